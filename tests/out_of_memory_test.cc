// An allocation that fails is an answer for the one call that made it, never
// a crash and never the failure of the calls batched with it (issue 18).
//
// This binary replaces malloc (which operator new, the engine's buffers and
// protobuf's strings all reach) with one that, on a thread that asked for it,
// fails every allocation of at least a given size. gRPC's own allocator
// aborts on failure, so the server's paths are tested by calling its
// conversion functions on this thread rather than through a live server.

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "engine/kv_cache.h"
#include "engine/multihead.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/convert.h"
#include "server/response_encoder.h"
#include "tests/golden_case.h"
#include "tests/random_tensor.h"
#include "tests/status_matchers.h"

extern "C" void* __libc_malloc(size_t size);  // glibc's own

namespace {
// Allocations of at least this many bytes fail on this thread.
thread_local size_t fail_from = SIZE_MAX;
}  // namespace

extern "C" void* malloc(size_t size) {
  if (size >= fail_from) {
    errno = ENOMEM;
    return nullptr;
  }
  return __libc_malloc(size);
}

namespace attention {
namespace {

using ::testing::HasSubstr;
using testing::StatusIs;

constexpr size_t kMiB = size_t{1} << 20;

// Allocations of `bytes` or more fail on this thread while it lives.
class FailLargeAllocations {
 public:
  explicit FailLargeAllocations(size_t bytes) { fail_from = bytes; }
  ~FailLargeAllocations() { fail_from = SIZE_MAX; }
};

std::vector<float> Random(int64_t n, uint32_t seed) {
  return testing::RandomFloats({n}, seed).values;
}

TensorView View(const std::vector<float>& v, std::vector<int64_t> shape) {
  return TensorView{DType::kFloat32, std::move(shape), v.data(), v.size() * sizeof(float)};
}

TEST(OutOfMemoryTest, InjectedFailureIsSeen) {
  // The test itself works: a large allocation fails while armed, not after.
  {
    FailLargeAllocations armed(kMiB);
    EXPECT_THROW(std::vector<char>(2 * kMiB), std::bad_alloc);
  }
  EXPECT_NO_THROW(std::vector<char>(2 * kMiB));
}

class EngineOutOfMemoryTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    EngineOptions options;
    options.backend = GetParam();
    options.max_request_bytes = 0;  // no limits: the allocation itself must fail
    options.max_request_flops = 0;
    options.max_score_elements = 0;
    options.max_tensor_elements = 0;
    engine_ = std::move(Engine::Create(options)).value();
    const testing::GoldenCase c = testing::LoadGoldenCase("mha_bias_kv_zero_attn");
    layer_ = std::move(
                 MultiheadAttention::Create(testing::MultiheadConfigOf(c), testing::StateDictOf(c)))
                 .value();
  }

  std::unique_ptr<Engine> engine_;
  std::unique_ptr<MultiheadAttention> layer_;  // embed_dim 8
};

TEST_P(EngineOutOfMemoryTest, LayerCallThatCannotAllocateFailsAloneInItsBatch) {
  // 600,000 query rows of 8: each of the layer's projections is 18 MiB.
  const std::vector<float> big = Random(600000 * 8, 1), small = Random(5 * 8, 2);
  AttentionArgs big_args, small_args;
  big_args.query = View(big, {1, 600000, 8});
  small_args.query = View(small, {1, 5, 8});
  const EngineCall alone{&small_args, layer_.get()};
  const absl::StatusOr<AttentionResult> expected =
      engine_->AttendBatchFromThisThread({&alone, 1}).front();
  ASSERT_TRUE(expected.ok()) << expected.status();

  const std::vector<EngineCall> calls = {{&big_args, layer_.get()}, {&small_args, layer_.get()}};
  std::vector<absl::StatusOr<AttentionResult>> results;
  {
    FailLargeAllocations armed(16 * kMiB);
    results = engine_->AttendBatchFromThisThread(calls);
  }
  EXPECT_THAT(results[0].status(), StatusIs(absl::StatusCode::kResourceExhausted,
                                            HasSubstr("layer input projections: out of memory")));
  ASSERT_TRUE(results[1].ok()) << results[1].status();
  EXPECT_EQ(results[1]->output.data, expected->output.data);
  EXPECT_EQ(results[1]->output.shape, expected->output.shape);
}

TEST_P(EngineOutOfMemoryTest, RawCallThatCannotAllocateFailsAloneInItsBatch) {
  // The big call's output alone is 18 MiB.
  const std::vector<float> big = Random(600000 * 8, 3), small = Random(2 * 6 * 8, 4);
  AttentionArgs big_args, small_args;
  big_args.query = View(big, {1, 600000, 8});
  big_args.key = View(small, {1, 12, 8});
  small_args.query = View(small, {2, 6, 8});
  const EngineCall alone{&small_args, nullptr};
  const absl::StatusOr<AttentionResult> expected =
      engine_->AttendBatchFromThisThread({&alone, 1}).front();
  ASSERT_TRUE(expected.ok()) << expected.status();

  const std::vector<EngineCall> calls = {{&big_args, nullptr}, {&small_args, nullptr}};
  std::vector<absl::StatusOr<AttentionResult>> results;
  {
    FailLargeAllocations armed(16 * kMiB);
    results = engine_->AttendBatchFromThisThread(calls);
  }
  EXPECT_THAT(results[0].status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("out of memory")));
  ASSERT_TRUE(results[1].ok()) << results[1].status();
  EXPECT_EQ(results[1]->output.data, expected->output.data);
}

INSTANTIATE_TEST_SUITE_P(Backends, EngineOutOfMemoryTest,
                         ::testing::Values(Backend::kOneDnn, Backend::kReference),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return info.param == Backend::kOneDnn ? "OneDnn" : "Reference";
                         });

// A session step whose decode pass cannot get its partial results (64
// key/value heads, 64 causal query rows each, a cache split among two
// threads: about 13 MiB of them, against a 2 MiB output): RESOURCE_EXHAUSTED
// for the call, where std::bad_alloc left the engine and ended the server.
TEST(SessionOutOfMemoryTest, ADecodePassThatCannotAllocateIsResourceExhausted) {
  EngineOptions options;
  options.threads = 2;
  options.max_request_bytes = 0;
  options.max_request_flops = 0;
  options.max_score_elements = 0;
  options.max_tensor_elements = 0;
  std::unique_ptr<Engine> engine = std::move(Engine::Create(options)).value();
  constexpr int64_t kHeads = 64, kDim = 128, kCached = 2048 - 64, kRows = 64;
  const std::vector<float> cached = Random(kCached * kHeads * kDim, 5);
  std::unique_ptr<KvCache> cache =
      std::move(KvCache::Create(kHeads, kDim, kDim, DType::kFloat32)).value();
  ASSERT_TRUE(cache->Append(kCached, cached.data(), kHeads * kDim, kDim, cached.data(),
                            kHeads * kDim, kDim)
                  .ok());
  cache->Commit();
  const std::vector<float> rows = Random(kHeads * kRows * kDim, 6);
  AttentionArgs args;
  args.query = View(rows, {1, kHeads, kRows, kDim});
  args.mask.causal = Causal::kBottomRight;
  SessionCall session{{cache.get()}, false};
  EngineCall call{&args, nullptr};
  call.session = &session;
  absl::StatusOr<AttentionResult> result;
  {
    FailLargeAllocations armed(8 * kMiB);
    result = std::move(engine->AttendBatchFromThisThread({&call, 1}).front());
  }
  EXPECT_THAT(result.status(), StatusIs(absl::StatusCode::kResourceExhausted,
                                        HasSubstr("session decode: out of memory")));
  cache->Rollback();
  EXPECT_EQ(cache->length(), kCached);
  // With the memory, the same step answers.
  result = std::move(engine->AttendBatchFromThisThread({&call, 1}).front());
  EXPECT_TRUE(result.ok()) << result.status();
}

TEST(ServerOutOfMemoryTest, ParsingALargeRequestWithoutMemoryIsResourceExhausted) {
  v1::AttendRequest request;
  request.mutable_query()->set_dtype(v1::Tensor::FLOAT32);
  for (int64_t d : {1, 4096, 1024}) request.mutable_query()->add_shape(d);
  request.mutable_query()->set_data(std::string(4096 * 1024 * 4, '\0'));  // 16 MiB
  const grpc::ByteBuffer bytes = server::SerializeMessage(request);
  v1::AttendRequest parsed;
  absl::Status status;
  {
    FailLargeAllocations armed(8 * kMiB);
    status = server::ParseMessage(bytes, &parsed);
  }
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kResourceExhausted,
                               HasSubstr("request parsing: out of memory")));
  EXPECT_TRUE(server::ParseMessage(bytes, &parsed).ok());
}

TEST(ServerOutOfMemoryTest, EncodingALargeAnswerWithoutMemoryIsResourceExhausted) {
  AttentionResult result;
  result.output.shape = {1, 4096, 1024};
  result.output.data.assign(4096 * 1024, 0.5f);
  absl::StatusOr<grpc::ByteBuffer> encoded;
  {
    FailLargeAllocations armed(4 * kMiB);
    // As BFLOAT16, the answer's 8 MiB of data is a new allocation.
    encoded = server::EncodeResponse(v1::AttendResponse(), std::move(result),
                                     /*need_weights=*/false, v1::Tensor::BFLOAT16);
  }
  EXPECT_THAT(encoded.status(), StatusIs(absl::StatusCode::kResourceExhausted,
                                         HasSubstr("answer encoding: out of memory")));
}

}  // namespace
}  // namespace attention
