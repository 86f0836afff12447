// The fuzz targets (fuzz_targets.h) on every committed input, in the normal
// test suite and its sanitizer builds: the seeds of corpus/<target>/, and
// regressions/<target>/, where each input that once crashed a target or broke
// one of its invariants is kept (named after the bug; the fix is described in
// the commit that added it). A target aborts on a broken invariant, failing
// this test binary.

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/fuzz/fuzz_targets.h"

namespace attention::fuzz {
namespace {

namespace fs = std::filesystem;

struct Target {
  const char* name;
  void (*run)(const uint8_t*, size_t);
};

class FuzzReplayTest : public ::testing::TestWithParam<Target> {};

// Every file under tests/fuzz/<kind>/<target>/, sorted (the folder may be absent).
std::vector<fs::path> Inputs(const char* kind, const char* target) {
  std::vector<fs::path> files;
  const fs::path dir = fs::path(ATTENTION_FUZZ_DIR) / kind / target;
  if (!fs::is_directory(dir)) return files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.is_regular_file()) files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

void Replay(const Target& target, const fs::path& file) {
  SCOPED_TRACE(file.string());
  std::ifstream in(file, std::ios::binary);
  const std::string bytes{std::istreambuf_iterator<char>(in), {}};
  ASSERT_TRUE(in.good() || in.eof()) << "cannot read " << file;
  target.run(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

TEST_P(FuzzReplayTest, HandlesEverySeed) {
  const std::vector<fs::path> seeds = Inputs("corpus", GetParam().name);
  EXPECT_FALSE(seeds.empty()) << "no seeds for " << GetParam().name;
  for (const fs::path& file : seeds) Replay(GetParam(), file);
}

TEST_P(FuzzReplayTest, HandlesEveryRegression) {
  for (const fs::path& file : Inputs("regressions", GetParam().name)) Replay(GetParam(), file);
}

INSTANTIATE_TEST_SUITE_P(Targets, FuzzReplayTest,
                         ::testing::Values(Target{"fuzz_request", &Request},
                                           Target{"fuzz_safetensors", &Safetensors},
                                           Target{"fuzz_model_config", &ModelConfig}),
                         [](const ::testing::TestParamInfo<Target>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace attention::fuzz
