#include "client/loadtest/schedule.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace attention::loadtest {
namespace {

absl::StatusOr<double> ParseValue(absl::string_view text, LoadKind kind, absl::string_view phase) {
  double value;
  if (!absl::SimpleAtod(text, &value) || !std::isfinite(value) || value < 0) {
    return absl::InvalidArgumentError(absl::StrCat("schedule phase \"", phase, "\": \"", text,
                                                   "\" is not a non-negative number"));
  }
  if (kind == LoadKind::kConcurrency &&
      (value != std::floor(value) || value > static_cast<double>(kMaxConcurrency))) {
    return absl::InvalidArgumentError(absl::StrCat("schedule phase \"", phase,
                                                   "\": a concurrency is a whole number up to ",
                                                   kMaxConcurrency, ", not ", text));
  }
  if (kind == LoadKind::kRate && value > static_cast<double>(kMaxRate)) {
    return absl::InvalidArgumentError(
        absl::StrCat("schedule phase \"", phase, "\": rate ", text, " is above ", kMaxRate, "/s"));
  }
  return value;
}

absl::StatusOr<Phase> ParsePhase(absl::string_view text, LoadKind kind) {
  const std::vector<absl::string_view> parts = absl::StrSplit(text, '@');
  if (parts.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("schedule phase \"", text, "\" is not VALUE@DURATION or FROM..TO@DURATION"));
  }
  Phase phase;
  if (!absl::ParseDuration(parts[1], &phase.length) || phase.length <= absl::ZeroDuration() ||
      phase.length == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("schedule phase \"", text, "\": \"", parts[1],
                                                   "\" is not a positive duration such as 5s"));
  }
  const std::vector<absl::string_view> values = absl::StrSplit(parts[0], "..");
  if (values.size() > 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("schedule phase \"", text, "\": a ramp is FROM..TO"));
  }
  absl::StatusOr<double> from = ParseValue(values[0], kind, text);
  if (!from.ok()) return from.status();
  absl::StatusOr<double> to = values.size() == 2 ? ParseValue(values[1], kind, text) : from;
  if (!to.ok()) return to.status();
  phase.from = *from;
  phase.to = *to;
  return phase;
}

}  // namespace

absl::StatusOr<Schedule> Schedule::Parse(absl::string_view spec) {
  const std::pair<absl::string_view, absl::string_view> kind_and_phases =
      absl::StrSplit(spec, absl::MaxSplits(':', 1));
  LoadKind kind;
  if (kind_and_phases.first == "rate") {
    kind = LoadKind::kRate;
  } else if (kind_and_phases.first == "concurrency") {
    kind = LoadKind::kConcurrency;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("schedule \"", spec,
                     "\" does not start with \"rate:\" or \"concurrency:\" (e.g. "
                     "rate:100@5s,100..500@10s)"));
  }
  std::vector<Phase> phases;
  for (absl::string_view text : absl::StrSplit(kind_and_phases.second, ',')) {
    absl::StatusOr<Phase> phase = ParsePhase(text, kind);
    if (!phase.ok()) return phase.status();
    phases.push_back(*phase);
  }
  Schedule schedule(kind, std::move(phases));
  if (schedule.Peak() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("schedule \"", spec, "\" offers no load: every value is 0"));
  }
  return schedule;
}

Schedule Schedule::Constant(LoadKind kind, double value, absl::Duration length) {
  return Schedule(kind, {Phase{value, value, length}});
}

Schedule Schedule::WithLead(absl::Duration length) const {
  if (length <= absl::ZeroDuration()) return *this;
  std::vector<Phase> phases = {Phase{phases_.front().from, phases_.front().from, length}};
  phases.insert(phases.end(), phases_.begin(), phases_.end());
  return Schedule(kind_, std::move(phases));
}

absl::Duration Schedule::length() const {
  absl::Duration total;
  for (const Phase& phase : phases_) total += phase.length;
  return total;
}

double Schedule::ValueAt(absl::Duration t) const {
  for (const Phase& phase : phases_) {
    if (t < phase.length) {
      if (phase.from == phase.to) return phase.from;
      return phase.from + (phase.to - phase.from) * absl::FDivDuration(t, phase.length);
    }
    t -= phase.length;
  }
  return 0;
}

double Schedule::MeanOver(absl::Duration from, absl::Duration to) const {
  if (to <= from) return ValueAt(from);
  // Each phase is linear: its part of the range contributes the mean of
  // its values at the part's ends times the part's length.
  double integral = 0;
  absl::Duration start;
  for (const Phase& phase : phases_) {
    const absl::Duration end = start + phase.length;
    const absl::Duration a = std::max(from, start), b = std::min(to, end);
    if (a < b) {
      auto at = [&](absl::Duration t) {
        if (phase.from == phase.to) return phase.from;
        return phase.from + (phase.to - phase.from) * absl::FDivDuration(t - start, phase.length);
      };
      integral += (at(a) + at(b)) / 2 * absl::ToDoubleSeconds(b - a);
    }
    if (end >= to) break;
    start = end;
  }
  return integral / absl::ToDoubleSeconds(to - from);
}

double Schedule::Peak() const {
  double peak = 0;
  for (const Phase& phase : phases_) peak = std::max({peak, phase.from, phase.to});
  return peak;
}

std::string Schedule::ToString() const {
  std::string text = kind_ == LoadKind::kRate ? "rate:" : "concurrency:";
  const char* separator = "";
  for (const Phase& phase : phases_) {
    absl::StrAppend(&text, separator, phase.from);
    if (phase.to != phase.from) absl::StrAppend(&text, "..", phase.to);
    // An unbounded phase (a run until --requests are sent) has no length.
    if (phase.length != absl::InfiniteDuration()) {
      absl::StrAppend(&text, "@", absl::FormatDuration(phase.length));
    }
    separator = ",";
  }
  return text;
}

SendTimes::SendTimes(const Schedule& schedule, Arrival arrival, uint64_t seed)
    : phases_(schedule.phases()), arrival_(arrival), rng_(seed) {
  if (arrival_ == Arrival::kPoisson) work_ = exponential_(rng_);
}

int64_t SendTimes::Next() {
  const double target = work_;
  work_ += arrival_ == Arrival::kConstant ? 1.0 : exponential_(rng_);
  for (; phase_ < phases_.size(); ++phase_) {
    const Phase& phase = phases_[phase_];
    const double a = phase.from;
    const double b = phase.to;
    const bool unbounded = phase.length == absl::InfiniteDuration();
    const double length_s =
        unbounded ? std::numeric_limits<double>::infinity() : absl::ToDoubleSeconds(phase.length);
    // The integral of the rate over the phase (0 for a pause, even unbounded).
    const double area = (a == 0 && b == 0) ? 0 : (a + b) / 2 * length_s;
    if (target < phase_work_ + area) {
      const double x = target - phase_work_;
      double offset_s;
      if (a == b) {
        offset_s = x / a;
      } else {
        // Solves a*t + (b - a)/(2 * length) * t^2 = x in the form that stays
        // exact when b - a is small.
        const double slope = (b - a) / length_s;
        const double denominator = a + std::sqrt(std::max(0.0, a * a + 2 * slope * x));
        offset_s = denominator > 0 ? 2 * x / denominator : 0;
      }
      return static_cast<int64_t>(std::llround((phase_start_s_ + offset_s) * 1e9));
    }
    phase_work_ += area;
    phase_start_s_ += length_s;
  }
  return -1;
}

absl::StatusOr<Arrival> ParseArrival(absl::string_view name) {
  if (name == "constant") return Arrival::kConstant;
  if (name == "poisson") return Arrival::kPoisson;
  return absl::InvalidArgumentError(
      absl::StrCat("arrival \"", name, "\" is not \"constant\" or \"poisson\""));
}

std::string ArrivalName(Arrival arrival) {
  return arrival == Arrival::kConstant ? "constant" : "poisson";
}

}  // namespace attention::loadtest
