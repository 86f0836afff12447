#include "client/loadtest/report.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace attention::loadtest {
namespace {

using Json = nlohmann::ordered_json;

// The summary's row label and note of each histogram, in kHistograms' order.
struct RowText {
  const char* label;
  const char* note;
};
constexpr RowText kRowText[] = {
    {"latency", "from the intended send time"},
    {"uncorrected", "from the actual send time, as ghz would report it"},
    {"send lateness", "actual - intended send time"},
    {"server queue", "queue_us of the OK answers"},
    {"server compute", "compute_us of the OK answers"},
};
static_assert(std::size(kRowText) == std::size(kHistograms));

constexpr size_t kBatchSizesShown = 6;

double Microseconds(double ns) { return std::round(ns) / 1e3; }

Json HistogramJson(const Histogram& histogram) {
  Json json;
  json["count"] = histogram.count();
  json["min"] = Microseconds(static_cast<double>(histogram.min()));
  json["mean"] = Microseconds(histogram.mean());
  for (const ReportedQuantile& q : JsonQuantiles()) {
    json[q.key] = Microseconds(static_cast<double>(histogram.ValueAtQuantile(q.quantile)));
  }
  json["max"] = Microseconds(static_cast<double>(histogram.max()));
  return json;
}

double MeanBatchSize(const LoadStats& stats) {
  int64_t answers = 0;
  int64_t requests = 0;
  for (size_t size = 0; size < stats.batch_sizes.size(); ++size) {
    answers += stats.batch_sizes[size];
    requests += stats.batch_sizes[size] * static_cast<int64_t>(size);
  }
  return answers == 0 ? 0 : static_cast<double>(requests) / static_cast<double>(answers);
}

// The summary's row of `histogram`'s quantiles and max, with `note`.
std::string HistogramRow(const char* label, const Histogram& histogram, const char* note) {
  std::string text = absl::StrFormat("%-15s", label);
  for (const ReportedQuantile& q : kReportedQuantiles) {
    absl::StrAppend(&text, absl::StrFormat("%10s", FormatLatency(static_cast<double>(
                                                       histogram.ValueAtQuantile(q.quantile)))));
  }
  absl::StrAppend(
      &text,
      absl::StrFormat("%10s  %s\n", FormatLatency(static_cast<double>(histogram.max())), note));
  return text;
}

std::string SessionSummary(const SessionStats& sessions, double seconds) {
  const std::string not_open =
      sessions.not_open_at_close > 0
          ? absl::StrFormat(", %d no longer open at close", sessions.not_open_at_close)
          : "";
  std::string text = absl::StrFormat(
      "\n%-15s%d of %d opened with %d rows, %d closed%s, %d recreated; %s cache, %s a row\n",
      "sessions", sessions.opened, sessions.sessions, sessions.prefill_rows, sessions.closed,
      not_open, sessions.recreations, sessions.cache_dtype,
      FormatBytes(static_cast<double>(sessions.cache_row_bytes)));
  absl::StrAppend(
      &text, absl::StrFormat("%-15s%d of %d answered in %.2fs: %.1f/s\n", "steps", sessions.steps,
                             sessions.sessions * sessions.steps_per_session, seconds,
                             sessions.steps_per_s(seconds)));
  absl::StrAppend(&text, absl::StrFormat("%-15s%s in %.2fs: %s/s\n", "cache read",
                                         FormatBytes(sessions.cache_bytes_read), seconds,
                                         FormatBytes(sessions.cache_bytes_read_per_s(seconds))));
  if (sessions.sessions_recreated > 0) {
    absl::StrAppend(&text, absl::StrFormat("%-15s%d sessions recreated (%d steps)\n",
                                           "recreated", sessions.sessions_recreated,
                                           sessions.recreations));
  }
  for (const auto& [name, replica] : sessions.replicas) {
    absl::StrAppend(&text, absl::StrFormat("%-15s%s: %d sessions created, %d steps\n", "replica",
                                           name.empty() ? "(unnamed)" : name, replica.created,
                                           replica.steps));
  }
  return text;
}

std::string Plural(int64_t n, const char* one, const char* many) {
  return absl::StrCat(n, " ", n == 1 ? one : many);
}

std::string DescribeRun(const RunDescription& run) {
  std::string text = absl::StrCat(
      "attention_loadtest: ", run.open_loop ? "open loop " : "closed loop ", run.schedule);
  if (run.open_loop) {
    absl::StrAppend(&text, ", ", run.arrival, " arrivals");
    if (run.max_in_flight > 0) {
      absl::StrAppend(&text, ", at most ", run.max_in_flight, " in flight");
    }
  }
  if (run.warmup_s > 0) absl::StrAppend(&text, absl::StrFormat(", %gs warm-up", run.warmup_s));
  absl::StrAppend(&text, run.stream ? ", AttendStream" : ", unary Attend",
                  run.transport == "h2" ? " over nghttp2\n" : "\n");
  absl::StrAppend(&text, "  ", absl::StrJoin(run.targets, " "), " x ",
                  Plural(run.connections, "connection", "connections"), ", ",
                  Plural(run.transport == "h2" ? 1 : run.threads, "thread", "threads"), "; ",
                  run.workload, "\n");
  return text;
}

}  // namespace

std::vector<ReportedQuantile> JsonQuantiles() {
  std::vector<ReportedQuantile> quantiles(std::begin(kReportedQuantiles),
                                          std::end(kReportedQuantiles));
  quantiles.insert(quantiles.end(), std::begin(kExtraJsonQuantiles),
                   std::end(kExtraJsonQuantiles));
  return quantiles;
}

std::string FormatBytes(double bytes) {
  constexpr const char* kUnits[] = {"B", "kB", "MB", "GB", "TB", "PB"};
  size_t unit = 0;
  while (bytes >= 999.5 && unit + 1 < std::size(kUnits)) {
    bytes /= 1000;
    ++unit;
  }
  return unit == 0 ? absl::StrFormat("%.0f B", bytes)
                   : absl::StrFormat("%.*f %s",
                                     bytes < 9.995   ? 2
                                     : bytes < 99.95 ? 1
                                                     : 0,
                                     bytes, kUnits[unit]);
}

std::string FormatSummary(const Report& report) {
  const LoadStats& stats = report.stats;
  std::string text;
  if (report.run.has_value()) {
    absl::StrAppend(&text, DescribeRun(*report.run), "\n");
  } else {
    absl::StrAppend(&text, "attention_loadtest: merged histogram logs\n\n");
  }
  absl::StrAppend(&text, absl::StrFormat("%-15s%d in %.2fs: %.1f/s answered, %.1f/s sent",
                                         "requests", stats.requests(), stats.duration_s,
                                         stats.throughput_rps(), stats.sent_rps()));
  if (report.run.has_value() && report.run->open_loop) {
    absl::StrAppend(&text, absl::StrFormat(" (target %.1f/s)", report.run->target_rps));
  }
  absl::StrAppend(
      &text, "\n",
      absl::StrFormat("%-15s%d (%.3f%%)", "errors", stats.errors(), 100 * stats.error_fraction()));
  std::vector<std::string> by_code;
  for (int code = 1; code < kStatusCodes; ++code) {
    if (stats.calls_by_code[code] > 0) {
      by_code.push_back(absl::StrCat(StatusCodeName(code), " ", stats.calls_by_code[code]));
    }
  }
  if (stats.verify_failures > 0)
    by_code.push_back(absl::StrCat("VERIFY_FAILED ", stats.verify_failures));
  if (!by_code.empty()) absl::StrAppend(&text, ": ", absl::StrJoin(by_code, ", "));
  absl::StrAppend(&text, "\n");
  if (!stats.first_error.empty()) {
    absl::StrAppend(&text, absl::StrFormat("%-15s%s\n", "first error", stats.first_error));
  }

  absl::StrAppend(&text, absl::StrFormat("\n%-15s", ""));
  for (const ReportedQuantile& q : kReportedQuantiles) {
    absl::StrAppend(&text, absl::StrFormat("%10s", q.key));
  }
  absl::StrAppend(&text, absl::StrFormat("%10s\n", "max"));
  // Without a late send, the uncorrected and lateness rows would only repeat
  // the latency row and zeros.
  const bool late = stats.send_lateness.max() > 0;
  for (size_t i = 0; i < std::size(kHistograms); ++i) {
    const NamedHistogram& named = kHistograms[i];
    const Histogram& histogram = stats.*named.histogram;
    if (!late && (named.histogram == &LoadStats::uncorrected_latency ||
                  named.histogram == &LoadStats::send_lateness)) {
      continue;
    }
    if (histogram.count() == 0) continue;
    const bool step = report.sessions.has_value() && named.histogram == &LoadStats::latency;
    absl::StrAppend(&text,
                    HistogramRow(step ? "step" : kRowText[i].label, histogram,
                                 step ? "a session step, send to answer" : kRowText[i].note));
  }
  if (report.sessions.has_value() && report.sessions->prefill.count() > 0) {
    absl::StrAppend(&text, HistogramRow("prefill", report.sessions->prefill,
                                        "a session's create with its prefill rows"));
  }
  if (report.sessions.has_value()) {
    absl::StrAppend(&text, SessionSummary(*report.sessions, stats.duration_s));
  }

  int64_t answers = 0;
  for (int64_t n : stats.batch_sizes) answers += n;
  if (answers > 0) {
    // The most common sizes first; the JSON has them all.
    std::vector<size_t> sizes;
    for (size_t size = 0; size < stats.batch_sizes.size(); ++size) {
      if (stats.batch_sizes[size] > 0) sizes.push_back(size);
    }
    std::stable_sort(sizes.begin(), sizes.end(), [&](size_t a, size_t b) {
      return stats.batch_sizes[a] > stats.batch_sizes[b];
    });
    std::vector<std::string> shown;
    for (size_t i = 0; i < sizes.size() && i < kBatchSizesShown; ++i) {
      const int64_t n = stats.batch_sizes[sizes[i]];
      shown.push_back(
          absl::StrFormat("%d: %d (%.1f%%)", sizes[i], n,
                          100.0 * static_cast<double>(n) / static_cast<double>(answers)));
    }
    if (sizes.size() > kBatchSizesShown) {
      shown.push_back(absl::StrCat("and ", sizes.size() - kBatchSizesShown, " other sizes"));
    }
    absl::StrAppend(&text, absl::StrFormat("\n%-15smean %.2f; %s\n", "batch sizes",
                                           MeanBatchSize(stats), absl::StrJoin(shown, ", ")));
  }
  absl::StrAppend(&text, absl::StrFormat("%-15s%.2fs user + %.2fs system = %.1f%% of %d cores\n",
                                         "client CPU", stats.cpu_user_s, stats.cpu_system_s,
                                         stats.cpu_percent(), stats.cores));
  for (const ThresholdResult& result : report.thresholds) {
    absl::StrAppend(&text, absl::StrFormat("%-15s%s: %s\n", "threshold",
                                           result.passed ? "ok" : "BROKEN", result.Describe()));
  }
  return text;
}

std::string FormatJson(const Report& report) {
  const LoadStats& stats = report.stats;
  Json json;
  if (report.run.has_value()) {
    const RunDescription& run = *report.run;
    json["run"] = {
        {"targets", run.targets},     {"connections", run.connections},
        {"threads", run.threads},     {"api", run.stream ? "stream" : "unary"},
        {"transport", run.transport}, {"loop", run.open_loop ? "open" : "closed"},
        {"schedule", run.schedule},   {"warmup_s", run.warmup_s},
        {"workload", run.workload},
    };
    if (run.open_loop) {
      json["run"]["arrival"] = run.arrival;
      json["run"]["max_in_flight"] = run.max_in_flight;
      json["target_rps"] = run.target_rps;
    }
  }
  json["throughput_rps"] = stats.throughput_rps();
  json["sent_rps"] = stats.sent_rps();
  json["requests"] = stats.requests();
  json["ok"] = stats.calls_by_code[0];
  json["sent"] = stats.sent;
  json["duration_s"] = stats.duration_s;
  json["send_window_s"] = stats.send_window_s;
  Json errors = Json::object();
  for (int code = 1; code < kStatusCodes; ++code) {
    if (stats.calls_by_code[code] > 0) errors[StatusCodeName(code)] = stats.calls_by_code[code];
  }
  if (stats.verify_failures > 0) errors["VERIFY_FAILED"] = stats.verify_failures;
  json["errors"] = errors;
  json["error_count"] = stats.errors();
  json["error_rate"] = stats.error_fraction();
  if (!stats.first_error.empty()) json["first_error"] = stats.first_error;
  for (const NamedHistogram& named : kHistograms) {
    json[absl::StrCat(named.name, "_us")] = HistogramJson(stats.*named.histogram);
  }
  Json batch_sizes = Json::object();
  for (size_t size = 0; size < stats.batch_sizes.size(); ++size) {
    if (stats.batch_sizes[size] > 0) batch_sizes[absl::StrCat(size)] = stats.batch_sizes[size];
  }
  json["batch_sizes"] = batch_sizes;
  json["mean_batch_size"] = MeanBatchSize(stats);
  json["cpu"] = {{"user_s", stats.cpu_user_s},
                 {"system_s", stats.cpu_system_s},
                 {"cores", stats.cores},
                 {"percent_of_machine", stats.cpu_percent()}};
  Json timeline = Json::array();
  double previous_t_s = 0;
  for (const TimelinePoint& point : report.timeline) {
    // Counts per second of the interval (the last one may be short).
    const double interval_s = point.t_s - previous_t_s;
    previous_t_s = point.t_s;
    auto per_s = [interval_s](double count) { return interval_s > 0 ? count / interval_s : 0; };
    Json entry = {{"t_s", point.t_s},
             {"interval_s", interval_s},
             {"target", point.target},
             {"sent", point.sent},
             {"completed", point.completed},
             {"errors", point.errors},
             {"sent_per_s", per_s(static_cast<double>(point.sent))},
             {"completed_per_s", per_s(static_cast<double>(point.completed))},
             {"errors_per_s", per_s(static_cast<double>(point.errors))},
             {"p50_us", Microseconds(static_cast<double>(point.p50_ns))},
             {"p99_us", Microseconds(static_cast<double>(point.p99_ns))},
             {"max_us", Microseconds(static_cast<double>(point.max_ns))}};
    if (report.sessions.has_value()) {
      entry["steps"] = point.steps;
      entry["steps_per_s"] = per_s(static_cast<double>(point.steps));
      entry["cache_bytes_read"] = point.cache_bytes_read;
      entry["cache_bytes_read_per_s"] = per_s(point.cache_bytes_read);
    }
    timeline.push_back(std::move(entry));
  }
  json["timeline"] = timeline;
  Json thresholds = Json::array();
  bool passed = true;
  for (const ThresholdResult& result : report.thresholds) {
    thresholds.push_back({{"threshold", result.threshold.text},
                          {"value", result.value},
                          {"passed", result.passed},
                          {"description", result.Describe()}});
    passed = passed && result.passed;
  }
  json["thresholds"] = thresholds;
  json["passed"] = passed;
  if (report.sessions.has_value()) {
    const SessionStats& sessions = *report.sessions;
    json["sessions"] = {
        {"sessions", sessions.sessions},
        {"prefill_rows", sessions.prefill_rows},
        {"steps_per_session", sessions.steps_per_session},
        {"cache_dtype", sessions.cache_dtype},
        {"cache_row_bytes", sessions.cache_row_bytes},
        {"opened", sessions.opened},
        {"closed", sessions.closed},
        {"not_open_at_close", sessions.not_open_at_close},
        {"recreations", sessions.recreations},
        {"sessions_recreated", sessions.sessions_recreated},
        {"steps", sessions.steps},
        {"steps_per_s", sessions.steps_per_s(stats.duration_s)},
        {"cache_bytes_read", sessions.cache_bytes_read},
        {"cache_bytes_read_per_s", sessions.cache_bytes_read_per_s(stats.duration_s)},
        {"prefill_us", HistogramJson(sessions.prefill)},
    };
    Json replicas = Json::object();
    for (const auto& [name, replica] : sessions.replicas) {
      replicas[name] = {{"created", replica.created}, {"steps", replica.steps}};
    }
    json["sessions"]["replicas"] = replicas;
  }
  return json.dump(2) + "\n";
}

std::string CsvHeader() {
  std::vector<std::string> columns = {"schedule",       "loop",     "target_rps",
                                      "requests",       "errors",   "error_rate",
                                      "throughput_rps", "sent_rps", "duration_s"};
  for (const NamedHistogram& named : kHistograms) {
    for (const ReportedQuantile& q : kReportedQuantiles) {
      columns.push_back(absl::StrCat(named.name, "_", q.key, "_us"));
    }
    columns.push_back(absl::StrCat(named.name, "_max_us"));
  }
  columns.push_back("cpu_percent");
  return absl::StrJoin(columns, ",");
}

std::string CsvRow(const Report& report) {
  const LoadStats& stats = report.stats;
  const bool has_run = report.run.has_value();
  std::vector<std::string> cells = {
      // Schedules hold commas; a CSV cell with them is quoted.
      has_run ? absl::StrCat("\"", report.run->schedule, "\"") : "merged",
      has_run ? (report.run->open_loop ? "open" : "closed") : "",
      has_run && report.run->open_loop ? absl::StrCat(report.run->target_rps) : "",
      absl::StrCat(stats.requests()),
      absl::StrCat(stats.errors()),
      absl::StrFormat("%.6g", stats.error_fraction()),
      absl::StrFormat("%.2f", stats.throughput_rps()),
      absl::StrFormat("%.2f", stats.sent_rps()),
      absl::StrFormat("%.3f", stats.duration_s)};
  for (const NamedHistogram& named : kHistograms) {
    const Histogram& histogram = stats.*named.histogram;
    for (const ReportedQuantile& q : kReportedQuantiles) {
      cells.push_back(
          absl::StrCat(Microseconds(static_cast<double>(histogram.ValueAtQuantile(q.quantile)))));
    }
    cells.push_back(absl::StrCat(Microseconds(static_cast<double>(histogram.max()))));
  }
  cells.push_back(absl::StrFormat("%.2f", stats.cpu_percent()));
  return absl::StrJoin(cells, ",");
}

}  // namespace attention::loadtest
