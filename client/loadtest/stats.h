#ifndef ATTENTION_CLIENT_LOADTEST_STATS_H_
#define ATTENTION_CLIENT_LOADTEST_STATS_H_

// What a load test measured, in a form that adds up: the runner's threads
// each keep one and merge them at the end, and the histogram log of one run
// merges with other runs' logs.

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/loadtest/histogram.h"

namespace attention::loadtest {

// gRPC's codes are 0 (OK) to 16 (UNAUTHENTICATED).
inline constexpr int kStatusCodes = 17;
// Larger batch sizes (a server sending nonsense) are counted as this one, so
// the count vector stays small.
inline constexpr int64_t kMaxBatchSize = int64_t{1} << 16;

struct LoadStats {
  // Nanoseconds, every completed call of the measurement, OK or not.
  Histogram latency;              // answer - intended send time
  Histogram uncorrected_latency;  // answer - actual send time
  Histogram send_lateness;        // actual - intended send time
  // Nanoseconds, from the OK answers' queue_us and compute_us.
  Histogram server_queue;
  Histogram server_compute;
  // Completed calls by gRPC status code; [0] counts OK answers that passed
  // --verify (or all OK answers without it).
  std::array<int64_t, kStatusCodes> calls_by_code{};
  // OK answers that failed --verify.
  int64_t verify_failures = 0;
  // batch_sizes[n]: OK answers that ran in an engine call of n requests.
  std::vector<int64_t> batch_sizes;
  // "CODE: message" of the first failed call, "" when none failed.
  std::string first_error;

  // Calls of the measurement sent, and the run's timing: from the start of
  // the measurement to its last answer, and to its last send.
  int64_t sent = 0;
  double duration_s = 0;
  double send_window_s = 0;
  // The load tester's own CPU time over the run (warm-up included).
  double cpu_user_s = 0;
  double cpu_system_s = 0;
  int cores = 0;

  void RecordBatchSize(int64_t size, int64_t count = 1);
  // Completed calls: OK, failed, or failing --verify.
  int64_t requests() const;
  // Failed calls and --verify failures.
  int64_t errors() const;
  double error_fraction() const;
  // Completed calls per second of duration_s.
  double throughput_rps() const;
  // Calls answered OK (and passing --verify) per second of duration_s: what
  // the rps gate measures.
  double ok_rps() const;
  // Calls sent per second of send_window_s.
  double sent_rps() const;
  // CPU time / (wall time x cores), in percent.
  double cpu_percent() const;

  // Adds `other`'s counts and histograms; keeps the longer duration and
  // window, as for load testers that ran side by side; adds CPU times.
  void Merge(const LoadStats& other);

  // The histogram log: text lines that FromLog reads back, so runs made
  // apart (or on several machines) merge into one report.
  std::string ToLog() const;
  // INVALID_ARGUMENT naming the line that is not as ToLog writes it.
  static absl::StatusOr<LoadStats> FromLog(absl::string_view text);
};

// What --sessions measured beside the steps' LoadStats (whose latency
// histogram and counts are the steps').
struct SessionStats {
  // The run: decoders, each with its session, prefill rows and steps.
  int64_t sessions = 0;
  int64_t prefill_rows = 0;
  int64_t steps_per_session = 0;
  std::string cache_dtype;  // "float32" or "bfloat16"
  // Cache bytes one row of a session holds: kv_heads x (key_dim + value_dim)
  // x the cache dtype's size.
  int64_t cache_row_bytes = 0;

  // Sessions created by their prefill; closed at the end, or found no longer
  // open then (expired, evicted, or on a replica the close did not reach).
  int64_t opened = 0;
  int64_t closed = 0;
  int64_t not_open_at_close = 0;
  // Steps answered by recreating a lost session from the kept rows, and the
  // sessions recreated at least once.
  int64_t recreations = 0;
  int64_t sessions_recreated = 0;
  // By the replica that answered (its "attention-replica" metadata; "" when
  // a server sent none): sessions created there (prefills and recreations)
  // and steps it answered.
  struct Replica {
    int64_t created = 0;
    int64_t steps = 0;
  };
  std::map<std::string, Replica> replicas;
  // Steps answered OK, and the cache bytes they read: each the rows it
  // attended over (the session's position after it) x cache_row_bytes.
  int64_t steps = 0;
  double cache_bytes_read = 0;
  // Nanoseconds, every prefill (the create call), OK or not.
  Histogram prefill;

  // Merges another decoder's counts (the run's settings are kept).
  void Merge(const SessionStats& other);
  // Per second of `seconds` (the steps' duration_s).
  double steps_per_s(double seconds) const;
  double cache_bytes_read_per_s(double seconds) const;
};

// The histograms of a LoadStats under the names the log and the reports use.
struct NamedHistogram {
  const char* name;
  Histogram LoadStats::*histogram;
};
inline constexpr NamedHistogram kHistograms[] = {
    {"latency", &LoadStats::latency},
    {"uncorrected_latency", &LoadStats::uncorrected_latency},
    {"send_lateness", &LoadStats::send_lateness},
    {"server_queue", &LoadStats::server_queue},
    {"server_compute", &LoadStats::server_compute},
};

// "OK", "UNAVAILABLE", ... for a gRPC code number.
std::string StatusCodeName(int code);

}  // namespace attention::loadtest

#endif  // ATTENTION_CLIENT_LOADTEST_STATS_H_
