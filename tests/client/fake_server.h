#ifndef ATTENTION_TESTS_CLIENT_FAKE_SERVER_H_
#define ATTENTION_TESTS_CLIENT_FAKE_SERVER_H_

// An in-process stand-in for the attention server on 127.0.0.1:0, so client
// tests need neither the engine nor a fixed port.

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attention/v1/service.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/server.h"
#include "grpcpp/support/status.h"

namespace attention::testing {

// Attend answers by request id:
//   "fail":  INVALID_ARGUMENT "mask.valid_lens: shape [3] does not match batch size 2"
//   "hang":  blocks until the call is cancelled or its deadline passes
//   other:   output = the query's elements re-encoded as output_dtype, shape
//            kept; with need_weights, weights = [1, 1] holding 0.5 as FLOAT16;
//            queue_us 3, compute_us 7, batch_size 1.
// A request with a session (AttendRequest.session) is checked and applied to
// an in-memory model of the server's sessions first: ids and positions one
// per batch row; create (positions 0) ALREADY_EXISTS for an open id; other
// requests NOT_FOUND for an id not open and ABORTED on a position mismatch;
// read_only with key or value INVALID_ARGUMENT. Any error changes no session.
// Each session then gets the key rows (the query's without a key) along the
// sequence dim, keeps a batch-1 request's key elements, and the answer carries
// session_positions; close closes them after answering. CloseSessions and
// GetSession answer from the same model (GetSession's bytes: position x
// kv_heads x (head_dim + value_dim) x the cache dtype's size; idle_ms 1, or 0
// while ReportHeld lasts;
// last_step_id the step_id of the last request that appended, unless
// set_report_step_ids(false), as a server from before it).
// AttendStream answers each message as Attend would, with its id and status
// (a "fail" message gets status code 3; the id "hang" is not special there,
// HangCall is: the stream hangs).
// ListModels and GetModel know one model, "demo": embed_dim 8, 2 heads.
// Health answers the status set with set_health(); service "missing" gets
// NOT_FOUND. Thread-safe.
class FakeAttentionServer {
 public:
  // Starts serving; fails the current test if it cannot. With
  // max_connection_age, connections older than that are sent GOAWAY (their
  // calls get 30 s more), as the real server's --max_connection_age_seconds.
  // With max_concurrent_streams, a connection carries at most that many calls
  // at once, as the real server's --max_concurrent_streams.
  explicit FakeAttentionServer(absl::Duration max_connection_age = absl::ZeroDuration(),
                               int max_concurrent_streams = 0);
  ~FakeAttentionServer();

  FakeAttentionServer(const FakeAttentionServer&) = delete;
  FakeAttentionServer& operator=(const FakeAttentionServer&) = delete;

  // "127.0.0.1:<port>".
  std::string address() const { return address_; }

  void set_health(grpc::health::v1::HealthCheckResponse::ServingStatus status);
  // Attend calls and AttendStreams send "attention-replica: NAME" from now on
  // (none while it is empty, as at the start).
  void set_replica(std::string name);
  // Whether GetSession reports last_step_id (it does at the start).
  void set_report_step_ids(bool report);
  // The next `count` GetSession calls answer idle_ms 0, as while another
  // client's request holds the session.
  void ReportHeld(int64_t count);
  // The "authorization" metadata of the latest call, "" when it had none.
  std::string last_authorization() const;
  // The "attention-affinity" metadata of the latest call, "" when it had none.
  std::string last_affinity() const;
  // The service name of the latest health check.
  std::string last_health_service() const;
  // Attend calls and AttendStream messages received so far.
  int64_t attend_calls() const;
  // AttendStream calls opened so far.
  int64_t attend_streams() const;
  // How many client addresses (TCP connections) have sent them.
  size_t distinct_peers() const;
  // The call-th of them (1-based) stalls the server for `stall`: it, and every
  // one arriving meanwhile, is answered only when the stall is over.
  void StallCall(int64_t call, absl::Duration stall);
  // The call-th of them (1-based) hangs as a "hang" call does.
  void HangCall(int64_t call);
  // The call-th of them (1-based) fails with `code` and the message
  // "injected failure of call N", changing nothing.
  void FailCall(int64_t call, grpc::StatusCode code);
  // The call-th of them (1-based) is applied as usual, then its answer is
  // lost: it fails with `code` and the message "injected loss of the answer
  // to call N" (a stream message's stream ends so), as when a deadline
  // passes or a connection fails after the server applied it.
  void LoseAnswerOfCall(int64_t call, grpc::StatusCode code);
  // The call-th of them (1-based) and the count - 1 after it, when they are
  // stream messages, are not answered: each one's stream ends with `code` and
  // the message "injected end of the stream at call N", changing nothing (as
  // a draining server ends its streams UNAVAILABLE). Unary calls are answered
  // as usual.
  void EndStreamAtCall(int64_t call, grpc::StatusCode code, int64_t count = 1);

  // The next `count` CloseSessions calls fail with `code`, closing nothing.
  void FailCloses(int64_t count, grpc::StatusCode code);
  // Every session open when the next CloseSessions call comes is forgotten
  // just before it is handled, as if it had expired.
  void DropSessionsAtNextClose();

  // Sessions open now.
  int64_t open_sessions() const;
  // Sessions closed by CloseSessions or a request's close.
  int64_t closed_sessions() const;
  // The "attention-affinity" of each CloseSessions call, in order.
  std::vector<std::string> close_affinities() const;
  // The elements of every key row session `id` was given by batch-1
  // requests, in order; empty when it is not open.
  std::vector<float> session_keys(const std::string& id) const;
  // Forgets every open session, as a server restart or eviction would; with
  // DropSessionsAtCall, just before the call-th Attend call (1-based) is
  // handled.
  void DropSessions();
  void DropSessionsAtCall(int64_t call);
  // Just before the call-th Attend call, every open session holds only its
  // first `rows` rows: a stale copy, as a replica keeps one while the
  // session lives elsewhere.
  void RewindSessionsAtCall(int64_t call, int64_t rows);
  // Just before the call-th Attend call, another client creates session `id`
  // with `rows` rows (step_id "another client's"), as one may between a
  // client's NOT_FOUND and its recreation.
  void TakeSessionAtCall(int64_t call, std::string id, int64_t rows);

 private:
  class AttentionImpl;
  class HealthImpl;
  struct FakeSession {
    std::string model;
    int32_t heads = 0;
    int32_t kv_heads = 0;
    int32_t head_dim = 0;
    int32_t value_dim = 0;
    v1::Tensor::DType cache_dtype = v1::Tensor::FLOAT32;
    int64_t position = 0;
    std::vector<float> keys;
    std::string last_step_id;
  };
  struct State {
    mutable absl::Mutex mu;
    grpc::health::v1::HealthCheckResponse::ServingStatus health ABSL_GUARDED_BY(mu) =
        grpc::health::v1::HealthCheckResponse::SERVING;
    std::string authorization ABSL_GUARDED_BY(mu);
    std::string affinity ABSL_GUARDED_BY(mu);
    std::vector<std::string> close_affinities ABSL_GUARDED_BY(mu);
    std::string health_service ABSL_GUARDED_BY(mu);
    std::string replica ABSL_GUARDED_BY(mu);
    bool report_step_ids ABSL_GUARDED_BY(mu) = true;
    int64_t report_held ABSL_GUARDED_BY(mu) = 0;
    int64_t attend_calls ABSL_GUARDED_BY(mu) = 0;
    int64_t attend_streams ABSL_GUARDED_BY(mu) = 0;
    std::set<std::string> peers ABSL_GUARDED_BY(mu);
    int64_t stall_call ABSL_GUARDED_BY(mu) = 0;
    int64_t hang_call ABSL_GUARDED_BY(mu) = 0;
    int64_t fail_call ABSL_GUARDED_BY(mu) = 0;
    grpc::StatusCode fail_code ABSL_GUARDED_BY(mu) = grpc::StatusCode::OK;
    int64_t lose_call ABSL_GUARDED_BY(mu) = 0;
    grpc::StatusCode lose_code ABSL_GUARDED_BY(mu) = grpc::StatusCode::OK;
    int64_t end_stream_call ABSL_GUARDED_BY(mu) = 0;
    grpc::StatusCode end_stream_code ABSL_GUARDED_BY(mu) = grpc::StatusCode::OK;
    int64_t end_stream_count ABSL_GUARDED_BY(mu) = 0;
    absl::Duration stall ABSL_GUARDED_BY(mu);
    absl::Time stalled_until ABSL_GUARDED_BY(mu) = absl::InfinitePast();
    std::map<std::string, FakeSession> sessions ABSL_GUARDED_BY(mu);
    int64_t closed_sessions ABSL_GUARDED_BY(mu) = 0;
    int64_t fail_closes ABSL_GUARDED_BY(mu) = 0;
    bool drop_at_close ABSL_GUARDED_BY(mu) = false;
    grpc::StatusCode fail_closes_code ABSL_GUARDED_BY(mu) = grpc::StatusCode::OK;
    int64_t drop_call ABSL_GUARDED_BY(mu) = 0;
    int64_t rewind_call ABSL_GUARDED_BY(mu) = 0;
    int64_t rewind_rows ABSL_GUARDED_BY(mu) = 0;
    int64_t take_call ABSL_GUARDED_BY(mu) = 0;
    std::string take_id ABSL_GUARDED_BY(mu);
    int64_t take_rows ABSL_GUARDED_BY(mu) = 0;
  };

  State state_;
  std::unique_ptr<AttentionImpl> attention_;
  std::unique_ptr<HealthImpl> health_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_CLIENT_FAKE_SERVER_H_
