#include "client/attention_client.h"

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/tensors.h"
#include "gmock/gmock.h"
#include "grpcpp/channel.h"
#include "gtest/gtest.h"
#include "tests/client/fake_server.h"
#include "tests/safetensors_writer.h"
#include "tests/status_matchers.h"

namespace attention::client {
namespace {

using ::attention::testing::FakeAttentionServer;
using ::attention::testing::IsOk;
using ::attention::testing::IsOkAndHolds;
using ::attention::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// How long a test with a short client timeout waits for the connection
// before its first call.
constexpr absl::Duration kConnect = absl::Seconds(30);

class AttentionClientTest : public ::testing::Test {
 protected:
  std::unique_ptr<AttentionClient> Connect(ClientOptions options = {}) {
    options.target = server_.address();
    absl::StatusOr<std::unique_ptr<AttentionClient>> client = AttentionClient::Create(options);
    EXPECT_THAT(client, IsOk());
    return client.ok() ? *std::move(client) : nullptr;
  }

  FakeAttentionServer server_;
};

TEST(AttentionClientCreateTest, RejectsEmptyTarget) {
  ClientOptions options;
  options.target = "";
  EXPECT_THAT(AttentionClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("target is empty")));
}

// gRPC aborts the process on metadata a header cannot carry.
TEST(AttentionClientCreateTest, RefusesATokenAHeaderCannotCarry) {
  ClientOptions options;
  options.bearer_token = "ab\ncd";
  EXPECT_THAT(AttentionClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("bearer_token: byte 2 of 5 is 0x0a; a token goes in a header")));
  options.bearer_token = "\xc3\xbc";
  EXPECT_THAT(
      AttentionClient::Create(options),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bearer_token: byte 0 of 2 is 0xc3")));
  options.bearer_token = "s3cret\r";
  EXPECT_THAT(AttentionClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("byte 6 of 7 is 0x0d")));
  EXPECT_THAT(CheckBearerToken("A-z0_9.~+/= !"), IsOk());
}

TEST(ReadBearerTokenFileTest, ReadsTheTokenAsTheServerDoes) {
  const std::string dir = testing::MakeTempDir("token_files");
  testing::WriteFile(dir + "/token", "  s3cret \r\n");
  EXPECT_THAT(ReadBearerTokenFile("--token_file", dir + "/token"), IsOkAndHolds("s3cret"));
  testing::WriteFile(dir + "/blank", " \n");
  EXPECT_THAT(ReadBearerTokenFile("--token_file", dir + "/blank"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat("--token_file: ", dir, "/blank holds no token"))));
  testing::WriteFile(dir + "/two_lines", "s3cret\nagain\n");
  EXPECT_THAT(
      ReadBearerTokenFile("--token_file", dir + "/two_lines"),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr(absl::StrCat("--token_file: ", dir, "/two_lines: byte 6 of 12 is 0x0a"))));
  EXPECT_THAT(ReadBearerTokenFile("--token_file", dir + "/missing"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat("--token_file: cannot read ", dir, "/missing: "))));
  EXPECT_THAT(ReadBearerTokenFile("--token_file", dir),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("it is a directory")));
}

// gRPC takes an empty CA list for the system's roots and an empty key for no
// client certificate: each would fail later, naming neither flag nor file.
TEST(AttentionClientCreateTest, RefusesTlsFilesThatAreDirectoriesOrEmpty) {
  const std::string dir = testing::MakeTempDir("tls_files");
  testing::WriteFile(dir + "/empty.pem", "");
  testing::WriteFile(dir + "/cert.pem", "-----BEGIN CERTIFICATE-----\nnot checked here\n");
  testing::WriteFile(dir + "/hostname", "attention-0\n");
  ClientOptions options;
  options.tls_ca_file = dir;
  EXPECT_THAT(AttentionClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tls_ca_file: cannot read " + dir + ": it is a directory")));
  options.tls_ca_file = dir + "/empty.pem";
  EXPECT_THAT(AttentionClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tls_ca_file: " + dir + "/empty.pem is empty")));
  options.tls_ca_file = dir + "/hostname";
  EXPECT_THAT(AttentionClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tls_ca_file: " + dir +
                                 "/hostname is not PEM (it has no -----BEGIN line)")));
  options.tls_ca_file.clear();
  options.tls_cert_file = dir + "/cert.pem";
  options.tls_key_file = dir;
  EXPECT_THAT(AttentionClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tls_key_file: cannot read " + dir + ": it is a directory")));
  options.tls_key_file = dir + "/missing.key";
  EXPECT_THAT(AttentionClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tls_key_file: cannot read " + dir +
                                 "/missing.key: No such file or directory")));
}

TEST(AttentionClientCreateTest, RejectsMessageLimitOutsideRange) {
  ClientOptions options;
  options.max_message_mb = 0;
  EXPECT_THAT(AttentionClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("max_message_mb is 0, must be in [1, 2047]")));
  options.max_message_mb = 4096;
  EXPECT_THAT(AttentionClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_message_mb is 4096")));
}

TEST(AttentionClientCreateTest, RejectsRetryAttemptsOutsideRange) {
  ClientOptions options;
  options.max_attempts = 0;
  EXPECT_THAT(AttentionClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("max_attempts is 0, must be in [1, 5]")));
  options.max_attempts = 6;
  EXPECT_THAT(AttentionClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_attempts is 6")));
}

TEST(AttentionClientCreateTest, RejectsBadReconnectBackoffs) {
  ClientOptions options;
  options.reconnect_backoff_initial = absl::ZeroDuration();
  EXPECT_THAT(AttentionClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("got initial 0, max 2s")));
  options.reconnect_backoff_initial = absl::Seconds(3);
  EXPECT_THAT(AttentionClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("initial <= max")));
  options.reconnect_backoff_initial = absl::Milliseconds(100);
  options.reconnect_backoff_min = absl::InfiniteDuration();
  EXPECT_THAT(AttentionClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("min inf")));
}

TEST_F(AttentionClientTest, WorksWithRetriesOff) {
  ClientOptions options;
  options.max_attempts = 1;
  std::unique_ptr<AttentionClient> client = Connect(options);
  ASSERT_NE(client, nullptr);
  EXPECT_THAT(client->GetServerInfo(), IsOk());
}

TEST_F(AttentionClientTest, AttendReturnsTheResponse) {
  std::unique_ptr<AttentionClient> client = Connect();
  ASSERT_NE(client, nullptr);
  v1::AttendRequest request;
  request.set_id("r1");
  *request.mutable_query() = *MakeFloatTensor({1, 1, 2}, {1.5f, -2.0f});
  request.set_output_dtype(v1::Tensor::BFLOAT16);
  absl::StatusOr<v1::AttendResponse> response = client->Attend(request);
  ASSERT_THAT(response, IsOk());
  EXPECT_EQ(response->id(), "r1");
  EXPECT_EQ(response->output().dtype(), v1::Tensor::BFLOAT16);
  EXPECT_THAT(ReadFloats(response->output()), IsOkAndHolds(ElementsAre(1.5f, -2.0f)));
}

TEST_F(AttentionClientTest, ServerErrorKeepsCodeAndMessage) {
  std::unique_ptr<AttentionClient> client = Connect();
  ASSERT_NE(client, nullptr);
  v1::AttendRequest request;
  request.set_id("fail");
  EXPECT_THAT(client->Attend(request),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "mask.valid_lens: shape [3] does not match batch size 2"));
  EXPECT_THAT(client->GetModel("nope"),
              StatusIs(absl::StatusCode::kNotFound, "model \"nope\" is not registered"));
}

TEST_F(AttentionClientTest, TimeoutBecomesDeadlineExceeded) {
  ClientOptions options;
  options.timeout = absl::Milliseconds(100);
  std::unique_ptr<AttentionClient> client = Connect(options);
  ASSERT_NE(client, nullptr);
  v1::AttendRequest request;
  request.set_id("hang");
  EXPECT_THAT(client->Attend(request), StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
}

// protobuf sent such strings anyway, and the server answered a bare status
// naming nothing ("UNIMPLEMENTED: ").
TEST_F(AttentionClientTest, TextThatIsNotUtf8IsRefusedNamingTheField) {
  std::unique_ptr<AttentionClient> client = Connect();
  ASSERT_NE(client, nullptr);
  const auto invalid = [](const std::string& text) {
    return StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(text));
  };
  EXPECT_THAT(client->GetSession("id\xff"),
              invalid("id: byte 2 of 3 is 0xff; not UTF-8 text, which the field must be"));
  EXPECT_THAT(client->CloseSessions({"ok", "\xc0\x80"}), invalid("ids[1]: byte 0 of 2 is 0xc0"));
  EXPECT_THAT(client->GetModel("\xed\xa0\x80"), invalid("name: byte 0 of 3 is 0xed"));
  v1::AttendRequest request;
  request.mutable_session()->add_ids("a");
  request.mutable_session()->add_ids("b\xf4\x90\x80\x80");
  EXPECT_THAT(client->Attend(request), invalid("session.ids[1]: byte 1 of 5 is 0xf4"));
  request.mutable_session()->clear_ids();
  request.set_model("m\xe2\x82");
  EXPECT_THAT(client->OpenStream()->Call(request), invalid("model: byte 1 of 3 is 0xe2"));
  EXPECT_EQ(server_.attend_calls(), 0);
  // Text in any script is UTF-8: it reaches the server.
  EXPECT_THAT(client->GetSession("mod\xc3\xa8le-\xe6\x97\xa5-\xf0\x9f\x98\x80"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("")));
}

TEST_F(AttentionClientTest, SendsBearerTokenOnlyWhenSet) {
  ClientOptions options;
  options.bearer_token = "s3cret";
  std::unique_ptr<AttentionClient> client = Connect(options);
  ASSERT_NE(client, nullptr);
  ASSERT_THAT(client->GetServerInfo(), IsOk());
  EXPECT_EQ(server_.last_authorization(), "Bearer s3cret");

  std::unique_ptr<AttentionClient> anonymous = Connect();
  ASSERT_NE(anonymous, nullptr);
  ASSERT_THAT(anonymous->ListModels(), IsOk());
  EXPECT_EQ(server_.last_authorization(), "");
}

TEST_F(AttentionClientTest, HealthReturnsTheStatusName) {
  std::unique_ptr<AttentionClient> client = Connect();
  ASSERT_NE(client, nullptr);
  EXPECT_THAT(client->Health(), IsOkAndHolds("SERVING"));
  server_.set_health(grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_THAT(client->Health("attention.v1.AttentionService"), IsOkAndHolds("NOT_SERVING"));
  EXPECT_EQ(server_.last_health_service(), "attention.v1.AttentionService");
  EXPECT_THAT(client->Health("missing"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("unknown service")));
}

TEST_F(AttentionClientTest, SessionCallsReturnTheServersAnswers) {
  std::unique_ptr<AttentionClient> client = Connect();
  ASSERT_NE(client, nullptr);
  v1::AttendRequest request;
  *request.mutable_query() = *MakeFloatTensor({1, 2, 2}, {1, 2, 3, 4});
  request.mutable_session()->add_ids("a");
  request.mutable_session()->add_positions(0);
  request.mutable_session()->set_create(true);
  absl::StatusOr<v1::AttendResponse> created = client->Attend(request);
  ASSERT_THAT(created, IsOk());
  EXPECT_THAT(created->session_positions(), ElementsAre(2));

  absl::StatusOr<v1::SessionInfo> info = client->GetSession("a");
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->position(), 2);
  absl::StatusOr<v1::CloseSessionsResponse> closed = client->CloseSessions({"a", "b", "a"});
  ASSERT_THAT(closed, IsOk());
  EXPECT_THAT(closed->closed(), ElementsAre("a"));
  EXPECT_THAT(closed->not_found(), ElementsAre("b"));
  // One call per distinct id, each routed by its own id (behind a proxy, the
  // ids may live on different replicas); with an affinity, one call.
  EXPECT_THAT(server_.close_affinities(), ElementsAre("a", "b"));
  ASSERT_THAT(client->CloseSessions({"c", "d"}, {.affinity = "group-1"}), IsOk());
  EXPECT_THAT(server_.close_affinities(), ElementsAre("a", "b", "group-1"));
  EXPECT_THAT(client->GetSession("a"),
              StatusIs(absl::StatusCode::kNotFound, "session \"a\" is not open"));
}

// `id`'s one-row query of two floats from `first`.
v1::AttendRequest StreamRequest(const std::string& id, float first) {
  v1::AttendRequest request;
  request.set_id(id);
  *request.mutable_query() = *MakeFloatTensor({1, 1, 2}, {first, first + 1});
  return request;
}

TEST_F(AttentionClientTest, AStreamAnswersEachCallInTurnAndGoesOnAfterAnError) {
  ClientOptions options;
  options.bearer_token = "s3cret";
  std::unique_ptr<AttentionClient> client = Connect(options);
  ASSERT_NE(client, nullptr);
  server_.set_replica("replica-a");
  std::unique_ptr<AttendStream> stream = client->OpenStream({.affinity = "group-7"});
  EXPECT_TRUE(stream->open());
  EXPECT_EQ(stream->replica(), "");

  absl::StatusOr<v1::AttendResponse> first = stream->Call(StreamRequest("r1", 1));
  ASSERT_THAT(first, IsOk());
  EXPECT_EQ(first->id(), "r1");
  EXPECT_THAT(ReadFloats(first->output()), IsOkAndHolds(ElementsAre(1, 2)));
  EXPECT_EQ(stream->replica(), "replica-a");
  EXPECT_EQ(server_.last_affinity(), "group-7");
  EXPECT_EQ(server_.last_authorization(), "Bearer s3cret");

  // An answer with an error status is that status; the stream goes on.
  EXPECT_THAT(stream->Call(StreamRequest("fail", 0)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "mask.valid_lens: shape [3] does not match batch size 2"));
  EXPECT_TRUE(stream->open());
  absl::StatusOr<v1::AttendResponse> third = stream->Call(StreamRequest("r3", 5));
  ASSERT_THAT(third, IsOk());
  EXPECT_THAT(ReadFloats(third->output()), IsOkAndHolds(ElementsAre(5, 6)));
  EXPECT_EQ(server_.attend_streams(), 1);
  EXPECT_EQ(server_.attend_calls(), 3);

  EXPECT_THAT(stream->Close(), IsOk());
  EXPECT_FALSE(stream->open());
  EXPECT_THAT(stream->Close(), IsOk());
  EXPECT_THAT(stream->Call(StreamRequest("r4", 0)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("has ended")));
  EXPECT_EQ(server_.attend_calls(), 3);
}

// The timeout bounds each message's wait, not the stream: calls further
// apart than it succeed, and one unanswered within it ends the stream.
TEST_F(AttentionClientTest, AStreamsTimeoutIsPerMessage) {
  ClientOptions options;
  options.timeout = absl::Milliseconds(300);
  std::unique_ptr<AttentionClient> client = Connect(options);
  ASSERT_NE(client, nullptr);
  // Connected first: 300ms bounds the messages, not a (sanitized) handshake.
  ASSERT_TRUE(client->channel()->WaitForConnected(absl::ToChronoTime(absl::Now() + kConnect)));
  std::unique_ptr<AttendStream> stream = client->OpenStream();
  ASSERT_THAT(stream->Call(StreamRequest("r1", 0)), IsOk());
  absl::SleepFor(absl::Milliseconds(400));
  ASSERT_THAT(stream->Call(StreamRequest("r2", 0)), IsOk());

  server_.HangCall(3);
  const absl::Time sent = absl::Now();
  EXPECT_THAT(
      stream->Call(StreamRequest("r3", 0)),
      StatusIs(absl::StatusCode::kDeadlineExceeded, "no answer on the AttendStream within 300ms"));
  EXPECT_LT(absl::Now() - sent, absl::Seconds(5));
  EXPECT_FALSE(stream->open());
  EXPECT_THAT(stream->Call(StreamRequest("r4", 0)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("DEADLINE_EXCEEDED: no answer on the AttendStream within 300ms")));
  EXPECT_EQ(server_.attend_calls(), 3);
}

TEST_F(AttentionClientTest, AStreamTheServerEndsReturnsItsStatus) {
  std::unique_ptr<AttentionClient> client = Connect();
  ASSERT_NE(client, nullptr);
  server_.EndStreamAtCall(2, grpc::StatusCode::UNAVAILABLE);
  std::unique_ptr<AttendStream> stream = client->OpenStream();
  ASSERT_THAT(stream->Call(StreamRequest("r1", 0)), IsOk());
  EXPECT_THAT(stream->Call(StreamRequest("r2", 0)),
              StatusIs(absl::StatusCode::kUnavailable, "injected end of the stream at call 2"));
  EXPECT_FALSE(stream->open());
  EXPECT_THAT(stream->Close(), IsOk());

  // Dropping a stream that is still open cancels it.
  std::unique_ptr<AttendStream> dropped = client->OpenStream();
  ASSERT_THAT(dropped->Call(StreamRequest("r3", 0)), IsOk());
  dropped.reset();
  EXPECT_EQ(server_.attend_streams(), 2);
}

// A stream its connection has no room for waits to start, within the
// timeout, and says so.
TEST(AttentionClientStreamLimitTest, AStreamThatCannotStartSaysWhy) {
  FakeAttentionServer server(absl::ZeroDuration(), /*max_concurrent_streams=*/1);
  ClientOptions options;
  options.target = server.address();
  options.timeout = absl::Milliseconds(300);
  absl::StatusOr<std::unique_ptr<AttentionClient>> client = AttentionClient::Create(options);
  ASSERT_THAT(client, IsOk());
  ASSERT_TRUE((*client)->channel()->WaitForConnected(absl::ToChronoTime(absl::Now() + kConnect)));
  std::unique_ptr<AttendStream> first = (*client)->OpenStream();
  ASSERT_THAT(first->Call(StreamRequest("r1", 0)), IsOk());
  std::unique_ptr<AttendStream> second = (*client)->OpenStream();
  EXPECT_THAT(second->Call(StreamRequest("r2", 0)),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("the AttendStream did not start within 300ms (its connection "
                                 "may have no stream to spare")));
  EXPECT_FALSE(second->open());
  // Once the first ends, a stream starts.
  EXPECT_THAT(first->Close(), IsOk());
  std::unique_ptr<AttendStream> third = (*client)->OpenStream();
  EXPECT_THAT(third->Call(StreamRequest("r3", 0)), IsOk());
}

TEST(AttentionClientUnreachableTest, UnusedPortIsUnavailable) {
  std::string target;
  {
    // A port that was just free: nothing listens there once the server is gone.
    FakeAttentionServer server;
    target = server.address();
  }
  ClientOptions options;
  options.target = target;
  options.timeout = absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<AttentionClient>> client = AttentionClient::Create(options);
  ASSERT_THAT(client, IsOk());
  EXPECT_THAT((*client)->GetServerInfo(), StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  std::unique_ptr<AttendStream> stream = (*client)->OpenStream();
  EXPECT_THAT(stream->Call(StreamRequest("r1", 0)),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  EXPECT_FALSE(stream->open());
}

}  // namespace
}  // namespace attention::client
