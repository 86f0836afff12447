// fuzz::ModelConfig: a model folder's config.pbtxt, optionally with its
// weights. The input is the config text, then optionally the line
// "#weights" and the bytes of a weights.safetensors:
//
//   - config only: ParseModelConfig, then BuildModel with the demo model's
//     weights (so configs of its shape build);
//   - config and weights: both are written into a folder named "m" and loaded
//     with LoadModel, the server's own loader.
//
// Whatever loads must then serve: a well-formed forward call on it succeeds.
// A config the loader accepts but whose every request fails is a bug.

#include <stdlib.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/engine.h"
#include "engine/multihead.h"
#include "server/model_repository.h"
#include "server/safetensors.h"
#include "tests/fuzz/fuzz_targets.h"

namespace attention::fuzz {
namespace {

constexpr absl::string_view kSeparator = "\n#weights\n";
// Forward calls are made only for layers up to this width (the fuzzer's
// inputs are a few KB; wider layers come only from the demo weights).
constexpr int64_t kMaxForwardDim = 256;

void Check(bool ok, const std::string& what) {
  if (ok) return;
  std::fprintf(stderr, "fuzz_model_config: %s\n", what.c_str());
  std::abort();
}

struct Fixture {
  std::unique_ptr<Engine> engine;
  StateDict demo_weights;
  std::string folder;  // <temp>/m
};

const Fixture& GetFixture() {
  static const Fixture* fixture = [] {
    auto* f = new Fixture;
    EngineOptions options;
    options.backend = Backend::kReference;
    options.max_tensor_elements = 1 << 16;
    options.max_score_elements = 1 << 16;
    options.max_request_flops = 1e8;
    options.max_request_bytes = int64_t{64} << 20;
    f->engine = *Engine::Create(options);
    absl::StatusOr<StateDict> weights =
        ReadSafetensors(ATTENTION_MODELS_DIR "/demo/weights.safetensors");
    Check(weights.ok(), std::string(weights.status().message()));
    f->demo_weights = *std::move(weights);
    std::string dir =
        (std::filesystem::temp_directory_path() / "fuzz_model_config.XXXXXX").string();
    Check(mkdtemp(dir.data()) != nullptr, "mkdtemp failed");
    f->folder = dir + "/m";
    std::filesystem::create_directory(f->folder);
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(std::filesystem::path(GetFixture().folder).parent_path(),
                                  ignored);
    });
    return f;
  }();
  return *fixture;
}

void Write(const std::string& path, absl::string_view contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  Check(out.good(), "cannot write " + path);
}

// One call with well-formed inputs of the layer's dims: self-attention, or
// key and value of kdim / vdim.
void Forward(const Engine& engine, const Model& model) {
  const MultiheadConfig& c = model.layer->config();
  const int64_t e = c.embed_dim;
  const int64_t kdim = c.kdim ? c.kdim : e, vdim = c.vdim ? c.vdim : e;
  if (e > kMaxForwardDim || kdim > kMaxForwardDim || vdim > kMaxForwardDim) return;
  const std::vector<float> q(static_cast<size_t>(2 * e), 0.25f);
  const std::vector<float> k(static_cast<size_t>(3 * kdim), -0.5f);
  const std::vector<float> v(static_cast<size_t>(3 * vdim), 0.75f);
  AttentionArgs args;
  args.query = {DType::kFloat32, {1, 2, e}, q.data(), q.size() * sizeof(float)};
  if (kdim != e || vdim != e) {
    args.key = {DType::kFloat32, {1, 3, kdim}, k.data(), k.size() * sizeof(float)};
    args.value = {DType::kFloat32, {1, 3, vdim}, v.data(), v.size() * sizeof(float)};
  }
  args.need_weights = true;
  absl::StatusOr<AttentionResult> result = model.layer->Forward(engine, args);
  Check(result.ok() || absl::IsResourceExhausted(result.status()),
        "a model that loaded fails a well-formed call: " + result.status().ToString());
}

}  // namespace

void ModelConfig(const uint8_t* data, size_t size) {
  const Fixture& f = GetFixture();
  const absl::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t split = input.find(kSeparator);
  absl::StatusOr<Model> model;
  if (split == absl::string_view::npos) {
    absl::StatusOr<v1::ModelConfig> config = ParseModelConfig(input, "fuzz/config.pbtxt");
    if (!config.ok()) return;
    model = BuildModel(*std::move(config), f.demo_weights, "fuzz/config.pbtxt",
                       "fuzz/weights.safetensors");
  } else {
    Write(f.folder + "/config.pbtxt", input.substr(0, split));
    Write(f.folder + "/weights.safetensors", input.substr(split + kSeparator.size()));
    model = LoadModel(f.folder);
  }
  if (!model.ok()) {
    Check(absl::IsInvalidArgument(model.status()),
          "a refusal that is not INVALID_ARGUMENT: " + model.status().ToString());
    return;
  }
  Forward(*f.engine, *model);
}

}  // namespace attention::fuzz
