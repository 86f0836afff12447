// The session helper and the client's session RPCs, against the fake
// server's model of sessions (tests/client/fake_server.h).

#include "client/session.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
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

  // A client of `server` (a test's own, for a fresh count of calls).
  static std::unique_ptr<AttentionClient> ClientOf(const FakeAttentionServer& server,
                                                   int max_attempts = ClientOptions().max_attempts) {
    ClientOptions options;
    options.target = server.address();
    options.max_attempts = max_attempts;
    absl::StatusOr<std::unique_ptr<AttentionClient>> client = AttentionClient::Create(options);
    EXPECT_THAT(client, IsOk());
    return client.ok() ? *std::move(client) : nullptr;
  }

  // Runs `body` on a server of its own and a keep_rows session `id` of it,
  // once per kind: unary and stream sessions, each against a server with
  // and without step ids.
  void ForEachSessionKind(const std::string& id,
                          absl::FunctionRef<void(FakeAttentionServer&, Session&)> body) {
    for (const bool stream : {false, true}) {
      for (const bool step_ids : {true, false}) {
        SCOPED_TRACE(absl::StrCat("stream ", stream, ", step ids ", step_ids));
        FakeAttentionServer server;
        server.set_report_step_ids(step_ids);
        std::unique_ptr<AttentionClient> client = ClientOf(server);
        ASSERT_NE(client, nullptr);
        std::unique_ptr<Session> s = Open(id, /*keep_rows=*/true, stream, client.get());
        ASSERT_NE(s, nullptr);
        body(server, *s);
      }
    }
  }

  // Moves session `id` on the server one row on, behind its Session's back.
  // Another writer's step of `rows` rows (step_id `step_id`).
  void StepElsewhere(const std::string& id, int64_t position, int64_t rows = 1,
                     const std::string& step_id = "") {
    v1::AttendRequest request;
    *request.mutable_query() = Rows(rows, 4, 0);
    request.mutable_session()->add_ids(id);
    request.mutable_session()->add_positions(position);
    request.mutable_session()->set_step_id(step_id);
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

// Another client's session of the same id is never taken over: its create is
// ALREADY_EXISTS every time, also when the check lands while that client's
// request holds the session (it used to fail ABORTED, as if it might be this
// step's own, and the next step went on at the server's position, appending
// to the other's session), and Close leaves it open.
TEST_F(SessionTest, AnotherClientsSessionOfTheIdIsNeverTakenOverNorClosed) {
  std::unique_ptr<Session> first = Open("taken");
  ASSERT_THAT(first->Step(Rows(2, 4, 0)), IsOk());
  std::unique_ptr<Session> second = Open("taken");
  server_.ReportHeld(1);  // the first GetSession lands while first's request holds it
  for (int i = 0; i < 3; ++i) {
    EXPECT_THAT(second->Step(Rows(1, 4, 10)),
                StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("taken")))
        << i;
  }
  ASSERT_THAT(second->Close(), IsOk());
  EXPECT_EQ(server_.open_sessions(), 1);
  ASSERT_THAT(first->Step(Rows(1, 4, 20)), IsOk());
  EXPECT_EQ(first->position(), 3);
}

// A first step that failed with its outcome unknown, while the id is
// another's: the next step is ALREADY_EXISTS (not the other's session taken
// over at its position), and Close closes nothing.
TEST_F(SessionTest, AnUnsureFirstStepOnAnotherClientsIdTakesNothingOver) {
  std::unique_ptr<Session> first = Open("theirs");
  ASSERT_THAT(first->Step(Rows(2, 4, 0)), IsOk());  // call 1
  std::unique_ptr<Session> second = Open("theirs");
  server_.FailCall(2, grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(second->Step(Rows(1, 4, 10)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
  EXPECT_THAT(second->Step(Rows(1, 4, 10)),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("theirs")));
  EXPECT_FALSE(second->open());
  EXPECT_EQ(server_.session_keys("theirs").size(), 2u * 4);  // first's rows alone

  std::unique_ptr<Session> third = Open("theirs");
  server_.FailCall(4, grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(third->Step(Rows(1, 4, 30)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
  ASSERT_THAT(third->Close(), IsOk());
  EXPECT_EQ(server_.open_sessions(), 1);
  EXPECT_EQ(server_.closed_sessions(), 0);
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
              StatusIs(absl::StatusCode::kNotFound, "session \"lost\" is not open"));
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

// Another client opens the id between this one's NOT_FOUND and its
// recreation: the recreation is ALREADY_EXISTS, and the session is the
// other's from then on. This one neither steps on it nor closes it.
TEST_F(SessionTest, ARecreationRefusedForAnotherClientsSessionLeavesItAlone) {
  ForEachSessionKind("contested", [](FakeAttentionServer& server, Session& s) {
    ASSERT_THAT(s.Step(Rows(2, 4, 0)), IsOk());
    server.DropSessions();
    // Call 2 is the step the server does not find, 3 its recreation.
    server.TakeSessionAtCall(3, "contested", 5);
    EXPECT_THAT(s.Step(Rows(1, 4, 8)),
                StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("this session is over")));
    EXPECT_FALSE(s.open());
    EXPECT_THAT(s.Step(Rows(1, 4, 8)),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("another client")));
    ASSERT_THAT(s.Close(), IsOk());
    EXPECT_EQ(server.open_sessions(), 1);
    EXPECT_EQ(server.closed_sessions(), 0);
    EXPECT_EQ(server.attend_calls(), 3);
  });
}

TEST_F(SessionTest, KeptRowsOfAnotherShapeAreRefusedBeforeSending) {
  std::unique_ptr<Session> s = Open("shape", /*keep_rows=*/true);
  ASSERT_NE(s, nullptr);
  ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
  EXPECT_THAT(s->Step(Rows(1, 6, 0)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("query: FLOAT32 [1, 1, 6] cannot follow the session's kept "
                                 "FLOAT32 key rows [1, 2, 4]")));
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

  // So is one that ends as a replica that went away ends it (SIGKILL:
  // "No status received", a reset stream).
  for (const grpc::StatusCode code :
       {grpc::StatusCode::UNKNOWN, grpc::StatusCode::CANCELLED, grpc::StatusCode::INTERNAL}) {
    const int64_t calls = server_.attend_calls();
    const int64_t position = s->position();
    server_.EndStreamAtCall(calls + 1, code);
    ASSERT_THAT(s->Step(Rows(1, 4, 12)), IsOk());
    EXPECT_EQ(s->position(), position + 1);
    EXPECT_EQ(server_.attend_calls(), calls + 2);
  }

  // Other ends are returned, unsent again; the next step opens a stream.
  const int64_t streams = server_.attend_streams();
  server_.EndStreamAtCall(server_.attend_calls() + 1, grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s->Step(Rows(1, 4, 12)), StatusIs(absl::StatusCode::kResourceExhausted,
                                                HasSubstr("injected end of the stream at call")));
  EXPECT_EQ(s->position(), 6);
  ASSERT_THAT(s->Step(Rows(1, 4, 12)), IsOk());
  EXPECT_EQ(s->position(), 7);
  EXPECT_EQ(server_.attend_streams(), streams + 1);
}

// A step is sent at most max_attempts times, as the channel retries a unary
// call; with 1, an ended stream fails it.
TEST_F(SessionTest, AStreamStepIsSentAtMostMaxAttemptsTimes) {
  for (const int max_attempts : {1, 3}) {
    SCOPED_TRACE(max_attempts);
    FakeAttentionServer server;
    std::unique_ptr<AttentionClient> client = ClientOf(server, max_attempts);
    ASSERT_NE(client, nullptr);
    std::unique_ptr<Session> s =
        Open("decoder-n", /*keep_rows=*/false, /*stream=*/true, client.get());
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

// A step whose answer is lost after the server applied it (its deadline
// passed) counts as applied once the next step has asked the server: the
// kept rows then hold it too, so a recreation sends what the server had.
TEST_F(SessionTest, AStepWhoseAnswerWasLostCountsOnceTheServerHasIt) {
  std::unique_ptr<Session> s = Open("lost-answer", /*keep_rows=*/true);
  ASSERT_NE(s, nullptr);
  ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
  server_.LoseAnswerOfCall(2, grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(s->Step(Rows(1, 4, 8)),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       "injected loss of the answer to call 2"));
  EXPECT_EQ(s->position(), 2);
  // The next step asks first, finds the lost step's row, and goes on after it.
  absl::StatusOr<v1::AttendResponse> next = s->Step(Rows(1, 4, 12));
  ASSERT_THAT(next, IsOk());
  EXPECT_THAT(next->session_positions(), ElementsAre(4));
  EXPECT_EQ(s->position(), 4);
  EXPECT_EQ(s->kept_bytes(), 2 * 4 * 4 * 4);
  EXPECT_EQ(server_.session_keys("lost-answer"),
            Concat({Rows(2, 4, 0), Rows(1, 4, 8), Rows(1, 4, 12)}));

  server_.DropSessions();
  ASSERT_THAT(s->Step(Rows(1, 4, 16)), IsOk());
  EXPECT_EQ(s->recreations(), 1);
  EXPECT_EQ(server_.session_keys("lost-answer"),
            Concat({Rows(2, 4, 0), Rows(1, 4, 8), Rows(1, 4, 12), Rows(1, 4, 16)}));
}

// A lost answer over a failed connection: the channel sends the step again,
// which the server refuses (ABORTED: it already has the row). The next step
// asks, and goes on. Before, every later step was ABORTED for good.
TEST_F(SessionTest, AStepSentAgainAfterItWasAppliedIsSettledByTheNextStep) {
  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream);
    FakeAttentionServer server;
    std::unique_ptr<AttentionClient> client = ClientOf(server);
    ASSERT_NE(client, nullptr);
    std::unique_ptr<Session> s = Open("resent", /*keep_rows=*/false, stream, client.get());
    ASSERT_NE(s, nullptr);
    ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
    server.LoseAnswerOfCall(2, grpc::StatusCode::UNAVAILABLE);
    EXPECT_THAT(s->Step(Rows(1, 4, 8)),
                StatusIs(absl::StatusCode::kAborted,
                         "session resent: position 2 was expected, the session holds 3"));
    ASSERT_THAT(s->Step(Rows(1, 4, 12)), IsOk());
    EXPECT_EQ(s->position(), 4);
    EXPECT_EQ(server.session_keys("resent"),
              Concat({Rows(2, 4, 0), Rows(1, 4, 8), Rows(1, 4, 12)}));
  }
}

// A create sent again after its first attempt was applied, its answer lost
// over a failed connection: the server refuses the resend ALREADY_EXISTS,
// but the session is this step's own, so the step is ABORTED (an outcome
// unknown) and its retry gets the lost answer; Close then closes it. The
// first step's create, and a recreation's; with and without step ids on the
// server. Before, a first step was ALREADY_EXISTS for good and Close left
// the session open, and a recreation's next steps FAILED_PRECONDITION.
TEST_F(SessionTest, ACreateSentAgainAfterItWasAppliedIsSettledByItsRetry) {
  ForEachSessionKind("created", [](FakeAttentionServer& server, Session& s) {
    server.LoseAnswerOfCall(1, grpc::StatusCode::UNAVAILABLE);
    EXPECT_THAT(s.Step(Rows(2, 4, 0)),
                StatusIs(absl::StatusCode::kAborted,
                         HasSubstr("an earlier attempt of the step, whose answer was lost, "
                                   "created it; send the step again")));
    absl::StatusOr<v1::AttendResponse> again = s.Step(Rows(2, 4, 0));
    ASSERT_THAT(again, IsOk());
    EXPECT_THAT(again->session_positions(), ElementsAre(2));
    EXPECT_EQ(s.position(), 2);
    EXPECT_EQ(server.session_keys("created"), Concat({Rows(2, 4, 0)}));

    // The session lost; the step's recreation applied, its answer lost.
    server.DropSessions();
    server.LoseAnswerOfCall(server.attend_calls() + 2, grpc::StatusCode::UNAVAILABLE);
    EXPECT_THAT(s.Step(Rows(1, 4, 8)),
                StatusIs(absl::StatusCode::kAborted, HasSubstr("it holds this step's 3 rows")));
    again = s.Step(Rows(1, 4, 8));
    ASSERT_THAT(again, IsOk());
    EXPECT_THAT(Floats(again->output()), ElementsAreArray(Floats(Rows(1, 4, 8))));
    EXPECT_EQ(s.position(), 3);
    EXPECT_EQ(s.kept_bytes(), 2 * 3 * 4 * 4);
    ASSERT_THAT(s.Step(Rows(1, 4, 12)), IsOk());
    EXPECT_EQ(server.session_keys("created"),
              Concat({Rows(2, 4, 0), Rows(1, 4, 8), Rows(1, 4, 12)}));
    ASSERT_THAT(s.Close(), IsOk());
    EXPECT_EQ(server.open_sessions(), 0);
  });
}

// The read-only retry of a step found applied, when the session is lost
// before it: the kept rows recreate it, and when that recreation is applied
// but its answer lost and the create sent again (ALREADY_EXISTS), the retry
// is ABORTED and the next one gets the answer. Before, it failed
// ALREADY_EXISTS, which says the id is another's.
TEST_F(SessionTest, ARetrysRecreationSentAgainAfterItWasAppliedIsSettledByTheNextRetry) {
  ForEachSessionKind("re-resent", [](FakeAttentionServer& server, Session& s) {
    ASSERT_THAT(s.Step(Rows(2, 4, 0)), IsOk());
    server.LoseAnswerOfCall(2, grpc::StatusCode::DEADLINE_EXCEEDED);
    EXPECT_THAT(s.Step(Rows(1, 4, 8)), StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
    // GetSession finds the step applied; the session is lost before its
    // read-only retry (call 3); the recreation (call 4) is applied, its
    // answer lost, and the create sent again.
    server.DropSessionsAtCall(3);
    server.LoseAnswerOfCall(4, grpc::StatusCode::UNAVAILABLE);
    EXPECT_THAT(s.Step(Rows(1, 4, 8)),
                StatusIs(absl::StatusCode::kAborted, HasSubstr("it holds this step's 3 rows")));
    absl::StatusOr<v1::AttendResponse> again = s.Step(Rows(1, 4, 8));
    ASSERT_THAT(again, IsOk());
    EXPECT_THAT(Floats(again->output()), ElementsAreArray(Floats(Rows(1, 4, 8))));
    EXPECT_THAT(again->session_positions(), ElementsAre(3));
    EXPECT_EQ(s.position(), 3);
    ASSERT_THAT(s.Step(Rows(1, 4, 12)), IsOk());
    EXPECT_EQ(server.session_keys("re-resent"),
              Concat({Rows(2, 4, 0), Rows(1, 4, 8), Rows(1, 4, 12)}));
    ASSERT_THAT(s.Close(), IsOk());
    EXPECT_EQ(server.open_sessions(), 0);
  });
}

// The natural retry of a step whose answer was lost: the same rows again.
// Once the server turns out to have applied them, the retry is sent
// read-only, so the rows are appended once and the answer is the lost one.
TEST_F(SessionTest, RetryingAStepWhoseAnswerWasLostAppendsItOnce) {
  for (const bool keep_rows : {false, true}) {
    SCOPED_TRACE(keep_rows);
    FakeAttentionServer server;
    std::unique_ptr<AttentionClient> client = ClientOf(server);
    ASSERT_NE(client, nullptr);
    std::unique_ptr<Session> s = Open("retry", keep_rows, /*stream=*/false, client.get());
    ASSERT_NE(s, nullptr);
    ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
    server.LoseAnswerOfCall(2, grpc::StatusCode::DEADLINE_EXCEEDED);
    EXPECT_THAT(s->Step(Rows(1, 4, 8)), StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
    absl::StatusOr<v1::AttendResponse> again = s->Step(Rows(1, 4, 8));
    ASSERT_THAT(again, IsOk());
    EXPECT_THAT(Floats(again->output()), ElementsAreArray(Floats(Rows(1, 4, 8))));
    EXPECT_THAT(again->session_positions(), ElementsAre(3));
    EXPECT_EQ(s->position(), 3);
    EXPECT_EQ(server.session_keys("retry"), Concat({Rows(2, 4, 0), Rows(1, 4, 8)}));
    // And the next step is a step again.
    ASSERT_THAT(s->Step(Rows(1, 4, 8)), IsOk());
    EXPECT_EQ(s->position(), 4);
    EXPECT_EQ(server.session_keys("retry"),
              Concat({Rows(2, 4, 0), Rows(1, 4, 8), Rows(1, 4, 8)}));
    EXPECT_EQ(s->kept_bytes(), keep_rows ? 2 * 4 * 4 * 4 : 0);
  }
}

// A retry that fails (its read-only call) is still a retry when sent again.
TEST_F(SessionTest, ARetryOfAFailedRetryAppendsNothingEither) {
  std::unique_ptr<Session> s = Open("retry-twice", /*keep_rows=*/true);
  ASSERT_NE(s, nullptr);
  ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
  server_.LoseAnswerOfCall(2, grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(s->Step(Rows(1, 4, 8)), StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
  server_.FailCall(3, grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(s->Step(Rows(1, 4, 8)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, "injected failure of call 3"));
  ASSERT_THAT(s->Step(Rows(1, 4, 8)), IsOk());
  EXPECT_EQ(s->position(), 3);
  EXPECT_EQ(s->kept_bytes(), 2 * 3 * 4 * 4);
  EXPECT_EQ(server_.session_keys("retry-twice"), Concat({Rows(2, 4, 0), Rows(1, 4, 8)}));
}

// The session lost between the lost answer and its retry: the retry
// recreates it from the kept rows, which already hold the step's row, so
// the row is there once and the answer is still the lost one. Without kept
// rows the retry stays NOT_FOUND, and appends nothing.
TEST_F(SessionTest, ARetryOfASessionLostSinceRecreatesItWithTheStepOnce) {
  for (const bool keep_rows : {false, true}) {
    SCOPED_TRACE(keep_rows);
    FakeAttentionServer server;
    std::unique_ptr<AttentionClient> client = ClientOf(server);
    ASSERT_NE(client, nullptr);
    std::unique_ptr<Session> s = Open("retry-lost", keep_rows, /*stream=*/false, client.get());
    ASSERT_NE(s, nullptr);
    ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
    server.LoseAnswerOfCall(2, grpc::StatusCode::DEADLINE_EXCEEDED);
    EXPECT_THAT(s->Step(Rows(1, 4, 8)), StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
    // GetSession finds the row; the read-only retry (call 3) finds nothing.
    server.DropSessionsAtCall(3);
    absl::StatusOr<v1::AttendResponse> again = s->Step(Rows(1, 4, 8));
    if (!keep_rows) {
      EXPECT_THAT(again, StatusIs(absl::StatusCode::kNotFound, HasSubstr("session \"retry-lost\"")));
      EXPECT_EQ(server.open_sessions(), 0);
      continue;
    }
    ASSERT_THAT(again, IsOk());
    EXPECT_THAT(Floats(again->output()), ElementsAreArray(Floats(Rows(1, 4, 8))));
    EXPECT_THAT(again->session_positions(), ElementsAre(3));
    EXPECT_EQ(s->position(), 3);
    EXPECT_EQ(s->recreations(), 1);
    EXPECT_EQ(server.session_keys("retry-lost"), Concat({Rows(2, 4, 0), Rows(1, 4, 8)}));
    // The next step is a step again.
    ASSERT_THAT(s->Step(Rows(1, 4, 12)), IsOk());
    EXPECT_EQ(s->position(), 4);
    EXPECT_EQ(server.session_keys("retry-lost"),
              Concat({Rows(2, 4, 0), Rows(1, 4, 8), Rows(1, 4, 12)}));
  }
}

// A replica that left and came back still has an old copy of a session that
// lived elsewhere meanwhile, fewer rows than the client's: with kept rows it
// is closed and the session recreated from them; without, refused.
TEST_F(SessionTest, AStaleCopyIsReplacedFromTheKeptRows) {
  for (const bool keep_rows : {false, true}) {
    SCOPED_TRACE(keep_rows);
    const std::string id = keep_rows ? "stale-kept" : "stale";
    std::unique_ptr<Session> s = Open(id, keep_rows);
    ASSERT_NE(s, nullptr);
    ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
    ASSERT_THAT(s->Step(Rows(2, 4, 8)), IsOk());
    // The server's copy goes back to the first two rows.
    ASSERT_THAT(client_->CloseSessions({id}), IsOk());
    v1::AttendRequest old;
    *old.mutable_query() = Rows(2, 4, 0);
    old.mutable_session()->add_ids(id);
    old.mutable_session()->add_positions(0);
    old.mutable_session()->set_create(true);
    ASSERT_THAT(client_->Attend(old), IsOk());

    EXPECT_THAT(s->Step(Rows(1, 4, 16)),
                StatusIs(absl::StatusCode::kAborted,
                         absl::StrCat("session ", id, ": position 4 was expected, the session holds 2")));
    if (!keep_rows) {
      EXPECT_THAT(s->Step(Rows(1, 4, 16)),
                  StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("a stale copy")));
      continue;
    }
    ASSERT_THAT(s->Step(Rows(1, 4, 16)), IsOk());
    EXPECT_EQ(s->position(), 5);
    EXPECT_EQ(s->recreations(), 1);
    EXPECT_EQ(server_.session_keys(id), Concat({Rows(2, 4, 0), Rows(2, 4, 8), Rows(1, 4, 16)}));
  }
}

// The retry of a step found applied, ABORTED because the session is no
// longer where the step left it (here the replica's copy is stale, one row
// where three were): the next step asks the server again. With kept rows
// the copy is closed and the retry recreates the session, the step's row
// once; without, FAILED_PRECONDITION. Before, the retry was ABORTED for good.
TEST_F(SessionTest, AnAbortedRetryIsSettledByTheNextStep) {
  for (const bool keep_rows : {true, false}) {
    SCOPED_TRACE(keep_rows);
    FakeAttentionServer server;
    std::unique_ptr<AttentionClient> client = ClientOf(server);
    ASSERT_NE(client, nullptr);
    std::unique_ptr<Session> s = Open("aborted-retry", keep_rows, /*stream=*/false, client.get());
    ASSERT_NE(s, nullptr);
    ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
    server.LoseAnswerOfCall(2, grpc::StatusCode::DEADLINE_EXCEEDED);
    EXPECT_THAT(s->Step(Rows(1, 4, 8)),
                StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
    // GetSession finds the row; the read-only retry (call 3) a stale copy.
    server.RewindSessionsAtCall(3, 1);
    EXPECT_THAT(s->Step(Rows(1, 4, 8)),
                StatusIs(absl::StatusCode::kAborted,
                         "session aborted-retry: position 3 was expected, the session holds 1"));
    absl::StatusOr<v1::AttendResponse> again = s->Step(Rows(1, 4, 8));
    if (!keep_rows) {
      EXPECT_THAT(again, StatusIs(absl::StatusCode::kFailedPrecondition,
                                  HasSubstr("the server holds 1 rows, fewer than the 3")));
      continue;
    }
    ASSERT_THAT(again, IsOk());
    EXPECT_THAT(Floats(again->output()), ElementsAreArray(Floats(Rows(1, 4, 8))));
    EXPECT_THAT(again->session_positions(), ElementsAre(3));
    EXPECT_EQ(s->recreations(), 1);
    EXPECT_EQ(server.session_keys("aborted-retry"), Concat({Rows(2, 4, 0), Rows(1, 4, 8)}));
    ASSERT_THAT(s->Step(Rows(1, 4, 12)), IsOk());
    EXPECT_EQ(s->position(), 4);
  }
}

// A step that failed without being applied: the next step asks, finds the
// position unchanged, and is sent at it.
TEST_F(SessionTest, AStepThatFailedUnappliedIsSettledByTheNextStep) {
  std::unique_ptr<Session> s = Open("unapplied", /*keep_rows=*/true);
  ASSERT_NE(s, nullptr);
  ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
  server_.FailCall(2, grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(s->Step(Rows(1, 4, 8)), StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
  ASSERT_THAT(s->Step(Rows(1, 4, 8)), IsOk());
  EXPECT_EQ(s->position(), 3);
  EXPECT_EQ(s->kept_bytes(), 2 * 3 * 4 * 4);
  EXPECT_EQ(server_.session_keys("unapplied"), Concat({Rows(2, 4, 0), Rows(1, 4, 8)}));
}

// With kept rows, a count that no unsure step explains is another writer's:
// refused, rather than kept rows that no longer match the server's.
TEST_F(SessionTest, KeptRowsRefuseAPositionNoUnsureStepExplains) {
  std::unique_ptr<Session> s = Open("two-writers", /*keep_rows=*/true);
  ASSERT_NE(s, nullptr);
  ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
  server_.LoseAnswerOfCall(2, grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(s->Step(Rows(1, 4, 8)), StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
  StepElsewhere("two-writers", 3);
  EXPECT_THAT(s->Step(Rows(1, 4, 12)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("the server holds 4 rows, this client 2 and 1 step(s) whose "
                                 "outcome is unknown, none of which makes 4")));
  EXPECT_EQ(s->position(), 2);
}

// Another writer that appended exactly as many rows as the step whose
// outcome is unknown (which the server never applied): by the count it
// would be taken for that step; the server's last step_id says it is not,
// whether the other writer named its step or not. With kept rows refused;
// without, the session goes on at the server's position. A server that
// does not report step ids leaves only the count.
TEST_F(SessionTest, AnotherWritersStepOfTheSameCountIsNotTakenForTheLostOne) {
  for (const std::string other : {"other-writer", ""}) {
    for (const bool keep_rows : {true, false}) {
      SCOPED_TRACE(absl::StrCat(keep_rows, " ", other));
      const std::string id = absl::StrCat(keep_rows ? "same-count-kept" : "same-count", other);
      std::unique_ptr<Session> s = Open(id, keep_rows);
      ASSERT_NE(s, nullptr);
      ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
      server_.FailCall(server_.attend_calls() + 1, grpc::StatusCode::DEADLINE_EXCEEDED);
      EXPECT_THAT(s->Step(Rows(1, 4, 8)),
                  StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
      StepElsewhere(id, 2, 1, other);
      absl::StatusOr<v1::AttendResponse> next = s->Step(Rows(1, 4, 8));
      if (keep_rows) {
        EXPECT_THAT(next, StatusIs(absl::StatusCode::kFailedPrecondition,
                                   HasSubstr(absl::StrCat("none of which makes 3 as its last "
                                                          "step (step_id \"", other, "\") did"))));
        EXPECT_EQ(s->position(), 2);
        continue;
      }
      // Taken as a new step at the server's position 3, not as a retry.
      ASSERT_THAT(next, IsOk());
      EXPECT_THAT(next->session_positions(), ElementsAre(4));
      EXPECT_EQ(s->position(), 4);
    }
  }
  // The same without step ids: the count alone takes the other writer's
  // row for the lost step, and the retry appends nothing.
  server_.set_report_step_ids(false);
  std::unique_ptr<Session> s = Open("same-count-old", /*keep_rows=*/true);
  ASSERT_NE(s, nullptr);
  ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
  server_.FailCall(server_.attend_calls() + 1, grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(s->Step(Rows(1, 4, 8)), StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
  StepElsewhere("same-count-old", 2, 1, "other-writer");
  ASSERT_THAT(s->Step(Rows(1, 4, 8)), IsOk());
  EXPECT_EQ(s->position(), 3);
  EXPECT_EQ(server_.session_keys("same-count-old"), Concat({Rows(2, 4, 0), Rows(1, 4, 0)}));
}

// A first step whose answer was lost may have created the session: Close
// closes it all the same, and a later step goes on from what the server has.
TEST_F(SessionTest, AFirstStepWhoseAnswerWasLostIsClosedAndContinued) {
  std::unique_ptr<Session> s = Open("maybe");
  ASSERT_NE(s, nullptr);
  server_.LoseAnswerOfCall(1, grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(s->Step(Rows(3, 4, 0)), StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
  EXPECT_FALSE(s->open());
  EXPECT_EQ(server_.open_sessions(), 1);
  ASSERT_THAT(s->Close(), IsOk());
  EXPECT_EQ(server_.open_sessions(), 0);

  std::unique_ptr<Session> t = Open("maybe-2");
  ASSERT_NE(t, nullptr);
  server_.LoseAnswerOfCall(2, grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(t->Step(Rows(3, 4, 0)), StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
  ASSERT_THAT(t->Step(Rows(1, 4, 12)), IsOk());
  EXPECT_TRUE(t->open());
  EXPECT_EQ(t->position(), 4);
}

// Only a NOT_FOUND that names the session is recreated: another (a model the
// server does not have, say) is returned as it is, with no kept rows resent.
TEST_F(SessionTest, OnlyTheSessionsOwnNotFoundIsRecreated) {
  std::unique_ptr<Session> s = Open("modelled", /*keep_rows=*/true);
  ASSERT_NE(s, nullptr);
  ASSERT_THAT(s->Step(Rows(2, 4, 0)), IsOk());
  server_.FailCall(2, grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s->Step(Rows(1, 4, 8)),
              StatusIs(absl::StatusCode::kNotFound, "injected failure of call 2"));
  EXPECT_EQ(s->recreations(), 0);
  EXPECT_EQ(server_.attend_calls(), 2);
  ASSERT_THAT(s->Step(Rows(1, 4, 8)), IsOk());
  EXPECT_EQ(s->position(), 3);
}

// An id of any bytes travels: gRPC carries only printable ASCII in a header,
// so the affinity goes %-encoded (it aborted the process before).
TEST_F(SessionTest, AnyIdIsAnAffinityGrpcCanCarry) {
  std::unique_ptr<Session> s = Open("caf\xc3\xa9 %\n1");
  ASSERT_NE(s, nullptr);
  ASSERT_THAT(s->Step(Rows(1, 4, 0)), IsOk());
  EXPECT_EQ(server_.last_affinity(), "caf%C3%A9%20%25%0A1");
  ASSERT_THAT(client_->GetSession("caf\xc3\xa9 %\n1"), IsOk());
  EXPECT_EQ(server_.last_affinity(), "caf%C3%A9%20%25%0A1");
  ASSERT_THAT(s->Close(), IsOk());
  EXPECT_EQ(server_.open_sessions(), 0);
}

}  // namespace
}  // namespace attention::client
