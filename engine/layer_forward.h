#ifndef ATTENTION_ENGINE_LAYER_FORWARD_H_
#define ATTENTION_ENGINE_LAYER_FORWARD_H_

// A MultiheadAttention forward split into the phases the engine runs
// (Engine::AttendBatch: plan, input projections, the inner attention, output
// projection), so the calls of a batch share each phase's pass over the
// compute threads. Engine-private; uses only the layer's public interface.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/attention.h"
#include "engine/backend.h"

namespace attention {
class MultiheadAttention;
}

namespace attention::internal {

struct LayerPlan {
  const MultiheadAttention* layer = nullptr;
  const AttentionArgs* args = nullptr;
  // The inputs as float32, [rows, dim] each (rows = the first two dims).
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  std::vector<float> q_copy, k_copy, v_copy;
  int64_t q_rows = 0, kv_rows = 0;
  int64_t kv_batch = 0, kv_len = 0;
  // Projections, then the inner attention call on them.
  FloatBuffer pq, pk, pv;
  AttentionArgs inner;
};

// INVALID_ARGUMENT when args sets what the layer fixes: num_heads, the score.
absl::Status CheckLayerSettings(const MultiheadAttention& layer, const AttentionArgs& args);
// Checks args against the layer (INVALID_ARGUMENT naming the field) and plans
// its forward.
absl::StatusOr<LayerPlan> PlanLayer(const MultiheadAttention& layer, const AttentionArgs& args);
// The q / k / v input projections; allocates their outputs in `plan`.
std::vector<LinearJob> InputProjections(LayerPlan& plan);
// After the projections: appends bias_k / bias_v / zero-attention keys and
// builds plan.inner.
void BuildInner(LayerPlan& plan);
// out_proj of the inner call's output, written to `out`.
LinearJob OutputProjection(const LayerPlan& plan, const FloatBuffer& attention_out,
                           FloatBuffer& out);

}  // namespace attention::internal

#endif  // ATTENTION_ENGINE_LAYER_FORWARD_H_
