// The scheduler: admission control, dynamic batching, and no compute for a
// caller that has gone.

#include "server/scheduler.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/tensors.h"
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

  // A job that holds the dispatcher until `release` is notified.
  Job Blocker(Outcome* out, absl::Notification* started, absl::Notification* release) {
    Job job = MakeJob(out);
    job.cancelled = [started, release] {
      started->Notify();
      release->WaitForNotification();
      return false;
    };
    return job;
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
  EXPECT_THAT(scheduler.Submit(MakeJob(&refused)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("queue full: 2 requests")));
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
  EXPECT_THAT(late.result, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("in the queue")));
  EXPECT_EQ(not_computed, 1);
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
  job.done = [&](absl::StatusOr<AttentionResult> r, const JobTiming& t) {
    ran_on = std::this_thread::get_id();
    out.result = std::move(r);
    out.timing = t;
    out.done.Notify();
  };
  ASSERT_THAT(scheduler.Submit(std::move(job)), testing::IsOk());
  ASSERT_TRUE(out.done.HasBeenNotified());  // answered before Submit returned
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_THAT(out.result, testing::IsOk());
  EXPECT_EQ(out.timing.batch_size, 1);
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

}  // namespace
}  // namespace attention::server
