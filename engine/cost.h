#ifndef ATTENTION_ENGINE_COST_H_
#define ATTENTION_ENGINE_COST_H_

// What one engine call will cost, from its shapes and score parameters alone:
// computed once per call before any work (Engine::CostOf), and used by the
// engine's limits, the server's choice of where a call computes, and its
// answer-size check.

#include <cstdint>

#include "engine/attention.h"

namespace attention {

class MultiheadAttention;

struct CallCost {
  // Floating-point work, in float32 multiply-add terms (one counts 2): the
  // matmuls, and the element-wise work each score kind does per (query, key)
  // pair (an additive score's tanh over its hidden size dominates it).
  double flops = 0;
  // Elements of the result the engine allocates (float32): the output, and
  // the weights when the call returns them.
  double output_elements = 0;
  double weights_elements = 0;
  // Working memory: converted copies of inputs and masks, a layer's
  // projections, a score's derived tensors (an additive score's projected
  // queries and keys, hidden wide), and each compute thread's blocks.
  double scratch_bytes = 0;

  double output_bytes() const { return output_elements * 4; }
  double weights_bytes() const { return weights_elements * 4; }
  // All the memory the call allocates.
  double bytes() const { return output_bytes() + weights_bytes() + scratch_bytes; }
};

namespace internal {

// Flop equivalents per (query, key) pair and hidden unit of an additive
// score (an add, a tanh and a multiply-add), per pair and dimension of a
// negative Euclidean score (scalar code), and per pair of the online softmax
// (max, exp, sum, rescale): chosen so that every kind computes about as many
// of the model's flops per second as a scaled-dot call does (cost_model_check
// holds them within 3x; docs/benchmarks.md, "Cost model", has the figures).
inline constexpr double kAdditiveFlopsPerHidden = 40;
inline constexpr double kNegEuclideanFlopsPerDim = 10;
inline constexpr double kSoftmaxFlopsPerScore = 10;

// A raw attention call of resolved shape `s` computed on `threads` threads.
CallCost RawCallCost(const AttentionArgs& args, const AttentionShape& s, int threads);

// A layer's forward: inputs of q_rows and kv_rows rows (batch x length), the
// inner attention over its heads with `extra_keys` appended keys.
CallCost LayerCallCost(const MultiheadAttention& layer, const AttentionArgs& args,
                       int64_t batch, int64_t query_len, int64_t kv_len, int64_t extra_keys,
                       int threads);

}  // namespace internal
}  // namespace attention

#endif  // ATTENTION_ENGINE_COST_H_
