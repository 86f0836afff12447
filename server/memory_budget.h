#ifndef ATTENTION_SERVER_MEMORY_BUDGET_H_
#define ATTENTION_SERVER_MEMORY_BUDGET_H_

#include <cstdint>
#include <functional>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace attention::server {

// The server-wide bound on the memory calls hold at once: each admitted call
// reserves what it will hold (its request, its allocations, its answer) until
// it is answered, and a call whose reservation would pass the budget is
// refused, so that concurrent large calls cannot together get the process
// killed. Thread-safe.
class MemoryBudget {
 public:
  // A reservation; returns its bytes to the budget when destroyed. Move-only.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept : budget_(other.budget_), bytes_(other.bytes_) {
      other.budget_ = nullptr;
    }
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { Release(); }

    int64_t bytes() const { return budget_ == nullptr ? 0 : bytes_; }

   private:
    friend class MemoryBudget;
    Lease(MemoryBudget* budget, int64_t bytes) : budget_(budget), bytes_(bytes) {}
    void Release();

    MemoryBudget* budget_ = nullptr;
    int64_t bytes_ = 0;
  };

  // `limit_bytes` 0 means no limit. `on_change`, if set, is told the bytes
  // reserved after every change (for a gauge).
  explicit MemoryBudget(int64_t limit_bytes, std::function<void(int64_t)> on_change = {});
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;
  // Every lease must be gone.
  ~MemoryBudget() = default;

  // Reserves `bytes` (at least 0), or RESOURCE_EXHAUSTED naming the numbers
  // when that would pass the limit: more than the whole budget, or more than
  // is left while other calls hold the rest (worth a retry).
  absl::StatusOr<Lease> Reserve(int64_t bytes);

  int64_t limit() const { return limit_; }
  int64_t reserved() const;

 private:
  void Return(int64_t bytes);

  const int64_t limit_;
  const std::function<void(int64_t)> on_change_;
  mutable absl::Mutex mu_;
  int64_t reserved_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t leases_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_MEMORY_BUDGET_H_
