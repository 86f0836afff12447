#include "engine/engine.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/types/span.h"
#include "common/half.h"
#include "common/mib_string.h"
#include "engine/attention.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/random_tensor.h"
#include "tests/status_matchers.h"

namespace attention {
namespace {

using ::testing::HasSubstr;
using testing::StatusIs;

// A tensor that owns its bytes.
struct Owned {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::string bytes;

  TensorView view() const { return TensorView{dtype, shape, bytes.data(), bytes.size()}; }
};

template <typename T>
Owned Make(DType dtype, std::vector<int64_t> shape, absl::Span<const T> values) {
  Owned t{dtype, std::move(shape), std::string(values.size() * sizeof(T), '\0')};
  if (!values.empty()) std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
  return t;
}

Owned Floats(std::vector<int64_t> shape, absl::Span<const float> v) {
  return Make<float>(DType::kFloat32, std::move(shape), v);
}

Owned Random(std::vector<int64_t> shape, uint32_t seed) {
  const testing::FloatTensor t = testing::RandomFloats(std::move(shape), seed);
  return Floats(t.shape, t.values);
}

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto engine = Engine::Create(EngineOptions{});
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(engine).value();
  }

  AttentionResult Run(const AttentionArgs& args) {
    auto r = engine_->Attend(args);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? std::move(r).value() : AttentionResult{};
  }

  // B=2, H=2, L=3, S=5, E=8 self-contained raw attention with weights.
  AttentionArgs Basic() {
    AttentionArgs a;
    a.query = q_.view();
    a.key = k_.view();
    a.value = v_.view();
    a.num_heads = 2;
    a.need_weights = true;
    return a;
  }

  std::unique_ptr<Engine> engine_;
  Owned q_ = Random({2, 3, 8}, 1), k_ = Random({2, 5, 8}, 2), v_ = Random({2, 5, 8}, 3);
};

void ExpectNear(absl::Span<const float> got, absl::Span<const float> want, float tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << "element " << i;
}

TEST_F(EngineTest, DropoutIsReproducibleFromTheSeed) {
  AttentionArgs a = Basic();
  a.dropout_p = 0.5;
  a.seed = 42;
  AttentionResult first = Run(a), second = Run(a);
  EXPECT_EQ(first.weights.data, second.weights.data);
  EXPECT_EQ(first.output.data, second.output.data);
  a.seed = 43;
  EXPECT_NE(Run(a).weights.data, first.weights.data);
}

TEST_F(EngineTest, DropoutKeepsAboutOneMinusPAndScalesSurvivors) {
  Owned q = Random({1, 64, 16}, 7), k = Random({1, 64, 16}, 8);
  AttentionArgs a;
  a.query = q.view();
  a.key = k.view();
  a.need_weights = true;
  const AttentionResult plain = Run(a);
  a.dropout_p = 0.3;
  a.seed = 9;
  const AttentionResult dropped = Run(a);
  size_t kept = 0;
  for (size_t i = 0; i < plain.weights.data.size(); ++i) {
    if (dropped.weights.data[i] == 0.0f) continue;
    ++kept;
    EXPECT_NEAR(dropped.weights.data[i], plain.weights.data[i] / 0.7f, 1e-6f) << "element " << i;
  }
  const double fraction = static_cast<double>(kept) / plain.weights.data.size();
  EXPECT_NEAR(fraction, 0.7, 0.02);  // 4096 draws: 0.02 is over 2.7 sigma
}

TEST_F(EngineTest, DropoutOfOneZeroesEverything) {
  AttentionArgs a = Basic();
  a.dropout_p = 1.0;
  const AttentionResult r = Run(a);
  for (float w : r.weights.data) EXPECT_EQ(w, 0.0f);
  for (float o : r.output.data) EXPECT_EQ(o, 0.0f);
}

TEST_F(EngineTest, OmittedKeyAndValueMeanSelfAttention) {
  AttentionArgs a = Basic();
  a.key = a.query;
  a.value = a.query;
  const AttentionResult explicit_kv = Run(a);
  a.key = {};
  a.value = {};
  const AttentionResult implicit_kv = Run(a);
  EXPECT_EQ(implicit_kv.output.data, explicit_kv.output.data);
  EXPECT_EQ(implicit_kv.weights.data, explicit_kv.weights.data);
}

TEST_F(EngineTest, AveragedWeightsAreTheMeanOverHeads) {
  AttentionArgs a = Basic();
  const AttentionResult split = Run(a);
  a.average_weights = true;
  const AttentionResult averaged = Run(a);
  ASSERT_EQ(averaged.weights.shape, (std::vector<int64_t>{2, 3, 5}));
  std::vector<float> mean(2 * 3 * 5, 0.0f);
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 15; ++i) mean[b * 15 + i] += split.weights.data[(b * 2 + h) * 15 + i] / 2;
  ExpectNear(averaged.weights.data, mean, 1e-6f);
}

TEST_F(EngineTest, SequenceFirstMatchesBatchFirstTransposed) {
  auto transpose = [](const Owned& t) {  // [B, P, E] <-> [P, B, E]
    const int64_t B = t.shape[0], P = t.shape[1], E = t.shape[2];
    std::vector<float> in(B * P * E), out(B * P * E);
    std::memcpy(in.data(), t.bytes.data(), t.bytes.size());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t p = 0; p < P; ++p)
        for (int64_t e = 0; e < E; ++e) out[(p * B + b) * E + e] = in[(b * P + p) * E + e];
    return Floats({P, B, E}, out);
  };
  const AttentionResult batch_first = Run(Basic());
  Owned q = transpose(q_), k = transpose(k_), v = transpose(v_);
  AttentionArgs a = Basic();
  a.query = q.view();
  a.key = k.view();
  a.value = v.view();
  a.layout = Layout::kSequenceFirst;
  const AttentionResult seq_first = Run(a);
  ASSERT_EQ(seq_first.output.shape, (std::vector<int64_t>{3, 2, 8}));
  Owned back = transpose(Floats(seq_first.output.shape, seq_first.output.data));
  std::vector<float> back_values(back.bytes.size() / 4);
  std::memcpy(back_values.data(), back.bytes.data(), back.bytes.size());
  ExpectNear(back_values, batch_first.output.data, 1e-6f);
  EXPECT_EQ(seq_first.weights.data, batch_first.weights.data);  // weights stay batch-first
}

TEST_F(EngineTest, HalfPrecisionInputsMatchTheirFloatValues) {
  auto to16 = [](const Owned& t, DType dtype) {
    std::vector<float> f(t.bytes.size() / 4);
    std::memcpy(f.data(), t.bytes.data(), t.bytes.size());
    std::vector<uint16_t> h(f.size());
    std::vector<float> rounded(f.size());
    for (size_t i = 0; i < f.size(); ++i) {
      h[i] = dtype == DType::kBFloat16 ? FloatToBFloat16(f[i]) : FloatToFloat16(f[i]);
      rounded[i] = dtype == DType::kBFloat16 ? BFloat16ToFloat(h[i]) : Float16ToFloat(h[i]);
    }
    return std::make_pair(Make<uint16_t>(dtype, t.shape, h), Floats(t.shape, rounded));
  };
  // FLOAT16 is widened to float32 math: exactly the float result of its values.
  auto [q16, qf] = to16(q_, DType::kFloat16);
  AttentionArgs a = Basic();
  a.query = q16.view();
  const AttentionResult half = Run(a);
  a.query = qf.view();
  EXPECT_EQ(half.output.data, Run(a).output.data);

  // BFLOAT16 inputs run bf16 matmuls (8-bit mantissa, float32 accumulation):
  // within bf16 rounding of the float result for these N(0, 1) inputs.
  auto [qb, qbf] = to16(q_, DType::kBFloat16);
  a.query = qb.view();
  const AttentionResult bf16 = Run(a);
  a.query = qbf.view();
  ExpectNear(bf16.output.data, Run(a).output.data, 2e-2f);
}

TEST_F(EngineTest, Int32ValidLensEqualInt64) {
  Owned lens64 = Make<int64_t>(DType::kInt64, {2}, {2, 4});
  Owned lens32 = Make<int32_t>(DType::kInt32, {2}, {2, 4});
  AttentionArgs a = Basic();
  a.mask.valid_lens = lens64.view();
  const AttentionResult r64 = Run(a);
  a.mask.valid_lens = lens32.view();
  EXPECT_EQ(Run(a).weights.data, r64.weights.data);
  EXPECT_EQ(r64.weights.data[4], 0.0f);  // b0 h0 i0 j4 is past len 2
}

TEST_F(EngineTest, PerHeadBoolMaskMasksOnlyItsHead) {
  std::vector<uint8_t> mask(2 * 2 * 3 * 5, 0);
  mask[(0 * 2 + 1) * 15 + 0 * 5 + 3] = 1;  // b0, h1, i0, j3
  Owned m = Make<uint8_t>(DType::kBool, {2, 2, 3, 5}, mask);
  AttentionArgs a = Basic();
  a.mask.attn_mask = m.view();
  const AttentionResult r = Run(a);
  EXPECT_EQ(r.weights.data[(0 * 2 + 1) * 15 + 3], 0.0f);
  EXPECT_GT(r.weights.data[(0 * 2 + 0) * 15 + 3], 0.0f);
}

TEST_F(EngineTest, BroadcastAttnMaskColumnAppliesToEveryRow) {
  Owned m = Make<uint8_t>(DType::kBool, {1, 5}, {0, 1, 0, 0, 1});
  AttentionArgs a = Basic();
  a.mask.attn_mask = m.view();
  const AttentionResult r = Run(a);
  for (size_t row = 0; row < r.weights.data.size() / 5; ++row) {
    EXPECT_EQ(r.weights.data[row * 5 + 1], 0.0f) << "row " << row;
    EXPECT_EQ(r.weights.data[row * 5 + 4], 0.0f) << "row " << row;
  }
}

TEST_F(EngineTest, FloatMaskOfMinusInfinityGivesAZeroRow) {
  const float inf = std::numeric_limits<float>::infinity();
  Owned m = Floats({2, 5}, {-inf, -inf, -inf, -inf, -inf, 0, 0, 0, 0, 0});
  AttentionArgs a = Basic();
  a.mask.key_padding_mask = m.view();
  const AttentionResult r = Run(a);
  for (int i = 0; i < 2 * 3 * 5; ++i) EXPECT_EQ(r.weights.data[i], 0.0f);  // batch 0
  for (int i = 0; i < 3 * 8; ++i) EXPECT_EQ(r.output.data[i], 0.0f);
  EXPECT_NE(r.output.data[3 * 8], 0.0f);
}

TEST_F(EngineTest, NoWeightsUnlessAsked) {
  AttentionArgs a = Basic();
  a.need_weights = false;
  const AttentionResult r = Run(a);
  EXPECT_TRUE(r.weights.shape.empty());
  EXPECT_TRUE(r.weights.data.empty());
  EXPECT_EQ(r.output.shape, (std::vector<int64_t>{2, 3, 8}));
}

TEST_F(EngineTest, RejectsMismatchedHeadDim) {
  Owned k = Random({2, 5, 6}, 4);
  AttentionArgs a = Basic();
  a.key = k.view();
  a.num_heads = 1;
  EXPECT_THAT(engine_->Attend(a), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("key: head dim 6")));
}

TEST_F(EngineTest, RejectsValidLensBeyondKeyLength) {
  Owned lens = Make<int64_t>(DType::kInt64, {2}, {2, 6});
  AttentionArgs a = Basic();
  a.mask.valid_lens = lens.view();
  EXPECT_THAT(engine_->Attend(a),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("mask.valid_lens: element 1 is 6")));
}

TEST_F(EngineTest, RejectsScoreParameterTheKindDoesNotUse) {
  Owned w = Random({4, 4}, 5);
  AttentionArgs a = Basic();
  a.score.w = w.view();
  EXPECT_THAT(engine_->Attend(a), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("score.w")));
}

TEST_F(EngineTest, RejectsDropoutOutsideUnitInterval) {
  AttentionArgs a = Basic();
  a.dropout_p = 1.5;
  EXPECT_THAT(engine_->Attend(a), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dropout_p")));
  a.dropout_p = std::nan("");
  EXPECT_THAT(engine_->Attend(a), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dropout_p")));
}

TEST_F(EngineTest, RejectsShapeWhoseProductOverflows) {
  Owned q = Floats({int64_t{1} << 40, int64_t{1} << 40, int64_t{1} << 40}, {1.0f});
  AttentionArgs a;
  a.query = q.view();
  EXPECT_THAT(engine_->Attend(a), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("query: shape")));
}

TEST_F(EngineTest, EnforcesTheScoreElementLimitOnCallsThatReturnWeights) {
  auto small = Engine::Create(EngineOptions{.max_score_elements = 10});
  ASSERT_TRUE(small.ok());
  AttentionArgs with_weights = Basic();
  with_weights.need_weights = true;
  EXPECT_THAT((*small)->Attend(with_weights),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("need_weights: B*H*L*S = 2*2*3*5")));
  EXPECT_EQ(RequestOverLimit((*small)->Attend(with_weights).status()), "max_score_elements");
  // Without weights the scores are computed in blocks and never held.
  AttentionArgs without = Basic();
  without.need_weights = false;
  EXPECT_TRUE((*small)->Attend(without).ok());
}

TEST_F(EngineTest, EnforcesTheRequestMemoryAndComputeLimits) {
  AttentionArgs args = Basic();
  args.need_weights = true;
  absl::StatusOr<CallCost> cost = engine_->CostOf({&args, nullptr});
  ASSERT_TRUE(cost.ok()) << cost.status();
  EXPECT_GT(cost->flops, 0);
  EXPECT_GT(cost->weights_elements, 0);

  auto no_memory = Engine::Create(EngineOptions{.max_request_bytes = 1024});
  ASSERT_TRUE(no_memory.ok());
  EXPECT_THAT((*no_memory)->Attend(args),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("MiB per request")));
  EXPECT_EQ(RequestOverLimit((*no_memory)->Attend(args).status()), "max_request_mb");
  // Rounded to 0.1 MiB, 8.04 MiB over 8 would read "8.0 over 8.0", and a
  // 16 KB output "0": then the exact bytes, and three digits.
  EXPECT_EQ(MiBString(16000), "0.0153");
  EXPECT_EQ(MiBString(0), "0");
  EXPECT_EQ(MiBString(1610612736), "1536.0");
  const MiBPair close = MiBOverLimit(8430000, 8388608);
  EXPECT_EQ(close.bytes, "8.0 MiB (8430000 bytes)");
  EXPECT_EQ(close.limit, "8.0 MiB (8388608 bytes)");
  EXPECT_EQ(MiBOverLimit(16 << 20, 8 << 20).bytes, "16.0 MiB");
  auto no_compute = Engine::Create(EngineOptions{.max_request_flops = 10});
  ASSERT_TRUE(no_compute.ok());
  EXPECT_THAT((*no_compute)->Attend(args),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("GFLOP per request")));
  EXPECT_EQ(RequestOverLimit((*no_compute)->Attend(args).status()), "max_request_gflop");
  EXPECT_THAT(Engine::Create(EngineOptions{.max_request_bytes = -1}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(">= 0")));
}

TEST_F(EngineTest, EnforcesTheTensorElementLimit) {
  auto small = Engine::Create(EngineOptions{.max_tensor_elements = 40});
  ASSERT_TRUE(small.ok());
  EXPECT_THAT((*small)->Attend(Basic()),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("query: 48 elements")));
  EXPECT_EQ(RequestOverLimit((*small)->Attend(Basic()).status()), "max_tensor_elements");
  // Only those errors name a limit; the wire never carries it.
  EXPECT_EQ(RequestOverLimit(absl::ResourceExhaustedError("queue full")), "");
  EXPECT_EQ(RequestOverLimit(absl::OkStatus()), "");
  absl::Status marked = OverLimitError("max_tensor_elements", "x");
  EXPECT_EQ(RequestOverLimit(absl::Status(absl::StatusCode::kInternal, marked.message())), "");
}

// Regression (hostile_input_test): a query row whose scores were all NaN
// counted as fully masked and got zeros, and the fused path turned any NaN row
// sum into zeros. A NaN now makes its row NaN, as in PyTorch, on both
// backends, both paths, float32 and bfloat16 inputs (docs/errors.md, "Non-finite numbers").
TEST(EngineNanTest, ANanInAQueryMakesItsRowNanAndNoOther) {
  constexpr int64_t B = 2, L = 3, S = 5, E = 8, H = 2, D = E / H;
  std::vector<float> q(B * L * E, 0.5f);
  for (size_t i = 0; i < q.size(); ++i) q[i] = 0.1f * static_cast<float>(i % 7);
  q[(0 * L + 1) * E + 3] = std::numeric_limits<float>::quiet_NaN();  // b 0, row 1, head 0
  std::vector<uint16_t> q16(q.size());
  for (size_t i = 0; i < q.size(); ++i) q16[i] = FloatToBFloat16(q[i]);
  const Owned k = Random({B, S, E}, 2), v = Random({B, S, E}, 3);
  for (const Backend backend : {Backend::kReference, Backend::kOneDnn}) {
    auto engine = Engine::Create(EngineOptions{.backend = backend});
    ASSERT_TRUE(engine.ok()) << engine.status();
    for (const bool need_weights : {false, true}) {
      for (const bool bf16 : {false, true}) {
        SCOPED_TRACE(::testing::Message() << (*engine)->backend_name() << " need_weights "
                                          << need_weights << " bf16 " << bf16);
        const Owned query = bf16 ? Make<uint16_t>(DType::kBFloat16, {B, L, E}, q16)
                                 : Floats({B, L, E}, q);
        AttentionArgs a;
        a.query = query.view();
        a.key = k.view();
        a.value = v.view();
        a.num_heads = H;
        a.need_weights = need_weights;
        absl::StatusOr<AttentionResult> r = (*engine)->Attend(a);
        ASSERT_TRUE(r.ok()) << r.status();
        for (int64_t b = 0; b < B; ++b) {
          for (int64_t i = 0; i < L; ++i) {
            for (int64_t h = 0; h < H; ++h) {
              const bool nan = b == 0 && i == 1 && h == 0;
              for (int64_t d = 0; d < D; ++d) {
                const float x = r->output.data[(b * L + i) * E + h * D + d];
                EXPECT_EQ(nan ? std::isnan(x) : std::isfinite(x), true)
                    << b << " " << i << " " << h << " " << d << ": " << x;
              }
              if (!need_weights) continue;
              for (int64_t j = 0; j < S; ++j) {
                const float w = r->weights.data[((b * H + h) * L + i) * S + j];
                EXPECT_EQ(std::isnan(w), nan) << b << " " << i << " " << h << " " << j;
              }
            }
          }
        }
      }
    }
  }
}

// How often `a`, never interrupted, polls its interrupt (-1: it failed); its
// answer must be the one computed without an interrupt.
int PollsWithoutStopping(Engine& engine, const AttentionArgs& a) {
  int polls = 0;
  const std::function<absl::Status()> count = [&] {
    ++polls;
    return absl::OkStatus();
  };
  std::vector<absl::StatusOr<AttentionResult>> whole =
      engine.AttendBatch(std::vector<EngineCall>{{.args = &a, .interrupt = &count}});
  absl::StatusOr<AttentionResult> plain = engine.Attend(a);
  if (whole.size() != 1 || !whole[0].ok() || !plain.ok()) {
    ADD_FAILURE() << whole.size() << " results; "
                  << (whole.empty() ? absl::OkStatus() : whole[0].status()) << "; "
                  << plain.status();
    return -1;
  }
  EXPECT_EQ(whole[0]->output.data, plain->output.data);
  EXPECT_EQ(whole[0]->weights.data, plain->weights.data);
  return polls;
}

// `a` with an interrupt whose `n`-th poll says `stop`: that status is the
// call's result, and it polls no more.
void ExpectStoppedAtPoll(Engine& engine, const AttentionArgs& a, int n, const absl::Status& stop) {
  int polls = 0;
  const std::function<absl::Status()> stop_at = [&] {
    return ++polls >= n ? stop : absl::OkStatus();
  };
  std::vector<absl::StatusOr<AttentionResult>> stopped =
      engine.AttendBatch(std::vector<EngineCall>{{.args = &a, .interrupt = &stop_at}});
  ASSERT_EQ(stopped.size(), 1u);
  EXPECT_EQ(stopped[0].status(), stop);
  EXPECT_EQ(polls, n);
}

// The reference backend polls a call's interrupt as the oneDNN backend does
// between its work items, before each block of 64 query rows of each head,
// not only before the call: a caller that left, or a deadline that passed,
// stops a long call part way.
TEST(ReferenceInterruptTest, StopsPartWayAtTheFirstNonOkPoll) {
  auto engine = Engine::Create(EngineOptions{.backend = Backend::kReference});
  ASSERT_TRUE(engine.ok()) << engine.status();
  constexpr int64_t B = 2, H = 2, L = 130, S = 16, E = 8;  // 3 blocks of rows per head
  const Owned q = Random({B, L, E}, 1), k = Random({B, S, E}, 2), v = Random({B, S, E}, 3);
  AttentionArgs a;
  a.query = q.view();
  a.key = k.view();
  a.value = v.view();
  a.num_heads = H;
  a.need_weights = true;
  // Polled once per block of rows of each head of each batch row.
  EXPECT_EQ(PollsWithoutStopping(**engine, a), B * H * 3);
  // Interrupted in the middle (the fifth poll: batch row 0, head 1, second
  // block).
  for (const absl::Status& stop :
       {absl::CancelledError("the caller left"), absl::DeadlineExceededError("deadline")}) {
    ExpectStoppedAtPoll(**engine, a, 5, stop);
  }
}

// An additive score's work item (64 query rows of one head) computes its
// hidden layer for every key: over a wide one and thousands of keys, for
// seconds. The oneDNN backend also polls the interrupt within it, per row of
// each block of keys, so such a call stops part way through its one item.
TEST(OneDnnInterruptTest, AnAdditiveScoreIsStoppedWithinAWorkItem) {
  auto engine = Engine::Create(EngineOptions{.backend = Backend::kOneDnn});
  ASSERT_TRUE(engine.ok()) << engine.status();
  constexpr int64_t L = 8, S = 1024, E = 4, kHidden = 16;  // one work item
  const Owned q = Random({1, L, E}, 1), k = Random({1, S, E}, 2), v = Random({1, S, E}, 3);
  const Owned w_q = Random({kHidden, E}, 4), w_k = Random({kHidden, E}, 5),
              w_v = Random({kHidden}, 6);
  AttentionArgs a;
  a.query = q.view();
  a.key = k.view();
  a.value = v.view();
  a.score.kind = ScoreKind::kAdditive;
  a.score.w_q = w_q.view();
  a.score.w_k = w_k.view();
  a.score.w_v = w_v.view();
  for (const bool need_weights : {false, true}) {
    SCOPED_TRACE(need_weights ? "weights" : "fused");
    a.need_weights = need_weights;
    EXPECT_GT(PollsWithoutStopping(**engine, a), 1);  // before the item, and within it
    // Stopped at the first poll inside the item (the second in all).
    ExpectStoppedAtPoll(**engine, a, 2, absl::DeadlineExceededError("deadline"));
  }
}

// The output pool keeps a freed large block for reuse, and frees it at an
// allocation (of any size) once it has gone unused for the idle limit.
TEST(OutputPoolTest, ABlockUnusedForTheIdleLimitIsFreedAtTheNextAllocation) {
  using std::chrono::hours;
  using std::chrono::milliseconds;
  const auto previous = SetOutputPoolIdleLimit(hours(1));
  constexpr size_t kBytes = (size_t{5} << 20) + 777;
  void* block = AllocateOutputMemory(kBytes);
  const size_t before = PooledOutputBytes();
  FreeOutputMemory(block, kBytes);
  EXPECT_GE(PooledOutputBytes(), before + kBytes);
  FreeOutputMemory(AllocateOutputMemory(64), 64);
  EXPECT_GE(PooledOutputBytes(), before + kBytes) << "freed before its limit";

  SetOutputPoolIdleLimit(milliseconds(1));
  std::this_thread::sleep_for(milliseconds(5));
  EXPECT_GE(PooledOutputBytes(), before + kBytes) << "nothing frees it until an allocation";
  FreeOutputMemory(AllocateOutputMemory(64), 64);
  EXPECT_EQ(PooledOutputBytes(), 0u);  // every pooled block is older than 1 ms
  SetOutputPoolIdleLimit(previous);
}

// A session counts its blocks' sizes against --session_memory_mb: a freed
// block serves only a block of its own size, never a smaller one it would
// hold twice the counted bytes for.
TEST(SessionBlockPoolTest, ReusesOnlyBlocksOfTheSizeAskedFor) {
  constexpr size_t kBytes = 48 * 1024 + 64;
  void* block = AllocateSessionBlock(kBytes);
  ASSERT_NE(block, nullptr);
  const size_t before = PooledSessionBlockBytes();
  FreeSessionBlock(block);
  ASSERT_EQ(PooledSessionBlockBytes(), before + kBytes);
  void* smaller = AllocateSessionBlock(kBytes - 64);
  EXPECT_NE(smaller, block);
  EXPECT_EQ(PooledSessionBlockBytes(), before + kBytes);  // still pooled
  void* same = AllocateSessionBlock(kBytes);
  EXPECT_EQ(same, block);
  EXPECT_EQ(PooledSessionBlockBytes(), before);
  FreeSessionBlock(smaller);
  FreeSessionBlock(same);
}

// Of several pooled blocks of one size, an allocation takes the one freed
// last, so that the others can reach the idle limit under a steady trickle of
// calls rather than all taking turns.
TEST(OutputPoolTest, AnAllocationTakesTheBlockOfItsSizeFreedLast) {
  constexpr size_t kBytes = (size_t{3} << 20) + 555;
  void* first = AllocateOutputMemory(kBytes);
  void* second = AllocateOutputMemory(kBytes);
  FreeOutputMemory(first, kBytes);
  FreeOutputMemory(second, kBytes);
  void* again = AllocateOutputMemory(kBytes);
  EXPECT_EQ(again, second);
  FreeOutputMemory(again, kBytes);
}

}  // namespace
}  // namespace attention
