#include "server/scheduler.h"

#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

namespace attention::server {

Scheduler::Scheduler(const Engine* engine, int64_t max_queue, SchedulerHooks hooks, int max_inline)
    : engine_(engine),
      max_queue_(max_queue),
      max_inline_(max_inline > 0 ? max_inline : std::max(1, engine->threads())),
      hooks_(std::move(hooks)) {
  dispatcher_ = std::thread([this] { Loop(); });
}

Scheduler::~Scheduler() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  dispatcher_.join();
}

absl::Status Scheduler::Submit(Job job) {
  int64_t depth;
  bool run_here = false;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("server is shutting down");
    if (static_cast<int64_t>(queue_.size()) >= max_queue_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "queue full: ", queue_.size(), " requests are waiting for compute (--max_queue ",
          max_queue_, "); retry with backoff"));
    }
    job.enqueued = absl::Now();
    // Small jobs compute here when the engine is idle; any job that is not
    // long itself does beside a long one, sharing the cores with it rather
    // than waiting for all of it.
    const bool beside_long = dispatching_long_ && job.flops < kLongJobFlops;
    if (((job.inline_when_idle && !dispatching_) || beside_long) &&
        threads_held_inline_ < max_inline_ && queue_.empty()) {
      ++threads_held_inline_;
      run_here = true;
    } else {
      ++queued_per_key_[job.batch_key];
      queue_.push_back(std::move(job));
    }
    depth = static_cast<int64_t>(queue_.size());
  }
  if (hooks_.queue_depth) hooks_.queue_depth(depth);
  if (run_here) {
    std::deque<Job> batch;
    batch.push_back(std::move(job));
    Run(batch);
    int held = 1;  // of the engine's threads
    for (int taken = 0;; ++taken) {
      batch.clear();
      {
        absl::MutexLock lock(&mu_);
        // Only a thread computing alone goes on: the last inline one to
        // finish, or the dispatcher, takes whatever is left.
        if (taken == kMaxBatchesAfterInline || threads_held_inline_ > held || dispatching_ ||
            !TakeDueBatch(batch)) {
          threads_held_inline_ -= held;
          break;
        }
        // A batch of small jobs may be large enough for all the engine's
        // threads: while it computes, no other job starts inline.
        held = threads_held_inline_ = max_inline_;
        depth = static_cast<int64_t>(queue_.size());
      }
      if (hooks_.queue_depth) hooks_.queue_depth(depth);
      Run(batch);
    }
  }
  return absl::OkStatus();
}

bool Scheduler::TakeDueBatch(std::deque<Job>& batch) {
  if (stopping_ || queue_.empty() || !queue_.front().inline_when_idle) return false;
  const Job& front = queue_.front();
  if (front.enqueued + front.max_queue_delay > absl::Now()) return false;
  TakeFrontBatch(batch);
  return true;
}

void Scheduler::TakeFrontBatch(std::deque<Job>& batch) {
  const std::string key = queue_.front().batch_key;
  const int64_t limit = std::max<int32_t>(1, queue_.front().max_batch_size);
  for (auto it = queue_.begin();
       it != queue_.end() && static_cast<int64_t>(batch.size()) < limit;) {
    if (it->batch_key == key) {
      batch.push_back(std::move(*it));
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
  if ((queued_per_key_[key] -= static_cast<int64_t>(batch.size())) == 0) {
    queued_per_key_.erase(key);
  }
}

int64_t Scheduler::queue_depth() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(queue_.size());
}

void Scheduler::Loop() {
  // The dispatcher leads the engine's passes: it and its OpenMP team each
  // keep a CPU of their own where the engine binds them (Engine::bound_cpus).
  if (!engine_->bound_cpus().empty() && !engine_->BindThisThread()) {
    spdlog::warn("could not bind the engine's threads to CPUs {} (sched_setaffinity refused?)",
                 absl::StrJoin(engine_->bound_cpus(), ","));
  }
  while (true) {
    std::deque<Job> batch;
    int64_t depth;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](Scheduler* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
            return s->threads_held_inline_ == 0 && (s->stopping_ || !s->queue_.empty());
          },
          this));
      if (queue_.empty()) return;  // stopping, and nothing left to run
      const std::string key = queue_.front().batch_key;
      const int64_t limit = std::max<int32_t>(1, queue_.front().max_batch_size);
      const absl::Time dispatch_by = queue_.front().enqueued + queue_.front().max_queue_delay;
      // Wait for the batch to fill, at most until the oldest job's delay is up.
      struct Full {
        Scheduler* s;
        const std::string* key;
        int64_t limit;
      } full{this, &key, limit};
      const absl::Condition filled(
          +[](Full* f) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return f->s->stopping_ || f->s->queued_per_key_[*f->key] >= f->limit;
          },
          &full);
      // Abseil's timed wait can end a little before absl::Now() reads the
      // deadline (its timer and Now() are different clocks: 0.3 ms early
      // was seen under TSan); the delay is a promise, so wait out the rest.
      while (!mu_.AwaitWithDeadline(filled, dispatch_by) && absl::Now() < dispatch_by) {
      }
      // The front job is the same: nothing else takes from the queue while the
      // dispatcher waits (no inline batch is running, and a queue that is not
      // empty starts none).
      TakeFrontBatch(batch);
      depth = static_cast<int64_t>(queue_.size());
      // Long: a job in it is. A batch of many shorter jobs took its turn
      // fairly; those arriving meanwhile queue and batch as usual.
      dispatching_ = true;
      dispatching_long_ = std::any_of(batch.begin(), batch.end(),
                                      [](const Job& job) { return job.flops >= kLongJobFlops; });
    }
    if (hooks_.queue_depth) hooks_.queue_depth(depth);
    Run(batch);
    absl::MutexLock lock(&mu_);
    dispatching_ = dispatching_long_ = false;
  }
}

// How far before a call's deadline a cancellation counts as the deadline's.
constexpr absl::Duration kDeadlineSlack = absl::Milliseconds(20);

const char* CallOverReason(absl::Time deadline, absl::Time now) {
  return now >= deadline - kDeadlineSlack ? "deadline_exceeded" : "cancelled";
}

namespace {

// Why `job`'s call is over at `now` (CallOverReason), or null while it is
// not. The deadline first: it passes without a cancellation being seen yet.
const char* OverReason(const Job& job, absl::Time now) {
  if (now >= job.deadline) return "deadline_exceeded";
  if (!job.cancelled || !job.cancelled()) return nullptr;
  return CallOverReason(job.deadline, now);
}

bool IsDeadline(const char* reason) { return absl::string_view(reason) == "deadline_exceeded"; }

}  // namespace

void Scheduler::Run(std::deque<Job>& batch) {
  const absl::Time start = absl::Now();
  std::vector<Job*> live;
  std::vector<EngineCall> calls;
  for (Job& job : batch) {
    JobTiming timing;
    timing.queue_us = absl::ToInt64Microseconds(start - job.enqueued);
    timing.queued = true;
    if (const char* reason = OverReason(job, start); reason != nullptr) {
      if (hooks_.not_computed) hooks_.not_computed(reason);
      job.done(
          IsDeadline(reason)
              ? absl::DeadlineExceededError(absl::StrCat("deadline passed after ", timing.queue_us,
                                                         " us in the queue, before compute"))
              : absl::CancelledError("the call was cancelled before compute started"),
          timing);
    } else {
      live.push_back(&job);
      calls.push_back({&job.request->args, job.model ? job.model->layer.get() : nullptr});
      calls.back().session = job.session.get();
    }
  }
  if (calls.empty()) return;
  if (hooks_.batch_size) hooks_.batch_size(static_cast<int32_t>(calls.size()));
  // Polled between work items while a job computes: a caller that left, or
  // whose deadline passed, frees the cores within one work item.
  std::vector<std::function<absl::Status()>> interrupts(live.size());
  for (size_t i = 0; i < live.size(); ++i) {
    interrupts[i] = [job = live[i]]() -> absl::Status {
      const char* reason = OverReason(*job, absl::Now());
      if (reason == nullptr) return absl::OkStatus();
      return IsDeadline(reason) ? absl::DeadlineExceededError(
                                      "deadline passed while the call computed; its work was "
                                      "stopped")
                                : absl::CancelledError(
                                      "the call was cancelled while it computed; its work was "
                                      "stopped");
    };
    calls[i].interrupt = &interrupts[i];
  }
  // The dispatcher is the server's one source of engine work: it computes
  // itself rather than handing each batch to the engine's thread and back.
  std::vector<absl::StatusOr<AttentionResult>> results = engine_->AttendBatchFromThisThread(calls);
  JobTiming timing;
  timing.compute_us = absl::ToInt64Microseconds(absl::Now() - start);
  timing.batch_size = static_cast<int32_t>(calls.size());
  timing.queued = timing.computed = true;
  for (size_t i = 0; i < live.size(); ++i) {
    // The engine answers these codes only for an interrupt.
    if (hooks_.interrupted && absl::IsDeadlineExceeded(results[i].status())) {
      hooks_.interrupted("deadline_exceeded");
    } else if (hooks_.interrupted && absl::IsCancelled(results[i].status())) {
      hooks_.interrupted("cancelled");
    }
    timing.queue_us = absl::ToInt64Microseconds(start - live[i]->enqueued);
    live[i]->done(std::move(results[i]), timing);
  }
}

}  // namespace attention::server
