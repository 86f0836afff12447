#ifndef ATTENTION_ENGINE_BACKEND_H_
#define ATTENTION_ENGINE_BACKEND_H_

// The interface the engine's compute thread drives. Engine-private.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/attention.h"

namespace attention::internal {

// One validated attention call.
struct BackendCall {
  const AttentionArgs* args = nullptr;
  AttentionShape shape;  // from ResolveShape(*args)
  const std::function<absl::Status()>* interrupt = nullptr;  // EngineCall::interrupt
};

// y[rows x out] = x[rows x in] w^T + bias: torch's Linear, w is [out, in].
struct LinearJob {
  const float* x = nullptr;
  int64_t rows = 0, in = 0;
  const float* w = nullptr;
  const float* bias = nullptr;  // may be null
  int64_t out = 0;
  float* y = nullptr;
};

// Work is split the same way whether a call runs alone or in a batch, so a
// call's result never depends on what it was batched with.
class ComputeBackend {
 public:
  virtual ~ComputeBackend() = default;
  // Runs every call in one pass over the compute threads; one result per call.
  // Called from several threads at once (Engine::AttendBatchFromThisThread), so
  // what passes share (caches of primitives and buffers) must be locked.
  virtual std::vector<absl::StatusOr<AttentionResult>> RunBatch(
      absl::Span<const BackendCall> calls) = 0;
  // Runs every job in one pass over the compute threads.
  virtual absl::Status LinearBatch(absl::Span<const LinearJob> jobs) = 0;
  virtual std::string name() const = 0;
  virtual std::string isa() const = 0;
  // Threads a pass may use.
  virtual int threads() const = 0;
};

std::unique_ptr<ComputeBackend> MakeReferenceBackend();
// Up to `threads` OpenMP threads per call (fewer under OMP_THREAD_LIMIT).
// INTERNAL when oneDNN cannot start.
absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeOneDnnBackend(int threads);

}  // namespace attention::internal

#endif  // ATTENTION_ENGINE_BACKEND_H_
