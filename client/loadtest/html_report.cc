#include "client/loadtest/html_report.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <initializer_list>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/string_view.h"
#include "client/loadtest/report.h"
#include "client/loadtest/thresholds.h"
#include "nlohmann/json.hpp"

namespace attention::loadtest {
namespace {

using Json = nlohmann::ordered_json;

// One run as the page sees it: its parsed report, or why there is none.
struct Run {
  std::string label;
  std::string error;
  Json report;  // null when the run failed
};

std::string Escape(absl::string_view text) {
  std::string escaped;
  for (char c : text) {
    switch (c) {
      case '&':
        escaped += "&amp;";
        break;
      case '<':
        escaped += "&lt;";
        break;
      case '>':
        escaped += "&gt;";
        break;
      case '"':
        escaped += "&quot;";
        break;
      case '\'':
        escaped += "&#39;";
        break;
      default:
        escaped += c;
    }
  }
  return escaped;
}

// The JSON's text of a value, as FormatJson wrote it.
std::string JsonText(const Json& value) {
  return value.dump(-1, ' ', false, Json::error_handler_t::replace);
}

// The value at `path` under `json`, or null.
const Json* Find(const Json& json, std::initializer_list<absl::string_view> path) {
  const Json* at = &json;
  for (absl::string_view key : path) {
    if (!at->is_object()) return nullptr;
    auto it = at->find(std::string(key));
    if (it == at->end()) return nullptr;
    at = &*it;
  }
  return at;
}

double Number(const Json* value) {
  return value != nullptr && value->is_number() ? value->get<double>() : 0;
}

std::string Text(const Json* value) {
  if (value == nullptr || value->is_null()) return "";
  return value->is_string() ? value->get<std::string>() : JsonText(*value);
}

// --- charts -----------------------------------------------------------------

// What the y axis counts, for its labels and the points' tooltips.
enum class Unit { kMicros, kPerSecond, kBytesPerSecond, kCount, kSeconds };

std::string FormatValue(Unit unit, double value) {
  switch (unit) {
    case Unit::kMicros:
      return FormatLatency(value * 1e3);
    case Unit::kPerSecond:
      return absl::StrFormat("%.4g/s", value);
    case Unit::kBytesPerSecond:
      return absl::StrCat(FormatBytes(value), "/s");
    case Unit::kCount:
      return absl::StrFormat("%.6g", value);
    case Unit::kSeconds:
      return absl::StrFormat("%.3gs", value);
  }
  return "";
}

// The percentile curves' points: the JSON's quantile keys, then max, each at
// -log10(1 - q) on the x axis (50% at 0.3, 99.999% at 5), max one further.
struct CurvePoint {
  std::string key;
  double x;
  std::string label;
};
std::vector<CurvePoint> CurvePoints() {
  std::vector<CurvePoint> points;
  for (const ReportedQuantile& q : JsonQuantiles()) {
    points.push_back(
        {q.key, -std::log10(1 - q.quantile), absl::StrFormat("%.6g%%", 100 * q.quantile)});
  }
  points.push_back({"max", std::round(points.back().x) + 1, "max"});
  return points;
}

enum class Axis { kTime, kPercentile, kCategory };

struct Point {
  double x = 0;
  double y = 0;
  std::string x_text;  // data-x: the JSON's x (or the percentile's key)
  std::string y_text;  // data-y: the JSON's number
};

struct Series {
  std::string key;     // data-series: the JSON key the values come from
  std::string legend;  // e.g. "latency (corrected)"
  int run = 0;
  int style = 0;  // the series' place in its chart: its dash (and colour, for one run)
  std::vector<Point> points;
};

struct Chart {
  std::string id;
  std::string title;
  std::string about;  // one sentence under the title
  std::string x_label;
  std::string y_label;
  Axis axis = Axis::kTime;
  Unit unit = Unit::kCount;
  std::vector<Series> series;
};

constexpr const char* kColours[] = {"#1f5fa8", "#c0392b", "#2e8b57", "#8e44ad",
                                    "#d35400", "#7f6000", "#16a085", "#555555"};
constexpr const char* kDashes[] = {"", "6 4", "2 3", "8 3 2 3"};

constexpr double kWidth = 900;
constexpr double kHeight = 300;
constexpr double kLeft = 80;
constexpr double kRight = 20;
constexpr double kTop = 15;
constexpr double kBottom = 45;

std::string Px(double value) { return absl::StrFormat("%.1f", value); }

// The smallest 1, 2 or 5 x 10^k at least `value`.
double NiceCeiling(double value) {
  if (value <= 0) return 1;
  const double power = std::pow(10, std::floor(std::log10(value)));
  for (double step : {1.0, 2.0, 5.0, 10.0}) {
    if (step * power >= value * (1 - 1e-12)) return step * power;
  }
  return 10 * power;
}

struct SeriesLook {
  std::string colour;
  std::string dash;
};
SeriesLook LookOf(const Series& series, bool several_runs) {
  const int colour = several_runs ? series.run : series.style;
  return {kColours[colour % std::size(kColours)], kDashes[series.style % std::size(kDashes)]};
}

std::string Legend(const Chart& chart, bool several_runs,
                   const std::vector<std::string>& run_labels) {
  std::string html = "<ul class=\"legend\">";
  for (const Series& series : chart.series) {
    const SeriesLook look = LookOf(series, several_runs);
    const std::string name =
        several_runs ? absl::StrCat(run_labels[series.run], ": ", series.legend) : series.legend;
    absl::StrAppend(
        &html, "<li><svg width=\"28\" height=\"10\" aria-hidden=\"true\">",
        chart.axis == Axis::kCategory
            ? absl::StrCat("<rect x=\"4\" y=\"0\" width=\"20\" height=\"10\" fill=\"", look.colour,
                           "\"/>")
            : absl::StrCat("<line x1=\"0\" y1=\"5\" x2=\"28\" y2=\"5\" stroke=\"", look.colour,
                           "\" stroke-width=\"2\" stroke-dasharray=\"", look.dash, "\"/>"),
        "</svg>", Escape(name), "</li>");
  }
  return html + "</ul>";
}

std::string PointAttributes(const Series& series, const Point& point) {
  return absl::StrCat(" data-run=\"", series.run, "\" data-series=\"", Escape(series.key),
                      "\" data-x=\"", Escape(point.x_text), "\" data-y=\"", Escape(point.y_text),
                      "\"");
}

// The chart's section: title, sentence, SVG and legend; "no data" when no
// series has a point.
std::string RenderChart(const Chart& chart, const std::vector<std::string>& run_labels) {
  const bool several_runs = run_labels.size() > 1;
  std::string html =
      absl::StrCat("<section class=\"chart\" id=\"", chart.id, "\"><h2>", Escape(chart.title),
                   "</h2><p class=\"about\">", Escape(chart.about), "</p>");
  double x_min = 0, x_max = 0, y_max = 0;
  bool any = false;
  std::map<double, std::string> categories;
  for (const Series& series : chart.series) {
    for (const Point& point : series.points) {
      x_min = any ? std::min(x_min, point.x) : point.x;
      x_max = any ? std::max(x_max, point.x) : point.x;
      y_max = std::max(y_max, point.y);
      any = true;
      categories.emplace(point.x, point.x_text);
    }
  }
  if (!any) {
    return absl::StrCat(html, "<p class=\"empty\">No data: the run has no ", Escape(chart.y_label),
                        " to show.</p></section>");
  }
  const std::vector<CurvePoint> curve = CurvePoints();
  if (chart.axis == Axis::kPercentile) {
    x_min = curve.front().x;
    x_max = curve.back().x;
  } else if (chart.axis == Axis::kTime) {
    x_min = std::min(x_min, 0.0);
  }
  if (x_max <= x_min) x_max = x_min + 1;
  const double top = NiceCeiling(y_max);
  const double plot_w = kWidth - kLeft - kRight;
  const double plot_h = kHeight - kTop - kBottom;
  std::vector<double> category_x;
  for (const auto& [x, text] : categories) category_x.push_back(x);
  const double slot = plot_w / static_cast<double>(std::max<size_t>(category_x.size(), 1));
  auto sx = [&](double x) { return kLeft + (x - x_min) / (x_max - x_min) * plot_w; };
  auto sy = [&](double y) { return kTop + plot_h - y / top * plot_h; };

  absl::StrAppend(&html, "<svg class=\"plot\" viewBox=\"0 0 ", kWidth, " ", kHeight,
                  "\" role=\"img\" aria-label=\"", Escape(chart.title), "\">");
  // The y grid: five steps of the nice ceiling.
  for (int i = 0; i <= 5; ++i) {
    const double y = top * i / 5;
    absl::StrAppend(&html, "<line class=\"grid\" x1=\"", Px(kLeft), "\" x2=\"", Px(kWidth - kRight),
                    "\" y1=\"", Px(sy(y)), "\" y2=\"", Px(sy(y)), "\"/><text class=\"tick\" x=\"",
                    Px(kLeft - 6), "\" y=\"", Px(sy(y) + 4), "\" text-anchor=\"end\">",
                    Escape(FormatValue(chart.unit, y)), "</text>");
  }
  // The x ticks.
  if (chart.axis == Axis::kPercentile) {
    for (const CurvePoint& point : curve) {
      absl::StrAppend(&html, "<line class=\"grid\" x1=\"", Px(sx(point.x)), "\" x2=\"",
                      Px(sx(point.x)), "\" y1=\"", Px(kTop), "\" y2=\"", Px(kTop + plot_h),
                      "\"/><text class=\"tick\" x=\"", Px(sx(point.x)), "\" y=\"",
                      Px(kTop + plot_h + 16), "\" text-anchor=\"middle\">", Escape(point.label),
                      "</text>");
    }
  } else if (chart.axis == Axis::kCategory) {
    for (size_t i = 0; i < category_x.size(); ++i) {
      absl::StrAppend(&html, "<text class=\"tick\" x=\"",
                      Px(kLeft + slot * (static_cast<double>(i) + 0.5)), "\" y=\"",
                      Px(kTop + plot_h + 16), "\" text-anchor=\"middle\">",
                      Escape(categories[category_x[i]]), "</text>");
    }
  } else {
    const double step = NiceCeiling((x_max - x_min) / 8);
    for (double x = std::ceil(x_min / step) * step; x <= x_max + 1e-9; x += step) {
      absl::StrAppend(&html, "<text class=\"tick\" x=\"", Px(sx(x)), "\" y=\"",
                      Px(kTop + plot_h + 16), "\" text-anchor=\"middle\">",
                      absl::StrFormat("%g", x), "</text>");
    }
  }
  absl::StrAppend(&html, "<line class=\"axis\" x1=\"", Px(kLeft), "\" x2=\"", Px(kWidth - kRight),
                  "\" y1=\"", Px(kTop + plot_h), "\" y2=\"", Px(kTop + plot_h),
                  "\"/><text class=\"label\" x=\"", Px(kLeft + plot_w / 2), "\" y=\"",
                  Px(kHeight - 6), "\" text-anchor=\"middle\">", Escape(chart.x_label),
                  "</text><text class=\"label\" transform=\"rotate(-90)\" x=\"",
                  Px(-(kTop + plot_h / 2)), "\" y=\"14\" text-anchor=\"middle\">",
                  Escape(chart.y_label), "</text>");

  const double bar_w = slot * 0.8 / static_cast<double>(chart.series.size());
  for (size_t s = 0; s < chart.series.size(); ++s) {
    const Series& series = chart.series[s];
    const SeriesLook look = LookOf(series, several_runs);
    const std::string name =
        several_runs ? absl::StrCat(run_labels[series.run], ": ", series.legend) : series.legend;
    if (chart.axis == Axis::kCategory) {
      for (const Point& point : series.points) {
        const size_t slot_index =
            std::lower_bound(category_x.begin(), category_x.end(), point.x) - category_x.begin();
        const double x = kLeft + slot * static_cast<double>(slot_index) + slot * 0.1 +
                         bar_w * static_cast<double>(s);
        absl::StrAppend(&html, "<rect class=\"point\"", PointAttributes(series, point), " x=\"",
                        Px(x), "\" y=\"", Px(sy(point.y)), "\" width=\"", Px(bar_w), "\" height=\"",
                        Px(kTop + plot_h - sy(point.y)), "\" fill=\"", look.colour, "\"><title>",
                        Escape(name), " ", Escape(point.x_text), ": ",
                        Escape(FormatValue(chart.unit, point.y)), "</title></rect>");
      }
      continue;
    }
    std::vector<std::string> coordinates;
    for (const Point& point : series.points) {
      coordinates.push_back(absl::StrCat(Px(sx(point.x)), ",", Px(sy(point.y))));
    }
    absl::StrAppend(&html, "<polyline class=\"line\" fill=\"none\" stroke=\"", look.colour,
                    "\" stroke-dasharray=\"", look.dash, "\" points=\"",
                    absl::StrJoin(coordinates, " "), "\"/>");
    for (const Point& point : series.points) {
      absl::StrAppend(&html, "<circle class=\"point\"", PointAttributes(series, point), " cx=\"",
                      Px(sx(point.x)), "\" cy=\"", Px(sy(point.y)), "\" r=\"2.5\" fill=\"",
                      look.colour, "\"><title>", Escape(name), " at ", Escape(point.x_text), ": ",
                      Escape(FormatValue(chart.unit, point.y)), "</title></circle>");
    }
  }
  return absl::StrCat(html, "</svg>", Legend(chart, several_runs, run_labels), "</section>");
}

// --- the runs' series -------------------------------------------------------

// A histogram's percentile curve: `histogram` is a FormatJson key such as
// "latency_us", under `parent` (the report, or its "sessions").
Series PercentileSeries(const Run& run, int index, const std::vector<absl::string_view>& path,
                        std::string legend, int style) {
  Series series{std::string(path.back()), std::move(legend), index, style, {}};
  const Json* histogram = &run.report;
  for (absl::string_view key : path) histogram = histogram ? Find(*histogram, {key}) : nullptr;
  if (histogram == nullptr || Number(Find(*histogram, {"count"})) == 0) return series;
  for (const CurvePoint& point : CurvePoints()) {
    const Json* value = Find(*histogram, {point.key});
    if (value == nullptr || !value->is_number()) continue;
    series.points.push_back({point.x, value->get<double>(), point.key, JsonText(*value)});
  }
  return series;
}

// A field of the timeline's points against their t_s.
Series TimelineSeries(const Run& run, int index, const std::string& field, std::string legend,
                      int style) {
  Series series{field, std::move(legend), index, style, {}};
  const Json* timeline = Find(run.report, {"timeline"});
  if (timeline == nullptr || !timeline->is_array()) return series;
  for (const Json& point : *timeline) {
    const Json* t = Find(point, {"t_s"});
    const Json* value = Find(point, {field});
    if (t == nullptr || value == nullptr || !t->is_number() || !value->is_number()) continue;
    series.points.push_back(
        {t->get<double>(), value->get<double>(), JsonText(*t), JsonText(*value)});
  }
  return series;
}

Series BatchSeries(const Run& run, int index) {
  Series series{"batch_sizes", "answers", index, 0, {}};
  const Json* sizes = Find(run.report, {"batch_sizes"});
  if (sizes == nullptr || !sizes->is_object()) return series;
  for (const auto& [size, count] : sizes->items()) {
    if (!count.is_number()) continue;
    series.points.push_back({std::atof(size.c_str()), count.get<double>(), size, JsonText(count)});
  }
  return series;
}

Series CpuSeries(const Run& run, int index) {
  Series series{"cpu", "CPU seconds", index, 0, {}};
  const Json* cpu = Find(run.report, {"cpu"});
  if (cpu == nullptr) return series;
  double x = 0;
  for (const char* key : {"user_s", "system_s"}) {
    const Json* value = Find(*cpu, {key});
    if (value != nullptr && value->is_number()) {
      series.points.push_back({x, value->get<double>(), key, JsonText(*value)});
    }
    ++x;
  }
  return series;
}

bool IsSessions(const Run& run) { return Find(run.report, {"sessions"}) != nullptr; }

bool IsOpenLoop(const Json& report) { return Text(Find(report, {"run", "loop"})) == "open"; }

std::vector<Chart> Charts(const std::vector<Run>& runs) {
  const bool sessions = std::any_of(runs.begin(), runs.end(), IsSessions);
  const std::string latency = sessions ? "step latency" : "latency";
  std::vector<Chart> charts;
  charts.push_back({"latency-percentiles",
                    absl::StrCat("Percentiles of ", latency),
                    "Corrected latency runs from each call's intended send time, uncorrected from "
                    "its actual send time; where the two part, calls waited to be sent "
                    "(coordinated omission). The x axis stretches the tail: each step is ten "
                    "times fewer calls.",
                    "percentile",
                    latency,
                    Axis::kPercentile,
                    Unit::kMicros,
                    {}});
  charts.push_back({"timeline-rates",
                    "Calls per second",
                    "Per interval of the timeline (about a second): the schedule's target rate "
                    "(open loops), calls sent, calls completed and failed calls.",
                    "seconds since the measurement began",
                    "calls per second",
                    Axis::kTime,
                    Unit::kPerSecond,
                    {}});
  charts.push_back({"timeline-latency",
                    "Latency per second",
                    "The median, 99th percentile and maximum of the latency of the calls "
                    "completed in each interval.",
                    "seconds since the measurement began",
                    latency,
                    Axis::kTime,
                    Unit::kMicros,
                    {}});
  if (sessions) {
    charts.push_back({"timeline-steps",
                      "Session steps per second",
                      "Steps answered in each interval (seconds from the decoders' start, their "
                      "prefills included).",
                      "seconds since the decoders began",
                      "steps per second",
                      Axis::kTime,
                      Unit::kPerSecond,
                      {}});
    charts.push_back({"timeline-cache",
                      "Cache bytes read per second",
                      "The session cache the answered steps attended over, per interval: each "
                      "step reads its session's rows so far.",
                      "seconds since the decoders began",
                      "cache bytes read per second",
                      Axis::kTime,
                      Unit::kBytesPerSecond,
                      {}});
    charts.push_back({"session-latency",
                      "Percentiles of prefill and step latency",
                      "A session's create with its prefill rows, and its one-row steps.",
                      "percentile",
                      "latency",
                      Axis::kPercentile,
                      Unit::kMicros,
                      {}});
  }
  charts.push_back({"server-breakdown",
                    "The server's queue and compute time",
                    "From the OK answers' queue_us (waiting in the server's batcher) and "
                    "compute_us (the engine's call); what the client's latency adds beyond "
                    "them is the network and the gRPC stacks.",
                    "percentile",
                    "server time",
                    Axis::kPercentile,
                    Unit::kMicros,
                    {}});
  charts.push_back({"batch-sizes",
                    "Batch sizes",
                    "OK answers by the number of requests the server ran in the same engine call.",
                    "requests in the engine call",
                    "answers",
                    Axis::kCategory,
                    Unit::kCount,
                    {}});
  charts.push_back({"tester-cpu",
                    "The load tester's CPU",
                    "User and system CPU seconds the load tester spent over the run; if it nears "
                    "all of its cores, the tester, not the server, may be the limit.",
                    "CPU time",
                    "seconds",
                    Axis::kCategory,
                    Unit::kSeconds,
                    {}});

  for (size_t i = 0; i < runs.size(); ++i) {
    const Run& run = runs[i];
    const int index = static_cast<int>(i);
    // A run without calls has only zeros to show.
    if (run.report.is_null() || Number(Find(run.report, {"requests"})) == 0) continue;
    auto chart = [&charts](absl::string_view id) -> Chart& {
      return *std::find_if(charts.begin(), charts.end(),
                           [id](const Chart& candidate) { return candidate.id == id; });
    };
    std::vector<Series>& curves = chart("latency-percentiles").series;
    curves.push_back(PercentileSeries(run, index, {"latency_us"}, "corrected", 0));
    curves.push_back(PercentileSeries(run, index, {"uncorrected_latency_us"}, "uncorrected", 1));
    std::vector<Series>& rates = chart("timeline-rates").series;
    // A closed loop's target is a concurrency, not a rate.
    if (IsOpenLoop(run.report)) rates.push_back(TimelineSeries(run, index, "target", "target", 0));
    rates.push_back(TimelineSeries(run, index, "sent_per_s", "sent", 1));
    rates.push_back(TimelineSeries(run, index, "completed_per_s", "completed", 2));
    rates.push_back(TimelineSeries(run, index, "errors_per_s", "errors", 3));
    std::vector<Series>& latencies = chart("timeline-latency").series;
    latencies.push_back(TimelineSeries(run, index, "p50_us", "p50", 0));
    latencies.push_back(TimelineSeries(run, index, "p99_us", "p99", 1));
    latencies.push_back(TimelineSeries(run, index, "max_us", "max", 2));
    if (sessions) {
      chart("timeline-steps")
          .series.push_back(TimelineSeries(run, index, "steps_per_s", "steps", 0));
      chart("timeline-cache")
          .series.push_back(
              TimelineSeries(run, index, "cache_bytes_read_per_s", "cache bytes read", 0));
      std::vector<Series>& session = chart("session-latency").series;
      session.push_back(PercentileSeries(run, index, {"sessions", "prefill_us"}, "prefill", 0));
      session.push_back(PercentileSeries(run, index, {"latency_us"}, "step", 1));
    }
    std::vector<Series>& server = chart("server-breakdown").series;
    server.push_back(PercentileSeries(run, index, {"server_queue_us"}, "queue", 0));
    server.push_back(PercentileSeries(run, index, {"server_compute_us"}, "compute", 1));
    chart("batch-sizes").series.push_back(BatchSeries(run, index));
    chart("tester-cpu").series.push_back(CpuSeries(run, index));
  }
  // Series without points only clutter the legends.
  for (Chart& chart : charts) {
    std::erase_if(chart.series, [](const Series& series) { return series.points.empty(); });
  }
  return charts;
}

// --- tables -----------------------------------------------------------------

std::string DescribeLoad(const Json& report) {
  const Json* run = Find(report, {"run"});
  if (run == nullptr) return "merged histogram logs";
  std::string text =
      absl::StrCat(Text(Find(*run, {"loop"})), " loop, ", Text(Find(*run, {"schedule"})));
  if (IsOpenLoop(report)) {
    absl::StrAppend(&text, absl::StrFormat(", target %.1f/s", Number(Find(report, {"target_rps"}))),
                    ", ", Text(Find(*run, {"arrival"})), " arrivals");
    if (Number(Find(*run, {"max_in_flight"})) > 0) {
      absl::StrAppend(&text, ", at most ", Text(Find(*run, {"max_in_flight"})), " in flight");
    }
  }
  if (Number(Find(*run, {"warmup_s"})) > 0) {
    absl::StrAppend(&text, ", ", Text(Find(*run, {"warmup_s"})), "s warm-up");
  }
  return text;
}

std::string DescribeTargets(const Json& report) {
  const Json* targets = Find(report, {"run", "targets"});
  if (targets == nullptr || !targets->is_array()) return "";
  std::vector<std::string> names;
  for (const Json& target : *targets) names.push_back(Text(&target));
  return absl::StrCat(absl::StrJoin(names, " "), " x ", Text(Find(report, {"run", "connections"})),
                      " connections");
}

std::string DescribeErrors(const Json& report) {
  std::string text = absl::StrFormat("%s (%.3f%%)", Text(Find(report, {"error_count"})),
                                     100 * Number(Find(report, {"error_rate"})));
  const Json* errors = Find(report, {"errors"});
  if (errors != nullptr && errors->is_object() && !errors->empty()) {
    std::vector<std::string> codes;
    for (const auto& [code, count] : errors->items()) {
      codes.push_back(absl::StrCat(code, " ", JsonText(count)));
    }
    absl::StrAppend(&text, ": ", absl::StrJoin(codes, ", "));
  }
  return Escape(text);
}

std::string DescribeThresholds(const Json& report) {
  const Json* thresholds = Find(report, {"thresholds"});
  if (thresholds == nullptr || !thresholds->is_array() || thresholds->empty()) return "none";
  std::string html = "<ul class=\"thresholds\">";
  for (const Json& threshold : *thresholds) {
    const Json* verdict = Find(threshold, {"passed"});
    const bool passed = verdict != nullptr && *verdict == true;
    absl::StrAppend(&html, "<li><span class=\"", passed ? "ok" : "broken", "\">",
                    passed ? "ok" : "BROKEN", "</span> ",
                    Escape(Text(Find(threshold, {"description"}))), "</li>");
  }
  return html + "</ul>";
}

std::string DescribeSessions(const Json& report) {
  const Json* sessions = Find(report, {"sessions"});
  if (sessions == nullptr) return "";
  return Escape(absl::StrFormat(
      "%s of %s opened with %s rows, %s closed, %s recreated; %s steps (%.1f/s); %s cache, "
      "%s read (%s/s)",
      Text(Find(*sessions, {"opened"})), Text(Find(*sessions, {"sessions"})),
      Text(Find(*sessions, {"prefill_rows"})), Text(Find(*sessions, {"closed"})),
      Text(Find(*sessions, {"recreations"})), Text(Find(*sessions, {"steps"})),
      Number(Find(*sessions, {"steps_per_s"})), Text(Find(*sessions, {"cache_dtype"})),
      FormatBytes(Number(Find(*sessions, {"cache_bytes_read"}))),
      FormatBytes(Number(Find(*sessions, {"cache_bytes_read_per_s"})))));
}

std::string SummaryTable(const std::vector<Run>& runs) {
  struct Row {
    const char* label;
    std::string (*cell)(const Json&);  // HTML
  };
  const Row rows[] = {
      {"load", [](const Json& r) { return Escape(DescribeLoad(r)); }},
      {"targets", [](const Json& r) { return Escape(DescribeTargets(r)); }},
      {"workload",
       [](const Json& r) {
         return Escape(Text(Find(r, {"run", "workload"})));
       }},
      {"transport",
       [](const Json& r) {
         const Json* run = Find(r, {"run"});
         if (run == nullptr) return std::string();
         return Escape(absl::StrCat(Text(Find(*run, {"api"})), " calls over ",
                                    Text(Find(*run, {"transport"})), ", ",
                                    Text(Find(*run, {"threads"})), " threads"));
       }},
      {"requests",
       [](const Json& r) {
         return Escape(absl::StrFormat("%s completed (%s OK) of %s sent in %.2fs",
                                       Text(Find(r, {"requests"})), Text(Find(r, {"ok"})),
                                       Text(Find(r, {"sent"})), Number(Find(r, {"duration_s"}))));
       }},
      {"throughput",
       [](const Json& r) {
         return Escape(absl::StrFormat("%.1f/s answered, %.1f/s sent",
                                       Number(Find(r, {"throughput_rps"})),
                                       Number(Find(r, {"sent_rps"}))));
       }},
      {"errors", DescribeErrors},
      {"first error", [](const Json& r) { return Escape(Text(Find(r, {"first_error"}))); }},
      {"latency p50 / p99 / max",
       [](const Json& r) {
         std::vector<std::string> values;
         for (const char* key : {"p50", "p99", "max"}) {
           values.push_back(FormatLatency(1e3 * Number(Find(r, {"latency_us", key}))));
         }
         return Escape(absl::StrJoin(values, " / "));
       }},
      {"mean batch size",
       [](const Json& r) {
         return Escape(absl::StrFormat("%.2f", Number(Find(r, {"mean_batch_size"}))));
       }},
      {"tester CPU",
       [](const Json& r) {
         return Escape(absl::StrFormat(
             "%.2fs user + %.2fs system = %.1f%% of %s cores", Number(Find(r, {"cpu", "user_s"})),
             Number(Find(r, {"cpu", "system_s"})), Number(Find(r, {"cpu", "percent_of_machine"})),
             Text(Find(r, {"cpu", "cores"}))));
       }},
      {"sessions", DescribeSessions},
      {"thresholds", DescribeThresholds},
  };
  std::string html = "<table class=\"summary\"><thead><tr><th></th>";
  for (const Run& run : runs) absl::StrAppend(&html, "<th>", Escape(run.label), "</th>");
  html += "</tr></thead><tbody>";
  for (const Row& row : rows) {
    std::vector<std::string> cells;
    bool any = false;
    for (const Run& run : runs) {
      cells.push_back(run.report.is_null() ? "" : row.cell(run.report));
      any = any || !cells.back().empty();
    }
    if (!any) continue;
    absl::StrAppend(&html, "<tr><th>", row.label, "</th>");
    for (const std::string& cell : cells) absl::StrAppend(&html, "<td>", cell, "</td>");
    html += "</tr>";
  }
  return html + "</tbody></table>";
}

// The runs' main numbers side by side, each with its change from the first.
std::string DifferencesTable(const std::vector<Run>& runs) {
  struct Metric {
    const char* label;
    std::vector<absl::string_view> path;
    Unit unit;
  };
  const Metric metrics[] = {
      {"throughput", {"throughput_rps"}, Unit::kPerSecond},
      {"sent", {"sent_rps"}, Unit::kPerSecond},
      {"errors", {"error_count"}, Unit::kCount},
      {"latency p50", {"latency_us", "p50"}, Unit::kMicros},
      {"latency p99", {"latency_us", "p99"}, Unit::kMicros},
      {"latency p99.9", {"latency_us", "p99.9"}, Unit::kMicros},
      {"latency p99.999", {"latency_us", "p99.999"}, Unit::kMicros},
      {"latency max", {"latency_us", "max"}, Unit::kMicros},
      {"uncorrected p99", {"uncorrected_latency_us", "p99"}, Unit::kMicros},
      {"server queue p99", {"server_queue_us", "p99"}, Unit::kMicros},
      {"server compute p99", {"server_compute_us", "p99"}, Unit::kMicros},
      {"mean batch size", {"mean_batch_size"}, Unit::kCount},
      {"tester CPU %", {"cpu", "percent_of_machine"}, Unit::kCount},
      {"steps", {"sessions", "steps_per_s"}, Unit::kPerSecond},
      {"cache read", {"sessions", "cache_bytes_read_per_s"}, Unit::kBytesPerSecond},
  };
  std::string html =
      "<section id=\"differences\"><h2>Differences</h2><p class=\"about\">Each run's numbers, "
      "and their change from the first run.</p><table class=\"differences\"><thead><tr><th></th>";
  for (const Run& run : runs) absl::StrAppend(&html, "<th>", Escape(run.label), "</th>");
  html += "</tr></thead><tbody>";
  for (const Metric& metric : metrics) {
    std::vector<const Json*> values;
    bool any = false;
    for (const Run& run : runs) {
      const Json* value = &run.report;
      for (absl::string_view key : metric.path) value = value ? Find(*value, {key}) : nullptr;
      values.push_back(value != nullptr && value->is_number() ? value : nullptr);
      any = any || values.back() != nullptr;
    }
    if (!any) continue;
    absl::StrAppend(&html, "<tr><th>", metric.label, "</th>");
    for (size_t i = 0; i < values.size(); ++i) {
      if (values[i] == nullptr) {
        html += "<td>-</td>";
        continue;
      }
      const double value = values[i]->get<double>();
      std::string cell = FormatValue(metric.unit, value);
      if (i > 0 && values[0] != nullptr) {
        const double base = values[0]->get<double>();
        absl::StrAppend(&cell, base != 0 ? absl::StrFormat(" (%+.1f%%)", 100 * (value / base - 1))
                                         : absl::StrFormat(" (%+g)", value - base));
      }
      absl::StrAppend(&html, "<td data-key=\"", Escape(absl::StrJoin(metric.path, ".")),
                      "\" data-value=\"", Escape(JsonText(*values[i])), "\">", Escape(cell),
                      "</td>");
    }
    html += "</tr>";
  }
  return html + "</tbody></table></section>";
}

// What a reader must know before the charts: failed, empty or broken runs.
std::string Notices(const std::vector<Run>& runs) {
  std::string html;
  for (const Run& run : runs) {
    const std::string name = Escape(run.label);
    if (run.report.is_null()) {
      absl::StrAppend(&html, "<p class=\"notice failed\">", name,
                      ": the run failed: ", Escape(run.error), "</p>");
      continue;
    }
    if (Number(Find(run.report, {"requests"})) == 0) {
      absl::StrAppend(&html, "<p class=\"notice empty\">", name,
                      ": the run completed no calls; there is nothing to plot.");
      if (const std::string error = Text(Find(run.report, {"first_error"})); !error.empty()) {
        absl::StrAppend(&html, " First error: ", Escape(error));
      }
      html += "</p>";
    } else if (Number(Find(run.report, {"error_count"})) > 0) {
      absl::StrAppend(&html, "<p class=\"notice errors\">", name, ": ",
                      Escape(Text(Find(run.report, {"error_count"}))),
                      " calls failed; first: ", Escape(Text(Find(run.report, {"first_error"}))),
                      "</p>");
    }
    if (const Json* passed = Find(run.report, {"passed"}); passed != nullptr && *passed == false) {
      absl::StrAppend(&html, "<p class=\"notice broken\">", name, ": a threshold was broken.</p>");
    }
  }
  return html;
}

constexpr char kStyle[] = R"css(
body { font-family: sans-serif; margin: 1.5em auto; max-width: 960px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }
thead th { background: #f0f0f0; }
.about { color: #555; font-size: 0.9em; margin: 0.2em 0 0.5em; }
.notice { padding: 0.5em 0.8em; border-left: 4px solid #c0392b; background: #fbeeee; }
.notice.errors { border-color: #d35400; background: #fdf2e9; }
.ok { color: #2e8b57; font-weight: bold; } .broken { color: #c0392b; font-weight: bold; }
ul.thresholds { margin: 0; padding-left: 1em; }
svg.plot { width: 100%; height: auto; border: 1px solid #e4e4e4; background: #fff; }
svg.plot .grid { stroke: #eee; } svg.plot .axis { stroke: #888; }
svg.plot .line { stroke-width: 1.6; }
svg.plot text { font-size: 11px; fill: #444; } svg.plot text.label { font-size: 12px; fill: #222; }
ul.legend { list-style: none; padding: 0; margin: 0.3em 0; font-size: 0.85em; }
ul.legend li { display: inline-block; margin-right: 1.2em; }
ul.legend svg { vertical-align: middle; margin-right: 0.3em; }
.empty { color: #777; font-style: italic; }
@media print { body { max-width: none; margin: 0; } section { break-inside: avoid; } }
)css";

}  // namespace

absl::StatusOr<std::string> FormatHtml(const std::vector<HtmlRun>& html_runs) {
  if (html_runs.empty()) return absl::InvalidArgumentError("no runs to report");
  std::vector<Run> runs;
  std::vector<std::string> labels;
  Json data = {{"runs", Json::array()}};
  for (const HtmlRun& html_run : html_runs) {
    Run& run = runs.emplace_back(Run{html_run.label, html_run.error, nullptr});
    if (!html_run.json.empty()) {
      run.report = Json::parse(html_run.json, nullptr, /*allow_exceptions=*/false);
      if (!run.report.is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat(html_run.label, ": not a JSON report of attention_loadtest --json"));
      }
    } else if (run.error.empty()) {
      run.error = "no results";
    }
    labels.push_back(run.label);
    data["runs"].push_back({{"label", run.label}, {"error", run.error}, {"report", run.report}});
  }

  std::string html = absl::StrCat(
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
      "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
      "style-src 'unsafe-inline'\">"
      "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
      "<title>attention_loadtest: ",
      Escape(absl::StrJoin(labels, " vs ")), "</title><style>", kStyle,
      "</style></head><body><h1>attention_loadtest: ", Escape(absl::StrJoin(labels, " vs ")),
      "</h1>");
  absl::StrAppend(&html, Notices(runs), "<section id=\"summary\"><h2>Summary</h2>",
                  SummaryTable(runs), "</section>");
  if (runs.size() > 1) absl::StrAppend(&html, DifferencesTable(runs));
  for (const Chart& chart : Charts(runs)) absl::StrAppend(&html, RenderChart(chart, labels));
  // The data block is inert (not JavaScript); "<" (only in strings) is
  // escaped so that no string in it can end the element.
  absl::StrAppend(&html, "<script type=\"application/json\" id=\"loadtest-data\">",
                  absl::StrReplaceAll(JsonText(data), {{"<", "\\u003c"}}),
                  "</script></body></html>\n");
  return html;
}

}  // namespace attention::loadtest
