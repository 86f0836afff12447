#include "server/memory_budget.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/mib_string.h"
#include "engine/engine.h"

namespace attention::server {
namespace {

std::string MiB(int64_t bytes) { return MiBString(static_cast<double>(bytes)) + " MiB"; }

}  // namespace

MemoryBudget::Lease& MemoryBudget::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Release();
    budget_ = std::exchange(other.budget_, nullptr);
    bytes_ = other.bytes_;
  }
  return *this;
}

void MemoryBudget::Lease::Release() {
  if (budget_ != nullptr) std::exchange(budget_, nullptr)->Return(bytes_);
}

MemoryBudget::MemoryBudget(int64_t limit_bytes, std::function<void(int64_t)> on_change)
    : limit_(std::max<int64_t>(0, limit_bytes)), on_change_(std::move(on_change)) {}

absl::StatusOr<MemoryBudget::Lease> MemoryBudget::Reserve(int64_t bytes) {
  bytes = std::max<int64_t>(0, bytes);
  int64_t now;
  {
    absl::MutexLock lock(&mu_);
    if (limit_ > 0 && bytes > limit_) {
      const MiBPair over = MiBOverLimit(static_cast<double>(bytes), static_cast<double>(limit_));
      return OverLimitError(
          "memory_budget_mb",
          absl::StrCat("memory: this call would hold ", over.bytes,
                       " (request, working memory and answer), ",
                       "more than the server's whole memory budget of ", over.limit,
                       " (--memory_budget_mb); send a smaller request"));
    }
    if (limit_ > 0 && reserved_ + bytes > limit_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "memory: this call would hold ", MiB(bytes), ", but ", leases_, " calls in flight hold ",
          MiB(reserved_), " of the server's memory budget of ", MiB(limit_),
          " (--memory_budget_mb); retry with backoff"));
    }
    reserved_ += bytes;
    ++leases_;
    now = reserved_;
  }
  if (on_change_) on_change_(now);
  return Lease(this, bytes);
}

int64_t MemoryBudget::reserved() const {
  absl::MutexLock lock(&mu_);
  return reserved_;
}

void MemoryBudget::Return(int64_t bytes) {
  int64_t now;
  {
    absl::MutexLock lock(&mu_);
    reserved_ -= bytes;
    --leases_;
    now = reserved_;
  }
  if (on_change_) on_change_(now);
}

}  // namespace attention::server
