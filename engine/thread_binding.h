#ifndef ATTENTION_ENGINE_THREAD_BINDING_H_
#define ATTENTION_ENGINE_THREAD_BINDING_H_

// Binding the engine's compute threads to CPUs (EngineOptions::bind_threads).
// Internal to the engine.
//
// Why: on a VM whose CPUs share no cache as far as Linux can tell (no cache
// topology), Linux often wakes a sleeping OpenMP thread on the CPU of the
// thread that wakes it, beside it, while another CPU idles, and the pass runs
// at one thread's speed: nearly half the decode passes of a server whose
// caller paused a few milliseconds between steps (docs/decode-log.md,
// 2026-12-05 (afternoon)). Bound, each thread wakes on its own CPU.

#include <vector>

namespace attention::internal {

// The CPUs the calling thread may run on (its affinity mask: the process's
// for a thread nothing bound), ascending; empty where that cannot be read.
std::vector<int> AllowedCpus();

// The CPUs to bind `threads` compute threads to, one each, in team order:
// `allowed` when it has exactly `threads` CPUs and `threads` > 1 (the
// process has them to itself, as a pod granted whole CPUs or a VM sized to
// the engine), else none: with more CPUs than threads the OS places them
// better, and pinning every replica of a shared node to its first CPUs
// would stack them there.
std::vector<int> CpusToBind(const std::vector<int>& allowed, int threads);

// Binds the calling thread to cpus[0] and, through one OpenMP pass of
// cpus.size() threads, thread t of the teams the calling thread leads to
// cpus[t] (libgomp keeps a leading thread's team threads from pass to pass,
// in the same order). False, with whatever was bound left bound, when a
// binding failed or the pass had fewer threads. A no-op returning false for
// fewer than two CPUs.
bool BindTeamOfThisThread(const std::vector<int>& cpus);

}  // namespace attention::internal

#endif  // ATTENTION_ENGINE_THREAD_BINDING_H_
