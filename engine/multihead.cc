#include "engine/multihead.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/shape_string.h"
#include "common/status_macros.h"
#include "engine/internal.h"

namespace attention {

std::vector<std::pair<std::string, std::vector<int64_t>>> MultiheadAttention::ExpectedWeights(
    const MultiheadConfig& c) {
  const int64_t e = c.embed_dim;
  const int64_t kdim = c.key_dim(), vdim = c.value_dim();
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

absl::Status MultiheadAttention::CheckConfig(const MultiheadConfig& config) {
  if (config.embed_dim < 1 || config.num_heads < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "embed_dim ", config.embed_dim, " and num_heads ", config.num_heads, " must both be >= 1"));
  }
  if (config.embed_dim % config.num_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_heads ", config.num_heads, " does not divide embed_dim ", config.embed_dim));
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
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MultiheadAttention>> MultiheadAttention::Create(
    const MultiheadConfig& config, StateDict weights) {
  ATTN_RETURN_IF_ERROR(CheckConfig(config));
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
      return absl::InvalidArgumentError(absl::StrCat(
          "weight \"", key, "\" has ", it->second.data.size(), " elements; its shape needs ", n));
    }
  }
  for (const auto& [key, tensor] : weights) {
    // Not captured by the lambda: Clang before 16 cannot capture a structured binding.
    const std::string& name = key;
    bool known = std::any_of(expected.begin(), expected.end(),
                             [&](const auto& e) { return e.first == name; });
    if (!known) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected weight \"", key, "\" of shape ",
                                                     ShapeString(tensor.shape),
                                                     " (not used by a layer with this config)"));
    }
  }
  return std::unique_ptr<MultiheadAttention>(new MultiheadAttention(config, std::move(weights)));
}

const Tensor* MultiheadAttention::weight(const std::string& key) const {
  auto it = weights_.find(key);
  return it == weights_.end() ? nullptr : &it->second;
}

absl::StatusOr<AttentionResult> MultiheadAttention::Forward(const Engine& engine,
                                                            const AttentionArgs& args) const {
  const EngineCall call{&args, this};
  return std::move(engine.AttendBatch({&call, 1}).front());
}

}  // namespace attention
