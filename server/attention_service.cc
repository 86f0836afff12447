#include "server/attention_service.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <deque>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/metadata.h"
#include "common/status_macros.h"
#include "server/convert.h"
#include "server/response_encoder.h"
#include "spdlog/spdlog.h"

#ifndef ATTENTION_VERSION
#error "ATTENTION_VERSION must be defined by the build"
#endif

namespace attention::server {
namespace {

// Calls up to this much work (tens of microseconds on one core) compute on the gRPC
// thread that received them when an engine thread is free (Job::inline_when_idle):
// for them the hand-offs to the scheduler's thread and back cost more than
// the math, and a gRPC thread is never held for long.
constexpr double kInlineMaxFlops = 1e6;

// The `model` label of calls naming a model that is not registered.
constexpr absl::string_view kUnknownModelLabel = "(unknown)";

// Frees `request`'s tensors, which its job no longer reads once computed:
// before its answer is sent, so that a large call does not hold both.
void DropTensors(v1::AttendRequest& request) {
  request.clear_query();
  request.clear_key();
  request.clear_value();
  request.clear_score();
  request.clear_mask();
}

// Every field of the answer to `request` but its tensors: with sessions,
// the rows each holds once this request's are committed.
template <typename SessionState>
v1::AttendResponse ResponseHead(const v1::AttendRequest& request, const JobTiming& timing,
                                const SessionState* session) {
  v1::AttendResponse head;
  if (session != nullptr) {
    for (const KvCache* cache : session->caches) {
      head.add_session_positions(cache->length() + cache->pending());
    }
  }
  head.set_id(request.id());
  head.set_queue_us(timing.queue_us);
  head.set_compute_us(timing.compute_us);
  head.set_batch_size(timing.batch_size);
  return head;
}

}  // namespace

AttentionServiceImpl::AttentionServiceImpl(const Engine* engine, const ModelRepository* models,
                                           Scheduler* scheduler, Metrics* metrics,
                                           const TokenAuth* auth, const ServiceOptions& options)
    : engine_(engine),
      models_(models),
      scheduler_(scheduler),
      metrics_(metrics),
      auth_(auth),
      options_(options),
      memory_(options.memory_budget_bytes,
              [metrics](int64_t reserved) { metrics->SetMemoryReserved(reserved); }),
      sessions_({options.session_memory_bytes,
                 options.session_idle_seconds > 0 ? absl::Seconds(options.session_idle_seconds)
                                                  : absl::InfiniteDuration(),
                 /*sweep_every=*/absl::Seconds(1), SessionStore::kSessionBookkeepingBytes},
                metrics) {}

// A unary call's reactor: counts the call open from its start until gRPC is
// done with it (its answer's last byte handed to the socket). Deletes itself.
class AttentionServiceImpl::UnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit UnaryReactor(const AttentionServiceImpl* service) : service_(service) {
    service_->CallOpened();
  }
  void OnDone() override {
    service_->CallsEnded(1);
    delete this;
  }
  // Memory the call holds until gRPC is done with its answer.
  MemoryBudget::Lease& lease() { return lease_; }

 private:
  const AttentionServiceImpl* const service_;
  MemoryBudget::Lease lease_;
};

void AttentionServiceImpl::AddStream(StreamReactor* stream) {
  absl::MutexLock lock(&streams_mu_);
  streams_.insert(stream);
}

void AttentionServiceImpl::RemoveStream(StreamReactor* stream) {
  absl::MutexLock lock(&streams_mu_);
  streams_.erase(stream);
}

absl::Time AttentionServiceImpl::last_call_end() const {
  const int64_t ns = last_call_end_ns_.load();
  return ns == INT64_MIN ? absl::InfinitePast() : absl::FromUnixNanos(ns);
}

void AttentionServiceImpl::CallsEnded(int64_t n) const {
  if (n == 0) return;
  last_call_end_ns_.store(absl::ToUnixNanos(absl::Now()));
  open_calls_.fetch_sub(n);
}

absl::Status AttentionServiceImpl::DrainingError(const v1::AttendRequest* request) {
  if (request != nullptr && request->has_session() && !request->session().create() &&
      !request->session().ids().empty()) {
    return absl::NotFoundError(absl::StrCat(
        "session \"", request->session().ids(0),
        "\": this replica is shutting down and its sessions end with it; create the session "
        "again (another replica takes it)"));
  }
  return absl::UnavailableError(
      "the server is shutting down and takes no new calls; retry on another replica");
}

void AttentionServiceImpl::SetReplica(std::string name) {
  if (replica_.load() != nullptr) return;
  replica_owner_ = std::make_unique<const std::string>(std::move(name));
  replica_.store(replica_owner_.get());
}

void AttentionServiceImpl::NameReplica(grpc::CallbackServerContext* context,
                                       const absl::Status& admitted) const {
  const std::string* name = replica_.load();
  if (name == nullptr || name->empty()) return;
  if (admitted.ok()) {
    context->AddInitialMetadata(kReplicaHeader, *name);
  } else {
    context->AddTrailingMetadata(kReplicaHeader, *name);
  }
}

void AttentionServiceImpl::Record(absl::string_view method, absl::string_view model,
                                  const absl::Status& status, absl::Time start,
                                  const JobTiming* timing) const {
  const double total = absl::ToDoubleSeconds(absl::Now() - start);
  // The label names a registered model, never whatever a caller sent: each
  // made-up name would otherwise add a series, and memory, for good.
  const absl::string_view label =
      model.empty() || models_->Find(model) != nullptr ? model : kUnknownModelLabel;
  metrics_->CountRequest(method, label, static_cast<int>(status.code()));
  if (const std::string limit = RequestOverLimit(status); !limit.empty()) {
    metrics_->CountOverLimit(method, limit);
  }
  metrics_->ObserveSeconds("total", method, total);
  if (timing != nullptr && timing->queued) {
    metrics_->ObserveSeconds("queue", method, timing->queue_us * 1e-6);
  }
  if (timing != nullptr && timing->computed) {
    metrics_->ObserveSeconds("compute", method, timing->compute_us * 1e-6);
  }
  if (!spdlog::should_log(spdlog::level::debug)) return;
  spdlog::debug("{} model={} code={} total_us={} queue_us={} compute_us={} batch={}{}{}",
                std::string(method), model.empty() ? "-" : std::string(model),
                static_cast<int>(status.code()), static_cast<int64_t>(total * 1e6),
                timing ? timing->queue_us : 0, timing ? timing->compute_us : 0,
                timing ? timing->batch_size : 0,
                status.ok() ? "" : " error=", std::string(status.message()));
}

absl::Status AttentionServiceImpl::Admit(const grpc::CallbackServerContext& context) const {
  if (draining_.load()) return DrainingError();
  return Authenticate(context);
}

absl::Status AttentionServiceImpl::Authenticate(const grpc::CallbackServerContext& context) const {
  return auth_ == nullptr ? absl::OkStatus() : auth_->Check(context);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::FinishUnary(grpc::ServerUnaryReactor* reactor,
                                                            absl::string_view method,
                                                            absl::string_view model,
                                                            absl::Time start,
                                                            const absl::Status& status) const {
  Record(method, model, status, start, nullptr);
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

absl::StatusOr<const Model*> AttentionServiceImpl::FindModel(absl::string_view name) const {
  const Model* model = models_->Find(name);
  if (model == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("model: \"", name, "\" is not registered (ListModels shows what is)"));
  }
  return model;
}

namespace {

// Room for an answer's fields other than its tensors.
constexpr double kAnswerHeadBytes = 4096;

// Bytes per element of a tensor in `dtype` on the wire (numbered as the engine's).
double WireElementBytes(v1::Tensor::DType dtype) {
  return static_cast<double>(DTypeSize(static_cast<DType>(dtype)));
}

double AnswerBytes(const CallCost& cost, v1::Tensor::DType output_dtype) {
  return (cost.output_elements + cost.weights_elements) * WireElementBytes(output_dtype) +
         kAnswerHeadBytes;
}

}  // namespace

absl::Status AttentionServiceImpl::CheckAnswerSize(const CallCost& cost,
                                                   v1::Tensor::DType output_dtype) const {
  const double output = cost.output_elements * WireElementBytes(output_dtype);
  const double weights = cost.weights_elements * WireElementBytes(output_dtype);
  const double answer = AnswerBytes(cost, output_dtype);
  if (answer <= static_cast<double>(options_.max_message_bytes)) return absl::OkStatus();
  return OverLimitError(
      "max_message_mb",
      absl::StrCat(
          "answer: ", static_cast<int64_t>(answer), " bytes (output ", static_cast<int64_t>(output),
          ", weights ", static_cast<int64_t>(weights), ", and ",
          static_cast<int64_t>(kAnswerHeadBytes),
          " kept for its other fields) would exceed the largest message the server sends, ",
          options_.max_message_bytes, " bytes (--max_message_mb)",
          weights > 0 ? "; ask without need_weights" : ""));
}

absl::Status AttentionServiceImpl::ReserveMemory(const CallCost& cost,
                                                 v1::Tensor::DType output_dtype,
                                                 size_t wire_bytes,
                                                 MemoryBudget::Lease* lease) {
  ATTN_RETURN_IF_ERROR(CheckAnswerSize(cost, output_dtype));
  // Held until answered: the parsed request (its bytes as received were freed
  // as they were parsed), the engine's allocations, and the encoded answer
  // (FLOAT32 tensors go out in the engine's own buffers; 16-bit ones are new).
  const double held =
      static_cast<double>(wire_bytes) + cost.bytes() +
      (output_dtype == v1::Tensor::FLOAT32 ? kAnswerHeadBytes : AnswerBytes(cost, output_dtype));
  ATTN_ASSIGN_OR_RETURN(
      *lease,
      memory_.Reserve(static_cast<int64_t>(std::min(held, static_cast<double>(INT64_MAX / 2)))));
  return absl::OkStatus();
}

absl::StatusOr<Job> AttentionServiceImpl::MakeJob(const grpc::CallbackServerContext& context,
                                                  const v1::AttendRequest& request,
                                                  size_t wire_bytes, MemoryBudget::Lease* lease) {
  // A caller gone before its request was even admitted is work not done, the
  // same as one the scheduler drops from its queue. The deadline first, as
  // there: gRPC also cancels a call whose deadline passed.
  if (context.deadline() <= std::chrono::system_clock::now()) {
    metrics_->CountNotComputed("deadline_exceeded");
    return absl::DeadlineExceededError("deadline passed before compute started");
  }
  if (context.IsCancelled()) {
    metrics_->CountNotComputed("cancelled");
    return absl::CancelledError("call cancelled before compute started");
  }
  Job job;
  if (!request.model().empty()) {
    ATTN_ASSIGN_OR_RETURN(job.model, FindModel(request.model()));
  }
  ATTN_ASSIGN_OR_RETURN(job.request, OutOfMemoryAsStatus("request conversion",
                                                         [&] { return ToEngineRequest(request); }));
  AttentionArgs& args = job.request->args;
  // Refused before admission: a bad request takes no queue slot. A session
  // request's cost, answer and memory depend on its sessions' rows: they are
  // checked once it holds them (Submit). Until then its shapes are checked
  // as the stateless call's (whose keys are its new rows), or, read-only
  // (no rows of its own, keys of the session's dims), its query's rank.
  if (request.has_session() && request.session().read_only()) {
    const int64_t rank = static_cast<int64_t>(args.query.shape.size());
    if (rank != 3 && rank != 4) {
      return absl::InvalidArgumentError(absl::StrCat(
          "query: rank ", rank, "; a session request's query is rank 3 or 4 (",
          job.model ? "a model layer's: rank 3" : "rank 4 with grouped-query heads", ")"));
    }
  } else {
    ATTN_ASSIGN_OR_RETURN(
        const CallCost cost, OutOfMemoryAsStatus("request validation", [&] {
          return engine_->CostOf({&args, job.model ? job.model->layer.get() : nullptr});
        }));
    if (!request.has_session()) {
      ATTN_RETURN_IF_ERROR(ReserveMemory(cost, job.request->output_dtype, wire_bytes, lease));
      job.flops = cost.flops;
      job.inline_when_idle = cost.flops <= kInlineMaxFlops;
    }
  }
  if (request.has_session()) {
    // What it holds while it waits for its sessions: its parsed request.
    ATTN_ASSIGN_OR_RETURN(*lease, memory_.Reserve(static_cast<int64_t>(wire_bytes)));
  }
  job.max_batch_size = options_.max_batch_size;
  job.max_queue_delay = absl::Microseconds(options_.max_queue_delay_us);
  if (job.model != nullptr) {
    const v1::ModelConfig& config = job.model->config;
    if (config.precision() == v1::AttendRequest::FAST) args.fast = true;
    if (config.batching().max_batch_size() > 0) {
      job.max_batch_size = config.batching().max_batch_size();
    }
    if (config.batching().has_max_queue_delay_us()) {
      job.max_queue_delay = absl::Microseconds(config.batching().max_queue_delay_us());
    }
    job.batch_key = absl::StrCat("model/", config.name());
  } else {
    // Raw calls batch with calls of the same head split.
    job.batch_key = absl::StrCat("raw/", args.num_heads, "/",
                                 args.query.shape.empty() ? 0 : args.query.shape.back());
  }
  job.deadline = absl::FromChrono(context.deadline());
  return job;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request_bytes,
                                                       grpc::ByteBuffer* response) {
  const absl::Time start = absl::Now();
  // Even a refused call received its request's bytes: the trimmer must know.
  metrics_->NoteCallArrived();
  UnaryReactor* reactor = new UnaryReactor(this);
  // Shared with the job's `done`, which outlives this call: the job's views
  // point into it.
  auto request = std::make_shared<v1::AttendRequest>();
  const size_t wire_bytes = request_bytes->Length();
  absl::Status admitted = Authenticate(*context);
  // The message's bytes are freed as they are parsed: gRPC hands them over
  // (const only by the method's signature) and reads them no more.
  if (admitted.ok()) {
    admitted = ParseAndReleaseMessage(const_cast<grpc::ByteBuffer*>(request_bytes), request.get());
    // No bytes at all parse as an empty message. gRPC calls the method with
    // a buffer that does not when the call ended before its request had
    // arrived whole (its deadline passed, or its caller cancelled, during the
    // upload). Not the caller's mistake: counted as a call dropped before
    // compute, by why it ended.
    if (!admitted.ok() && wire_bytes == 0) {
      const char* reason = CallOverReason(absl::FromChrono(context->deadline()), absl::Now());
      metrics_->CountNotComputed(reason);
      admitted = absl::string_view(reason) == "cancelled"
                     ? absl::CancelledError("the caller cancelled before its request had arrived")
                     : absl::DeadlineExceededError(
                           "the call's deadline passed before its request had arrived");
    }
  }
  // Parsed first, so that a request on sessions learns they are gone.
  if (admitted.ok() && draining_.load()) admitted = DrainingError(request.get());
  NameReplica(context, admitted);
  absl::StatusOr<Job> job =
      admitted.ok() ? MakeJob(*context, *request, wire_bytes, &reactor->lease()) : admitted;
  if (!job.ok()) return FinishUnary(reactor, "Attend", request->model(), start, job.status());
  metrics_->AddInFlight(1);
  job->cancelled = [context] { return context->IsCancelled(); };
  const v1::Tensor::DType output_dtype = job->request->output_dtype;
  auto session = request->has_session() ? std::make_shared<SessionState>() : nullptr;
  if (session != nullptr) session->memory = {wire_bytes, &reactor->lease()};
  job->done = [this, request, response, reactor, output_dtype, start, session](
                  absl::StatusOr<AttentionResult> result, const JobTiming& timing) {
    absl::Status status = result.status();
    if (status.ok()) {
      absl::StatusOr<grpc::ByteBuffer> encoded =
          EncodeResponse(ResponseHead(*request, timing, session.get()), *std::move(result),
                         request->need_weights(), output_dtype);
      if (encoded.ok()) {
        response->Swap(&*encoded);
      } else {
        status = encoded.status();
      }
    }
    FinishSessions(session, status.ok());
    DropTensors(*request);
    Record("Attend", request->model(), status, start, &timing);
    metrics_->AddInFlight(-1);
    reactor->Finish(ToGrpcStatus(status));
  };
  if (absl::Status queued = Submit(*std::move(job), *request, session); !queued.ok()) {
    metrics_->AddInFlight(-1);
    return FinishUnary(reactor, "Attend", request->model(), start, queued);
  }
  return reactor;
}

// One AttendStream call. Reads, job completions and writes arrive on
// different threads; mu_ orders them. Deletes itself in OnDone.
class AttentionServiceImpl::StreamReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  StreamReactor(AttentionServiceImpl* service, grpc::CallbackServerContext* context)
      : service_(service), context_(context) {
    const absl::Time start = absl::Now();
    service_->metrics_->NoteCallArrived();
    // Registered before the drain check: a drain that starts meanwhile either
    // finds this stream registered or is seen by the check.
    service_->AddStream(this);
    absl::MutexLock lock(&mu_);
    const absl::Status admitted = service_->Admit(*context);
    service_->NameReplica(context, admitted);
    if (!admitted.ok()) {
      // Counted as one AttendStream call, as a refused Attend is.
      service_->Record("AttendStream", "", admitted, start, nullptr);
      finished_ = true;
      Finish(ToGrpcStatus(admitted));
      return;
    }
    ReadNextLocked();
  }

  // The server is draining: once the requests in flight are answered, the
  // stream ends UNAVAILABLE (OK if the caller had half-closed), so that its
  // caller moves to another replica now rather than when the drain times out.
  void Drain() {
    absl::MutexLock lock(&mu_);
    MaybeFinishLocked();
  }

  void OnReadDone(bool ok) override {
    // Shared with the job's `done`: the job's views point into it.
    auto request = std::make_shared<v1::AttendRequest>();
    grpc::ByteBuffer bytes;
    {
      absl::MutexLock lock(&mu_);
      reading_ = false;
      if (!ok) {  // the caller half-closed, or the call is over
        reads_done_ = true;
        MaybeFinishLocked();
        return;
      }
      if (finished_) return;  // a read that completed as a drain finished the stream
      taking_ = true;
      ++in_flight_;
      service_->CallOpened();
      bytes.Swap(&next_);
    }
    // Unlocked from here: parsing a large message takes a while, during which
    // answers to this stream's earlier requests are written, and a small job
    // may compute, and answer, within Submit.
    const size_t wire_bytes = bytes.Length();
    absl::Status parsed = ParseAndReleaseMessage(&bytes, request.get());
    // Parsed first, so that the refusal carries the request's id.
    if (parsed.ok() && service_->draining_.load()) parsed = DrainingError(request.get());
    service_->metrics_->NoteCallArrived();
    service_->metrics_->AddInFlight(1);
    const absl::Time start = absl::Now();
    // Memory the request holds until its answer is written (or dropped).
    auto lease = std::make_shared<MemoryBudget::Lease>();
    absl::StatusOr<Job> job =
        parsed.ok() ? service_->MakeJob(*context_, *request, wire_bytes, lease.get()) : parsed;
    absl::Status refused;
    if (job.ok()) {
      const v1::Tensor::DType output_dtype = job->request->output_dtype;
      job->cancelled = [this] { return cancelled_.load(); };
      auto session = request->has_session() ? std::make_shared<SessionState>() : nullptr;
      if (session != nullptr) session->memory = {wire_bytes, lease.get()};
      job->done = [this, request, output_dtype, start, lease, session](
                      absl::StatusOr<AttentionResult> result, const JobTiming& timing) {
        absl::StatusOr<grpc::ByteBuffer> answer = absl::UnknownError("unset");
        if (result.ok()) {
          v1::AttendResponse head = ResponseHead(*request, timing, session.get());
          head.mutable_status()->set_code(0);
          answer = EncodeResponse(head, *std::move(result), request->need_weights(), output_dtype);
        } else {
          answer = result.status();
        }
        // The next request on these sessions, perhaps on this stream, starts
        // once this answer is queued (as `defer` ends, after `lock`), so that
        // the stream answers them in their sessions' order.
        const SessionStore::DeferStarts defer;
        service_->FinishSessions(session, answer.ok());
        DropTensors(*request);
        service_->Record("AttendStream", request->model(), answer.status(), start, &timing);
        absl::MutexLock lock(&mu_);
        AnswerLocked(*request, std::move(answer), std::move(*lease));
      };
      refused = service_->Submit(*std::move(job), *request, session);
    } else {
      refused = job.status();
    }
    absl::MutexLock lock(&mu_);
    if (!refused.ok()) {
      service_->Record("AttendStream", request->model(), refused, start, nullptr);
      AnswerLocked(*request, refused, {});
    }
    taking_ = false;
    if (!reading_ && !reads_done_ && !cancelled_ && !finished_ && in_flight_ < kMaxStreamInFlight) {
      ReadNextLocked();
    }
    MaybeFinishLocked();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    writes_.pop_front();
    --in_flight_;
    service_->CallsEnded(1);
    if (!ok) cancelled_ = true;
    if (cancelled_) DropWritesLocked();
    WriteNextLocked();
    if (!reading_ && !taking_ && !reads_done_ && !cancelled_ && !finished_ &&
        in_flight_ < kMaxStreamInFlight) {
      ReadNextLocked();
    }
    MaybeFinishLocked();
  }

  void OnCancel() override {
    cancelled_ = true;
    absl::MutexLock lock(&mu_);
    if (!writing_) DropWritesLocked();
    MaybeFinishLocked();
  }

  void OnDone() override {
    // gRPC calls OnDone after every other reaction has returned, but orders
    // them with its own atomics, which ThreadSanitizer cannot see (Debian's
    // gRPC is not instrumented): taking mu_ once makes the order visible to
    // it, as the other reactions touch the members under mu_.
    { absl::MutexLock lock(&mu_); }
    service_->RemoveStream(this);
    delete this;
  }

 private:
  void ReadNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    reading_ = true;
    StartRead(&next_);
  }

  // Queues the answer to `request`: the encoded response, or an answer
  // carrying the error.
  void AnswerLocked(const v1::AttendRequest& request, absl::StatusOr<grpc::ByteBuffer> answer,
                    MemoryBudget::Lease lease) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    service_->metrics_->AddInFlight(-1);
    if (cancelled_) {
      --in_flight_;
      service_->CallsEnded(1);
      MaybeFinishLocked();
      return;
    }
    if (!answer.ok()) {
      v1::AttendResponse response;
      response.set_id(request.id());
      const grpc::Status wire = ToGrpcStatus(answer.status());
      response.mutable_status()->set_code(wire.error_code());
      response.mutable_status()->set_message(wire.error_message());
      answer = SerializeMessage(response);
    }
    writes_.push_back({*std::move(answer), std::move(lease)});
    WriteNextLocked();
  }

  // The caller is gone: answers not yet written never will be.
  void DropWritesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    in_flight_ -= static_cast<int>(writes_.size());
    service_->CallsEnded(static_cast<int64_t>(writes_.size()));
    writes_.clear();
  }

  void WriteNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || writes_.empty() || cancelled_) return;
    writing_ = true;
    StartWrite(&writes_.front().bytes);
  }

  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || in_flight_ > 0 || writing_) return;
    if (!cancelled_ && !reads_done_ && service_->draining_.load()) {
      // A read may be pending: it completes, not ok, once the call is over.
      finished_ = true;
      Finish(ToGrpcStatus(DrainingError()));
      return;
    }
    if (reading_ || (!reads_done_ && !cancelled_)) return;
    finished_ = true;
    Finish(cancelled_ ? grpc::Status::CANCELLED : grpc::Status::OK);
  }

  AttentionServiceImpl* const service_;
  grpc::CallbackServerContext* const context_;
  std::atomic<bool> cancelled_{false};
  absl::Mutex mu_;
  grpc::ByteBuffer next_ ABSL_GUARDED_BY(mu_);  // being read
  struct Write {
    grpc::ByteBuffer bytes;
    MemoryBudget::Lease lease;  // of the request it answers
  };
  std::deque<Write> writes_ ABSL_GUARDED_BY(mu_);  // front is being written
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;         // read, not yet written (or dropped)
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  // A request read is being parsed and submitted (OnReadDone): the next is
  // read only after it, so that requests are taken in the order written and
  // a session's steps sent back to back apply in that order.
  bool taking_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

void AttentionServiceImpl::StartDraining() {
  draining_.store(true);
  absl::MutexLock lock(&streams_mu_);
  for (StreamReactor* stream : streams_) stream->Drain();
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttentionServiceImpl::AttendStream(
    grpc::CallbackServerContext* context) {
  return new StreamReactor(this, context);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetServerInfo(
    grpc::CallbackServerContext* context, const v1::GetServerInfoRequest* /*request*/,
    v1::ServerInfo* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = new UnaryReactor(this);
  const absl::Status admitted = Admit(*context);
  NameReplica(context, admitted);
  if (!admitted.ok()) return FinishUnary(reactor, "GetServerInfo", "", start, admitted);
  const EngineOptions& options = engine_->options();
  response->set_version(ATTENTION_VERSION);
  response->set_engine_backend(engine_->backend_name());
  response->set_engine_isa(engine_->isa());
  response->set_engine_threads(engine_->threads());
  if (const std::string* replica = replica_.load(); replica != nullptr) {
    response->set_replica(*replica);
  }
  v1::Limits* limits = response->mutable_limits();
  limits->set_max_message_bytes(options_.max_message_bytes);
  limits->set_max_tensor_elements(options.max_tensor_elements);
  limits->set_max_score_elements(options.max_score_elements);
  limits->set_max_queue(options_.max_queue);
  limits->set_max_request_bytes(options.max_request_bytes);
  limits->set_max_request_gflop(options.max_request_flops / 1e9);
  limits->set_memory_budget_bytes(memory_.limit());
  limits->set_session_memory_bytes(options_.session_memory_bytes);
  limits->set_session_idle_seconds(options_.session_idle_seconds);
  for (int kind = v1::Score::Kind_MIN; kind <= v1::Score::Kind_MAX; ++kind) {
    if (v1::Score::Kind_IsValid(kind)) {
      response->add_supported_scores(static_cast<v1::Score::Kind>(kind));
    }
  }
  for (int dtype = v1::Tensor::DType_MIN; dtype <= v1::Tensor::DType_MAX; ++dtype) {
    if (v1::Tensor::DType_IsValid(dtype)) {
      response->add_supported_dtypes(static_cast<v1::Tensor::DType>(dtype));
    }
  }
  return FinishUnary(reactor, "GetServerInfo", "", start, absl::OkStatus());
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(grpc::CallbackServerContext* context,
                                                           const v1::ListModelsRequest* /*request*/,
                                                           v1::ListModelsResponse* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = new UnaryReactor(this);
  absl::Status status = Admit(*context);
  NameReplica(context, status);
  if (status.ok()) {
    for (const Model* model : models_->models()) *response->add_models() = model->config;
  }
  return FinishUnary(reactor, "ListModels", "", start, status);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModel(grpc::CallbackServerContext* context,
                                                         const v1::GetModelRequest* request,
                                                         v1::GetModelResponse* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = new UnaryReactor(this);
  absl::Status status = Admit(*context);
  NameReplica(context, status);
  if (status.ok()) {
    absl::StatusOr<const Model*> model = FindModel(request->name());
    if (model.ok()) *response->mutable_config() = (*model)->config;
    status = model.status();
  }
  return FinishUnary(reactor, "GetModel", "", start, status);
}

namespace {

// The batch size of a validated call: one session per batch row.
int64_t BatchOf(const AttentionArgs& args) {
  const std::vector<int64_t>& q = args.query.shape;
  return q.size() == 4 || args.layout == Layout::kBatchFirst ? q[0] : q[1];
}

// The key/value rows a validated call appends to each of its sessions.
int64_t NewRows(const AttentionArgs& args, bool read_only) {
  if (read_only) return 0;
  const std::vector<int64_t>& k = (args.key.present() ? args.key : args.query).shape;
  if (k.size() == 4) return k[2];
  return args.layout == Layout::kBatchFirst ? k[1] : k[0];
}

// What a session of this validated call is fixed to, and its cache's shape.
// The shortest decimal that reads back as `x` ("0.125", "1.0000004"), so that
// two scales an error names alike are the same.
std::string Shortest(float x) {
  char text[32];
  const std::to_chars_result end = std::to_chars(text, text + sizeof text, x);
  return std::string(text, end.ptr);
}

SessionKind KindOf(const v1::AttendRequest& request, const AttentionArgs& args, const Model* model) {
  SessionKind kind;
  if (model != nullptr) {
    const MultiheadConfig& c = model->layer->config();
    kind.model = model->config.name();
    kind.description = absl::StrCat("model \"", kind.model, "\"");
    kind.heads = static_cast<int32_t>(c.num_heads);
    kind.kv_heads = c.num_heads;
    kind.key_dim = kind.value_dim = c.embed_dim / c.num_heads;
    return kind;
  }
  // A read-only request's keys are the session's: its kind comes from its
  // query alone (a key or value it sends, unchecked yet, the engine refuses).
  const bool own_rows = !request.session().read_only();
  const TensorView& q = args.query;
  const TensorView& k = own_rows && args.key.present() ? args.key : q;
  const TensorView& v = own_rows && args.value.present() ? args.value : k;
  int64_t query_dim = 0;
  if (q.shape.size() == 4) {
    kind.heads = static_cast<int32_t>(q.shape[1]);
    kind.heads_field = "query.shape[1]";
    kind.kv_heads = k.shape[1];
    kind.key_dim = k.shape[3];
    kind.value_dim = v.shape[3];
    query_dim = q.shape[3];
  } else {
    const int64_t heads = args.num_heads > 0 ? args.num_heads : 1;
    kind.heads = static_cast<int32_t>(heads);
    kind.heads_field = "num_heads";
    kind.kv_heads = heads;
    kind.key_dim = k.shape[2] / heads;
    kind.value_dim = v.shape[2] / heads;
    query_dim = q.shape[2] / heads;
  }
  kind.query_dim = query_dim;
  // The scale in effect: left out, SCALED_DOT's is 1/sqrt(query head dim)
  // (as the engine's), the others' 1; a step naming the same scale is the
  // same kind.
  const v1::Score& score = request.score();
  const double scale = score.has_scale() ? score.scale()
                       : score.kind() == v1::Score::SCALED_DOT
                           ? 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(query_dim, 1)))
                           : 1.0;
  kind.score_kind = score.kind();
  kind.score_scale = static_cast<float>(scale);
  kind.score =
      absl::StrCat(v1::Score::Kind_Name(score.kind()), " scale ", Shortest(kind.score_scale));
  if (score.kind() == v1::Score::GAUSSIAN) {
    kind.score_bandwidth = static_cast<float>(score.has_bandwidth() ? score.bandwidth() : 1.0);
    absl::StrAppend(&kind.score, " bandwidth ", Shortest(kind.score_bandwidth));
  }
  if (score.kind() == v1::Score::ADDITIVE || score.kind() == v1::Score::BILINEAR) {
    // Their weights are the request's: the same call each time is the caller's to keep.
    absl::StrAppend(&kind.score, " (with the request's score weights)");
  }
  kind.description =
      absl::StrCat("raw attention with ", kind.heads, " query heads, score ", kind.score);
  return kind;
}

}  // namespace

absl::Status AttentionServiceImpl::Submit(Job job, const v1::AttendRequest& request,
                                          const std::shared_ptr<SessionState>& session) {
  if (session == nullptr) return scheduler_->Submit(std::move(job));
  const AttentionArgs& args = job.request->args;
  ATTN_ASSIGN_OR_RETURN(session->request, sessions_.Parse(request.session(), BatchOf(args)));
  session->request.new_rows = NewRows(args, session->request.read_only);
  const SessionKind kind = KindOf(request, args, job.model);
  auto shared = std::make_shared<Job>(std::move(job));
  // The ids' holder before this request may still be computing: the rest
  // runs once it is done (on its thread).
  sessions_.Acquire(session->request.ids, [this, shared, session, kind](bool waited) {
    Job& job = *shared;
    const auto done = job.done;
    absl::StatusOr<std::vector<KvCache*>> caches = sessions_.Begin(session->request, kind);
    if (!caches.ok()) {
      done(caches.status(), JobTiming{});
      return;
    }
    session->caches = *caches;
    session->begun = true;
    job.session = std::make_shared<SessionCall>(SessionCall{*caches, session->request.read_only});
    EngineCall call{&job.request->args, job.model ? job.model->layer.get() : nullptr};
    call.session = job.session.get();
    absl::StatusOr<CallCost> cost = OutOfMemoryAsStatus("request validation", [&] {
      return engine_->CostOf(call);
    });
    // Then the memory the call holds, and last the caches' growth, which may
    // evict idle sessions: a request refused here evicts none.
    absl::Status status = cost.status();
    if (status.ok()) {
      *session->memory.lease = MemoryBudget::Lease();  // the request's alone, now in the whole
      status = ReserveMemory(*cost, job.request->output_dtype, session->memory.wire_bytes,
                             session->memory.lease);
    }
    if (status.ok()) status = sessions_.Reserve(session->request);
    if (!status.ok()) {
      done(status, JobTiming{});
      return;
    }
    job.flops = cost->flops;
    // A request started by another's end is on that request's thread (the
    // scheduler's, perhaps): it queues rather than computing there.
    job.inline_when_idle = !waited && cost->flops <= kInlineMaxFlops;
    job.batch_key = absl::StrCat(job.batch_key, "/session");
    if (absl::Status queued = scheduler_->Submit(std::move(job)); !queued.ok()) {
      done(queued, JobTiming{});
    }
  });
  return absl::OkStatus();
}

void AttentionServiceImpl::FinishSessions(const std::shared_ptr<SessionState>& session, bool ok) {
  if (session == nullptr) return;
  if (session->begun) {
    sessions_.Finish(session->request, ok);
  } else {
    sessions_.Release(session->request.ids);
  }
}

grpc::ServerUnaryReactor* AttentionServiceImpl::CloseSessions(
    grpc::CallbackServerContext* context, const v1::CloseSessionsRequest* request,
    v1::CloseSessionsResponse* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = new UnaryReactor(this);
  absl::Status status = Admit(*context);
  NameReplica(context, status);
  if (status.ok()) status = sessions_.CheckEnabled("ids");
  // A malformed id fails the whole request, as in every other: nothing closed.
  for (int i = 0; status.ok() && i < request->ids_size(); ++i) {
    status = SessionStore::CheckId(absl::StrCat("ids[", i, "]"), request->ids(i));
  }
  if (!status.ok()) return FinishUnary(reactor, "CloseSessions", "", start, status);
  sessions_.Close({request->ids().begin(), request->ids().end()},
                  [this, reactor, response, start](std::vector<std::string> closed,
                                                   std::vector<std::string> not_found) {
                    for (std::string& id : closed) response->add_closed(std::move(id));
                    for (std::string& id : not_found) response->add_not_found(std::move(id));
                    FinishUnary(reactor, "CloseSessions", "", start, absl::OkStatus());
                  });
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetSession(grpc::CallbackServerContext* context,
                                                           const v1::GetSessionRequest* request,
                                                           v1::SessionInfo* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = new UnaryReactor(this);
  absl::Status status = Authenticate(*context);
  if (status.ok() && draining_.load()) {
    status = absl::NotFoundError(absl::StrCat("session \"", request->id(),
                                              "\": this replica is shutting down and its "
                                              "sessions end with it"));
  }
  NameReplica(context, status);
  if (status.ok()) {
    absl::StatusOr<v1::SessionInfo> info = sessions_.Info(request->id());
    if (info.ok()) *response = *std::move(info);
    status = info.status();
  }
  return FinishUnary(reactor, "GetSession", "", start, status);
}

}  // namespace attention::server
