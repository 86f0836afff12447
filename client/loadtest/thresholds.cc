#include "client/loadtest/thresholds.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace attention::loadtest {
namespace {

absl::Status Bad(absl::string_view text, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("threshold \"", text, "\": ", why));
}

// Splits "p99<20ms" into "p99", the operator and "20ms".
bool SplitAtOperator(absl::string_view text, absl::string_view* metric, Threshold::Op* op,
                     absl::string_view* value) {
  const size_t at = text.find_first_of("<>");
  if (at == absl::string_view::npos) return false;
  const bool equal = at + 1 < text.size() && text[at + 1] == '=';
  if (text[at] == '<') {
    *op = equal ? Threshold::Op::kLessOrEqual : Threshold::Op::kLess;
  } else {
    *op = equal ? Threshold::Op::kGreaterOrEqual : Threshold::Op::kGreater;
  }
  *metric = absl::StripAsciiWhitespace(text.substr(0, at));
  *value = absl::StripAsciiWhitespace(text.substr(at + (equal ? 2 : 1)));
  return true;
}

// "20ms" in nanoseconds.
bool ParseLatency(absl::string_view value, double* ns) {
  constexpr std::pair<absl::string_view, double> kUnits[] = {
      {"ns", 1}, {"us", 1e3}, {"ms", 1e6}, {"s", 1e9}};
  for (const auto& [unit, scale] : kUnits) {
    absl::string_view number = value;
    if (absl::ConsumeSuffix(&number, unit) && absl::SimpleAtod(number, ns)) {
      *ns *= scale;
      return *ns >= 0;
    }
  }
  return false;
}

bool Holds(double value, Threshold::Op op, double bound) {
  switch (op) {
    case Threshold::Op::kLess:
      return value < bound;
    case Threshold::Op::kLessOrEqual:
      return value <= bound;
    case Threshold::Op::kGreater:
      return value > bound;
    case Threshold::Op::kGreaterOrEqual:
      return value >= bound;
  }
  return false;
}

}  // namespace

std::string FormatLatency(double ns) {
  if (ns < 1e3) return absl::StrFormat("%.0fns", ns);
  if (ns < 1e4) return absl::StrFormat("%.2fus", ns / 1e3);
  if (ns < 1e6) return absl::StrFormat("%.0fus", ns / 1e3);
  if (ns < 1e9) return absl::StrFormat("%.2fms", ns / 1e6);
  return absl::StrFormat("%.2fs", ns / 1e9);
}

absl::StatusOr<Threshold> ParseThreshold(absl::string_view text) {
  Threshold threshold;
  threshold.text = std::string(absl::StripAsciiWhitespace(text));
  absl::string_view metric;
  absl::string_view value;
  if (!SplitAtOperator(threshold.text, &metric, &threshold.op, &value)) {
    return Bad(text, "want METRIC<VALUE or METRIC>VALUE, e.g. p99<20ms, errors<0.1%, rps>1000");
  }
  if (metric == "errors") {
    absl::string_view number = value;
    const bool percent = absl::ConsumeSuffix(&number, "%");
    if (!absl::SimpleAtod(number, &threshold.bound) || threshold.bound < 0) {
      return Bad(text, "errors takes a count (errors<5) or a percentage (errors<0.1%)");
    }
    threshold.metric = percent ? Threshold::Metric::kErrorFraction : Threshold::Metric::kErrorCount;
    if (percent) threshold.bound /= 100;
    return threshold;
  }
  if (metric == "rps") {
    if (!absl::SimpleAtod(value, &threshold.bound) || threshold.bound < 0) {
      return Bad(text, "rps takes a number of answers per second, e.g. rps>1000");
    }
    threshold.metric = Threshold::Metric::kThroughput;
    return threshold;
  }
  absl::string_view quantile = metric;
  if (metric == "max") {
    threshold.metric = Threshold::Metric::kLatencyMax;
  } else if (metric == "mean") {
    threshold.metric = Threshold::Metric::kLatencyMean;
  } else if (absl::ConsumePrefix(&quantile, "p") &&
             absl::SimpleAtod(quantile, &threshold.quantile) && threshold.quantile > 0 &&
             threshold.quantile < 100) {
    threshold.metric = Threshold::Metric::kLatencyQuantile;
    threshold.quantile /= 100;
  } else {
    return Bad(text,
               absl::StrCat("unknown metric \"", metric,
                            "\"; want p50, p90, p99, p99.9, p99.99, max, mean, errors or rps"));
  }
  if (!ParseLatency(value, &threshold.bound)) {
    return Bad(text, absl::StrCat("\"", value, "\" is not a latency with a unit (ns, us, ms, s)"));
  }
  return threshold;
}

std::string ThresholdResult::Describe() const {
  if (!measured) return absl::StrCat(threshold.text, ": no measured call");
  std::string value_text;
  switch (threshold.metric) {
    case Threshold::Metric::kErrorFraction:
      value_text = absl::StrFormat("errors are %.4g%%", value * 100);
      break;
    case Threshold::Metric::kErrorCount:
      value_text = absl::StrFormat("errors are %.0f", value);
      break;
    case Threshold::Metric::kThroughput:
      value_text = absl::StrFormat("rps is %.1f (answered OK)", value);
      break;
    default:
      value_text = absl::StrCat(
          absl::StripAsciiWhitespace(
              absl::string_view(threshold.text).substr(0, threshold.text.find_first_of("<>"))),
          " is ", FormatLatency(value));
  }
  return absl::StrCat(threshold.text, ": ", value_text);
}

std::vector<ThresholdResult> EvaluateThresholds(const std::vector<Threshold>& thresholds,
                                                const LoadStats& stats) {
  std::vector<ThresholdResult> results;
  for (const Threshold& threshold : thresholds) {
    ThresholdResult result;
    result.threshold = threshold;
    switch (threshold.metric) {
      case Threshold::Metric::kLatencyQuantile:
        result.value = static_cast<double>(stats.latency.ValueAtQuantile(threshold.quantile));
        break;
      case Threshold::Metric::kLatencyMax:
        result.value = static_cast<double>(stats.latency.max());
        break;
      case Threshold::Metric::kLatencyMean:
        result.value = stats.latency.mean();
        break;
      case Threshold::Metric::kErrorFraction:
        result.value = stats.error_fraction();
        break;
      case Threshold::Metric::kErrorCount:
        result.value = static_cast<double>(stats.errors());
        break;
      case Threshold::Metric::kThroughput:
        result.value = stats.ok_rps();
        break;
    }
    const bool latency = threshold.metric == Threshold::Metric::kLatencyQuantile ||
                         threshold.metric == Threshold::Metric::kLatencyMax ||
                         threshold.metric == Threshold::Metric::kLatencyMean;
    // An empty histogram reads 0, which would pass any `<` gate; so would
    // the error fraction of no call (0 of 0). A count of errors is measured
    // by a run of no call: none failed.
    if (latency) {
      result.measured = stats.latency.count() > 0;
    } else if (threshold.metric == Threshold::Metric::kErrorFraction) {
      result.measured = stats.requests() > 0;
    } else {
      result.measured = true;
    }
    result.passed = result.measured && Holds(result.value, threshold.op, threshold.bound);
    results.push_back(std::move(result));
  }
  return results;
}

int ThresholdExitCode(const std::vector<ThresholdResult>& results) {
  for (const ThresholdResult& result : results) {
    if (!result.passed) return kExitThreshold;
  }
  return kExitOk;
}

}  // namespace attention::loadtest
