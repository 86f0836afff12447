#ifndef ATTENTION_CLIENT_LOADTEST_THRESHOLDS_H_
#define ATTENTION_CLIENT_LOADTEST_THRESHOLDS_H_

// Pass/fail gates on a run for CI: --threshold 'p99<20ms', 'errors<0.1%', ...

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/loadtest/stats.h"

namespace attention::loadtest {

struct Threshold {
  enum class Metric {
    kLatencyQuantile,  // pNN: latency from the intended send time
    kLatencyMax,       // max
    kLatencyMean,      // mean
    kErrorFraction,    // errors<N%
    kErrorCount,       // errors<N
    kThroughput,       // rps: answers per second
  };
  enum class Op { kLess, kLessOrEqual, kGreater, kGreaterOrEqual };

  std::string text;  // as given
  Metric metric = Metric::kLatencyQuantile;
  double quantile = 0;  // kLatencyQuantile: in (0, 1)
  Op op = Op::kLess;
  double bound = 0;  // nanoseconds, a fraction, a count or calls/s
};

// "METRIC OP VALUE": METRIC one of p50, p90, p99, p99.9, p99.99 (any pNN in
// (0, 100)), max, mean (latencies, VALUE with a unit: ns, us, ms or s),
// errors (VALUE a count, or a percentage with %) or rps; OP one of <, <=,
// >, >=. INVALID_ARGUMENT saying what is wrong with `text`.
absl::StatusOr<Threshold> ParseThreshold(absl::string_view text);

struct ThresholdResult {
  Threshold threshold;
  double value = 0;  // what the run measured, in the threshold's units
  // False for a latency gate on a run that measured no call (every session's
  // prefill failed, say): broken, since nothing showed the latency held.
  bool measured = true;
  bool passed = false;
  // "p99<20ms: p99 is 25.3ms", "errors<0.1%: errors are 0.02%",
  // "p99<20ms: no measured call".
  std::string Describe() const;
};

std::vector<ThresholdResult> EvaluateThresholds(const std::vector<Threshold>& thresholds,
                                                const LoadStats& stats);

// The load tester's exit codes.
inline constexpr int kExitOk = 0;
inline constexpr int kExitSetup = 1;      // a bad command line, or the run could not start
inline constexpr int kExitThreshold = 2;  // a threshold was broken

// kExitThreshold when any result failed, else kExitOk.
int ThresholdExitCode(const std::vector<ThresholdResult>& results);

// "512us", "1.23ms", "2.50s": a duration in nanoseconds for people.
std::string FormatLatency(double ns);

}  // namespace attention::loadtest

#endif  // ATTENTION_CLIENT_LOADTEST_THRESHOLDS_H_
