#include <memory>
#include <string>

#include "engine/engine.h"
#include "engine/multihead.h"
#include "gtest/gtest.h"
#include "tests/golden_case.h"

namespace attention {
namespace {

using testing::AllClose;
using testing::GoldenCase;

class GoldenEngineTest : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    auto engine = Engine::Create(EngineOptions{});
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(engine).value().release();
  }
  static void TearDownTestSuite() { delete engine_; }
  static Engine* engine_;
};

Engine* GoldenEngineTest::engine_ = nullptr;

TEST_P(GoldenEngineTest, MatchesPyTorch) {
  const GoldenCase c = testing::LoadGoldenCase(GetParam());
  auto result = engine_->Attend(testing::ToEngineArgs(c));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(AllClose(result->output.shape, result->output.data, c.expected_output, c.atol,
                       c.rtol))
      << "output";
  if (c.expected_weights.present) {
    EXPECT_TRUE(AllClose(result->weights.shape, result->weights.data, c.expected_weights, c.atol,
                         c.rtol))
        << "weights";
  }
}

TEST(GoldenEngineSuite, HasEveryAttentionCase) {
  EXPECT_EQ(testing::GoldenCaseNames("attention").size(), 24u);
}

class GoldenMultiheadEngineTest : public GoldenEngineTest {};

TEST_P(GoldenMultiheadEngineTest, MatchesTorchMultiheadAttention) {
  const GoldenCase c = testing::LoadGoldenCase(GetParam());
  auto layer = MultiheadAttention::Create(testing::MultiheadConfigOf(c), testing::StateDictOf(c));
  ASSERT_TRUE(layer.ok()) << layer.status();
  AttentionArgs args = testing::ToEngineArgs(c);
  if (!c.multihead.at("batch_first").get<bool>()) args.layout = Layout::kSequenceFirst;
  auto result = (*layer)->Forward(*engine_, args);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(AllClose(result->output.shape, result->output.data, c.expected_output, c.atol,
                       c.rtol))
      << "output";
  EXPECT_TRUE(AllClose(result->weights.shape, result->weights.data, c.expected_weights, c.atol,
                       c.rtol))
      << "weights";
}

TEST(GoldenEngineSuite, HasEveryMultiheadCase) {
  EXPECT_EQ(testing::GoldenCaseNames("multihead").size(), 5u);
}

INSTANTIATE_TEST_SUITE_P(MultiheadCases, GoldenMultiheadEngineTest,
                         ::testing::ValuesIn(testing::GoldenCaseNames("multihead")),
                         [](const auto& info) { return info.param; });

INSTANTIATE_TEST_SUITE_P(AttentionCases, GoldenEngineTest,
                         ::testing::ValuesIn(testing::GoldenCaseNames("attention")),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace attention
