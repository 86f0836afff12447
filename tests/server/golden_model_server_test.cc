// Every multihead golden case end to end: the case's state_dict written as a
// model folder, a real server started on that repository, calls through the client.

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/tensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"
#include "tests/golden_case.h"
#include "tests/safetensors_writer.h"
#include "tests/server/golden_request.h"
#include "tests/server/test_server.h"

namespace attention::testing {
namespace {

using ::testing::HasSubstr;

std::string ConfigText(const GoldenCase& c) {
  const MultiheadConfig m = MultiheadConfigOf(c);
  return absl::StrCat("name: \"", c.name, "\"\nembed_dim: ", m.embed_dim,
                      "\nnum_heads: ", m.num_heads, "\nkdim: ", m.kdim, "\nvdim: ", m.vdim,
                      "\nbias: ", m.bias ? "true" : "false",
                      "\nadd_bias_kv: ", m.add_bias_kv ? "true" : "false",
                      "\nadd_zero_attn: ", m.add_zero_attn ? "true" : "false", "\n");
}

// A model repository holding every multihead golden case, one folder each.
std::string WriteGoldenRepository() {
  const std::string repo = MakeTempDir("golden_models");
  for (const std::string& name : GoldenCaseNames("multihead")) {
    const GoldenCase c = LoadGoldenCase(name);
    const std::string folder = repo + "/" + name;
    std::filesystem::create_directories(folder);
    WriteFile(folder + "/config.pbtxt", ConfigText(c));
    WriteFile(folder + "/weights.safetensors", SafetensorsBytes(StateDictOf(c)));
  }
  return repo;
}

// A server whose repository holds every multihead golden case.
template <typename Base>
class ModelServerSuite : public ServerSuite<Base> {
 protected:
  static void SetUpTestSuite() {
    ServerOptions options;
    options.model_repository = WriteGoldenRepository();
    ServerSuite<Base>::StartSuiteServer(std::move(options));
  }
};

v1::AttendRequest ModelRequest(const GoldenCase& c) {
  v1::AttendRequest r = ToRequest(c);
  r.set_model(c.name);
  r.clear_num_heads();
  r.clear_score();
  if (!c.multihead.at("batch_first").get<bool>()) r.set_layout(v1::AttendRequest::SEQUENCE_FIRST);
  return r;
}

class GoldenModelServerTest : public ModelServerSuite<::testing::TestWithParam<std::string>> {};

TEST_P(GoldenModelServerTest, MatchesTorchMultiheadAttention) {
  const GoldenCase c = LoadGoldenCase(GetParam());
  absl::StatusOr<v1::AttendResponse> response = client().Attend(ModelRequest(c));
  ASSERT_THAT(response, IsOk());
  EXPECT_EQ(response->id(), c.name);
  EXPECT_TRUE(WireClose(response->output(), c.expected_output, c.atol, c.rtol));
  EXPECT_TRUE(WireClose(response->weights(), c.expected_weights, c.atol, c.rtol));
}

INSTANTIATE_TEST_SUITE_P(Cases, GoldenModelServerTest,
                         ::testing::ValuesIn(GoldenCaseNames("multihead")),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

class ModelRpcTest : public ModelServerSuite<::testing::Test> {};

TEST_F(ModelRpcTest, ListModelsNamesEveryFolder) {
  absl::StatusOr<v1::ListModelsResponse> list = client().ListModels();
  ASSERT_THAT(list, IsOk());
  std::vector<std::string> names;
  for (const auto& m : list->models()) names.push_back(m.name());
  EXPECT_EQ(names, GoldenCaseNames("multihead"));
}

TEST_F(ModelRpcTest, GetModelReturnsTheResolvedConfig) {
  absl::StatusOr<v1::GetModelResponse> model = client().GetModel("mha_kdim_vdim_per_head");
  ASSERT_THAT(model, IsOk());
  EXPECT_EQ(model->config().embed_dim(), 8);
  EXPECT_EQ(model->config().num_heads(), 2);
  EXPECT_EQ(model->config().kdim(), 5);
  EXPECT_EQ(model->config().vdim(), 3);
  EXPECT_TRUE(model->config().bias());
}

TEST_F(ModelRpcTest, UnknownModelIsNotFound) {
  EXPECT_THAT(client().GetModel("nope"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("model: \"nope\" is not registered")));
  v1::AttendRequest r = ModelRequest(LoadGoldenCase("mha_seed_padding"));
  r.set_model("nope");
  EXPECT_THAT(client().Attend(r),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("model: \"nope\"")));
}

TEST_F(ModelRpcTest, SelfAttentionOmitsKeyAndValue) {
  const GoldenCase c = LoadGoldenCase("mha_seed_padding");  // key == value == query
  v1::AttendRequest r = ModelRequest(c);
  r.clear_key();
  r.clear_value();
  absl::StatusOr<v1::AttendResponse> response = client().Attend(r);
  ASSERT_THAT(response, IsOk());
  EXPECT_TRUE(WireClose(response->output(), c.expected_output, c.atol, c.rtol));
}

TEST_F(ModelRpcTest, RejectsHeadsOrScoreSetBesideAModel) {
  v1::AttendRequest r = ModelRequest(LoadGoldenCase("mha_seed_padding"));
  r.set_num_heads(3);
  EXPECT_THAT(client().Attend(r),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_heads:")));
  r.clear_num_heads();
  r.mutable_score()->set_kind(v1::Score::COSINE);
  EXPECT_THAT(client().Attend(r), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("score:")));
}

TEST_F(ModelRpcTest, RejectsInputThatDoesNotFitTheLayer) {
  v1::AttendRequest r = ModelRequest(LoadGoldenCase("mha_seed_padding"));  // embed_dim 6
  *r.mutable_query() = Ramp({3, 4, 5});
  EXPECT_THAT(client().Attend(r),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("query: last dim 5 does not match the model's embed_dim 6")));
}

TEST(ModelServerStartupTest, BrokenRepositoryStopsStartup) {
  const std::string repo = MakeTempDir("broken_repo");
  std::filesystem::create_directories(repo + "/m");
  WriteFile(repo + "/m/config.pbtxt", "embed_dim: 4\nnum_heads: 2\n");
  WriteFile(repo + "/m/weights.safetensors", "short");
  ServerOptions options;
  options.model_repository = repo;
  EXPECT_THAT(TestServer::Start(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("weights.safetensors")));
}

TEST(ModelServerStartupTest, ServesTheShippedDemoModel) {
  ServerOptions options;
  options.model_repository = ATTENTION_MODELS_DIR;
  absl::StatusOr<std::unique_ptr<TestServer>> server = TestServer::Start(options);
  ASSERT_THAT(server, IsOk());
  v1::AttendRequest r;
  r.set_model("demo");
  *r.mutable_query() = Ramp({2, 16, 64});
  r.set_need_weights(true);
  absl::StatusOr<v1::AttendResponse> response = (*server)->client().Attend(r);
  ASSERT_THAT(response, IsOk());
  EXPECT_THAT(response->output().shape(), ::testing::ElementsAre(2, 16, 64));
  EXPECT_THAT(response->weights().shape(), ::testing::ElementsAre(2, 4, 16, 16));
}

}  // namespace
}  // namespace attention::testing
