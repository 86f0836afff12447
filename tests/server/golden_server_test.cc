// Every attention golden case through the real gRPC server and the client.

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "client/tensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"
#include "tests/golden_case.h"
#include "tests/server/golden_request.h"
#include "tests/server/test_server.h"

namespace attention::testing {
namespace {

class GoldenServerTest : public ServerSuite<::testing::TestWithParam<std::string>> {};

TEST_P(GoldenServerTest, MatchesPyTorch) {
  const GoldenCase c = LoadGoldenCase(GetParam());
  absl::StatusOr<v1::AttendResponse> response = client().Attend(ToRequest(c));
  ASSERT_THAT(response, IsOk());
  EXPECT_EQ(response->id(), c.name);
  EXPECT_TRUE(WireClose(response->output(), c.expected_output, c.atol, c.rtol));
  if (c.expected_weights.present) {
    EXPECT_TRUE(WireClose(response->weights(), c.expected_weights, c.atol, c.rtol));
  } else {
    EXPECT_FALSE(response->has_weights());
  }
}

TEST_P(GoldenServerTest, OutputWithoutWeightsMatchesPyTorch) {
  const GoldenCase c = LoadGoldenCase(GetParam());
  v1::AttendRequest request = ToRequest(c);
  request.set_need_weights(false);
  request.set_average_weights(false);
  absl::StatusOr<v1::AttendResponse> response = client().Attend(request);
  ASSERT_THAT(response, IsOk());
  EXPECT_TRUE(WireClose(response->output(), c.expected_output, c.atol, c.rtol));
  EXPECT_FALSE(response->has_weights());
}

INSTANTIATE_TEST_SUITE_P(Cases, GoldenServerTest, ::testing::ValuesIn(GoldenCaseNames("attention")),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

class GoldenServerDTypeTest : public ServerSuite<::testing::TestWithParam<v1::Tensor::DType>> {};

// 16-bit outputs carry about 3 significant digits; the tolerance allows for that.
TEST_P(GoldenServerDTypeTest, MatchesPyTorchLoosely) {
  const GoldenCase c = LoadGoldenCase("masks_combined");
  v1::AttendRequest request = ToRequest(c);
  request.set_output_dtype(GetParam());
  absl::StatusOr<v1::AttendResponse> response = client().Attend(request);
  ASSERT_THAT(response, IsOk());
  EXPECT_EQ(response->output().dtype(), GetParam());
  EXPECT_EQ(response->weights().dtype(), GetParam());
  EXPECT_TRUE(WireClose(response->output(), c.expected_output, 1e-2, 1e-2));
  EXPECT_TRUE(WireClose(response->weights(), c.expected_weights, 1e-2, 1e-2));
}

INSTANTIATE_TEST_SUITE_P(OutputDTypes, GoldenServerDTypeTest,
                         ::testing::Values(v1::Tensor::BFLOAT16, v1::Tensor::FLOAT16),
                         [](const ::testing::TestParamInfo<v1::Tensor::DType>& info) {
                           return v1::Tensor::DType_Name(info.param);
                         });

}  // namespace
}  // namespace attention::testing
