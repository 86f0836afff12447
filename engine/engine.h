#ifndef ATTENTION_ENGINE_ENGINE_H_
#define ATTENTION_ENGINE_ENGINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/attention.h"
#include "engine/cost.h"

namespace attention {

class MultiheadAttention;
struct SessionCall;

// One call of Engine::AttendBatch: raw attention, or `layer`'s forward.
struct EngineCall {
  const AttentionArgs* args = nullptr;
  const MultiheadAttention* layer = nullptr;
  // Polled while the call computes, between its work items (a block of 64
  // query rows of one head: milliseconds at most), and with an additive
  // score (whose item computes its hidden layer for every key: seconds over
  // a wide one) also within them, per query row of each block of 512 keys;
  // from any compute thread: a non-OK status stops the call's remaining work
  // and becomes its result (a server's CANCELLED when the caller left,
  // DEADLINE_EXCEEDED when its deadline passed). May be null. The reference
  // backend polls it before each block of 64 query rows of each head.
  const std::function<absl::Status()>* interrupt = nullptr;
  // Keys and values kept between calls (engine/kv_cache.h); null: none.
  // Must stay valid, and its caches used by no other call, until the call's
  // result is returned.
  const SessionCall* session = nullptr;
};

enum class Backend {
  kReference,  // plain loops, double accumulation: the oracle
  kOneDnn,     // oneDNN matmuls, fused blocked attention when weights are not needed
};

struct EngineOptions {
  Backend backend = Backend::kOneDnn;
  // Threads one pass of a call may use (an OpenMP team); 0 means one per CPU
  // the process may run on (its affinity mask).
  int threads = 0;
  // Largest element count of any one input tensor; 0 means no limit.
  int64_t max_tensor_elements = int64_t{1} << 28;
  // Largest B*H*L*S of one call that returns its weights (the scores are
  // then held whole); 0 means no limit. Without weights the scores are
  // computed in blocks and never held, so any length passes this limit.
  int64_t max_score_elements = int64_t{1} << 28;
  // Most memory one call may allocate (CallCost::bytes: output, weights,
  // working memory); 0 means no limit.
  int64_t max_request_bytes = int64_t{1} << 30;
  // Most work one call may take (CallCost::flops), so that no single call
  // holds the cores for minutes (2e12 is some 10-20 s here); 0 means no limit.
  double max_request_flops = 2e12;
  // Binds each compute thread to a CPU of its own when the process may run on
  // exactly `threads` CPUs (Engine::bound_cpus): the thread leading a pass to
  // the first, thread t of its OpenMP team to the (t+1)-th. Why, and when it
  // does nothing: engine/thread_binding.h.
  bool bind_threads = true;
};

// RESOURCE_EXHAUSTED for a request over one of the per-request limits, which
// it would pass on no replica at any time (unlike a full queue or memory
// budget): retrying it cannot help, and it says nothing of the server's
// health. `limit` is the limit's server flag ("max_tensor_elements"); the
// status carries it, not the wire: RequestOverLimit reads it back.
absl::Status OverLimitError(absl::string_view limit, absl::string_view message);
// The limit an OverLimitError names; empty for any other status.
std::string RequestOverLimit(const absl::Status& status);

// Computes attention. Thread-safe. Attend and AttendBatch, from any number of
// threads, run one at a time on the engine's worker thread, so their callers
// never oversubscribe the cores. AttendBatchFromThisThread computes on its
// caller's thread instead, and several may run at once: a caller that uses it
// (the server's scheduler) decides what computes beside what. The backend
// locks what its passes share (its caches of oneDNN primitives and buffers).
class Engine {
 public:
  // Starts the compute threads. INVALID_ARGUMENT for inconsistent options.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options);

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  ~Engine();

  // Runs one call. INVALID_ARGUMENT for malformed arguments (the message names
  // the field and the numbers), RESOURCE_EXHAUSTED over the options' limits.
  absl::StatusOr<AttentionResult> Attend(const AttentionArgs& args) const;

  // The checks Attend / AttendBatch make before any work, without the work:
  // the same INVALID_ARGUMENT / RESOURCE_EXHAUSTED errors (a layer call's
  // limits too: its inputs, and the scores and output of the attention
  // between its projections). Masks of a layer call are checked once its
  // projections exist, so only by AttendBatch.
  // Returns the call's cost (engine/cost.h), by which a scheduler can tell a
  // small call from a large one and a server the size of its answer. A layer
  // call is planned to be checked, which copies its 16-bit inputs as float32.
  absl::StatusOr<CallCost> CostOf(const EngineCall& call) const;

  // Runs several calls as one engine call (dynamic batching): they share each
  // pass over the compute threads, while every call is split into work exactly
  // as when it runs alone, so each result is bit-identical to its own Attend /
  // MultiheadAttention::Forward. One result (or error) per call, in order.
  std::vector<absl::StatusOr<AttentionResult>> AttendBatch(
      absl::Span<const EngineCall> calls) const;

  // AttendBatch without the hand-off to the worker thread and back: the
  // calling thread leads the pass, fanning out to up to options().threads
  // OpenMP threads (one, for a small pass). Calls from several threads at once
  // compute at once, each with its own team: for a caller that decides what
  // runs beside what (the server's scheduler), not for concurrent callers.
  std::vector<absl::StatusOr<AttentionResult>> AttendBatchFromThisThread(
      absl::Span<const EngineCall> calls) const;

  const EngineOptions& options() const { return options_; }
  // "reference" or "onednn".
  std::string backend_name() const;
  // The instruction set the backend runs ("avx512_core_bf16", ..., or "generic").
  std::string isa() const;
  // Compute threads in use.
  int threads() const;
  // The CPUs the compute threads are bound to, in team order (the leading
  // thread's first); empty when they are not (EngineOptions::bind_threads).
  const std::vector<int>& bound_cpus() const;
  // Binds the calling thread, which leads passes from now on
  // (AttendBatchFromThisThread, as the server's scheduler does), and the
  // threads of its OpenMP teams to bound_cpus(); a no-op when that is empty.
  // The engine's worker thread binds itself so. Returns whether it bound.
  bool BindThisThread() const;

 private:
  struct Impl;
  // The threads a call's cost counts buffers for: the configured ones, the
  // same for every backend, so that every backend refuses the same calls.
  int CostThreads() const;
  Engine(const EngineOptions& options, std::unique_ptr<Impl> impl);
  std::vector<absl::StatusOr<AttentionResult>> Batch(absl::Span<const EngineCall> calls,
                                                     bool from_this_thread) const;
  EngineOptions options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace attention

#endif  // ATTENTION_ENGINE_ENGINE_H_
