// attention_loadtest --sessions against the fake server's model of sessions
// (tests/client/fake_server.h): the decoders' calls, the counts, and the
// cache bytes read.

#include "client/loadtest/sessions.h"

#include <atomic>
#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "client/loadtest/loadtest.h"
#include "client/loadtest/report.h"
#include "client/loadtest/thresholds.h"
#include "client/loadtest/workload.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/client/fake_server.h"
#include "tests/run_program.h"
#include "tests/safetensors_writer.h"

namespace attention::loadtest {
namespace {

using ::attention::testing::FakeAttentionServer;
using ::attention::testing::MakeTempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;

// Raw attention, 2 heads of 4: a cache row is 2 x (4 + 4) floats.
constexpr int64_t kRowBytes = 2 * (4 + 4) * 4;

// Rows attended over by the steps of one decoder: (P + 1) + ... + (P + T).
double RowsRead(int64_t prefill, int64_t steps) {
  return static_cast<double>(steps * prefill + steps * (steps + 1) / 2);
}

class SessionLoadTest : public ::testing::Test {
 protected:
  SessionLoadOptions Options(int64_t sessions, int64_t prefill, int64_t steps) {
    ShapeOptions shape;
    shape.embed_dim = 8;
    shape.heads = 2;
    shape.mask = MaskKind::kCausalBottomRight;
    shape.query_len = shape.key_len = prefill;
    SessionLoadOptions options;
    options.targets = {server_.address()};
    options.sessions = sessions;
    options.prefill_rows = prefill;
    options.steps = steps;
    options.prefill = *BuildRequest(shape, nullptr);
    shape.query_len = shape.key_len = 1;
    options.step = *BuildRequest(shape, nullptr);
    options.cache_row_bytes = CacheRowBytes(2, 4, 4, v1::Tensor::FLOAT32);
    options.id_prefix = "test-";
    return options;
  }

  FakeAttentionServer server_;
};

TEST(CacheRowBytesTest, IsHeadsTimesKeyAndValueDimsTimesElementSize) {
  EXPECT_EQ(CacheRowBytes(2, 4, 4, v1::Tensor::FLOAT32), kRowBytes);
  EXPECT_EQ(CacheRowBytes(8, 128, 64, v1::Tensor::BFLOAT16), 8 * 192 * 2);
}

// Unary, then with each decoder's calls on a stream of its own.
TEST_F(SessionLoadTest, DecodersPrefillStepAndCloseTheirSessions) {
  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "stream" : "unary");
    const int64_t calls_before = server_.attend_calls();
    SessionLoadOptions options = Options(3, 4, 5);
    options.stream = stream;
    absl::StatusOr<SessionRunResult> result = RunSessions(options);
    ASSERT_TRUE(result.ok()) << result.status();
    const SessionStats& sessions = result->sessions;
    EXPECT_EQ(sessions.opened, 3);
    EXPECT_EQ(sessions.closed, 3);
    EXPECT_EQ(sessions.steps, 15);
    EXPECT_EQ(sessions.recreations, 0);
    EXPECT_EQ(sessions.prefill.count(), 3);
    EXPECT_EQ(sessions.cache_bytes_read, 3 * kRowBytes * RowsRead(4, 5));
    const LoadStats& stats = result->stats;
    EXPECT_EQ(stats.sent, 15);
    EXPECT_EQ(stats.requests(), 15);
    EXPECT_EQ(stats.errors(), 0) << stats.first_error;
    EXPECT_EQ(stats.latency.count(), 15);
    EXPECT_EQ(stats.server_compute.count(), 15);
    // Each decoder: a prefill and five steps.
    EXPECT_EQ(server_.attend_calls() - calls_before, 18);
    EXPECT_EQ(server_.attend_streams(), stream ? 3 : 0);
    EXPECT_EQ(server_.open_sessions(), 0);
    EXPECT_EQ(server_.closed_sessions(), stream ? 6 : 3);
  }
}

TEST_F(SessionLoadTest, ALostSessionIsRecreatedFromTheKeptRows) {
  // Call 1 is the prefill, 2 the first step, 3 the second, which finds its
  // session gone; its recreation is call 4.
  server_.DropSessionsAtCall(3);
  absl::StatusOr<SessionRunResult> result = RunSessions(Options(1, 4, 5));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->sessions.recreations, 1);
  EXPECT_EQ(result->sessions.steps, 5);
  EXPECT_EQ(result->sessions.cache_bytes_read, kRowBytes * RowsRead(4, 5));
  EXPECT_EQ(result->stats.errors(), 0);
  EXPECT_EQ(server_.attend_calls(), 7);
}

TEST_F(SessionLoadTest, WithoutKeptRowsALostSessionEndsItsDecoder) {
  server_.DropSessionsAtCall(3);
  SessionLoadOptions options = Options(1, 4, 5);
  options.keep_rows = false;
  absl::StatusOr<SessionRunResult> result = RunSessions(options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->sessions.steps, 1);
  EXPECT_EQ(result->stats.sent, 2);
  EXPECT_EQ(result->stats.calls_by_code[static_cast<int>(absl::StatusCode::kNotFound)], 1);
  EXPECT_EQ(result->stats.first_error, "NOT_FOUND: session \"test-0\" is not open");
  EXPECT_EQ(result->sessions.closed, 0);
  EXPECT_EQ(result->sessions.cache_bytes_read, kRowBytes * 5.0);
}

TEST_F(SessionLoadTest, AFailedPrefillIsCountedAndSendsNoStep) {
  server_.FailCall(1, grpc::StatusCode::RESOURCE_EXHAUSTED);
  absl::StatusOr<SessionRunResult> result = RunSessions(Options(1, 4, 5));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->sessions.opened, 0);
  EXPECT_EQ(result->sessions.prefill.count(), 1);
  // Sent and failed: requests were more than sent before.
  EXPECT_EQ(result->stats.sent, 1);
  EXPECT_EQ(result->stats.requests(), 1);
  EXPECT_EQ(result->stats.errors(), 1);
  EXPECT_EQ(result->stats.first_error, "RESOURCE_EXHAUSTED: injected failure of call 1");
  EXPECT_EQ(server_.attend_calls(), 1);
}

// A prefill whose answer was lost may have created the session: a decoder
// that stops there (an error it does not send again after) closes it all the
// same (it stayed until it expired before).
TEST_F(SessionLoadTest, APrefillWhoseAnswerWasLostIsClosed) {
  server_.LoseAnswerOfCall(1, grpc::StatusCode::UNKNOWN);
  absl::StatusOr<SessionRunResult> result = RunSessions(Options(1, 4, 5));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->sessions.opened, 0);
  EXPECT_EQ(result->sessions.closed, 0);
  EXPECT_EQ(result->stats.errors(), 1);
  EXPECT_EQ(server_.attend_calls(), 1);
  EXPECT_EQ(server_.closed_sessions(), 1);
  EXPECT_EQ(server_.open_sessions(), 0);
}

// A call whose outcome is unknown (UNAVAILABLE, DEADLINE_EXCEEDED) or that
// found the session moved on (ABORTED) is sent again, as client.md tells a
// decoder to, each failure counted. Through a proxy restarting for a second,
// every decoder stopped at its first error and left its session open, and
// the run passed errors<1% having made a third of its steps.
TEST_F(SessionLoadTest, CallsWhoseOutcomeIsUnknownAreSentAgain) {
  // Call 1, the prefill, applied but its answer lost; call 3, the second
  // step, refused before it is applied.
  server_.LoseAnswerOfCall(1, grpc::StatusCode::DEADLINE_EXCEEDED);
  server_.FailCall(3, grpc::StatusCode::DEADLINE_EXCEEDED);
  server_.FailCloses(2, grpc::StatusCode::UNAVAILABLE);
  SessionLoadOptions options = Options(1, 4, 5);
  options.client.max_attempts = 1;  // the channel's own retries off
  const absl::Time start = absl::Now();
  absl::StatusOr<SessionRunResult> result = RunSessions(options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->sessions.opened, 1);
  EXPECT_EQ(result->sessions.steps, 5);
  EXPECT_EQ(result->sessions.closed, 1);
  EXPECT_EQ(result->sessions.prefill.count(), 2);
  EXPECT_EQ(result->sessions.cache_bytes_read, kRowBytes * RowsRead(4, 5));
  const LoadStats& stats = result->stats;
  EXPECT_EQ(stats.calls_by_code[static_cast<int>(absl::StatusCode::kDeadlineExceeded)], 2);
  EXPECT_EQ(stats.calls_by_code[static_cast<int>(absl::StatusCode::kUnavailable)], 2);
  EXPECT_EQ(stats.requests(), 5 + 4);
  EXPECT_EQ(stats.sent, stats.requests());
  EXPECT_EQ(server_.open_sessions(), 0);
  // Waits of 0.1 s, then 0.1, 0.2 s for the close.
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(400));
}

TEST_F(SessionLoadTest, OtherErrorsStopTheDecoder) {
  server_.FailCall(3, grpc::StatusCode::RESOURCE_EXHAUSTED);
  absl::StatusOr<SessionRunResult> result = RunSessions(Options(1, 4, 5));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->sessions.steps, 1);
  EXPECT_EQ(result->stats.errors(), 1);
  EXPECT_EQ(result->sessions.closed, 1);
  EXPECT_EQ(server_.attend_calls(), 3);
}

// A session the server no longer had at the close (it expired, or the close
// reached another replica) was counted as closed.
TEST_F(SessionLoadTest, ASessionNoLongerOpenAtTheCloseIsNotCountedClosed) {
  server_.DropSessionsAtNextClose();
  absl::StatusOr<SessionRunResult> result = RunSessions(Options(1, 4, 5));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->sessions.steps, 5);
  EXPECT_EQ(result->sessions.closed, 0);
  EXPECT_EQ(result->sessions.not_open_at_close, 1);
  EXPECT_EQ(result->stats.errors(), 0);
  Report report;
  report.stats = result->stats;
  report.sessions = result->sessions;
  EXPECT_THAT(FormatSummary(report),
              HasSubstr("1 of 1 opened with 4 rows, 0 closed, 1 no longer open at close, "));
  EXPECT_THAT(FormatJson(report), HasSubstr("\"not_open_at_close\": 1,"));
}

TEST_F(SessionLoadTest, AnInterruptedRunClosesItsSessions) {
  std::atomic<bool> interrupted{true};
  SessionLoadOptions options = Options(2, 4, 5);
  options.interrupted = &interrupted;
  absl::StatusOr<SessionRunResult> result = RunSessions(options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->sessions.opened, 2);
  EXPECT_EQ(result->sessions.steps, 0);
  EXPECT_EQ(server_.open_sessions(), 0);
}

TEST_F(SessionLoadTest, RejectsOptionsOutOfRange) {
  SessionLoadOptions options = Options(0, 4, 5);
  EXPECT_THAT(RunSessions(options).status().message(), HasSubstr("--sessions is 0"));
  options = Options(1, 4, -1);
  EXPECT_THAT(RunSessions(options).status().message(), HasSubstr("--steps is -1"));
}

// --- RunLoadtest with --sessions ---------------------------------------------

using testing::ReadWholeFile;

class SessionLoadtestTest : public ::testing::Test {
 protected:
  LoadtestConfig Config() const {
    LoadtestConfig config;
    config.targets = {server_.address()};
    config.sessions = 2;
    config.prefill = 3;
    config.steps = 4;
    config.shape.embed_dim = 8;
    config.shape.heads = 2;
    config.mask = "causal_bottom_right";
    return config;
  }

  FakeAttentionServer server_;
};

TEST_F(SessionLoadtestTest, ReportsStepsPrefillAndCacheBytesRead) {
  LoadtestConfig config = Config();
  config.session_dtype = "bfloat16";
  config.verify = true;
  config.json_file = MakeTempDir("sessions") + "/out.json";
  config.thresholds = {"errors<1"};
  std::ostringstream out, err;
  ASSERT_EQ(RunLoadtest(config, out, err), kExitOk) << err.str() << out.str();
  // A bfloat16 row: 2 heads x (4 + 4) x 2 bytes; 2 x 32 x (4 x 3 + 10) = 1408.
  const double bytes = 2 * 32 * RowsRead(3, 4);
  EXPECT_THAT(
      out.str(),
      AllOf(HasSubstr("closed loop 2 sessions x (prefill 3 rows + 4 one-row steps)"),
            HasSubstr("bfloat16 cache, rows kept"), HasSubstr("\nstep "), HasSubstr("\nprefill "),
            HasSubstr("2 of 2 opened with 3 rows, 2 closed, 0 recreated; bfloat16 "
                      "cache, 32 B a row"),
            HasSubstr("8 of 8 answered in"), HasSubstr("cache read     1.41 kB in")));
  const nlohmann::json json =
      nlohmann::json::parse(ReadWholeFile(config.json_file), nullptr, false);
  ASSERT_FALSE(json.is_discarded());
  EXPECT_EQ(json["requests"], 8);
  EXPECT_EQ(json["latency_us"]["count"], 8);
  const nlohmann::json& sessions = json["sessions"];
  EXPECT_EQ(sessions["sessions"], 2);
  EXPECT_EQ(sessions["prefill_rows"], 3);
  EXPECT_EQ(sessions["steps_per_session"], 4);
  EXPECT_EQ(sessions["cache_dtype"], "bfloat16");
  EXPECT_EQ(sessions["cache_row_bytes"], 32);
  EXPECT_EQ(sessions["opened"], 2);
  EXPECT_EQ(sessions["closed"], 2);
  EXPECT_EQ(sessions["recreations"], 0);
  EXPECT_EQ(sessions["steps"], 8);
  EXPECT_EQ(sessions["cache_bytes_read"], bytes);
  EXPECT_EQ(sessions["prefill_us"]["count"], 2);
  const double seconds = json["duration_s"];
  ASSERT_GT(seconds, 0);
  EXPECT_DOUBLE_EQ(sessions["steps_per_s"], 8 / seconds);
  EXPECT_DOUBLE_EQ(sessions["cache_bytes_read_per_s"], bytes / seconds);
}

TEST_F(SessionLoadtestTest, StreamRunsSayWhichApiTheyUsed) {
  LoadtestConfig config = Config();
  config.json_file = MakeTempDir("sessions_stream") + "/out.json";
  std::ostringstream out, err;
  ASSERT_EQ(RunLoadtest(config, out, err), kExitOk) << err.str() << out.str();
  EXPECT_THAT(out.str(), HasSubstr("one-row steps), unary Attend\n"));
  EXPECT_EQ(server_.attend_streams(), 0);

  config.stream = true;
  std::ostringstream out2, err2;
  ASSERT_EQ(RunLoadtest(config, out2, err2), kExitOk) << err2.str() << out2.str();
  EXPECT_THAT(out2.str(),
              AllOf(HasSubstr("one-row steps), AttendStream\n"), HasSubstr("8 of 8 answered in")));
  const nlohmann::json json =
      nlohmann::json::parse(ReadWholeFile(config.json_file), nullptr, false);
  ASSERT_FALSE(json.is_discarded());
  EXPECT_EQ(json["run"]["api"], "stream");
  EXPECT_EQ(json["sessions"]["steps"], 8);
  EXPECT_EQ(server_.attend_streams(), 2);
}

// Every decoder holds its stream open, so at most kStreamsPerConnection
// share a connection: 201 decoders get 3.
TEST_F(SessionLoadtestTest, StreamDecodersOpenAConnectionPerHundred) {
  LoadtestConfig config = Config();
  config.sessions = 2 * kStreamsPerConnection + 1;
  config.steps = 1;
  config.stream = true;
  std::ostringstream out, err;
  ASSERT_EQ(RunLoadtest(config, out, err), kExitOk) << err.str() << out.str();
  EXPECT_THAT(out.str(), AllOf(HasSubstr(" x 3 connections, 201 threads"),
                               HasSubstr("201 of 201 answered in")));
  EXPECT_EQ(server_.attend_streams(), 201);
  EXPECT_EQ(server_.distinct_peers(), 3u);
}

TEST_F(SessionLoadtestTest, AModelsCacheRowIsItsEmbedDimForKeysAndValues) {
  LoadtestConfig config = Config();
  config.shape.model = "demo";
  config.shape.embed_dim = 0;
  config.json_file = MakeTempDir("sessions_model") + "/out.json";
  std::ostringstream out, err;
  ASSERT_EQ(RunLoadtest(config, out, err), kExitOk) << err.str() << out.str();
  const nlohmann::json json =
      nlohmann::json::parse(ReadWholeFile(config.json_file), nullptr, false);
  // The fake's demo model: embed_dim 8, 2 heads of 4.
  EXPECT_EQ(json["sessions"]["cache_row_bytes"], kRowBytes);
}

TEST_F(SessionLoadtestTest, GroupedQueryDecodersCacheTheirKeyValueHeads) {
  LoadtestConfig config = Config();
  config.shape.heads = 4;
  config.shape.kv_heads = 2;
  config.verify = true;
  config.json_file = MakeTempDir("sessions_gqa") + "/out.json";
  std::ostringstream out, err;
  ASSERT_EQ(RunLoadtest(config, out, err), kExitOk) << err.str() << out.str();
  EXPECT_THAT(out.str(), AllOf(HasSubstr("raw attention, 4 heads over 2 key/value, query "
                                         "[1, 4, 1, 2] float32, key [1, 2, 1, 2] float32"),
                               HasSubstr("8 of 8 answered in")));
  const nlohmann::json json =
      nlohmann::json::parse(ReadWholeFile(config.json_file), nullptr, false);
  ASSERT_FALSE(json.is_discarded());
  // 2 key/value heads x (2 + 2) float32 elements: half a 4-head cache's row.
  EXPECT_EQ(json["sessions"]["cache_row_bytes"], 2 * (2 + 2) * 4);
  EXPECT_EQ(json["sessions"]["cache_bytes_read"], 2 * 32 * RowsRead(3, 4));
  EXPECT_EQ(json["requests"], 8);
  EXPECT_TRUE(json["errors"].empty()) << json["errors"];
}

TEST_F(SessionLoadtestTest, FlagsOfOtherLoadsAreRefused) {
  LoadtestConfig config = Config();
  config.rate = 10;
  config.shape.batch = 2;
  config.transport = "h2";
  std::ostringstream out, err;
  EXPECT_EQ(RunLoadtest(config, out, err), kExitSetup);
  EXPECT_THAT(err.str(), HasSubstr("error: --sessions runs decoders of --prefill and --steps "
                                   "calls; it does not take --rate, --transport h2, --batch\n"));

  for (const auto& [change, message] :
       std::vector<std::pair<std::function<void(LoadtestConfig&)>, std::string>>{
           {[](LoadtestConfig& c) { c.mask = "causal"; },
            "--sessions takes --mask none or causal_bottom_right"},
           {[](LoadtestConfig& c) { c.session_dtype = "float16"; },
            "--session_dtype \"float16\" is not float32 or bfloat16"},
           {[](LoadtestConfig& c) { c.prefill = 0; }, "--prefill is 0"},
           {[](LoadtestConfig& c) { c.prefill = 300'000'000; },
            "--prefill is 300000000; want 1 to 268435456"},
           // Each decoder runs on a thread of its own.
           {[](LoadtestConfig& c) { c.threads = 4; }, "it does not take --threads\n"},
           // The flags both kinds of run take are checked alike.
           {[](LoadtestConfig& c) { c.transport = "bogus"; },
            "--transport: \"bogus\" is not one of auto, grpc and h2"},
           {[](LoadtestConfig& c) { c.timeout = absl::Seconds(-1); },
            "--timeout is -1s; want 0 (no deadline) or more"},
           {[](LoadtestConfig& c) { c.connections = 5000; },
            "--connections is 5000; want 1 to 1024"},
       }) {
    config = Config();
    change(config);
    std::ostringstream out2, err2;
    EXPECT_EQ(RunLoadtest(config, out2, err2), kExitSetup) << message;
    EXPECT_THAT(err2.str(), HasSubstr(message));
  }
  EXPECT_EQ(server_.attend_calls(), 0);
}

// The one prefill failed, so no step was measured: a latency gate cannot pass
// on an empty histogram's 0.
TEST_F(SessionLoadtestTest, LatencyGatesBreakWhenNoStepWasMeasured) {
  server_.FailCall(1, grpc::StatusCode::RESOURCE_EXHAUSTED);
  LoadtestConfig config = Config();
  config.sessions = 1;
  config.thresholds = {"p99<20ms", "max<1ms"};
  std::ostringstream out, err;
  EXPECT_EQ(RunLoadtest(config, out, err), kExitThreshold) << err.str() << out.str();
  EXPECT_THAT(out.str(), AllOf(HasSubstr("0 of 4 answered in"),
                               HasSubstr("threshold      BROKEN: p99<20ms: no measured call\n"),
                               HasSubstr("threshold      BROKEN: max<1ms: no measured call\n")));
}

}  // namespace
}  // namespace attention::loadtest
