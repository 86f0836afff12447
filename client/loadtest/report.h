#ifndef ATTENTION_CLIENT_LOADTEST_REPORT_H_
#define ATTENTION_CLIENT_LOADTEST_REPORT_H_

// A load test's results for people (the summary), for programs (JSON, and a
// CSV row per run) and for later merging (LoadStats::ToLog).

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "client/loadtest/runner.h"
#include "client/loadtest/stats.h"
#include "client/loadtest/thresholds.h"

namespace attention::loadtest {

// How a run was made.
struct RunDescription {
  std::vector<std::string> targets;
  int connections = 1;
  int threads = 1;
  bool stream = false;
  std::string transport = "grpc";
  bool open_loop = false;
  std::string schedule;   // the measured schedule, as Schedule::ToString
  std::string arrival;    // open loops: "constant" or "poisson"
  double target_rps = 0;  // open loops: the schedule's mean rate
  int64_t max_in_flight = 0;
  double warmup_s = 0;
  std::string workload;  // e.g. "model demo, query [1, 16, 64] float32"
};

struct Report {
  std::optional<RunDescription> run;  // absent for merged logs
  LoadStats stats;
  std::optional<SessionStats> sessions;  // --sessions runs
  std::vector<TimelinePoint> timeline;
  std::vector<ThresholdResult> thresholds;
};

// The quantiles every latency is reported at, with their JSON keys.
struct ReportedQuantile {
  const char* key;
  double quantile;
};
inline constexpr ReportedQuantile kReportedQuantiles[] = {
    {"p50", 0.5}, {"p90", 0.9}, {"p99", 0.99}, {"p99.9", 0.999}, {"p99.99", 0.9999}};
// The JSON's histograms hold these too (then max): the HTML report's
// percentile curves reach 99.999%.
inline constexpr ReportedQuantile kExtraJsonQuantiles[] = {{"p99.999", 0.99999}};
// kReportedQuantiles, then kExtraJsonQuantiles.
std::vector<ReportedQuantile> JsonQuantiles();

// "1.23 GB", "456 MB": bytes for people, in powers of 1000.
std::string FormatBytes(double bytes);

// The readable summary for stdout.
std::string FormatSummary(const Report& report);
// One JSON object: throughput_rps, requests, errors (by code), latency_us and
// uncorrected_latency_us (p50 ... p99.999, max, with min, mean and count),
// send lateness, the server's queue and compute times, batch sizes, CPU use,
// the timeline (with each interval's rates) and the thresholds.
std::string FormatJson(const Report& report);
// A CSV header and one row of a run's numbers (latencies in microseconds):
// runs append rows under one header.
std::string CsvHeader();
std::string CsvRow(const Report& report);

}  // namespace attention::loadtest

#endif  // ATTENTION_CLIENT_LOADTEST_REPORT_H_
