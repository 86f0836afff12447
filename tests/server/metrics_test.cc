#include "server/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "engine/attention.h"
#include "gmock/gmock.h"
#include "grpcpp/support/status.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "tests/status_matchers.h"

namespace attention::server {
namespace {

using ::attention::testing::IsOk;
using ::attention::testing::StatusIs;
using ::testing::AllOf;
using ::testing::Contains;
using ::testing::Gt;
using ::testing::HasSubstr;
using ::testing::Le;
using ::testing::Optional;

using Labels = std::map<std::string, std::string>;

struct Sample {
  std::string name;
  Labels labels;
  double value = 0;
};

// One exposition in the text format 0.0.4, checked line by line as it is
// parsed: failures are reported as test failures naming the line.
struct Exposition {
  std::vector<Sample> samples;
  std::map<std::string, std::string> types;  // family name -> counter, gauge, ...
  std::set<std::string> helped;              // families with a # HELP line

  // The value of the one sample `name` with exactly `labels`, if present.
  std::optional<double> Value(const std::string& name, const Labels& labels = {}) const {
    std::optional<double> found;
    for (const Sample& sample : samples) {
      if (sample.name != name || sample.labels != labels) continue;
      EXPECT_FALSE(found.has_value()) << "duplicate series " << name;
      found = sample.value;
    }
    return found;
  }
};

// The family a sample belongs to: histogram samples drop their suffix.
std::string FamilyOf(const std::string& name, const std::map<std::string, std::string>& types) {
  for (const absl::string_view suffix : {"_bucket", "_sum", "_count"}) {
    absl::string_view base = name;
    if (absl::ConsumeSuffix(&base, suffix) && types.count(std::string(base)) > 0 &&
        types.at(std::string(base)) == "histogram") {
      return std::string(base);
    }
  }
  return name;
}

bool IsMetricNameChar(char c, bool first) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
         (!first && c >= '0' && c <= '9');
}

// Parses `{a="x",b="y"}` at the front of `text` (which starts at '{'),
// unescaping \\, \" and \n; consumes it. False on malformed text.
bool ConsumeLabels(absl::string_view* text, Labels* labels) {
  if (!absl::ConsumePrefix(text, "{")) return false;
  while (!absl::ConsumePrefix(text, "}")) {
    const size_t equals = text->find("=\"");
    if (equals == absl::string_view::npos || equals == 0) return false;
    const std::string name(text->substr(0, equals));
    text->remove_prefix(equals + 2);
    std::string value;
    while (true) {
      if (text->empty()) return false;
      const char c = text->front();
      text->remove_prefix(1);
      if (c == '"') break;
      if (c == '\n') return false;
      if (c != '\\') {
        value += c;
        continue;
      }
      if (text->empty()) return false;
      const char escaped = text->front();
      text->remove_prefix(1);
      if (escaped == 'n') {
        value += '\n';
      } else if (escaped == '\\' || escaped == '"') {
        value += escaped;
      } else {
        return false;
      }
    }
    if (!labels->emplace(name, value).second) return false;
    absl::ConsumePrefix(text, ",");
  }
  return true;
}

bool ParseValue(absl::string_view text, double* value) {
  if (text == "+Inf") {
    *value = std::numeric_limits<double>::infinity();
    return true;
  }
  if (text == "-Inf") {
    *value = -std::numeric_limits<double>::infinity();
    return true;
  }
  if (text == "NaN") {
    *value = std::nan("");
    return true;
  }
  return absl::SimpleAtod(text, value);
}

// Adds one line of an exposition to `exposition`.
void ParseLine(absl::string_view line, Exposition* exposition) {
  SCOPED_TRACE(absl::StrCat("line: ", line));
  if (absl::ConsumePrefix(&line, "# HELP ")) {
    const std::string name(line.substr(0, line.find(' ')));
    EXPECT_TRUE(exposition->helped.insert(name).second) << "second HELP for " << name;
    return;
  }
  if (absl::ConsumePrefix(&line, "# TYPE ")) {
    const std::vector<std::string> parts = absl::StrSplit(line, ' ');
    ASSERT_EQ(parts.size(), 2u);
    EXPECT_THAT((std::set<std::string>{"counter", "gauge", "histogram"}), Contains(parts[1]));
    EXPECT_TRUE(exposition->types.emplace(parts[0], parts[1]).second)
        << "second TYPE for " << parts[0];
    return;
  }
  ASSERT_NE(line.front(), '#') << "unexpected comment";
  Sample sample;
  size_t end = 0;
  while (end < line.size() && IsMetricNameChar(line[end], end == 0)) ++end;
  ASSERT_GT(end, 0u) << "no metric name";
  sample.name = std::string(line.substr(0, end));
  line.remove_prefix(end);
  if (!line.empty() && line.front() == '{') {
    ASSERT_TRUE(ConsumeLabels(&line, &sample.labels)) << "malformed labels";
  }
  ASSERT_TRUE(absl::ConsumePrefix(&line, " ")) << "no space before the value";
  ASSERT_TRUE(ParseValue(line, &sample.value)) << "value is not a number";
  const std::string family = FamilyOf(sample.name, exposition->types);
  EXPECT_TRUE(exposition->types.count(family) > 0) << "sample before its # TYPE line";
  EXPECT_TRUE(exposition->helped.count(family) > 0) << "sample without # HELP";
  exposition->samples.push_back(std::move(sample));
}

Exposition Parse(const std::string& text) {
  Exposition exposition;
  EXPECT_TRUE(!text.empty() && text.back() == '\n') << "the exposition must end with a newline";
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    ParseLine(line, &exposition);
  }
  return exposition;
}

Labels With(Labels labels, const std::string& name, const std::string& value) {
  labels[name] = value;
  return labels;
}

// Every histogram series: buckets non-decreasing in `le`, +Inf == _count.
void ExpectHistogramsConsistent(const Exposition& exposition) {
  std::map<std::pair<std::string, Labels>, std::vector<std::pair<double, double>>> buckets;
  for (const Sample& sample : exposition.samples) {
    absl::string_view base = sample.name;
    if (!absl::ConsumeSuffix(&base, "_bucket")) continue;
    Labels series = sample.labels;
    ASSERT_EQ(series.count("le"), 1u) << sample.name;
    double le;
    ASSERT_TRUE(ParseValue(series["le"], &le)) << series["le"];
    series.erase("le");
    buckets[{std::string(base), series}].push_back({le, sample.value});
  }
  for (const auto& [series, points] : buckets) {
    SCOPED_TRACE(series.first);
    for (size_t i = 1; i < points.size(); ++i) {
      EXPECT_LT(points[i - 1].first, points[i].first) << "le out of order";
      EXPECT_LE(points[i - 1].second, points[i].second) << "buckets not cumulative";
    }
    ASSERT_FALSE(points.empty());
    EXPECT_TRUE(std::isinf(points.back().first)) << "no +Inf bucket";
    EXPECT_THAT(exposition.Value(series.first + "_count", series.second),
                Optional(points.back().second));
  }
}

// The engine's output pool is the process's: a freed block of 1 MiB or more
// joins it, and the gauge shows it.
TEST(MetricsTest, PooledBytesShowFreedEngineOutputBlocks) {
  constexpr size_t kBytes = (size_t{3} << 20) + 12345;
  void* block = AllocateOutputMemory(kBytes);
  const size_t before = PooledOutputBytes();
  FreeOutputMemory(block, kBytes);
  const size_t after = PooledOutputBytes();
  EXPECT_GE(after - before, kBytes);
  Metrics metrics;
  EXPECT_THAT(Parse(metrics.RenderPrometheus()).Value("attention_engine_pooled_bytes"),
              Optional(static_cast<double>(after)));
}

// Closed sessions' cache blocks are pooled for new sessions, and the gauge
// shows them; a new block of that size comes from the pool.
TEST(MetricsTest, SessionPooledBytesShowFreedCacheBlocks) {
  constexpr size_t kBytes = 40000;
  // The pool is the process's: blocks that earlier tests' sessions freed
  // (up to twice kBytes) would serve this allocation. With no idle time
  // allowed, the allocation first frees them all, and its block is new.
  const std::chrono::nanoseconds previous = SetOutputPoolIdleLimit(std::chrono::nanoseconds(0));
  void* block = AllocateSessionBlock(kBytes);
  SetOutputPoolIdleLimit(previous);
  EXPECT_EQ(PooledSessionBlockBytes(), 0u);
  ASSERT_NE(block, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(block) % 64, 0u);
  const size_t before = PooledSessionBlockBytes();
  FreeSessionBlock(block);
  const size_t after = PooledSessionBlockBytes();
  EXPECT_EQ(after - before, kBytes);
  Metrics metrics;
  EXPECT_THAT(Parse(metrics.RenderPrometheus()).Value("attention_session_pooled_bytes"),
              Optional(static_cast<double>(after)));
  void* again = AllocateSessionBlock(kBytes);
  EXPECT_EQ(PooledSessionBlockBytes(), before);
  FreeSessionBlock(again);
}

TEST(MetricsTest, EmptyMetricsRenderEveryFamily) {
  Metrics metrics;
  const Exposition exposition = Parse(metrics.RenderPrometheus());
  EXPECT_EQ(exposition.types, (std::map<std::string, std::string>{
                                  {"attention_requests_total", "counter"},
                                  {"attention_requests_over_limit_total", "counter"},
                                  {"attention_latency_seconds", "histogram"},
                                  {"attention_batch_size", "histogram"},
                                  {"attention_queue_depth", "gauge"},
                                  {"attention_in_flight", "gauge"},
                                  {"attention_memory_reserved_bytes", "gauge"},
                                  {"attention_engine_pooled_bytes", "gauge"},
                                  {"attention_malloc_trims_total", "counter"},
                                  {"attention_malloc_trim_seconds_total", "counter"},
                                  {"attention_not_computed_total", "counter"},
                                  {"attention_interrupted_total", "counter"},
                                  {"attention_sessions_open", "gauge"},
                                  {"attention_session_cache_bytes", "gauge"},
                                  {"attention_session_pooled_bytes", "gauge"},
                                  {"attention_sessions_ended_total", "counter"},
                                  {"attention_session_rows_appended_total", "counter"},
                                  {"attention_queue_limit", "gauge"},
                                  {"attention_memory_budget_bytes", "gauge"},
                                  {"attention_session_cache_limit_bytes", "gauge"},
                                  {"attention_build_info", "gauge"},
                                  {"process_cpu_seconds_total", "counter"},
                                  {"process_resident_memory_bytes", "gauge"},
                                  {"process_virtual_memory_bytes", "gauge"},
                                  {"process_start_time_seconds", "gauge"},
                                  {"process_open_fds", "gauge"},
                              }));
  EXPECT_THAT(exposition.Value("attention_queue_depth"), Optional(0.0));
  EXPECT_THAT(exposition.Value("attention_in_flight"), Optional(0.0));
  EXPECT_THAT(exposition.Value("attention_build_info", {{"version", ATTENTION_TEST_VERSION}}),
              Optional(1.0));
  // The process's, from /proc: this test's own process.
  EXPECT_THAT(exposition.Value("process_resident_memory_bytes"), Optional(Gt(1e6)));
  EXPECT_THAT(exposition.Value("process_open_fds"), Optional(Gt(2.0)));
  // Boot time (whole seconds) plus ticks since boot, as Prometheus's own
  // clients compute it: near now, not exactly (the VM's clock drifts from
  // its boot time's).
  const double now = static_cast<double>(time(nullptr));
  EXPECT_THAT(exposition.Value("process_start_time_seconds"),
              Optional(AllOf(Gt(now - 600), Le(now + 600))));
  metrics.SetLimits(1024, 1536ll << 20, 1024ll << 20);
  const Exposition limited = Parse(metrics.RenderPrometheus());
  EXPECT_THAT(limited.Value("attention_queue_limit"), Optional(1024.0));
  EXPECT_THAT(limited.Value("attention_memory_budget_bytes"), Optional(1536.0 * (1 << 20)));
  EXPECT_THAT(limited.Value("attention_session_cache_limit_bytes"), Optional(1024.0 * (1 << 20)));
  EXPECT_THAT(exposition.Value("attention_memory_reserved_bytes"), Optional(0.0));
  EXPECT_THAT(exposition.Value("attention_batch_size_count"), Optional(0.0));
  EXPECT_THAT(exposition.Value("attention_not_computed_total", {{"reason", "cancelled"}}),
              Optional(0.0));
  EXPECT_THAT(exposition.Value("attention_not_computed_total", {{"reason", "deadline_exceeded"}}),
              Optional(0.0));
  for (const char* reason : {"closed", "evicted", "expired"}) {
    EXPECT_THAT(exposition.Value("attention_sessions_ended_total", {{"reason", reason}}),
                Optional(0.0));
  }
  ExpectHistogramsConsistent(exposition);
}

// As Prometheus's own clients count them: every descriptor the process has
// open, the listing's own included. The two /proc files read for the other
// process metrics were counted too, while still open.
TEST(MetricsTest, ProcessOpenFdsCountsTheProcesssOwnDescriptors) {
  Metrics metrics;
  const auto listed = [] {
    int64_t fds = 0;
    for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
      (void)entry;
      ++fds;
    }
    return fds;
  };
  // Another thread of the test binary may open or close one meanwhile: one
  // of a few tries sees them still.
  double closest = 1e9;
  for (int attempt = 0; attempt < 5 && closest != 0; ++attempt) {
    const int64_t want = listed();
    const std::optional<double> got = Parse(metrics.RenderPrometheus()).Value("process_open_fds");
    ASSERT_TRUE(got.has_value());
    closest = std::min(closest, std::abs(*got - static_cast<double>(want)));
  }
  EXPECT_EQ(closest, 0);
}

TEST(MetricsTest, CountsRequestsByMethodModelAndCodeName) {
  Metrics metrics;
  metrics.CountRequest("Attend", "demo", 0);
  metrics.CountRequest("Attend", "demo", 0);
  metrics.CountRequest("Attend", "demo", static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  metrics.CountRequest("GetModel", "", static_cast<int>(grpc::StatusCode::NOT_FOUND));
  metrics.CountRequest("Attend", "demo", 42);

  const std::string text = metrics.RenderPrometheus();
  EXPECT_THAT(text, HasSubstr("attention_requests_total{method=\"Attend\",model=\"demo\","
                              "code=\"OK\"} 2\n"));
  const Exposition exposition = Parse(text);
  const Labels attend = {{"method", "Attend"}, {"model", "demo"}};
  EXPECT_THAT(exposition.Value("attention_requests_total", With(attend, "code", "OK")),
              Optional(2.0));
  EXPECT_THAT(
      exposition.Value("attention_requests_total", With(attend, "code", "INVALID_ARGUMENT")),
      Optional(1.0));
  EXPECT_THAT(exposition.Value("attention_requests_total", With(attend, "code", "42")),
              Optional(1.0));
  EXPECT_THAT(exposition.Value("attention_requests_total",
                               {{"method", "GetModel"}, {"model", ""}, {"code", "NOT_FOUND"}}),
              Optional(1.0));
}

TEST(MetricsTest, LatencyBucketsAreCumulativeWithInclusiveUpperBounds) {
  Metrics metrics;
  metrics.ObserveSeconds("queue", "Attend", 0.0003);  // le 0.0005
  metrics.ObserveSeconds("queue", "Attend", 0.001);   // exactly a bound: le 0.001
  metrics.ObserveSeconds("queue", "Attend", 0.002);   // le 0.0025
  metrics.ObserveSeconds("queue", "Attend", 100);     // above 60: +Inf only
  metrics.ObserveSeconds("compute", "Attend", 0.02);

  const std::string text = metrics.RenderPrometheus();
  EXPECT_THAT(text, HasSubstr("attention_latency_seconds_bucket{stage=\"queue\",method=\"Attend\","
                              "le=\"0.001\"} 2\n"));
  const Exposition exposition = Parse(text);
  const Labels queue = {{"stage", "queue"}, {"method", "Attend"}};
  auto bucket = [&](const std::string& le) {
    return exposition.Value("attention_latency_seconds_bucket", With(queue, "le", le));
  };
  EXPECT_THAT(bucket("0.00005"), Optional(0.0));
  EXPECT_THAT(bucket("0.00025"), Optional(0.0));
  EXPECT_THAT(bucket("0.0005"), Optional(1.0));
  EXPECT_THAT(bucket("0.001"), Optional(2.0));
  EXPECT_THAT(bucket("0.0025"), Optional(3.0));
  EXPECT_THAT(bucket("30"), Optional(3.0));
  EXPECT_THAT(bucket("+Inf"), Optional(4.0));
  EXPECT_THAT(exposition.Value("attention_latency_seconds_count", queue), Optional(4.0));
  const std::optional<double> sum = exposition.Value("attention_latency_seconds_sum", queue);
  ASSERT_TRUE(sum.has_value());
  EXPECT_DOUBLE_EQ(*sum, 0.0003 + 0.001 + 0.002 + 100);
  EXPECT_THAT(exposition.Value("attention_latency_seconds_count",
                               {{"stage", "compute"}, {"method", "Attend"}}),
              Optional(1.0));
  ExpectHistogramsConsistent(exposition);
}

// From a small call's queue wait (tens of microseconds) to a long call's
// compute (tens of seconds: --max_request_gflop allows 2000 GFLOP).
TEST(MetricsTest, LatencyBoundsSpan25MicrosecondsTo60Seconds) {
  const std::vector<double>& bounds = Metrics::LatencyBuckets();
  ASSERT_FALSE(bounds.empty());
  EXPECT_DOUBLE_EQ(bounds.front(), 25e-6);
  EXPECT_DOUBLE_EQ(bounds.back(), 60);
  for (size_t i = 1; i < bounds.size(); ++i) {
    EXPECT_LT(bounds[i - 1], bounds[i]);
    EXPECT_LE(bounds[i] / bounds[i - 1], 3.0) << "too coarse above " << bounds[i - 1];
  }
}

TEST(MetricsTest, NegativeSecondsCountAsZeroAndNaNIsDropped) {
  Metrics metrics;
  metrics.ObserveSeconds("total", "Attend", -1);
  metrics.ObserveSeconds("total", "Attend", std::nan(""));
  const Exposition exposition = Parse(metrics.RenderPrometheus());
  const Labels total = {{"stage", "total"}, {"method", "Attend"}};
  EXPECT_THAT(exposition.Value("attention_latency_seconds_bucket", With(total, "le", "0.00005")),
              Optional(1.0));
  EXPECT_THAT(exposition.Value("attention_latency_seconds_count", total), Optional(1.0));
  EXPECT_THAT(exposition.Value("attention_latency_seconds_sum", total), Optional(0.0));
}

TEST(MetricsTest, BatchSizesGoToPowerOfTwoBuckets) {
  Metrics metrics;
  metrics.ObserveBatchSize(1);
  metrics.ObserveBatchSize(3);
  metrics.ObserveBatchSize(256);
  metrics.ObserveBatchSize(1000);
  const Exposition exposition = Parse(metrics.RenderPrometheus());
  auto bucket = [&](const std::string& le) {
    return exposition.Value("attention_batch_size_bucket", {{"le", le}});
  };
  EXPECT_THAT(bucket("1"), Optional(1.0));
  EXPECT_THAT(bucket("2"), Optional(1.0));
  EXPECT_THAT(bucket("4"), Optional(2.0));
  EXPECT_THAT(bucket("128"), Optional(2.0));
  EXPECT_THAT(bucket("256"), Optional(3.0));
  EXPECT_THAT(bucket("+Inf"), Optional(4.0));
  EXPECT_THAT(exposition.Value("attention_batch_size_sum"), Optional(1260.0));
  ExpectHistogramsConsistent(exposition);
}

TEST(MetricsTest, GaugesHoldTheLatestValue) {
  Metrics metrics;
  metrics.SetQueueDepth(7);
  metrics.SetQueueDepth(5);
  metrics.AddInFlight(3);
  metrics.AddInFlight(-1);
  const Exposition exposition = Parse(metrics.RenderPrometheus());
  EXPECT_THAT(exposition.Value("attention_queue_depth"), Optional(5.0));
  EXPECT_THAT(exposition.Value("attention_in_flight"), Optional(2.0));
}

// What the heap trimmer watches: a session's end frees its cache whether or
// not a call arrives (an expiry), so it counts as activity.
TEST(MetricsTest, CallsAndEndedSessionsCountAsActivity) {
  Metrics metrics;
  EXPECT_EQ(metrics.activity(), 0u);
  metrics.NoteCallArrived();
  EXPECT_EQ(metrics.activity(), 1u);
  metrics.CountSessionEnded("expired");
  metrics.CountSessionEnded("closed");
  EXPECT_EQ(metrics.activity(), 3u);
}

TEST(MetricsTest, CountsRequestsNotComputedByReason) {
  Metrics metrics;
  metrics.CountNotComputed("cancelled");
  metrics.CountNotComputed("deadline_exceeded");
  metrics.CountNotComputed("deadline_exceeded");
  const Exposition exposition = Parse(metrics.RenderPrometheus());
  EXPECT_THAT(exposition.Value("attention_not_computed_total", {{"reason", "cancelled"}}),
              Optional(1.0));
  EXPECT_THAT(exposition.Value("attention_not_computed_total", {{"reason", "deadline_exceeded"}}),
              Optional(2.0));
}

TEST(MetricsTest, OverLimitCountsStartAtZeroForEveryMethodAndLimit) {
  Metrics metrics;
  metrics.CountOverLimit("AttendStream", "max_message_mb");
  metrics.CountOverLimit("Attend", "some_new_limit");
  const Exposition exposition = Parse(metrics.RenderPrometheus());
  for (const char* method : {"Attend", "AttendStream"}) {
    for (const char* limit :
         {"max_tensor_elements", "max_score_elements", "max_request_mb", "max_request_gflop",
          "memory_budget_mb", "max_message_mb", "session_memory_mb"}) {
      SCOPED_TRACE(absl::StrCat(method, " ", limit));
      const bool counted =
          std::string(method) == "AttendStream" && std::string(limit) == "max_message_mb";
      EXPECT_THAT(exposition.Value("attention_requests_over_limit_total",
                                   {{"method", method}, {"limit", limit}}),
                  Optional(counted ? 1.0 : 0.0));
    }
  }
  EXPECT_THAT(exposition.Value("attention_requests_over_limit_total",
                               {{"method", "Attend"}, {"limit", "some_new_limit"}}),
              Optional(1.0));
}

TEST(MetricsTest, EscapesBackslashQuoteAndNewlineInLabelValues) {
  Metrics metrics;
  metrics.CountRequest("Attend", "a\"b\\c\nd", 0);
  const std::string text = metrics.RenderPrometheus();
  EXPECT_THAT(text, HasSubstr("model=\"a\\\"b\\\\c\\nd\""));
  EXPECT_THAT(Parse(text).Value("attention_requests_total",
                                {{"method", "Attend"}, {"model", "a\"b\\c\nd"}, {"code", "OK"}}),
              Optional(1.0));
}

TEST(MetricsTest, ConcurrentRecordingLosesNothing) {
  Metrics metrics;
  constexpr int kThreads = 4;
  constexpr int kPerThread = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&metrics] {
      for (int i = 0; i < kPerThread; ++i) {
        metrics.CountRequest("Attend", "demo", 0);
        metrics.ObserveSeconds("total", "Attend", 0.001);
        metrics.AddInFlight(1);
        metrics.AddInFlight(-1);
        if (i % 100 == 0) metrics.RenderPrometheus();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  const Exposition exposition = Parse(metrics.RenderPrometheus());
  EXPECT_THAT(exposition.Value("attention_requests_total",
                               {{"method", "Attend"}, {"model", "demo"}, {"code", "OK"}}),
              Optional(double{kThreads * kPerThread}));
  EXPECT_THAT(exposition.Value("attention_latency_seconds_count",
                               {{"stage", "total"}, {"method", "Attend"}}),
              Optional(double{kThreads * kPerThread}));
  EXPECT_THAT(exposition.Value("attention_in_flight"), Optional(0.0));
  EXPECT_THAT(exposition.Value("attention_memory_reserved_bytes"), Optional(0.0));
}

class MetricsServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<MetricsServer>> server =
        MetricsServer::Start("127.0.0.1", 0, &metrics_);
    ASSERT_THAT(server, IsOk());
    server_ = *std::move(server);
    ASSERT_GT(server_->port(), 0);
  }

  httplib::Result Get(const std::string& path) {
    httplib::Client client("127.0.0.1", server_->port());
    client.set_connection_timeout(5);
    client.set_read_timeout(5);
    return client.Get(path.c_str());
  }

  Metrics metrics_;
  std::unique_ptr<MetricsServer> server_;
};

TEST_F(MetricsServerTest, ServesTheMetricsAsPrometheusText) {
  metrics_.CountRequest("Attend", "demo", 0);
  metrics_.ObserveSeconds("compute", "Attend", 0.004);
  metrics_.SetQueueDepth(3);

  httplib::Result result = Get("/metrics");
  ASSERT_TRUE(result) << httplib::to_string(result.error());
  EXPECT_EQ(result->status, 200);
  EXPECT_EQ(result->get_header_value("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  const Exposition exposition = Parse(result->body);
  EXPECT_THAT(exposition.Value("attention_requests_total",
                               {{"method", "Attend"}, {"model", "demo"}, {"code", "OK"}}),
              Optional(1.0));
  EXPECT_THAT(exposition.Value("attention_latency_seconds_bucket",
                               {{"stage", "compute"}, {"method", "Attend"}, {"le", "0.005"}}),
              Optional(1.0));
  EXPECT_THAT(exposition.Value("attention_queue_depth"), Optional(3.0));
  ExpectHistogramsConsistent(exposition);
}

TEST_F(MetricsServerTest, ScrapesSeeNewValues) {
  httplib::Result before = Get("/metrics");
  ASSERT_TRUE(before) << httplib::to_string(before.error());
  EXPECT_THAT(Parse(before->body).Value("attention_in_flight"), Optional(0.0));
  metrics_.AddInFlight(4);
  httplib::Result after = Get("/metrics");
  ASSERT_TRUE(after) << httplib::to_string(after.error());
  EXPECT_THAT(Parse(after->body).Value("attention_in_flight"), Optional(4.0));
}

// Connections that send nothing must not stall the probes: with two workers
// and httplib's 5 s wait for a request, two idle sockets held /healthz for
// 4 to 21 s, past any load balancer's check timeout.
TEST_F(MetricsServerTest, IdleConnectionsDoNotHoldUpProbes) {
  std::vector<int> idle;
  for (int i = 0; i < MetricsServer::kMetricsWorkers - 2; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(server_->port()));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
    idle.push_back(fd);
  }
  httplib::Client client("127.0.0.1", server_->port());
  client.set_read_timeout(3);  // the old server answered after 5 s at best
  httplib::Result result = client.Get("/healthz");
  for (int fd : idle) close(fd);
  ASSERT_TRUE(result) << httplib::to_string(result.error());
  EXPECT_EQ(result->status, 200);
}

TEST_F(MetricsServerTest, HealthzIsOk) {
  httplib::Result result = Get("/healthz");
  ASSERT_TRUE(result) << httplib::to_string(result.error());
  EXPECT_EQ(result->status, 200);
  EXPECT_EQ(result->body, "ok\n");
}

// /readyz: 503 with the reason until SetReady(), 200 "ok" then, 503 with the
// new reason after SetNotReady(); /healthz stays 200 all along.
TEST_F(MetricsServerTest, ReadyzFollowsSetReadyAndSetNotReady) {
  httplib::Result starting = Get("/readyz");
  ASSERT_TRUE(starting) << httplib::to_string(starting.error());
  EXPECT_EQ(starting->status, 503);
  EXPECT_EQ(starting->body, absl::StrCat(MetricsServer::kStartingReason, "\n"));
  server_->SetReady();
  httplib::Result ready = Get("/readyz");
  ASSERT_TRUE(ready) << httplib::to_string(ready.error());
  EXPECT_EQ(ready->status, 200);
  EXPECT_EQ(ready->body, "ok\n");
  server_->SetNotReady("draining: test");
  httplib::Result draining = Get("/readyz");
  ASSERT_TRUE(draining) << httplib::to_string(draining.error());
  EXPECT_EQ(draining->status, 503);
  EXPECT_EQ(draining->body, "draining: test\n");
  httplib::Result live = Get("/healthz");
  ASSERT_TRUE(live) << httplib::to_string(live.error());
  EXPECT_EQ(live->status, 200);
}

TEST_F(MetricsServerTest, OtherPathsAreNotFound) {
  httplib::Result result = Get("/nope");
  ASSERT_TRUE(result) << httplib::to_string(result.error());
  EXPECT_EQ(result->status, 404);
}

// httplib's default socket options set SO_REUSEPORT, with which a second
// server silently shared the port instead of failing.
TEST_F(MetricsServerTest, PortInUseIsUnavailable) {
  EXPECT_THAT(MetricsServer::Start("127.0.0.1", server_->port(), &metrics_),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr(absl::StrCat("127.0.0.1:", server_->port()))));
}

TEST(MetricsServerStartTest, RejectsBadArguments) {
  Metrics metrics;
  EXPECT_THAT(MetricsServer::Start("127.0.0.1", 0, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no metrics")));
  EXPECT_THAT(MetricsServer::Start("127.0.0.1", 70000, &metrics),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("70000")));
  EXPECT_THAT(MetricsServer::Start("127.0.0.1", -2, &metrics),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("-2")));
}

// Regression: stopping right after Start must not race the listener thread
// (httplib's stop() is a no-op until the listener runs, and the join hung).
TEST(MetricsServerStartTest, StartThenStopAtOnceNeverHangs) {
  Metrics metrics;
  for (int i = 0; i < 50; ++i) {
    absl::StatusOr<std::unique_ptr<MetricsServer>> server =
        MetricsServer::Start("127.0.0.1", 0, &metrics);
    ASSERT_THAT(server, IsOk());
  }
}

}  // namespace
}  // namespace attention::server
