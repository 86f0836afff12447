#include "engine/gemm_baseline.h"

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace attention {
namespace {

using ::testing::HasSubstr;
using testing::IsOk;
using testing::StatusIs;

TEST(GemmBaselineTest, RunsF32AndCountsTwoNCubedFlops) {
  absl::StatusOr<std::unique_ptr<GemmBaseline>> gemm = GemmBaseline::Create(64, /*bf16=*/false);
  ASSERT_THAT(gemm, IsOk());
  EXPECT_THAT((*gemm)->Run(), IsOk());
  EXPECT_THAT((*gemm)->Run(), IsOk());
  EXPECT_EQ((*gemm)->flops(), 2.0 * 64 * 64 * 64);
}

// bf16 matmuls need avx512_core or newer; elsewhere oneDNN has none, and
// Create says so rather than throwing.
TEST(GemmBaselineTest, RunsBf16OrReportsUnimplemented) {
  absl::StatusOr<std::unique_ptr<GemmBaseline>> gemm = GemmBaseline::Create(48, /*bf16=*/true);
  if (!gemm.ok()) {
    EXPECT_THAT(gemm, StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("bf16")));
    return;
  }
  EXPECT_TRUE((*gemm)->bf16());
  EXPECT_THAT((*gemm)->Run(), IsOk());
}

TEST(GemmBaselineTest, RejectsSizesOutOfRange) {
  for (int64_t n : {int64_t{0}, int64_t{-3}, GemmBaseline::kMaxSize + 1}) {
    EXPECT_THAT(GemmBaseline::Create(n, /*bf16=*/false),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("n = ")))
        << n;
  }
}

}  // namespace
}  // namespace attention
