// AttendStream: many requests on one stream, answered by id, bad ones with
// their own status while the stream goes on.

#include <map>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "attention/v1/service.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "tests/server/test_server.h"
#include "tests/status_matchers.h"

namespace attention::testing {
namespace {

using ::testing::HasSubstr;

using Stream = grpc::ClientReaderWriter<v1::AttendRequest, v1::AttendResponse>;

v1::AttendRequest Good(const std::string& id) {
  v1::AttendRequest r;
  r.set_id(id);
  *r.mutable_query() = Ramp({1, 6, 8});
  r.set_num_heads(2);
  return r;
}

v1::AttendRequest Bad(const std::string& id) {
  v1::AttendRequest r = Good(id);
  r.set_num_heads(3);  // does not divide 8
  return r;
}

class StreamTest : public ServerSuite<> {
 protected:
  std::unique_ptr<v1::AttentionService::Stub> stub_ =
      v1::AttentionService::NewStub(client().channel());
};

TEST_F(StreamTest, AnswersEveryRequestByIdAndGoesOnAfterBadOnes) {
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = stub_->AttendStream(&context);
  std::map<std::string, bool> sent;  // id -> good
  for (int i = 0; i < 10; ++i) {
    const std::string id = absl::StrCat("r", i);
    const bool good = i % 3 != 1;
    ASSERT_TRUE(stream->Write(good ? Good(id) : Bad(id)));
    sent[id] = good;
  }
  stream->WritesDone();
  const absl::StatusOr<v1::AttendResponse> unary = client().Attend(Good("unary"));
  ASSERT_THAT(unary, IsOk());
  v1::AttendResponse response;
  std::map<std::string, v1::AttendResponse> answers;
  while (stream->Read(&response)) answers[response.id()] = response;
  EXPECT_TRUE(stream->Finish().ok());
  ASSERT_EQ(answers.size(), sent.size());
  for (const auto& [id, good] : sent) {
    SCOPED_TRACE(id);
    const v1::AttendResponse& a = answers[id];
    if (good) {
      EXPECT_EQ(a.status().code(), 0);
      EXPECT_EQ(a.output().data(), unary->output().data());
    } else {
      EXPECT_EQ(a.status().code(), grpc::StatusCode::INVALID_ARGUMENT);
      EXPECT_THAT(a.status().message(), HasSubstr("num_heads: 3"));
      EXPECT_FALSE(a.has_output());
    }
  }
}

// More requests than a stream may have unanswered: the server pauses reading
// and resumes as answers are written.
TEST_F(StreamTest, AnswersMoreRequestsThanItsInFlightWindow) {
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = stub_->AttendStream(&context);
  constexpr int kRequests = 200;
  for (int i = 0; i < kRequests; ++i) ASSERT_TRUE(stream->Write(Good(absl::StrCat(i))));
  stream->WritesDone();
  int answered = 0;
  v1::AttendResponse response;
  while (stream->Read(&response)) {
    EXPECT_EQ(response.status().code(), 0) << response.status().message();
    ++answered;
  }
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(answered, kRequests);
}

TEST_F(StreamTest, ACallerThatCancelsLeavesTheServerHealthy) {
  {
    grpc::ClientContext context;
    std::unique_ptr<Stream> stream = stub_->AttendStream(&context);
    for (int i = 0; i < 50; ++i) stream->Write(Good(absl::StrCat(i)));
    context.TryCancel();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  EXPECT_THAT(client().Attend(Good("after")), IsOk());
  EXPECT_THAT(client().Health(), IsOkAndHolds("SERVING"));
}

TEST_F(StreamTest, AnEmptyStreamFinishesOk) {
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = stub_->AttendStream(&context);
  stream->WritesDone();
  v1::AttendResponse response;
  EXPECT_FALSE(stream->Read(&response));
  EXPECT_TRUE(stream->Finish().ok());
}

}  // namespace
}  // namespace attention::testing
