#ifndef ATTENTION_SERVER_ATTENTION_SERVICE_H_
#define ATTENTION_SERVER_ATTENTION_SERVICE_H_

#include <atomic>
#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attention/v1/service.grpc.pb.h"
#include "engine/engine.h"
#include "grpcpp/support/byte_buffer.h"
#include "server/memory_budget.h"
#include "server/metrics.h"
#include "server/model_repository.h"
#include "server/scheduler.h"
#include "server/security.h"
#include "server/session_store.h"

namespace attention::server {

struct ServiceOptions {
  int64_t max_message_bytes = 0;  // reported in GetServerInfo's limits
  int64_t max_queue = 0;
  // Batching defaults for raw attention and for models whose config sets none.
  int32_t max_batch_size = 1;
  int64_t max_queue_delay_us = 0;
  // Memory all calls in flight may hold at once (server/memory_budget.h); 0: no limit.
  int64_t memory_budget_bytes = 0;
  // Sessions (server/session_store.h): bytes all caches may hold (0: no
  // sessions), and seconds an idle one is kept (0: for good).
  int64_t session_memory_bytes = 0;
  int64_t session_idle_seconds = 0;
};

// Attend and AttendStream take and give raw bytes: requests are parsed by
// protobuf as usual, but answers are encoded by server/response_encoder.h,
// whose messages carry the engine's output buffers without a copy.
using AttentionServiceBase = v1::AttentionService::WithRawCallbackMethod_Attend<
    v1::AttentionService::WithRawCallbackMethod_AttendStream<
        v1::AttentionService::WithCallbackMethod_GetServerInfo<
            v1::AttentionService::WithCallbackMethod_ListModels<
                v1::AttentionService::WithCallbackMethod_GetModel<
                    v1::AttentionService::WithCallbackMethod_CloseSessions<
                        v1::AttentionService::WithCallbackMethod_GetSession<
                            v1::AttentionService::Service>>>>>>>;

// attention.v1.AttentionService on gRPC's callback API: converts requests
// (server/convert.h) and hands them to the scheduler, which batches them
// onto the engine; gRPC's threads never wait for compute. Thread-safe.
class AttentionServiceImpl final : public AttentionServiceBase {
 public:
  // Every pointer must outlive the service; `auth` may be null (no auth).
  // Each call is counted in `metrics`; calls failing `auth` get UNAUTHENTICATED.
  AttentionServiceImpl(const Engine* engine, const ModelRepository* models, Scheduler* scheduler,
                       Metrics* metrics, const TokenAuth* auth, const ServiceOptions& options);

  AttentionServiceImpl(const AttentionServiceImpl&) = delete;
  AttentionServiceImpl& operator=(const AttentionServiceImpl&) = delete;

  // With `model` set, runs that registered layer (NOT_FOUND when unknown).
  // DEADLINE_EXCEEDED / CANCELLED when the call is over before compute starts;
  // otherwise the conversion's and the engine's errors.
  // `request` and `response` are a serialized AttendRequest and AttendResponse.
  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  // Each request becomes a job like Attend's; answers carry the request's id
  // and come in completion order; a bad request is answered with its status
  // and the stream goes on. At most kMaxStreamInFlight requests per stream are
  // unanswered at once: past that the server stops reading, so a caller that
  // stops reading cannot make it buffer without bound. Once the server drains
  // (StartDraining), a stream answers what it has taken and ends UNAVAILABLE.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttendStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const v1::GetServerInfoRequest* request,
                                          v1::ServerInfo* response) override;
  // Every registered model's config, sorted by name.
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const v1::ListModelsRequest* request,
                                       v1::ListModelsResponse* response) override;
  // NOT_FOUND for a name that is not registered.
  grpc::ServerUnaryReactor* GetModel(grpc::CallbackServerContext* context,
                                     const v1::GetModelRequest* request,
                                     v1::GetModelResponse* response) override;

  // Closes sessions once no request holds them; OK, listing the ids that
  // were not open.
  grpc::ServerUnaryReactor* CloseSessions(grpc::CallbackServerContext* context,
                                          const v1::CloseSessionsRequest* request,
                                          v1::CloseSessionsResponse* response) override;
  // NOT_FOUND naming the id when it is not open.
  grpc::ServerUnaryReactor* GetSession(grpc::CallbackServerContext* context,
                                       const v1::GetSessionRequest* request,
                                       v1::SessionInfo* response) override;

  const SessionStore& sessions() const { return sessions_; }

  // The name this replica gives itself in the metadata of every answer
  // ("attention-replica", kReplicaHeader; NameReplica), so that callers
  // behind a proxy see which replica served them. Set once, when the port is
  // known; answers before that carry none.
  void SetReplica(std::string name);

  // The first step of a drain: from now on every new call, and every new
  // request on an open stream, is answered UNAVAILABLE, except a request on
  // open sessions (or GetSession), answered NOT_FOUND: the sessions end with
  // this replica, and their callers recreate them on another. Calls taken
  // before go on; open streams end once their requests in flight are
  // answered. Health and the connections are the caller's (AttentionServer).
  void StartDraining();
  // Calls, and requests on streams, taken and not yet over: the last byte of
  // their answer has not yet been handed to the connection's socket.
  int64_t open_calls() const { return open_calls_.load(); }
  // When the last of them ended; InfinitePast() if none has.
  absl::Time last_call_end() const;

 private:
  class StreamReactor;
  class UnaryReactor;
  static constexpr int kMaxStreamInFlight = 32;

  absl::StatusOr<const Model*> FindModel(absl::string_view name) const;
  // Records a finished call of `method` in the metrics (and the debug log),
  // and whether `status` refused it for a per-request limit.
  void Record(absl::string_view method, absl::string_view model, const absl::Status& status,
              absl::Time start, const JobTiming* timing) const;
  // Whether a new call is taken: UNAVAILABLE once draining, UNAUTHENTICATED
  // unless it carries the bearer token (when auth is on).
  absl::Status Admit(const grpc::CallbackServerContext& context) const;
  // The bearer token check alone (Attend checks the drain once it has parsed
  // the request).
  absl::Status Authenticate(const grpc::CallbackServerContext& context) const;
  // Adds the replica's name to the call's initial metadata once `admitted`
  // (the call is taken), else to its trailing metadata: a refused call then
  // sends no header before its status (a Trailers-Only answer), which a
  // client's retry policy may retry; gRPC retries no call once headers came.
  void NameReplica(grpc::CallbackServerContext* context, const absl::Status& admitted) const;
  // Finishes a unary call with `status` and records it.
  grpc::ServerUnaryReactor* FinishUnary(grpc::ServerUnaryReactor* reactor, absl::string_view method,
                                        absl::string_view model, absl::Time start,
                                        const absl::Status& status) const;
  // Open streams, which StartDraining tells to end.
  void AddStream(StreamReactor* stream);
  void RemoveStream(StreamReactor* stream);
  // Counts a call (or stream request) open / `n` of them over.
  void CallOpened() const { open_calls_.fetch_add(1); }
  void CallsEnded(int64_t n) const;
  // The refusal of new calls, and stream requests, once draining: NOT_FOUND
  // naming the first session of a `request` on open sessions (not create),
  // UNAVAILABLE for anything else.
  static absl::Status DrainingError(const v1::AttendRequest* request = nullptr);
  // RESOURCE_EXHAUSTED, with the numbers, when the answer of a call of `cost`
  // would exceed the largest message the server sends: refused before
  // compute rather than computed and then not sent.
  absl::Status CheckAnswerSize(const CallCost& cost, v1::Tensor::DType output_dtype) const;
  // Validates and converts `request`, which came as `wire_bytes` bytes, into a
  // job whose `done` is still unset, and reserves in `lease` the memory the
  // call will hold until it is answered (RESOURCE_EXHAUSTED past the budget);
  // for a session request, its request's bytes while it waits for its
  // sessions, and Submit the rest over its sessions' rows.
  absl::StatusOr<Job> MakeJob(const grpc::CallbackServerContext& context,
                              const v1::AttendRequest& request, size_t wire_bytes,
                              MemoryBudget::Lease* lease);
  // RESOURCE_EXHAUSTED, with the numbers, when the answer of a call of
  // `cost` is too large (CheckAnswerSize) or the memory it holds until
  // answered, with its request's `wire_bytes`, would pass the budget;
  // otherwise reserves that memory in `lease`.
  absl::Status ReserveMemory(const CallCost& cost, v1::Tensor::DType output_dtype,
                             size_t wire_bytes, MemoryBudget::Lease* lease);
  // A session request's state from admission to its answer.
  struct SessionState {
    SessionRequest request;
    std::vector<KvCache*> caches;  // once begun
    bool begun = false;
    // Its request's bytes as received and the lease its memory is reserved
    // in, once its cost over its sessions' rows is known (the caller's,
    // which outlives the request).
    struct {
      size_t wire_bytes = 0;
      MemoryBudget::Lease* lease = nullptr;
    } memory;
  };
  // Hands `job` to the scheduler: at once without sessions; with them, once
  // its sessions are free (SessionStore::Acquire) and checked (Begin). An
  // error before that is returned (the job's `done` is then never called);
  // one after, given to `done`.
  absl::Status Submit(Job job, const v1::AttendRequest& request,
                      const std::shared_ptr<SessionState>& session);
  // The answer's session_positions, and the sessions' end: committed when
  // `ok` (the answer is encoded), dropped otherwise. Nothing for a request
  // without sessions.
  void FinishSessions(const std::shared_ptr<SessionState>& session, bool ok);

  const Engine* const engine_;
  const ModelRepository* const models_;
  Scheduler* const scheduler_;
  Metrics* const metrics_;
  const TokenAuth* const auth_;
  const ServiceOptions options_;
  MemoryBudget memory_;
  SessionStore sessions_;
  std::atomic<bool> draining_{false};
  // SetReplica's name: owned by replica_owner_, published once.
  std::unique_ptr<const std::string> replica_owner_;
  std::atomic<const std::string*> replica_{nullptr};
  absl::Mutex streams_mu_;
  absl::flat_hash_set<StreamReactor*> streams_ ABSL_GUARDED_BY(streams_mu_);
  mutable std::atomic<int64_t> open_calls_{0};
  // absl::ToUnixNanos of last_call_end(); INT64_MIN before the first.
  mutable std::atomic<int64_t> last_call_end_ns_{INT64_MIN};
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_ATTENTION_SERVICE_H_
