// Randomized differential tests: the oneDNN backend against the reference
// backend (plain loops, double accumulation) on seeded random inputs. A
// failure prints the whole case (SCOPED_TRACE); every case is reproducible
// alone, e.g. --gtest_filter='Fuzz/DifferentialTest.MatchesReference/Seed83'.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/engine.h"
#include "common/half.h"
#include "gtest/gtest.h"

namespace attention {
namespace {

constexpr Backend kBackendUnderTest = Backend::kOneDnn;

enum class Lens { kNone, kPerBatch, kPerRow };
enum class Fill { kBool, kBoolRuns, kFloat, kFloatNegInf };

// One randomized call. Mask shapes are patterns over "BHLS1": "BS" is
// [B, S], "1HLS" is [1, H, L, S]; empty means no mask.
struct CaseSpec {
  std::string name;
  uint32_t seed = 1;
  int64_t batch = 2;
  int64_t heads = 2;
  int64_t kv_heads = 0;  // rank-4 only; 0 means `heads`
  int64_t query_len = 9;
  int64_t key_len = 13;
  int64_t query_dim = 8;  // per head
  int64_t key_dim = 0;    // 0 means query_dim
  int64_t value_dim = 0;  // 0 means query_dim
  bool rank4 = false;
  Layout layout = Layout::kBatchFirst;
  bool query_batch_of_one = false;
  bool key_batch_of_one = false;
  bool value_batch_of_one = false;
  bool self_attention = false;  // key and value omitted
  bool value_omitted = false;   // value = key
  ScoreKind score = ScoreKind::kScaledDot;
  std::optional<double> scale;
  std::optional<double> bandwidth;
  int64_t hidden = 8;  // additive
  Lens lens = Lens::kNone;
  DType lens_dtype = DType::kInt64;
  std::string key_padding;  // "BS" or "1S"
  Fill key_padding_fill = Fill::kBool;
  std::string attn_mask;
  Fill attn_mask_fill = Fill::kBool;
  DType float_mask_dtype = DType::kFloat32;
  Causal causal = Causal::kNone;
  int64_t unmasked_tail = 0;  // masks are shaped for the S - unmasked_tail keys before it
  bool need_weights = true;
  bool average_weights = false;
  double dropout_p = 0.0;
  DType dtype = DType::kFloat32;
  bool fast = false;

  int64_t Dk() const { return key_dim ? key_dim : query_dim; }
  int64_t Dv() const { return value_dim ? value_dim : query_dim; }
  int64_t Hk() const { return kv_heads ? kv_heads : heads; }
  int64_t MaskedKeys() const { return key_len - unmasked_tail; }
  // Multiply-adds of the reference: B*H*L*S*(score + value) work.
  double Cost() const {
    const double score_cost =
        score == ScoreKind::kAdditive ? static_cast<double>(hidden) * (Dk() + 1) : query_dim;
    return static_cast<double>(batch) * heads * query_len * key_len * (score_cost + Dv());
  }
};

constexpr ScoreKind kScoreKinds[] = {
    ScoreKind::kScaledDot, ScoreKind::kDot,          ScoreKind::kAdditive, ScoreKind::kBilinear,
    ScoreKind::kCosine,    ScoreKind::kNegEuclidean, ScoreKind::kGaussian};

constexpr Fill kFills[] = {Fill::kBool, Fill::kBoolRuns, Fill::kFloat, Fill::kFloatNegInf};

const char* ScoreName(ScoreKind kind) {
  static const char* const kNames[] = {"ScaledDot", "Dot",          "Additive", "Bilinear",
                                       "Cosine",    "NegEuclidean", "Gaussian"};
  return kNames[static_cast<int>(kind)];
}

const char* CausalName(Causal causal) {
  static const char* const kNames[] = {"none", "top_left", "bottom_right"};
  return kNames[static_cast<int>(causal)];
}

const char* FillName(Fill fill) {
  static const char* const kNames[] = {"bool", "bool_runs", "float", "float_neg_inf"};
  return kNames[static_cast<int>(fill)];
}

// gtest prints parameters of failed tests with this.
void PrintTo(const CaseSpec& s, std::ostream* os) { *os << s.name; }

std::string Describe(const CaseSpec& s) {
  std::string d = absl::StrCat(
      s.name, ": seed=", s.seed, " B=", s.batch, " H=", s.heads, " Hk=", s.Hk(), " L=", s.query_len,
      " S=", s.key_len, " Dq=", s.query_dim, " Dk=", s.Dk(), " Dv=", s.Dv(),
      s.rank4 ? " rank4" : " rank3", s.layout == Layout::kSequenceFirst ? " sequence_first" : "",
      s.query_batch_of_one ? " query_batch=1" : "", s.key_batch_of_one ? " key_batch=1" : "",
      s.value_batch_of_one ? " value_batch=1" : "", s.self_attention ? " self_attention" : "",
      s.value_omitted ? " value_omitted" : "", " score=", ScoreName(s.score));
  if (s.scale) absl::StrAppend(&d, " scale=", *s.scale);
  if (s.bandwidth) absl::StrAppend(&d, " bandwidth=", *s.bandwidth);
  if (s.score == ScoreKind::kAdditive) absl::StrAppend(&d, " hidden=", s.hidden);
  if (s.lens != Lens::kNone) {
    absl::StrAppend(&d, " valid_lens=", s.lens == Lens::kPerBatch ? "[B]" : "[B,L]", " ",
                    DTypeName(s.lens_dtype));
  }
  if (!s.key_padding.empty()) {
    absl::StrAppend(&d, " key_padding_mask=", s.key_padding, " ", FillName(s.key_padding_fill));
  }
  if (!s.attn_mask.empty()) {
    absl::StrAppend(&d, " attn_mask=", s.attn_mask, " ", FillName(s.attn_mask_fill));
  }
  if (s.float_mask_dtype != DType::kFloat32) {
    absl::StrAppend(&d, " float_masks=", DTypeName(s.float_mask_dtype));
  }
  absl::StrAppend(&d, " causal=", CausalName(s.causal));
  if (s.unmasked_tail) absl::StrAppend(&d, " unmasked_tail=", s.unmasked_tail);
  absl::StrAppend(&d, " need_weights=", s.need_weights, " average_weights=", s.average_weights,
                  " dropout_p=", s.dropout_p, " dtype=", DTypeName(s.dtype), " fast=", s.fast);
  return d;
}

template <typename T>
std::string Bytes(const std::vector<T>& values) {
  std::string bytes(values.size() * sizeof(T), '\0');
  if (!values.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

std::string FloatBytes(const std::vector<float>& values, DType dtype) {
  if (dtype == DType::kFloat32) return Bytes(values);
  std::vector<uint16_t> half(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    half[i] = dtype == DType::kBFloat16 ? FloatToBFloat16(values[i]) : FloatToFloat16(values[i]);
  }
  return Bytes(half);
}

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// The tensors of one CaseSpec, drawn from its seed, and the arguments viewing them.
class RandomCase {
 public:
  explicit RandomCase(const CaseSpec& spec) : spec_(spec), rng_(spec.seed) {
    const CaseSpec& s = spec_;
    args_.layout = s.layout;
    args_.num_heads = s.rank4 ? 0 : s.heads;
    args_.query =
        Normal(InputShape(s.query_batch_of_one, s.heads, s.query_len, s.query_dim), 1.0, s.dtype);
    if (!s.self_attention) {
      args_.key = Normal(InputShape(s.key_batch_of_one, s.Hk(), s.key_len, s.Dk()), 1.0, s.dtype);
    }
    if (!s.self_attention && !s.value_omitted) {
      args_.value =
          Normal(InputShape(s.value_batch_of_one, s.Hk(), s.key_len, s.Dv()), 1.0, s.dtype);
    }
    args_.score.kind = s.score;
    args_.score.scale = s.scale;
    args_.score.bandwidth = s.bandwidth;
    if (s.score == ScoreKind::kAdditive) {
      args_.score.w_q = Normal({s.hidden, s.query_dim}, 1.0 / std::sqrt(s.query_dim));
      args_.score.w_k = Normal({s.hidden, s.Dk()}, 1.0 / std::sqrt(s.Dk()));
      args_.score.w_v = Normal({s.hidden}, 1.0);
    } else if (s.score == ScoreKind::kBilinear) {
      args_.score.w = Normal({s.query_dim, s.Dk()}, 1.0 / std::sqrt(s.query_dim));
    }
    if (s.lens != Lens::kNone) args_.mask.valid_lens = ValidLens();
    if (!s.key_padding.empty()) {
      args_.mask.key_padding_mask = Mask(s.key_padding, s.key_padding_fill);
    }
    if (!s.attn_mask.empty()) args_.mask.attn_mask = Mask(s.attn_mask, s.attn_mask_fill);
    args_.mask.causal = s.causal;
    args_.mask.unmasked_tail = s.unmasked_tail;
    args_.need_weights = s.need_weights;
    args_.average_weights = s.average_weights;
    args_.dropout_p = s.dropout_p;
    args_.seed = s.seed * 7919ull + 17;
    args_.fast = s.fast;
  }

  RandomCase(const RandomCase&) = delete;
  RandomCase& operator=(const RandomCase&) = delete;

  const AttentionArgs& args() const { return args_; }

 private:
  std::vector<int64_t> InputShape(bool batch_of_one, int64_t heads, int64_t len, int64_t dim) {
    const CaseSpec& s = spec_;
    const int64_t b = batch_of_one ? 1 : s.batch;
    if (s.rank4) return {b, heads, len, dim};
    if (s.layout == Layout::kSequenceFirst) return {len, b, heads * dim};
    return {b, len, heads * dim};
  }

  std::vector<int64_t> PatternShape(const std::string& pattern) const {
    std::vector<int64_t> shape;
    for (char c : pattern) {
      shape.push_back(c == 'B'   ? spec_.batch
                      : c == 'H' ? spec_.heads
                      : c == 'L' ? spec_.query_len
                      : c == 'S' ? spec_.MaskedKeys()
                                 : 1);
    }
    return shape;
  }

  TensorView Add(DType dtype, std::vector<int64_t> shape, std::string bytes) {
    const std::string& stored = storage_.emplace_back(std::move(bytes));
    return TensorView{dtype, std::move(shape), stored.data(), stored.size()};
  }

  TensorView Normal(std::vector<int64_t> shape, double stddev, DType dtype = DType::kFloat32) {
    std::normal_distribution<float> dist(0.0f, static_cast<float>(stddev));
    std::vector<float> values(Elements(shape));
    for (float& x : values) x = dist(rng_);
    return Add(dtype, std::move(shape), FloatBytes(values, dtype));
  }

  // Lengths in [0, S]; the first is 0 (fully masked rows) and the last S.
  TensorView ValidLens() {
    const CaseSpec& s = spec_;
    std::vector<int64_t> shape = {s.batch};
    if (s.lens == Lens::kPerRow) shape.push_back(s.query_len);
    std::uniform_int_distribution<int64_t> dist(0, s.MaskedKeys());
    std::vector<int64_t> lens(Elements(shape));
    for (int64_t& len : lens) len = dist(rng_);
    lens.front() = 0;
    if (lens.size() > 1) lens.back() = s.MaskedKeys();
    if (s.lens_dtype == DType::kInt64) return Add(DType::kInt64, std::move(shape), Bytes(lens));
    return Add(DType::kInt32, std::move(shape),
               Bytes(std::vector<int32_t>(lens.begin(), lens.end())));
  }

  // Masks 30% of the elements at random, or one random run of keys per row
  // (kBoolRuns), and every key of the first row when rows are S long. Float
  // masks are N(0, 1) biases, -inf where masked for kFloatNegInf.
  TensorView Mask(const std::string& pattern, Fill fill) {
    std::vector<int64_t> shape = PatternShape(pattern);
    const int64_t n = Elements(shape), row = shape.back();
    std::bernoulli_distribution coin(0.3);
    std::uniform_int_distribution<int64_t> key(0, row);
    std::vector<uint8_t> masked(n);
    for (int64_t r = 0; r < n; r += row) {
      const int64_t a = key(rng_), b = key(rng_);
      for (int64_t j = 0; j < row; ++j) {
        const bool in_run = j >= std::min(a, b) && j < std::max(a, b);
        masked[r + j] = (r == 0 && row == spec_.MaskedKeys()) ||
                        (fill == Fill::kBoolRuns ? in_run : coin(rng_));
      }
    }
    if (fill == Fill::kBool || fill == Fill::kBoolRuns) {
      return Add(DType::kBool, std::move(shape), Bytes(masked));
    }
    std::normal_distribution<float> bias;
    std::vector<float> values(n);
    for (int64_t i = 0; i < n; ++i) {
      const bool neg_inf = fill == Fill::kFloatNegInf && masked[i];
      values[i] = neg_inf ? -std::numeric_limits<float>::infinity() : bias(rng_);
    }
    return Add(spec_.float_mask_dtype, std::move(shape),
               FloatBytes(values, spec_.float_mask_dtype));
  }

  const CaseSpec spec_;
  std::mt19937 rng_;
  std::deque<std::string> storage_;
  AttentionArgs args_;
};

struct Tolerance {
  double atol;
  double rtol;
};

constexpr Tolerance kIdentical{0, 0};

// Standard deviation of the logits that matmuls compute, for N(0, 1) inputs:
// scale * q.k (bilinear: q'.k with q' = q W ~ N(0, 1); gaussian: its
// bw^2 * q.k term). Cosine logits are bounded by the scale; additive and
// neg_euclidean logits are computed without matmuls, in float32.
double LogitSpread(const CaseSpec& s) {
  const double dq = static_cast<double>(s.query_dim), dk = static_cast<double>(s.Dk());
  const double bw = s.bandwidth.value_or(1.0);
  switch (s.score) {
    case ScoreKind::kScaledDot:
      return s.scale.value_or(1 / std::sqrt(dq)) * std::sqrt(dq);
    case ScoreKind::kDot:
      return s.scale.value_or(1) * std::sqrt(dq);
    case ScoreKind::kBilinear:
      return s.scale.value_or(1) * std::sqrt(dk);
    case ScoreKind::kGaussian:
      return s.scale.value_or(1) * bw * bw * std::sqrt(dq);
    case ScoreKind::kCosine:
      return s.scale.value_or(1);
    case ScoreKind::kAdditive:
    case ScoreKind::kNegEuclidean:
      return 0;
  }
  return 0;
}

struct Tolerances {
  Tolerance output;
  Tolerance weights;
};

// float32 math: the golden cases' tolerance (atol 1e-5, rtol 1e-4) up to a
// logit spread of 4. Float32 logits are off by ~2^-24 * sum_d |scale q_d k_d|
// (the reference accumulates in double), which grows with the spread, and
// outputs move by that times |v - output|: measured 4.2e-5 at spread 32
// (DOT, scale 4, D = 64, S = 1100). Past 4, atol grows with the spread.
Tolerances Float32Tolerances(const CaseSpec& s) {
  const Tolerance tol{1e-5 * std::max(1.0, LogitSpread(s) / 4), 1e-4};
  return {tol, tol};
}

// bf16 math (args.fast, or BFLOAT16 inputs, on CPUs with avx512_bf16) rounds
// q, k, the probabilities and v to 8-bit mantissas (relative error <= 2^-9)
// before float32-accumulated matmuls.
// - Rounding q and k moves each logit by ~2^-9 * spread (std), ~0.007 * spread
//   at worst over 1e5 logits; weights move by at most about that times p, and
//   outputs by about that times |v - output|. Measured worst: weights
//   0.003 * spread, outputs 0.011 * spread (DOT, D = 64: spread 8).
// - Rounding the probabilities and v moves outputs by up to 2^-9 * max |v|
//   each: measured 0.009 where the logits are float32 (ADDITIVE, D = 64) and
//   0.011 at spread 1 (SCALED_DOT, D = 64, masked).
// Both bounds below keep a 2x margin over what was measured; dropout scales
// kept probabilities, and so every error, by 1 / (1 - p).
Tolerances BFloat16Tolerances(const CaseSpec& s) {
  const double spread = LogitSpread(s);
  const double dropout = s.dropout_p < 1 ? 1 / (1 - s.dropout_p) : 1;
  const double float32_atol = Float32Tolerances(s).weights.atol;
  return {.output = {(2e-2 + 2e-2 * spread) * dropout, 2e-2},
          .weights = {std::max(float32_atol, 6e-3 * spread * dropout), 2e-2}};
}

Tolerances TolerancesFor(const CaseSpec& s) {
  return s.fast || s.dtype == DType::kBFloat16 ? BFloat16Tolerances(s) : Float32Tolerances(s);
}

// "[b, h, i, j]" of flat element `e` of a row-major `shape`.
std::string IndexString(const std::vector<int64_t>& shape, int64_t e) {
  std::vector<int64_t> index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = e % shape[d];
    e /= shape[d];
  }
  return absl::StrCat("[", absl::StrJoin(index, ", "), "]");
}

// |got - want| <= atol + rtol * |want| element-wise; names the worst element.
::testing::AssertionResult Close(const Tensor& got, const Tensor& want, Tolerance tol) {
  if (got.shape != want.shape || got.data.size() != want.data.size()) {
    return ::testing::AssertionFailure() << "shape [" << absl::StrJoin(got.shape, ", ")
                                         << "], want [" << absl::StrJoin(want.shape, ", ") << "]";
  }
  int64_t bad = 0, worst = 0;
  double worst_excess = 0;
  for (size_t e = 0; e < got.data.size(); ++e) {
    const double g = got.data[e], w = want.data[e];
    const double excess = std::fabs(g - w) - (tol.atol + tol.rtol * std::fabs(w));
    if (excess <= 0) continue;
    if (bad++ == 0 || !(excess <= worst_excess)) {
      worst = static_cast<int64_t>(e);
      worst_excess = std::isnan(excess) ? std::numeric_limits<double>::infinity() : excess;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << got.data.size() << " elements off by more than " << tol.atol << " + "
         << tol.rtol << " * |want|; worst at " << IndexString(got.shape, worst) << ": got "
         << got.data[worst] << ", want " << want.data[worst];
}

// The backend under test and the reference, shared by every test of a suite.
class DifferentialFixture : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    reference_ = CreateEngine(Backend::kReference).release();
    under_test_ = CreateEngine(kBackendUnderTest).release();
  }
  static void TearDownTestSuite() {
    delete reference_;
    delete under_test_;
    reference_ = under_test_ = nullptr;
  }

  static std::unique_ptr<Engine> CreateEngine(Backend backend) {
    auto engine = Engine::Create(EngineOptions{.backend = backend});
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? std::move(engine).value() : nullptr;
  }

  static AttentionResult Attend(const Engine* engine, const AttentionArgs& args) {
    if (engine == nullptr) {
      ADD_FAILURE() << "no engine";
      return {};
    }
    auto result = engine->Attend(args);
    EXPECT_TRUE(result.ok()) << engine->backend_name() << ": " << result.status();
    return result.ok() ? std::move(result).value() : AttentionResult{};
  }

  static void ExpectMatchesReference(const CaseSpec& spec) {
    SCOPED_TRACE(Describe(spec));
    const RandomCase c(spec);
    const AttentionResult want = Attend(reference_, c.args());
    const AttentionResult got = Attend(under_test_, c.args());
    const Tolerances tol = TolerancesFor(spec);
    EXPECT_TRUE(Close(got.output, want.output, tol.output)) << "output";
    EXPECT_TRUE(Close(got.weights, want.weights, tol.weights)) << "weights";
  }

  static Engine* reference_;
  static Engine* under_test_;
};

Engine* DifferentialFixture::reference_ = nullptr;
Engine* DifferentialFixture::under_test_ = nullptr;

class DifferentialTest : public DifferentialFixture,
                         public ::testing::WithParamInterface<CaseSpec> {};

TEST_P(DifferentialTest, MatchesReference) { ExpectMatchesReference(GetParam()); }

CaseSpec Base(uint32_t seed, int64_t batch, int64_t heads, int64_t query_len, int64_t key_len,
              int64_t dim) {
  CaseSpec s;
  s.seed = seed;
  s.batch = batch;
  s.heads = heads;
  s.query_len = query_len;
  s.key_len = key_len;
  s.query_dim = dim;
  return s;
}

// Named variations of one base spec, each with its own seed; every variation
// runs twice: with weights (the matmul path) and without (the fused path).
class Variations {
 public:
  explicit Variations(const CaseSpec& base) : base_(base) {}

  template <typename Set>
  void Add(const std::string& name, Set&& set) {
    CaseSpec s = base_;
    s.seed = base_.seed + static_cast<uint32_t>(specs_.size());
    set(s);
    for (bool need_weights : {true, false}) {
      s.need_weights = need_weights;
      s.name = absl::StrCat(name, need_weights ? "_Weights" : "_Fused");
      specs_.push_back(s);
    }
  }

  std::vector<CaseSpec> specs() const { return specs_; }

 private:
  const CaseSpec base_;
  std::vector<CaseSpec> specs_;
};

std::vector<CaseSpec> ScoreCases() {
  Variations v(Base(10000, 2, 2, 37, 70, 17));
  auto add = [&](ScoreKind kind, const std::string& suffix, std::optional<double> scale,
                 std::optional<double> bandwidth = std::nullopt) {
    v.Add(absl::StrCat(ScoreName(kind), suffix), [&](CaseSpec& s) {
      s.score = kind;
      s.scale = scale;
      s.bandwidth = bandwidth;
      if (kind == ScoreKind::kAdditive) {
        s.query_dim = 5;
        s.key_dim = 7;
        s.value_dim = 3;
        s.hidden = 9;
      } else if (kind == ScoreKind::kBilinear) {
        s.key_dim = 33;
        s.value_dim = 4;
      }
    });
  };
  const std::pair<ScoreKind, double> custom_scales[] = {
      {ScoreKind::kScaledDot, 0.37}, {ScoreKind::kDot, 0.5},    {ScoreKind::kAdditive, 1.7},
      {ScoreKind::kBilinear, 0.25},  {ScoreKind::kCosine, 5.0}, {ScoreKind::kNegEuclidean, 0.3},
      {ScoreKind::kGaussian, 0.8}};
  for (const auto& [kind, scale] : custom_scales) {
    add(kind, "", std::nullopt);
    add(kind, "CustomScale", scale);
  }
  add(ScoreKind::kGaussian, "Bandwidth", std::nullopt, 0.45);
  add(ScoreKind::kGaussian, "NarrowBandwidth", std::nullopt, 4.5);
  for (ScoreKind kind : {ScoreKind::kCosine, ScoreKind::kNegEuclidean, ScoreKind::kGaussian}) {
    v.Add(absl::StrCat(ScoreName(kind), "SelfAttention"), [&](CaseSpec& s) {
      s.score = kind;
      s.self_attention = true;
      s.key_len = s.query_len;
    });
  }
  return v.specs();
}

// Key lengths around typical block sizes, query lengths across query blocks,
// odd head dims.
std::vector<CaseSpec> ShapeCases() {
  struct Shape {
    int64_t l, s, d;
  };
  const Shape shapes[] = {{1, 1, 1},     {1, 7, 3},       {3, 1, 17},     {5, 63, 33},
                          {17, 65, 64},  {64, 129, 8},    {1, 257, 33},   {129, 511, 17},
                          {33, 513, 64}, {200, 1000, 32}, {128, 128, 64}, {127, 64, 3},
                          {129, 1, 8},   {257, 7, 1},     {300, 300, 80}, {513, 65, 17}};
  Variations v(Base(20000, 2, 2, 1, 1, 1));
  for (const Shape& sh : shapes) {
    v.Add(absl::StrCat("L", sh.l, "_S", sh.s, "_D", sh.d), [&](CaseSpec& s) {
      s.query_len = sh.l;
      s.key_len = sh.s;
      s.query_dim = sh.d;
      if (s.Cost() > 2e7) s.batch = 1;
    });
  }
  return v.specs();
}

std::vector<CaseSpec> MaskCases() {
  Variations v(Base(30000, 3, 2, 70, 150, 16));
  for (DType dtype : {DType::kInt64, DType::kInt32}) {
    for (Lens lens : {Lens::kPerBatch, Lens::kPerRow}) {
      v.Add(absl::StrCat(lens == Lens::kPerBatch ? "ValidLensPerBatch" : "ValidLensPerRow",
                         DTypeName(dtype)),
            [&](CaseSpec& s) {
              s.lens = lens;
              s.lens_dtype = dtype;
            });
    }
  }
  for (const char* pattern : {"BS", "1S"}) {
    for (Fill fill : kFills) {
      v.Add(absl::StrCat("KeyPadding_", pattern, "_", FillName(fill)), [&](CaseSpec& s) {
        s.key_padding = pattern;
        s.key_padding_fill = fill;
      });
    }
  }
  for (const char* pattern : {"LS", "1S", "L1", "11", "BLS", "1LS", "B1S", "BL1", "BHLS", "1HLS",
                              "B1LS", "BH1S", "11LS", "1H1S"}) {
    for (Fill fill : kFills) {
      v.Add(absl::StrCat("AttnMask_", pattern, "_", FillName(fill)), [&](CaseSpec& s) {
        s.attn_mask = pattern;
        s.attn_mask_fill = fill;
      });
    }
  }
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    v.Add(absl::StrCat("FloatMasks", DTypeName(dtype)), [&](CaseSpec& s) {
      s.key_padding = "BS";
      s.key_padding_fill = Fill::kFloatNegInf;
      s.attn_mask = "BHLS";
      s.attn_mask_fill = Fill::kFloat;
      s.float_mask_dtype = dtype;
    });
  }
  struct Lengths {
    int64_t l, s;
  };
  for (Causal causal : {Causal::kTopLeft, Causal::kBottomRight}) {
    for (Lengths len : {Lengths{70, 150}, Lengths{150, 150}, Lengths{200, 65}, Lengths{1, 129},
                        Lengths{129, 1}, Lengths{300, 513}}) {
      v.Add(absl::StrCat("Causal_", CausalName(causal), "_L", len.l, "_S", len.s),
            [&](CaseSpec& s) {
              s.causal = causal;
              s.query_len = len.l;
              s.key_len = len.s;
              if (s.Cost() > 2e7) s.batch = 1;
            });
    }
  }
  for (int64_t tail : {1, 2}) {
    v.Add(absl::StrCat("UnmaskedTail", tail, "_AllMasks"), [&](CaseSpec& s) {
      s.unmasked_tail = tail;
      s.lens = Lens::kPerRow;
      s.key_padding = "BS";
      s.attn_mask = "BHLS";
      s.attn_mask_fill = Fill::kFloatNegInf;
    });
    for (Causal causal : {Causal::kTopLeft, Causal::kBottomRight}) {
      v.Add(absl::StrCat("UnmaskedTail", tail, "_Causal_", CausalName(causal)), [&](CaseSpec& s) {
        s.unmasked_tail = tail;
        s.causal = causal;
        s.key_len = 600;
        s.query_len = 130;
        s.key_padding = "1S";
        s.key_padding_fill = Fill::kBoolRuns;
      });
    }
  }
  v.Add("LongKeys_ValidLens", [](CaseSpec& s) {
    s.key_len = 1100;
    s.lens = Lens::kPerRow;
  });
  v.Add("LongKeys_MaskedRuns", [](CaseSpec& s) {
    s.key_len = 1100;
    s.key_padding = "BS";
    s.key_padding_fill = Fill::kBoolRuns;
    s.attn_mask = "BHLS";
    s.attn_mask_fill = Fill::kBoolRuns;
  });
  v.Add("Combined_ValidLensKeyPaddingAttnMask", [](CaseSpec& s) {
    s.lens = Lens::kPerRow;
    s.key_padding = "BS";
    s.attn_mask = "BHLS";
    s.attn_mask_fill = Fill::kFloat;
  });
  v.Add("Combined_AllWithTopLeft", [](CaseSpec& s) {
    s.lens = Lens::kPerBatch;
    s.lens_dtype = DType::kInt32;
    s.key_padding = "BS";
    s.key_padding_fill = Fill::kFloat;
    s.attn_mask = "LS";
    s.attn_mask_fill = Fill::kFloatNegInf;
    s.causal = Causal::kTopLeft;
  });
  v.Add("Combined_AllWithBottomRightLongQuery", [](CaseSpec& s) {
    s.query_len = 200;
    s.key_len = 130;
    s.lens = Lens::kPerRow;
    s.key_padding = "1S";
    s.attn_mask = "B1LS";
    s.causal = Causal::kBottomRight;
  });
  return v.specs();
}

std::vector<CaseSpec> LayoutCases() {
  Variations v(Base(40000, 3, 4, 33, 65, 9));
  for (int64_t heads : {1, 2, 4}) {
    v.Add(absl::StrCat("Rank3Heads", heads), [&](CaseSpec& s) { s.heads = heads; });
  }
  v.Add("Rank3DifferentHeadDims", [](CaseSpec& s) { s.value_dim = 5; });
  for (int64_t kv_heads : {4, 2, 1}) {
    v.Add(absl::StrCat("Rank4Heads4KvHeads", kv_heads), [&](CaseSpec& s) {
      s.rank4 = true;
      s.kv_heads = kv_heads;
    });
  }
  v.Add("Rank4Heads6KvHeads3", [](CaseSpec& s) {
    s.rank4 = true;
    s.heads = 6;
    s.kv_heads = 3;
    s.value_dim = 17;
  });
  v.Add("Rank4GroupedWithMasks", [](CaseSpec& s) {
    s.rank4 = true;
    s.kv_heads = 2;
    s.attn_mask = "BHLS";
    s.lens = Lens::kPerRow;
    s.causal = Causal::kBottomRight;
  });
  v.Add("Rank4GroupedAveragedWeights", [](CaseSpec& s) {
    s.rank4 = true;
    s.kv_heads = 1;
    s.average_weights = true;
    s.query_batch_of_one = true;
  });
  for (ScoreKind kind : kScoreKinds) {
    v.Add(absl::StrCat("QueryBatchOfOne", ScoreName(kind)), [&](CaseSpec& s) {
      s.score = kind;
      s.query_batch_of_one = true;
    });
    v.Add(absl::StrCat("KeyBatchOfOne", ScoreName(kind)), [&](CaseSpec& s) {
      s.score = kind;
      s.key_batch_of_one = true;
    });
  }
  v.Add("ValueBatchOfOne", [](CaseSpec& s) { s.value_batch_of_one = true; });
  v.Add("KeyValueBatchOfOne", [](CaseSpec& s) {
    s.key_batch_of_one = true;
    s.value_batch_of_one = true;
  });
  v.Add("ValueBatchOfOneRank4", [](CaseSpec& s) {
    s.rank4 = true;
    s.kv_heads = 1;
    s.value_batch_of_one = true;
  });
  v.Add("SequenceFirst", [](CaseSpec& s) { s.layout = Layout::kSequenceFirst; });
  v.Add("SequenceFirstBroadcastWithMasks", [](CaseSpec& s) {
    s.layout = Layout::kSequenceFirst;
    s.key_batch_of_one = true;
    s.key_padding = "BS";
    s.attn_mask = "LS";
  });
  v.Add("ValueOmitted", [](CaseSpec& s) { s.value_omitted = true; });
  v.Add("ValueOmittedKeyBatchOfOne", [](CaseSpec& s) {
    s.value_omitted = true;
    s.key_batch_of_one = true;
  });
  v.Add("SelfAttention", [](CaseSpec& s) {
    s.self_attention = true;
    s.key_len = s.query_len;
  });
  return v.specs();
}

std::vector<CaseSpec> OptionCases() {
  Variations v(Base(50000, 2, 3, 65, 130, 64));
  v.Add("AverageWeights", [](CaseSpec& s) { s.average_weights = true; });
  v.Add("AverageWeightsMasked", [](CaseSpec& s) {
    s.average_weights = true;
    s.attn_mask = "BHLS";
    s.lens = Lens::kPerBatch;
  });
  for (int percent : {10, 50, 100}) {
    v.Add(absl::StrCat("Dropout", percent), [&](CaseSpec& s) { s.dropout_p = percent / 100.0; });
  }
  v.Add("DropoutMaskedAveraged", [](CaseSpec& s) {
    s.dropout_p = 0.3;
    s.average_weights = true;
    s.causal = Causal::kTopLeft;
    s.key_padding = "BS";
  });
  v.Add("DropoutLongKeysMasked", [](CaseSpec& s) {
    s.dropout_p = 0.4;
    s.key_len = 1100;
    s.query_dim = 16;
    s.key_padding = "BS";
    s.key_padding_fill = Fill::kBoolRuns;
  });
  v.Add("LargeLogitsLongKeys", [](CaseSpec& s) {
    s.score = ScoreKind::kDot;
    s.scale = 4.0;
    s.key_len = 1100;
  });
  v.Add("DropoutGroupedLongQuery", [](CaseSpec& s) {
    s.dropout_p = 0.2;
    s.rank4 = true;
    s.heads = 4;
    s.kv_heads = 2;
    s.query_len = 200;
    s.query_dim = 32;
  });
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    v.Add(absl::StrCat("Inputs", DTypeName(dtype)), [&](CaseSpec& s) { s.dtype = dtype; });
    v.Add(absl::StrCat("Inputs", DTypeName(dtype), "Masked"), [&](CaseSpec& s) {
      s.dtype = dtype;
      s.causal = Causal::kBottomRight;
      s.key_padding = "BS";
    });
  }
  return v.specs();
}

// bf16 math for every score kind on D = 64 N(0, 1) inputs.
std::vector<CaseSpec> FastCases() {
  Variations v(Base(60000, 2, 2, 129, 257, 64));
  for (ScoreKind kind : kScoreKinds) {
    v.Add(absl::StrCat("Fast", ScoreName(kind)), [&](CaseSpec& s) {
      s.score = kind;
      s.fast = true;
      if (kind == ScoreKind::kAdditive) {
        s.hidden = 16;
        s.key_len = 65;
      }
      if (kind == ScoreKind::kGaussian) s.bandwidth = 0.2;
    });
  }
  v.Add("FastMasked", [](CaseSpec& s) {
    s.fast = true;
    s.causal = Causal::kTopLeft;
    s.lens = Lens::kPerRow;
    s.attn_mask = "BHLS";
    s.attn_mask_fill = Fill::kFloatNegInf;
  });
  v.Add("FastDropout", [](CaseSpec& s) {
    s.fast = true;
    s.dropout_p = 0.25;
  });
  v.Add("BFloat16InputsLongKeys", [](CaseSpec& s) {
    s.dtype = DType::kBFloat16;
    s.key_len = 1000;
  });
  return v.specs();
}

template <typename T>
T Pick(std::mt19937& rng, std::initializer_list<T> values) {
  std::uniform_int_distribution<size_t> index(0, values.size() - 1);
  return values.begin()[index(rng)];
}

// A spec drawn at random from `seed`, with reference cost under ~5e6.
CaseSpec FuzzCase(uint32_t seed) {
  std::mt19937 rng(seed);
  std::bernoulli_distribution coin(0.5), often(0.3), rarely(0.15);
  CaseSpec s;
  s.name = absl::StrCat("Seed", seed);
  s.seed = seed;
  s.rank4 = often(rng);
  s.score = kScoreKinds[std::uniform_int_distribution<size_t>(0, std::size(kScoreKinds) - 1)(rng)];
  do {
    s.batch = Pick<int64_t>(rng, {1, 2, 3});
    s.heads = Pick<int64_t>(rng, {1, 2, 3, 4});
    s.query_len = Pick<int64_t>(rng, {1, 2, 5, 16, 33, 64, 127, 128, 129, 200});
    s.key_len = Pick<int64_t>(rng, {1, 3, 7, 63, 64, 65, 129, 257, 511, 513, 1000});
    s.query_dim = Pick<int64_t>(rng, {1, 3, 8, 17, 32, 33, 64, 80});
    s.value_dim = Pick<int64_t>(rng, {0, 0, 1, 5, 16, 33});
    s.hidden = Pick<int64_t>(rng, {1, 4, 16});
    if (s.score == ScoreKind::kAdditive || s.score == ScoreKind::kBilinear) {
      s.key_dim = Pick<int64_t>(rng, {0, 1, 4, 9});
    }
    s.self_attention = rarely(rng) && s.Dk() == s.query_dim && s.Dv() == s.query_dim;
    if (s.self_attention) s.key_len = s.query_len;
  } while (s.Cost() > 5e6);
  if (s.rank4 && !s.self_attention) {
    s.kv_heads = s.heads % 2 == 0 && coin(rng) ? s.heads / 2 : Pick<int64_t>(rng, {0, 1});
  } else if (!s.rank4 && rarely(rng)) {
    s.layout = Layout::kSequenceFirst;
  }
  s.value_omitted = !s.self_attention && s.Dv() == s.Dk() && rarely(rng);
  s.key_batch_of_one = !s.self_attention && rarely(rng);
  s.value_batch_of_one = s.value_omitted ? s.key_batch_of_one : !s.self_attention && rarely(rng);
  s.query_batch_of_one =
      !s.self_attention && !(s.key_batch_of_one && s.value_batch_of_one) && rarely(rng);
  if (often(rng)) s.scale = std::uniform_real_distribution<double>(0.05, 2.0)(rng);
  if (s.score == ScoreKind::kGaussian && coin(rng)) {
    s.bandwidth = std::uniform_real_distribution<double>(0.1, 2.0)(rng);
  }
  if (often(rng)) s.lens = coin(rng) ? Lens::kPerBatch : Lens::kPerRow;
  s.lens_dtype = coin(rng) ? DType::kInt64 : DType::kInt32;
  const auto fill = [&] { return kFills[std::uniform_int_distribution<size_t>(0, 3)(rng)]; };
  if (often(rng)) s.key_padding = Pick<const char*>(rng, {"BS", "1S"});
  s.key_padding_fill = fill();
  if (often(rng)) {
    s.attn_mask = Pick<const char*>(rng, {"LS", "1S", "L1", "BLS", "1LS", "BHLS", "1HLS", "B1LS"});
  }
  s.attn_mask_fill = fill();
  s.causal = Pick(rng, {Causal::kNone, Causal::kNone, Causal::kTopLeft, Causal::kBottomRight});
  if (s.key_len > 2 && rarely(rng)) s.unmasked_tail = Pick<int64_t>(rng, {1, 2});
  s.need_weights = coin(rng);
  s.average_weights = often(rng);
  if (rarely(rng)) s.dropout_p = Pick(rng, {0.1, 0.5});
  s.dtype = Pick(rng, {DType::kFloat32, DType::kFloat32, DType::kFloat32, DType::kFloat32,
                       DType::kBFloat16, DType::kFloat16});
  s.fast = rarely(rng);
  return s;
}

std::vector<CaseSpec> FuzzCases() {
  std::vector<CaseSpec> specs;
  for (uint32_t seed = 1; seed <= 200; ++seed) specs.push_back(FuzzCase(seed));
  return specs;
}

std::string SpecName(const ::testing::TestParamInfo<CaseSpec>& info) { return info.param.name; }

INSTANTIATE_TEST_SUITE_P(Scores, DifferentialTest, ::testing::ValuesIn(ScoreCases()), SpecName);
INSTANTIATE_TEST_SUITE_P(Shapes, DifferentialTest, ::testing::ValuesIn(ShapeCases()), SpecName);
INSTANTIATE_TEST_SUITE_P(Masks, DifferentialTest, ::testing::ValuesIn(MaskCases()), SpecName);
INSTANTIATE_TEST_SUITE_P(Layouts, DifferentialTest, ::testing::ValuesIn(LayoutCases()), SpecName);
INSTANTIATE_TEST_SUITE_P(Options, DifferentialTest, ::testing::ValuesIn(OptionCases()), SpecName);
INSTANTIATE_TEST_SUITE_P(Fast, DifferentialTest, ::testing::ValuesIn(FastCases()), SpecName);
INSTANTIATE_TEST_SUITE_P(Fuzz, DifferentialTest, ::testing::ValuesIn(FuzzCases()), SpecName);

using DifferentialMemoryTest = DifferentialFixture;

// Outputs reuse the memory of earlier outputs (blocks of 1 MiB and more)
// without clearing it: rows that no key reaches must still come back as zeros
// after a call that filled that memory.
TEST_F(DifferentialMemoryTest, FullyMaskedRowsAreZeroInReusedOutputMemory) {
  CaseSpec weights = Base(70000, 2, 2, 256, 1100, 16);
  weights.name = "ReusedWeights";
  weights.value_dim = 8;
  weights.lens = Lens::kPerBatch;
  CaseSpec output = Base(70001, 2, 2, 256, 64, 16);
  output.name = "ReusedOutput";
  output.value_dim = 256;
  output.causal = Causal::kBottomRight;
  for (CaseSpec spec : {weights, output}) {
    for (bool need_weights : {true, false}) {
      spec.need_weights = need_weights;
      CaseSpec unmasked = spec;
      unmasked.lens = Lens::kNone;
      unmasked.causal = Causal::kNone;
      Attend(under_test_, RandomCase(unmasked).args());
      ExpectMatchesReference(spec);
    }
  }
}

// The engine runs calls one at a time on its compute thread, so callers on many
// threads get exactly what one caller gets.
TEST(EngineConcurrencyTest, ConcurrentCallersGetTheSequentialResults) {
  constexpr int kThreads = 4, kCallsPerThread = 20, kCases = 8;
  auto engine = Engine::Create(EngineOptions{.backend = kBackendUnderTest});
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<CaseSpec> specs;
  std::vector<std::unique_ptr<RandomCase>> cases;
  std::vector<AttentionResult> sequential;
  for (uint32_t seed = 1001; seed <= 1000 + kCases; ++seed) {
    specs.push_back(FuzzCase(seed));
    cases.push_back(std::make_unique<RandomCase>(specs.back()));
    auto result = (*engine)->Attend(cases.back()->args());
    ASSERT_TRUE(result.ok()) << result.status();
    sequential.push_back(std::move(result).value());
  }
  std::vector<std::vector<absl::StatusOr<AttentionResult>>> concurrent(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int c = 0; c < kCallsPerThread; ++c) {
        concurrent[t].push_back((*engine)->Attend(cases[(t + c) % kCases]->args()));
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) {
    for (int c = 0; c < kCallsPerThread; ++c) {
      const int k = (t + c) % kCases;
      SCOPED_TRACE(absl::StrCat("thread ", t, " call ", c, ": ", Describe(specs[k])));
      const absl::StatusOr<AttentionResult>& got = concurrent[t][c];
      ASSERT_TRUE(got.ok()) << got.status();
      const AttentionResult& want = sequential[k];
      EXPECT_TRUE(Close(got->output, want.output, kIdentical)) << "output";
      EXPECT_TRUE(Close(got->weights, want.weights, kIdentical)) << "weights";
    }
  }
}

}  // namespace
}  // namespace attention
