// precision FAST (bf16 matmuls, float32 accumulation) on every golden case:
// how far it lands from PyTorch's float64 numbers. The figures it prints are
// the ones docs/engine.md, "Accuracy", quotes.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "engine/engine.h"
#include "engine/multihead.h"
#include "gtest/gtest.h"
#include "tests/golden_case.h"

namespace attention {
namespace {

// Largest |got - want| over the elements.
double MaxAbsError(absl::Span<const float> got, const testing::GoldenTensor& want) {
  double worst = 0;
  for (size_t i = 0; i < got.size() && i < want.values.size(); ++i) {
    worst = std::max(worst, std::fabs(got[i] - want.values[i]));
  }
  return worst;
}

class FastPrecisionTest : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() { engine_ = std::move(Engine::Create({})).value().release(); }
  static void TearDownTestSuite() { delete engine_; }
  static Engine* engine_;
};

Engine* FastPrecisionTest::engine_ = nullptr;

// bf16 keeps 8 significant bits (relative rounding 2^-9 = 0.2%) of the
// operands of both matmuls; on these cases (|values| up to about 3, S up to 50)
// that moves outputs and weights by at most a few hundredths.
constexpr double kFastTolerance = 3e-2;

TEST_P(FastPrecisionTest, StaysWithinBf16RoundingOfPyTorch) {
  const testing::GoldenCase c = testing::LoadGoldenCase(GetParam());
  AttentionArgs args = testing::ToEngineArgs(c);
  args.fast = true;
  absl::StatusOr<AttentionResult> result;
  if (c.kind == "multihead") {
    auto layer = MultiheadAttention::Create(testing::MultiheadConfigOf(c), testing::StateDictOf(c));
    ASSERT_TRUE(layer.ok()) << layer.status();
    if (!c.multihead.at("batch_first").get<bool>()) args.layout = Layout::kSequenceFirst;
    result = (*layer)->Forward(*engine_, args);
  } else {
    result = engine_->Attend(args);
  }
  ASSERT_TRUE(result.ok()) << result.status();
  const double out = MaxAbsError(result->output.data, c.expected_output);
  const double w = MaxAbsError(result->weights.data, c.expected_weights);
  std::printf("FAST %-28s max |error| output %.2e weights %.2e\n", c.name.c_str(), out, w);
  EXPECT_LE(out, kFastTolerance);
  EXPECT_LE(w, kFastTolerance);
}

std::vector<std::string> AllCases() {
  std::vector<std::string> names = testing::GoldenCaseNames("attention");
  for (const std::string& n : testing::GoldenCaseNames("multihead")) names.push_back(n);
  return names;
}

INSTANTIATE_TEST_SUITE_P(GoldenCases, FastPrecisionTest, ::testing::ValuesIn(AllCases()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace attention
