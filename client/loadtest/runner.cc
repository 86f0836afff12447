#include "client/loadtest/runner.h"

#include <sys/resource.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <optional>
#include <semaphore>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/loadtest/h2_transport.h"
#include "client/loadtest/wire.h"
#include "common/status_macros.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/slice.h"
#include "grpcpp/support/status.h"

namespace attention::loadtest {
namespace {

using Clock = std::chrono::steady_clock;

// The controller's cadence: concurrency changes, end of run, stream timeouts.
constexpr auto kControlTick = std::chrono::milliseconds(10);
constexpr int64_t kSweepEveryNs = 100'000'000;
// The pacing thread sleeps at most this long at once, to notice a stop.
constexpr int64_t kMaxSleepNs = 50'000'000;
// After sending ends, calls get their timeout and this much more to end
// before they are cancelled; after an interrupt, only this much.
constexpr int64_t kDrainGraceNs = 1'000'000'000;
// Streams get this long to close cleanly at the end before being cancelled.
constexpr int64_t kStreamCloseNs = 5'000'000'000;

constexpr int64_t kNever = std::numeric_limits<int64_t>::max();
// Progress and timeline intervals are at least this long.
constexpr int64_t kMinProgressNs = 10'000'000;

void AtomicMax(std::atomic<int64_t>& value, int64_t candidate) {
  int64_t current = value.load(std::memory_order_relaxed);
  while (current < candidate &&
         !value.compare_exchange_weak(current, candidate, std::memory_order_relaxed)) {
  }
}

// One finished call (or stream message), as a worker records it.
struct Outcome {
  int64_t intended_ns = 0;
  int64_t sent_ns = 0;
  int64_t done_ns = 0;
  bool measured = false;
  int code = 0;                          // gRPC status code
  absl::string_view error;               // why, when code != 0 or verify_failed
  bool verify_failed = false;            // OK, but --verify refused the answer
  const AnswerFields* answer = nullptr;  // the answer's fields, when it had one
};

// Completion-queue tags: each knows what to do when its operation ends.
class Event {
 public:
  virtual void Proceed(bool ok) = 0;

 protected:
  ~Event() = default;
};

// A tag goes to gRPC with AsTag and comes back through FromTag. The queue
// hands it back only after the operation started with it, an ordering gRPC's
// core keeps with atomics ThreadSanitizer cannot see (the library is not
// built with it); these two tell it.
void* AsTag(Event* event) {
#if defined(__SANITIZE_THREAD__)
  __tsan_release(event);
#endif
  return event;
}

Event* FromTag(void* tag) {
#if defined(__SANITIZE_THREAD__)
  __tsan_acquire(tag);
#endif
  return static_cast<Event*>(tag);
}

class Runner;
class Worker;

// One unary call; pooled by its worker and reused.
struct UnaryCall final : Event {
  void Proceed(bool ok) override;

  Runner* runner = nullptr;
  Worker* worker = nullptr;
  std::optional<grpc::ClientContext> context;
  std::unique_ptr<grpc::ClientAsyncResponseReader<grpc::ByteBuffer>> reader;
  grpc::ByteBuffer response;
  grpc::Status status;
  int64_t intended_ns = 0;
  int64_t sent_ns = 0;
  bool measured = false;
  bool in_use = false;
};

// A completion queue and the thread polling it, what the calls completing on
// it measured, and its pool of unary calls.
class Worker {
 public:
  explicit Worker(Runner* runner) : runner_(runner) {}

  grpc::CompletionQueue* cq() { return &cq_; }

  void Start() {
    thread_ = std::thread([this] {
      void* tag;
      bool ok;
      while (cq_.Next(&tag, &ok)) FromTag(tag)->Proceed(ok);
    });
  }

  // Once nothing can start on the queue any more.
  void Stop() {
    cq_.Shutdown();
    if (thread_.joinable()) {
      thread_.join();
    } else {
      void* tag;
      bool ok;
      while (cq_.Next(&tag, &ok)) FromTag(tag)->Proceed(ok);
    }
  }

  // A pooled call with a fresh context.
  UnaryCall* AcquireCall() {
    absl::MutexLock lock(&mu_);
    UnaryCall* call;
    if (free_.empty()) {
      call = &calls_.emplace_back();
      call->runner = runner_;
      call->worker = this;
    } else {
      call = free_.back();
      free_.pop_back();
    }
    call->context.emplace();
    call->in_use = true;
    return call;
  }

  // Records `outcome` and returns `call` to the pool.
  void ReleaseCall(UnaryCall* call, const Outcome& outcome) {
    absl::MutexLock lock(&mu_);
    RecordLocked(outcome);
    call->reader.reset();
    call->context.reset();
    call->response.Clear();
    call->in_use = false;
    free_.push_back(call);
  }

  void Record(const Outcome& outcome) {
    absl::MutexLock lock(&mu_);
    RecordLocked(outcome);
  }

  // Moves the latencies recorded since the last call into `into`.
  void TakeInterval(Histogram* into) {
    absl::MutexLock lock(&mu_);
    into->Merge(interval_);
    interval_.Clear();
  }

  void CancelCalls() {
    absl::MutexLock lock(&mu_);
    for (UnaryCall& call : calls_) {
      if (call.in_use) call.context->TryCancel();
    }
  }

  LoadStats TakeStats() {
    absl::MutexLock lock(&mu_);
    return std::move(stats_);
  }

 private:
  void RecordLocked(const Outcome& o) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!o.measured) return;
    const int64_t latency = o.done_ns - o.intended_ns;
    interval_.Record(latency);
    stats_.latency.Record(latency);
    stats_.uncorrected_latency.Record(o.done_ns - o.sent_ns);
    stats_.send_lateness.Record(o.sent_ns - o.intended_ns);
    const int code = o.code >= 0 && o.code < kStatusCodes ? o.code : grpc::StatusCode::UNKNOWN;
    if (o.verify_failed) {
      ++stats_.verify_failures;
    } else {
      ++stats_.calls_by_code[code];
    }
    if ((code != 0 || o.verify_failed) && stats_.first_error.empty()) {
      stats_.first_error =
          absl::StrCat(o.verify_failed ? "VERIFY_FAILED" : StatusCodeName(code), ": ", o.error);
    }
    if (code == 0 && o.answer != nullptr) {
      stats_.server_queue.Record(o.answer->queue_us * 1000);
      stats_.server_compute.Record(o.answer->compute_us * 1000);
      stats_.RecordBatchSize(o.answer->batch_size);
    }
  }

  Runner* const runner_;
  grpc::CompletionQueue cq_;
  std::thread thread_;
  absl::Mutex mu_;
  LoadStats stats_ ABSL_GUARDED_BY(mu_);
  Histogram interval_ ABSL_GUARDED_BY(mu_);
  std::deque<UnaryCall> calls_ ABSL_GUARDED_BY(mu_);  // a deque: calls never move
  std::vector<UnaryCall*> free_ ABSL_GUARDED_BY(mu_);
};

struct Channel {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<grpc::GenericStub> stub;
};

class StreamConn;

// A message of a stream, from its send to its answer.
struct PendingMessage {
  int64_t intended_ns = 0;
  int64_t sent_ns = -1;  // -1 until written
  bool measured = false;
};

// The stream a channel's messages go to; replaced when it fails.
struct StreamSlot {
  Worker* worker = nullptr;
  grpc::GenericStub* stub = nullptr;
  absl::Mutex mu;
  StreamConn* conn ABSL_GUARDED_BY(mu) = nullptr;
};

// The load: see RunLoad. Threads: the completion-queue workers, in open loops
// one pacing thread, and the caller's, which controls the run.
class Runner {
 public:
  Runner(const RunOptions& options, std::vector<Channel> channels,
         const v1::AttendRequest& request);

  // --transport h2: connects the transport that then carries every call.
  absl::Status ConnectH2(const std::vector<std::string>& addresses);

  RunResult Run();

  int64_t NowNs() const { return (Clock::now() - start_).count(); }

  void OnUnaryDone(UnaryCall* call);
  // Reads an answer into `answer` and fills the code, error and verify
  // result of `outcome`; `problem` holds the text `outcome->error` may point to.
  void Inspect(grpc::ByteBuffer* buffer, AnswerFields* answer, std::string* problem,
               Outcome* outcome) const;
  void Inspect(absl::string_view bytes, AnswerFields* answer, std::string* problem,
               Outcome* outcome) const;
  // A stream message ended, answered or not; `answer` only when it was.
  void FinishMessage(Worker& worker, const PendingMessage& message, int64_t done_ns,
                     const Outcome& result);
  void NoteWritten(const PendingMessage& message) {
    if (message.measured) AtomicMax(last_sent_ns_, message.sent_ns);
  }
  // The request without its id, which stream messages put in front.
  const grpc::Slice& stream_body() const { return stream_body_; }
  void PrepareContext(grpc::ClientContext* context, bool deadline) const;
  const std::string& stream_method() const { return stream_method_; }
  void Register(StreamConn* conn);
  void Unregister(StreamConn* conn);

 private:
  void Start(int64_t intended_ns, bool measured);
  // Call `n`'s channel: round robin, passing over channels whose target is
  // down (TRANSIENT_FAILURE, until they reconnect) while another one is not,
  // as gRPC's round_robin does with the addresses of one channel. Calls to a
  // down target would fail at once, and gRPC's retries stay on their channel.
  size_t PickChannel(uint64_t n);
  void StartUnary(Worker& worker, Channel& channel, int64_t intended_ns, bool measured);
  void OnH2Done(const H2CallInfo& info, const H2Answer& answer);
  // What Inspect does after the parse (`parsed`: it succeeded).
  void Judge(bool parsed, const v1::AttendResponse* response, AnswerFields* answer,
             std::string* problem, Outcome* outcome) const;
  void SendOnStream(StreamSlot& slot, int64_t intended_ns, bool measured);
  // Every call's end: counters, then the next call of a closed loop or a free
  // place for an open loop's.
  void Finished(const Outcome& outcome);

  // Closed loop: a caller whose call ended (or a new one) sends its next call,
  // or retires when the schedule wants fewer callers or the run is over.
  void ContinueSlot();
  bool TakeTicket(int64_t now_ns);
  void MarkStopping(int64_t now_ns);
  void ControlConcurrency(int64_t now_ns);
  // Open loop: the pacing thread, or with the h2 transport its thread.
  void SendOnSchedule();
  // Sends the calls due by `now` (NowNs). False once sending is over (the
  // schedule's end, max_requests, or stopping); else `next_ns` is when the
  // next call is due, or -1 when it waits for a place under max_in_flight
  // (may_block: waits for one here instead).
  bool PaceStep(int64_t now, bool may_block, int64_t* next_ns);
  bool SleepUntil(int64_t t_ns) const;
  bool SendingDone() const;

  void ExpireStreamMessages(int64_t now_ns);
  void Tick(int64_t now_ns);
  void CancelAll();
  void CloseStreams();

  const RunOptions& options_;
  const bool open_loop_;
  const int64_t measure_start_ns_;
  const int64_t end_ns_;
  const int64_t timeout_ns_;  // 0: no deadline
  const Schedule schedule_;   // with the warm-up in front
  const std::string attend_method_ = "/attention.v1.AttentionService/Attend";
  const std::string stream_method_ = "/attention.v1.AttentionService/AttendStream";
  std::string authorization_;
  grpc::ByteBuffer request_buffer_;  // the whole request, for unary calls
  grpc::Slice stream_body_;          // the request without its id

  std::vector<Channel> channels_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<std::unique_ptr<StreamSlot>> slots_;
  std::unique_ptr<std::counting_semaphore<>> in_flight_cap_;
  Clock::time_point start_;

  std::atomic<uint64_t> next_call_{0};
  std::atomic<uint64_t> next_skip_{0};  // PickChannel's stand-ins
  std::atomic<uint64_t> next_seq_{0};
  std::atomic<int64_t> sent_{0};
  std::atomic<int64_t> measured_sent_{0};
  std::atomic<int64_t> completed_{0};
  std::atomic<int64_t> errors_{0};
  std::atomic<int64_t> measured_completed_{0};
  std::atomic<int64_t> measured_errors_{0};
  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> last_sent_ns_{0};
  std::atomic<int64_t> last_done_ns_{0};
  // Closed loop: callers running, callers wanted, measured calls started.
  std::atomic<int64_t> active_{0};
  std::atomic<int64_t> target_{0};
  std::atomic<int64_t> tickets_{0};
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> stop_ns_{-1};
  // Open loop: set by the pacing thread when it is done, with when the
  // schedule's sending window ended.
  std::atomic<bool> sending_done_{false};
  std::atomic<int64_t> window_end_ns_{0};
  // PaceStep's, on one thread at a time.
  struct {
    std::optional<SendTimes> times;
    int64_t next_intended = -1;  // due and not yet sent; -1: take the next
    int64_t measured = 0;
  } pace_;

  absl::Mutex conns_mu_;
  absl::flat_hash_set<StreamConn*> conns_ ABSL_GUARDED_BY(conns_mu_);
  std::string unary_request_;  // the serialized request, for the h2 transport

  // The controller's: progress and timeline.
  Histogram cumulative_;
  std::vector<TimelinePoint> timeline_;
  int64_t last_tick_ns_ = 0;
  int64_t last_tick_completed_ = 0;
  // The timeline counts measured calls only (as the run's totals do), from
  // the measured counters at its last point: a tick that ends the warm-up a
  // little late leaves the calls measured before it to the first point.
  Histogram timeline_latency_;  // measured answers since the last point
  int64_t timeline_sent_ = 0;
  int64_t timeline_completed_ = 0;
  int64_t timeline_errors_ = 0;

  // Last: its thread reports to the members above, so it goes first.
  std::unique_ptr<H2Transport> h2_;
};

void UnaryCall::Proceed(bool /*ok: always true for Finish*/) { runner->OnUnaryDone(this); }

// --- streams --------------------------------------------------------------------

// One AttendStream call. Its operations complete on its worker's thread; the
// senders, the controller and that thread meet under mu_. Deletes itself once
// it has ended, no operation is outstanding and its slot has let go of it
// (Close).
class StreamConn {
 public:
  StreamConn(Runner* runner, Worker* worker, grpc::GenericStub* stub)
      : runner_(runner), worker_(worker) {
    runner_->Register(this);
    runner_->PrepareContext(&context_, /*deadline=*/false);
    absl::MutexLock lock(&mu_);
    stream_ = stub->PrepareCall(&context_, runner_->stream_method(), worker_->cq());
    ++ops_;
    stream_->StartCall(AsTag(&started_));
  }

  ~StreamConn() { runner_->Unregister(this); }

  // Queues message `seq`; false once the stream has failed or is closing.
  bool Send(uint64_t seq, int64_t intended_ns, bool measured) {
    absl::MutexLock lock(&mu_);
    if (failed_ || closing_) return false;
    pending_[seq] = PendingMessage{intended_ns, -1, measured};
    queue_.push_back(seq);
    WriteNextLocked();
    return true;
  }

  // Half-closes once the queue is written; the caller forgets the stream.
  void Close() {
    bool last;
    {
      absl::MutexLock lock(&mu_);
      closing_ = true;
      detached_ = true;
      MaybeWritesDoneLocked();
      last = ops_ == 0 && ended_;
    }
    if (last) delete this;
  }

  void Cancel() { context_.TryCancel(); }

  // Removes the messages sent (or queued) `timeout_ns` or more before `now_ns`
  // into `expired`.
  void Expire(int64_t now_ns, int64_t timeout_ns, std::vector<PendingMessage>* expired) {
    absl::MutexLock lock(&mu_);
    for (auto it = pending_.begin(); it != pending_.end();) {
      const PendingMessage& message = it->second;
      const int64_t since = message.sent_ns >= 0 ? message.sent_ns : message.intended_ns;
      if (now_ns - since >= timeout_ns) {
        expired->push_back(message);
        pending_.erase(it++);
      } else {
        ++it;
      }
    }
  }

 private:
  struct Op final : Event {
    Op(StreamConn* conn, void (StreamConn::*handler)(bool)) : conn(conn), handler(handler) {}
    void Proceed(bool ok) override { (conn->*handler)(ok); }
    StreamConn* conn;
    void (StreamConn::*handler)(bool);
  };

  void OnStarted(bool ok) {
    absl::MutexLock lock(&mu_);
    if (ok) {
      started_ok_ = true;
      ++ops_;
      stream_->Read(&incoming_, AsTag(&read_));
      WriteNextLocked();
      MaybeWritesDoneLocked();
    } else {
      failed_ = true;
      FinishLocked();
    }
    EndOpLocked();
  }

  void OnWritten(bool ok) {
    bool last;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (ok) {
        WriteNextLocked();
        MaybeWritesDoneLocked();
      } else {
        failed_ = true;  // the pending read fails too, and finishes the call
      }
      last = EndOpLocked();
    }
    if (last) delete this;
  }

  void OnRead(bool ok) {
    if (!ok) {
      absl::MutexLock lock(&mu_);
      failed_ = true;
      FinishLocked();
      EndOpLocked();  // the Finish keeps it alive
      return;
    }
    const int64_t done_ns = runner_->NowNs();
    AnswerFields answer;
    std::string problem;
    Outcome outcome;
    runner_->Inspect(&incoming_, &answer, &problem, &outcome);
    uint64_t seq;
    const bool has_seq = absl::SimpleAtoi(answer.id, &seq);
    std::optional<PendingMessage> message;
    {
      absl::MutexLock lock(&mu_);
      if (has_seq) {
        auto it = pending_.find(seq);
        if (it != pending_.end()) {
          message = it->second;
          pending_.erase(it);
        }
      }
      ++ops_;
      stream_->Read(&incoming_, AsTag(&read_));
      EndOpLocked();  // the new Read keeps it alive
    }
    // An answer to an expired message was counted as DEADLINE_EXCEEDED already.
    if (message.has_value()) runner_->FinishMessage(*worker_, *message, done_ns, outcome);
  }

  void OnWritesDone(bool /*ok*/) {
    bool last;
    {
      absl::MutexLock lock(&mu_);
      last = EndOpLocked();
    }
    if (last) delete this;
  }

  void OnFinished(bool /*ok*/) {
    absl::flat_hash_map<uint64_t, PendingMessage> unanswered;
    {
      absl::MutexLock lock(&mu_);
      ended_ = true;
      unanswered.swap(pending_);
      queue_.clear();
    }
    const int64_t done_ns = runner_->NowNs();
    Outcome outcome;
    std::string why;
    if (status_.ok()) {
      outcome.code = grpc::StatusCode::ABORTED;
      why = "the stream ended before answering";
    } else {
      outcome.code = status_.error_code();
      why = absl::StrCat("stream: ", status_.error_message());
    }
    outcome.error = why;
    for (const auto& [seq, message] : unanswered) {
      runner_->FinishMessage(*worker_, message, done_ns, outcome);
    }
    bool last;
    {
      absl::MutexLock lock(&mu_);
      last = EndOpLocked();
    }
    if (last) delete this;
  }

  void WriteNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    while (!writing_ && started_ok_ && !failed_ && !queue_.empty()) {
      const uint64_t seq = queue_.front();
      queue_.pop_front();
      auto it = pending_.find(seq);
      if (it == pending_.end()) continue;  // expired while queued
      it->second.sent_ns = runner_->NowNs();
      runner_->NoteWritten(it->second);
      writing_ = true;
      ++ops_;
      stream_->Write(MessageWithId(seq, runner_->stream_body()), AsTag(&written_));
    }
  }

  void MaybeWritesDoneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (closing_ && started_ok_ && !failed_ && !writing_ && queue_.empty() && !writes_done_) {
      writes_done_ = true;
      ++ops_;
      stream_->WritesDone(AsTag(&writes_done_op_));
    }
  }

  void FinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finishing_) return;
    finishing_ = true;
    ++ops_;
    stream_->Finish(&status_, AsTag(&finished_));
  }

  // One operation fewer; true when the stream should now delete itself.
  bool EndOpLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return --ops_ == 0 && ended_ && detached_;
  }

  Runner* const runner_;
  Worker* const worker_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> stream_;
  Op started_{this, &StreamConn::OnStarted};
  Op written_{this, &StreamConn::OnWritten};
  Op read_{this, &StreamConn::OnRead};
  Op writes_done_op_{this, &StreamConn::OnWritesDone};
  Op finished_{this, &StreamConn::OnFinished};
  grpc::ByteBuffer incoming_;  // only the read handler touches it
  grpc::Status status_;

  absl::Mutex mu_;
  std::deque<uint64_t> queue_ ABSL_GUARDED_BY(mu_);  // not yet written
  absl::flat_hash_map<uint64_t, PendingMessage> pending_ ABSL_GUARDED_BY(mu_);
  int ops_ ABSL_GUARDED_BY(mu_) = 0;
  bool started_ok_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool writes_done_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  bool detached_ ABSL_GUARDED_BY(mu_) = false;
};

// --- the runner -----------------------------------------------------------------

Runner::Runner(const RunOptions& options, std::vector<Channel> channels,
               const v1::AttendRequest& request)
    : options_(options),
      open_loop_(options.schedule.kind() == LoadKind::kRate),
      measure_start_ns_(absl::ToInt64Nanoseconds(options.warmup)),
      end_ns_(options.schedule.length() == absl::InfiniteDuration()
                  ? kNever
                  : absl::ToInt64Nanoseconds(options.warmup + options.schedule.length())),
      timeout_ns_(options.client.timeout > absl::ZeroDuration() &&
                          options.client.timeout != absl::InfiniteDuration()
                      ? absl::ToInt64Nanoseconds(options.client.timeout)
                      : 0),
      schedule_(options.schedule.WithLead(options.warmup)),
      channels_(std::move(channels)) {
  if (!options.client.bearer_token.empty()) {
    authorization_ = absl::StrCat("Bearer ", options.client.bearer_token);
  }
  const std::string whole = request.SerializeAsString();
  if (options.transport == Transport::kH2) unary_request_ = whole;
  grpc::Slice whole_slice(whole);
  request_buffer_ = grpc::ByteBuffer(&whole_slice, 1);
  v1::AttendRequest body = request;
  body.clear_id();
  stream_body_ = grpc::Slice(body.SerializeAsString());

  for (int i = 0; i < options.threads; ++i) workers_.push_back(std::make_unique<Worker>(this));
  if (options.stream) {
    for (size_t i = 0; i < channels_.size(); ++i) {
      auto slot = std::make_unique<StreamSlot>();
      slot->worker = workers_[i % workers_.size()].get();
      slot->stub = channels_[i].stub.get();
      slots_.push_back(std::move(slot));
    }
  }
  if (open_loop_ && options.max_in_flight > 0) {
    in_flight_cap_ =
        std::make_unique<std::counting_semaphore<>>(static_cast<ptrdiff_t>(options.max_in_flight));
  }
}

void Runner::PrepareContext(grpc::ClientContext* context, bool deadline) const {
  if (deadline && timeout_ns_ > 0) {
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::nanoseconds(timeout_ns_));
  }
  if (!authorization_.empty()) context->AddMetadata("authorization", authorization_);
}

void Runner::Register(StreamConn* conn) {
  absl::MutexLock lock(&conns_mu_);
  conns_.insert(conn);
}

void Runner::Unregister(StreamConn* conn) {
  absl::MutexLock lock(&conns_mu_);
  conns_.erase(conn);
}

void Runner::Start(int64_t intended_ns, bool measured) {
  sent_.fetch_add(1, std::memory_order_relaxed);
  in_flight_.fetch_add(1, std::memory_order_relaxed);
  if (measured) measured_sent_.fetch_add(1, std::memory_order_relaxed);
  const uint64_t n = next_call_.fetch_add(1, std::memory_order_relaxed);
  const size_t channel = PickChannel(n);
  if (h2_ != nullptr) {
    H2CallInfo info{intended_ns, NowNs(), measured};
    if (intended_ns < 0) info.intended_ns = info.sent_ns;
    if (measured) AtomicMax(last_sent_ns_, info.sent_ns);
    h2_->Send(channel, info);
  } else if (options_.stream) {
    SendOnStream(*slots_[channel], intended_ns, measured);
  } else {
    StartUnary(*workers_[n % workers_.size()], channels_[channel], intended_ns, measured);
  }
}

size_t Runner::PickChannel(uint64_t n) {
  const size_t size = h2_ != nullptr ? h2_->size() : channels_.size();
  const size_t first = n % size;
  auto down = [this](size_t i) {
    if (h2_ != nullptr) return h2_->Down(i);
    return channels_[i].channel->GetState(/*try_to_connect=*/false) ==
           GRPC_CHANNEL_TRANSIENT_FAILURE;
  };
  if (size == 1 || !down(first)) return first;
  // The stand-ins rotate too, so a down channel's share spreads evenly over
  // the others rather than all going to its neighbour.
  const uint64_t skip = next_skip_.fetch_add(1, std::memory_order_relaxed);
  for (size_t i = 0; i < size - 1; ++i) {
    const size_t candidate = (first + 1 + (skip + i) % (size - 1)) % size;
    if (!down(candidate)) return candidate;
  }
  return first;
}

void Runner::StartUnary(Worker& worker, Channel& channel, int64_t intended_ns, bool measured) {
  UnaryCall* call = worker.AcquireCall();
  // Sent, then the deadline: a call that times out then measures at least
  // its timeout (the other order lost the time between the two, 1.7 ms once
  // under ASan on a loaded machine).
  call->sent_ns = NowNs();
  PrepareContext(&*call->context, /*deadline=*/true);
  call->measured = measured;
  call->intended_ns = intended_ns < 0 ? call->sent_ns : intended_ns;
  if (measured) AtomicMax(last_sent_ns_, call->sent_ns);
  call->reader =
      channel.stub->PrepareUnaryCall(&*call->context, attend_method_, request_buffer_, worker.cq());
  call->reader->StartCall();
  call->reader->Finish(&call->response, &call->status, AsTag(call));
}

void Runner::SendOnStream(StreamSlot& slot, int64_t intended_ns, bool measured) {
  const uint64_t seq = next_seq_.fetch_add(1, std::memory_order_relaxed);
  const PendingMessage message{intended_ns < 0 ? NowNs() : intended_ns, -1, measured};
  {
    absl::MutexLock lock(&slot.mu);
    if (slot.conn != nullptr && slot.conn->Send(seq, message.intended_ns, measured)) return;
    if (slot.conn != nullptr) slot.conn->Close();
    slot.conn = new StreamConn(this, slot.worker, slot.stub);
    if (slot.conn->Send(seq, message.intended_ns, measured)) return;
  }
  // The new stream failed at once; outside the lock, since a closed loop
  // sends its next message from here.
  Outcome outcome;
  outcome.code = grpc::StatusCode::UNAVAILABLE;
  outcome.error = "the stream failed as it started";
  FinishMessage(*slot.worker, message, NowNs(), outcome);
}

void Runner::Inspect(grpc::ByteBuffer* buffer, AnswerFields* answer, std::string* problem,
                     Outcome* outcome) const {
  if (options_.verifier == nullptr) {
    Judge(ReadAnswerFields(buffer, answer), nullptr, answer, problem, outcome);
    return;
  }
  v1::AttendResponse response;
  grpc::ProtoBufferReader reader(buffer);
  Judge(response.ParseFromZeroCopyStream(&reader), &response, answer, problem, outcome);
}

void Runner::Inspect(absl::string_view bytes, AnswerFields* answer, std::string* problem,
                     Outcome* outcome) const {
  if (options_.verifier == nullptr) {
    Judge(ReadAnswerFields(bytes, answer), nullptr, answer, problem, outcome);
    return;
  }
  v1::AttendResponse response;
  Judge(response.ParseFromArray(bytes.data(), static_cast<int>(bytes.size())), &response, answer,
        problem, outcome);
}

void Runner::Judge(bool parsed, const v1::AttendResponse* response, AnswerFields* answer,
                   std::string* problem, Outcome* outcome) const {
  if (parsed && response != nullptr) {
    answer->id = response->id();
    answer->code = response->status().code();
    answer->message = response->status().message();
    answer->queue_us = response->queue_us();
    answer->compute_us = response->compute_us();
    answer->batch_size = response->batch_size();
    if (answer->code == 0) {
      const absl::Status verified = options_.verifier->Check(*response);
      if (!verified.ok()) {
        outcome->verify_failed = true;
        *problem = std::string(verified.message());
        outcome->error = *problem;
      }
    }
  }
  if (!parsed) {
    outcome->code = grpc::StatusCode::INTERNAL;
    *problem = "the answer is not an AttendResponse";
    outcome->error = *problem;
    return;
  }
  outcome->answer = answer;
  outcome->code = answer->code;
  if (answer->code != 0) outcome->error = answer->message;
}

void Runner::OnUnaryDone(UnaryCall* call) {
  Outcome outcome;
  outcome.done_ns = NowNs();
  outcome.intended_ns = call->intended_ns;
  outcome.sent_ns = call->sent_ns;
  outcome.measured = call->measured;
  AnswerFields answer;
  std::string problem;
  if (call->status.ok()) {
    Inspect(&call->response, &answer, &problem, &outcome);
  } else {
    outcome.code = call->status.error_code();
    problem = call->status.error_message();  // a copy: grpc::Status returns it by value
    outcome.error = problem;
  }
  call->worker->ReleaseCall(call, outcome);
  Finished(outcome);
}

void Runner::OnH2Done(const H2CallInfo& info, const H2Answer& h2) {
  Outcome outcome;
  outcome.done_ns = NowNs();
  outcome.intended_ns = info.intended_ns;
  outcome.sent_ns = info.sent_ns;
  outcome.measured = info.measured;
  AnswerFields answer;
  std::string problem;
  if (h2.code == grpc::StatusCode::OK) {
    Inspect(h2.response, &answer, &problem, &outcome);
  } else {
    outcome.code = h2.code;
    outcome.error = h2.message;
  }
  workers_.front()->Record(outcome);
  Finished(outcome);
}

absl::Status Runner::ConnectH2(const std::vector<std::string>& addresses) {
  H2Options h2;
  h2.targets = addresses;
  h2.path = attend_method_;
  h2.request = unary_request_;
  h2.authorization = authorization_;
  h2.timeout = options_.client.timeout;
  h2.max_message_bytes = options_.client.max_message_mb << 20;
  h2.connect_timeout = options_.connect_timeout;
  h2.reconnect_backoff_initial = options_.client.reconnect_backoff_initial;
  h2.reconnect_backoff_max = options_.client.reconnect_backoff_max;
  h2.attempt_timeout = options_.client.reconnect_backoff_min;
  ATTN_ASSIGN_OR_RETURN(
      h2_, H2Transport::Connect(h2, [this](const H2CallInfo& info, const H2Answer& answer) {
        OnH2Done(info, answer);
      }));
  return absl::OkStatus();
}

void Runner::FinishMessage(Worker& worker, const PendingMessage& message, int64_t done_ns,
                           const Outcome& result) {
  Outcome outcome = result;
  outcome.intended_ns = message.intended_ns;
  outcome.sent_ns = message.sent_ns >= 0 ? message.sent_ns : message.intended_ns;
  outcome.done_ns = done_ns;
  outcome.measured = message.measured;
  worker.Record(outcome);
  Finished(outcome);
}

void Runner::Finished(const Outcome& outcome) {
  const bool failed = outcome.code != 0 || outcome.verify_failed;
  completed_.fetch_add(1, std::memory_order_relaxed);
  if (failed) errors_.fetch_add(1, std::memory_order_relaxed);
  if (outcome.measured) {
    measured_completed_.fetch_add(1, std::memory_order_relaxed);
    if (failed) measured_errors_.fetch_add(1, std::memory_order_relaxed);
    AtomicMax(last_done_ns_, outcome.done_ns);
  }
  in_flight_.fetch_sub(1, std::memory_order_relaxed);
  if (!open_loop_) {
    ContinueSlot();
  } else if (in_flight_cap_ != nullptr) {
    in_flight_cap_->release();
  }
}

void Runner::MarkStopping(int64_t now_ns) {
  if (!stopping_.exchange(true)) stop_ns_.store(now_ns);
}

bool Runner::TakeTicket(int64_t now_ns) {
  if (options_.max_requests == 0) return true;
  if (tickets_.fetch_add(1) < options_.max_requests) return true;
  MarkStopping(now_ns);
  return false;
}

void Runner::ContinueSlot() {
  int64_t active = active_.load();
  while (active > target_.load()) {
    if (active_.compare_exchange_weak(active, active - 1)) return;
  }
  const int64_t now = NowNs();
  if (now >= end_ns_) MarkStopping(now);
  const bool measured = now >= measure_start_ns_;
  if (!stopping_.load() && (!measured || TakeTicket(now))) {
    Start(/*intended_ns=*/-1, measured);
    return;
  }
  active_.fetch_sub(1);
}

void Runner::ControlConcurrency(int64_t now_ns) {
  if (stopping_.load()) return;
  if (now_ns >= end_ns_) {
    MarkStopping(now_ns);
    return;
  }
  target_.store(std::llround(schedule_.ValueAt(absl::Nanoseconds(now_ns))));
  int64_t active = active_.load();
  while (!stopping_.load() && active < target_.load()) {
    if (active_.compare_exchange_weak(active, active + 1)) {
      ContinueSlot();
      active = active_.load();
    }
  }
}

bool Runner::SleepUntil(int64_t t_ns) const {
  for (;;) {
    const int64_t now = NowNs();
    if (now >= t_ns) return true;
    if (stopping_.load(std::memory_order_relaxed)) return false;
    std::this_thread::sleep_for(std::chrono::nanoseconds(std::min(t_ns - now, kMaxSleepNs)));
  }
}

void Runner::SendOnSchedule() {
#ifdef __linux__
  // The kernel may otherwise wake a sleeping thread up to 50 us late.
  prctl(PR_SET_TIMERSLACK, 1000UL);
#endif
  int64_t next;
  while (PaceStep(NowNs(), /*may_block=*/true, &next)) {
    if (!SleepUntil(next)) {
      PaceStep(NowNs(), /*may_block=*/true, &next);  // sees stopping_ and ends the window
      break;
    }
  }
}

bool Runner::PaceStep(int64_t now, bool may_block, int64_t* next_ns) {
  auto finish = [this](int64_t window_end) {
    window_end_ns_.store(window_end == kNever ? NowNs() : window_end);
    sending_done_.store(true);
    return false;
  };
  if (sending_done_.load(std::memory_order_relaxed)) return false;
  for (;;) {
    if (pace_.next_intended < 0) {
      const int64_t intended = pace_.times->Next();
      if (intended < 0 || intended >= end_ns_) return finish(end_ns_);
      if (intended >= measure_start_ns_ && options_.max_requests > 0 &&
          pace_.measured == options_.max_requests) {
        return finish(intended);
      }
      pace_.next_intended = intended;
    }
    if (stopping_.load(std::memory_order_relaxed)) return finish(now);
    if (pace_.next_intended > now) {
      *next_ns = pace_.next_intended;
      return true;
    }
    if (in_flight_cap_ != nullptr) {
      bool acquired = in_flight_cap_->try_acquire();
      while (may_block && !acquired && !stopping_.load(std::memory_order_relaxed)) {
        acquired = in_flight_cap_->try_acquire_for(std::chrono::nanoseconds(kMaxSleepNs));
      }
      if (!acquired) {
        if (may_block) return finish(NowNs());  // stopping
        *next_ns = -1;                          // the next call that ends frees a place
        return true;
      }
    }
    const bool in_measurement = pace_.next_intended >= measure_start_ns_;
    Start(pace_.next_intended, in_measurement);
    if (in_measurement) ++pace_.measured;
    pace_.next_intended = -1;
    now = NowNs();
  }
}

bool Runner::SendingDone() const {
  return open_loop_ ? sending_done_.load() : stopping_.load() && active_.load() == 0;
}

void Runner::ExpireStreamMessages(int64_t now_ns) {
  if (timeout_ns_ == 0) return;
  std::vector<PendingMessage> expired;
  for (const std::unique_ptr<StreamSlot>& slot : slots_) {
    {
      absl::MutexLock lock(&slot->mu);
      if (slot->conn != nullptr) slot->conn->Expire(now_ns, timeout_ns_, &expired);
    }
    Outcome outcome;
    outcome.code = grpc::StatusCode::DEADLINE_EXCEEDED;
    outcome.error = "no answer on the stream within --timeout";
    for (const PendingMessage& message : expired) {
      FinishMessage(*slot->worker, message, now_ns, outcome);
    }
    expired.clear();
  }
}

void Runner::Tick(int64_t now_ns) {
  for (const std::unique_ptr<Worker>& worker : workers_) worker->TakeInterval(&timeline_latency_);
  const int64_t sent = sent_.load();
  const int64_t completed = completed_.load();
  const int64_t errors = errors_.load();
  const double seconds = static_cast<double>(now_ns - last_tick_ns_) * 1e-9;
  // Ticks fall on the start of the measurement (a little late, perhaps), so
  // an interval is all warm-up or all measurement.
  if (last_tick_ns_ >= measure_start_ns_) {
    const int64_t measured_sent = measured_sent_.load();
    const int64_t measured_completed = measured_completed_.load();
    const int64_t measured_errors = measured_errors_.load();
    cumulative_.Merge(timeline_latency_);
    timeline_.push_back(TimelinePoint{
        .t_s = static_cast<double>(now_ns - measure_start_ns_) * 1e-9,
        // The interval's mean: a ramp's midpoint, not its end.
        .target = schedule_.MeanOver(absl::Nanoseconds(std::min(last_tick_ns_, end_ns_ - 1)),
                                     absl::Nanoseconds(std::min(now_ns, end_ns_))),
        .sent = measured_sent - timeline_sent_,
        .completed = measured_completed - timeline_completed_,
        .errors = measured_errors - timeline_errors_,
        .p50_ns = timeline_latency_.ValueAtQuantile(0.5),
        .p99_ns = timeline_latency_.ValueAtQuantile(0.99),
        .max_ns = timeline_latency_.max(),
    });
    timeline_latency_.Clear();
    timeline_sent_ = measured_sent;
    timeline_completed_ = measured_completed;
    timeline_errors_ = measured_errors;
  }
  if (options_.on_progress) {
    const double rps =
        seconds > 0 ? static_cast<double>(completed - last_tick_completed_) / seconds : 0;
    options_.on_progress(Progress{
        .elapsed = absl::Nanoseconds(now_ns),
        .warming_up = last_tick_ns_ < measure_start_ns_,
        // Past its end the schedule's value is 0: the last tick shows the last one.
        .target = schedule_.ValueAt(absl::Nanoseconds(std::min(now_ns, end_ns_ - 1))),
        .sent = sent,
        .completed = completed,
        .errors = errors,
        .in_flight = in_flight_.load(),
        .rps = rps,
        .p99_ns = cumulative_.ValueAtQuantile(0.99),
    });
  }
  last_tick_ns_ = now_ns;
  last_tick_completed_ = completed;
}

void Runner::CancelAll() {
  if (h2_ != nullptr) h2_->CancelAll();
  for (const std::unique_ptr<Worker>& worker : workers_) worker->CancelCalls();
  absl::MutexLock lock(&conns_mu_);
  for (StreamConn* conn : conns_) conn->Cancel();
}

void Runner::CloseStreams() {
  for (const std::unique_ptr<StreamSlot>& slot : slots_) {
    absl::MutexLock lock(&slot->mu);
    if (slot->conn != nullptr) slot->conn->Close();
    slot->conn = nullptr;
  }
  auto all_gone = [this] {
    absl::MutexLock lock(&conns_mu_);
    return conns_.empty();
  };
  const int64_t cancel_at = NowNs() + kStreamCloseNs;
  bool cancelled = false;
  while (!all_gone()) {
    if (!cancelled && NowNs() >= cancel_at) {
      CancelAll();
      cancelled = true;
    }
    std::this_thread::sleep_for(kControlTick);
  }
}

RunResult Runner::Run() {
  rusage usage_before;
  getrusage(RUSAGE_SELF, &usage_before);
  start_ = Clock::now();
  if (h2_ == nullptr) {
    for (const std::unique_ptr<Worker>& worker : workers_) worker->Start();
  }
  std::thread pacer;
  if (open_loop_) {
    pace_.times.emplace(schedule_, options_.arrival, options_.seed);
    if (h2_ != nullptr) {
      // The transport's thread keeps the schedule: no hand-off per call.
      const int64_t base =
          std::chrono::duration_cast<std::chrono::nanoseconds>(start_.time_since_epoch()).count();
      h2_->SetPacer([this, base](int64_t steady_now) -> int64_t {
        int64_t next;
        if (!PaceStep(steady_now - base, /*may_block=*/false, &next) || next < 0) return -1;
        return next + base;
      });
    } else {
      pacer = std::thread([this] { SendOnSchedule(); });
    }
  }

  const int64_t progress_ns =
      std::max(absl::ToInt64Nanoseconds(options_.progress_interval), kMinProgressNs);
  // Every progress_ns, and once when the warm-up ends.
  auto tick_after = [&](int64_t tick) {
    return tick < measure_start_ns_ ? std::min(tick + progress_ns, measure_start_ns_)
                                    : tick + progress_ns;
  };
  int64_t next_tick = tick_after(0);
  int64_t next_sweep = kSweepEveryNs;
  int64_t cancel_at = kNever;
  bool cancelled = false;
  bool draining = false;
  for (;;) {
    const int64_t now = NowNs();
    if (options_.interrupted != nullptr && options_.interrupted->load() && !stopping_.load()) {
      MarkStopping(now);
      cancel_at = std::min(cancel_at, now + kDrainGraceNs);
    }
    if (!open_loop_) ControlConcurrency(now);
    if (options_.stream && now >= next_sweep) {
      ExpireStreamMessages(now);
      next_sweep = now + kSweepEveryNs;
    }
    if (now >= next_tick) {
      Tick(now);
      next_tick = tick_after(next_tick);
    }
    if (SendingDone()) {
      if (in_flight_.load() == 0) break;
      if (!draining && timeout_ns_ > 0) {
        cancel_at = std::min(cancel_at, now + timeout_ns_ + kDrainGraceNs);
      }
      draining = true;
    }
    if (!cancelled && now >= cancel_at) {
      CancelAll();
      cancelled = true;
    }
    std::this_thread::sleep_for(kControlTick);
  }
  if (pacer.joinable()) pacer.join();
  // The last interval, unless the run ended just after a tick with nothing
  // since (a point of zeros some microseconds long).
  const int64_t end = NowNs();
  if (end > last_tick_ns_ &&
      (timeline_.empty() || measured_completed_.load() != timeline_completed_ ||
       measured_sent_.load() != timeline_sent_)) {
    Tick(end);
  }
  CloseStreams();
  if (h2_ != nullptr) h2_->Stop();
  for (const std::unique_ptr<Worker>& worker : workers_) worker->Stop();
  rusage usage_after;
  getrusage(RUSAGE_SELF, &usage_after);

  RunResult result;
  for (const std::unique_ptr<Worker>& worker : workers_) result.stats.Merge(worker->TakeStats());
  LoadStats& stats = result.stats;
  stats.sent = measured_sent_.load();
  const int64_t window_end =
      std::max(open_loop_ ? window_end_ns_.load() : stop_ns_.load(), last_sent_ns_.load());
  stats.send_window_s =
      static_cast<double>(std::max<int64_t>(0, window_end - measure_start_ns_)) * 1e-9;
  // To the last answer, or the end of the window the calls were sent over if
  // that is later: an open loop's last answer can come long before its
  // window ends (one call at 0.5/s for 1 s read as 2000 answered/s).
  stats.duration_s = static_cast<double>(std::max<int64_t>(
                         0, std::max(last_done_ns_.load(), window_end) - measure_start_ns_)) *
                     1e-9;
  auto seconds = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6;
  };
  stats.cpu_user_s = seconds(usage_after.ru_utime) - seconds(usage_before.ru_utime);
  stats.cpu_system_s = seconds(usage_after.ru_stime) - seconds(usage_before.ru_stime);
  stats.cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  result.timeline = std::move(timeline_);
  return result;
}

absl::Status CheckOptions(const RunOptions& options) {
  if (options.targets.empty()) return absl::InvalidArgumentError("no target given");
  ATTN_RETURN_IF_ERROR(CheckConnectionsAndThreads(options.connections, options.threads));
  if (options.max_in_flight < 0 || options.max_requests < 0) {
    return absl::InvalidArgumentError("max_in_flight and max_requests must not be negative");
  }
  if (options.warmup < absl::ZeroDuration() || options.warmup == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError("warmup must be a finite, non-negative duration");
  }
  if (options.schedule.length() == absl::InfiniteDuration() && options.max_requests == 0) {
    return absl::InvalidArgumentError("an unbounded schedule needs max_requests");
  }
  if (options.transport == Transport::kH2) return CheckH2Carries(options.stream, options.client);
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckH2Carries(bool stream, const client::ClientOptions& client) {
  if (stream) {
    return absl::InvalidArgumentError("--transport h2 sends unary calls; --stream needs grpc");
  }
  if (client.UsesTls()) {
    return absl::InvalidArgumentError("--transport h2 is plaintext only; TLS needs grpc");
  }
  return absl::OkStatus();
}

absl::Status CheckConnectionsAndThreads(int64_t connections, int64_t threads) {
  if (connections < 1 || connections > kMaxConnections) {
    return absl::InvalidArgumentError(
        absl::StrCat("--connections is ", connections, "; want 1 to ", kMaxConnections));
  }
  if (threads < 1 || threads > kMaxThreads) {
    return absl::InvalidArgumentError(
        absl::StrCat("--threads is ", threads, "; want 1 to ", kMaxThreads));
  }
  return absl::OkStatus();
}

absl::StatusOr<RunResult> RunLoad(const RunOptions& options, const v1::AttendRequest& request) {
  ATTN_RETURN_IF_ERROR(CheckOptions(options));
  if (options.transport == Transport::kH2) {
    // Connection-major order, as below.
    std::vector<std::string> addresses;
    for (int c = 0; c < options.connections; ++c) {
      addresses.insert(addresses.end(), options.targets.begin(), options.targets.end());
    }
    Runner runner(options, {}, request);
    ATTN_RETURN_IF_ERROR(runner.ConnectH2(addresses));
    return runner.Run();
  }
  // Connection-major order: consecutive calls go to consecutive targets.
  std::vector<Channel> channels;
  for (int c = 0; c < options.connections; ++c) {
    for (const std::string& target : options.targets) {
      client::ClientOptions client_options = options.client;
      client_options.target = target;
      client_options.own_connection = true;
      ATTN_ASSIGN_OR_RETURN(std::unique_ptr<client::AttentionClient> client,
                            client::AttentionClient::Create(client_options));
      Channel channel;
      channel.channel = client->channel();
      channel.stub = std::make_unique<grpc::GenericStub>(channel.channel);
      channels.push_back(std::move(channel));
    }
  }
  const auto connect_by =
      std::chrono::system_clock::now() +
      std::chrono::nanoseconds(absl::ToInt64Nanoseconds(options.connect_timeout));
  for (size_t i = 0; i < channels.size(); ++i) {
    if (!channels[i].channel->WaitForConnected(connect_by)) {
      return absl::UnavailableError(
          absl::StrCat("cannot connect to ", options.targets[i % options.targets.size()],
                       " within ", absl::FormatDuration(options.connect_timeout)));
    }
  }
  Runner runner(options, std::move(channels), request);
  return runner.Run();
}

}  // namespace attention::loadtest
