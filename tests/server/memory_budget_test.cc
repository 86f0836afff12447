#include "server/memory_budget.h"

#include <utility>

#include "engine/engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace attention::server {
namespace {

using ::testing::HasSubstr;
using testing::StatusIs;

constexpr int64_t kMiB = int64_t{1} << 20;

TEST(MemoryBudgetTest, ReservesUpToTheLimitAndReturnsOnRelease) {
  int64_t gauge = -1;
  MemoryBudget budget(10 * kMiB, [&](int64_t reserved) { gauge = reserved; });
  absl::StatusOr<MemoryBudget::Lease> a = budget.Reserve(6 * kMiB);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->bytes(), 6 * kMiB);
  EXPECT_EQ(gauge, 6 * kMiB);
  {
    absl::StatusOr<MemoryBudget::Lease> b = budget.Reserve(4 * kMiB);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(budget.reserved(), 10 * kMiB);
  }
  EXPECT_EQ(budget.reserved(), 6 * kMiB);
  EXPECT_EQ(gauge, 6 * kMiB);
  *a = MemoryBudget::Lease();  // assigning over a lease returns its bytes
  EXPECT_EQ(budget.reserved(), 0);
  EXPECT_EQ(gauge, 0);
}

TEST(MemoryBudgetTest, ACallPastWhatIsLeftIsRefusedWithTheNumbers) {
  MemoryBudget budget(10 * kMiB);
  absl::StatusOr<MemoryBudget::Lease> held = budget.Reserve(8 * kMiB);
  ASSERT_TRUE(held.ok());
  EXPECT_THAT(
      budget.Reserve(3 * kMiB),
      StatusIs(absl::StatusCode::kResourceExhausted,
               HasSubstr("would hold 3.0 MiB, but 1 calls in flight hold 8.0 MiB of the "
                         "server's memory budget of 10.0 MiB (--memory_budget_mb); retry")));
  // The load of the moment, not the request: not a request over a limit.
  EXPECT_EQ(RequestOverLimit(budget.Reserve(3 * kMiB).status()), "");
  EXPECT_EQ(budget.reserved(), 8 * kMiB);  // a refusal reserves nothing
  MemoryBudget::Lease moved = *std::move(held);
  EXPECT_EQ(budget.reserved(), 8 * kMiB);  // moving keeps the one reservation
  moved = MemoryBudget::Lease();
  EXPECT_TRUE(budget.Reserve(3 * kMiB).ok());
}

TEST(MemoryBudgetTest, ACallLargerThanTheWholeBudgetIsRefusedForGood) {
  MemoryBudget budget(10 * kMiB);
  EXPECT_THAT(budget.Reserve(11 * kMiB),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("would hold 11.0 MiB (request, working memory and answer), more "
                                 "than the server's whole memory budget of 10.0 MiB")));
  EXPECT_EQ(RequestOverLimit(budget.Reserve(11 * kMiB).status()), "memory_budget_mb");
}

TEST(MemoryBudgetTest, ZeroMeansNoLimit) {
  MemoryBudget budget(0);
  absl::StatusOr<MemoryBudget::Lease> huge = budget.Reserve(int64_t{1} << 50);
  ASSERT_TRUE(huge.ok());
  EXPECT_EQ(budget.reserved(), int64_t{1} << 50);
}

}  // namespace
}  // namespace attention::server
