#include "client/loadtest/stats.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace attention::loadtest {
namespace {

constexpr absl::string_view kLogMagic = "# attention_loadtest histogram log 1";

double PerSecond(double count, double seconds) { return seconds > 0 ? count / seconds : 0; }

absl::Status BadLine(int number, absl::string_view line, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("histogram log line ", number, " \"", line, "\": ", why));
}

// The run-level numbers of the log, by key.
struct Scalar {
  absl::string_view key;
  double LoadStats::*value;
};
constexpr Scalar kScalars[] = {
    {"duration_s", &LoadStats::duration_s},
    {"send_window_s", &LoadStats::send_window_s},
    {"cpu_user_s", &LoadStats::cpu_user_s},
    {"cpu_system_s", &LoadStats::cpu_system_s},
};

}  // namespace

std::string StatusCodeName(int code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

void LoadStats::RecordBatchSize(int64_t size, int64_t count) {
  size = std::clamp<int64_t>(size, 0, kMaxBatchSize);
  if (static_cast<size_t>(size) >= batch_sizes.size()) batch_sizes.resize(size + 1, 0);
  batch_sizes[size] += count;
}

int64_t LoadStats::requests() const {
  int64_t total = verify_failures;
  for (int64_t n : calls_by_code) total += n;
  return total;
}

int64_t LoadStats::errors() const { return requests() - calls_by_code[0]; }

double LoadStats::error_fraction() const {
  const int64_t total = requests();
  return total == 0 ? 0 : static_cast<double>(errors()) / static_cast<double>(total);
}

double LoadStats::throughput_rps() const {
  return PerSecond(static_cast<double>(requests()), duration_s);
}

double LoadStats::ok_rps() const {
  return PerSecond(static_cast<double>(calls_by_code[0]), duration_s);
}

double LoadStats::sent_rps() const { return PerSecond(static_cast<double>(sent), send_window_s); }

double LoadStats::cpu_percent() const {
  const double wall = std::max(duration_s, send_window_s);
  return cores > 0 ? 100 * PerSecond(cpu_user_s + cpu_system_s, wall * cores) : 0;
}

void LoadStats::Merge(const LoadStats& other) {
  for (const NamedHistogram& named : kHistograms) {
    (this->*named.histogram).Merge(other.*named.histogram);
  }
  for (int code = 0; code < kStatusCodes; ++code) calls_by_code[code] += other.calls_by_code[code];
  verify_failures += other.verify_failures;
  if (batch_sizes.size() < other.batch_sizes.size()) batch_sizes.resize(other.batch_sizes.size());
  for (size_t i = 0; i < other.batch_sizes.size(); ++i) batch_sizes[i] += other.batch_sizes[i];
  if (first_error.empty()) first_error = other.first_error;
  sent += other.sent;
  duration_s = std::max(duration_s, other.duration_s);
  send_window_s = std::max(send_window_s, other.send_window_s);
  cpu_user_s += other.cpu_user_s;
  cpu_system_s += other.cpu_system_s;
  cores = std::max(cores, other.cores);
}

void SessionStats::Merge(const SessionStats& other) {
  opened += other.opened;
  closed += other.closed;
  not_open_at_close += other.not_open_at_close;
  recreations += other.recreations;
  sessions_recreated += other.sessions_recreated;
  for (const auto& [name, replica] : other.replicas) {
    replicas[name].created += replica.created;
    replicas[name].steps += replica.steps;
  }
  steps += other.steps;
  cache_bytes_read += other.cache_bytes_read;
  prefill.Merge(other.prefill);
}

double SessionStats::steps_per_s(double seconds) const {
  return PerSecond(static_cast<double>(steps), seconds);
}

double SessionStats::cache_bytes_read_per_s(double seconds) const {
  return PerSecond(cache_bytes_read, seconds);
}

std::string LoadStats::ToLog() const {
  std::string log =
      absl::StrCat(kLogMagic, "\n# merge logs with: attention_loadtest merge FILE...\n");
  absl::StrAppend(&log, "sent ", sent, "\ncores ", cores, "\n");
  for (const Scalar& scalar : kScalars) {
    absl::StrAppend(&log, scalar.key, " ", absl::StrFormat("%.9g", this->*scalar.value), "\n");
  }
  for (int code = 0; code < kStatusCodes; ++code) {
    if (calls_by_code[code] > 0) {
      absl::StrAppend(&log, "calls ", StatusCodeName(code), " ", calls_by_code[code], "\n");
    }
  }
  absl::StrAppend(&log, "verify_failures ", verify_failures, "\n");
  for (size_t size = 0; size < batch_sizes.size(); ++size) {
    if (batch_sizes[size] > 0) {
      absl::StrAppend(&log, "batch_size ", size, " ", batch_sizes[size], "\n");
    }
  }
  if (!first_error.empty()) {
    absl::StrAppend(&log, "first_error ",
                    absl::StrReplaceAll(first_error, {{"\n", " "}, {"\r", " "}}), "\n");
  }
  for (const NamedHistogram& named : kHistograms) {
    absl::StrAppend(&log, "histogram ", named.name, " ", (this->*named.histogram).ToText(), "\n");
  }
  return log;
}

absl::StatusOr<LoadStats> LoadStats::FromLog(absl::string_view text) {
  if (!absl::StartsWith(text, kLogMagic)) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a histogram log: it does not start with \"", kLogMagic, "\""));
  }
  LoadStats stats;
  int number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++number;
    line = absl::StripTrailingAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    const std::pair<absl::string_view, absl::string_view> key_rest =
        absl::StrSplit(line, absl::MaxSplits(' ', 1));
    const absl::string_view key = key_rest.first;
    const absl::string_view rest = key_rest.second;
    if (key == "first_error") {
      stats.first_error = std::string(rest);
      continue;
    }
    if (key == "histogram") {
      const std::pair<absl::string_view, absl::string_view> name_text =
          absl::StrSplit(rest, absl::MaxSplits(' ', 1));
      const NamedHistogram* named = nullptr;
      for (const NamedHistogram& candidate : kHistograms) {
        if (name_text.first == candidate.name) named = &candidate;
      }
      if (named == nullptr) return BadLine(number, line, "unknown histogram");
      absl::StatusOr<Histogram> histogram = Histogram::FromText(name_text.second);
      if (!histogram.ok()) return BadLine(number, line, histogram.status().message());
      stats.*named->histogram = *std::move(histogram);
      continue;
    }
    const std::vector<absl::string_view> words = absl::StrSplit(rest, ' ');
    int64_t count;
    if (key == "calls" || key == "batch_size") {
      if (words.size() != 2 || !absl::SimpleAtoi(words[1], &count) || count < 0) {
        return BadLine(number, line, absl::StrCat("want \"", key, " NAME COUNT\""));
      }
      if (key == "batch_size") {
        int64_t size;
        if (!absl::SimpleAtoi(words[0], &size) || size < 0 || size > kMaxBatchSize) {
          return BadLine(number, line, "bad batch size");
        }
        stats.RecordBatchSize(size, count);
        continue;
      }
      int code = 0;
      while (code < kStatusCodes && StatusCodeName(code) != words[0]) ++code;
      if (code == kStatusCodes) return BadLine(number, line, "unknown status code");
      stats.calls_by_code[code] += count;
      continue;
    }
    if (words.size() != 1) return BadLine(number, line, "want \"KEY VALUE\"");
    if (key == "sent" || key == "verify_failures" || key == "cores") {
      if (!absl::SimpleAtoi(words[0], &count) || count < 0) {
        return BadLine(number, line, "not a non-negative integer");
      }
      if (key == "sent") stats.sent = count;
      if (key == "verify_failures") stats.verify_failures = count;
      if (key == "cores") stats.cores = static_cast<int>(count);
      continue;
    }
    const Scalar* scalar = nullptr;
    for (const Scalar& candidate : kScalars) {
      if (key == candidate.key) scalar = &candidate;
    }
    double value;
    if (scalar == nullptr) return BadLine(number, line, "unknown key");
    if (!absl::SimpleAtod(words[0], &value) || value < 0) {
      return BadLine(number, line, "not a non-negative number");
    }
    stats.*scalar->value = value;
  }
  return stats;
}

}  // namespace attention::loadtest
