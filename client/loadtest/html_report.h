#ifndef ATTENTION_CLIENT_LOADTEST_HTML_REPORT_H_
#define ATTENTION_CLIENT_LOADTEST_HTML_REPORT_H_

// The load test as one self-contained HTML page: a summary, tables and SVG
// charts drawn from FormatJson's numbers. The page loads nothing (no script,
// font, image or style from anywhere; its Content-Security-Policy forbids
// it), runs no script, and prints.
//
// Every plotted point is an SVG element with data-run (the run's index),
// data-series (the JSON key it comes from), data-x and data-y (the JSON's
// numbers, as the JSON writes them; data-x of a percentile is its key, e.g.
// "p99.9"); the runs' JSON is embedded whole in
// <script type="application/json" id="loadtest-data"> as
// {"runs": [{"label": ..., "error": ..., "report": {...}}]}.

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace attention::loadtest {

// One run of the report.
struct HtmlRun {
  std::string label;  // the run's name in legends and tables, e.g. its file
  std::string json;   // FormatJson's text; empty when the run failed
  std::string error;  // why there are no results, when the run failed
};

// The page for `runs` (one: a run's report; several: overlaid on the same
// axes, with a table of their differences from the first). A run that failed
// or completed no calls is reported as such. INVALID_ARGUMENT naming the
// run whose JSON does not parse, or when `runs` is empty.
absl::StatusOr<std::string> FormatHtml(const std::vector<HtmlRun>& runs);

}  // namespace attention::loadtest

#endif  // ATTENTION_CLIENT_LOADTEST_HTML_REPORT_H_
