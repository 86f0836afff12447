#ifndef ATTENTION_ENGINE_SESSION_FORWARD_H_
#define ATTENTION_ENGINE_SESSION_FORWARD_H_

// An engine call with sessions (EngineCall::session, engine/kv_cache.h),
// split into the phases Engine::AttendBatch runs: plan (checks, shapes,
// cost), a layer's input projections (layer_forward.h), appending the new
// rows to the caches, then the attention: the decode kernel (decode.h) for a
// few query rows of a dot-product score without weights; for caches that
// were empty, the call itself on its own rows; otherwise one backend call
// per batch row over a contiguous copy of its cached rows; and a layer's
// output projection. Engine-private.

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/cost.h"
#include "engine/decode.h"
#include "engine/engine.h"
#include "engine/internal.h"
#include "engine/kv_cache.h"
#include "engine/layer_forward.h"

namespace attention::internal {

struct SessionPlan {
  const AttentionArgs* args = nullptr;
  const SessionCall* session = nullptr;
  const MultiheadAttention* layer = nullptr;  // null: raw attention
  std::optional<LayerPlan> layer_plan;        // the layer's projections
  // The call's sizes: key_len is the rows this call appends per batch row.
  AttentionShape shape;
  // Keys each batch row attends: its cache's rows after this call's append,
  // and the layer's appended keys after them (tail).
  std::vector<int64_t> keys;
  int64_t max_keys = 0;
  int tail = 0;
  ScoreSpec score;  // the raw call's, or the layer's
  float scale = 1.0f;
  bool decode = false;  // the decode kernel computes it
  // A read-only raw call's stand-in key/value (shape resolution only).
  std::vector<float> stand_in;
  // The query rows attention reads (a layer's projected ones) and where
  // each head's rows are in them and in `out` (set by AppendRows).
  const float* q = nullptr;
  std::vector<float> q_copy;
  HeadIndexer q_ix, out_ix;
  // A call that appends to empty caches only (new sessions' prefill): the
  // attention is one backend call on the call's own rows, the same call
  // without sessions, instead of a copy of each row's cache (set by
  // PlanSession; its arguments by RowCalls).
  bool direct = false;
  AttentionArgs direct_args;
  // A raw call's new key and value rows as float32 (set by AppendRows), and
  // their copies when the call's are of another dtype.
  const float* k = nullptr;
  const float* v = nullptr;
  std::vector<float> k_copy, v_copy;
  // Per batch row of the general path: its query, keys and values as
  // contiguous rank-4 copies, and the call on them.
  std::vector<FloatBuffer> row_q, row_k, row_v;
  std::vector<AttentionArgs> row_args;
  std::vector<float> zero_row;  // the zero-attention key, key_dim zeros
  // The attention's output: the call's output shape (a layer's inner
  // output, [B, L, E] / [L, B, E], before out_proj).
  FloatBuffer out;
  std::vector<int64_t> out_shape;
  Tensor weights;
};

// Checks the call (INVALID_ARGUMENT naming the field and the numbers;
// FAILED_PRECONDITION for a cache with pending rows) and plans it.
absl::StatusOr<SessionPlan> PlanSession(const EngineCall& call);
// What the call will cost on `threads` threads: the attention over every
// cached row, a layer's projections of this call's rows only.
CallCost SessionCost(const SessionPlan& plan, int threads);
// The call's sizes with every key it attends (for the engine's limits).
AttentionShape FullShape(const SessionPlan& plan);

// After a layer's projections: appends the call's new rows to the caches
// (pending, on up to `threads` threads) and allocates the output.
absl::Status AppendRows(SessionPlan& plan, int threads);
// The decode kernel's items for a plan with `decode` set.
std::vector<DecodeItem> DecodeItems(SessionPlan& plan);
// The backend calls of a plan without `decode`: one per batch row (their
// copies made on up to `threads` threads), or the one direct call.
absl::StatusOr<std::vector<BackendCall>> RowCalls(SessionPlan& plan, int threads,
                                                  const std::function<absl::Status()>* interrupt);
// Copies the row calls' results (as many as RowCalls made) into plan.out and
// plan.weights.
absl::Status GatherRowResults(SessionPlan& plan,
                              std::vector<absl::StatusOr<AttentionResult>> results);
// The attention's result (before a layer's output projection).
AttentionResult TakeResult(SessionPlan& plan);

}  // namespace attention::internal

#endif  // ATTENTION_ENGINE_SESSION_FORWARD_H_
