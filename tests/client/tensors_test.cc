#include "client/tensors.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace attention::client {
namespace {

using ::attention::testing::IsOk;
using ::attention::testing::IsOkAndHolds;
using ::attention::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint32_t ToBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// Little-endian bytes of 16-bit words, as on the wire.
std::string Bytes16(const std::vector<uint16_t>& words) {
  std::string bytes;
  for (uint16_t w : words) {
    bytes.push_back(static_cast<char>(w & 0xff));
    bytes.push_back(static_cast<char>(w >> 8));
  }
  return bytes;
}

std::string Bytes32(const std::vector<uint32_t>& words) {
  std::string bytes;
  for (uint32_t w : words) {
    for (int i = 0; i < 4; ++i) bytes.push_back(static_cast<char>((w >> (8 * i)) & 0xff));
  }
  return bytes;
}

// The 16-bit words of a one-dimensional tensor made from `values`.
std::vector<uint16_t> Encode16(const std::vector<float>& values, v1::Tensor::DType dtype) {
  absl::StatusOr<v1::Tensor> tensor =
      MakeFloatTensor({static_cast<int64_t>(values.size())}, values, dtype);
  EXPECT_THAT(tensor, IsOk());
  if (!tensor.ok()) return {};
  std::vector<uint16_t> words;
  const std::string& data = tensor->data();
  for (size_t i = 0; i + 1 < data.size(); i += 2) {
    words.push_back(static_cast<uint16_t>(static_cast<unsigned char>(data[i]) |
                                          static_cast<unsigned char>(data[i + 1]) << 8));
  }
  return words;
}

// Floats decoded from the 16-bit `words` of a one-dimensional tensor.
std::vector<float> Decode16(const std::vector<uint16_t>& words, v1::Tensor::DType dtype) {
  v1::Tensor tensor;
  tensor.set_dtype(dtype);
  tensor.add_shape(static_cast<int64_t>(words.size()));
  tensor.set_data(Bytes16(words));
  absl::StatusOr<std::vector<float>> values = ReadFloats(tensor);
  EXPECT_THAT(values, IsOk());
  return values.ok() ? *values : std::vector<float>();
}

TEST(MakeFloatTensorTest, Float32IsLittleEndianIeee) {
  absl::StatusOr<v1::Tensor> tensor = MakeFloatTensor({2}, {1.0f, -2.5f});
  ASSERT_THAT(tensor, IsOk());
  EXPECT_EQ(tensor->dtype(), v1::Tensor::FLOAT32);
  EXPECT_THAT(tensor->shape(), ElementsAre(2));
  EXPECT_EQ(tensor->data(), Bytes32({0x3f800000u, 0xc0200000u}));
  EXPECT_THAT(tensor->float_data(), IsEmpty());
}

TEST(MakeFloatTensorTest, Float32KeepsSpecialValuesBitForBit) {
  const std::vector<uint32_t> bits = {0x7fc00001u, 0x7f800000u, 0xff800000u,
                                      0x00000001u, 0x80000000u, 0x7f7fffffu};
  std::vector<float> values;
  for (uint32_t b : bits) values.push_back(FromBits(b));
  absl::StatusOr<v1::Tensor> tensor = MakeFloatTensor({2, 3}, values);
  ASSERT_THAT(tensor, IsOk());
  EXPECT_EQ(tensor->data(), Bytes32(bits));
  absl::StatusOr<std::vector<float>> back = ReadFloats(*tensor);
  ASSERT_THAT(back, IsOk());
  ASSERT_EQ(back->size(), bits.size());
  for (size_t i = 0; i < bits.size(); ++i) EXPECT_EQ(ToBits((*back)[i]), bits[i]) << i;
}

TEST(MakeFloatTensorTest, BFloat16KnownBitPatterns) {
  EXPECT_THAT(Encode16({1.0f, -2.0f, 0.0f, -0.0f}, v1::Tensor::BFLOAT16),
              ElementsAre(0x3f80, 0xc000, 0x0000, 0x8000));
  EXPECT_THAT(
      Encode16({std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()},
               v1::Tensor::BFLOAT16),
      ElementsAre(0x7f80, 0xff80));
  // The largest float rounds up to infinity.
  EXPECT_THAT(Encode16({FromBits(0x7f7fffffu)}, v1::Tensor::BFLOAT16), ElementsAre(0x7f80));
  // Subnormals survive.
  EXPECT_THAT(Encode16({FromBits(0x00010000u), FromBits(0x807f0000u)}, v1::Tensor::BFLOAT16),
              ElementsAre(0x0001, 0x807f));
}

TEST(MakeFloatTensorTest, BFloat16RoundsToNearestEven) {
  EXPECT_THAT(Encode16({FromBits(0x3f808000u),   // halfway, lower is even: down
                        FromBits(0x3f818000u),   // halfway, upper is even: up
                        FromBits(0x3f808001u),   // above halfway: up
                        FromBits(0x3f807fffu)},  // below halfway: down
                       v1::Tensor::BFLOAT16),
              ElementsAre(0x3f80, 0x3f82, 0x3f81, 0x3f80));
}

TEST(MakeFloatTensorTest, BFloat16KeepsNaNsNaN) {
  // A signalling NaN whose payload is only in the low bits must not become inf.
  std::vector<uint16_t> words = Encode16(
      {FromBits(0x7fc00000u), FromBits(0x7f800001u), FromBits(0xffc00000u)}, v1::Tensor::BFLOAT16);
  ASSERT_EQ(words.size(), 3u);
  for (uint16_t w : words) {
    EXPECT_EQ(w & 0x7f80, 0x7f80) << std::hex << w;
    EXPECT_NE(w & 0x007f, 0) << std::hex << w;
  }
  EXPECT_EQ(words[2] & 0x8000, 0x8000);
}

TEST(MakeFloatTensorTest, Float16KnownBitPatterns) {
  EXPECT_THAT(Encode16({1.0f, -2.0f, 0.5f, 65504.0f, -0.0f}, v1::Tensor::FLOAT16),
              ElementsAre(0x3c00, 0xc000, 0x3800, 0x7bff, 0x8000));
  EXPECT_THAT(
      Encode16({std::numeric_limits<float>::infinity(), 65520.0f, 1e10f}, v1::Tensor::FLOAT16),
      ElementsAre(0x7c00, 0x7c00, 0x7c00));
  EXPECT_THAT(Encode16({std::ldexp(1.0f, -14), std::ldexp(1.0f, -24), 1023 * std::ldexp(1.0f, -24)},
                       v1::Tensor::FLOAT16),
              ElementsAre(0x0400, 0x0001, 0x03ff));
  EXPECT_THAT(Encode16({std::numeric_limits<float>::quiet_NaN()}, v1::Tensor::FLOAT16),
              ElementsAre(0x7e00));
}

TEST(MakeFloatTensorTest, Float16RoundsToNearestEven) {
  EXPECT_THAT(Encode16({1.0f + std::ldexp(1.0f, -11),      // halfway to 0x3c01: down
                        1.0f + 3 * std::ldexp(1.0f, -11),  // halfway to 0x3c02: up
                        std::ldexp(1.0f, -25),             // half the smallest subnormal: 0
                        3 * std::ldexp(1.0f, -25),         // 1.5 subnormal ulps: 2
                        65519.0f},                         // below the inf threshold
                       v1::Tensor::FLOAT16),
              ElementsAre(0x3c00, 0x3c02, 0x0000, 0x0002, 0x7bff));
}

TEST(ReadFloatsTest, DecodesBFloat16Bits) {
  std::vector<float> values =
      Decode16({0x3f80, 0xc040, 0x7f80, 0x0001, 0x8000}, v1::Tensor::BFLOAT16);
  ASSERT_EQ(values.size(), 5u);
  EXPECT_EQ(values[0], 1.0f);
  EXPECT_EQ(values[1], -3.0f);
  EXPECT_EQ(values[2], std::numeric_limits<float>::infinity());
  EXPECT_EQ(ToBits(values[3]), 0x00010000u);
  EXPECT_EQ(ToBits(values[4]), 0x80000000u);
  EXPECT_TRUE(std::isnan(Decode16({0x7fc1}, v1::Tensor::BFLOAT16).at(0)));
}

TEST(ReadFloatsTest, DecodesFloat16Bits) {
  std::vector<float> values =
      Decode16({0x3c00, 0xc000, 0x7bff, 0xfc00, 0x0001, 0x03ff, 0x0400}, v1::Tensor::FLOAT16);
  EXPECT_THAT(values, ElementsAre(1.0f, -2.0f, 65504.0f, -std::numeric_limits<float>::infinity(),
                                  std::ldexp(1.0f, -24), 1023 * std::ldexp(1.0f, -24),
                                  std::ldexp(1.0f, -14)));
  EXPECT_TRUE(std::isnan(Decode16({0x7e00}, v1::Tensor::FLOAT16).at(0)));
  EXPECT_TRUE(std::isnan(Decode16({0x7c01}, v1::Tensor::FLOAT16).at(0)));
}

TEST(ReadFloatsTest, ReadsFloatData) {
  v1::Tensor tensor;
  tensor.add_shape(1);
  tensor.add_shape(2);
  tensor.add_float_data(0.25f);
  tensor.add_float_data(-4.0f);
  EXPECT_THAT(ReadFloats(tensor), IsOkAndHolds(ElementsAre(0.25f, -4.0f)));
}

TEST(ReadFloatsTest, EmptyShapeHasNoElements) {
  absl::StatusOr<v1::Tensor> tensor = MakeFloatTensor({0, 3}, {}, v1::Tensor::FLOAT16);
  ASSERT_THAT(tensor, IsOk());
  EXPECT_THAT(ReadFloats(*tensor), IsOkAndHolds(IsEmpty()));
}

// Values exactly representable in all three float types come back unchanged.
class FloatRoundTripTest : public ::testing::TestWithParam<v1::Tensor::DType> {};

TEST_P(FloatRoundTripTest, ExactValuesComeBack) {
  const std::vector<float> values = {0.0f,
                                     -0.0f,
                                     1.0f,
                                     -1.5f,
                                     0.125f,
                                     3.0f,
                                     256.0f,
                                     -1024.0f,
                                     std::numeric_limits<float>::infinity(),
                                     std::ldexp(1.0f, -14)};
  absl::StatusOr<v1::Tensor> tensor = MakeFloatTensor({2, 5}, values, GetParam());
  ASSERT_THAT(tensor, IsOk());
  EXPECT_EQ(tensor->dtype(), GetParam());
  EXPECT_EQ(tensor->data().size(), values.size() * (GetParam() == v1::Tensor::FLOAT32 ? 4 : 2));
  absl::StatusOr<std::vector<float>> back = ReadFloats(*tensor);
  ASSERT_THAT(back, IsOk());
  ASSERT_EQ(back->size(), values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(ToBits((*back)[i]), ToBits(values[i])) << "element " << i;
  }
}

TEST_P(FloatRoundTripTest, ExpandToFloatDataGivesFloat32Elements) {
  absl::StatusOr<v1::Tensor> tensor = MakeFloatTensor({1, 3}, {1.0f, -2.0f, 0.5f}, GetParam());
  ASSERT_THAT(tensor, IsOk());
  ASSERT_THAT(ExpandToFloatData(&*tensor), IsOk());
  EXPECT_EQ(tensor->dtype(), v1::Tensor::FLOAT32);
  EXPECT_THAT(tensor->shape(), ElementsAre(1, 3));
  EXPECT_TRUE(tensor->data().empty());
  EXPECT_THAT(tensor->float_data(), ElementsAre(1.0f, -2.0f, 0.5f));
}

TEST_P(FloatRoundTripTest, RejectsWrongByteCount) {
  v1::Tensor tensor;
  tensor.set_dtype(GetParam());
  tensor.add_shape(2);
  tensor.add_shape(3);
  tensor.set_data(std::string(10, '\0'));
  const int size = GetParam() == v1::Tensor::FLOAT32 ? 4 : 2;
  EXPECT_THAT(ReadFloats(tensor), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("data has 10 bytes, shape [2, 3] of " +
                                                     v1::Tensor::DType_Name(GetParam()) +
                                                     " needs " + std::to_string(6 * size))));
  EXPECT_THAT(ExpandToFloatData(&tensor),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("data has 10 bytes")));
  EXPECT_EQ(tensor.data().size(), 10u) << "a failed expansion leaves the tensor alone";
}

INSTANTIATE_TEST_SUITE_P(AllFloatTypes, FloatRoundTripTest,
                         ::testing::Values(v1::Tensor::FLOAT32, v1::Tensor::BFLOAT16,
                                           v1::Tensor::FLOAT16),
                         [](const ::testing::TestParamInfo<v1::Tensor::DType>& info) {
                           return v1::Tensor::DType_Name(info.param);
                         });

TEST(MakeBoolTensorTest, OneBytePerElement) {
  absl::StatusOr<v1::Tensor> tensor = MakeBoolTensor({2, 2}, {true, false, false, true});
  ASSERT_THAT(tensor, IsOk());
  EXPECT_EQ(tensor->dtype(), v1::Tensor::BOOL);
  EXPECT_THAT(tensor->shape(), ElementsAre(2, 2));
  EXPECT_EQ(tensor->data(), std::string("\x01\x00\x00\x01", 4));
}

TEST(MakeInt64TensorTest, LittleEndianTwosComplement) {
  absl::StatusOr<v1::Tensor> tensor = MakeInt64Tensor({2}, {-1, (int64_t{1} << 40) + 5});
  ASSERT_THAT(tensor, IsOk());
  EXPECT_EQ(tensor->dtype(), v1::Tensor::INT64);
  EXPECT_EQ(tensor->data(), std::string("\xff\xff\xff\xff\xff\xff\xff\xff"
                                        "\x05\x00\x00\x00\x00\x01\x00\x00",
                                        16));
}

TEST(MakeTensorTest, RejectsValueCountThatDoesNotMatchShape) {
  EXPECT_THAT(MakeFloatTensor({2, 3}, {1, 2, 3, 4, 5}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("values has 5 elements, shape [2, 3] needs 6")));
  EXPECT_THAT(MakeBoolTensor({3}, {true}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("values has 1 elements, shape [3] needs 3")));
  EXPECT_THAT(MakeInt64Tensor({}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("values has 0 elements, shape [] needs 1")));
}

TEST(MakeTensorTest, RejectsNegativeDim) {
  EXPECT_THAT(MakeFloatTensor({2, -1}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("shape [2, -1] has negative dim -1 at index 1")));
}

// A product that wraps around int64 must not be mistaken for a small count.
TEST(MakeTensorTest, RejectsShapeWhoseProductOverflows) {
  const int64_t big = int64_t{1} << 32;
  EXPECT_THAT(MakeInt64Tensor({big, big}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("shape [4294967296, 4294967296] has more than "
                                 "9223372036854775807 elements")));
  v1::Tensor tensor;
  tensor.set_dtype(v1::Tensor::FLOAT16);
  tensor.add_shape(int64_t{1} << 62);
  EXPECT_THAT(ReadFloats(tensor),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs more than")));
}

TEST(MakeFloatTensorTest, RejectsNonFloatDType) {
  EXPECT_THAT(
      MakeFloatTensor({1}, {1.0f}, v1::Tensor::BOOL),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dtype BOOL is not a float type")));
}

TEST(ReadFloatsTest, RejectsNonFloatDType) {
  absl::StatusOr<v1::Tensor> tensor = MakeInt64Tensor({1}, {7});
  ASSERT_THAT(tensor, IsOk());
  EXPECT_THAT(ReadFloats(*tensor), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("dtype INT64 is not a float type")));
}

TEST(ReadFloatsTest, RejectsFloatDataOfWrongCount) {
  v1::Tensor tensor;
  tensor.add_shape(3);
  tensor.add_float_data(1.0f);
  tensor.add_float_data(2.0f);
  EXPECT_THAT(ReadFloats(tensor),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("float_data has 2 elements, shape [3] needs 3")));
}

TEST(ReadFloatsTest, RejectsFloatDataOnHalfTensor) {
  v1::Tensor tensor;
  tensor.set_dtype(v1::Tensor::BFLOAT16);
  tensor.add_shape(1);
  tensor.add_float_data(1.0f);
  EXPECT_THAT(ReadFloats(tensor), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("float_data is set on a BFLOAT16 tensor")));
}

TEST(ReadFloatsTest, RejectsTwoSourcesOfElements) {
  absl::StatusOr<v1::Tensor> tensor = MakeFloatTensor({1}, {1.0f});
  ASSERT_THAT(tensor, IsOk());
  tensor->add_float_data(1.0f);
  EXPECT_THAT(ReadFloats(*tensor),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("at most one of data, float_data and int_data")));
}

TEST(ReadFloatsTest, RejectsIntDataOnFloatTensor) {
  v1::Tensor tensor;
  tensor.add_shape(1);
  tensor.add_int_data(1);
  EXPECT_THAT(ReadFloats(tensor), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("int_data is set on a FLOAT32 tensor")));
}

TEST(ExpandToFloatDataTest, LeavesNonFloatTensorAlone) {
  absl::StatusOr<v1::Tensor> tensor = MakeBoolTensor({2}, {true, false});
  ASSERT_THAT(tensor, IsOk());
  const v1::Tensor before = *tensor;
  ASSERT_THAT(ExpandToFloatData(&*tensor), IsOk());
  EXPECT_EQ(tensor->SerializeAsString(), before.SerializeAsString());
}

}  // namespace
}  // namespace attention::client
