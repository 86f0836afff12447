#include <iterator>
#include <memory>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "engine/engine.h"
#include "engine/multihead.h"
#include "gtest/gtest.h"
#include "tests/golden_case.h"

namespace attention {
namespace {

using testing::AllClose;
using testing::GoldenCase;

constexpr Backend kBackends[] = {Backend::kReference, Backend::kOneDnn};

// Every golden case of one kind on every backend.
class GoldenEngineTest : public ::testing::TestWithParam<std::tuple<Backend, std::string>> {
 protected:
  static void SetUpTestSuite() {
    for (Backend backend : kBackends) {
      auto engine = Engine::Create(EngineOptions{.backend = backend});
      ASSERT_TRUE(engine.ok()) << engine.status();
      engines_[static_cast<int>(backend)] = std::move(engine).value().release();
    }
  }
  static void TearDownTestSuite() {
    for (Engine*& engine : engines_) {
      delete engine;
      engine = nullptr;
    }
  }

  const Engine& engine() const { return *engines_[static_cast<int>(std::get<0>(GetParam()))]; }
  GoldenCase Case() const { return testing::LoadGoldenCase(std::get<1>(GetParam())); }

  static Engine* engines_[std::size(kBackends)];
};

Engine* GoldenEngineTest::engines_[std::size(kBackends)] = {};

std::string ParamName(const ::testing::TestParamInfo<GoldenEngineTest::ParamType>& info) {
  const char* backend = std::get<0>(info.param) == Backend::kReference ? "Reference" : "OneDnn";
  return absl::StrCat(backend, "_", std::get<1>(info.param));
}

TEST_P(GoldenEngineTest, MatchesPyTorch) {
  const GoldenCase c = Case();
  auto result = engine().Attend(testing::ToEngineArgs(c));
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
  const GoldenCase c = Case();
  auto layer = MultiheadAttention::Create(testing::MultiheadConfigOf(c), testing::StateDictOf(c));
  ASSERT_TRUE(layer.ok()) << layer.status();
  AttentionArgs args = testing::ToEngineArgs(c);
  if (!c.multihead.at("batch_first").get<bool>()) args.layout = Layout::kSequenceFirst;
  auto result = (*layer)->Forward(engine(), args);
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

INSTANTIATE_TEST_SUITE_P(
    MultiheadCases, GoldenMultiheadEngineTest,
    ::testing::Combine(::testing::ValuesIn(kBackends),
                       ::testing::ValuesIn(testing::GoldenCaseNames("multihead"))),
    ParamName);

INSTANTIATE_TEST_SUITE_P(
    AttentionCases, GoldenEngineTest,
    ::testing::Combine(::testing::ValuesIn(kBackends),
                       ::testing::ValuesIn(testing::GoldenCaseNames("attention"))),
    ParamName);

}  // namespace
}  // namespace attention
