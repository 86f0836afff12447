// Writes the seed corpora of the fuzz targets into tests/fuzz/corpus/<target>/:
// requests made from golden cases and by hand, the demo model's config, and
// small safetensors files made from the golden multi-head layers. The seeds
// are committed; run this again (built with ATTENTION_FUZZ=ON) after the wire
// contract or the golden cases change:
//
//   build-fuzz/fuzz_make_corpus tests/fuzz/corpus

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention/v1/attention.pb.h"
#include "client/tensors.h"
#include "engine/multihead.h"
#include "tests/golden_case.h"
#include "tests/safetensors_writer.h"
#include "tests/server/golden_request.h"

namespace attention::testing {
namespace {

namespace fs = std::filesystem;

void Put(const fs::path& dir, const std::string& name, const std::string& bytes) {
  fs::create_directories(dir);
  std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  std::printf("%s: %zu bytes\n", (dir / name).c_str(), bytes.size());
}

std::vector<float> Wave(size_t n) {
  std::vector<float> values(n);
  for (size_t i = 0; i < n; ++i) values[i] = std::sin(0.7f * static_cast<float>(i));
  return values;
}

v1::Tensor Floats(const std::vector<int64_t>& shape,
                  v1::Tensor::DType dtype = v1::Tensor::FLOAT32) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return *client::MakeFloatTensor(shape, Wave(static_cast<size_t>(n)), dtype);
}

// Requests no golden case makes: the model, 16-bit dtypes, int_data,
// float_data, sequence-first, dropout, and the other scores.
std::vector<std::pair<std::string, v1::AttendRequest>> HandMadeRequests() {
  std::vector<std::pair<std::string, v1::AttendRequest>> out;
  {
    v1::AttendRequest r;
    r.set_id("demo");
    r.set_model("demo");
    *r.mutable_query() = Floats({1, 3, 64});
    *r.mutable_mask()->mutable_key_padding_mask() =
        *client::MakeBoolTensor({1, 3}, {false, false, true});
    r.set_need_weights(true);
    out.emplace_back("demo_model", std::move(r));
  }
  {
    v1::AttendRequest r;
    *r.mutable_query() = Floats({3, 2, 8}, v1::Tensor::BFLOAT16);  // [L, B, E]
    *r.mutable_key() = Floats({4, 2, 8}, v1::Tensor::FLOAT16);
    r.set_layout(v1::AttendRequest::SEQUENCE_FIRST);
    r.set_num_heads(2);
    v1::Tensor* lens = r.mutable_mask()->mutable_valid_lens();
    lens->set_dtype(v1::Tensor::INT32);
    lens->add_shape(2);
    lens->add_int_data(4);
    lens->add_int_data(2);
    r.mutable_mask()->set_causal(v1::Mask::BOTTOM_RIGHT);
    r.set_output_dtype(v1::Tensor::FLOAT16);
    r.set_precision(v1::AttendRequest::FAST);
    r.set_dropout_p(0.25);
    r.set_seed(7);
    r.set_need_weights(true);
    r.set_average_weights(true);
    out.emplace_back("seq_first_16bit_dropout", std::move(r));
  }
  {
    v1::AttendRequest r;
    v1::Tensor* q = r.mutable_query();
    q->add_shape(1);
    q->add_shape(2);
    q->add_shape(3);
    for (float x : Wave(6)) q->add_float_data(x);
    r.mutable_score()->set_kind(v1::Score::GAUSSIAN);
    r.mutable_score()->set_bandwidth(1.5);
    r.set_output_dtype(v1::Tensor::BFLOAT16);
    out.emplace_back("gaussian_float_data", std::move(r));
  }
  {
    v1::AttendRequest r;
    *r.mutable_query() = Floats({1, 2, 2, 4});
    *r.mutable_key() = Floats({1, 1, 5, 4});
    r.mutable_score()->set_kind(v1::Score::NEG_EUCLIDEAN);
    r.mutable_score()->set_scale(0.5);
    *r.mutable_mask()->mutable_attn_mask() = Floats({1, 2, 2, 5});
    r.set_need_weights(true);
    out.emplace_back("rank4_neg_euclidean_float_mask", std::move(r));
  }
  return out;
}

void RequestSeeds(const fs::path& dir) {
  for (const char* name : {"sdpa_basic", "masks_combined", "rank4_gqa", "additive", "bilinear",
                           "cosine", "valid_lens_2d", "attn_mask_float_3d", "query_broadcast"}) {
    Put(dir, name, ToRequest(LoadGoldenCase(name)).SerializeAsString());
  }
  for (const auto& [name, request] : HandMadeRequests()) {
    Put(dir, name, request.SerializeAsString());
  }
}

// config.pbtxt text of a golden multi-head case (torch's constructor arguments).
std::string ConfigText(const MultiheadConfig& c) {
  std::string text = absl::StrCat("embed_dim: ", c.embed_dim, "\nnum_heads: ", c.num_heads, "\n");
  if (c.kdim) absl::StrAppend(&text, "kdim: ", c.kdim, "\n");
  if (c.vdim) absl::StrAppend(&text, "vdim: ", c.vdim, "\n");
  absl::StrAppend(&text, "bias: ", c.bias ? "true" : "false", "\n");
  if (c.add_bias_kv) absl::StrAppend(&text, "add_bias_kv: true\n");
  if (c.add_zero_attn) absl::StrAppend(&text, "add_zero_attn: true\n");
  return text;
}

// A BF16 and an F16 tensor and __metadata__, written by hand: the test
// writer makes F32 only.
std::string MixedDTypeSafetensors() {
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"F16","shape":[3],"data_offsets":[8,14]}})";
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  out += header;
  // bf16 1, -2, 0.5, inf; f16 1, -0, 65504.
  const uint16_t data[] = {0x3f80, 0xc000, 0x3f00, 0x7f80, 0x3c00, 0x8000, 0x7bff};
  for (uint16_t x : data) {
    out.push_back(static_cast<char>(x & 0xff));
    out.push_back(static_cast<char>(x >> 8));
  }
  return out;
}

void ModelSeeds(const fs::path& safetensors_dir, const fs::path& config_dir) {
  Put(safetensors_dir, "mixed_dtypes", MixedDTypeSafetensors());
  Put(safetensors_dir, "empty", std::string("\x02\0\0\0\0\0\0\0{}", 10));
  for (const char* name : {"mha_bias_kv_zero_attn", "mha_kdim_vdim_per_head"}) {
    const GoldenCase c = LoadGoldenCase(name);
    const std::string weights = SafetensorsBytes(StateDictOf(c));
    Put(safetensors_dir, name, weights);
    Put(config_dir, name, ConfigText(MultiheadConfigOf(c)) + "\n#weights\n" + weights);
  }
  std::ifstream demo(ATTENTION_MODELS_DIR "/demo/config.pbtxt");
  Put(config_dir, "demo", std::string(std::istreambuf_iterator<char>(demo), {}));
  Put(config_dir, "every_field",
      "name: \"m\"\nembed_dim: 64\nnum_heads: 8\nkdim: 64\nvdim: 64\nbias: true\n"
      "add_bias_kv: false\nadd_zero_attn: false\n"
      "score { kind: GAUSSIAN bandwidth: 0.5 }\nprecision: FAST\n"
      "batching { max_batch_size: 16 max_queue_delay_us: 500 }\n");
  Put(config_dir, "cosine_scale", "embed_dim: 64\nnum_heads: 2\nscore { kind: COSINE scale: 4 }\n");
}

}  // namespace
}  // namespace attention::testing

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR (tests/fuzz/corpus)\n", argv[0]);
    return 2;
  }
  const std::filesystem::path root = argv[1];
  attention::testing::RequestSeeds(root / "fuzz_request");
  attention::testing::ModelSeeds(root / "fuzz_safetensors", root / "fuzz_model_config");
  return ::testing::Test::HasFailure() ? 1 : 0;
}
