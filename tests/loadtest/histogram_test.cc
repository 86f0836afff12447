#include "client/loadtest/histogram.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/loadtest/stats.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace attention::loadtest {
namespace {

using ::attention::testing::StatusIs;
using ::testing::HasSubstr;

constexpr double kQuantiles[] = {0.5, 0.9, 0.99, 0.999, 0.9999};

// The ceil(q * n)-th smallest of `sorted`, the definition Histogram follows.
int64_t ExactQuantile(const std::vector<int64_t>& sorted, double q) {
  const size_t rank =
      std::max<size_t>(1, static_cast<size_t>(std::ceil(q * static_cast<double>(sorted.size()))));
  return sorted[rank - 1];
}

struct Distribution {
  const char* name;
  // Nanoseconds.
  std::function<int64_t(std::mt19937_64&)> draw;
};

class HistogramAccuracyTest : public ::testing::TestWithParam<Distribution> {};

TEST_P(HistogramAccuracyTest, QuantilesAreWithinOnePercentOfTheExactOnes) {
  std::mt19937_64 rng(42);
  std::vector<int64_t> values(200'000);
  Histogram histogram;
  for (int64_t& value : values) {
    value = GetParam().draw(rng);
    histogram.Record(value);
  }
  std::sort(values.begin(), values.end());
  EXPECT_EQ(histogram.count(), static_cast<int64_t>(values.size()));
  EXPECT_EQ(histogram.min(), values.front());
  EXPECT_EQ(histogram.max(), values.back());
  EXPECT_EQ(histogram.ValueAtQuantile(1.0), values.back());
  for (double q : kQuantiles) {
    const double exact = static_cast<double>(ExactQuantile(values, q));
    const double got = static_cast<double>(histogram.ValueAtQuantile(q));
    EXPECT_LE(std::abs(got - exact), 0.01 * exact)
        << "quantile " << q << ": got " << got << " ns, exact " << exact << " ns";
  }
}

INSTANTIATE_TEST_SUITE_P(
    KnownDistributions, HistogramAccuracyTest,
    ::testing::Values(Distribution{"uniform_1us_to_1s",
                                   [](std::mt19937_64& rng) {
                                     return std::uniform_int_distribution<int64_t>(
                                         1'000, 1'000'000'000)(rng);
                                   }},
                      Distribution{"exponential_mean_1ms",
                                   [](std::mt19937_64& rng) {
                                     return static_cast<int64_t>(
                                         std::exponential_distribution<double>(1e-6)(rng));
                                   }},
                      // A fast mode and a slow one, as a server with a stall or a cold cache.
                      Distribution{"bimodal_200us_and_50ms",
                                   [](std::mt19937_64& rng) {
                                     const bool slow = std::bernoulli_distribution(0.1)(rng);
                                     std::normal_distribution<double> mode(slow ? 50e6 : 200e3,
                                                                           slow ? 5e6 : 20e3);
                                     return std::max<int64_t>(1, static_cast<int64_t>(mode(rng)));
                                   }}),
    [](const ::testing::TestParamInfo<Distribution>& info) { return info.param.name; });

TEST(HistogramTest, SmallValuesAreExact) {
  Histogram histogram;
  for (int64_t v = 0; v < 256; ++v) histogram.Record(v);
  EXPECT_EQ(histogram.ValueAtQuantile(0.5), 127);
  EXPECT_EQ(histogram.ValueAtQuantile(0.0), 0);
  EXPECT_EQ(histogram.ValueAtQuantile(1.0), 255);
  EXPECT_DOUBLE_EQ(histogram.mean(), 127.5);
}

TEST(HistogramTest, KeepsEveryValueWithoutASamplingCap) {
  Histogram histogram;
  for (int i = 0; i < 2'000'000; ++i) histogram.Record(1'000 + i % 1'000);
  histogram.Record(5'000'000'000, 3);  // three 5 s outliers among two million
  EXPECT_EQ(histogram.count(), 2'000'003);
  EXPECT_EQ(histogram.max(), 5'000'000'000);
  EXPECT_NEAR(static_cast<double>(histogram.ValueAtQuantile(0.9999995)), 5e9, 5e9 * 0.01);
}

TEST(HistogramTest, ValuesPastTheTrackableRangeKeepAnExactMax) {
  Histogram histogram;
  histogram.Record(Histogram::kMaxTrackable * 4);
  histogram.Record(-5);  // counts as 0
  EXPECT_EQ(histogram.max(), Histogram::kMaxTrackable * 4);
  EXPECT_EQ(histogram.min(), 0);
  EXPECT_EQ(histogram.count(), 2);
}

TEST(HistogramTest, EmptyReportsZeros) {
  Histogram histogram;
  EXPECT_EQ(histogram.ValueAtQuantile(0.99), 0);
  EXPECT_EQ(histogram.max(), 0);
  EXPECT_EQ(histogram.mean(), 0);
}

TEST(HistogramTest, TextRoundTrips) {
  Histogram histogram;
  std::mt19937_64 rng(7);
  for (int i = 0; i < 10'000; ++i) histogram.Record(static_cast<int64_t>(rng() % 100'000'000));
  absl::StatusOr<Histogram> read = Histogram::FromText(histogram.ToText());
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->ToText(), histogram.ToText());
  EXPECT_EQ(read->ValueAtQuantile(0.99), histogram.ValueAtQuantile(0.99));
}

TEST(HistogramTest, FromTextSaysWhatIsWrong) {
  EXPECT_THAT(Histogram::FromText("count=2 min=1 max=2 sum=3 buckets=1:1"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("buckets hold 1 values")));
  EXPECT_THAT(Histogram::FromText("count=1 min=1 max=1 sum=1 buckets=x:1"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not LOW:COUNT")));
  EXPECT_THAT(Histogram::FromText("count=1"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("want 5 fields")));
}

// Two runs' logs, merged, must tell what one histogram of both runs' values
// tells: the point of writing logs that later runs merge.
TEST(HistogramLogTest, MergeOfTwoLogsEqualsOneHistogramOfBoth) {
  std::mt19937_64 rng(3);
  std::exponential_distribution<double> fast(1e-5);
  std::exponential_distribution<double> slow(1e-7);
  LoadStats first;
  LoadStats second;
  Histogram both;
  for (int i = 0; i < 50'000; ++i) {
    const int64_t a = static_cast<int64_t>(fast(rng));
    const int64_t b = static_cast<int64_t>(slow(rng));
    first.latency.Record(a);
    second.latency.Record(b);
    both.Record(a);
    both.Record(b);
  }
  first.calls_by_code[0] = 50'000;
  second.calls_by_code[0] = 49'990;
  second.calls_by_code[14] = 10;  // UNAVAILABLE
  second.first_error = "UNAVAILABLE: connection reset\nby peer";
  first.RecordBatchSize(4, 100);
  second.RecordBatchSize(4, 50);
  second.RecordBatchSize(8, 7);

  absl::StatusOr<LoadStats> merged = LoadStats::FromLog(first.ToLog());
  ASSERT_TRUE(merged.ok()) << merged.status();
  absl::StatusOr<LoadStats> other = LoadStats::FromLog(second.ToLog());
  ASSERT_TRUE(other.ok()) << other.status();
  merged->Merge(*other);

  EXPECT_EQ(merged->latency.ToText(), both.ToText());
  for (double q : kQuantiles) {
    EXPECT_EQ(merged->latency.ValueAtQuantile(q), both.ValueAtQuantile(q)) << q;
  }
  EXPECT_EQ(merged->requests(), 100'000);
  EXPECT_EQ(merged->errors(), 10);
  EXPECT_EQ(merged->batch_sizes[4], 150);
  EXPECT_EQ(merged->batch_sizes[8], 7);
  EXPECT_EQ(merged->first_error, "UNAVAILABLE: connection reset by peer");
}

TEST(HistogramLogTest, FromLogNamesTheBadLine) {
  EXPECT_THAT(LoadStats::FromLog("something else"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a histogram log")));
  const std::string log = LoadStats().ToLog() + "calls NOT_A_CODE 3\n";
  EXPECT_THAT(LoadStats::FromLog(log),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown status code")));
}

}  // namespace
}  // namespace attention::loadtest
