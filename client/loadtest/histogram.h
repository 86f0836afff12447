#ifndef ATTENTION_CLIENT_LOADTEST_HISTOGRAM_H_
#define ATTENTION_CLIENT_LOADTEST_HISTOGRAM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attention::loadtest {

// Counts of non-negative integers (nanoseconds in the load tester), kept in
// log-spaced buckets as HdrHistogram does: values below 256 each have their
// own bucket, and every power-of-two range above is cut into 128 equal
// sub-buckets, so a bucket is at most 1/128 of its values wide. A quantile is
// reported as its bucket's midpoint, within 0.4% of the true value. Every
// recorded value counts: there is no sampling and no cap on the count. Values
// above kMaxTrackable (about 73 minutes of nanoseconds) share the last bucket;
// min, max and the sum stay exact. Not thread-safe.
class Histogram {
 public:
  static constexpr int64_t kMaxTrackable = (int64_t{1} << 42) - 1;

  Histogram();

  // Negative values count as 0.
  void Record(int64_t value, int64_t count = 1);
  // Adds every count of `other`, as if its values had been recorded here.
  void Merge(const Histogram& other);
  void Clear();

  int64_t count() const { return count_; }
  // 0 when empty.
  int64_t min() const { return count_ == 0 ? 0 : min_; }
  int64_t max() const { return max_; }
  double mean() const;
  // The value at quantile q in [0, 1]: the midpoint of the bucket holding the
  // ceil(q * count)-th smallest value, clamped to [min, max]; q = 1 is max.
  // 0 when empty.
  int64_t ValueAtQuantile(double q) const;

  // One line: "count=N min=A max=B sum=S buckets=LOW:COUNT,LOW:COUNT,...",
  // LOW being the smallest value of each non-empty bucket. FromText reads it
  // back (INVALID_ARGUMENT naming what is wrong); the result equals this one.
  std::string ToText() const;
  static absl::StatusOr<Histogram> FromText(absl::string_view text);

 private:
  static int Index(int64_t value);
  static int64_t LowestOf(int index);
  static int64_t WidthOf(int index);

  std::vector<int64_t> counts_;
  int64_t count_ = 0;
  int64_t min_ = 0;
  int64_t max_ = 0;
  int64_t sum_ = 0;
};

}  // namespace attention::loadtest

#endif  // ATTENTION_CLIENT_LOADTEST_HISTOGRAM_H_
