#include "server/response_encoder.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/half.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/support/slice.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace attention::server {
namespace {

using ::attention::testing::IsOk;
using ::attention::testing::StatusIs;
using ::testing::HasSubstr;

Tensor MakeTensor(std::vector<int64_t> shape, float first) {
  Tensor t;
  t.shape = std::move(shape);
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  t.data.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t.data[i] = first + 0.37f * static_cast<float>(i);
  return t;
}

// What protobuf itself makes of `t` as `dtype`.
v1::Tensor WireTensor(const Tensor& t, v1::Tensor::DType dtype) {
  v1::Tensor wire;
  wire.set_dtype(dtype);
  wire.mutable_shape()->Assign(t.shape.begin(), t.shape.end());
  std::string* bytes = wire.mutable_data();
  if (dtype == v1::Tensor::FLOAT32) {
    bytes->assign(reinterpret_cast<const char*>(t.data.data()), t.data.size() * sizeof(float));
    return wire;
  }
  for (float f : t.data) {
    const uint16_t bits = dtype == v1::Tensor::BFLOAT16 ? FloatToBFloat16(f) : FloatToFloat16(f);
    bytes->append(reinterpret_cast<const char*>(&bits), sizeof bits);
  }
  return wire;
}

v1::AttendResponse Head() {
  v1::AttendResponse head;
  head.set_id("call-7");
  head.set_queue_us(12);
  head.set_compute_us(345);
  head.set_batch_size(3);
  return head;
}

v1::AttendResponse Parse(const grpc::ByteBuffer& buffer) {
  v1::AttendResponse parsed;
  EXPECT_THAT(ParseMessage(buffer, &parsed), IsOk());
  return parsed;
}

class EncodeResponseTest : public ::testing::TestWithParam<v1::Tensor::DType> {};

TEST_P(EncodeResponseTest, ParsesAsTheSameMessageProtobufWouldMake) {
  const v1::Tensor::DType dtype = GetParam();
  for (bool need_weights : {false, true}) {
    AttentionResult result{MakeTensor({2, 3, 8}, -1.5f), MakeTensor({2, 3, 5}, 0.25f)};
    v1::AttendResponse expected = Head();
    *expected.mutable_output() = WireTensor(result.output, dtype);
    if (need_weights) *expected.mutable_weights() = WireTensor(result.weights, dtype);

    absl::StatusOr<grpc::ByteBuffer> encoded_or =
        EncodeResponse(Head(), std::move(result), need_weights, dtype);
    ASSERT_THAT(encoded_or, IsOk());
    grpc::ByteBuffer& encoded = *encoded_or;
    const v1::AttendResponse parsed = Parse(encoded);
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(parsed, expected))
        << "need_weights " << need_weights << "\nparsed:\n"
        << parsed.ShortDebugString().substr(0, 400) << "\nexpected:\n"
        << expected.ShortDebugString().substr(0, 400);
    EXPECT_EQ(encoded.Length(), expected.ByteSizeLong());
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, EncodeResponseTest,
                         ::testing::Values(v1::Tensor::FLOAT32, v1::Tensor::BFLOAT16,
                                           v1::Tensor::FLOAT16),
                         [](const auto& info) { return v1::Tensor::DType_Name(info.param); });

TEST(EncodeResponse, CarriesTheStatusOfAStreamAnswer) {
  v1::AttendResponse head = Head();
  head.mutable_status()->set_code(0);
  AttentionResult result{MakeTensor({1, 1, 4}, 1.0f), {}};
  absl::StatusOr<grpc::ByteBuffer> encoded_or =
      EncodeResponse(head, std::move(result), false, v1::Tensor::FLOAT32);
  ASSERT_THAT(encoded_or, IsOk());
  grpc::ByteBuffer& encoded = *encoded_or;
  const v1::AttendResponse parsed = Parse(encoded);
  EXPECT_TRUE(parsed.has_status());
  EXPECT_EQ(parsed.status().code(), 0);
  EXPECT_EQ(parsed.output().shape_size(), 3);
}

TEST(EncodeResponse, HandsTheEngineBuffersToGrpcWithoutCopying) {
  AttentionResult result{MakeTensor({4, 16, 64}, 0.5f), MakeTensor({4, 16, 16}, 0.0f)};
  const void* output = result.output.data.data();
  const void* weights = result.weights.data.data();
  const size_t output_bytes = result.output.data.size() * sizeof(float);
  const size_t weights_bytes = result.weights.data.size() * sizeof(float);
  absl::StatusOr<grpc::ByteBuffer> encoded_or =
      EncodeResponse(Head(), std::move(result), true, v1::Tensor::FLOAT32);
  ASSERT_THAT(encoded_or, IsOk());
  grpc::ByteBuffer& encoded = *encoded_or;
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(encoded.Dump(&slices).ok());
  bool found_output = false, found_weights = false;
  for (const grpc::Slice& slice : slices) {
    found_output |= slice.begin() == output && slice.size() == output_bytes;
    found_weights |= slice.begin() == weights && slice.size() == weights_bytes;
  }
  EXPECT_TRUE(found_output) << "no slice is the engine's output buffer";
  EXPECT_TRUE(found_weights) << "no slice is the engine's weights buffer";
}

TEST(EncodeResponse, RefusesANonFloatOutputDtype) {
  AttentionResult result{MakeTensor({1, 1, 4}, 1.0f), {}};
  EXPECT_THAT(EncodeResponse(Head(), std::move(result), false, v1::Tensor::INT32).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("output_dtype")));
}

TEST(ParseMessage, RefusesBytesThatAreNotTheMessage) {
  const std::string garbage = "\xff\xff\xff\xff\x0f not a message";
  grpc::Slice slice(garbage);
  v1::AttendRequest request;
  EXPECT_THAT(ParseMessage(grpc::ByteBuffer(&slice, 1), &request),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("AttendRequest")));
}

TEST(ParseMessage, ReadsAMessageSplitOverSlices) {
  v1::AttendRequest request;
  request.set_id("split");
  request.mutable_query()->mutable_data()->assign(1000, 'x');
  const std::string bytes = request.SerializeAsString();
  grpc::Slice slices[] = {grpc::Slice(bytes.substr(0, 7)), grpc::Slice(bytes.substr(7, 500)),
                          grpc::Slice(bytes.substr(507))};
  v1::AttendRequest parsed;
  ASSERT_THAT(ParseMessage(grpc::ByteBuffer(slices, 3), &parsed), IsOk());
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(parsed, request));
}

// A request cut into slices of `size` bytes (and an empty slice after each).
grpc::ByteBuffer Sliced(const std::string& bytes, size_t size) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += size) {
    slices.emplace_back(bytes.substr(at, size));
    slices.emplace_back();
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

TEST(ParseAndReleaseMessage, ReadsWhatParseMessageReadsAndEmptiesTheBuffer) {
  v1::AttendRequest request;
  request.set_id("released");
  request.mutable_query()->mutable_data()->assign(100000, 'q');
  request.mutable_key()->mutable_data()->assign(3000, 'k');
  request.set_need_weights(true);
  const std::string bytes = request.SerializeAsString();
  // Slices of 1 byte make every field cross slice boundaries; 4096, the usual case.
  for (size_t size : {size_t{1}, size_t{7}, size_t{4096}, bytes.size()}) {
    grpc::ByteBuffer buffer = Sliced(bytes, size);
    v1::AttendRequest parsed;
    ASSERT_THAT(ParseAndReleaseMessage(&buffer, &parsed), IsOk()) << size;
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(parsed, request)) << size;
    EXPECT_EQ(buffer.Length(), 0u) << size;
  }
}

// Trims cost more than they give back to requests under 64 MiB (24 MiB
// calls ran four times slower with a trim every 16 MiB): only larger ones
// trim as they are freed.
TEST(ParseAndReleaseMessage, TrimsTheHeapOnlyForRequestsOf64MiBOrMore) {
  for (const auto& [mib, trims] : {std::pair{48, 0}, std::pair{80, 5}}) {
    v1::AttendRequest request;
    request.mutable_query()->mutable_data()->assign(size_t(mib) << 20, 'q');
    grpc::ByteBuffer buffer = Sliced(request.SerializeAsString(), 1 << 20);
    request.Clear();
    const int64_t before = ParseTrims();
    v1::AttendRequest parsed;
    ASSERT_THAT(ParseAndReleaseMessage(&buffer, &parsed), IsOk());
    EXPECT_EQ(ParseTrims() - before, trims) << mib << " MiB";
  }
}

TEST(ParseAndReleaseMessage, RefusesBytesThatAreNotTheMessage) {
  grpc::ByteBuffer buffer = Sliced("\xff\xff\xff\xff\x0f not a message", 3);
  v1::AttendRequest request;
  EXPECT_THAT(ParseAndReleaseMessage(&buffer, &request),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("AttendRequest")));
  grpc::ByteBuffer truncated =
      Sliced(v1::AttendRequest().SerializeAsString() + std::string("\x0a\x05" "ab", 4), 2);
  EXPECT_THAT(ParseAndReleaseMessage(&truncated, &request),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("AttendRequest")));
}

}  // namespace
}  // namespace attention::server
