#include "engine/multihead.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/internal.h"
#include "engine/multihead_plan.h"
#include "engine/status_macros.h"

namespace attention {
namespace {

using internal::ShapeString;

// Appends `rows` (each `dim` floats, one set per batch entry) after the
// `len` positions of every batch entry of a [B, len, dim] / [len, B, dim] tensor.
FloatBuffer AppendPositions(const FloatBuffer& x, Layout layout, int64_t batch,
                                   int64_t len, int64_t dim,
                                   const std::vector<const float*>& rows) {
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

std::vector<std::pair<std::string, std::vector<int64_t>>> MultiheadAttention::ExpectedWeights(
    const MultiheadConfig& c) {
  const int64_t e = c.embed_dim;
  const int64_t kdim = c.kdim ? c.kdim : e, vdim = c.vdim ? c.vdim : e;
  std::vector<std::pair<std::string, std::vector<int64_t>>> keys;
  if (kdim == e && vdim == e) {
    keys.push_back({"in_proj_weight", {3 * e, e}});
  } else {
    keys.push_back({"q_proj_weight", {e, e}});
    keys.push_back({"k_proj_weight", {e, kdim}});
    keys.push_back({"v_proj_weight", {e, vdim}});
  }
  if (c.bias) keys.push_back({"in_proj_bias", {3 * e}});
  if (c.add_bias_kv) {
    keys.push_back({"bias_k", {1, 1, e}});
    keys.push_back({"bias_v", {1, 1, e}});
  }
  keys.push_back({"out_proj.weight", {e, e}});
  if (c.bias) keys.push_back({"out_proj.bias", {e}});
  return keys;
}

absl::StatusOr<std::unique_ptr<MultiheadAttention>> MultiheadAttention::Create(
    const MultiheadConfig& config, StateDict weights) {
  if (config.embed_dim < 1 || config.num_heads < 1) {
    return absl::InvalidArgumentError(absl::StrCat("embed_dim ", config.embed_dim,
                                                   " and num_heads ", config.num_heads,
                                                   " must both be >= 1"));
  }
  if (config.embed_dim % config.num_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_heads ", config.num_heads,
                                                   " does not divide embed_dim ",
                                                   config.embed_dim));
  }
  if (config.kdim < 0 || config.vdim < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kdim ", config.kdim, " and vdim ", config.vdim, " must be >= 0"));
  }
  // Found by fuzz_model_config: ExpectedWeights' 3 * embed_dim overflowed
  // int64 for embed_dim 2^62. No real layer comes near this bound (its
  // in_proj_weight alone would be 3 * 2^62 floats).
  constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
  if (config.embed_dim > kMaxDim || config.kdim > kMaxDim || config.vdim > kMaxDim) {
    return absl::InvalidArgumentError(absl::StrCat("embed_dim ", config.embed_dim, ", kdim ",
                                                   config.kdim, " and vdim ", config.vdim,
                                                   " must be at most ", kMaxDim));
  }
  const ScoreSpec& s = config.score;
  if (s.w_q.present() || s.w_k.present() || s.w_v.present() || s.w.present() ||
      s.kind == ScoreKind::kAdditive || s.kind == ScoreKind::kBilinear) {
    return absl::InvalidArgumentError(
        "score: a model's score must be parameter-free (SCALED_DOT, DOT, COSINE, "
        "NEG_EUCLIDEAN or GAUSSIAN)");
  }
  // Checked here, not first by every request: a layer that loaded but whose
  // every call fails these checks would be served broken (fuzz_model_config).
  if (s.scale && !std::isfinite(*s.scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("score.scale: ", *s.scale, " is not a finite number"));
  }
  if (s.bandwidth && s.kind != ScoreKind::kGaussian) {
    return absl::InvalidArgumentError("score.bandwidth: is used by score GAUSSIAN only");
  }
  if (s.bandwidth && !std::isfinite(*s.bandwidth)) {
    return absl::InvalidArgumentError(
        absl::StrCat("score.bandwidth: ", *s.bandwidth, " is not a finite number"));
  }
  const auto expected = ExpectedWeights(config);
  for (const auto& [key, shape] : expected) {
    auto it = weights.find(key);
    if (it == weights.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("missing weight \"", key, "\" of shape ", ShapeString(shape)));
    }
    if (it->second.shape != shape) {
      return absl::InvalidArgumentError(absl::StrCat("weight \"", key, "\" has shape ",
                                                     ShapeString(it->second.shape), "; want ",
                                                     ShapeString(shape)));
    }
    ATTN_ASSIGN_OR_RETURN(int64_t n, internal::CheckedElementCount(shape, key));
    if (static_cast<int64_t>(it->second.data.size()) != n) {
      return absl::InvalidArgumentError(absl::StrCat("weight \"", key, "\" has ",
                                                     it->second.data.size(),
                                                     " elements; its shape needs ", n));
    }
  }
  for (const auto& [key, tensor] : weights) {
    // Not captured by the lambda: Clang before 16 cannot capture a structured binding.
    const std::string& name = key;
    bool known = std::any_of(expected.begin(), expected.end(),
                             [&](const auto& e) { return e.first == name; });
    if (!known) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unexpected weight \"", key, "\" of shape ", ShapeString(tensor.shape),
          " (not used by a layer with this config)"));
    }
  }
  return std::unique_ptr<MultiheadAttention>(
      new MultiheadAttention(config, std::move(weights)));
}

const Tensor* MultiheadAttention::Find(const std::string& key) const {
  auto it = weights_.find(key);
  return it == weights_.end() ? nullptr : &it->second;
}

absl::StatusOr<AttentionResult> MultiheadAttention::Forward(const Engine& engine,
                                                            const AttentionArgs& args) const {
  const EngineCall call{&args, this};
  return std::move(engine.AttendBatch({&call, 1}).front());
}

namespace internal {

absl::StatusOr<LayerPlan> PlanLayer(const MultiheadAttention& layer, const AttentionArgs& args) {
  const MultiheadConfig& c = layer.config();
  const int64_t e = c.embed_dim;
  const int64_t kdim = c.kdim ? c.kdim : e, vdim = c.vdim ? c.vdim : e;
  if (args.num_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_heads: the model has ", c.num_heads, " heads; leave num_heads unset"));
  }
  const ScoreSpec& s = args.score;
  if (s.kind != ScoreKind::kScaledDot || s.scale || s.bandwidth || s.w_q.present() ||
      s.w_k.present() || s.w_v.present() || s.w.present()) {
    return absl::InvalidArgumentError("score: the model sets the score; leave score unset");
  }
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
  const int64_t kdim = c.kdim ? c.kdim : e, vdim = c.vdim ? c.vdim : e;
  const Tensor* packed = layer.Find("in_proj_weight");
  const float* wq = packed ? packed->data.data() : layer.Find("q_proj_weight")->data.data();
  const float* wk = packed ? wq + e * e : layer.Find("k_proj_weight")->data.data();
  const float* wv = packed ? wq + 2 * e * e : layer.Find("v_proj_weight")->data.data();
  const Tensor* in_b = layer.Find("in_proj_bias");
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
    extra_k.push_back(layer.Find("bias_k")->data.data());
    extra_v.push_back(layer.Find("bias_v")->data.data());
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
  const Tensor* out_b = layer.Find("out_proj.bias");
  out.resize(attention_out.size());
  return {attention_out.data(), static_cast<int64_t>(attention_out.size()) / e, e,
          layer.Find("out_proj.weight")->data.data(), out_b ? out_b->data.data() : nullptr, e,
          out.data()};
}

}  // namespace internal
}  // namespace attention
