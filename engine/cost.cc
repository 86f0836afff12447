#include "engine/cost.h"

#include <algorithm>

#include "engine/multihead.h"

namespace attention::internal {
namespace {

// The engine's work split (engine/onednn_backend.cc): blocks of query rows
// against blocks of keys, per thread.
constexpr double kQueryBlock = 64, kKeyBlock = 512;

double Elements(const TensorView& v) {
  if (!v.present()) return 0;
  double n = 1;
  for (int64_t d : v.shape) n *= static_cast<double>(d);
  return n;
}

// A copy of `v` as float32 when it is not, and as bfloat16 when the call
// computes in bfloat16 and `v` is not.
double ConvertedBytes(const TensorView& v, bool bf16_math) {
  if (!v.present()) return 0;
  double bytes = v.dtype == DType::kFloat32 ? 0 : Elements(v) * 4;
  if (bf16_math && v.dtype != DType::kBFloat16) bytes += Elements(v) * 2;
  return bytes;
}

}  // namespace

CallCost RawCallCost(const AttentionArgs& a, const AttentionShape& s, int threads) {
  const double B = static_cast<double>(s.batch), H = static_cast<double>(s.heads),
               Hk = static_cast<double>(s.kv_heads), L = static_cast<double>(s.query_len),
               S = static_cast<double>(s.key_len), Dq = static_cast<double>(s.query_dim),
               Dk = static_cast<double>(s.key_dim), Dv = static_cast<double>(s.value_dim);
  const double pairs = B * H * L * S;
  const double hidden =
      a.score.kind == ScoreKind::kAdditive && a.score.w_v.present() && !a.score.w_v.shape.empty()
          ? static_cast<double>(a.score.w_v.shape[0])
          : 0;
  CallCost cost;
  double per_pair = 0;
  switch (a.score.kind) {
    case ScoreKind::kAdditive:
      per_pair = hidden * kAdditiveFlopsPerHidden;
      // Queries and keys projected to the hidden size, once.
      cost.flops += 2 * (B * H * L * Dq + B * Hk * S * Dk) * hidden;
      cost.scratch_bytes += (B * H * L + B * Hk * S + 1) * hidden * 4;
      break;
    case ScoreKind::kNegEuclidean:
      per_pair = kNegEuclideanFlopsPerDim * Dk;
      break;
    case ScoreKind::kBilinear:
      per_pair = 2 * Dk;
      cost.flops += 2 * B * H * L * Dq * Dk;  // q W, once
      cost.scratch_bytes += B * H * L * Dk * 6;
      break;
    case ScoreKind::kCosine:
      per_pair = 2 * Dk;
      cost.scratch_bytes += (B * H * L + B * Hk * S) * 4;
      break;
    case ScoreKind::kGaussian:
      per_pair = 2 * Dk;
      cost.scratch_bytes += B * Hk * S * 4;
      break;
    case ScoreKind::kScaledDot:
    case ScoreKind::kDot:
      per_pair = 2 * Dk;
      break;
  }
  cost.flops += pairs * (per_pair + kSoftmaxFlopsPerScore + 2 * Dv);

  const TensorView& q = a.query;
  const TensorView& k = a.key.present() ? a.key : q;
  const TensorView& v = a.value.present() ? a.value : k;
  const bool bf16_math = a.fast || q.dtype == DType::kBFloat16 || k.dtype == DType::kBFloat16 ||
                         v.dtype == DType::kBFloat16;
  cost.scratch_bytes += ConvertedBytes(q, bf16_math);
  if (a.key.present()) cost.scratch_bytes += ConvertedBytes(k, bf16_math);
  if (a.value.present()) cost.scratch_bytes += ConvertedBytes(v, bf16_math);
  cost.scratch_bytes += Elements(a.mask.attn_mask) * 4 + Elements(a.mask.key_padding_mask) * 4;

  cost.output_elements = B * H * L * Dv;
  if (a.need_weights) cost.weights_elements = B * (a.average_weights ? 1 : H) * L * S;
  // Each thread's blocks: scores (float32 and bfloat16), the output
  // accumulator, row statistics, and one head's weight rows when averaging.
  double per_thread = kQueryBlock * kKeyBlock * 6 + kQueryBlock * (Dv + 2) * 4;
  if (a.need_weights && a.average_weights) per_thread += kQueryBlock * S * 4;
  cost.scratch_bytes += std::max(1, threads) * per_thread;
  return cost;
}

CallCost LayerCallCost(const MultiheadAttention& layer, const AttentionArgs& a, int64_t batch,
                       int64_t query_len, int64_t kv_len, int64_t extra_keys, int threads) {
  const MultiheadConfig& c = layer.config();
  const double e = static_cast<double>(c.embed_dim);
  const double kdim = static_cast<double>(c.key_dim());
  const double vdim = static_cast<double>(c.value_dim());
  const double q_rows = static_cast<double>(batch) * static_cast<double>(query_len);
  const double kv_rows = static_cast<double>(batch) * static_cast<double>(kv_len);
  const double keys = static_cast<double>(batch) * static_cast<double>(kv_len + extra_keys);

  // The inner attention: float32 projections, the layer's heads.
  AttentionArgs inner;
  inner.score = c.score;
  inner.need_weights = a.need_weights;
  inner.average_weights = a.average_weights;
  inner.fast = a.fast;
  AttentionShape s;
  s.batch = batch;
  s.heads = s.kv_heads = c.num_heads;
  s.query_len = query_len;
  s.key_len = kv_len + extra_keys;
  s.query_dim = s.key_dim = s.value_dim = c.embed_dim / c.num_heads;
  CallCost cost = RawCallCost(inner, s, threads);

  // Input and output projections.
  cost.flops += 2 * q_rows * e * e + 2 * kv_rows * (kdim + vdim) * e + 2 * q_rows * e * e;
  // Float32 copies of 16-bit inputs, the projections, the inner output.
  cost.scratch_bytes += ConvertedBytes(a.query, false) + ConvertedBytes(a.key, false) +
                        ConvertedBytes(a.value, false);
  cost.scratch_bytes += (q_rows + 2 * keys) * e * 4 + cost.output_bytes();
  cost.output_elements = q_rows * e;
  return cost;
}

}  // namespace attention::internal
