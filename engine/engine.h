#ifndef ATTENTION_ENGINE_ENGINE_H_
#define ATTENTION_ENGINE_ENGINE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/attention.h"

namespace attention {

enum class Backend { kReference };

struct EngineOptions {
  Backend backend = Backend::kReference;
  // Largest element count of any one input tensor; 0 means no limit.
  int64_t max_tensor_elements = int64_t{1} << 28;
  // Largest B*H*L*S of one call; 0 means no limit.
  int64_t max_score_elements = int64_t{1} << 28;
};

// Computes attention. Thread-safe: Attend may be called from many threads.
class Engine {
 public:
  // Returns INVALID_ARGUMENT for inconsistent options.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options);

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  ~Engine();

  // Runs one call. INVALID_ARGUMENT for malformed arguments (the message names
  // the field and the numbers), RESOURCE_EXHAUSTED over the options' limits.
  absl::StatusOr<AttentionResult> Attend(const AttentionArgs& args) const;

  const EngineOptions& options() const { return options_; }
  // "reference", ...
  std::string backend_name() const;

 private:
  explicit Engine(const EngineOptions& options) : options_(options) {}
  EngineOptions options_;
};

}  // namespace attention

#endif  // ATTENTION_ENGINE_ENGINE_H_
