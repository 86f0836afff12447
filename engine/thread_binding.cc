#include "engine/thread_binding.h"

#include <omp.h>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#include <atomic>

namespace attention::internal {

std::vector<int> AllowedCpus() {
  std::vector<int> cpus;
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
#endif
  return cpus;
}

std::vector<int> CpusToBind(const std::vector<int>& allowed, int threads) {
  if (threads < 2 || static_cast<int>(allowed.size()) != threads) return {};
  return allowed;
}

namespace {

bool BindThisThreadTo(int cpu) {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0;
#else
  (void)cpu;
  return false;
#endif
}

}  // namespace

bool BindTeamOfThisThread(const std::vector<int>& cpus) {
  const int n = static_cast<int>(cpus.size());
  if (n < 2) return false;
  std::atomic<int> bound{0};
  omp_set_dynamic(0);  // all n threads, as the engine's own passes ask
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
    if (omp_get_num_threads() == n && BindThisThreadTo(cpus[t])) {
      bound.fetch_add(1, std::memory_order_relaxed);
    }
  }
  return bound.load() == n;
}

}  // namespace attention::internal
