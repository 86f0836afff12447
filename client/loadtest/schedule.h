#ifndef ATTENTION_CLIENT_LOADTEST_SCHEDULE_H_
#define ATTENTION_CLIENT_LOADTEST_SCHEDULE_H_

// What load to offer over time: a number of calls in flight (closed loop) or
// a rate of calls (open loop), held or ramped in phases, and for open loops
// the intended send time of every call.

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace attention::loadtest {

enum class LoadKind {
  kConcurrency,  // closed loop: each of N callers sends its next call when the last returns
  kRate,         // open loop: calls per second, sent on schedule whatever the answers do
};

// The largest load a schedule (or --concurrency, --rate) may ask for. More
// callers than this would each need their own call object and would bury any
// server in overhead long before they measured it; a faster rate could not be
// sent, only queued without end.
inline constexpr int64_t kMaxConcurrency = 1'000'000;
inline constexpr int64_t kMaxRate = 100'000'000;  // calls/s

// One phase: the value goes linearly from `from` to `to` over `length`
// (from == to holds it). Rates are calls/s; concurrencies are rounded to the
// nearest whole caller.
struct Phase {
  double from = 0;
  double to = 0;
  absl::Duration length;
};

class Schedule {
 public:
  // "KIND:PHASE,PHASE,..." with KIND "rate" or "concurrency" and each PHASE
  // "VALUE@DURATION" (hold) or "FROM..TO@DURATION" (linear ramp), e.g.
  // "rate:100@5s,100..1000@20s,1000@10s" or "concurrency:1@5s,8@5s,64@5s".
  // INVALID_ARGUMENT naming the phase: a negative or non-finite value, a
  // fractional or too large concurrency, a duration that is not positive and
  // finite, or a schedule with no load at all.
  static absl::StatusOr<Schedule> Parse(absl::string_view spec);
  // `value` held for `length`; InfiniteDuration() holds it until the run stops.
  static Schedule Constant(LoadKind kind, double value, absl::Duration length);

  // This schedule after a phase holding its first value for `length` (the
  // warm-up); `length` zero returns it unchanged.
  Schedule WithLead(absl::Duration length) const;

  LoadKind kind() const { return kind_; }
  const std::vector<Phase>& phases() const { return phases_; }
  // The sum of the phases; InfiniteDuration() when one is unbounded.
  absl::Duration length() const;
  // The rate or concurrency at `t` after the start; 0 past the end.
  double ValueAt(absl::Duration t) const;
  // Its mean over [from, to) (ValueAt(from) when the range is empty): what
  // an interval of a ramp promises on average.
  double MeanOver(absl::Duration from, absl::Duration to) const;
  // The largest value of any phase.
  double Peak() const;
  // In Parse's syntax; an unbounded phase has no "@DURATION".
  std::string ToString() const;

 private:
  Schedule(LoadKind kind, std::vector<Phase> phases) : kind_(kind), phases_(std::move(phases)) {}

  LoadKind kind_;
  std::vector<Phase> phases_;
};

enum class Arrival {
  kConstant,  // evenly spaced, 1/rate apart
  kPoisson,   // exponential gaps of mean 1/rate, from a seeded generator
};

// The intended send times of a rate schedule: the k-th call goes out when the
// integral of the rate from the start reaches k (constant arrivals, starting
// at 0) or the sum of k exponential draws of mean 1 (Poisson arrivals), so
// steps and ramps get exactly the calls their rates promise. Not thread-safe.
class SendTimes {
 public:
  // `schedule` must be a rate schedule.
  SendTimes(const Schedule& schedule, Arrival arrival, uint64_t seed);

  // Nanoseconds from the schedule's start to the next send; -1 once the
  // schedule has ended.
  int64_t Next();

 private:
  std::vector<Phase> phases_;
  Arrival arrival_;
  std::mt19937_64 rng_;
  std::exponential_distribution<double> exponential_{1.0};
  double work_ = 0;           // the integral the next send waits for
  size_t phase_ = 0;          // the phase `work_` falls in, or past
  double phase_start_s_ = 0;  // when it starts
  double phase_work_ = 0;     // the integral up to its start
};

// "constant" or "poisson"; INVALID_ARGUMENT otherwise.
absl::StatusOr<Arrival> ParseArrival(absl::string_view name);
std::string ArrivalName(Arrival arrival);

}  // namespace attention::loadtest

#endif  // ATTENTION_CLIENT_LOADTEST_SCHEDULE_H_
