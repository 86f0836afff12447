#include "server/heap_trimmer.h"

#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <utility>

namespace attention::server {
namespace {

std::atomic<int64_t> trims{0};
std::atomic<int64_t> trim_nanos{0};

void Trim() {
  const absl::Time start = absl::Now();
  malloc_trim(0);
  trim_nanos.fetch_add(absl::ToInt64Nanoseconds(absl::Now() - start), std::memory_order_relaxed);
  trims.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

HeapTrimStats HeapTrimStatsNow() {
  return {trims.load(std::memory_order_relaxed),
          static_cast<double>(trim_nanos.load(std::memory_order_relaxed)) * 1e-9};
}

HeapTrimmer::HeapTrimmer(absl::Duration idle, std::function<ServerActivity()> activity)
    : activity_(std::move(activity)),
      thread_([this, idle, started = activity_().started] { Loop(idle, started); }) {}

HeapTrimmer::~HeapTrimmer() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void HeapTrimmer::Loop(absl::Duration idle, uint64_t started) {
  const absl::Duration poll = std::min(idle / 4, absl::Milliseconds(100));
  // The count of calls started when the server was last trimmed, and when it
  // was last seen busy: a trim waits for a call after the last one, then for
  // `idle` without one.
  uint64_t trimmed_at = started;
  uint64_t seen = trimmed_at;
  absl::Time quiet_since = absl::Now();
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stop_), poll)) {
    const ServerActivity now = activity_();
    if (now.in_flight > 0 || now.started != seen) {
      seen = now.started;
      quiet_since = absl::Now();
      continue;
    }
    if (seen == trimmed_at || absl::Now() - quiet_since < idle) continue;
    mu_.Unlock();
    Trim();
    mu_.Lock();
    trimmed_at = seen;
  }
}

}  // namespace attention::server
