// The session helper and the client's session RPCs, against the fake
// server's model of sessions (tests/client/fake_server.h).

#include "client/session.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/attention_client.h"
#include "client/tensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/fake_server.h"
#include "tests/status_matchers.h"

namespace attention::client {
namespace {

using ::attention::testing::FakeAttentionServer;
using ::attention::testing::IsOk;
using ::attention::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

// `rows` rows of `dim` elements, [1, rows, dim], counting up from `first`.
v1::Tensor Rows(int64_t rows, int64_t dim, float first) {
  std::vector<float> values(rows * dim);
  for (size_t i = 0; i < values.size(); ++i) values[i] = first + static_cast<float>(i);
  return *MakeFloatTensor({1, rows, dim}, values);
}

std::vector<float> Floats(const v1::Tensor& tensor) { return *ReadFloats(tensor); }

// Concatenation of the elements of `parts`.
std::vector<float> Concat(const std::vector<v1::Tensor>& parts) {
  std::vector<float> all;
  for (const v1::Tensor& part : parts) {
    const std::vector<float> values = Floats(part);
    all.insert(all.end(), values.begin(), values.end());
  }
  return all;
}

class SessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ClientOptions options;
    options.target = server_.address();
    absl::StatusOr<std::unique_ptr<AttentionClient>> client = AttentionClient::Create(options);
    ASSERT_THAT(client, IsOk());
    client_ = *std::move(client);
  }

  std::unique_ptr<Session> Open(const std::string& id, bool keep_rows = false, bool stream = false,
                                AttentionClient* client = nullptr) {
    SessionOptions options;
    options.id = id;
    options.request.set_num_heads(2);
    options.request.mutable_mask()->set_causal(v1::Mask::BOTTOM_RIGHT);
    options.keep_rows = keep_rows;
    options.stream = stream;
    absl::StatusOr<std::unique_ptr<Session>> session =
        Session::Create(client != nullptr ? client : client_.get(), options);
    EXPECT_THAT(session, IsOk());
    return session.ok() ? *std::move(session) : nullptr;
  }

  // Moves session `id` on the server one row on, behind its Session's back.
  void StepElsewhere(const std::string& id, int64_t position) {
    v1::AttendRequest request;
    *request.mutable_query() = Rows(1, 4, 0);
    request.mutable_session()->add_ids(id);
    request.mutable_session()->add_positions(position);
    ASSERT_THAT(client_->Attend(request), IsOk());
  }

  FakeAttentionServer server_;
  std::unique_ptr<AttentionClient> client_;
};

TEST_F(SessionTest, CreateRejectsBadOptions) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  SessionOptions options;
  options.id = "s";
  EXPECT_THAT(Session::Create(nullptr, options), StatusIs(kInvalid, HasSubstr("client is null")));
  options.id = "";
  EXPECT_THAT(Session::Create(client_.get(), options),
              StatusIs(kInvalid, HasSubstr("has 0 bytes; want 1 to 128")));
  options.id = std::string(129, 'x');
  EXPECT_THAT(Session::Create(client_.get(), options), StatusIs(kInvalid, HasSubstr("has 129")));
  options.id = "s";
  *options.request.mutable_query() = Rows(1, 4, 0);
  EXPECT_THAT(Session::Create(client_.get(), options),
              StatusIs(kInvalid, HasSubstr("must leave query, key, value and session unset")));
  options.request.clear_query();
  options.cache_dtype = v1::Tensor::FLOAT16;
  EXPECT_THAT(Session::Create(client_.get(), options),
              StatusIs(kInvalid, HasSubstr("cache_dtype FLOAT16 is not FLOAT32 or BFLOAT16")));
  EXPECT_EQ(server_.attend_calls(), 0);
}

TEST_F(SessionTest, FirstStepCreatesAndPositionsFollowTheAnswers) {
  SessionOptions options;
  options.id = "decoder-1";
  options.request.set_num_heads(2);
  options.cache_dtype = v1::Tensor::BFLOAT16;
  absl::StatusOr<std::unique_ptr<Session>> session = Session::Create(client_.get(), options);
  ASSERT_THAT(session, IsOk());
  Session& s = **session;
  EXPECT_FALSE(s.open());
  EXPECT_EQ(s.position(), 0);

  absl::StatusOr<v1::AttendResponse> prefill =
      s.Step(Rows(3, 4, 0), Rows(3, 4, 100), Rows(3, 4, 200));
  ASSERT_THAT(prefill, IsOk());
  EXPECT_THAT(prefill->session_positions(), ElementsAre(3));
  EXPECT_THAT(Floats(prefill->output()), ElementsAreArray(Floats(Rows(3, 4, 0))));
  EXPECT_TRUE(s.open());
  EXPECT_EQ(s.position(), 3);

  ASSERT_THAT(s.Step(Rows(1, 4, 10), Rows(1, 4, 110), Rows(1, 4, 210)), IsOk());
  EXPECT_EQ(s.position(), 4);
  EXPECT_EQ(server_.session_keys("decoder-1"), Concat({Rows(3, 4, 100), Rows(1, 4, 110)}));

  absl::StatusOr<v1::SessionInfo> info = client_->GetSession("decoder-1");
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->position(), 4);
  EXPECT_EQ(info->heads(), 2);
  EXPECT_EQ(info->head_dim(), 2);
  EXPECT_EQ(info->cache_dtype(), v1::Tensor::BFLOAT16);
  EXPECT_EQ(s.recreations(), 0);
  EXPECT_EQ(s.kept_bytes(), 0);
}

// Every call of a session carries "attention-affinity" for a proxy to hash
// on: the id, or the group the caller chose; stateless calls carry none.
TEST_F(SessionTest, SessionCallsCarryTheirAffinity) {
  std::unique_ptr<Session> s = Open("decoder-9", /*keep_rows=*/true);
  ASSERT_NE(s, nullptr);
  ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
  EXPECT_EQ(server_.last_affinity(), "decoder-9");
  server_.DropSessions();
  ASSERT_THAT(s->Step(Rows(1, 4, 1)), IsOk());  // the recreation, too
  EXPECT_EQ(s->recreations(), 1);
  EXPECT_EQ(server_.last_affinity(), "decoder-9");
  ASSERT_THAT(s->Close(), IsOk());
  EXPECT_EQ(server_.last_affinity(), "decoder-9");

  SessionOptions grouped;
  grouped.id = "decoder-10";
  grouped.affinity = "user-42";
  grouped.request.set_num_heads(2);
  absl::StatusOr<std::unique_ptr<Session>> g = Session::Create(client_.get(), grouped);
  ASSERT_THAT(g, IsOk());
  ASSERT_THAT((*g)->Step(Rows(2, 4, 0)), IsOk());
  EXPECT_EQ(server_.last_affinity(), "user-42");

  // The client itself: a session request's first id unless the call names
  // a group; GetSession's id; nothing without sessions.
  v1::AttendRequest request;
  *request.mutable_query() = Rows(1, 4, 0);
  ASSERT_THAT(client_->Attend(request), IsOk());
  EXPECT_EQ(server_.last_affinity(), "");
  request.mutable_session()->add_ids("decoder-10");
  request.mutable_session()->add_positions(2);
  ASSERT_THAT(client_->Attend(request), IsOk());
  EXPECT_EQ(server_.last_affinity(), "decoder-10");
  CallOptions call;
  call.affinity = "user-42";
  request.mutable_session()->set_positions(0, 3);
  ASSERT_THAT(client_->Attend(request, call), IsOk());
  EXPECT_EQ(server_.last_affinity(), "user-42");
  ASSERT_THAT(client_->GetSession("decoder-10"), IsOk());
  EXPECT_EQ(server_.last_affinity(), "decoder-10");
}

TEST_F(SessionTest, WithoutKeyTheQueryRowsAreAppended) {
  std::unique_ptr<Session> s = Open("self");
  ASSERT_NE(s, nullptr);
  ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
  ASSERT_THAT(s->Step(Rows(1, 4, 8)), IsOk());
  EXPECT_EQ(s->position(), 3);
  EXPECT_EQ(server_.session_keys("self"), Concat({Rows(2, 4, 0), Rows(1, 4, 8)}));
}

TEST_F(SessionTest, ServerErrorsKeepCodeAndMessageAndChangeNothing) {
  SessionOptions options;
  options.id = "s";
  options.request.set_id("fail");
  absl::StatusOr<std::unique_ptr<Session>> session = Session::Create(client_.get(), options);
  ASSERT_THAT(session, IsOk());
  EXPECT_THAT((*session)->Step(Rows(2, 4, 0)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "mask.valid_lens: shape [3] does not match batch size 2"));
  EXPECT_FALSE((*session)->open());
  EXPECT_EQ((*session)->position(), 0);
  EXPECT_EQ(server_.open_sessions(), 0);
}

TEST_F(SessionTest, CreatingAnOpenIdIsAlreadyExists) {
  std::unique_ptr<Session> first = Open("twin");
  std::unique_ptr<Session> second = Open("twin");
  ASSERT_NE(second, nullptr);
  ASSERT_THAT(first->Step(Rows(1, 4, 0)), IsOk());
  EXPECT_THAT(second->Step(Rows(1, 4, 0)),
              StatusIs(absl::StatusCode::kAlreadyExists, "session twin already exists"));
  EXPECT_FALSE(second->open());
}

TEST_F(SessionTest, APositionMismatchIsAbortedAndKeepsThePosition) {
  std::unique_ptr<Session> s = Open("shared", /*keep_rows=*/true);
  ASSERT_NE(s, nullptr);
  ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
  StepElsewhere("shared", 2);
  EXPECT_THAT(s->Step(Rows(1, 4, 0)),
              StatusIs(absl::StatusCode::kAborted,
                       "session shared: position 2 was expected, the session holds 3"));
  EXPECT_EQ(s->position(), 2);
  EXPECT_EQ(s->recreations(), 0);
}

TEST_F(SessionTest, CloseClosesOnceAndLaterStepsFail) {
  std::unique_ptr<Session> s = Open("done");
  ASSERT_NE(s, nullptr);
  ASSERT_THAT(s->Step(Rows(1, 4, 0)), IsOk());
  EXPECT_THAT(s->Close(), IsOk());
  EXPECT_FALSE(s->open());
  EXPECT_EQ(server_.open_sessions(), 0);
  EXPECT_EQ(server_.closed_sessions(), 1);
  EXPECT_THAT(s->Close(), IsOk());
  EXPECT_THAT(s->Step(Rows(1, 4, 0)),
              StatusIs(absl::StatusCode::kFailedPrecondition, "session done is closed"));
  EXPECT_EQ(server_.closed_sessions(), 1);
}

TEST_F(SessionTest, ClosingASessionNoStepCreatedSendsNothing) {
  std::unique_ptr<Session> s = Open("never");
  ASSERT_NE(s, nullptr);
  EXPECT_THAT(s->Close(), IsOk());
  EXPECT_EQ(server_.closed_sessions(), 0);
}

TEST_F(SessionTest, ClosingASessionTheServerLostIsOk) {
  std::unique_ptr<Session> s = Open("lost");
  ASSERT_NE(s, nullptr);
  ASSERT_THAT(s->Step(Rows(1, 4, 0)), IsOk());
  server_.DropSessions();
  EXPECT_THAT(s->Close(), IsOk());
}

TEST_F(SessionTest, WithoutKeptRowsALostSessionIsNotFound) {
  std::unique_ptr<Session> s = Open("lost");
  ASSERT_NE(s, nullptr);
  ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
  server_.DropSessions();
  EXPECT_THAT(s->Step(Rows(1, 4, 0)),
              StatusIs(absl::StatusCode::kNotFound, "session lost is not open"));
  EXPECT_EQ(s->position(), 2);
  EXPECT_EQ(s->recreations(), 0);
  EXPECT_EQ(server_.attend_calls(), 2);
}

TEST_F(SessionTest, KeptRowsRecreateALostSessionInOneRequest) {
  std::unique_ptr<Session> s = Open("decoder", /*keep_rows=*/true);
  ASSERT_NE(s, nullptr);
  ASSERT_THAT(s->Step(Rows(2, 4, 0), Rows(2, 4, 100), Rows(2, 4, 200)), IsOk());
  ASSERT_THAT(s->Step(Rows(1, 4, 8), Rows(1, 4, 108), Rows(1, 4, 208)), IsOk());
  // Keys and values, 3 rows of 4 floats each.
  EXPECT_EQ(s->kept_bytes(), 2 * 3 * 4 * 4);

  server_.DropSessions();
  absl::StatusOr<v1::AttendResponse> answer =
      s->Step(Rows(1, 4, 12), Rows(1, 4, 112), Rows(1, 4, 212));
  ASSERT_THAT(answer, IsOk());
  // The answer is the step's: its query, and every row in the session.
  EXPECT_THAT(Floats(answer->output()), ElementsAreArray(Floats(Rows(1, 4, 12))));
  EXPECT_THAT(answer->session_positions(), ElementsAre(4));
  EXPECT_EQ(s->position(), 4);
  EXPECT_EQ(s->recreations(), 1);
  EXPECT_EQ(server_.session_keys("decoder"),
            Concat({Rows(2, 4, 100), Rows(1, 4, 108), Rows(1, 4, 112)}));
  // Prefill, step, the step the server did not find, its recreation.
  EXPECT_EQ(server_.attend_calls(), 4);

  ASSERT_THAT(s->Step(Rows(1, 4, 16), Rows(1, 4, 116), Rows(1, 4, 216)), IsOk());
  EXPECT_EQ(s->position(), 5);
  EXPECT_EQ(s->recreations(), 1);
  EXPECT_EQ(s->kept_bytes(), 2 * 5 * 4 * 4);
}

// Rank 4 [1, H, S, D]: the rows of each head are kept apart, so the
// recreated keys are each head's rows in order, not the steps' tensors one
// after another.
TEST_F(SessionTest, RecreationConcatenatesEachHeadsRows) {
  SessionOptions options;
  options.id = "gqa";
  options.keep_rows = true;
  absl::StatusOr<std::unique_ptr<Session>> session = Session::Create(client_.get(), options);
  ASSERT_THAT(session, IsOk());
  Session& s = **session;
  auto heads = [](int64_t rows, float first) {
    std::vector<float> values(2 * rows * 2);
    for (size_t i = 0; i < values.size(); ++i) values[i] = first + static_cast<float>(i);
    return *MakeFloatTensor({1, 2, rows, 2}, values);
  };
  const v1::Tensor query = *MakeFloatTensor({1, 4, 1, 2}, std::vector<float>(8, 0.5f));
  // Keys: head 0 rows {0,1},{2,3}; head 1 rows {4,5},{6,7}; then {10,11} / {12,13}.
  ASSERT_THAT(s.Step(*MakeFloatTensor({1, 4, 2, 2}, std::vector<float>(16, 0.5f)), heads(2, 0),
                     heads(2, 50)),
              IsOk());
  server_.DropSessions();
  ASSERT_THAT(s.Step(query, heads(1, 10), heads(1, 60)), IsOk());
  EXPECT_EQ(s.recreations(), 1);
  EXPECT_EQ(s.position(), 3);
  EXPECT_THAT(server_.session_keys("gqa"), ElementsAre(0, 1, 2, 3, 10, 11, 4, 5, 6, 7, 12, 13));
  absl::StatusOr<v1::SessionInfo> info = client_->GetSession("gqa");
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->heads(), 4);
  EXPECT_EQ(info->kv_heads(), 2);
}

TEST_F(SessionTest, AFailedRecreationIsReturnedAndRetriedOnTheNextStep) {
  std::unique_ptr<Session> s = Open("retried", /*keep_rows=*/true);
  ASSERT_NE(s, nullptr);
  ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
  server_.DropSessions();
  // Call 2 is the step the server does not find, 3 its recreation.
  server_.FailCall(3, grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s->Step(Rows(1, 4, 8)),
              StatusIs(absl::StatusCode::kResourceExhausted, "injected failure of call 3"));
  EXPECT_EQ(s->recreations(), 0);
  EXPECT_EQ(s->position(), 2);

  ASSERT_THAT(s->Step(Rows(1, 4, 8)), IsOk());
  EXPECT_EQ(s->recreations(), 1);
  EXPECT_EQ(s->position(), 3);
  EXPECT_EQ(server_.session_keys("retried"), Concat({Rows(2, 4, 0), Rows(1, 4, 8)}));
}

TEST_F(SessionTest, KeptRowsOfAnotherShapeAreRefusedBeforeSending) {
  std::unique_ptr<Session> s = Open("shape", /*keep_rows=*/true);
  ASSERT_NE(s, nullptr);
  ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
  EXPECT_THAT(s->Step(Rows(1, 6, 0)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("key: FLOAT32 [1, 1, 6] cannot follow the session's kept "
                                 "FLOAT32 rows [1, 2, 4]")));
  EXPECT_EQ(server_.attend_calls(), 1);
}

// With stream, the steps are messages of one AttendStream carrying the
// session's affinity, and Close ends it before closing the session.
TEST_F(SessionTest, AStreamSessionStepsOnOneStream) {
  server_.set_replica("replica-b");
  std::unique_ptr<Session> s = Open("decoder-s", /*keep_rows=*/false, /*stream=*/true);
  ASSERT_NE(s, nullptr);
  ASSERT_THAT(s->Step(Rows(2, 4, 0), Rows(2, 4, 100), Rows(2, 4, 200)), IsOk());
  EXPECT_EQ(s->replica(), "replica-b");
  EXPECT_EQ(server_.last_affinity(), "decoder-s");
  ASSERT_THAT(s->Step(Rows(1, 4, 8), Rows(1, 4, 108), Rows(1, 4, 208)), IsOk());
  EXPECT_THAT(s->Step(Rows(1, 4, 12), Rows(1, 4, 112), Rows(1, 4, 212)), IsOk());
  EXPECT_EQ(s->position(), 4);
  EXPECT_EQ(server_.session_keys("decoder-s"),
            Concat({Rows(2, 4, 100), Rows(1, 4, 108), Rows(1, 4, 112)}));
  EXPECT_EQ(server_.attend_streams(), 1);
  EXPECT_EQ(server_.attend_calls(), 3);

  // A server error answers the step and keeps the stream.
  StepElsewhere("decoder-s", 4);
  EXPECT_THAT(s->Step(Rows(1, 4, 16)), StatusIs(absl::StatusCode::kAborted, ::testing::_));
  EXPECT_EQ(s->position(), 4);
  EXPECT_EQ(server_.attend_streams(), 1);

  ASSERT_THAT(s->Close(), IsOk());
  EXPECT_EQ(server_.open_sessions(), 0);
  EXPECT_EQ(server_.closed_sessions(), 1);
}

// A stream that ends UNAVAILABLE instead of answering (a draining server)
// had not taken the step: it is sent again, once, on a new stream.
TEST_F(SessionTest, AStreamEndedUnavailableIsReopenedAndTheStepSentAgain) {
  std::unique_ptr<Session> s = Open("decoder-r", /*keep_rows=*/false, /*stream=*/true);
  ASSERT_NE(s, nullptr);
  ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
  server_.EndStreamAtCall(2, grpc::StatusCode::UNAVAILABLE);
  absl::StatusOr<v1::AttendResponse> answer = s->Step(Rows(1, 4, 8));
  ASSERT_THAT(answer, IsOk());
  EXPECT_THAT(answer->session_positions(), ElementsAre(3));
  EXPECT_EQ(server_.session_keys("decoder-r"), Concat({Rows(2, 4, 0), Rows(1, 4, 8)}));
  EXPECT_EQ(server_.attend_streams(), 2);
  EXPECT_EQ(server_.attend_calls(), 3);

  // Other ends are returned, unsent again; the next step opens a stream.
  server_.EndStreamAtCall(4, grpc::StatusCode::INTERNAL);
  EXPECT_THAT(s->Step(Rows(1, 4, 12)),
              StatusIs(absl::StatusCode::kInternal, "injected end of the stream at call 4"));
  EXPECT_EQ(s->position(), 3);
  ASSERT_THAT(s->Step(Rows(1, 4, 12)), IsOk());
  EXPECT_EQ(s->position(), 4);
  EXPECT_EQ(server_.attend_streams(), 3);
}

// A step is sent at most max_attempts times, as the channel retries a unary
// call; with 1, an ended stream fails it.
TEST_F(SessionTest, AStreamStepIsSentAtMostMaxAttemptsTimes) {
  for (const int max_attempts : {1, 3}) {
    SCOPED_TRACE(max_attempts);
    FakeAttentionServer server;
    ClientOptions options;
    options.target = server.address();
    options.max_attempts = max_attempts;
    absl::StatusOr<std::unique_ptr<AttentionClient>> client = AttentionClient::Create(options);
    ASSERT_THAT(client, IsOk());
    std::unique_ptr<Session> s =
        Open("decoder-n", /*keep_rows=*/false, /*stream=*/true, client->get());
    ASSERT_NE(s, nullptr);
    ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
    server.EndStreamAtCall(2, grpc::StatusCode::UNAVAILABLE, /*count=*/max_attempts);
    EXPECT_THAT(s->Step(Rows(1, 4, 8)),
                StatusIs(absl::StatusCode::kUnavailable,
                         absl::StrCat("injected end of the stream at call ", 1 + max_attempts)));
    EXPECT_EQ(s->position(), 2);
    EXPECT_EQ(server.attend_calls(), 1 + max_attempts);
    ASSERT_THAT(s->Step(Rows(1, 4, 8)), IsOk());
    EXPECT_EQ(s->position(), 3);
    // The prefill's stream, which the first attempt ended, a stream for
    // each later attempt, and the next step's.
    EXPECT_EQ(server.attend_streams(), 1 + max_attempts);
  }
}

TEST_F(SessionTest, KeptRowsRecreateALostSessionOnTheStream) {
  std::unique_ptr<Session> s = Open("decoder-k", /*keep_rows=*/true, /*stream=*/true);
  ASSERT_NE(s, nullptr);
  ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
  server_.DropSessions();
  ASSERT_THAT(s->Step(Rows(1, 4, 8)), IsOk());
  EXPECT_EQ(s->recreations(), 1);
  EXPECT_EQ(s->position(), 3);
  EXPECT_EQ(server_.session_keys("decoder-k"), Concat({Rows(2, 4, 0), Rows(1, 4, 8)}));
  // Prefill, the step the server did not find, its recreation: one stream.
  EXPECT_EQ(server_.attend_calls(), 3);
  EXPECT_EQ(server_.attend_streams(), 1);
}

}  // namespace
}  // namespace attention::client
