#include "tests/golden_case.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/shape_string.h"

namespace attention::testing {
namespace {

template <typename T>
void Append(std::string& bytes, T v) {
  char buf[sizeof(T)];
  std::memcpy(buf, &v, sizeof(T));
  bytes.append(buf, sizeof(T));
}

GoldenTensor ParseTensor(const nlohmann::json& j) {
  GoldenTensor t;
  t.present = true;
  t.dtype = j.at("dtype").get<std::string>();
  t.shape = j.at("shape").get<std::vector<int64_t>>();
  for (const auto& v : j.at("data")) {
    double x = v.is_boolean() ? (v.get<bool>() ? 1.0 : 0.0) : v.get<double>();
    t.values.push_back(x);
    if (t.dtype == "f32") {
      Append(t.bytes, static_cast<float>(x));
    } else if (t.dtype == "bool") {
      Append(t.bytes, static_cast<uint8_t>(x != 0));
    } else if (t.dtype == "i64") {
      Append(t.bytes, static_cast<int64_t>(x));
    } else {
      ADD_FAILURE() << "unknown golden dtype " << t.dtype;
    }
  }
  return t;
}

GoldenTensor OptionalTensor(const nlohmann::json& parent, const char* key) {
  if (!parent.is_object() || !parent.contains(key)) return {};
  return ParseTensor(parent.at(key));
}

}  // namespace

DType GoldenTensor::engine_dtype() const {
  if (dtype == "bool") return DType::kBool;
  if (dtype == "i64") return DType::kInt64;
  return DType::kFloat32;
}

TensorView GoldenTensor::View() const {
  if (!present) return {};
  return TensorView{engine_dtype(), shape, bytes.data(), bytes.size()};
}

std::vector<std::string> GoldenCaseNames(std::string_view kind) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(ATTENTION_GOLDEN_DIR)) {
    if (entry.path().extension() != ".json") continue;
    std::ifstream in(entry.path());
    nlohmann::json j = nlohmann::json::parse(in);
    if (j.value("kind", "") == kind) names.push_back(entry.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

GoldenCase LoadGoldenCase(const std::string& name) {
  std::ifstream in(std::string(ATTENTION_GOLDEN_DIR) + "/" + name + ".json");
  nlohmann::json j = nlohmann::json::parse(in);
  GoldenCase c;
  c.name = j.at("name").get<std::string>();
  c.kind = j.at("kind").get<std::string>();
  const auto& inputs = j.at("inputs");
  c.query = ParseTensor(inputs.at("query"));
  c.key = OptionalTensor(inputs, "key");
  c.value = OptionalTensor(inputs, "value");

  const auto& o = j.at("options");
  c.score = o.value("score", "scaled_dot");
  if (o.contains("scale")) c.scale = o.at("scale").get<double>();
  if (o.contains("num_heads")) c.num_heads = o.at("num_heads").get<int64_t>();
  if (o.contains("score_params")) {
    const auto& p = o.at("score_params");
    c.w_q = OptionalTensor(p, "w_q");
    c.w_k = OptionalTensor(p, "w_k");
    c.w_v = OptionalTensor(p, "w_v");
    c.w = OptionalTensor(p, "w");
    if (p.contains("bandwidth")) c.bandwidth = p.at("bandwidth").get<double>();
  }
  if (o.contains("mask")) {
    const auto& m = o.at("mask");
    c.valid_lens = OptionalTensor(m, "valid_lens");
    c.key_padding_mask = OptionalTensor(m, "key_padding_mask");
    c.attn_mask = OptionalTensor(m, "attn_mask");
    c.causal = m.value("causal", "none");
  }
  c.need_weights = o.value("need_weights", false);
  c.average_weights = o.value("average_weights", false);
  if (j.contains("multihead")) c.multihead = j.at("multihead");

  const auto& e = j.at("expected");
  c.expected_output = ParseTensor(e.at("output"));
  c.expected_weights = OptionalTensor(e, "weights");
  c.atol = j.at("tolerance").at("atol").get<double>();
  c.rtol = j.at("tolerance").at("rtol").get<double>();
  return c;
}

AttentionArgs ToEngineArgs(const GoldenCase& c) {
  AttentionArgs a;
  a.query = c.query.View();
  a.key = c.key.View();
  a.value = c.value.View();
  a.num_heads = c.num_heads.value_or(0);
  static const std::pair<const char*, ScoreKind> kScores[] = {
      {"scaled_dot", ScoreKind::kScaledDot}, {"dot", ScoreKind::kDot},
      {"additive", ScoreKind::kAdditive},    {"bilinear", ScoreKind::kBilinear},
      {"cosine", ScoreKind::kCosine},        {"neg_euclidean", ScoreKind::kNegEuclidean},
      {"gaussian", ScoreKind::kGaussian}};
  bool known = false;
  for (const auto& [name, kind] : kScores) {
    if (c.score == name) {
      a.score.kind = kind;
      known = true;
    }
  }
  if (!known) ADD_FAILURE() << "unknown score " << c.score;
  a.score.scale = c.scale;
  a.score.w_q = c.w_q.View();
  a.score.w_k = c.w_k.View();
  a.score.w_v = c.w_v.View();
  a.score.w = c.w.View();
  a.score.bandwidth = c.bandwidth;
  a.mask.valid_lens = c.valid_lens.View();
  a.mask.key_padding_mask = c.key_padding_mask.View();
  a.mask.attn_mask = c.attn_mask.View();
  a.mask.causal = c.causal == "top_left"       ? Causal::kTopLeft
                  : c.causal == "bottom_right" ? Causal::kBottomRight
                                               : Causal::kNone;
  a.need_weights = c.need_weights;
  a.average_weights = c.average_weights;
  return a;
}

MultiheadConfig MultiheadConfigOf(const GoldenCase& c) {
  const auto& m = c.multihead;
  MultiheadConfig config;
  config.embed_dim = m.at("embed_dim").get<int64_t>();
  config.num_heads = m.at("num_heads").get<int64_t>();
  config.kdim = m.value("kdim", int64_t{0});
  config.vdim = m.value("vdim", int64_t{0});
  config.bias = m.value("bias", true);
  config.add_bias_kv = m.value("add_bias_kv", false);
  config.add_zero_attn = m.value("add_zero_attn", false);
  return config;
}

StateDict StateDictOf(const GoldenCase& c) {
  StateDict dict;
  for (const auto& [key, value] : c.multihead.at("state_dict").items()) {
    GoldenTensor t = ParseTensor(value);
    dict[key] = Tensor{t.shape, FloatBuffer(t.values.begin(), t.values.end())};
  }
  return dict;
}

::testing::AssertionResult AllClose(const std::vector<int64_t>& got_shape,
                                    absl::Span<const float> got, const GoldenTensor& want,
                                    double atol, double rtol) {
  if (got_shape != want.shape) {
    return ::testing::AssertionFailure()
           << "shape " << ShapeString(got_shape) << ", want " << ShapeString(want.shape);
  }
  if (got.size() != want.values.size()) {
    return ::testing::AssertionFailure() << got.size() << " elements, want " << want.values.size();
  }
  size_t bad = 0;
  std::ostringstream first;
  for (size_t i = 0; i < got.size(); ++i) {
    double w = want.values[i];
    double g = got[i];
    if (!(std::fabs(g - w) <= atol + rtol * std::fabs(w))) {
      if (bad++ == 0) first << "element " << i << ": got " << g << ", want " << w;
    }
  }
  if (bad > 0) {
    return ::testing::AssertionFailure()
           << bad << " of " << got.size() << " elements off; first " << first.str();
  }
  return ::testing::AssertionSuccess();
}

}  // namespace attention::testing
