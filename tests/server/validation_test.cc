// Every class of bad request, sent through the real server: the code and the
// wire field the message names.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/tensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"
#include "tests/server/test_server.h"

namespace attention::testing {
namespace {

using ::testing::HasSubstr;
using Change = std::function<void(v1::AttendRequest&)>;

// The status of ValidRequest() after `change`, sent through `client`.
absl::Status AttendWith(client::AttentionClient& client, const Change& change) {
  v1::AttendRequest r = ValidRequest();
  change(r);
  return client.Attend(r).status();
}

class ValidationTest : public ServerSuite<> {
 protected:
  static absl::Status Attend(const Change& change) { return AttendWith(client(), change); }
};

TEST_F(ValidationTest, AcceptsTheValidRequest) {
  EXPECT_THAT(Attend([](v1::AttendRequest&) {}), IsOk());
}

TEST_F(ValidationTest, RejectsQueryOfWrongRank) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                *r.mutable_query() = Ramp({2, 12});
              }),
              StatusIs(kInvalid, HasSubstr("query:")));
}

TEST_F(ValidationTest, RejectsKeyOfWrongRank) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                *r.mutable_key() = Ramp({2, 1, 5, 4});
              }),
              StatusIs(kInvalid, HasSubstr("key:")));
}

TEST_F(ValidationTest, RejectsMismatchedBatch) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                *r.mutable_query() = Ramp({3, 3, 4});
              }),
              StatusIs(kInvalid, HasSubstr("key: batch size 2 does not match query's batch size "
                                           "3 (a batch dim of 1 broadcasts)")));
}

TEST_F(ValidationTest, RejectsValueSequenceLengthOtherThanKeys) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                *r.mutable_value() = Ramp({2, 4, 6});
              }),
              StatusIs(kInvalid, HasSubstr("value:")));
}

TEST_F(ValidationTest, RejectsKeyDimOtherThanQueryDimForScaledDot) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                *r.mutable_key() = Ramp({2, 5, 3});
              }),
              StatusIs(kInvalid, HasSubstr("key:")));
}

TEST_F(ValidationTest, RejectsByteCountOtherThanShapeTimesDType) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) { r.mutable_query()->mutable_data()->resize(44); }),
              StatusIs(kInvalid, HasSubstr("query:")));
}

TEST_F(ValidationTest, RejectsNegativeValidLens) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                *r.mutable_mask()->mutable_valid_lens() = *client::MakeInt64Tensor({2}, {3, -1});
              }),
              StatusIs(kInvalid, HasSubstr("mask.valid_lens:")));
}

TEST_F(ValidationTest, RejectsValidLensOfWrongShape) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                *r.mutable_mask()->mutable_valid_lens() = *client::MakeInt64Tensor({3}, {1, 2, 3});
              }),
              StatusIs(kInvalid, HasSubstr("mask.valid_lens:")));
}

TEST_F(ValidationTest, RejectsAttnMaskThatDoesNotBroadcast) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                *r.mutable_mask()->mutable_attn_mask() = Ramp({3, 4});
              }),
              StatusIs(kInvalid, HasSubstr("mask.attn_mask:")));
}

TEST_F(ValidationTest, RejectsKeyPaddingMaskThatDoesNotBroadcast) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                *r.mutable_mask()->mutable_key_padding_mask() =
                    *client::MakeBoolTensor({2, 4}, std::vector<bool>(8, false));
              }),
              StatusIs(kInvalid, HasSubstr("mask.key_padding_mask:")));
}

TEST_F(ValidationTest, RejectsHeadsThatDoNotDivideTheEmbedding) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) { r.set_num_heads(3); }),
              StatusIs(kInvalid, HasSubstr("num_heads:")));
}

TEST_F(ValidationTest, RejectsGroupedQueryHeadsThatDoNotDivide) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                *r.mutable_query() = Ramp({2, 4, 3, 2});
                *r.mutable_key() = Ramp({2, 3, 5, 2});
                *r.mutable_value() = Ramp({2, 3, 5, 2});
              }),
              StatusIs(kInvalid, HasSubstr("key:")));
}

TEST_F(ValidationTest, RejectsUnknownDType) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                r.mutable_query()->set_dtype(static_cast<v1::Tensor::DType>(17));
              }),
              StatusIs(kInvalid, HasSubstr("query.dtype: unknown value 17")));
}

TEST_F(ValidationTest, RejectsUnknownScoreKind) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                r.mutable_score()->set_kind(static_cast<v1::Score::Kind>(17));
              }),
              StatusIs(kInvalid, HasSubstr("score.kind: unknown value 17")));
}

TEST_F(ValidationTest, RejectsUnknownCausal) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                r.mutable_mask()->set_causal(static_cast<v1::Mask::Causal>(3));
              }),
              StatusIs(kInvalid, HasSubstr("mask.causal: unknown value 3")));
}

TEST_F(ValidationTest, RejectsUnknownLayout) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                r.set_layout(static_cast<v1::AttendRequest::Layout>(-1));
              }),
              StatusIs(kInvalid, HasSubstr("layout: unknown value -1")));
}

TEST_F(ValidationTest, RejectsUnknownPrecision) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                r.set_precision(static_cast<v1::AttendRequest::Precision>(5));
              }),
              StatusIs(kInvalid, HasSubstr("precision: unknown value 5")));
}

TEST_F(ValidationTest, RejectsUnknownOutputDType) {
  EXPECT_THAT(
      Attend([](v1::AttendRequest& r) { r.set_output_dtype(static_cast<v1::Tensor::DType>(6)); }),
      StatusIs(kInvalid, HasSubstr("output_dtype: unknown value 6")));
}

TEST_F(ValidationTest, RejectsNonFloatOutputDType) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) { r.set_output_dtype(v1::Tensor::INT64); }),
              StatusIs(kInvalid, HasSubstr("output_dtype:")));
}

// [2^40]^3 wraps to 0 in 64 bits: unchecked shape arithmetic would take the
// 16 bytes for a valid tensor or size a buffer from garbage.
TEST_F(ValidationTest, RejectsShapeWhoseElementCountOverflows) {
  constexpr int64_t kHuge = int64_t{1} << 40;
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                *r.mutable_query() =
                    RawTensor(v1::Tensor::FLOAT32, {kHuge, kHuge, kHuge}, std::string(16, '\0'));
              }),
              StatusIs(kInvalid, HasSubstr("query:")));
}

// Regression: the engine's message for this quotes all 100000 dims; sent
// whole, the client got RESOURCE_EXHAUSTED "received initial metadata size
// exceeds limit" instead of the error naming the field.
TEST_F(ValidationTest, RejectsHugeRankWithAMessageThatFitsInATrailer) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                *r.mutable_query() = RawTensor(v1::Tensor::FLOAT32, std::vector<int64_t>(100000, 1),
                                               std::string(4, '\0'));
              }),
              StatusIs(kInvalid, HasSubstr("query:")));
}

TEST_F(ValidationTest, RejectsUnknownModelAsNotFound) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) { r.set_model("demo"); }),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("model: \"demo\" is not registered")));
}

TEST_F(ValidationTest, AcceptsFastPrecision) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) { r.set_precision(v1::AttendRequest::FAST); }),
              IsOk());
}

TEST_F(ValidationTest, RejectsDataAndFloatDataBothSet) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) { r.mutable_query()->add_float_data(1.0f); }),
              StatusIs(kInvalid, HasSubstr("query: set only one of data, float_data")));
}

TEST_F(ValidationTest, RejectsFloatDataWithNonFloatDType) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                v1::Tensor* lens = r.mutable_mask()->mutable_valid_lens();
                lens->set_dtype(v1::Tensor::INT64);
                lens->add_shape(2);
                lens->add_float_data(1.0f);
                lens->add_float_data(2.0f);
              }),
              StatusIs(kInvalid, HasSubstr("mask.valid_lens: float_data needs dtype FLOAT32")));
}

TEST_F(ValidationTest, RejectsIntDataWithFloatDType) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                v1::Tensor* mask = r.mutable_mask()->mutable_attn_mask();
                mask->add_shape(3);
                mask->add_shape(5);
                for (int i = 0; i < 15; ++i) mask->add_int_data(0);
              }),
              StatusIs(kInvalid, HasSubstr("mask.attn_mask: int_data needs dtype")));
}

TEST_F(ValidationTest, RejectsIntDataOutsideInt32) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                v1::Tensor* lens = r.mutable_mask()->mutable_valid_lens();
                lens->set_dtype(v1::Tensor::INT32);
                lens->add_shape(2);
                lens->add_int_data(1);
                lens->add_int_data(int64_t{1} << 32);
              }),
              StatusIs(kInvalid, HasSubstr("mask.valid_lens.int_data[1]")));
}

TEST_F(ValidationTest, RejectsBoolIntDataOtherThanZeroOrOne) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                v1::Tensor* mask = r.mutable_mask()->mutable_key_padding_mask();
                mask->set_dtype(v1::Tensor::BOOL);
                mask->add_shape(2);
                mask->add_shape(5);
                for (int i = 0; i < 10; ++i) mask->add_int_data(i == 7 ? 2 : 0);
              }),
              StatusIs(kInvalid, HasSubstr("mask.key_padding_mask.int_data[7]")));
}

TEST_F(ValidationTest, RejectsBoolMaskDataOtherThanZeroOrOne) {
  EXPECT_THAT(Attend([](v1::AttendRequest& r) {
                *r.mutable_mask()->mutable_attn_mask() = RawTensor(
                    v1::Tensor::BOOL, {3, 5}, std::string("\0\1\0\0\0\0\2\0\0\0\0\0\0\0\0", 15));
              }),
              StatusIs(kInvalid, HasSubstr("mask.attn_mask:")));
}

TEST(ValidationLimitsTest, RejectsTensorOverTheElementLimit) {
  ServerOptions options;
  options.engine.max_tensor_elements = 16;
  absl::StatusOr<std::unique_ptr<TestServer>> server = TestServer::Start(options);
  ASSERT_THAT(server, IsOk());
  EXPECT_THAT(AttendWith((*server)->client(), [](v1::AttendRequest&) {}),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("query:")));
}

TEST(ValidationLimitsTest, RejectsWeightsOverTheScoreLimit) {
  ServerOptions options;
  options.engine.max_score_elements = 16;
  absl::StatusOr<std::unique_ptr<TestServer>> server = TestServer::Start(options);
  ASSERT_THAT(server, IsOk());
  EXPECT_THAT(
      AttendWith((*server)->client(), [](v1::AttendRequest& r) { r.set_need_weights(true); }),
      StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("need_weights: B*H*L*S")));
  EXPECT_THAT(AttendWith((*server)->client(), [](v1::AttendRequest&) {}), IsOk());
}

}  // namespace
}  // namespace attention::testing
