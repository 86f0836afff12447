#include "server/model_repository.h"

#include <cstring>
#include <filesystem>
#include <string>
#include <utility>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"
#include "server/safetensors.h"
#include "tests/golden_case.h"
#include "tests/safetensors_writer.h"

namespace attention {
namespace {

using ::testing::HasSubstr;
using testing::StatusIs;
using testing::MakeTempDir;
using testing::SafetensorsBytes;
using testing::WriteFile;

constexpr char kConfig[] = "embed_dim: 4\nnum_heads: 2\n";

// A valid state_dict for kConfig.
StateDict SmallWeights() {
  StateDict d;
  d["in_proj_weight"] = Tensor{{12, 4}, FloatBuffer(48, 0.1f)};
  d["in_proj_bias"] = Tensor{{12}, FloatBuffer(12, 0.0f)};
  d["out_proj.weight"] = Tensor{{4, 4}, FloatBuffer(16, 0.2f)};
  d["out_proj.bias"] = Tensor{{4}, FloatBuffer(4, 0.0f)};
  return d;
}

class ModelRepositoryTest : public ::testing::Test {
 protected:
  // Writes repo/<name>/ with `config` and `weights` bytes; returns the repo dir.
  std::string Repo(const std::string& config, const std::string& weights,
                   const std::string& name = "m") {
    const std::string repo =
        MakeTempDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(repo + "/" + name);
    WriteFile(repo + "/" + name + "/config.pbtxt", config);
    WriteFile(repo + "/" + name + "/weights.safetensors", weights);
    return repo;
  }

  // The bytes of a valid file with `patch` applied to its JSON header text.
  static std::string PatchedHeader(const std::string& from, const std::string& to) {
    std::string bytes = SafetensorsBytes(SmallWeights());
    uint64_t len = 0;
    std::memcpy(&len, bytes.data(), 8);
    std::string header = bytes.substr(8, len);
    const size_t at = header.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    header.replace(at, from.size(), to);
    std::string out(8, '\0');
    uint64_t new_len = header.size();
    std::memcpy(out.data(), &new_len, 8);
    return out + header + bytes.substr(8 + len);
  }
};

TEST_F(ModelRepositoryTest, LoadsAValidModel) {
  auto repo = ModelRepository::Load(Repo(kConfig, SafetensorsBytes(SmallWeights())));
  ASSERT_TRUE(repo.ok()) << repo.status();
  const Model* m = (*repo)->Find("m");
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->config.name(), "m");
  EXPECT_EQ(m->config.embed_dim(), 4);
  EXPECT_EQ((*repo)->Find("other"), nullptr);
}

TEST_F(ModelRepositoryTest, SkipsHiddenFolders) {
  // As a Kubernetes ConfigMap volume lays out a model: its files are links
  // into "..data", which is no model of its own.
  const std::string repo = Repo(kConfig, SafetensorsBytes(SmallWeights()));
  std::filesystem::create_directories(repo + "/m/..data");
  std::filesystem::create_directories(repo + "/..2026_11_21");
  WriteFile(repo + "/..2026_11_21/config.pbtxt", "not a config");
  auto loaded = ModelRepository::Load(repo);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_NE((*loaded)->Find("m"), nullptr);
  EXPECT_EQ((*loaded)->models().size(), 1u);
}

TEST_F(ModelRepositoryTest, ServesTheShippedDemoModel) {
  auto repo = ModelRepository::Load(ATTENTION_MODELS_DIR);
  ASSERT_TRUE(repo.ok()) << repo.status();
  const Model* demo = (*repo)->Find("demo");
  ASSERT_NE(demo, nullptr);
  EXPECT_EQ(demo->config.embed_dim(), 64);
  EXPECT_EQ(demo->config.num_heads(), 4);
}

TEST_F(ModelRepositoryTest, RejectsTruncatedFile) {
  std::string bytes = SafetensorsBytes(SmallWeights());
  EXPECT_THAT(ModelRepository::Load(Repo(kConfig, bytes.substr(0, bytes.size() - 10))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("run past the")));
  EXPECT_THAT(ModelRepository::Load(Repo(kConfig, bytes.substr(0, 5))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("file has 5 bytes")));
}

TEST_F(ModelRepositoryTest, RejectsHeaderLengthBeyondTheFile) {
  std::string bytes = SafetensorsBytes(SmallWeights());
  bytes[6] = 1;  // header length += 2^48
  EXPECT_THAT(ModelRepository::Load(Repo(kConfig, bytes)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("runs past the end of the")));
}

TEST_F(ModelRepositoryTest, RejectsOverlappingOffsets) {
  // Keys are written sorted: in_proj_bias [0, 48) comes first.
  std::string bytes = PatchedHeader("\"data_offsets\":[48,240]", "\"data_offsets\":[40,232]");
  EXPECT_THAT(ModelRepository::Load(Repo(kConfig, bytes)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlap")));
}

TEST_F(ModelRepositoryTest, RejectsOutOfRangeOffsets) {
  std::string bytes = PatchedHeader("\"data_offsets\":[48,240]", "\"data_offsets\":[4800,4992]");
  EXPECT_THAT(
      ModelRepository::Load(Repo(kConfig, bytes)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("in_proj_weight\": data_offsets [4800, 4992)")));
}

TEST_F(ModelRepositoryTest, RejectsUnsupportedDtype) {
  std::string bytes = PatchedHeader("\"dtype\":\"F32\"", "\"dtype\":\"I64\"");
  EXPECT_THAT(ModelRepository::Load(Repo(kConfig, bytes)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dtype I64 is not supported")));
}

TEST_F(ModelRepositoryTest, RejectsByteRangeThatDoesNotMatchTheShape) {
  std::string bytes = PatchedHeader("\"shape\":[12,4]", "\"shape\":[12,5]");
  EXPECT_THAT(ModelRepository::Load(Repo(kConfig, bytes)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs 240")));
}

TEST_F(ModelRepositoryTest, RejectsShapeThatDoesNotMatchTheConfig) {
  StateDict d = SmallWeights();
  d["out_proj.weight"] = Tensor{{4, 3}, FloatBuffer(12, 0.2f)};
  EXPECT_THAT(
      ModelRepository::Load(Repo(kConfig, SafetensorsBytes(d))),
      StatusIs(
          absl::StatusCode::kInvalidArgument,
          HasSubstr(
              "m/weights.safetensors: weight \"out_proj.weight\" has shape [4, 3]; want [4, 4]")));
}

TEST_F(ModelRepositoryTest, RejectsMissingKey) {
  StateDict d = SmallWeights();
  d.erase("in_proj_bias");
  EXPECT_THAT(ModelRepository::Load(Repo(kConfig, SafetensorsBytes(d))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("missing weight \"in_proj_bias\"")));
}

TEST_F(ModelRepositoryTest, RejectsExtraKey) {
  StateDict d = SmallWeights();
  d["bias_k"] = Tensor{{1, 1, 4}, FloatBuffer(4, 0.0f)};
  EXPECT_THAT(ModelRepository::Load(Repo(kConfig, SafetensorsBytes(d))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unexpected weight \"bias_k\"")));
}

TEST_F(ModelRepositoryTest, RejectsBadTextproto) {
  EXPECT_THAT(ModelRepository::Load(
                  Repo("embed_dim: 4\nnum_heads: two\n", SafetensorsBytes(SmallWeights()))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("config.pbtxt: line 2")));
  EXPECT_THAT(ModelRepository::Load(Repo("embed_dims: 4\n", SafetensorsBytes(SmallWeights()))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("embed_dims")));
}

TEST_F(ModelRepositoryTest, RejectsNameThatDoesNotMatchItsFolder) {
  EXPECT_THAT(ModelRepository::Load(
                  Repo(std::string("name: \"x\"\n") + kConfig, SafetensorsBytes(SmallWeights()))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not match its folder \"m\"")));
}

TEST_F(ModelRepositoryTest, RejectsHeadsThatDoNotDivideEmbedDim) {
  EXPECT_THAT(
      ModelRepository::Load(Repo("embed_dim: 4\nnum_heads: 3\n", SafetensorsBytes(SmallWeights()))),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("m/config.pbtxt: num_heads 3 does not divide embed_dim 4")));
}

TEST_F(ModelRepositoryTest, RejectsMissingWeightsFile) {
  const std::string repo = Repo(kConfig, "");
  std::filesystem::remove(repo + "/m/weights.safetensors");
  EXPECT_THAT(ModelRepository::Load(repo),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("weights.safetensors: cannot open")));
}

TEST_F(ModelRepositoryTest, RejectsMissingDirectory) {
  EXPECT_THAT(ModelRepository::Load("/nonexistent/models"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("/nonexistent/models is not a directory")));
}

TEST(SafetensorsTest, ReadsHalfPrecisionTensors) {
  // {"a": BF16 [2] = {1.0, -2.0}, "b": F16 [1] = {0.5}}
  std::string header = R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},)"
                       R"("b":{"dtype":"F16","shape":[1],"data_offsets":[4,6]}})";
  std::string bytes(8, '\0');
  bytes[0] = static_cast<char>(header.size());
  bytes += header;
  const unsigned char data[] = {0x80, 0x3f, 0x00, 0xc0, 0x00, 0x38};
  bytes.append(reinterpret_cast<const char*>(data), sizeof data);
  auto dict = ParseSafetensors(bytes, "t");
  ASSERT_TRUE(dict.ok()) << dict.status();
  EXPECT_EQ(dict->at("a").data, (FloatBuffer{1.0f, -2.0f}));
  EXPECT_EQ(dict->at("b").data, (FloatBuffer{0.5f}));
}

// Regressions found by fuzz_model_config (tests/fuzz/regressions/): configs
// that loaded although every call of the model then failed, and one whose
// embed_dim overflowed the weight shape arithmetic (3 * embed_dim).
TEST_F(ModelRepositoryTest, RefusesAtLoadTheScoresItsCallsWouldRefuse) {
  const std::string weights = SafetensorsBytes(SmallWeights());
  const std::pair<const char*, const char*> cases[] = {
      {"score { kind: GAUSSIAN bandwidth: nan }",
       "m/config.pbtxt: score.bandwidth: nan is not a finite number"},
      {"score { kind: DOT bandwidth: 2 }",
       "m/config.pbtxt: score.bandwidth: is used by score GAUSSIAN only"},
      {"score { kind: DOT scale: inf }", "m/config.pbtxt: score.scale: inf is not a finite number"},
      {"score { kind: 99 }", "m/config.pbtxt: score.kind: unknown value 99"},
  };
  for (const auto& [score, message] : cases) {
    EXPECT_THAT(ModelRepository::Load(Repo(std::string(kConfig) + score, weights)),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(message)))
        << score;
  }
}

TEST_F(ModelRepositoryTest, RefusesDimsWhoseWeightShapesWouldOverflow) {
  EXPECT_THAT(
      ModelRepository::Load(
          Repo("embed_dim: 4611686018427387904\nnum_heads: 1\n", SafetensorsBytes(SmallWeights()))),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("m/config.pbtxt: embed_dim 4611686018427387904, kdim 0 and vdim 0 must be "
                         "at most 2147483647")));
}

// The format's rule: the tensors cover the data section exactly. A hole or
// bytes after the last tensor mean a file written wrong (or cut and patched).
TEST(SafetensorsTest, RejectsDataNoTensorHolds) {
  const auto file = [](const std::string& header, size_t data_bytes) {
    std::string bytes(8, '\0');
    bytes[0] = static_cast<char>(header.size());
    return bytes + header + std::string(data_bytes, '\0');
  };
  const std::string a = R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})";
  ASSERT_TRUE(ParseSafetensors(file("{" + a + "}", 4), "t").ok());
  EXPECT_THAT(ParseSafetensors(file("{" + a + "}", 6), "t"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("t: the data section has 6 bytes; its tensors hold 4")));
  EXPECT_THAT(
      ParseSafetensors(
          file("{" + a + R"(,"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})", 12), "t"),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("t: bytes [4, 8) of the data section before \"b\" belong to no tensor")));
  EXPECT_THAT(ParseSafetensors(file("{}", 2), "t"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("t: the data section has 2 bytes; its tensors hold 0")));
}

TEST(SafetensorsTest, RejectsHeaderThatIsNotJson) {
  std::string bytes(8, '\0');
  bytes[0] = 3;
  bytes += "{x:";
  EXPECT_THAT(ParseSafetensors(bytes, "t"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("t: header is not a JSON object")));
}

}  // namespace
}  // namespace attention
