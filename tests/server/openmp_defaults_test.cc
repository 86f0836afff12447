// ReexecWithOpenMpDefaults, called first in this test's main as in
// attention_server's: libgomp starts with OMP_WAIT_POLICY=PASSIVE, so an
// OpenMP thread that has finished its share of a parallel pass sleeps instead
// of spinning on a core that gRPC's threads need. ctest runs this with
// OMP_WAIT_POLICY unset.

#include <omp.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "server/openmp_defaults.h"

namespace {

// Nanoseconds thread `tid` of this process has run on a CPU (the first field
// of schedstat); -1 if it cannot be read.
int64_t ThreadCpuNanos(pid_t tid) {
  std::ifstream in("/proc/self/task/" + std::to_string(tid) + "/schedstat");
  int64_t nanos = -1;
  in >> nanos;
  return in ? nanos : -1;
}

TEST(OpenMpDefaultsTest, PassiveWaitPolicyIsSet) {
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  ASSERT_NE(policy, nullptr);
  EXPECT_STREQ(policy, "PASSIVE");
}

// The variable alone proves nothing: libgomp reads it in its own constructor. Spinning, libgomp's default, shows as the worker thread using
// the CPU for 1 to 15 ms after the pass; asleep, it uses a few microseconds.
TEST(OpenMpDefaultsTest, WorkerThreadsSleepAfterAParallelPass) {
  constexpr int kPasses = 5;
  constexpr int64_t kMaxIdleCpuNanos = 300'000;
  std::vector<int64_t> idle_cpu_nanos;
  for (int pass = 0; pass < kPasses; ++pass) {
    std::atomic<pid_t> worker{0};
    std::atomic<int> threads{0};
#pragma omp parallel num_threads(2)
    {
      threads = omp_get_num_threads();
      if (omp_get_thread_num() == 1) worker = static_cast<pid_t>(syscall(SYS_gettid));
    }
    ASSERT_EQ(threads.load(), 2) << "the OpenMP runtime gave the pass one thread";
    const int64_t after_pass = ThreadCpuNanos(worker);
    ASSERT_GE(after_pass, 0) << "cannot read the worker thread's schedstat";
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const int64_t later = ThreadCpuNanos(worker);
    ASSERT_GE(later, after_pass);
    idle_cpu_nanos.push_back(later - after_pass);
  }
  std::sort(idle_cpu_nanos.begin(), idle_cpu_nanos.end());
  EXPECT_LT(idle_cpu_nanos[kPasses / 2], kMaxIdleCpuNanos)
      << "median CPU time of the idle worker thread in the 50 ms after a pass; smallest "
      << idle_cpu_nanos.front() << " ns, largest " << idle_cpu_nanos.back() << " ns";
}

}  // namespace

int main(int argc, char** argv) {
  attention::server::ReexecWithOpenMpDefaults(argv);
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
