#include "engine/layer_forward.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/shape_string.h"
#include "common/status_macros.h"
#include "engine/internal.h"
#include "engine/multihead.h"

namespace attention::internal {
namespace {

// Appends `rows` (each `dim` floats, one set per batch entry) after the
// `len` positions of every batch entry of a [B, len, dim] / [len, B, dim] tensor.
FloatBuffer AppendPositions(const FloatBuffer& x, Layout layout, int64_t batch, int64_t len,
                            int64_t dim, const std::vector<const float*>& rows) {
  const int64_t extra = static_cast<int64_t>(rows.size());
  const int64_t new_len = len + extra;
  FloatBuffer y(static_cast<size_t>(batch * new_len * dim));
  auto offset = [&](int64_t b, int64_t j, int64_t n) {
    return (layout == Layout::kBatchFirst ? b * n + j : j * batch + b) * dim;
  };
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j = 0; j < new_len; ++j) {
      const float* src = j < len ? x.data() + offset(b, j, len) : rows[j - len];
      std::memcpy(y.data() + offset(b, j, new_len), src, dim * sizeof(float));
    }
  }
  return y;
}

TensorView ViewOf(const FloatBuffer& data, std::vector<int64_t> shape) {
  return TensorView{DType::kFloat32, std::move(shape), data.data(), data.size() * sizeof(float)};
}

}  // namespace

absl::Status CheckLayerSettings(const MultiheadAttention& layer, const AttentionArgs& args) {
  if (args.num_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_heads: the model has ", layer.config().num_heads, " heads; leave num_heads unset"));
  }
  const ScoreSpec& s = args.score;
  if (s.kind != ScoreKind::kScaledDot || s.scale || s.bandwidth || s.w_q.present() ||
      s.w_k.present() || s.w_v.present() || s.w.present()) {
    return absl::InvalidArgumentError("score: the model sets the score; leave score unset");
  }
  return absl::OkStatus();
}

absl::StatusOr<LayerPlan> PlanLayer(const MultiheadAttention& layer, const AttentionArgs& args) {
  const MultiheadConfig& c = layer.config();
  const int64_t e = c.embed_dim;
  const int64_t kdim = c.key_dim(), vdim = c.value_dim();
  ATTN_RETURN_IF_ERROR(CheckLayerSettings(layer, args));
  if (!args.query.present()) return absl::InvalidArgumentError("query: is required");
  const TensorView& q = args.query;
  const TensorView& k = args.key.present() ? args.key : q;
  const TensorView& v = args.value.present() ? args.value : k;
  struct Input {
    const char* field;
    const TensorView& view;
    int64_t dim;
    const char* dim_name;
    bool given;
  } inputs[] = {{"query", q, e, "embed_dim", true},
                {"key", k, kdim, "kdim", args.key.present()},
                {"value", v, vdim, "vdim", args.value.present()}};
  for (const auto& in : inputs) {
    ATTN_RETURN_IF_ERROR(CheckView(in.view, in.field, Allowed::kFloat, {3}));
    if (in.view.shape[2] != in.dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          in.field, ": last dim ", in.view.shape[2], " does not match the model's ", in.dim_name,
          " ", in.dim, in.given ? "" : " (it defaults to the previous input; pass it)"));
    }
  }
  const bool bf = args.layout == Layout::kBatchFirst;
  LayerPlan plan;
  plan.layer = &layer;
  plan.args = &args;
  plan.kv_batch = k.shape[bf ? 0 : 1];
  plan.kv_len = k.shape[bf ? 1 : 0];
  if (v.shape[bf ? 0 : 1] != plan.kv_batch || v.shape[bf ? 1 : 0] != plan.kv_len) {
    return absl::InvalidArgumentError(absl::StrCat("value: shape ", ShapeString(v.shape),
                                                   " does not match key's batch and length ",
                                                   ShapeString(k.shape)));
  }
  plan.q_rows = q.shape[0] * q.shape[1];
  plan.kv_rows = k.shape[0] * k.shape[1];
  auto floats = [](const TensorView& view, std::vector<float>& copy) {
    if (view.dtype == DType::kFloat32) return static_cast<const float*>(view.data);
    copy = LoadFloats(view);
    return static_cast<const float*>(copy.data());
  };
  plan.q = floats(q, plan.q_copy);
  plan.k = args.key.present() ? floats(k, plan.k_copy) : plan.q;
  plan.v = args.value.present() ? floats(v, plan.v_copy) : plan.k;
  return plan;
}

std::vector<LinearJob> InputProjections(LayerPlan& plan) {
  const MultiheadAttention& layer = *plan.layer;
  const MultiheadConfig& c = layer.config();
  const int64_t e = c.embed_dim;
  const int64_t kdim = c.key_dim(), vdim = c.value_dim();
  const Tensor* packed = layer.weight("in_proj_weight");
  const float* wq = packed ? packed->data.data() : layer.weight("q_proj_weight")->data.data();
  const float* wk = packed ? wq + e * e : layer.weight("k_proj_weight")->data.data();
  const float* wv = packed ? wq + 2 * e * e : layer.weight("v_proj_weight")->data.data();
  const Tensor* in_b = layer.weight("in_proj_bias");
  const float* bq = in_b ? in_b->data.data() : nullptr;
  plan.pq.resize(static_cast<size_t>(plan.q_rows * e));
  plan.pk.resize(static_cast<size_t>(plan.kv_rows * e));
  plan.pv.resize(static_cast<size_t>(plan.kv_rows * e));
  return {{plan.q, plan.q_rows, e, wq, bq, e, plan.pq.data()},
          {plan.k, plan.kv_rows, kdim, wk, in_b ? bq + e : nullptr, e, plan.pk.data()},
          {plan.v, plan.kv_rows, vdim, wv, in_b ? bq + 2 * e : nullptr, e, plan.pv.data()}};
}

void BuildInner(LayerPlan& plan) {
  const MultiheadAttention& layer = *plan.layer;
  const MultiheadConfig& c = layer.config();
  const AttentionArgs& args = *plan.args;
  const int64_t e = c.embed_dim;
  std::vector<const float*> extra_k, extra_v;
  const std::vector<float> zero_row(static_cast<size_t>(e), 0.0f);
  if (c.add_bias_kv) {
    extra_k.push_back(layer.weight("bias_k")->data.data());
    extra_v.push_back(layer.weight("bias_v")->data.data());
  }
  if (c.add_zero_attn) {
    extra_k.push_back(zero_row.data());
    extra_v.push_back(zero_row.data());
  }
  const int64_t tail = static_cast<int64_t>(extra_k.size());
  if (tail > 0) {
    plan.pk = AppendPositions(plan.pk, args.layout, plan.kv_batch, plan.kv_len, e, extra_k);
    plan.pv = AppendPositions(plan.pv, args.layout, plan.kv_batch, plan.kv_len, e, extra_v);
  }
  const bool bf = args.layout == Layout::kBatchFirst;
  const std::vector<int64_t> kv_shape =
      bf ? std::vector<int64_t>{plan.kv_batch, plan.kv_len + tail, e}
         : std::vector<int64_t>{plan.kv_len + tail, plan.kv_batch, e};
  plan.inner = args;
  plan.inner.query = ViewOf(plan.pq, {args.query.shape[0], args.query.shape[1], e});
  plan.inner.key = ViewOf(plan.pk, kv_shape);
  plan.inner.value = ViewOf(plan.pv, kv_shape);
  plan.inner.num_heads = c.num_heads;
  plan.inner.score = c.score;
  plan.inner.mask.unmasked_tail = tail;
}

LinearJob OutputProjection(const LayerPlan& plan, const FloatBuffer& attention_out,
                           FloatBuffer& out) {
  const MultiheadAttention& layer = *plan.layer;
  const int64_t e = layer.config().embed_dim;
  const Tensor* out_b = layer.weight("out_proj.bias");
  out.resize(attention_out.size());
  return {attention_out.data(),
          static_cast<int64_t>(attention_out.size()) / e,
          e,
          layer.weight("out_proj.weight")->data.data(),
          out_b ? out_b->data.data() : nullptr,
          e,
          out.data()};
}

}  // namespace attention::internal
