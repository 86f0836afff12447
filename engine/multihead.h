#ifndef ATTENTION_ENGINE_MULTIHEAD_H_
#define ATTENTION_ENGINE_MULTIHEAD_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/attention.h"
#include "engine/engine.h"

namespace attention {

// The constructor arguments of torch.nn.MultiheadAttention, plus the score the
// layer uses between its projections (torch's is scaled_dot).
struct MultiheadConfig {
  int64_t embed_dim = 0;
  int64_t num_heads = 0;
  int64_t kdim = 0;  // 0 means embed_dim
  int64_t vdim = 0;  // 0 means embed_dim
  bool bias = true;
  bool add_bias_kv = false;
  bool add_zero_attn = false;
  // Only parameter-free kinds (no w_q / w_k / w_v / w); bandwidth for kGaussian.
  ScoreSpec score;

  // The last dims of key and value: kdim and vdim, or embed_dim when 0.
  int64_t key_dim() const { return kdim > 0 ? kdim : embed_dim; }
  int64_t value_dim() const { return vdim > 0 ? vdim : embed_dim; }
};

// torch state_dict entries by torch's key name ("in_proj_weight", "out_proj.bias", ...).
using StateDict = std::map<std::string, Tensor>;

// A torch.nn.MultiheadAttention layer with fixed weights. Immutable after
// Create, so Forward is thread-safe.
class MultiheadAttention {
 public:
  // The state_dict keys and shapes torch uses for `config` (packed
  // in_proj_weight when kdim == vdim == embed_dim, q/k/v_proj_weight otherwise).
  static std::vector<std::pair<std::string, std::vector<int64_t>>> ExpectedWeights(
      const MultiheadConfig& config);

  // INVALID_ARGUMENT for an inconsistent config: dims below 1 or above
  // 2^31 - 1, heads that do not divide embed_dim, a score with parameters,
  // a non-finite scale or bandwidth, a bandwidth for a score other than
  // GAUSSIAN.
  static absl::Status CheckConfig(const MultiheadConfig& config);

  // Takes the weights. CheckConfig's errors, or INVALID_ARGUMENT naming the
  // key and shapes for a missing, extra or wrongly shaped entry.
  static absl::StatusOr<std::unique_ptr<MultiheadAttention>> Create(const MultiheadConfig& config,
                                                                    StateDict weights);

  MultiheadAttention(const MultiheadAttention&) = delete;
  MultiheadAttention& operator=(const MultiheadAttention&) = delete;

  // torch's forward: args.query [B, L, E] ([L, B, E] sequence-first), key
  // [B, S, kdim] and value [B, S, vdim] (omitted: self-attention), masks,
  // need_weights / average_weights and dropout as for raw attention. Weights
  // have S + 1 columns per appended key (add_bias_kv, add_zero_attn).
  // args.num_heads and args.score must be left at their defaults:
  // INVALID_ARGUMENT otherwise, and for inputs that do not fit the layer.
  // The same as Engine::AttendBatch with this one call.
  absl::StatusOr<AttentionResult> Forward(const Engine& engine, const AttentionArgs& args) const;

  const MultiheadConfig& config() const { return config_; }
  // The weight named `key` (a torch state_dict key); null if the config has none.
  const Tensor* weight(const std::string& key) const;

 private:
  MultiheadAttention(const MultiheadConfig& config, StateDict weights)
      : config_(config), weights_(std::move(weights)) {}

  MultiheadConfig config_;
  StateDict weights_;
};

}  // namespace attention

#endif  // ATTENTION_ENGINE_MULTIHEAD_H_
