#include "client/loadtest/sessions.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/attention_client.h"
#include "client/session.h"
#include "common/status_macros.h"
#include "grpcpp/channel.h"

namespace attention::loadtest {
namespace {

using Clock = std::chrono::steady_clock;

int64_t NanosSince(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
}

// What one decoder measured.
struct DecoderResult {
  LoadStats stats;
  SessionStats sessions;
  // Nanoseconds from the run's start: its first step sent, last one answered.
  int64_t first_step_ns = std::numeric_limits<int64_t>::max();
  int64_t last_step_ns = 0;
};

void CountFailure(const absl::Status& status, LoadStats* stats) {
  ++stats->calls_by_code[static_cast<int>(status.code())];
  if (stats->first_error.empty()) {
    stats->first_error =
        absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message());
  }
}

// A call that was sent and failed: it counts among the calls sent, as a
// step does.
void CountFailedCall(const absl::Status& status, LoadStats* stats) {
  ++stats->sent;
  CountFailure(status, stats);
}

// After a failed call, a decoder sends it again if its outcome is unknown or
// the session moved on (client.md: "send the step again"), as while a
// replica or the proxy restarts: 0.1 s later, the wait doubling up to 1 s,
// until its failures in a row have lasted 10 s.
constexpr absl::Duration kFirstRetryWait = absl::Milliseconds(100);
constexpr absl::Duration kMaxRetryWait = absl::Seconds(1);
constexpr absl::Duration kGiveUpAfter = absl::Seconds(10);

bool SentAgainAfter(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable ||
         status.code() == absl::StatusCode::kDeadlineExceeded ||
         status.code() == absl::StatusCode::kAborted;
}

// The process's CPU time over the steps: from the first step sent to the
// moment the last decoder is done stepping, so prefills before and closes
// after do not count against the steps' window.
class StepCpu {
 public:
  explicit StepCpu(int64_t decoders) : stepping_(decoders) {}

  void FirstStep() {
    std::call_once(started_, [this] { getrusage(RUSAGE_SELF, &start_); });
  }
  // Once by every decoder, after its last step (or instead of any).
  void DoneStepping() {
    if (stepping_.fetch_sub(1) == 1) getrusage(RUSAGE_SELF, &end_);
  }
  // After every decoder is done: user and system seconds.
  void Read(double* user_s, double* system_s) {
    bool stepped = true;
    std::call_once(started_, [&stepped] { stepped = false; });
    *user_s = stepped ? Seconds(end_.ru_utime) - Seconds(start_.ru_utime) : 0;
    *system_s = stepped ? Seconds(end_.ru_stime) - Seconds(start_.ru_stime) : 0;
  }

 private:
  static double Seconds(const timeval& t) {
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6;
  }

  std::once_flag started_;
  std::atomic<int64_t> stepping_;
  rusage start_{};
  rusage end_{};
};

// The run's steps by the second they were sent or answered in, shared by
// the decoders. Thread-safe.
class StepTimeline {
 public:
  void Sent(int64_t at_ns) {
    absl::MutexLock lock(&mu_);
    ++At(at_ns).sent;
  }
  // A step answered (or failed) at `at_ns` after `latency_ns`; an OK one
  // read `cache_bytes`.
  void Answered(int64_t at_ns, int64_t latency_ns, bool ok, double cache_bytes) {
    absl::MutexLock lock(&mu_);
    Second& second = At(at_ns);
    ++second.completed;
    second.latency.Record(latency_ns);
    if (ok) {
      ++second.steps;
      second.cache_bytes_read += cache_bytes;
    } else {
      ++second.errors;
    }
  }
  // The points, the last one ending at `end_ns` (the last answer).
  std::vector<TimelinePoint> Points(int64_t end_ns) {
    absl::MutexLock lock(&mu_);
    std::vector<TimelinePoint> points;
    for (size_t i = 0; i < seconds_.size(); ++i) {
      const Second& second = seconds_[i];
      points.push_back(TimelinePoint{
          .t_s = std::min(static_cast<double>(i + 1),
                          std::max(static_cast<double>(i), static_cast<double>(end_ns) * 1e-9)),
          .sent = second.sent,
          .completed = second.completed,
          .errors = second.errors,
          .p50_ns = second.latency.ValueAtQuantile(0.5),
          .p99_ns = second.latency.ValueAtQuantile(0.99),
          .max_ns = second.latency.max(),
          .steps = second.steps,
          .cache_bytes_read = second.cache_bytes_read,
      });
    }
    return points;
  }

 private:
  struct Second {
    int64_t sent = 0;
    int64_t completed = 0;
    int64_t errors = 0;
    int64_t steps = 0;
    double cache_bytes_read = 0;
    Histogram latency;
  };
  Second& At(int64_t at_ns) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const size_t index = static_cast<size_t>(std::max<int64_t>(at_ns, 0) / 1'000'000'000);
    if (index >= seconds_.size()) seconds_.resize(index + 1);
    return seconds_[index];
  }

  absl::Mutex mu_;
  std::vector<Second> seconds_ ABSL_GUARDED_BY(mu_);
};

class Decoder {
 public:
  Decoder(const SessionLoadOptions& options, client::AttentionClient* client, std::string id,
          Clock::time_point start, StepCpu* cpu, StepTimeline* timeline)
      : options_(options),
        client_(client),
        id_(std::move(id)),
        start_(start),
        cpu_(cpu),
        timeline_(timeline) {}

  DecoderResult Run() {
    client::SessionOptions session_options;
    session_options.id = id_;
    session_options.request = options_.step;
    session_options.request.clear_query();
    session_options.request.clear_key();
    session_options.request.clear_value();
    session_options.cache_dtype = options_.cache_dtype;
    session_options.keep_rows = options_.keep_rows;
    session_options.stream = options_.stream;
    absl::StatusOr<std::unique_ptr<client::Session>> session =
        client::Session::Create(client_, std::move(session_options));
    if (!session.ok()) {
      CountFailure(session.status(), &result_.stats);
      cpu_->DoneStepping();
      return std::move(result_);
    }
    if (Prefill(**session)) {
      for (int64_t i = 0; i < options_.steps && !Interrupted();) {
        absl::Status stepped = Step(**session);
        if (stepped.ok()) {
          ++i;
          retry_ = {};
        } else if (!WaitToSendAgain(stepped, /*until_interrupted=*/true)) {
          break;
        }
      }
    }
    cpu_->DoneStepping();
    // Close sends nothing for a session no call created, but also closes
    // one a prefill whose answer was lost may have created. An interrupted
    // run still closes its sessions, sent again as the steps are.
    if (!lost_) {
      const bool open = (*session)->open();
      retry_ = {};
      while (true) {
        const absl::Status closed = (*session)->Close();
        if (closed.ok()) {
          if (open) {
            ++((*session)->found_at_close() ? result_.sessions.closed
                                            : result_.sessions.not_open_at_close);
          }
          break;
        }
        CountFailedCall(closed, &result_.stats);
        if (!WaitToSendAgain(closed, /*until_interrupted=*/false)) break;
      }
    }
    result_.sessions.recreations = (*session)->recreations();
    result_.sessions.sessions_recreated = (*session)->recreations() > 0 ? 1 : 0;
    return std::move(result_);
  }

 private:
  bool Interrupted() const {
    return options_.interrupted != nullptr && options_.interrupted->load();
  }

  // After the call failed with `status`: true once it is time to send it
  // again (SentAgainAfter), false if it is not to be (another error, failures
  // in a row for kGiveUpAfter, or with `until_interrupted` a Ctrl-C).
  bool WaitToSendAgain(const absl::Status& status, bool until_interrupted) {
    if (!SentAgainAfter(status)) return false;
    const absl::Time now = absl::Now();
    if (retry_.wait == absl::ZeroDuration()) {
      retry_ = {now, kFirstRetryWait};
    } else {
      retry_.wait = std::min(retry_.wait * 2, kMaxRetryWait);
    }
    if (now + retry_.wait - retry_.first_failure > kGiveUpAfter) return false;
    const absl::Time until = now + retry_.wait;
    while (absl::Now() < until) {
      if (until_interrupted && Interrupted()) return false;
      absl::SleepFor(std::min(until - absl::Now(), absl::Milliseconds(10)));
    }
    return !(until_interrupted && Interrupted());
  }

  // Sends `request`'s rows as the session's next step.
  static absl::StatusOr<v1::AttendResponse> Send(client::Session& session,
                                                 const v1::AttendRequest& request) {
    std::optional<v1::Tensor> key, value;
    if (request.has_key()) key = request.key();
    if (request.has_value()) value = request.value();
    return session.Step(request.query(), std::move(key), std::move(value));
  }

  bool Prefill(client::Session& session) {
    while (true) {
      const Clock::time_point sent = Clock::now();
      absl::StatusOr<v1::AttendResponse> answer = Send(session, options_.prefill);
      result_.sessions.prefill.Record(NanosSince(sent));
      if (answer.ok()) break;
      CountFailedCall(answer.status(), &result_.stats);
      if (!WaitToSendAgain(answer.status(), /*until_interrupted=*/true)) return false;
    }
    retry_ = {};
    ++result_.sessions.opened;
    ++result_.sessions.replicas[session.replica()].created;
    return true;
  }

  absl::Status Step(client::Session& session) {
    cpu_->FirstStep();
    const int64_t sent_ns = NanosSince(start_);
    result_.first_step_ns = std::min(result_.first_step_ns, sent_ns);
    ++result_.stats.sent;
    timeline_->Sent(sent_ns);
    const int64_t recreations = session.recreations();
    absl::StatusOr<v1::AttendResponse> answer = Send(session, options_.step);
    const int64_t done_ns = NanosSince(start_);
    result_.last_step_ns = std::max(result_.last_step_ns, done_ns);
    LoadStats& stats = result_.stats;
    stats.latency.Record(done_ns - sent_ns);
    stats.uncorrected_latency.Record(done_ns - sent_ns);
    stats.send_lateness.Record(0);
    if (!answer.ok()) {
      timeline_->Answered(done_ns, done_ns - sent_ns, /*ok=*/false, 0);
      CountFailure(answer.status(), &stats);
      lost_ = answer.status().code() == absl::StatusCode::kNotFound;
      return answer.status();
    }
    stats.server_queue.Record(answer->queue_us() * 1000);
    stats.server_compute.Record(answer->compute_us() * 1000);
    stats.RecordBatchSize(answer->batch_size());
    absl::Status verified = absl::OkStatus();
    if (options_.verifier != nullptr) verified = options_.verifier->Check(*answer);
    if (verified.ok()) {
      ++stats.calls_by_code[0];
    } else {
      ++stats.verify_failures;
      if (stats.first_error.empty()) {
        stats.first_error = absl::StrCat("VERIFY_FAILED: ", verified.message());
      }
    }
    ++result_.sessions.steps;
    SessionStats::Replica& replica = result_.sessions.replicas[session.replica()];
    ++replica.steps;
    if (session.recreations() > recreations) ++replica.created;
    const double cache_bytes =
        static_cast<double>(session.position()) * static_cast<double>(options_.cache_row_bytes);
    result_.sessions.cache_bytes_read += cache_bytes;
    timeline_->Answered(done_ns, done_ns - sent_ns, /*ok=*/true, cache_bytes);
    return absl::OkStatus();
  }

  const SessionLoadOptions& options_;
  client::AttentionClient* client_;
  const std::string id_;
  const Clock::time_point start_;
  StepCpu* cpu_;
  StepTimeline* timeline_;
  DecoderResult result_;
  // A step found the session gone (NOT_FOUND): there is nothing to close.
  bool lost_ = false;
  // The failures in a row of the call being sent again: since when, and the
  // wait before the next send (zero: none failed).
  struct {
    absl::Time first_failure;
    absl::Duration wait;
  } retry_;
};

absl::Status CheckOptions(const SessionLoadOptions& options) {
  if (options.targets.empty()) return absl::InvalidArgumentError("no target given");
  if (options.sessions < 1 || options.sessions > kMaxSessions) {
    return absl::InvalidArgumentError(
        absl::StrCat("--sessions is ", options.sessions, "; want 1 to ", kMaxSessions));
  }
  if (options.steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--steps is ", options.steps, "; want 0 or more"));
  }
  if (options.connections < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--connections is ", options.connections, "; want 1 or more"));
  }
  return absl::OkStatus();
}

}  // namespace

int64_t CacheRowBytes(int64_t kv_heads, int64_t key_dim, int64_t value_dim,
                      v1::Tensor::DType cache_dtype) {
  return kv_heads * (key_dim + value_dim) * (cache_dtype == v1::Tensor::BFLOAT16 ? 2 : 4);
}

absl::StatusOr<SessionRunResult> RunSessions(const SessionLoadOptions& options) {
  ATTN_RETURN_IF_ERROR(CheckOptions(options));
  // Connection-major order, as the runner's: consecutive decoders go to
  // consecutive targets.
  std::vector<std::unique_ptr<client::AttentionClient>> clients;
  for (int c = 0; c < options.connections; ++c) {
    for (const std::string& target : options.targets) {
      client::ClientOptions client_options = options.client;
      client_options.target = target;
      client_options.own_connection = true;
      ATTN_ASSIGN_OR_RETURN(std::unique_ptr<client::AttentionClient> client,
                            client::AttentionClient::Create(client_options));
      clients.push_back(std::move(client));
    }
  }
  const auto connect_by =
      std::chrono::system_clock::now() +
      std::chrono::nanoseconds(absl::ToInt64Nanoseconds(options.connect_timeout));
  for (size_t i = 0; i < clients.size(); ++i) {
    if (!clients[i]->channel()->WaitForConnected(connect_by)) {
      return absl::UnavailableError(
          absl::StrCat("cannot connect to ", options.targets[i % options.targets.size()],
                       " within ", absl::FormatDuration(options.connect_timeout)));
    }
  }
  const std::string prefix =
      options.id_prefix.empty()
          ? absl::StrCat("loadtest-", getpid(), "-", absl::ToUnixMicros(absl::Now()), "-")
          : options.id_prefix;

  StepCpu cpu(options.sessions);
  StepTimeline timeline;
  const Clock::time_point start = Clock::now();
  std::vector<DecoderResult> results(options.sessions);
  std::vector<std::thread> threads;
  threads.reserve(options.sessions);
  for (int64_t i = 0; i < options.sessions; ++i) {
    threads.emplace_back([&, i] {
      Decoder decoder(options, clients[i % clients.size()].get(), absl::StrCat(prefix, i), start,
                      &cpu, &timeline);
      results[i] = decoder.Run();
    });
  }
  for (std::thread& thread : threads) thread.join();

  SessionRunResult run;
  SessionStats& sessions = run.sessions;
  sessions.sessions = options.sessions;
  sessions.steps_per_session = options.steps;
  sessions.prefill_rows = options.prefill_rows;
  sessions.cache_dtype = options.cache_dtype == v1::Tensor::BFLOAT16 ? "bfloat16" : "float32";
  sessions.cache_row_bytes = options.cache_row_bytes;
  int64_t first_step_ns = std::numeric_limits<int64_t>::max();
  int64_t last_step_ns = 0;
  for (const DecoderResult& result : results) {
    run.stats.Merge(result.stats);
    sessions.Merge(result.sessions);
    first_step_ns = std::min(first_step_ns, result.first_step_ns);
    last_step_ns = std::max(last_step_ns, result.last_step_ns);
  }
  LoadStats& stats = run.stats;
  stats.duration_s =
      last_step_ns > first_step_ns ? static_cast<double>(last_step_ns - first_step_ns) * 1e-9 : 0;
  stats.send_window_s = stats.duration_s;
  cpu.Read(&stats.cpu_user_s, &stats.cpu_system_s);
  stats.cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  run.timeline = timeline.Points(last_step_ns);
  return run;
}

}  // namespace attention::loadtest
