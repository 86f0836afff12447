// attention_loadtest end to end: RunLoadtest against the real server (with
// --verify), and the binary itself for flags and exit codes.

#include "client/loadtest/loadtest.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/loadtest/report.h"
#include "client/loadtest/thresholds.h"
#include "client/loadtest/workload.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/client/fake_server.h"
#include "tests/run_program.h"
#include "tests/safetensors_writer.h"
#include "tests/server/test_server.h"

#ifndef ATTENTION_LOADTEST_BIN
#error "ATTENTION_LOADTEST_BIN must be defined by the build"
#endif

namespace attention::loadtest {
namespace {

using ::attention::testing::FakeAttentionServer;
using ::attention::testing::MakeTempDir;
using ::testing::HasSubstr;
using ::testing::Not;

using testing::Outcome;
using testing::ReadWholeFile;

nlohmann::json ReadJson(const std::string& path) {
  return nlohmann::json::parse(ReadWholeFile(path), nullptr, /*allow_exceptions=*/false);
}

// --- against the real server ------------------------------------------------

class LoadtestServerTest : public testing::ServerSuite<> {
 protected:
  static void SetUpTestSuite() {
    ServerOptions options;
    options.model_repository = ATTENTION_MODELS_DIR;
    StartSuiteServer(options);
  }

  LoadtestConfig Config() const {
    LoadtestConfig config;
    config.targets = {server_->server().address()};
    config.concurrency = 4;
    config.requests = 200;
    return config;
  }

  static Outcome RunConfig(const LoadtestConfig& config) {
    std::ostringstream out, err;
    Outcome outcome;
    outcome.exit_code = RunLoadtest(config, out, err);
    outcome.out = out.str();
    outcome.err = err.str();
    return outcome;
  }
};

// Both transports: the real server's answers read and verified alike.
TEST_F(LoadtestServerTest, DemoModelAnswersPassVerify) {
  for (const char* transport : {"grpc", "h2"}) {
    SCOPED_TRACE(transport);
    LoadtestConfig config = Config();
    config.shape.model = "demo";
    config.verify = true;
    config.transport = transport;
    config.json_file = MakeTempDir("demo") + "/out.json";
    const Outcome outcome = RunConfig(config);
    ASSERT_EQ(outcome.exit_code, kExitOk) << outcome.err << outcome.out;
    const nlohmann::json json = ReadJson(config.json_file);
    EXPECT_EQ(json["requests"], 200);
    EXPECT_TRUE(json["errors"].empty()) << json["errors"];
    EXPECT_EQ(json["server_compute_us"]["count"], 200);
    EXPECT_FALSE(json["batch_sizes"].empty());
    EXPECT_EQ(json["run"]["transport"], transport) << json["run"];
    EXPECT_THAT(outcome.out, HasSubstr("model demo, query [1, 16, 64] float32"));
  }
}

// Decoders with sessions against the real server: the demo model and raw
// attention with a BFLOAT16 cache; the bytes a step reads, by the loadtest's
// count, match the session's own in GetSession.
TEST_F(LoadtestServerTest, SessionDecodersPrefillStepAndClose) {
  for (const char* dtype : {"float32", "bfloat16"}) {
    SCOPED_TRACE(dtype);
    LoadtestConfig config;
    config.targets = {server_->server().address()};
    config.shape.model = "demo";
    config.sessions = 2;
    config.prefill = 16;
    config.steps = 8;
    config.session_dtype = dtype;
    config.json_file = MakeTempDir("sessions") + "/out.json";
    const Outcome outcome = RunConfig(config);
    ASSERT_EQ(outcome.exit_code, kExitOk) << outcome.err << outcome.out;
    const nlohmann::json json = ReadJson(config.json_file);
    EXPECT_TRUE(json["errors"].empty()) << json["errors"];
    const nlohmann::json& sessions = json["sessions"];
    EXPECT_EQ(sessions["opened"], 2);
    EXPECT_EQ(sessions["closed"], 2);
    EXPECT_EQ(sessions["steps"], 16);
    EXPECT_EQ(sessions["recreations"], 0);
    // The demo model: 4 heads of 16 keys and 16 values.
    EXPECT_EQ(sessions["cache_row_bytes"],
              4 * (16 + 16) * (std::string(dtype) == "float32" ? 4 : 2));
  }
}

TEST_F(LoadtestServerTest, RawStreamWithWeightsAndMasksPassesVerify) {
  LoadtestConfig config = Config();
  config.stream = true;
  config.shape.heads = 4;
  config.shape.key_len = 24;
  config.shape.need_weights = true;
  config.mask = "attn_mask";
  config.dtype = "bfloat16";
  config.verify = true;
  config.thresholds = {"errors<1"};
  const Outcome outcome = RunConfig(config);
  EXPECT_EQ(outcome.exit_code, kExitOk) << outcome.err << outcome.out;
  EXPECT_THAT(outcome.out, HasSubstr("requests       200 "));
}

TEST_F(LoadtestServerTest, OpenLoopWithWarmUpAndPoissonArrivals) {
  LoadtestConfig config = Config();
  config.concurrency = 0;
  config.requests = 0;
  config.rate = 200;
  config.arrival = "poisson";
  config.duration = absl::Milliseconds(500);
  config.warmup = absl::Milliseconds(200);
  config.mask = "causal";
  config.verify = true;
  config.thresholds = {"errors<1"};
  const Outcome outcome = RunConfig(config);
  EXPECT_EQ(outcome.exit_code, kExitOk) << outcome.err << outcome.out;
  EXPECT_THAT(outcome.out, HasSubstr("poisson arrivals"));
}

// --expected: the answers must hold the values of a saved response, which the
// seeded request makes reproducible.
TEST_F(LoadtestServerTest, AnswersAreComparedWithAnExpectedResponse) {
  LoadtestConfig config = Config();
  config.shape.model = "demo";
  config.requests = 50;
  absl::StatusOr<v1::GetModelResponse> model = client().GetModel("demo");
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<v1::AttendRequest> request = BuildRequest(config.shape, &model->config());
  ASSERT_TRUE(request.ok()) << request.status();
  absl::StatusOr<v1::AttendResponse> response = client().Attend(*request);
  ASSERT_TRUE(response.ok()) << response.status();

  const std::string dir = MakeTempDir("expected");
  std::string json;
  ASSERT_TRUE(google::protobuf::util::MessageToJsonString(*response, &json).ok());
  config.expected_file = dir + "/expected.json";
  testing::WriteFile(config.expected_file, json);
  config.thresholds = {"errors<1"};
  Outcome outcome = RunConfig(config);
  EXPECT_EQ(outcome.exit_code, kExitOk) << outcome.err << outcome.out;

  // The same file with one output value moved by 0.5.
  std::vector<float> values = *client::ReadFloats(response->output());
  values[3] += 0.5f;
  const std::vector<int64_t> shape(response->output().shape().begin(),
                                   response->output().shape().end());
  *response->mutable_output() = *client::MakeFloatTensor(shape, values);
  json.clear();
  ASSERT_TRUE(google::protobuf::util::MessageToJsonString(*response, &json).ok());
  testing::WriteFile(config.expected_file, json);
  outcome = RunConfig(config);
  EXPECT_EQ(outcome.exit_code, kExitThreshold) << outcome.err << outcome.out;
  EXPECT_THAT(outcome.out, HasSubstr("VERIFY_FAILED 50"));
  EXPECT_THAT(outcome.out, HasSubstr("output: element 3 is"));
}

// A server that wants a bearer token: h2 sends it as gRPC's client does, and
// a wrong one counts UNAUTHENTICATED with the server's message.
TEST(LoadtestAuthTest, H2SendsTheBearerToken) {
  const std::string dir = MakeTempDir("h2_auth");
  {
    std::ofstream token(dir + "/token");
    token << "s3cret\n";
  }
  ServerOptions server_options;
  server_options.model_repository = ATTENTION_MODELS_DIR;
  server_options.auth_token_file = dir + "/token";
  absl::StatusOr<std::unique_ptr<testing::TestServer>> server =
      testing::TestServer::Start(server_options);
  ASSERT_TRUE(server.ok()) << server.status();
  LoadtestConfig config;
  config.targets = {(*server)->server().address()};
  config.transport = "h2";
  config.concurrency = 2;
  config.requests = 20;
  config.shape.model = "demo";
  config.client.bearer_token = "s3cret";
  std::ostringstream out, err;
  ASSERT_EQ(RunLoadtest(config, out, err), kExitOk) << err.str() << out.str();
  EXPECT_THAT(out.str(), HasSubstr("errors         0 "));

  // Raw attention: with the model, the wrong token would fail GetModel first.
  config.shape.model.clear();
  config.client.bearer_token = "wrong";
  config.thresholds = {"errors<1"};
  std::ostringstream out2, err2;
  EXPECT_EQ(RunLoadtest(config, out2, err2), kExitThreshold) << err2.str();
  EXPECT_THAT(out2.str(), HasSubstr("UNAUTHENTICATED 20"));
}

TEST_F(LoadtestServerTest, SetupErrorsExitWithOne) {
  LoadtestConfig config = Config();
  config.shape.model = "nope";
  Outcome outcome = RunConfig(config);
  EXPECT_EQ(outcome.exit_code, kExitSetup);
  EXPECT_THAT(outcome.err, HasSubstr("error: model nope on"));

  config = Config();
  config.rate = 10;
  outcome = RunConfig(config);
  EXPECT_EQ(outcome.exit_code, kExitSetup);
  EXPECT_THAT(outcome.err, HasSubstr("one of --concurrency, --rate and --schedule"));

  config = Config();
  config.mask = "diagonal";
  EXPECT_THAT(RunConfig(config).err, HasSubstr("mask \"diagonal\""));

  config = Config();
  config.concurrency = 0;
  config.schedule = "rate:10@1s";
  config.duration = absl::Seconds(1);
  EXPECT_THAT(RunConfig(config).err, HasSubstr("--duration and --schedule"));

  config = Config();
  config.transport = "h3";
  EXPECT_THAT(RunConfig(config).err,
              HasSubstr("--transport: \"h3\" is not one of auto, grpc and h2"));

  config = Config();
  config.json_file = "/nonexistent/folder/run.json";
  const Outcome missing_folder = RunConfig(config);
  EXPECT_EQ(missing_folder.exit_code, kExitSetup);
  EXPECT_THAT(missing_folder.err, HasSubstr("--json /nonexistent/folder/run.json: the folder "
                                            "/nonexistent/folder does not exist"));
  EXPECT_THAT(missing_folder.out, ::testing::IsEmpty()) << "it did not run";

  config = Config();
  config.transport = "h2";
  config.threads = 2;
  config.client.max_attempts = 1;
  EXPECT_THAT(RunConfig(config).err,
              HasSubstr("--transport h2 polls on one thread and does not retry; --threads and "
                        "--max_attempts need --transport grpc (or auto)"));
}

TEST(LoadtestTransportTest, AutoTakesH2WhereItCanCarryTheRun) {
  LoadtestConfig config;
  constexpr size_t kSmall = 4 << 10;
  for (const char* target : {"127.0.0.1:50051", "localhost:1", "[::1]:50051", "attention:80"}) {
    config.targets = {target};
    EXPECT_EQ(ResolveTransport(config, kSmall), "h2") << target;
  }
  EXPECT_EQ(ResolveTransport(config, kMaxH2AutoRequestBytes), "h2");
  EXPECT_EQ(ResolveTransport(config, kMaxH2AutoRequestBytes + 1), "grpc");
  for (const char* target : {"dns:///localhost:1", "ipv4:127.0.0.1:1,127.0.0.2:1",
                             "unix:/tmp/socket", "localhost", "::1:50051", ":50051"}) {
    config.targets = {"127.0.0.1:1", target};
    EXPECT_EQ(ResolveTransport(config, kSmall), "grpc") << target;
  }
  config.targets = {"127.0.0.1:1"};
  config.stream = true;
  EXPECT_EQ(ResolveTransport(config, kSmall), "grpc");
  config.stream = false;
  config.client.tls_ca_file = "ca.pem";
  EXPECT_EQ(ResolveTransport(config, kSmall), "grpc");
  config.client.tls_ca_file.clear();
  config.threads = 2;  // options only gRPC's client has
  EXPECT_EQ(ResolveTransport(config, kSmall), "grpc");
  config.threads = 1;
  config.client.max_attempts = 1;
  EXPECT_EQ(ResolveTransport(config, kSmall), "grpc");
  config.client.max_attempts = client::ClientOptions().max_attempts;
  EXPECT_EQ(ResolveTransport(config, kSmall), "h2");
  config.transport = "grpc";
  EXPECT_EQ(ResolveTransport(config, kSmall), "grpc");
  config.transport = "h2";
  EXPECT_EQ(ResolveTransport(config, kMaxH2AutoRequestBytes + 1), "h2");
}

// Each flag change, from a config that would run, is refused before any
// call: exit 1 with exactly `error: <message>`.
using FlagChange = std::pair<std::function<void(LoadtestConfig&)>, std::string>;
void ExpectRefusedBeforeAnyCall(const std::vector<FlagChange>& cases) {
  FakeAttentionServer server;
  for (const auto& [change, message] : cases) {
    LoadtestConfig config;
    config.targets = {server.address()};
    change(config);
    std::ostringstream out, err;
    EXPECT_EQ(RunLoadtest(config, out, err), kExitSetup) << message;
    EXPECT_EQ(err.str(), absl::StrCat("error: ", message, "\n"));
  }
  EXPECT_EQ(server.attend_calls(), 0);
}

// --rate and --concurrency take --schedule's limits, and a rate that is not
// a number is refused: NaN once ran as a closed loop of one caller, and an
// infinite or huge rate queued calls without end.
TEST(LoadtestFlagsTest, RateAndConcurrencyTakeTheSchedulesLimits) {
  ExpectRefusedBeforeAnyCall({
      {[](LoadtestConfig& c) { c.rate = std::nan(""); }, "--rate nan is not a non-negative number"},
      {[](LoadtestConfig& c) { c.rate = std::numeric_limits<double>::infinity(); },
       "--rate inf is not a non-negative number"},
      {[](LoadtestConfig& c) { c.rate = -1; }, "--rate -1 is not a non-negative number"},
      {[](LoadtestConfig& c) { c.rate = 1e12; }, "--rate 1e+12 is above 100000000/s"},
      {[](LoadtestConfig& c) { c.rate = 100'000'001; }, "--rate 100000001 is above 100000000/s"},
      {[](LoadtestConfig& c) { c.concurrency = 2'000'000; },
       "--concurrency is a whole number from 0 to 1000000, not 2000000"},
      {[](LoadtestConfig& c) { c.concurrency = -1; },
       "--concurrency is a whole number from 0 to 1000000, not -1"},
  });
}

// Said before a model's lookup, which failed to connect first and said so.
TEST(LoadtestFlagsTest, WhatH2CannotCarryIsSaidBeforeAnyConnection) {
  ExpectRefusedBeforeAnyCall({
      {[](LoadtestConfig& c) {
         c.transport = "h2";
         c.shape.model = "demo";
         c.client.tls_ca_file = "/nonexistent/ca.pem";
       },
       "--transport h2 is plaintext only; TLS needs grpc"},
      {[](LoadtestConfig& c) {
         c.transport = "h2";
         c.shape.model = "demo";
         c.stream = true;
       },
       "--transport h2 sends unary calls; --stream needs grpc"},
  });
}

// The flags both kinds of run take (--sessions has its own cases in
// sessions_test.cc), and the request's dims, name the flag and the exact
// limit.
TEST(LoadtestFlagsTest, OutOfRangeFlagsNameTheFlagAndTheLimit) {
  ExpectRefusedBeforeAnyCall({
      {[](LoadtestConfig& c) { c.connections = 0; }, "--connections is 0; want 1 to 1024"},
      {[](LoadtestConfig& c) { c.connections = 1025; }, "--connections is 1025; want 1 to 1024"},
      {[](LoadtestConfig& c) { c.threads = 65; }, "--threads is 65; want 1 to 64"},
      {[](LoadtestConfig& c) { c.timeout = absl::Milliseconds(-1); },
       "--timeout is -1ms; want 0 (no deadline) or more"},
      {[](LoadtestConfig& c) { c.connect_timeout = absl::ZeroDuration(); },
       "--connect_timeout 0 is not a positive, finite duration"},
      {[](LoadtestConfig& c) { c.shape.heads = 0; }, "--heads is 0; want 1 to 268435456"},
      {[](LoadtestConfig& c) { c.shape.query_len = 300'000'000; },
       "--seq_len is 300000000; want 1 to 268435456"},
      {[](LoadtestConfig& c) {
         c.shape.query_len = 100'000;
         c.shape.embed_dim = 10'000;
       },
       "query [1, 100000, 10000] has more than 268435456 elements (the server's "
       "--max_tensor_elements)"},
  });
}

// --- the binary -------------------------------------------------------------

#if defined(__SANITIZE_THREAD__)
// The binary of a ThreadSanitizer build has no tests/tsan_absl_sync.cc, so
// TSan would take every absl::Mutex-guarded access in it for a race; its code
// is checked in this process, where the runner tests run it.
constexpr char kEnvironment[] = "TSAN_OPTIONS=report_bugs=0 ";
#else
constexpr char kEnvironment[] = "";
#endif

// Runs attention_loadtest with `args` (shell words, quoted as needed).
Outcome RunBinary(const std::string& args) {
  const std::string dir = MakeTempDir("binary");
  return testing::RunCommand(absl::StrCat(kEnvironment, ATTENTION_LOADTEST_BIN, " ", args), dir);
}

class LoadtestBinaryTest : public ::testing::Test {
 protected:
  // Two targets and a short closed loop.
  std::string Load() const {
    return absl::StrCat("--target ", first_.address(), " --target=", second_.address(),
                        " --concurrency 2 --requests 100 --seq_len 4 --embed_dim 8");
  }

  FakeAttentionServer first_;
  FakeAttentionServer second_;
};

TEST_F(LoadtestBinaryTest, ABrokenThresholdExitsWithTwoAndSaysWhich) {
  const Outcome outcome =
      RunBinary(absl::StrCat(Load(), " --threshold 'p99<1ns' --threshold 'errors<1%'"));
  EXPECT_EQ(outcome.exit_code, kExitThreshold) << outcome.err;
  EXPECT_THAT(outcome.out, HasSubstr("BROKEN: p99<1ns: p99 is"));
  EXPECT_THAT(outcome.out, HasSubstr("ok: errors<1%: errors are 0%"));
  EXPECT_EQ(first_.attend_calls(), 50);
  EXPECT_EQ(second_.attend_calls(), 50);
}

TEST_F(LoadtestBinaryTest, KeptThresholdsExitWithZero) {
  const Outcome outcome = RunBinary(absl::StrCat(Load(), " --threshold 'p99<10s,errors<1'"));
  EXPECT_EQ(outcome.exit_code, kExitOk) << outcome.err;
  EXPECT_THAT(outcome.out, Not(HasSubstr("BROKEN")));
  EXPECT_THAT(outcome.out, HasSubstr("requests       100 "));
}

TEST_F(LoadtestBinaryTest, ABadCommandLineExitsWithOne) {
  Outcome outcome = RunBinary(absl::StrCat(Load(), " --threshold 'p99<20'"));
  EXPECT_EQ(outcome.exit_code, kExitSetup);
  EXPECT_THAT(outcome.err, HasSubstr("error: threshold \"p99<20\""));
  outcome = RunBinary("--no_such_flag");
  EXPECT_EQ(outcome.exit_code, kExitSetup);
  // absl reads "nan" as a double; it once ran as a closed loop of one caller.
  outcome = RunBinary("--target 127.0.0.1:1 --rate nan");
  EXPECT_EQ(outcome.exit_code, kExitSetup);
  EXPECT_THAT(outcome.err, HasSubstr("error: --rate nan is not a non-negative number"));
  outcome = RunBinary(absl::StrCat(Load(), " extra"));
  EXPECT_EQ(outcome.exit_code, kExitSetup);
  EXPECT_THAT(outcome.err, HasSubstr("unexpected argument \"extra\""));
}

// gRPC's own log lines (a failed handshake logs an ERROR per attempt) broke
// into the progress line and the summary; GRPC_VERBOSITY keeps them.
TEST_F(LoadtestBinaryTest, GrpcsOwnLogLinesAreLeftOutUnlessAsked) {
  const std::string args = absl::StrCat("--target ", first_.address(),
                                        " --tls_server_name localhost --connect_timeout 1s "
                                        "--requests 1 --transport grpc --progress=false");
  const Outcome quiet = RunBinary(args);
  EXPECT_EQ(quiet.exit_code, kExitSetup);
  EXPECT_EQ(quiet.err, absl::StrCat("error: cannot connect to ", first_.address(), " within 1s\n"));
  const Outcome verbose = testing::RunCommand(
      absl::StrCat("GRPC_VERBOSITY=ERROR ", kEnvironment, ATTENTION_LOADTEST_BIN, " ", args),
      MakeTempDir("verbose"));
  EXPECT_THAT(verbose.err, HasSubstr("Handshake failed"));
}

// The header of --csv was looked for by reading the file first: /dev/stdout
// under a pipe is the tester's own output, and it waited for it for ever.
TEST_F(LoadtestBinaryTest, CsvToAPipeGetsTheHeaderAndTheRow) {
  const std::string dir = MakeTempDir("csv_pipe");
  const Outcome outcome =
      testing::RunCommand(absl::StrCat(kEnvironment, "timeout 60 ", ATTENTION_LOADTEST_BIN, " ",
                                       Load(), " --csv /dev/stdout | cat"),
                          dir);
  EXPECT_THAT(outcome.out, HasSubstr("requests       100 "));
  EXPECT_THAT(outcome.out, HasSubstr(absl::StrCat("\n", CsvHeader(), "\n")));
}

// A summary written nowhere (a full disk) is a failed run, not a passed one.
TEST_F(LoadtestBinaryTest, ASummaryThatCannotBeWrittenExitsWithOne) {
  const std::string dir = MakeTempDir("full");
  const Outcome outcome = testing::RunCommand(
      absl::StrCat("(", kEnvironment, ATTENTION_LOADTEST_BIN, " ", Load(), " >/dev/full)"), dir);
  EXPECT_EQ(outcome.exit_code, kExitSetup) << outcome.err;
  EXPECT_THAT(outcome.err, HasSubstr("error: cannot write the summary to standard output"));
}

TEST_F(LoadtestBinaryTest, HistogramLogsOfTwoRunsMergeIntoOne) {
  const std::string dir = MakeTempDir("merge");
  for (const char* name : {"a", "b"}) {
    const Outcome outcome = RunBinary(absl::StrCat(Load(), " --histogram_log ", dir, "/", name,
                                                   ".hlog --csv ", dir, "/runs.csv"));
    ASSERT_EQ(outcome.exit_code, kExitOk) << outcome.err;
  }
  const Outcome merged = RunBinary(absl::StrCat("merge ", dir, "/a.hlog ", dir, "/b.hlog --json ",
                                                dir, "/merged.json --threshold 'errors<1'"));
  ASSERT_EQ(merged.exit_code, kExitOk) << merged.err;
  EXPECT_THAT(merged.out, HasSubstr("merged histogram logs"));
  const nlohmann::json json = ReadJson(dir + "/merged.json");
  EXPECT_EQ(json["requests"], 200);
  EXPECT_EQ(json["latency_us"]["count"], 200);
  // Two rows under one header.
  const std::vector<std::string> lines =
      absl::StrSplit(ReadWholeFile(dir + "/runs.csv"), '\n', absl::SkipEmpty());
  EXPECT_EQ(lines.size(), 3u);

  const Outcome broken = RunBinary(absl::StrCat("merge ", dir, "/runs.csv"));
  EXPECT_EQ(broken.exit_code, kExitSetup);
  EXPECT_THAT(broken.err, HasSubstr("not a histogram log"));
}

}  // namespace
}  // namespace attention::loadtest
