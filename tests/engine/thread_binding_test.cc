// EngineOptions::bind_threads: which CPUs the engine binds its compute
// threads to, and that a leading thread's OpenMP teams keep the binding;
// and how many threads the engine takes by default.

#include "engine/thread_binding.h"

#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <memory>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attention::internal {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

TEST(ThreadBindingTest, BindsOnlyWhenTheProcessHasExactlyTheThreadsCpus) {
  EXPECT_THAT(CpusToBind({0, 1}, 2), ElementsAre(0, 1));
  EXPECT_THAT(CpusToBind({3, 7, 9}, 3), ElementsAre(3, 7, 9));
  EXPECT_THAT(CpusToBind({0, 1, 2, 3}, 2), IsEmpty());  // a share of a larger machine
  EXPECT_THAT(CpusToBind({0, 1}, 4), IsEmpty());        // more threads than CPUs
  EXPECT_THAT(CpusToBind({5}, 1), IsEmpty());           // one thread: nothing to keep apart
  EXPECT_THAT(CpusToBind({}, 2), IsEmpty());            // the mask could not be read
}

TEST(ThreadBindingTest, TheLeaderAndEachTeamThreadKeepTheirCpu) {
  const std::vector<int> allowed = AllowedCpus();  // this thread's, unbound
  ASSERT_FALSE(allowed.empty());
  // Two CPUs this process may use (the same one twice on a one-CPU host).
  const std::vector<int> cpus = {allowed.front(), allowed.back()};
  // On a thread of its own, whose binding ends with it.
  std::vector<std::vector<int>> seen(2);
  bool bound = false;
  std::vector<int> leader;
  std::thread([&] {
    bound = BindTeamOfThisThread(cpus);
    leader = AllowedCpus();
    // Later passes of this leader's teams: libgomp keeps their threads.
    for (int pass = 0; pass < 3; ++pass) {
#pragma omp parallel num_threads(2)
      {
        const int t = omp_get_thread_num();
        if (omp_get_num_threads() == 2) seen[t] = AllowedCpus();
      }
    }
  }).join();
  if (omp_get_thread_limit() < 2) {  // OMP_THREAD_LIMIT=1: a team of one
    EXPECT_FALSE(bound);
    return;
  }
  ASSERT_TRUE(bound);
  EXPECT_THAT(leader, ElementsAre(cpus[0]));
  EXPECT_THAT(seen[0], ElementsAre(cpus[0]));
  EXPECT_THAT(seen[1], ElementsAre(cpus[1]));
  // This thread's own binding is untouched.
  EXPECT_EQ(AllowedCpus(), allowed);
}

TEST(ThreadBindingTest, OneCpuIsNothingToBind) {
  const std::vector<int> before = AllowedCpus();
  EXPECT_FALSE(BindTeamOfThisThread({}));
  EXPECT_FALSE(BindTeamOfThisThread({before.front()}));
  EXPECT_EQ(AllowedCpus(), before);
}

TEST(ThreadBindingTest, TheEngineBindsWhenItsThreadsAreTheProcessCpus) {
  const std::vector<int> allowed = AllowedCpus();
  const int n = static_cast<int>(allowed.size());
  EngineOptions options;
  options.threads = n;
  std::unique_ptr<Engine> engine = std::move(Engine::Create(options)).value();
  // (Fewer threads under OMP_THREAD_LIMIT: then none.)
  EXPECT_EQ(engine->bound_cpus(), n > 1 && engine->threads() == n ? allowed : std::vector<int>{});
  // More threads than CPUs, or binding turned off: none.
  options.threads = n + 1;
  EXPECT_THAT(std::move(Engine::Create(options)).value()->bound_cpus(), IsEmpty());
  options.threads = n;
  options.bind_threads = false;
  std::unique_ptr<Engine> unbound = std::move(Engine::Create(options)).value();
  EXPECT_THAT(unbound->bound_cpus(), IsEmpty());
  // Which makes BindThisThread a no-op.
  const std::vector<int> before = AllowedCpus();
  EXPECT_FALSE(unbound->BindThisThread());
  EXPECT_EQ(AllowedCpus(), before);
}

TEST(ThreadBindingTest, DefaultThreadsAreOnePerCpuTheProcessMayRunOn) {
  const std::vector<int> allowed = AllowedCpus();
  ASSERT_FALSE(allowed.empty());
  // As under `taskset -c CPU`: one CPU allowed, however many are online.
  int threads = 0;
  std::vector<int> bound = {-1};
  std::thread([&] {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(allowed.back(), &one);
    ASSERT_EQ(pthread_setaffinity_np(pthread_self(), sizeof one, &one), 0);
    std::unique_ptr<Engine> engine = std::move(Engine::Create({})).value();
    threads = engine->threads();
    bound = engine->bound_cpus();
  }).join();
  EXPECT_EQ(threads, 1);
  EXPECT_THAT(bound, IsEmpty());
}

}  // namespace
}  // namespace attention::internal
