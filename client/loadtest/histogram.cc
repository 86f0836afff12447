#include "client/loadtest/histogram.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace attention::loadtest {
namespace {

// 2^kSubBucketBits buckets of width 1 below 2^kSubBucketBits, then kHalf
// buckets per power of two: the widest bucket is 1/kHalf of its lowest value.
constexpr int kSubBucketBits = 8;
constexpr int64_t kSubBuckets = int64_t{1} << kSubBucketBits;
constexpr int64_t kHalf = kSubBuckets / 2;
constexpr int kTrackableBits = 42;
static_assert(Histogram::kMaxTrackable == (int64_t{1} << kTrackableBits) - 1);
// The shift of the last power-of-two range, [2^41, 2^42).
constexpr int kLastShift = kTrackableBits - kSubBucketBits;
constexpr int kBucketCount = static_cast<int>(kSubBuckets + kLastShift * kHalf);

absl::Status BadText(absl::string_view what, absl::string_view text) {
  return absl::InvalidArgumentError(absl::StrCat("histogram: ", what, " in \"", text, "\""));
}

// The integer after "key=" in `field`.
absl::StatusOr<int64_t> ParseField(absl::string_view field, absl::string_view key) {
  int64_t value;
  if (!absl::ConsumePrefix(&field, key) || !absl::ConsumePrefix(&field, "=") ||
      !absl::SimpleAtoi(field, &value) || value < 0) {
    return BadText(absl::StrCat("want ", key, "=<non-negative integer>"), field);
  }
  return value;
}

}  // namespace

Histogram::Histogram() : counts_(kBucketCount, 0) {}

int Histogram::Index(int64_t value) {
  value = std::clamp<int64_t>(value, 0, kMaxTrackable);
  if (value < kSubBuckets) return static_cast<int>(value);
  const int msb = 63 - std::countl_zero(static_cast<uint64_t>(value));
  const int shift = msb - (kSubBucketBits - 1);
  const int64_t sub = value >> shift;  // in [kHalf, kSubBuckets)
  return static_cast<int>(kSubBuckets + (shift - 1) * kHalf + (sub - kHalf));
}

int64_t Histogram::LowestOf(int index) {
  if (index < kSubBuckets) return index;
  const int64_t k = index - kSubBuckets;
  const int shift = static_cast<int>(k / kHalf) + 1;
  return (k % kHalf + kHalf) << shift;
}

int64_t Histogram::WidthOf(int index) {
  if (index < kSubBuckets) return 1;
  return int64_t{1} << ((index - kSubBuckets) / kHalf + 1);
}

void Histogram::Record(int64_t value, int64_t count) {
  if (count <= 0) return;
  value = std::max<int64_t>(value, 0);
  counts_[Index(value)] += count;
  if (count_ == 0 || value < min_) min_ = value;
  if (value > max_) max_ = value;
  count_ += count;
  sum_ += value * count;
}

void Histogram::Merge(const Histogram& other) {
  if (other.count_ == 0) return;
  for (size_t i = 0; i < counts_.size(); ++i) counts_[i] += other.counts_[i];
  if (count_ == 0 || other.min_ < min_) min_ = other.min_;
  max_ = std::max(max_, other.max_);
  count_ += other.count_;
  sum_ += other.sum_;
}

void Histogram::Clear() {
  std::fill(counts_.begin(), counts_.end(), 0);
  count_ = min_ = max_ = sum_ = 0;
}

double Histogram::mean() const {
  return count_ == 0 ? 0.0 : static_cast<double>(sum_) / static_cast<double>(count_);
}

int64_t Histogram::ValueAtQuantile(double q) const {
  if (count_ == 0) return 0;
  if (q >= 1.0) return max_;
  const int64_t rank = std::max<int64_t>(
      1, static_cast<int64_t>(std::ceil(std::max(q, 0.0) * static_cast<double>(count_))));
  int64_t seen = 0;
  for (int i = 0; i < kBucketCount; ++i) {
    seen += counts_[i];
    if (seen >= rank) {
      const int64_t width = WidthOf(i);
      return std::clamp(LowestOf(i) + width / 2, min(), max_);
    }
  }
  return max_;
}

std::string Histogram::ToText() const {
  std::string text =
      absl::StrCat("count=", count_, " min=", min(), " max=", max_, " sum=", sum_, " buckets=");
  const char* separator = "";
  for (int i = 0; i < kBucketCount; ++i) {
    if (counts_[i] == 0) continue;
    absl::StrAppend(&text, separator, LowestOf(i), ":", counts_[i]);
    separator = ",";
  }
  return text;
}

absl::StatusOr<Histogram> Histogram::FromText(absl::string_view text) {
  const std::vector<absl::string_view> fields = absl::StrSplit(text, ' ', absl::SkipEmpty());
  if (fields.size() != 5) return BadText("want 5 fields: count, min, max, sum, buckets", text);
  Histogram histogram;
  int64_t values[4];
  constexpr absl::string_view kKeys[4] = {"count", "min", "max", "sum"};
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<int64_t> value = ParseField(fields[i], kKeys[i]);
    if (!value.ok()) return value.status();
    values[i] = *value;
  }
  const auto [count, min, max, sum] = values;
  absl::string_view buckets = fields[4];
  if (!absl::ConsumePrefix(&buckets, "buckets=")) return BadText("no buckets=", text);
  int64_t total = 0;
  for (absl::string_view bucket : absl::StrSplit(buckets, ',', absl::SkipEmpty())) {
    const std::pair<absl::string_view, absl::string_view> parts = absl::StrSplit(bucket, ':');
    int64_t low, n;
    if (!absl::SimpleAtoi(parts.first, &low) || !absl::SimpleAtoi(parts.second, &n) || low < 0 ||
        n <= 0 || low > kMaxTrackable) {
      return BadText(absl::StrCat("bucket \"", bucket, "\" is not LOW:COUNT"), text);
    }
    histogram.counts_[Index(low)] += n;
    total += n;
  }
  if (total != count) {
    return BadText(absl::StrCat("buckets hold ", total, " values, count says ", count), text);
  }
  if (count > 0 && min > max) return BadText("min is above max", text);
  histogram.count_ = count;
  histogram.min_ = count > 0 ? min : 0;
  histogram.max_ = count > 0 ? max : 0;
  histogram.sum_ = sum;
  return histogram;
}

}  // namespace attention::loadtest
