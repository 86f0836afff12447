#include "client/loadtest/schedule.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace attention::loadtest {
namespace {

using ::attention::testing::StatusIs;
using ::testing::HasSubstr;

// Every send time of `schedule`, in nanoseconds.
std::vector<int64_t> AllSends(const Schedule& schedule, Arrival arrival, uint64_t seed = 1) {
  SendTimes times(schedule, arrival, seed);
  std::vector<int64_t> sends;
  for (int64_t t = times.Next(); t >= 0; t = times.Next()) sends.push_back(t);
  return sends;
}

int64_t CountBetween(const std::vector<int64_t>& sends, double from_s, double to_s) {
  int64_t n = 0;
  for (int64_t t : sends) n += t >= from_s * 1e9 && t < to_s * 1e9 ? 1 : 0;
  return n;
}

TEST(ScheduleTest, ParsesStepsAndRamps) {
  absl::StatusOr<Schedule> schedule = Schedule::Parse("rate:100@5s,100..1000@20s,1000@500ms");
  ASSERT_TRUE(schedule.ok()) << schedule.status();
  EXPECT_EQ(schedule->kind(), LoadKind::kRate);
  ASSERT_EQ(schedule->phases().size(), 3u);
  EXPECT_EQ(schedule->phases()[1].from, 100);
  EXPECT_EQ(schedule->phases()[1].to, 1000);
  EXPECT_EQ(schedule->length(), absl::Milliseconds(25'500));
  EXPECT_EQ(schedule->ToString(), "rate:100@5s,100..1000@20s,1000@500ms");
  EXPECT_DOUBLE_EQ(schedule->ValueAt(absl::Seconds(15)), 550);
  EXPECT_EQ(schedule->ValueAt(absl::Seconds(30)), 0);
  EXPECT_EQ(schedule->Peak(), 1000);

  absl::StatusOr<Schedule> closed = Schedule::Parse("concurrency:1@5s,8@5s");
  ASSERT_TRUE(closed.ok()) << closed.status();
  EXPECT_EQ(closed->kind(), LoadKind::kConcurrency);
  EXPECT_EQ(closed->ValueAt(absl::Seconds(6)), 8);
}

// A bad text and what the error must say about it.
using BadInput = std::pair<std::string, std::string>;

class ScheduleRejectsTest : public ::testing::TestWithParam<BadInput> {};

TEST_P(ScheduleRejectsTest, SaysWhy) {
  EXPECT_THAT(Schedule::Parse(GetParam().first),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(GetParam().second)));
}

INSTANTIATE_TEST_SUITE_P(BadSchedules, ScheduleRejectsTest,
                         ::testing::Values(BadInput{"", "does not start with"},
                                           BadInput{"speed:1@1s", "does not start with"},
                                           BadInput{"rate:", "is not VALUE@DURATION"},
                                           BadInput{"rate:100", "is not VALUE@DURATION"},
                                           BadInput{"rate:-1@1s", "not a non-negative number"},
                                           BadInput{"rate:1@0s", "not a positive duration"},
                                           BadInput{"rate:1@forever", "not a positive duration"},
                                           BadInput{"rate:1..2..3@1s", "a ramp is FROM..TO"},
                                           BadInput{"concurrency:1.5@1s", "a whole number"},
                                           BadInput{"concurrency:2000000@1s",
                                                    "a whole number up to 1000000, not 2000000"},
                                           BadInput{"rate:1e9@1s", "rate 1e9 is above 100000000/s"},
                                           BadInput{"rate:0@1s,0..0@2s", "offers no load"}));

TEST(ScheduleTest, WithLeadHoldsTheFirstValueFirst) {
  const Schedule schedule = Schedule::Parse("rate:10..20@1s")->WithLead(absl::Seconds(2));
  EXPECT_EQ(schedule.ToString(), "rate:10@2s,10..20@1s");
  EXPECT_EQ(Schedule::Constant(LoadKind::kRate, 5, absl::Seconds(1)).WithLead({}).ToString(),
            "rate:5@1s");
}

TEST(ScheduleTest, MeanOverIsTheMeanOfTheRange) {
  const Schedule schedule = *Schedule::Parse("rate:100@1s,100..300@2s");
  EXPECT_DOUBLE_EQ(schedule.MeanOver(absl::Seconds(1), absl::Seconds(2)), 150);
  EXPECT_DOUBLE_EQ(schedule.MeanOver(absl::Seconds(0.5), absl::Seconds(1.5)), 112.5);
  EXPECT_DOUBLE_EQ(schedule.MeanOver(absl::Seconds(0), absl::Seconds(3)), 500.0 / 3);
  EXPECT_DOUBLE_EQ(schedule.MeanOver(absl::Seconds(2), absl::Seconds(2)), 200);  // ValueAt
  EXPECT_DOUBLE_EQ(schedule.MeanOver(absl::Seconds(2.5), absl::Seconds(3.5)), 275.0 / 2);
  const Schedule unbounded = Schedule::Constant(LoadKind::kRate, 40, absl::InfiniteDuration());
  EXPECT_DOUBLE_EQ(unbounded.MeanOver(absl::Seconds(5), absl::Seconds(6)), 40);
}

TEST(SendTimesTest, ConstantArrivalsAreEvenlySpacedFromZero) {
  const std::vector<int64_t> sends =
      AllSends(Schedule::Constant(LoadKind::kRate, 1000, absl::Seconds(1)), Arrival::kConstant);
  ASSERT_EQ(sends.size(), 1000u);
  for (size_t i = 0; i < sends.size(); ++i)
    EXPECT_EQ(sends[i], static_cast<int64_t>(i) * 1'000'000);
}

TEST(SendTimesTest, EachStepGetsTheCallsItsRatePromises) {
  const std::vector<int64_t> sends =
      AllSends(*Schedule::Parse("rate:100@1s,0@1s,300@1s"), Arrival::kConstant);
  EXPECT_EQ(CountBetween(sends, 0, 1), 100);
  EXPECT_EQ(CountBetween(sends, 1, 2), 0);
  EXPECT_EQ(CountBetween(sends, 2, 3), 300);
  EXPECT_EQ(sends.size(), 400u);
}

TEST(SendTimesTest, ARampSendsTheIntegralOfItsRate) {
  // 0 to 1000/s over 2 s: 1000 calls, a quarter of them in the first second.
  const std::vector<int64_t> sends =
      AllSends(*Schedule::Parse("rate:0..1000@2s"), Arrival::kConstant);
  EXPECT_NEAR(static_cast<double>(sends.size()), 1000, 1);
  EXPECT_NEAR(static_cast<double>(CountBetween(sends, 0, 1)), 250, 1);
  // A falling ramp mirrors it.
  const std::vector<int64_t> down =
      AllSends(*Schedule::Parse("rate:1000..0@2s"), Arrival::kConstant);
  EXPECT_NEAR(static_cast<double>(CountBetween(down, 0, 1)), 750, 1);
}

TEST(SendTimesTest, PoissonArrivalsHaveTheRateAndExponentialGaps) {
  const Schedule schedule = Schedule::Constant(LoadKind::kRate, 10'000, absl::Seconds(10));
  const std::vector<int64_t> sends = AllSends(schedule, Arrival::kPoisson, 5);
  // 100000 expected; the standard deviation of the count is about 316.
  EXPECT_NEAR(static_cast<double>(sends.size()), 100'000, 1'500);
  double sum = 0;
  double sum_sq = 0;
  for (size_t i = 1; i < sends.size(); ++i) {
    const double gap = static_cast<double>(sends[i] - sends[i - 1]);
    sum += gap;
    sum_sq += gap * gap;
  }
  const double n = static_cast<double>(sends.size() - 1);
  const double mean = sum / n;
  const double cv = std::sqrt(sum_sq / n - mean * mean) / mean;
  EXPECT_NEAR(mean, 100'000, 2'000);  // 0.1 ms
  EXPECT_NEAR(cv, 1.0, 0.05);         // exponential gaps: standard deviation = mean

  EXPECT_EQ(AllSends(schedule, Arrival::kPoisson, 5), sends) << "same seed, same times";
  EXPECT_NE(AllSends(schedule, Arrival::kPoisson, 6), sends);
}

TEST(SendTimesTest, AnUnboundedScheduleNeverEnds) {
  SendTimes times(Schedule::Constant(LoadKind::kRate, 1e6, absl::InfiniteDuration()),
                  Arrival::kConstant, 1);
  int64_t last = -1;
  for (int i = 0; i < 5'000'000; ++i) last = times.Next();
  EXPECT_EQ(last, 4'999'999'000);
}

TEST(ArrivalTest, ParsesNames) {
  EXPECT_EQ(*ParseArrival("poisson"), Arrival::kPoisson);
  EXPECT_EQ(ArrivalName(*ParseArrival("constant")), "constant");
  EXPECT_THAT(ParseArrival("bursty"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bursty")));
}

}  // namespace
}  // namespace attention::loadtest
