#ifndef ATTENTION_CLIENT_LOADTEST_RUNNER_H_
#define ATTENTION_CLIENT_LOADTEST_RUNNER_H_

// Drives the load: gRPC's completion-queue API on a few threads (no thread
// per call), one pre-serialized request shared by every call, call objects
// reused from a pool. Open loops send from one pacing thread at the
// schedule's intended times and measure latency from them.

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attention/v1/attention.pb.h"
#include "client/attention_client.h"
#include "client/loadtest/schedule.h"
#include "client/loadtest/stats.h"
#include "client/loadtest/workload.h"

namespace attention::loadtest {

// A snapshot for the live progress line.
struct Progress {
  absl::Duration elapsed;   // since the start, warm-up included
  bool warming_up = false;  // the last interval was warm-up
  double target = 0;        // the schedule's rate or concurrency now
  // Since the start, warm-up included.
  int64_t sent = 0;
  int64_t completed = 0;
  int64_t errors = 0;
  int64_t in_flight = 0;
  double rps = 0;      // answers per second over the last interval
  int64_t p99_ns = 0;  // latency (from the intended send time) of the measurement so far
};

// One progress interval of the measurement.
struct TimelinePoint {
  double t_s = 0;     // the interval's end, from the start of the measurement
  double target = 0;  // the schedule's mean over the interval
  int64_t sent = 0;   // in the interval
  int64_t completed = 0;
  int64_t errors = 0;
  // Latency from the intended send time of the interval's answers.
  int64_t p50_ns = 0;
  int64_t p99_ns = 0;
  int64_t max_ns = 0;
  // --sessions: steps answered OK in the interval, and the cache bytes they
  // read (SessionStats::cache_bytes_read's share).
  int64_t steps = 0;
  double cache_bytes_read = 0;
};

// The most --connections to each target, and --threads, a run takes.
inline constexpr int kMaxConnections = 1024;
inline constexpr int kMaxThreads = 64;
// INVALID_ARGUMENT naming --connections or --threads outside those ranges.
absl::Status CheckConnectionsAndThreads(int64_t connections, int64_t threads);

// OK, or INVALID_ARGUMENT when the h2 transport cannot carry the run: it
// sends plaintext unary calls only.
absl::Status CheckH2Carries(bool stream, const client::ClientOptions& client);

// How calls travel: gRPC's C++ client, or HTTP/2 through nghttp2
// (h2_transport.h: plaintext unary calls to HOST:PORT targets, about a third
// of the CPU per call).
enum class Transport { kGrpc, kH2 };

struct RunOptions {
  Transport transport = Transport::kGrpc;
  // gRPC targets ("HOST:PORT", "dns:///NAME:PORT"); calls go round-robin over
  // them, and over `connections` channels (TCP connections) to each.
  std::vector<std::string> targets;
  int connections = 1;
  // Credentials, token, message size and the per-call timeout; its target is
  // ignored.
  client::ClientOptions client;
  // How long each channel may take to connect before RunLoad gives up.
  absl::Duration connect_timeout = absl::Seconds(10);

  // The measured load. Rate schedules are open loops; with max_in_flight > 0
  // a send that finds that many calls unanswered waits for one, late.
  Schedule schedule = Schedule::Constant(LoadKind::kConcurrency, 1, absl::Seconds(10));
  Arrival arrival = Arrival::kConstant;
  int64_t max_in_flight = 0;
  // Load at the schedule's first value before the measurement; not counted.
  absl::Duration warmup;
  // Measured calls to send at most; 0 for no limit.
  int64_t max_requests = 0;
  // AttendStream: one stream per channel, each call a message on it.
  bool stream = false;
  // Threads polling completion queues (kGrpc; kH2 runs one thread).
  int threads = 1;
  // Seeds Poisson arrivals.
  uint64_t seed = 1;
  // Checks every OK answer when set (a full parse of each; slower).
  const Verifier* verifier = nullptr;

  absl::Duration progress_interval = absl::Seconds(1);
  // Called on the calling thread of RunLoad once per progress_interval.
  std::function<void(const Progress&)> on_progress;
  // When it turns true, sending stops and the calls in flight are cancelled;
  // what was measured is returned.
  const std::atomic<bool>* interrupted = nullptr;
};

struct RunResult {
  LoadStats stats;
  std::vector<TimelinePoint> timeline;
};

// Connects every channel (UNAVAILABLE naming the target when one does not
// connect within connect_timeout), runs the schedule, waits for every call
// sent to end (answered, failed, timed out, or cancelled once interrupted),
// and returns what the measurement saw. INVALID_ARGUMENT for options out of
// range. Failed calls are counted, not returned as errors.
absl::StatusOr<RunResult> RunLoad(const RunOptions& options, const v1::AttendRequest& request);

}  // namespace attention::loadtest

#endif  // ATTENTION_CLIENT_LOADTEST_RUNNER_H_
