// fuzz::Safetensors: arbitrary bytes as a weights.safetensors file. The parser
// must refuse what is malformed with INVALID_ARGUMENT and, for what it
// accepts, return tensors whose element counts match their shapes; an
// accepted state_dict is then offered to MultiheadAttention::Create, with a
// config read off its out_proj.weight, as the model loader would.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/multihead.h"
#include "server/safetensors.h"
#include "tests/fuzz/fuzz_targets.h"

namespace attention::fuzz {
namespace {

void Check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "fuzz_safetensors: %s\n", what);
  std::abort();
}

}  // namespace

void Safetensors(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<StateDict> dict = ParseSafetensors(bytes, "fuzz.safetensors");
  if (!dict.ok()) {
    Check(absl::IsInvalidArgument(dict.status()), "a refusal that is not INVALID_ARGUMENT");
    return;
  }
  for (const auto& [key, tensor] : *dict) {
    uint64_t n = 1;
    for (int64_t d : tensor.shape) {
      Check(d >= 0, "a negative dim");
      Check(!__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n), "an overflowing shape");
    }
    Check(n == tensor.data.size(), "a tensor whose element count is not its shape's");
  }
  auto out = dict->find("out_proj.weight");
  if (out == dict->end() || out->second.shape.size() != 2) return;
  MultiheadConfig config;
  config.embed_dim = out->second.shape[0];
  config.num_heads = 1;
  config.bias = dict->count("out_proj.bias") > 0;
  config.add_bias_kv = dict->count("bias_k") > 0;
  if (auto k = dict->find("k_proj_weight"); k != dict->end() && k->second.shape.size() == 2) {
    config.kdim = k->second.shape[1];
  }
  if (auto v = dict->find("v_proj_weight"); v != dict->end() && v->second.shape.size() == 2) {
    config.vdim = v->second.shape[1];
  }
  absl::StatusOr<std::unique_ptr<MultiheadAttention>> layer =
      MultiheadAttention::Create(config, *std::move(dict));
  Check(layer.ok() || absl::IsInvalidArgument(layer.status()),
        "Create refused with a code other than INVALID_ARGUMENT");
}

}  // namespace attention::fuzz
