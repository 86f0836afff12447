#include "client/cli.h"

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/fake_server.h"
#include "tests/status_matchers.h"

namespace attention::client {
namespace {

using ::attention::testing::FakeAttentionServer;
using ::attention::testing::IsOk;
using ::attention::testing::StatusIs;
using ::testing::AllOf;
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::StartsWith;

constexpr char kSmallRequest[] = R"({
  "id": "r1",
  "query": {"shape": [1, 1, 2], "float_data": [1.5, -2]},
  "need_weights": true,
  "output_dtype": "BFLOAT16"
})";

struct CliResult {
  int code = -1;
  std::string out;
  std::string err;
};

CliResult RunCliOn(const std::vector<std::string>& args, const std::string& stdin_text = "") {
  std::istringstream in(stdin_text);
  std::ostringstream out, err;
  CliResult result;
  result.code = RunCli(args, in, out, err);
  result.out = out.str();
  result.err = err.str();
  return result;
}

// The one error line RunCli writes for a failed call.
MATCHER_P(IsErrorLine, prefix, "") {
  return ::testing::ExplainMatchResult(AllOf(StartsWith(prefix), EndsWith("\n")), arg,
                                       result_listener) &&
         arg.find('\n') == arg.size() - 1;
}

TEST(ParseCliArgsTest, Defaults) {
  absl::StatusOr<CliCommand> command = ParseCliArgs({"call"});
  ASSERT_THAT(command, IsOk());
  EXPECT_EQ(command->command, "call");
  EXPECT_EQ(command->input, "-");
  EXPECT_FALSE(command->raw);
  EXPECT_EQ(command->client.target, "127.0.0.1:50051");
  EXPECT_EQ(command->client.timeout, absl::Seconds(30));
  EXPECT_EQ(command->client.bearer_token, "");
}

TEST(ParseCliArgsTest, FlagsBeforeAndAfterTheCommand) {
  absl::StatusOr<CliCommand> command =
      ParseCliArgs({"--target", "10.0.0.1:9", "--timeout=500ms", "call", "req.json", "--raw",
                    "--token", "abc", "--max_message_mb=64"});
  ASSERT_THAT(command, IsOk());
  EXPECT_EQ(command->command, "call");
  EXPECT_EQ(command->input, "req.json");
  EXPECT_TRUE(command->raw);
  EXPECT_EQ(command->client.target, "10.0.0.1:9");
  EXPECT_EQ(command->client.timeout, absl::Milliseconds(500));
  EXPECT_EQ(command->client.bearer_token, "abc");
  EXPECT_EQ(command->client.max_message_mb, 64);
  EXPECT_EQ(command->affinity, "");
  command = ParseCliArgs({"close", "a", "--affinity=g"});
  ASSERT_THAT(command, IsOk());
  EXPECT_EQ(command->affinity, "g");
}

TEST(ParseCliArgsTest, TlsFlags) {
  absl::StatusOr<CliCommand> command =
      ParseCliArgs({"health", "--tls_ca", "ca.pem", "--tls_cert=client.pem", "--tls_key",
                    "client.key", "--tls_server_name", "attention.test"});
  ASSERT_THAT(command, IsOk());
  EXPECT_EQ(command->client.tls_ca_file, "ca.pem");
  EXPECT_EQ(command->client.tls_cert_file, "client.pem");
  EXPECT_EQ(command->client.tls_key_file, "client.key");
  EXPECT_EQ(command->client.tls_server_name_override, "attention.test");
}

// Half of a key pair is a mistake in the command line (exit 2), named by
// its flags, found before connecting.
TEST(RunCliTest, TlsCertificateWithoutKeyIsAUsageError) {
  const CliResult result = RunCliOn({"health", "--tls_cert", "client.pem"});
  EXPECT_EQ(result.code, kCliUsage);
  EXPECT_THAT(
      result.err,
      StartsWith("error: INVALID_ARGUMENT: --tls_cert needs --tls_key (its private key)\n"));
}

TEST(ParseCliArgsTest, HealthService) {
  absl::StatusOr<CliCommand> command = ParseCliArgs({"health", "--service", "attention.v1.X"});
  ASSERT_THAT(command, IsOk());
  EXPECT_EQ(command->command, "health");
  EXPECT_EQ(command->service, "attention.v1.X");
}

TEST(ParseCliArgsTest, DoubleDashEndsFlags) {
  absl::StatusOr<CliCommand> command = ParseCliArgs({"call", "--", "--odd-name.json"});
  ASSERT_THAT(command, IsOk());
  EXPECT_EQ(command->input, "--odd-name.json");
}

TEST(ParseCliArgsTest, ModelTakesAName) {
  absl::StatusOr<CliCommand> command = ParseCliArgs({"model", "demo"});
  ASSERT_THAT(command, IsOk());
  EXPECT_EQ(command->model, "demo");
  EXPECT_THAT(ParseCliArgs({"model"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model needs a NAME")));
}

TEST(ParseCliArgsTest, SessionTakesAnIdAndCloseSeveral) {
  absl::StatusOr<CliCommand> command = ParseCliArgs({"session", "decoder-7"});
  ASSERT_THAT(command, IsOk());
  EXPECT_EQ(command->command, "session");
  EXPECT_THAT(command->session_ids, ElementsAre("decoder-7"));
  command = ParseCliArgs({"close", "a", "--", "-b"});
  ASSERT_THAT(command, IsOk());
  EXPECT_THAT(command->session_ids, ElementsAre("a", "-b"));

  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_THAT(ParseCliArgs({"session"}), StatusIs(kInvalid, "session needs an ID"));
  EXPECT_THAT(ParseCliArgs({"session", "a", "b"}),
              StatusIs(kInvalid, HasSubstr("session takes 1 argument, got 2: unexpected \"b\"")));
  EXPECT_THAT(ParseCliArgs({"close"}), StatusIs(kInvalid, "close needs one or more IDs"));
}

TEST(ParseCliArgsTest, NamesTheBadArgument) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_THAT(ParseCliArgs({}), StatusIs(kInvalid, "no command given"));
  EXPECT_THAT(ParseCliArgs({"frobnicate"}),
              StatusIs(kInvalid, HasSubstr("unknown command \"frobnicate\"")));
  EXPECT_THAT(ParseCliArgs({"--colour", "call"}),
              StatusIs(kInvalid, HasSubstr("unknown flag \"--colour\"")));
  EXPECT_THAT(ParseCliArgs({"call", "--target"}),
              StatusIs(kInvalid, HasSubstr("--target needs a value")));
  EXPECT_THAT(ParseCliArgs({"call", "--raw=yes"}),
              StatusIs(kInvalid, HasSubstr("--raw takes no value")));
  EXPECT_THAT(ParseCliArgs({"--timeout", "soon", "info"}),
              StatusIs(kInvalid, HasSubstr("--timeout: \"soon\" is not")));
  EXPECT_THAT(ParseCliArgs({"--timeout", "-1s", "info"}),
              StatusIs(kInvalid, HasSubstr("--timeout: \"-1s\" is not")));
  EXPECT_THAT(ParseCliArgs({"--max_message_mb", "lots", "info"}),
              StatusIs(kInvalid, HasSubstr("--max_message_mb: \"lots\"")));
  // Past what gRPC can take: a bad command line, not a failed call.
  EXPECT_THAT(ParseCliArgs({"--max_message_mb", "5000", "info"}),
              StatusIs(kInvalid, HasSubstr("--max_message_mb: \"5000\" is not an integer from 1 "
                                           "to 2047")));
  EXPECT_THAT(ParseCliArgs({"call", "a.json", "b.json"}),
              StatusIs(kInvalid, HasSubstr("call takes 1 argument, got 2: unexpected \"b.json\"")));
  EXPECT_THAT(ParseCliArgs({"info", "extra"}),
              StatusIs(kInvalid, HasSubstr("info takes 0 arguments, got 1")));
  EXPECT_THAT(ParseCliArgs({"info", "--service", "x"}),
              StatusIs(kInvalid, HasSubstr("--service applies to health, not info")));
  EXPECT_THAT(ParseCliArgs({"info", "--raw"}),
              StatusIs(kInvalid, HasSubstr("--raw applies to call, not info")));
  EXPECT_THAT(
      ParseCliArgs({"models", "--affinity", "a"}),
      StatusIs(kInvalid, HasSubstr("--affinity applies to call, session and close, not models")));
  EXPECT_THAT(ParseCliArgs({"--tls_cert", "c.pem", "health"}),
              StatusIs(kInvalid, HasSubstr("--tls_cert needs --tls_key (its private key)")));
  EXPECT_THAT(ParseCliArgs({"--tls_key", "k.pem", "health"}),
              StatusIs(kInvalid, HasSubstr("--tls_key needs --tls_cert (its certificate)")));
}

// A token gRPC could not send (it would abort the process) is a usage error.
TEST(RunCliTest, ATokenAHeaderCannotCarryIsAUsageError) {
  const CliResult result = RunCliOn({"info", "--token", "ab\ncd"});
  EXPECT_EQ(result.code, kCliUsage);
  EXPECT_THAT(result.err,
              StartsWith("error: INVALID_ARGUMENT: --token: byte 2 of 5 is 0x0a; a token goes in "
                         "a header, so it must be printable ASCII"));
}

TEST(RunCliTest, UsageErrorsExitTwo) {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {}, {"bogus"}, {"--nope", "info"}, {"call", "--timeout"}, {"health", "x"}}) {
    CliResult result = RunCliOn(args);
    EXPECT_EQ(result.code, kCliUsage) << ::testing::PrintToString(args);
    EXPECT_THAT(result.err, StartsWith("error: INVALID_ARGUMENT: "));
    EXPECT_THAT(result.out, IsEmpty());
  }
}

TEST(RunCliTest, HelpPrintsUsageAndExitsZero) {
  CliResult result = RunCliOn({"--help"});
  EXPECT_EQ(result.code, kCliOk);
  EXPECT_THAT(result.out, StartsWith("usage: attention_cli"));
  EXPECT_THAT(result.err, IsEmpty());
  EXPECT_EQ(RunCliOn({"-h", "call"}).code, kCliOk);
}

TEST(RunCliTest, HelpListsEveryFlag) {
  const std::string help = RunCliOn({"--help"}).out;
  const std::vector<std::string> flags = CliFlagNames();
  EXPECT_THAT(flags, Contains("target"));
  for (const std::string& flag : flags) {
    EXPECT_THAT(help, HasSubstr(absl::StrCat("\n  --", flag, " "))) << flag;
  }
}

// The request is parsed before connecting: these fail without any server.
TEST(RunCliTest, UnknownJsonFieldIsNamed) {
  CliResult result =
      RunCliOn({"--target", "127.0.0.1:1", "call"}, R"({"querry": {"shape": [1, 1, 1]}})");
  EXPECT_EQ(result.code, kCliError);
  EXPECT_THAT(result.err,
              AllOf(IsErrorLine("error: INVALID_ARGUMENT: standard input: not an AttendRequest"),
                    HasSubstr("querry")));
  EXPECT_THAT(result.out, IsEmpty());
}

TEST(RunCliTest, MalformedJsonIsRejected) {
  CliResult result = RunCliOn({"call", "-"}, R"({"id": "x", "need_weights": tru})");
  EXPECT_EQ(result.code, kCliError);
  EXPECT_THAT(result.err, IsErrorLine("error: INVALID_ARGUMENT: standard input: not an "
                                      "AttendRequest in JSON: "));
}

TEST(RunCliTest, WrongJsonTypeIsRejected) {
  CliResult result = RunCliOn({"call"}, R"({"num_heads": "two"})");
  EXPECT_EQ(result.code, kCliError);
  EXPECT_THAT(result.err, AllOf(IsErrorLine("error: INVALID_ARGUMENT: "), HasSubstr("two")));
}

// A key given twice in one object is refused by the parse into a
// google.protobuf.Value. A field under both its JSON names is not: protobuf's
// parser merged the two, a tensor's float_data and floatData becoming one list.
TEST(RunCliTest, AKeyGivenTwiceInOneObjectIsRejected) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"num_heads": 1, "num_heads": 2})", "Repeated map key: 'num_heads'"},
      {R"({"query": {"shape": [1, 1, 2]}, "query": {"shape": [2]}})",
       "Repeated map key: 'query'"},
      {R"({"need_weights": true, "need_\u0077eights": false})",
       "Repeated map key: 'need_weights'"},
      {R"({"query": {"shape": [1, 1, 2], "float_data": [1, 2], "floatData": [3, 4]}})",
       "ata: given twice, also as \"f"},
      {R"({"num_heads": 1, "numHeads": 1})", "eads: given twice, also as \""},
  };
  for (const auto& [json, message] : cases) {
    CliResult result = RunCliOn({"--target", "127.0.0.1:1", "call"}, json);
    EXPECT_EQ(result.code, kCliError) << json;
    EXPECT_THAT(result.err,
                AllOf(IsErrorLine("error: INVALID_ARGUMENT: standard input: not an AttendRequest "
                                  "in JSON: "),
                      HasSubstr(message)))
        << json;
  }
  // The same key in two objects, and a value that reads like a key, are fine.
  CliResult fine = RunCliOn({"--target", "127.0.0.1:1", "--timeout", "1ms", "call"},
                            R"({"query": {"shape": [1, 1, 2], "float_data": [1, 2]},
                                "key": {"shape": [1, 1, 2], "float_data": [1, 2]},
                                "model": "model", "num_heads": 1})");
  EXPECT_THAT(fine.err, Not(HasSubstr("not an AttendRequest")));
}

// protobuf's parser read "no" as false and "yes" as true for a bool, a lone
// string as a list of one, and created a session from {"create": "yes"}.
TEST(RunCliTest, JsonTypesTheParserWouldBendAreRejected) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"need_weights": "yes"})", "need_weights: a string where the field takes true or false"},
      {R"({"session": {"ids": "X", "create": true}})",
       "session.ids: a string where the field takes a list"},
      {R"({"session": {"ids": ["X"], "create": "no"}})",
       "session.create: a string where the field takes true or false"},
      {R"({"query": {"shape": [1, 1, 2], "floatData": [1, true]}})",
       "query.floatData[1]: true or false where the field takes a number"},
      {R"({"query": 3})", "query: a number where Tensor takes an object"},
      {R"([{"id": "x"}])", "the request: a list where AttendRequest takes an object"},
  };
  for (const auto& [json, message] : cases) {
    CliResult result = RunCliOn({"--target", "127.0.0.1:1", "call"}, json);
    EXPECT_EQ(result.code, kCliError) << json;
    EXPECT_THAT(result.err, IsErrorLine(absl::StrCat("error: INVALID_ARGUMENT: standard input: not "
                                                     "an AttendRequest in JSON: ",
                                                     message)))
        << json;
  }
  // What JSON may write as strings still parses: 64-bit integers, NaN, enums.
  CliResult fine = RunCliOn({"--target", "127.0.0.1:1", "--timeout", "1ms", "call"},
                            R"({"query": {"shape": ["1", 1, 2], "float_data": ["NaN", 1]},
                                "num_heads": "1", "mask": {"causal": "BOTTOM_RIGHT"},
                                "need_weights": null})");
  EXPECT_THAT(fine.err, Not(HasSubstr("not an AttendRequest")));
}

TEST(RunCliTest, EmptyInputIsRejected) {
  CliResult result = RunCliOn({"call"}, "  \n");
  EXPECT_EQ(result.code, kCliError);
  EXPECT_THAT(result.err, IsErrorLine("error: INVALID_ARGUMENT: standard input is empty; "
                                      "expected an AttendRequest in JSON"));
}

TEST(RunCliTest, MissingFileIsNotFound) {
  CliResult result = RunCliOn({"call", "/nonexistent/request.json"});
  EXPECT_EQ(result.code, kCliError);
  EXPECT_THAT(result.err, IsErrorLine("error: NOT_FOUND: cannot open /nonexistent/request.json"));
}

// Reading a directory through an ifstream threw from libstdc++ and aborted the CLI.
TEST(RunCliTest, DirectoryIsAnErrorNotACrash) {
  CliResult result = RunCliOn({"call", ::testing::TempDir()});
  EXPECT_EQ(result.code, kCliError);
  EXPECT_THAT(result.err, IsErrorLine("error: FAILED_PRECONDITION: cannot read "));
}

class RunCliServerTest : public ::testing::Test {
 protected:
  CliResult RunAgainstServer(std::vector<std::string> args, const std::string& stdin_text = "") {
    args.insert(args.begin(), {"--target", server_.address()});
    return RunCliOn(args, stdin_text);
  }

  FakeAttentionServer server_;
};

TEST_F(RunCliServerTest, CallPrintsFloatDataByDefault) {
  CliResult result = RunAgainstServer({"call"}, kSmallRequest);
  ASSERT_EQ(result.code, kCliOk) << result.err;
  EXPECT_THAT(result.err, IsEmpty());
  EXPECT_THAT(result.out,
              AllOf(HasSubstr("\"id\": \"r1\""), HasSubstr("\"float_data\""), HasSubstr("1.5"),
                    HasSubstr("-2"), HasSubstr("0.5"), HasSubstr("\"compute_us\": \"7\""),
                    Not(HasSubstr("BFLOAT16")), Not(HasSubstr("\"data\"")), EndsWith("}\n")));
}

TEST_F(RunCliServerTest, CallRawKeepsBytes) {
  CliResult result = RunAgainstServer({"--raw", "call"}, kSmallRequest);
  ASSERT_EQ(result.code, kCliOk) << result.err;
  // bf16 1.5 = 0x3fc0, -2 = 0xc000: bytes c0 3f 00 c0, base64 "wD8AwA==".
  EXPECT_THAT(result.out, AllOf(HasSubstr("\"dtype\": \"BFLOAT16\""),
                                HasSubstr("\"data\": \"wD8AwA==\""), Not(HasSubstr("float_data"))));
}

TEST_F(RunCliServerTest, CallReadsAFile) {
  const std::string path = ::testing::TempDir() + "cli_test_request.json";
  {
    std::ofstream file(path);
    file << kSmallRequest;
  }
  CliResult result = RunAgainstServer({"call", path});
  std::remove(path.c_str());
  ASSERT_EQ(result.code, kCliOk) << result.err;
  EXPECT_THAT(result.out, HasSubstr("\"id\": \"r1\""));
}

TEST_F(RunCliServerTest, ServerErrorIsOneLineWithCode) {
  CliResult result = RunAgainstServer({"call"}, R"({"id": "fail"})");
  EXPECT_EQ(result.code, kCliError);
  EXPECT_EQ(result.err,
            "error: INVALID_ARGUMENT: mask.valid_lens: shape [3] does not match batch size 2\n");
  EXPECT_THAT(result.out, IsEmpty());
}

TEST_F(RunCliServerTest, TimeoutIsDeadlineExceeded) {
  CliResult result = RunAgainstServer({"--timeout", "100ms", "call"}, R"({"id": "hang"})");
  EXPECT_EQ(result.code, kCliError);
  EXPECT_THAT(result.err, IsErrorLine("error: DEADLINE_EXCEEDED: "));
}

TEST_F(RunCliServerTest, TokenIsSentAsBearer) {
  ASSERT_EQ(RunAgainstServer({"--token", "t0k", "info"}).code, kCliOk);
  EXPECT_EQ(server_.last_authorization(), "Bearer t0k");
}

TEST_F(RunCliServerTest, TokenFileIsSentAsBearer) {
  const std::string path = ::testing::TempDir() + "/cli_token";
  std::ofstream(path) << "t0k\n";
  ASSERT_EQ(RunAgainstServer({"--token_file", path, "info"}).code, kCliOk);
  EXPECT_EQ(server_.last_authorization(), "Bearer t0k");
  CliResult both = RunAgainstServer({"--token_file", path, "--token", "t0k", "info"});
  EXPECT_EQ(both.code, kCliUsage);
  EXPECT_THAT(both.err,
              StartsWith("error: INVALID_ARGUMENT: give --token or --token_file, not both\n"));
  std::remove(path.c_str());
  CliResult missing = RunAgainstServer({"--token_file", path, "info"});
  EXPECT_EQ(missing.code, kCliUsage);
  EXPECT_THAT(missing.err, StartsWith(absl::StrCat("error: INVALID_ARGUMENT: --token_file: cannot "
                                                   "read ",
                                                   path, ": ")));
}

// A full disk or a closed pipe lost the answer, and the exit code said 0.
TEST_F(RunCliServerTest, AnAnswerThatCannotBeWrittenExitsOne) {
  std::istringstream in;
  std::ostream out(nullptr);  // every write fails
  std::ostringstream err;
  EXPECT_EQ(RunCli({"--target", server_.address(), "info"}, in, out, err), kCliError);
  EXPECT_EQ(err.str(), "error: cannot write the answer to standard output\n");
}

TEST_F(RunCliServerTest, HealthExitsZeroOnlyWhenServing) {
  CliResult serving = RunAgainstServer({"health"});
  EXPECT_EQ(serving.code, kCliOk);
  EXPECT_EQ(serving.out, "SERVING\n");

  server_.set_health(grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  CliResult draining = RunAgainstServer({"health", "--service", "attention.v1.AttentionService"});
  EXPECT_EQ(draining.code, kCliError);
  EXPECT_EQ(draining.out, "NOT_SERVING\n");
  EXPECT_THAT(draining.err, IsEmpty());
  EXPECT_EQ(server_.last_health_service(), "attention.v1.AttentionService");

  CliResult missing = RunAgainstServer({"health", "--service", "missing"});
  EXPECT_EQ(missing.code, kCliError);
  EXPECT_EQ(missing.err, "error: NOT_FOUND: unknown service\n");
}

TEST_F(RunCliServerTest, InfoModelsAndModelPrintJson) {
  CliResult info = RunAgainstServer({"info"});
  ASSERT_EQ(info.code, kCliOk) << info.err;
  EXPECT_THAT(info.out,
              AllOf(HasSubstr("\"version\": \"fake-1.0\""),
                    HasSubstr("\"engine_backend\": \"reference\""), HasSubstr("\"SCALED_DOT\"")));

  CliResult models = RunAgainstServer({"models"});
  ASSERT_EQ(models.code, kCliOk) << models.err;
  EXPECT_THAT(models.out,
              AllOf(HasSubstr("\"name\": \"demo\""), HasSubstr("\"embed_dim\": \"8\"")));

  CliResult model = RunAgainstServer({"model", "nope"});
  EXPECT_EQ(model.code, kCliError);
  EXPECT_EQ(model.err, "error: NOT_FOUND: model \"nope\" is not registered\n");
}

// A decoder from JSON: open with create, step with the position the answer
// gave, inspect, close.
TEST_F(RunCliServerTest, SessionsOpenStepInspectAndClose) {
  CliResult open = RunAgainstServer({"call"}, R"({
    "query": {"shape": [1, 2, 4], "float_data": [1, 2, 3, 4, 5, 6, 7, 8]},
    "num_heads": 2,
    "mask": {"causal": "BOTTOM_RIGHT"},
    "session": {"ids": ["d1"], "positions": [0], "create": true, "cache_dtype": "BFLOAT16"}
  })");
  ASSERT_EQ(open.code, kCliOk) << open.err;
  EXPECT_THAT(open.out, HasSubstr(R"("session_positions": [
  "2"
 ])"));

  CliResult step = RunAgainstServer({"call"}, R"({
    "query": {"shape": [1, 1, 4], "float_data": [9, 10, 11, 12]},
    "num_heads": 2,
    "session": {"ids": ["d1"], "positions": ["2"]}
  })");
  ASSERT_EQ(step.code, kCliOk) << step.err;
  EXPECT_THAT(step.out, HasSubstr("\"3\""));
  // Session calls carry their affinity: the first id, or --affinity.
  EXPECT_EQ(server_.last_affinity(), "d1");

  CliResult stale = RunAgainstServer({"call"}, R"({
    "query": {"shape": [1, 1, 4], "float_data": [9, 10, 11, 12]},
    "session": {"ids": ["d1"], "positions": [2]}
  })");
  EXPECT_EQ(stale.code, kCliError);
  EXPECT_EQ(stale.err,
            "error: ABORTED: session d1: position 2 was expected, the session holds 3\n");

  CliResult info = RunAgainstServer({"--affinity", "group-1", "session", "d1"});
  ASSERT_EQ(info.code, kCliOk) << info.err;
  EXPECT_EQ(server_.last_affinity(), "group-1");
  EXPECT_THAT(info.out,
              AllOf(HasSubstr("\"id\": \"d1\""), HasSubstr("\"position\": \"3\""),
                    HasSubstr("\"heads\": 2"), HasSubstr("\"head_dim\": 2"),
                    HasSubstr("\"cache_dtype\": \"BFLOAT16\""), HasSubstr("\"idle_ms\": \"1\"")));

  CliResult closed = RunAgainstServer({"close", "d1", "d2"});
  ASSERT_EQ(closed.code, kCliOk) << closed.err;
  EXPECT_THAT(closed.out, AllOf(HasSubstr(R"("closed": [
  "d1"
 ])"),
                                HasSubstr(R"("not_found": [
  "d2"
 ])")));
  CliResult none = RunAgainstServer({"close", "d1"});
  EXPECT_THAT(none.out, HasSubstr(R"("closed": [])"));

  CliResult gone = RunAgainstServer({"session", "d1"});
  EXPECT_EQ(gone.code, kCliError);
  EXPECT_EQ(gone.err, "error: NOT_FOUND: session \"d1\" is not open\n");
  EXPECT_THAT(gone.out, IsEmpty());
}

}  // namespace
}  // namespace attention::client
