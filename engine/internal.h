#ifndef ATTENTION_ENGINE_INTERNAL_H_
#define ATTENTION_ENGINE_INTERNAL_H_

// Engine-private helpers shared by the backends. Not part of the public API.

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/shape_string.h"
#include "engine/attention.h"

namespace attention::internal {

// Product of `shape`, or INVALID_ARGUMENT naming `field` when it overflows int64.
absl::StatusOr<int64_t> CheckedElementCount(const std::vector<int64_t>& shape,
                                            const std::string& field);

bool IsFloat(DType dtype);

// The output of a call of resolved shape `s`: [B, H, L, Dv] for rank-4 inputs,
// else [B, L, H*Dv] batch-first or [L, B, H*Dv] sequence-first.
std::vector<int64_t> OutputShape(const AttentionArgs& args, const AttentionShape& s);
// Its weights: [B, L, S] averaged over the heads, [B, H, L, S] otherwise.
std::vector<int64_t> WeightsShape(const AttentionArgs& args, const AttentionShape& s);

enum class Allowed { kFloat, kFloatOrBool, kInteger };

// Checks a present view: dtype allowed, rank one of `ranks`, every dim >= 1,
// no overflow, byte count equal to shape x dtype, BOOL elements 0 or 1.
// INVALID_ARGUMENT names `field`.
absl::Status CheckView(const TensorView& view, const std::string& field, Allowed allowed,
                       std::initializer_list<size_t> ranks);

// Elements of a float view (FLOAT32, BFLOAT16 or FLOAT16) as float32.
// The view must already have passed ResolveShape.
std::vector<float> LoadFloats(const TensorView& view);
// Elements of an INT32 / INT64 view.
std::vector<int64_t> LoadInts(const TensorView& view);
// Elements of a BOOL view, 0 or 1.
std::vector<uint8_t> LoadBools(const TensorView& view);

// Where row `pos` of head `head` of batch `batch` starts in a query, key or
// value tensor, for every supported layout; a batch dim of 1 broadcasts.
struct HeadIndexer {
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
  int64_t pos_stride = 0;

  int64_t Offset(int64_t batch, int64_t head, int64_t pos) const {
    return batch * batch_stride + head * head_stride + pos * pos_stride;
  }
};

// Indexer for `view` holding `heads` heads of `head_dim` each.
HeadIndexer MakeHeadIndexer(const TensorView& view, Layout layout, bool rank4, int64_t heads,
                            int64_t head_dim);

// Counter-based uniform [0, 1) from (seed, index): the same on every backend
// and thread split.
double DropoutUniform(uint64_t seed, uint64_t index);

// The score's scale after defaults (1/sqrt(Dq) for scaled_dot, else 1).
double EffectiveScale(const ScoreSpec& score, int64_t query_dim);

}  // namespace attention::internal

#endif  // ATTENTION_ENGINE_INTERNAL_H_
