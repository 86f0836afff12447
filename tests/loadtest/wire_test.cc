#include "client/loadtest/wire.h"

#include <string>
#include <vector>

#include "attention/v1/attention.pb.h"
#include "client/tensors.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "gtest/gtest.h"

namespace attention::loadtest {
namespace {

grpc::ByteBuffer Serialized(const google::protobuf::Message& message) {
  grpc::Slice slice(message.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

TEST(ReadAnswerFieldsTest, ReadsTimingsAndStatusPastLargeTensors) {
  v1::AttendResponse response;
  response.set_id("12345");
  *response.mutable_output() =
      *client::MakeFloatTensor({1, 512, 512}, std::vector<float>(512 * 512, 0.25f));
  *response.mutable_weights() = *client::MakeFloatTensor({2, 2}, {1, 2, 3, 4});
  response.mutable_status()->set_code(8);
  response.mutable_status()->set_message("queue full");
  response.set_queue_us(1234567);
  response.set_compute_us(89);
  response.set_batch_size(32);
  grpc::ByteBuffer buffer = Serialized(response);

  AnswerFields fields;
  ASSERT_TRUE(ReadAnswerFields(&buffer, &fields));
  EXPECT_EQ(fields.id, "12345");
  EXPECT_EQ(fields.code, 8);
  EXPECT_EQ(fields.message, "queue full");
  EXPECT_EQ(fields.queue_us, 1234567);
  EXPECT_EQ(fields.compute_us, 89);
  EXPECT_EQ(fields.batch_size, 32);
}

TEST(ReadAnswerFieldsTest, AnEmptyAnswerHasZeros) {
  grpc::ByteBuffer buffer = Serialized(v1::AttendResponse());
  AnswerFields fields;
  ASSERT_TRUE(ReadAnswerFields(&buffer, &fields));
  EXPECT_EQ(fields.code, 0);
  EXPECT_EQ(fields.batch_size, 0);
}

TEST(ReadAnswerFieldsTest, RefusesBytesThatAreNotAMessage) {
  v1::AttendResponse response;
  response.set_queue_us(5);
  *response.mutable_output() = *client::MakeFloatTensor({4}, {1, 2, 3, 4});
  const std::string bytes = response.SerializeAsString();
  // Cut inside the output tensor.
  grpc::Slice truncated(bytes.substr(0, bytes.size() - 3));
  grpc::ByteBuffer buffer(&truncated, 1);
  AnswerFields fields;
  EXPECT_FALSE(ReadAnswerFields(&buffer, &fields));
}

TEST(MessageWithIdTest, PutsTheIdInFrontOfTheSharedBody) {
  v1::AttendRequest request;
  request.set_model("demo");
  request.set_need_weights(true);
  *request.mutable_query() = *client::MakeFloatTensor({1, 2, 2}, {1, 2, 3, 4});
  const grpc::Slice body(request.SerializeAsString());
  for (uint64_t id : {uint64_t{0}, uint64_t{7}, uint64_t{18446744073709551615u}}) {
    grpc::ByteBuffer buffer = MessageWithId(id, body);
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(buffer.Dump(&slices).ok());
    std::string bytes;
    for (const grpc::Slice& slice : slices) {
      bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    }
    v1::AttendRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(bytes));
    EXPECT_EQ(parsed.id(), std::to_string(id));
    parsed.clear_id();
    EXPECT_EQ(parsed.SerializeAsString(), request.SerializeAsString());
  }
}

}  // namespace
}  // namespace attention::loadtest
