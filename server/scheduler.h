#ifndef ATTENTION_SERVER_SCHEDULER_H_
#define ATTENTION_SERVER_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/engine.h"
#include "engine/kv_cache.h"
#include "server/convert.h"
#include "server/model_repository.h"

namespace attention::server {

using JobTiming = JobTimingFields;

// Why a call found over at `now` ended: "deadline_exceeded" from shortly
// before its deadline on (gRPC's own timer cancels a call whose deadline
// passed, and can fire a little before the deadline reads as passed here),
// else "cancelled" (its caller cancelled).
const char* CallOverReason(absl::Time deadline, absl::Time now);

// One admitted request.
struct Job {
  std::unique_ptr<EngineRequest> request;
  const Model* model = nullptr;  // null: raw attention
  // The sessions it appends to and attends over (engine/kv_cache.h); null: none.
  std::shared_ptr<SessionCall> session;
  // Jobs with equal keys may share an engine call.
  std::string batch_key;
  int32_t max_batch_size = 1;
  absl::Duration max_queue_delay;
  // A small job (tens of microseconds of compute, on one thread): when
  // nothing is queued, the dispatcher is not computing and fewer small jobs
  // than the engine has threads are computing, Submit computes it on the
  // calling thread. That saves the two thread hand-offs to the dispatcher and
  // back, which would cost more than its compute.
  bool inline_when_idle = false;
  // Its compute (CallCost::flops).
  double flops = 0;
  absl::Time deadline = absl::InfiniteFuture();
  // True once the caller is gone; may be empty.
  std::function<bool()> cancelled;
  // Called exactly once, on the scheduler's thread (or in a Submit, see
  // inline_when_idle): the result, or
  // CANCELLED / DEADLINE_EXCEEDED when the caller left before compute began.
  std::function<void(absl::StatusOr<AttentionResult>, const JobTiming&)> done;

  absl::Time enqueued;  // set by Submit
};

// What the scheduler reports as it goes (for metrics); any may be empty.
struct SchedulerHooks {
  std::function<void(int64_t depth)> queue_depth;
  std::function<void(int32_t size)> batch_size;
  std::function<void(const char* reason)> not_computed;  // "cancelled", "deadline_exceeded"
  // A job whose compute was stopped part way (Job::cancelled, Job::deadline).
  std::function<void(const char* reason)> interrupted;  // "cancelled", "deadline_exceeded"
};

// Dynamic batching with admission control: a bounded FIFO of jobs and one
// dispatcher thread that packs jobs of the same batch key into one engine
// call, which it computes itself (Engine::AttendBatchFromThisThread: the
// dispatcher owns the cores), up to the job's max_batch_size, waiting at most
// its max_queue_delay for others to join. Jobs whose caller left or whose
// deadline passed are answered without compute. The dispatcher's batches
// compute on all the engine's threads. Small (inline_when_idle) jobs compute
// on the threads that submit them, several at once (each on one thread). While
// the dispatcher computes a long job (kLongJobFlops or more), every job
// that is not long itself computes on its submitting thread too, beside it:
// the cores are shared between them, so a call of milliseconds never waits
// seconds behind another's. Thread-safe.
class Scheduler {
 public:
  // `engine` must outlive the scheduler. Starts the dispatcher thread. At most
  // `max_inline` small jobs compute inline at once; 0 means one per engine
  // thread.
  Scheduler(const Engine* engine, int64_t max_queue, SchedulerHooks hooks = {}, int max_inline = 0);
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;
  // Runs every job still queued, then stops.
  ~Scheduler();

  // Queues `job`, or computes it before returning (inline_when_idle).
  // RESOURCE_EXHAUSTED (with the numbers) when the queue is full; `done` is
  // then never called.
  absl::Status Submit(Job job);

  int64_t queue_depth() const;

 private:
  void Loop();
  void Run(std::deque<Job>& batch);
  // After an inline job, its thread goes on with up to this many batches that
  // are already due, rather than waking the dispatcher for them, as long as
  // no other inline job is computing (a batch of small jobs may be large).
  static constexpr int kMaxBatchesAfterInline = 4;
  // A job of at least this much work (some 10 ms on this machine's cores) is
  // long: while the dispatcher computes one, shorter jobs compute on their own
  // threads beside it, as what they take from it costs it less than they
  // would wait.
  static constexpr double kLongJobFlops = 2e9;
  // Moves the batch of the queue's front job into `batch` when it is small
  // (inline_when_idle) and its delay is up; false, taking nothing, otherwise.
  bool TakeDueBatch(std::deque<Job>& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the queue's front job and the next queued jobs of its batch_key, up
  // to its max_batch_size, into `batch`. The queue must not be empty.
  void TakeFrontBatch(std::deque<Job>& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Engine* const engine_;
  const int64_t max_queue_;
  const int max_inline_;
  const SchedulerHooks hooks_;

  mutable absl::Mutex mu_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> queued_per_key_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Engine threads held by batches computing in Submit: one for a small job,
  // all of them (max_inline_) for a batch of queued jobs.
  int threads_held_inline_ ABSL_GUARDED_BY(mu_) = 0;
  bool dispatching_ ABSL_GUARDED_BY(mu_) = false;       // the dispatcher is computing
  bool dispatching_long_ ABSL_GUARDED_BY(mu_) = false;  // ... a batch with a long job
  std::thread dispatcher_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_SCHEDULER_H_
