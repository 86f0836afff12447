#include "engine/gemm_baseline.h"

#include <cstdint>
#include <new>
#include <random>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attention {
namespace {

constexpr uint32_t kSeedA = 4;
constexpr uint32_t kSeedB = 5;

absl::Status FromDnnlError(const dnnl::error& e, int64_t n, bool bf16) {
  const std::string message =
      absl::StrCat("oneDNN ", bf16 ? "bf16" : "f32", " matmul at n = ", n, ": ", e.what());
  switch (e.status) {
    case dnnl_unimplemented:
      return absl::UnimplementedError(message);
    case dnnl_out_of_memory:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

// Uniform in [-1, 1), written as float32 or bfloat16 into `memory`.
void FillRandom(dnnl::memory& memory, int64_t count, bool bf16, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  void* data = memory.get_data_handle();
  for (int64_t i = 0; i < count; ++i) {
    const float x = dist(rng);
    if (bf16) {
      static_cast<uint16_t*>(data)[i] = FloatToBFloat16(x);
    } else {
      static_cast<float*>(data)[i] = x;
    }
  }
}

}  // namespace

struct GemmBaseline::Impl {
  dnnl::engine engine;
  dnnl::stream stream;
  dnnl::matmul matmul;
  dnnl::memory a, b, c;

  Impl(int64_t n, bool bf16) : engine(dnnl::engine::kind::cpu, 0), stream(engine) {
    using dt = dnnl::memory::data_type;
    using Tag = dnnl::memory::format_tag;
    const dnnl::memory::dims dims = {n, n};
    const dnnl::memory::desc input_md(dims, bf16 ? dt::bf16 : dt::f32, Tag::ab);
    const dnnl::memory::desc output_md(dims, dt::f32, Tag::ab);
    matmul = dnnl::matmul(
        dnnl::matmul::primitive_desc(dnnl::matmul::desc(input_md, input_md, output_md), engine));
    a = dnnl::memory(input_md, engine);
    b = dnnl::memory(input_md, engine);
    c = dnnl::memory(output_md, engine);
    FillRandom(a, n * n, bf16, kSeedA);
    FillRandom(b, n * n, bf16, kSeedB);
  }
};

absl::StatusOr<std::unique_ptr<GemmBaseline>> GemmBaseline::Create(int64_t n, bool bf16) {
  if (n < 1 || n > kMaxSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("GEMM baseline size n = ", n, " must be in [1, ", kMaxSize, "]"));
  }
  try {
    return std::unique_ptr<GemmBaseline>(
        new GemmBaseline(n, bf16, std::make_unique<Impl>(n, bf16)));
  } catch (const dnnl::error& e) {
    return FromDnnlError(e, n, bf16);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("GEMM baseline: out of memory for three ", n, " x ", n, " matrices"));
  }
}

GemmBaseline::GemmBaseline(int64_t n, bool bf16, std::unique_ptr<Impl> impl)
    : n_(n), bf16_(bf16), impl_(std::move(impl)) {}

GemmBaseline::~GemmBaseline() = default;

absl::Status GemmBaseline::Run() {
  try {
    impl_->matmul.execute(
        impl_->stream,
        {{DNNL_ARG_SRC, impl_->a}, {DNNL_ARG_WEIGHTS, impl_->b}, {DNNL_ARG_DST, impl_->c}});
    impl_->stream.wait();
  } catch (const dnnl::error& e) {
    return FromDnnlError(e, n_, bf16_);
  }
  return absl::OkStatus();
}

}  // namespace attention
