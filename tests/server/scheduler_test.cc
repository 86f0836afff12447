// The scheduler: admission control, dynamic batching, and no compute for a
// caller that has gone.

#include "server/scheduler.h"

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/tensors.h"
#include "engine/thread_binding.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/convert.h"
#include "tests/server/test_server.h"
#include "tests/status_matchers.h"

namespace attention::server {
namespace {

using ::testing::HasSubstr;
using testing::StatusIs;

// A finished job's outcome.
struct Outcome {
  absl::Notification done;
  absl::StatusOr<AttentionResult> result;
  JobTiming timing;
};

class SchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = std::move(Engine::Create({})).value();
    request_.set_id("x");
    *request_.mutable_query() = testing::Ramp({1, 8, 16});
    request_.set_num_heads(2);
  }

  // A job on request_ reporting into `out`.
  Job MakeJob(Outcome* out, int32_t max_batch = 1, absl::Duration delay = absl::ZeroDuration()) {
    Job job;
    job.request = std::move(ToEngineRequest(request_)).value();
    job.batch_key = "k";
    job.max_batch_size = max_batch;
    job.max_queue_delay = delay;
    job.done = [out](absl::StatusOr<AttentionResult> r, const JobTiming& t) {
      out->result = std::move(r);
      out->timing = t;
      out->done.Notify();
    };
    return job;
  }

  // A `done` that reports into `out` and records, in `on`, the thread it ran on.
  static std::function<void(absl::StatusOr<AttentionResult>, const JobTiming&)> Recording(
      Outcome* out, std::thread::id* on) {
    return [out, on](absl::StatusOr<AttentionResult> r, const JobTiming& t) {
      *on = std::this_thread::get_id();
      out->result = std::move(r);
      out->timing = t;
      out->done.Notify();
    };
  }

  // Recording, after first running `meanwhile` while the job still counts as
  // computing (e.g. submitting more jobs from other threads).
  static std::function<void(absl::StatusOr<AttentionResult>, const JobTiming&)> RecordingAfter(
      Outcome* out, std::thread::id* on, std::function<void()> meanwhile) {
    return [record = Recording(out, on), meanwhile = std::move(meanwhile)](
               absl::StatusOr<AttentionResult> r, const JobTiming& t) {
      meanwhile();
      record(std::move(r), t);
    };
  }

  // A small job (inline_when_idle), up to 4 to a batch, reporting into `out`
  // and recording in `on` the thread it ran on.
  Job SmallJob(Outcome* out, std::thread::id* on) {
    Job job = MakeJob(out, /*max_batch=*/4);
    job.inline_when_idle = true;
    job.done = Recording(out, on);
    return job;
  }

  // A job that holds the dispatcher until `release` is notified. The
  // scheduler asks whether a job was cancelled before its compute and again
  // between its work items; the first time holds.
  Job Blocker(Outcome* out, absl::Notification* started, absl::Notification* release) {
    Job job = MakeJob(out);
    auto first = std::make_shared<std::atomic<bool>>(true);
    job.cancelled = [started, release, first] {
      if (first->exchange(false)) {
        started->Notify();
        release->WaitForNotification();
      }
      return false;
    };
    return job;
  }

  // Submits a Blocker of `flops` to `scheduler` and returns once it holds the
  // dispatcher.
  void HoldDispatcher(Scheduler& scheduler, double flops, Outcome* out,
                      absl::Notification* release) {
    absl::Notification started;
    Job job = Blocker(out, &started, release);
    job.flops = flops;
    ASSERT_THAT(scheduler.Submit(std::move(job)), testing::IsOk());
    started.WaitForNotification();
  }

  std::unique_ptr<Engine> engine_;
  v1::AttendRequest request_;
};

TEST_F(SchedulerTest, AFullQueueRefusesWithResourceExhausted) {
  Scheduler scheduler(engine_.get(), /*max_queue=*/2);
  Outcome blocked, a, b, refused;
  absl::Notification started, release;
  ASSERT_THAT(scheduler.Submit(Blocker(&blocked, &started, &release)), testing::IsOk());
  started.WaitForNotification();  // the dispatcher holds it; the queue is empty
  ASSERT_THAT(scheduler.Submit(MakeJob(&a)), testing::IsOk());
  ASSERT_THAT(scheduler.Submit(MakeJob(&b)), testing::IsOk());
  const absl::Status full = scheduler.Submit(MakeJob(&refused));
  EXPECT_THAT(full,
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("queue full: 2 requests")));
  EXPECT_EQ(RequestOverLimit(full), "");  // the load of the moment, not the request
  EXPECT_EQ(scheduler.queue_depth(), 2);
  release.Notify();
  for (Outcome* o : {&blocked, &a, &b}) {
    o->done.WaitForNotification();
    EXPECT_THAT(o->result, testing::IsOk());
  }
  EXPECT_FALSE(refused.done.HasBeenNotified());
}

TEST_F(SchedulerTest, AJobWhoseDeadlinePassesWhileQueuedIsNotComputed) {
  std::atomic<int> not_computed{0};
  SchedulerHooks hooks;
  hooks.not_computed = [&](const char* reason) {
    EXPECT_STREQ(reason, "deadline_exceeded");
    ++not_computed;
  };
  Scheduler scheduler(engine_.get(), 8, hooks);
  Outcome blocked, late;
  absl::Notification started, release;
  ASSERT_THAT(scheduler.Submit(Blocker(&blocked, &started, &release)), testing::IsOk());
  started.WaitForNotification();
  Job job = MakeJob(&late);
  job.deadline = absl::Now() + absl::Milliseconds(1);
  ASSERT_THAT(scheduler.Submit(std::move(job)), testing::IsOk());
  absl::SleepFor(absl::Milliseconds(5));  // let the deadline pass; not a synchronisation
  release.Notify();
  late.done.WaitForNotification();
  EXPECT_THAT(late.result,
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("in the queue")));
  EXPECT_EQ(not_computed, 1);
  // The metrics count its wait, and no compute.
  EXPECT_TRUE(late.timing.queued);
  EXPECT_FALSE(late.timing.computed);
}

TEST_F(SchedulerTest, AJobWhoseCallerLeftIsNotComputed) {
  Scheduler scheduler(engine_.get(), 8);
  Outcome gone;
  Job job = MakeJob(&gone);
  job.cancelled = [] { return true; };
  ASSERT_THAT(scheduler.Submit(std::move(job)), testing::IsOk());
  gone.done.WaitForNotification();
  EXPECT_THAT(gone.result, StatusIs(absl::StatusCode::kCancelled, HasSubstr("before compute")));
}

TEST_F(SchedulerTest, QueuedJobsOfOneKeyShareAnEngineCallWithUnbatchedResults) {
  Outcome alone;
  {
    Scheduler scheduler(engine_.get(), 8);
    ASSERT_THAT(scheduler.Submit(MakeJob(&alone)), testing::IsOk());
    alone.done.WaitForNotification();
  }
  ASSERT_THAT(alone.result, testing::IsOk());
  EXPECT_EQ(alone.timing.batch_size, 1);
  EXPECT_TRUE(alone.timing.queued && alone.timing.computed);

  std::vector<int32_t> batch_sizes;
  SchedulerHooks hooks;
  hooks.batch_size = [&](int32_t size) { batch_sizes.push_back(size); };
  Scheduler scheduler(engine_.get(), 16, hooks);
  Outcome blocked;
  absl::Notification started, release;
  ASSERT_THAT(scheduler.Submit(Blocker(&blocked, &started, &release)), testing::IsOk());
  started.WaitForNotification();
  std::vector<Outcome> outcomes(6);
  for (Outcome& o : outcomes) {
    ASSERT_THAT(scheduler.Submit(MakeJob(&o, /*max_batch=*/4, absl::Milliseconds(50))),
                testing::IsOk());
  }
  release.Notify();
  for (Outcome& o : outcomes) {
    o.done.WaitForNotification();
    ASSERT_THAT(o.result, testing::IsOk());
    EXPECT_EQ(o.result->output.data, alone.result->output.data);  // bit for bit
  }
  // The blocker alone, then a full batch of 4 at once, then the last 2 after their delay.
  EXPECT_THAT(batch_sizes, ::testing::ElementsAre(1, 4, 2));
  EXPECT_EQ(outcomes[0].timing.batch_size, 4);
  EXPECT_EQ(outcomes[5].timing.batch_size, 2);
}

TEST_F(SchedulerTest, AnIdleSchedulerComputesASmallJobOnTheSubmittingThread) {
  Scheduler scheduler(engine_.get(), 8);
  Outcome out;
  std::thread::id ran_on;
  Job job = MakeJob(&out);
  job.inline_when_idle = true;
  job.done = Recording(&out, &ran_on);
  ASSERT_THAT(scheduler.Submit(std::move(job)), testing::IsOk());
  ASSERT_TRUE(out.done.HasBeenNotified());  // answered before Submit returned
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_THAT(out.result, testing::IsOk());
  EXPECT_EQ(out.timing.batch_size, 1);
}

TEST_F(SchedulerTest, TheDispatcherKeepsTheEnginesFirstBoundCpu) {
  // An engine of one thread per CPU this process may run on: bound where
  // that is two or more (and OMP_THREAD_LIMIT allows as many).
  const std::vector<int> allowed = internal::AllowedCpus();
  EngineOptions options;
  options.threads = static_cast<int>(allowed.size());
  std::unique_ptr<Engine> engine = std::move(Engine::Create(options)).value();
  const bool binds = allowed.size() > 1 && engine->threads() == options.threads;
  ASSERT_EQ(engine->bound_cpus(), binds ? allowed : std::vector<int>{});
  Scheduler scheduler(engine.get(), 8);
  Outcome out;
  std::vector<int> dispatcher_cpus;
  Job job = MakeJob(&out);  // queued: the dispatcher computes it and answers
  job.done = [&out, &dispatcher_cpus](absl::StatusOr<AttentionResult> r, const JobTiming&) {
    dispatcher_cpus = internal::AllowedCpus();
    out.result = std::move(r);
    out.done.Notify();
  };
  ASSERT_THAT(scheduler.Submit(std::move(job)), testing::IsOk());
  out.done.WaitForNotification();
  EXPECT_THAT(out.result, testing::IsOk());
  EXPECT_EQ(dispatcher_cpus, binds ? std::vector<int>{allowed.front()} : allowed);
  // The submitting thread is left alone.
  EXPECT_EQ(internal::AllowedCpus(), allowed);
}

TEST_F(SchedulerTest, ASmallJobWaitsItsTurnWhileTheEngineIsBusy) {
  Scheduler scheduler(engine_.get(), 8);
  Outcome blocked, small;
  absl::Notification started, release;
  ASSERT_THAT(scheduler.Submit(Blocker(&blocked, &started, &release)), testing::IsOk());
  started.WaitForNotification();
  Job job = MakeJob(&small);
  job.inline_when_idle = true;
  ASSERT_THAT(scheduler.Submit(std::move(job)), testing::IsOk());
  EXPECT_FALSE(small.done.HasBeenNotified());  // queued behind the running batch
  EXPECT_EQ(scheduler.queue_depth(), 1);
  release.Notify();
  small.done.WaitForNotification();
  EXPECT_THAT(small.result, testing::IsOk());
}

TEST_F(SchedulerTest, ASmallJobComputesInlineBesideALongBatch) {
  // Regression: a small call waited for the whole of a long one (an additive
  // score of seconds) because small jobs never computed beside the dispatcher.
  Scheduler scheduler(engine_.get(), 8);
  Outcome blocked, small;
  absl::Notification release;
  HoldDispatcher(scheduler, 1e12, &blocked, &release);
  std::thread::id ran_on;
  Job job = MakeJob(&small);
  job.inline_when_idle = true;
  job.done = Recording(&small, &ran_on);
  ASSERT_THAT(scheduler.Submit(std::move(job)), testing::IsOk());
  EXPECT_TRUE(small.done.HasBeenNotified());  // answered while the long batch computes
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_THAT(small.result, testing::IsOk());
  EXPECT_FALSE(blocked.done.HasBeenNotified());
  release.Notify();
  blocked.done.WaitForNotification();
  EXPECT_THAT(blocked.result, testing::IsOk());
}

TEST_F(SchedulerTest, AJobShorterThanALongBatchComputesBesideIt) {
  Scheduler scheduler(engine_.get(), 8);
  Outcome blocked, medium;
  absl::Notification release;
  HoldDispatcher(scheduler, 1e12, &blocked, &release);
  std::thread::id ran_on;
  Job job = MakeJob(&medium);  // not inline_when_idle: too large to compute inline when idle
  job.flops = 1e8;
  job.done = Recording(&medium, &ran_on);
  ASSERT_THAT(scheduler.Submit(std::move(job)), testing::IsOk());
  EXPECT_TRUE(medium.done.HasBeenNotified());
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  // A job as long as the batch waits its turn.
  Outcome other_long;
  Job second = MakeJob(&other_long);
  second.flops = 1e12;
  ASSERT_THAT(scheduler.Submit(std::move(second)), testing::IsOk());
  EXPECT_FALSE(other_long.done.HasBeenNotified());
  release.Notify();
  other_long.done.WaitForNotification();
  EXPECT_THAT(other_long.result, testing::IsOk());
}

TEST_F(SchedulerTest, AJobWaitsForABatchWithoutALongJob) {
  // Many short jobs batched together are not one long call: what arrives
  // meanwhile queues, and batches, as usual.
  Scheduler scheduler(engine_.get(), 8);
  Outcome blocked, medium;
  absl::Notification release;
  HoldDispatcher(scheduler, 1.5e9, &blocked, &release);
  Job job = MakeJob(&medium);
  job.flops = 1e8;
  ASSERT_THAT(scheduler.Submit(std::move(job)), testing::IsOk());
  EXPECT_FALSE(medium.done.HasBeenNotified());
  EXPECT_EQ(scheduler.queue_depth(), 1);
  release.Notify();
  medium.done.WaitForNotification();
  EXPECT_THAT(medium.result, testing::IsOk());
}

// Submits `job` from another thread and returns once Submit has: called
// from a running job's `done`, it queues the job behind that one.
void SubmitFromAnotherThread(Scheduler& scheduler, Job job) {
  std::thread([&] { ASSERT_THAT(scheduler.Submit(std::move(job)), testing::IsOk()); }).join();
}

TEST_F(SchedulerTest, JobsThatQueuedBehindAnInlineJobRunOnItsThreadAsOneBatch) {
  Scheduler scheduler(engine_.get(), 8, {}, /*max_inline=*/1);
  Outcome first, later_a, later_b;
  std::thread::id first_on, a_on, b_on;
  Job a = SmallJob(&later_a, &a_on);
  Job b = SmallJob(&later_b, &b_on);
  Job job = SmallJob(&first, &first_on);
  // While the first job is still computing (its answer is being given), two
  // more arrive from other threads and queue.
  job.done = RecordingAfter(&first, &first_on, [&] {
    SubmitFromAnotherThread(scheduler, std::move(a));
    SubmitFromAnotherThread(scheduler, std::move(b));
  });
  ASSERT_THAT(scheduler.Submit(std::move(job)), testing::IsOk());
  // Submit returned after answering all three: its thread took the two queued
  // jobs, due at once (no delay), in one batch, instead of waking the dispatcher.
  ASSERT_TRUE(later_a.done.HasBeenNotified());
  ASSERT_TRUE(later_b.done.HasBeenNotified());
  EXPECT_EQ(first_on, std::this_thread::get_id());
  EXPECT_EQ(a_on, std::this_thread::get_id());
  EXPECT_EQ(b_on, std::this_thread::get_id());
  EXPECT_THAT(later_a.result, testing::IsOk());
  EXPECT_EQ(later_a.timing.batch_size, 2);
  EXPECT_EQ(later_b.timing.batch_size, 2);
  EXPECT_EQ(scheduler.queue_depth(), 0);
}

TEST_F(SchedulerTest, AnInlineJobLeavesLargeOrNotYetDueJobsToTheDispatcher) {
  Scheduler scheduler(engine_.get(), 8, {}, /*max_inline=*/1);
  Outcome first, large, delayed, second;
  std::thread::id first_on, large_on, delayed_on, second_on;
  // An inline job whose `done` first submits `next` from another thread.
  auto submitting = [&](Outcome* out, std::thread::id* on, Job& next) {
    Job job = MakeJob(out);
    job.inline_when_idle = true;
    job.done = RecordingAfter(
        out, on, [&scheduler, &next] { SubmitFromAnotherThread(scheduler, std::move(next)); });
    return job;
  };
  Job big = MakeJob(&large);  // not inline_when_idle: too much work for a gRPC thread
  big.done = Recording(&large, &large_on);
  Job job = submitting(&first, &first_on, big);
  ASSERT_THAT(scheduler.Submit(std::move(job)), testing::IsOk());
  large.done.WaitForNotification();
  EXPECT_NE(large_on, std::this_thread::get_id());
  EXPECT_THAT(large.result, testing::IsOk());

  // A small job whose batching delay is not up yet waits for it on the
  // dispatcher too. This thread takes due jobs inline once `again` is done,
  // a few statements after `wait` is queued: the delay is long enough that it
  // cannot find `wait` due first unless it stalls for a second there.
  Job wait = MakeJob(&delayed, /*max_batch=*/4, absl::Seconds(1));
  wait.inline_when_idle = true;
  wait.done = Recording(&delayed, &delayed_on);
  Job again = submitting(&second, &second_on, wait);
  ASSERT_THAT(scheduler.Submit(std::move(again)), testing::IsOk());
  delayed.done.WaitForNotification();
  EXPECT_NE(delayed_on, std::this_thread::get_id());
  EXPECT_THAT(delayed.result, testing::IsOk());
  EXPECT_GE(delayed.timing.queue_us, 1000000);
}

TEST_F(SchedulerTest, SmallJobsComputeInlineSideBySideUpToMaxInline) {
  Scheduler scheduler(engine_.get(), 8, {}, /*max_inline=*/2);
  Outcome first, second;
  std::thread::id first_on, second_on, second_submitted_on;
  Job next = SmallJob(&second, &second_on);
  Job job = SmallJob(&first, &first_on);
  // While the first computes (its answer is being given), a second arrives on
  // another thread: with a thread of the engine free, it computes there at
  // once, before its Submit returns.
  job.done = RecordingAfter(&first, &first_on, [&] {
    std::thread([&] {
      second_submitted_on = std::this_thread::get_id();
      ASSERT_THAT(scheduler.Submit(std::move(next)), testing::IsOk());
      EXPECT_TRUE(second.done.HasBeenNotified());
    }).join();
  });
  ASSERT_THAT(scheduler.Submit(std::move(job)), testing::IsOk());
  ASSERT_TRUE(second.done.HasBeenNotified());
  EXPECT_EQ(first_on, std::this_thread::get_id());
  EXPECT_EQ(second_on, second_submitted_on);
  EXPECT_THAT(second.result, testing::IsOk());
  EXPECT_EQ(second.timing.batch_size, 1);
}

TEST_F(SchedulerTest, BeyondMaxInlineSmallJobsQueueForTheLastInlineThreadToFinish) {
  Scheduler scheduler(engine_.get(), 8, {}, /*max_inline=*/2);
  Outcome a, b, c, d;
  std::thread::id a_on, b_on, c_on, d_on;
  Job job_d = SmallJob(&d, &d_on);
  Job job_c = SmallJob(&c, &c_on);
  // c computes as a batch taken from the queue, which may need all the
  // engine's threads: d, arriving meanwhile, queues although a thread is free.
  job_c.done = RecordingAfter(&c, &c_on, [&] {
    SubmitFromAnotherThread(scheduler, std::move(job_d));
    EXPECT_FALSE(d.done.HasBeenNotified());
  });
  Job job_b = SmallJob(&b, &b_on);
  // b computes inline beside a; c, arriving while both do, queues, and b,
  // finishing first, leaves it to a.
  job_b.done = RecordingAfter(&b, &b_on, [&] {
    SubmitFromAnotherThread(scheduler, std::move(job_c));
    EXPECT_FALSE(c.done.HasBeenNotified());
    EXPECT_EQ(scheduler.queue_depth(), 1);
  });
  Job job_a = SmallJob(&a, &a_on);
  job_a.done = RecordingAfter(&a, &a_on, [&] {
    SubmitFromAnotherThread(scheduler, std::move(job_b));
    EXPECT_TRUE(b.done.HasBeenNotified());
    EXPECT_FALSE(c.done.HasBeenNotified());
  });
  ASSERT_THAT(scheduler.Submit(std::move(job_a)), testing::IsOk());
  // a's thread, alone once b was done, took c and then d.
  ASSERT_TRUE(c.done.HasBeenNotified());
  ASSERT_TRUE(d.done.HasBeenNotified());
  EXPECT_NE(b_on, std::this_thread::get_id());
  EXPECT_EQ(c_on, std::this_thread::get_id());
  EXPECT_EQ(d_on, std::this_thread::get_id());
  for (Outcome* o : {&a, &b, &c, &d}) EXPECT_THAT(o->result, testing::IsOk());
  EXPECT_EQ(scheduler.queue_depth(), 0);
}

}  // namespace
}  // namespace attention::server
