// attention_loadtest's HTML report: its plotted points are the JSON's
// numbers, it references nothing outside itself, and headless Chromium opens
// it without a console error. The end-to-end tests run the real
// attention_server (127.0.0.1, port 0) and the real attention_loadtest.

#include "client/loadtest/html_report.h"

#include <sys/wait.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/loadtest/report.h"
#include "client/loadtest/thresholds.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/loadtest/known_stats.h"
#include "tests/run_program.h"
#include "tests/safetensors_writer.h"
#include "tests/status_matchers.h"

#if !defined(ATTENTION_LOADTEST_BIN) || !defined(ATTENTION_SERVER_BIN) || \
    !defined(ATTENTION_CHROMIUM_BIN) || !defined(ATTENTION_ARTIFACT_DIR)
#error "the build defines the binaries' paths and the artifact directory"
#endif

namespace attention::loadtest {
namespace {

using ::attention::testing::MakeTempDir;
using ::attention::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;
using Json = nlohmann::ordered_json;

using testing::Outcome;
using testing::ReadWholeFile;

// The page's embedded data block, parsed ("runs": [{label, error, report}]).
Json DataBlock(const std::string& html) {
  const std::string open = "<script type=\"application/json\" id=\"loadtest-data\">";
  const size_t begin = html.find(open);
  const size_t end = html.find("</script>", begin);
  if (begin == std::string::npos || end == std::string::npos) return nullptr;
  return Json::parse(html.substr(begin + open.size(), end - begin - open.size()), nullptr,
                     /*allow_exceptions=*/false);
}

struct PlottedPoint {
  int run;
  std::string series;
  std::string x;
  std::string y;
};

// The value of attribute `name` at the start of `rest` (` name="value"`), or
// nullopt; `rest` is left after it.
std::optional<std::string> TakeAttribute(absl::string_view& rest, absl::string_view name) {
  const std::string opening = absl::StrCat(" ", name, "=\"");
  if (!absl::ConsumePrefix(&rest, opening)) return std::nullopt;
  const size_t end = rest.find('"');
  if (end == absl::string_view::npos) return std::nullopt;
  std::string value(rest.substr(0, end));
  rest.remove_prefix(end + 1);
  return value;
}

// Every point the report plots: `<circle class="point" data-run=".."
// data-series=".." data-x=".." data-y=".."` (or `<rect ...`), in order. (Not
// std::regex: GCC 12 warns inside its <regex> in the ASan build.)
std::vector<PlottedPoint> PlottedPoints(const std::string& html) {
  std::vector<PlottedPoint> points;
  const absl::string_view all(html);
  for (size_t at = all.find("<"); at != absl::string_view::npos; at = all.find("<", at + 1)) {
    absl::string_view rest = all.substr(at + 1);
    if (!absl::ConsumePrefix(&rest, "circle") && !absl::ConsumePrefix(&rest, "rect")) continue;
    const std::optional<std::string> kind = TakeAttribute(rest, "class");
    if (kind != "point") continue;
    const std::optional<std::string> run = TakeAttribute(rest, "data-run");
    const std::optional<std::string> series = TakeAttribute(rest, "data-series");
    const std::optional<std::string> x = TakeAttribute(rest, "data-x");
    const std::optional<std::string> y = TakeAttribute(rest, "data-y");
    int run_number = 0;
    // Digits only, as the report writes them (SimpleAtoi alone takes a sign).
    if (run && series && x && y && absl::c_all_of(*run, absl::ascii_isdigit) &&
        absl::SimpleAtoi(*run, &run_number)) {
      points.push_back({run_number, *series, *x, *y});
    }
  }
  return points;
}

// Where `point` comes from in `report`: the value the JSON holds, or null.
Json JsonValueOf(const Json& report, const PlottedPoint& point) {
  const Json x = Json::parse(point.x, nullptr, /*allow_exceptions=*/false);
  if (point.series == "batch_sizes") return report["batch_sizes"].value(point.x, Json());
  if (point.series == "cpu") return report["cpu"].value(point.x, Json());
  if (point.series == "prefill_us") return report["sessions"]["prefill_us"].value(point.x, Json());
  if (report.contains(point.series) && report[point.series].is_object()) {
    return report[point.series].value(point.x, Json());  // a histogram's percentile
  }
  for (const Json& entry : report["timeline"]) {  // a timeline field at t_s
    if (entry["t_s"] == x) return entry.value(point.series, Json());
  }
  return nullptr;
}

// Every plotted point is the JSON's number, and every percentile and
// timeline value of the JSON is plotted; `html` holds the page's reports.
void ExpectPlotsAreTheJsons(const std::string& html) {
  const Json data = DataBlock(html);
  ASSERT_TRUE(data.is_object()) << "no data block";
  const std::vector<PlottedPoint> points = PlottedPoints(html);
  ASSERT_FALSE(points.empty());
  for (const PlottedPoint& point : points) {
    ASSERT_LT(point.run, static_cast<int>(data["runs"].size()));
    const Json& report = data["runs"][point.run]["report"];
    const Json plotted = Json::parse(point.y, nullptr, /*allow_exceptions=*/false);
    EXPECT_EQ(plotted, JsonValueOf(report, point))
        << "run " << point.run << " " << point.series << " at " << point.x << " plots " << point.y;
  }
  for (size_t run = 0; run < data["runs"].size(); ++run) {
    const Json& report = data["runs"][run]["report"];
    if (report.is_null() || report["requests"] == 0) continue;
    auto count = [&](const std::string& series) {
      return std::count_if(points.begin(), points.end(), [&](const PlottedPoint& p) {
        return p.run == static_cast<int>(run) && p.series == series;
      });
    };
    // p50 ... p99.999 and max; sessions plot the steps' latency twice
    // (against the uncorrected, and against the prefill).
    const bool sessions = report.contains("sessions");
    EXPECT_EQ(count("latency_us"), sessions ? 14 : 7) << "run " << run;
    EXPECT_EQ(count("uncorrected_latency_us"), 7) << "run " << run;
    EXPECT_EQ(count("p99_us"), static_cast<long>(report["timeline"].size())) << "run " << run;
    EXPECT_EQ(count("completed_per_s"), static_cast<long>(report["timeline"].size()));
    EXPECT_EQ(count("batch_sizes"), static_cast<long>(report["batch_sizes"].size()));
    if (sessions) {
      EXPECT_EQ(count("prefill_us"), 7);
      EXPECT_EQ(count("steps_per_s"), static_cast<long>(report["timeline"].size()));
      EXPECT_EQ(count("cache_bytes_read_per_s"), static_cast<long>(report["timeline"].size()));
    }
  }
}

// Nothing in the page is fetched or linked: no URL, no element that loads.
void ExpectNoNetworkReference(const std::string& html) {
  for (const char* needle : {"http:", "https:", "//", "src=", "href=", "url(", "<link", "@import",
                             "<iframe", "<img", "<object", "<embed"}) {
    EXPECT_THAT(html, Not(HasSubstr(needle)));
  }
  // One script element: the inert JSON data block.
  size_t scripts = 0;
  for (size_t at = html.find("<script"); at != std::string::npos;
       at = html.find("<script", at + 1)) {
    ++scripts;
    EXPECT_TRUE(absl::StartsWith(absl::string_view(html).substr(at),
                                 "<script type=\"application/json\" id=\"loadtest-data\">"))
        << html.substr(at, 60);
  }
  EXPECT_EQ(scripts, 1u);
  EXPECT_THAT(html, HasSubstr("Content-Security-Policy\" content=\"default-src 'none'"));
}

// Opens `html_path` in headless Chromium, writes a screenshot (its path is
// printed for CI to keep) and returns Chromium's console messages; fails the
// test if Chromium does not run or takes no screenshot.
std::vector<std::string> OpenInChromium(const std::string& html_path, const std::string& name) {
  const std::string dir = MakeTempDir("chromium");
  std::filesystem::create_directories(ATTENTION_ARTIFACT_DIR);
  const std::string screenshot = absl::StrCat(ATTENTION_ARTIFACT_DIR, "/", name, ".png");
  std::remove(screenshot.c_str());
  // No network at all (--host-resolver-rules), a profile of its own.
  const std::string command = absl::StrCat(
      "HOME=", dir, " timeout -k 5 90 ", ATTENTION_CHROMIUM_BIN,
      " --headless=new --no-sandbox --disable-gpu --no-first-run --disable-extensions"
      " --disable-background-networking --disable-sync --host-resolver-rules='MAP * ~NOTFOUND'"
      " --user-data-dir=",
      dir,
      "/profile --enable-logging=stderr --v=0 --window-size=1280,2400 --screenshot=", screenshot,
      " file://", html_path, " >", dir, "/out 2>", dir, "/log");
  const int status = std::system(command.c_str());
  const std::string log = ReadWholeFile(dir + "/log");
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "chromium: " << status << "\n"
                                                             << log;
  EXPECT_TRUE(std::filesystem::exists(screenshot) && std::filesystem::file_size(screenshot) > 0)
      << "no screenshot at " << screenshot << "\n"
      << log;
  std::cout << "screenshot of " << html_path << ": " << screenshot << std::endl;
  std::vector<std::string> console;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::StrContains(line, "CONSOLE") || absl::StrContains(line, "Uncaught") ||
        absl::StrContains(line, "Content Security Policy")) {
      console.emplace_back(line);
    }
  }
  return console;
}

// --- the page from known numbers ---------------------------------------------

// 1000 calls over two seconds, 5 failed, with a timeline and thresholds.
Report KnownReport() {
  Report report;
  report.stats = KnownStats();
  // Uncorrected below the corrected latency, so the curves differ.
  report.stats.uncorrected_latency.Clear();
  report.stats.uncorrected_latency.Record(900'000, 1000);
  report.run.emplace();
  report.run->targets = {"127.0.0.1:5000"};
  report.run->open_loop = true;
  report.run->schedule = "rate:500@2s";
  report.run->arrival = "constant";
  report.run->target_rps = 500;
  report.run->workload = "raw attention <1 head>";
  report.timeline = {{.t_s = 1,
                      .target = 500,
                      .sent = 500,
                      .completed = 498,
                      .errors = 5,
                      .p50_ns = 1'000'000,
                      .p99_ns = 2'000'000,
                      .max_ns = 100'000'000},
                     {.t_s = 2,
                      .target = 500,
                      .sent = 500,
                      .completed = 502,
                      .errors = 0,
                      .p50_ns = 1'000'000,
                      .p99_ns = 1'500'000,
                      .max_ns = 3'000'000}};
  report.thresholds = EvaluateThresholds({*ParseThreshold("p99<20ms")}, report.stats);
  return report;
}

TEST(HtmlReportTest, PlotsTheJsonsNumbersAndLoadsNothing) {
  const absl::StatusOr<std::string> html =
      FormatHtml({HtmlRun{"run", FormatJson(KnownReport()), ""}});
  ASSERT_THAT(html, attention::testing::IsOk());
  ExpectPlotsAreTheJsons(*html);
  ExpectNoNetworkReference(*html);
  // Strings from the run are escaped, not markup.
  EXPECT_THAT(*html, HasSubstr("raw attention &lt;1 head&gt;"));
  EXPECT_THAT(*html, HasSubstr("5 calls failed; first: UNAVAILABLE: connection refused"));
  EXPECT_THAT(*html, HasSubstr("<span class=\"ok\">ok</span> p99&lt;20ms"));
}

TEST(HtmlReportTest, OverlaysRunsWithTheirDifferences) {
  Report slower = KnownReport();
  slower.stats.latency.Record(2'000'000, 1000);
  const absl::StatusOr<std::string> html =
      FormatHtml({HtmlRun{"before.json", FormatJson(KnownReport()), ""},
                  HtmlRun{"after.json", FormatJson(slower), ""}});
  ASSERT_THAT(html, attention::testing::IsOk());
  ExpectPlotsAreTheJsons(*html);
  EXPECT_THAT(*html, HasSubstr("<section id=\"differences\">"));
  EXPECT_THAT(*html, HasSubstr("before.json: corrected"));
  EXPECT_THAT(*html, HasSubstr("after.json: corrected"));
}

TEST(HtmlReportTest, SaysWhenARunIsEmptyOrFailed) {
  const absl::StatusOr<std::string> html =
      FormatHtml({HtmlRun{"empty", FormatJson(Report{}), ""},
                  HtmlRun{"broken", "", "cannot connect to 127.0.0.1:1 within 1s"}});
  ASSERT_THAT(html, attention::testing::IsOk());
  EXPECT_THAT(*html, HasSubstr("empty: the run completed no calls"));
  EXPECT_THAT(*html, HasSubstr("broken: the run failed: cannot connect to 127.0.0.1:1 within 1s"));
  EXPECT_THAT(*html, HasSubstr("No data"));
  EXPECT_THAT(PlottedPoints(*html), ::testing::IsEmpty());
  ExpectNoNetworkReference(*html);
}

TEST(HtmlReportTest, RejectsWhatIsNotAReport) {
  EXPECT_THAT(FormatHtml({HtmlRun{"notes.txt", "p99 was fine", ""}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("notes.txt")));
  EXPECT_THAT(FormatHtml({}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no runs")));
}

// A string of the run cannot end the data block early.
TEST(HtmlReportTest, DataBlockKeepsScriptEndTagsInStrings) {
  Report report = KnownReport();
  report.run->workload = "</script><script>alert(1)</script>";
  const absl::StatusOr<std::string> html = FormatHtml({HtmlRun{"run", FormatJson(report), ""}});
  ASSERT_THAT(html, attention::testing::IsOk());
  EXPECT_EQ(DataBlock(*html)["runs"][0]["report"]["run"]["workload"], report.run->workload);
  EXPECT_THAT(*html, Not(HasSubstr("<script>alert")));
  ExpectNoNetworkReference(*html);
}

// --- real runs ----------------------------------------------------------------

Outcome RunProgram(const std::string& program, const std::string& args, const std::string& dir) {
  return testing::RunCommand(absl::StrCat("timeout -k 5 120 ", program, " ", args), dir);
}

// The real attention_server on 127.0.0.1 (port 0), for the suite; it stops
// itself after 10 minutes if the suite does not stop it first.
class HtmlReportRunTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(MakeTempDir("html_report"));
    const std::string port_file = *dir_ + "/port";
    const std::string command = absl::StrCat(
        "timeout 600 ", ATTENTION_SERVER_BIN, " --listen=127.0.0.1:0 --port_file=", port_file,
        " --metrics_port=0 --engine_threads=1 --model_repository= >", *dir_,
        "/server.log 2>&1 & "
        "echo $! >",
        *dir_, "/server.pid");
    ASSERT_EQ(std::system(command.c_str()), 0);
    std::ifstream(*dir_ + "/server.pid") >> server_pid_;
    const absl::Time end = absl::Now() + absl::Seconds(30);
    while (port_ == 0 && absl::Now() < end) {
      std::ifstream(port_file) >> port_;
      if (port_ == 0) absl::SleepFor(absl::Milliseconds(50));
    }
    ASSERT_GT(port_, 0) << "no port file after 30s:\n" << ReadWholeFile(*dir_ + "/server.log");
  }
  static void TearDownTestSuite() {
    // `timeout` passes SIGTERM on to the server.
    if (server_pid_ > 0) kill(server_pid_, SIGTERM);
    delete dir_;
    // A repeated run (--gtest_repeat) starts a new server on a new port.
    dir_ = nullptr;
    port_ = 0;
    server_pid_ = 0;
  }

  // attention_loadtest against the server.
  static Outcome Loadtest(const std::string& args) {
    return RunProgram(ATTENTION_LOADTEST_BIN, absl::StrCat("--target 127.0.0.1:", port_, " ", args),
                      MakeTempDir("loadtest"));
  }

  // The page's checks: its points (when it has any), its references,
  // Chromium's console.
  static void CheckPage(const std::string& html_path, const std::string& name,
                        bool plotted = true) {
    const std::string html = ReadWholeFile(html_path);
    ASSERT_FALSE(html.empty()) << html_path;
    if (plotted) ExpectPlotsAreTheJsons(html);
    ExpectNoNetworkReference(html);
    EXPECT_THAT(OpenInChromium(html_path, name), ::testing::IsEmpty());
  }

  static std::string* dir_;
  static int port_;
  static pid_t server_pid_;
};
std::string* HtmlReportRunTest::dir_ = nullptr;
int HtmlReportRunTest::port_ = 0;
pid_t HtmlReportRunTest::server_pid_ = 0;

TEST_F(HtmlReportRunTest, LiveRunAndTwoSavedRuns) {
  const std::string dir = MakeTempDir("html_runs");
  const Outcome open =
      Loadtest(absl::StrCat("--rate 200 --duration 2s --threshold 'p99<10s' --json ", dir,
                            "/open.json --html ", dir, "/open.html"));
  ASSERT_EQ(open.exit_code, 0) << open.err;
  // The live page embeds exactly what --json wrote.
  const Json saved = Json::parse(ReadWholeFile(dir + "/open.json"), nullptr, false);
  EXPECT_EQ(DataBlock(ReadWholeFile(dir + "/open.html"))["runs"][0]["report"], saved);
  EXPECT_GE(saved["timeline"].size(), 2u);
  CheckPage(dir + "/open.html", "live_open_loop");

  const Outcome closed =
      Loadtest(absl::StrCat("--concurrency 2 --duration 1s --json ", dir, "/closed.json"));
  ASSERT_EQ(closed.exit_code, 0) << closed.err;
  const Outcome report = RunProgram(
      ATTENTION_LOADTEST_BIN,
      absl::StrCat("report ", dir, "/open.json ", dir, "/closed.json --html ", dir, "/both.html"),
      dir);
  ASSERT_EQ(report.exit_code, 0) << report.err;
  const std::string both = ReadWholeFile(dir + "/both.html");
  EXPECT_THAT(both, HasSubstr("<section id=\"differences\">"));
  EXPECT_EQ(DataBlock(both)["runs"][1]["report"],
            Json::parse(ReadWholeFile(dir + "/closed.json"), nullptr, false));
  CheckPage(dir + "/both.html", "saved_runs_overlaid");
}

TEST_F(HtmlReportRunTest, SessionRunPlotsStepsAndCacheReads) {
  const std::string dir = MakeTempDir("html_sessions");
  const Outcome run = Loadtest(absl::StrCat("--sessions 2 --prefill 16 --steps 50 --json ", dir,
                                            "/sessions.json --html ", dir, "/sessions.html"));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const Json saved = Json::parse(ReadWholeFile(dir + "/sessions.json"), nullptr, false);
  ASSERT_FALSE(saved["timeline"].empty());
  int64_t steps = 0;
  for (const Json& point : saved["timeline"]) steps += point["steps"].get<int64_t>();
  EXPECT_EQ(steps, saved["sessions"]["steps"]);
  const std::string html = ReadWholeFile(dir + "/sessions.html");
  EXPECT_THAT(html, HasSubstr("Session steps per second"));
  EXPECT_THAT(html, HasSubstr("Cache bytes read per second"));
  CheckPage(dir + "/sessions.html", "live_sessions");
}

TEST_F(HtmlReportRunTest, FailedRunStillGivesAPage) {
  const std::string dir = MakeTempDir("html_failed");
  // Nothing listens on port 1 of 127.0.0.1.
  const Outcome run =
      RunProgram(ATTENTION_LOADTEST_BIN,
                 absl::StrCat("--target 127.0.0.1:1 --connect_timeout 1s --duration 1s --html ",
                              dir, "/failed.html"),
                 dir);
  EXPECT_EQ(run.exit_code, 1);
  const std::string html = ReadWholeFile(dir + "/failed.html");
  EXPECT_THAT(html, HasSubstr("run: the run failed: "));
  EXPECT_THAT(html, HasSubstr("127.0.0.1:1"));
  EXPECT_THAT(PlottedPoints(html), ::testing::IsEmpty());
  CheckPage(dir + "/failed.html", "failed_run", /*plotted=*/false);
}

}  // namespace
}  // namespace attention::loadtest
