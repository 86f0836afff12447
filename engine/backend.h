#ifndef ATTENTION_ENGINE_BACKEND_H_
#define ATTENTION_ENGINE_BACKEND_H_

// The interface the engine's compute thread drives. Engine-private.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/attention.h"

namespace attention::internal {

class ComputeBackend {
 public:
  virtual ~ComputeBackend() = default;
  // Runs one validated call; `shape` comes from ResolveShape(args). Called
  // from the engine's compute thread only, so implementations may keep
  // unsynchronised caches.
  virtual absl::StatusOr<AttentionResult> Run(const AttentionArgs& args,
                                              const AttentionShape& shape) = 0;
  virtual std::string name() const = 0;
  virtual std::string isa() const = 0;
};

std::unique_ptr<ComputeBackend> MakeReferenceBackend();
// `threads` OpenMP threads per call. INTERNAL when oneDNN cannot start.
absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeOneDnnBackend(int threads);

}  // namespace attention::internal

#endif  // ATTENTION_ENGINE_BACKEND_H_
