// Engine::AttendBatch (dynamic batching's engine call) must give every call
// exactly what it gets alone.

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "engine/engine.h"
#include "engine/multihead.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/golden_case.h"
#include "tests/random_tensor.h"
#include "tests/status_matchers.h"

namespace attention {
namespace {

using ::testing::HasSubstr;
using testing::StatusIs;

using Input = testing::FloatTensor;
using testing::RandomFloats;

class BatchTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    EngineOptions options;
    options.backend = GetParam();
    engine_ = std::move(Engine::Create(options)).value();
    const testing::GoldenCase c = testing::LoadGoldenCase("mha_bias_kv_zero_attn");
    layer_ = std::move(MultiheadAttention::Create(testing::MultiheadConfigOf(c),
                                                  testing::StateDictOf(c)))
                 .value();
  }

  std::unique_ptr<Engine> engine_;
  std::unique_ptr<MultiheadAttention> layer_;  // embed_dim 8, 2 heads, bias_kv, zero_attn
};

TEST_P(BatchTest, EveryCallGetsExactlyItsOwnResult) {
  // Raw calls of different shapes and paths, and layer calls of different lengths.
  const Input q1 = RandomFloats({2, 70, 16}, 1), q2 = RandomFloats({1, 4, 5, 8}, 2),
              k2 = RandomFloats({1, 2, 9, 8}, 3);
  const Input x1 = RandomFloats({3, 16, 8}, 4), x2 = RandomFloats({1, 5, 8}, 5),
              x3 = RandomFloats({2, 300, 8}, 6);
  std::vector<AttentionArgs> args(5);
  args[0].query = q1.view();
  args[0].num_heads = 4;
  args[0].mask.causal = Causal::kTopLeft;
  args[1].query = q2.view();
  args[1].key = k2.view();
  args[1].need_weights = true;
  args[2].query = x1.view();
  args[2].need_weights = true;
  args[2].average_weights = true;
  args[3].query = x2.view();
  args[4].query = x3.view();
  const std::vector<EngineCall> calls = {{&args[0], nullptr},
                                         {&args[1], nullptr},
                                         {&args[2], layer_.get()},
                                         {&args[3], layer_.get()},
                                         {&args[4], layer_.get()}};
  const std::vector<absl::StatusOr<AttentionResult>> batched = engine_->AttendBatch(calls);
  ASSERT_EQ(batched.size(), calls.size());
  for (size_t i = 0; i < calls.size(); ++i) {
    SCOPED_TRACE("call " + std::to_string(i));
    absl::StatusOr<AttentionResult> alone = calls[i].layer ? calls[i].layer->Forward(*engine_, args[i])
                                                           : engine_->Attend(args[i]);
    ASSERT_TRUE(alone.ok()) << alone.status();
    ASSERT_TRUE(batched[i].ok()) << batched[i].status();
    EXPECT_EQ(batched[i]->output.shape, alone->output.shape);
    EXPECT_EQ(batched[i]->output.data, alone->output.data);  // bit for bit
    EXPECT_EQ(batched[i]->weights.shape, alone->weights.shape);
    EXPECT_EQ(batched[i]->weights.data, alone->weights.data);
  }
}

TEST_P(BatchTest, ABadCallFailsAloneAndTheOthersStillRun) {
  const Input good = RandomFloats({1, 5, 8}, 7), bad = RandomFloats({1, 5, 7}, 8);
  AttentionArgs a, b, c;
  a.query = good.view();
  b.query = bad.view();  // last dim 7 does not match embed_dim 8
  c.query = good.view();
  c.num_heads = 3;  // does not divide 8
  const std::vector<EngineCall> calls = {{&a, layer_.get()}, {&b, layer_.get()}, {&c, nullptr}};
  const std::vector<absl::StatusOr<AttentionResult>> results = engine_->AttendBatch(calls);
  EXPECT_TRUE(results[0].ok()) << results[0].status();
  EXPECT_THAT(results[1], StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("query: last dim 7")));
  EXPECT_THAT(results[2], StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_heads: 3")));
}

// Views that share one buffer but differ in length or dtype are different
// inputs: each is converted on its own. (Conversions keyed on the pointer
// alone handed one view the other's copy: a read past the end of a shorter
// one, through the public API.)
TEST_P(BatchTest, ViewsOfOneBufferAreConvertedEachOnItsOwn) {
  const Input source = RandomFloats({1, 64, 16}, 9);
  std::vector<uint16_t> shared(source.values.size());
  for (size_t i = 0; i < shared.size(); ++i) shared[i] = FloatToFloat16(source.values[i]);
  // The same bytes again, in buffers of their own.
  std::vector<uint16_t> query_copy = shared, key_copy = shared;
  auto view = [](const std::vector<uint16_t>& buffer, DType dtype, int64_t rows) {
    return TensorView{dtype, {1, rows, 16}, buffer.data(), static_cast<size_t>(rows) * 16 * 2};
  };
  for (const DType key_dtype : {DType::kFloat16, DType::kBFloat16})
  for (const auto& [query_rows, key_rows] : {std::pair<int64_t, int64_t>{64, 8}, {8, 64}}) {
    SCOPED_TRACE(absl::StrCat("key ", DTypeName(key_dtype), ", query rows ", query_rows,
                              ", key rows ", key_rows));
    AttentionArgs sharing, separate;  // the key's rows are a prefix of the query's, or not
    sharing.query = view(shared, DType::kFloat16, query_rows);
    sharing.key = view(shared, key_dtype, key_rows);
    separate.query = view(query_copy, DType::kFloat16, query_rows);
    separate.key = view(key_copy, key_dtype, key_rows);
    for (AttentionArgs* a : {&sharing, &separate}) {
      a->num_heads = 2;
      a->need_weights = true;
    }
    absl::StatusOr<AttentionResult> got = engine_->Attend(sharing);
    absl::StatusOr<AttentionResult> want = engine_->Attend(separate);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(got->output.data, want->output.data);
    EXPECT_EQ(got->weights.data, want->weights.data);
  }
}

TEST_P(BatchTest, AnEmptyBatchIsFine) { EXPECT_TRUE(engine_->AttendBatch({}).empty()); }

INSTANTIATE_TEST_SUITE_P(Backends, BatchTest,
                         ::testing::Values(Backend::kOneDnn, Backend::kReference),
                         [](const auto& info) {
                           return info.param == Backend::kOneDnn ? "OneDnn" : "Reference";
                         });

}  // namespace
}  // namespace attention
