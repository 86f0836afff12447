// Engine calls with sessions (engine/kv_cache.h): every answer must equal the
// stateless call whose key and value are every row appended so far.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "engine/decode.h"
#include "engine/engine.h"
#include "engine/kv_cache.h"
#include "engine/multihead.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/golden_case.h"
#include "tests/random_tensor.h"
#include "tests/status_matchers.h"

namespace attention {
namespace {

using ::testing::HasSubstr;
using testing::IsOk;
using testing::StatusIs;

using Input = testing::FloatTensor;
using testing::RandomFloats;

using internal::DecodeKernels;
// Every kernel set of the decode pass: the CPU's widest (AVX-512 where it
// has it), the AVX2 kernels (the same as the widest on an AVX2 CPU) and the
// portable loops.
constexpr DecodeKernels kEveryKernelSet[] = {DecodeKernels::kBest, DecodeKernels::kAvx2,
                                             DecodeKernels::kPortable};
std::string KernelsName(DecodeKernels kernels) {
  switch (kernels) {
    case DecodeKernels::kBest:
      return internal::DecodeKernelsChosen();
    case DecodeKernels::kAvx2:
      return "AVX2";
    case DecodeKernels::kPortable:
      return "portable";
  }
  return "?";
}

// Concatenates a and b along `axis` (their other dims equal).
Input Concat(const Input& a, const Input& b, size_t axis) {
  if (a.values.empty()) return b;
  Input out{a.shape, {}};
  out.shape[axis] += b.shape[axis];
  int64_t outer = 1, inner_a = 1, inner_b = 1;
  for (size_t d = 0; d < axis; ++d) outer *= a.shape[d];
  for (size_t d = axis; d < a.shape.size(); ++d) {
    inner_a *= a.shape[d];
    inner_b *= b.shape[d];
  }
  for (int64_t o = 0; o < outer; ++o) {
    out.values.insert(out.values.end(), a.values.begin() + o * inner_a,
                      a.values.begin() + (o + 1) * inner_a);
    out.values.insert(out.values.end(), b.values.begin() + o * inner_b,
                      b.values.begin() + (o + 1) * inner_b);
  }
  return out;
}

// Batch row b of a batch-first tensor, as a batch of one.
Input Row(const Input& x, int64_t b) {
  Input out{x.shape, {}};
  out.shape[0] = 1;
  const int64_t n = static_cast<int64_t>(x.values.size()) / x.shape[0];
  out.values.assign(x.values.begin() + b * n, x.values.begin() + (b + 1) * n);
  return out;
}

void ExpectNear(const std::vector<float>& got, const std::vector<float>& want, float tolerance,
                const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  float worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::abs(got[i] - want[i]) / (1.0f + std::abs(want[i])));
  }
  EXPECT_LE(worst, tolerance) << what;
}

std::vector<float> Values(const FloatBuffer& b) { return {b.begin(), b.end()}; }

// The largest |a[i] - b[i]|; infinity when the sizes differ, so that a
// bound on it fails.
float MaxAbsDifference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return std::numeric_limits<float>::infinity();
  float worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

// x as a cache of `dtype` stores it.
float Stored(float x, DType dtype) {
  return dtype == DType::kBFloat16 ? BFloat16ToFloat(FloatToBFloat16(x)) : x;
}

std::unique_ptr<KvCache> NewCache(int64_t heads, int64_t kd, int64_t vd,
                                  DType dtype = DType::kFloat32) {
  return std::move(KvCache::Create(heads, kd, vd, dtype)).value();
}

// A cache of `dtype` holding `keys` random rows per key/value head, stored
// directly (a prefill through the reference backend would take most of a
// test's time), and those rows: 1 x kv_heads x keys x dim each, the values
// from seed + 1.
struct FilledCache {
  std::unique_ptr<KvCache> cache;
  Input k, v;
};
FilledCache Filled(int64_t kv_heads, int64_t dim, int64_t keys, DType dtype, uint32_t seed) {
  FilledCache f{NewCache(kv_heads, dim, dim, dtype), RandomFloats({1, kv_heads, keys, dim}, seed),
                RandomFloats({1, kv_heads, keys, dim}, seed + 1)};
  EXPECT_THAT(
      f.cache->Append(keys, f.k.values.data(), dim, keys * dim, f.v.values.data(), dim, keys * dim),
      IsOk());
  f.cache->Commit();
  return f;
}

// One step's rows, random from `seed`: the query (group query heads per
// key/value head) and the new keys and values, `rows` each, and the
// arguments that take them.
struct StepRows {
  Input q, k, v;
  AttentionArgs args;
};
StepRows RandomStep(int64_t kv_heads, int64_t group, int64_t rows, int64_t dim, uint32_t seed) {
  StepRows s{RandomFloats({1, kv_heads * group, rows, dim}, seed),
             RandomFloats({1, kv_heads, rows, dim}, seed + 1),
             RandomFloats({1, kv_heads, rows, dim}, seed + 2),
             {}};
  s.args.query = s.q.view();
  s.args.key = s.k.view();
  s.args.value = s.v.view();
  return s;
}

class SessionTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    EngineOptions options;
    options.backend = GetParam();
    engine_ = std::move(Engine::Create(options)).value();
  }

  // One session call on `caches`, committed when it succeeds.
  absl::StatusOr<AttentionResult> Step(const AttentionArgs& args, std::vector<KvCache*> caches,
                                       const MultiheadAttention* layer = nullptr,
                                       bool read_only = false) {
    SessionCall session{std::move(caches), read_only};
    EngineCall call{&args, layer};
    call.session = &session;
    absl::StatusOr<AttentionResult> r = std::move(engine_->AttendBatch({&call, 1}).front());
    for (KvCache* c : session.caches) {
      if (r.ok()) {
        c->Commit();
      } else {
        c->Rollback();
      }
    }
    return r;
  }

  // The stateless call of `args` over the cached rows k0 / v0 and then the
  // step's k / v ([1, Hk, S, D] each), as a cache of `dtype` stores them,
  // under precision EXACT whatever `args` asks (the answer FAST is held to).
  absl::StatusOr<AttentionResult> StatelessOverStored(AttentionArgs args, const Input& k0,
                                                      const Input& v0, const Input& k,
                                                      const Input& v, DType dtype) {
    args.fast = false;
    Input keys = Concat(k0, k, 2), values = Concat(v0, v, 2);
    for (float& x : keys.values) x = Stored(x, dtype);
    for (float& x : values.values) x = Stored(x, dtype);
    args.key = keys.view();
    args.value = values.view();
    return engine_->Attend(args);
  }

  // Output and weights of `got` within 2e-5 of the stateless call `args`.
  void ExpectStateless(const AttentionResult& got, const AttentionArgs& args,
                       const std::string& what) {
    absl::StatusOr<AttentionResult> want = engine_->Attend(args);
    ASSERT_THAT(want.status(), IsOk());
    ExpectNear(Values(got.output.data), Values(want->output.data), 2e-5f, what + " output");
    ExpectNear(Values(got.weights.data), Values(want->weights.data), 2e-5f, what + " weights");
  }

  std::unique_ptr<Engine> engine_;
};

TEST(KvCacheTest, AppendsIntoFixedBlocksAndRollsBack) {
  auto cache = NewCache(2, 3, 4);
  EXPECT_EQ(cache->block_bytes(), KvCache::kBlockRows * 2 * (3 + 4) * 4);
  EXPECT_EQ(cache->BytesFor(0), 0);
  EXPECT_EQ(cache->BytesFor(65), 2 * cache->block_bytes());
  // Rows of [heads, dim]: row r head h element e = 100 r + 10 h + e.
  std::vector<float> k(70 * 2 * 3), v(70 * 2 * 4);
  for (int r = 0; r < 70; ++r) {
    for (int h = 0; h < 2; ++h) {
      for (int e = 0; e < 3; ++e) k[(r * 2 + h) * 3 + e] = 100.0f * r + 10 * h + e;
      for (int e = 0; e < 4; ++e) v[(r * 2 + h) * 4 + e] = -100.0f * r - 10 * h - e;
    }
  }
  ASSERT_THAT(cache->Append(70, k.data(), 6, 3, v.data(), 8, 4), IsOk());
  EXPECT_EQ(cache->length(), 0);
  EXPECT_EQ(cache->pending(), 70);
  EXPECT_EQ(cache->bytes(), 2 * cache->block_bytes());
  cache->Commit();
  EXPECT_EQ(cache->length(), 70);
  float key[3], value[4];
  cache->ReadRows(1, 66, 1, key, value);
  EXPECT_EQ(key[2], 6612.0f);
  EXPECT_EQ(value[3], -6613.0f);
  // A failed call's rows go, and the blocks only they used.
  ASSERT_THAT(cache->Append(60, k.data(), 6, 3, v.data(), 8, 4), IsOk());
  EXPECT_EQ(cache->bytes(), 3 * cache->block_bytes());
  cache->Rollback();
  EXPECT_EQ(cache->length(), 70);
  EXPECT_EQ(cache->pending(), 0);
  EXPECT_EQ(cache->bytes(), 2 * cache->block_bytes());
  cache->ReadRows(0, 69, 1, key, value);
  EXPECT_EQ(key[0], 6900.0f);
}

// Appends rows [first, first + n) of k and v ([rows, heads, dim] each).
absl::Status AppendInputs(KvCache& cache, const Input& k, const Input& v, int64_t first, int64_t n,
                          int threads = 1) {
  const int64_t heads = k.shape[1], kd = k.shape[2], vd = v.shape[2];
  return cache.Append(n, k.values.data() + first * heads * kd, heads * kd, kd,
                      v.values.data() + first * heads * vd, heads * vd, vd, threads);
}

// a's blocks are byte for byte b's.
void ExpectSameBlocks(const KvCache& a, const KvCache& b) {
  ASSERT_EQ(a.blocks(), b.blocks());
  for (int64_t i = 0; i < a.blocks(); ++i) {
    EXPECT_EQ(std::memcmp(a.KeyBlock(i, 0), b.KeyBlock(i, 0), static_cast<size_t>(a.block_bytes())),
              0)
        << "block " << i;
  }
}

// Both storage layouts, odd dims (a BFLOAT16 key row is padded to pairs):
// rows appended at once on one thread, or in pieces of every alignment (odd
// starts, across blocks, the large ones on two threads), make the same
// blocks byte for byte; every element reads back as stored, one row or many
// at a time; and a rollback leaves the blocks exactly as if the dropped rows
// had never come (zeros past the last row, which kernels read).
TEST(KvCacheTest, EveryElementReadsBackAndRollbackRestoresZeros) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const int64_t heads = 4, kd = 33, vd = 31, rows = 637;
    const Input k = RandomFloats({rows, heads, kd}, 140), v = RandomFloats({rows, heads, vd}, 141);
    auto cache = NewCache(heads, kd, vd, dtype), pieces = NewCache(heads, kd, vd, dtype);
    ASSERT_THAT(AppendInputs(*cache, k, v, 0, rows), IsOk());
    cache->Commit();
    int64_t done = 0;
    for (int64_t n : {3, 300, 1, 333}) {
      ASSERT_THAT(AppendInputs(*pieces, k, v, done, n, /*threads=*/2), IsOk());
      done += n;
    }
    ASSERT_EQ(done, rows);
    EXPECT_EQ(pieces->pending(), rows);
    pieces->Commit();
    ExpectSameBlocks(*cache, *pieces);
    const auto stored_key = [&](int64_t r, int64_t h, int64_t e) {
      return Stored(k.values[(r * heads + h) * kd + e], dtype);
    };
    const auto stored_value = [&](int64_t r, int64_t h, int64_t e) {
      return Stored(v.values[(r * heads + h) * vd + e], dtype);
    };
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        float key[kd], value[vd];
        cache->ReadRows(h, r, 1, key, value);
        for (int64_t e = 0; e < kd; ++e) ASSERT_EQ(key[e], stored_key(r, h, e));
        for (int64_t e = 0; e < vd; ++e) ASSERT_EQ(value[e], stored_value(r, h, e));
      }
    }
    const int64_t from = 61, n = 200;  // from an odd row, across blocks
    std::vector<float> keys(n * kd), values(n * vd);
    cache->ReadRows(2, from, n, keys.data(), values.data());
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t e = 0; e < kd; ++e) ASSERT_EQ(keys[r * kd + e], stored_key(from + r, 2, e));
      for (int64_t e = 0; e < vd; ++e) ASSERT_EQ(values[r * vd + e], stored_value(from + r, 2, e));
    }
    // 10 rows of NaN, dropped.
    const std::vector<float> nan(10 * heads * std::max(kd, vd),
                                 std::numeric_limits<float>::quiet_NaN());
    ASSERT_THAT(cache->Append(10, nan.data(), heads * kd, kd, nan.data(), heads * vd, vd), IsOk());
    cache->Rollback();
    ExpectSameBlocks(*cache, *pieces);
  }
}

TEST(KvCacheTest, RejectsBadDimsAndDtypes) {
  EXPECT_THAT(KvCache::Create(0, 4, 4, DType::kFloat32).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("kv_heads 0")));
  EXPECT_THAT(KvCache::Create(1, 4, 4, DType::kFloat16).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("FLOAT16")));
}

TEST(KvCacheTest, BFloat16StorageRoundsToNearestEven) {
  auto cache = NewCache(1, 2, 2, DType::kBFloat16);
  const float k[2] = {1.00390625f, 3.14159f}, v[2] = {-2.5f, 1e-3f};
  ASSERT_THAT(cache->Append(1, k, 2, 2, v, 2, 2), IsOk());
  float key[2], value[2];
  cache->ReadRows(0, 0, 1, key, value);
  EXPECT_EQ(key[0], BFloat16ToFloat(FloatToBFloat16(k[0])));
  EXPECT_EQ(key[1], BFloat16ToFloat(FloatToBFloat16(k[1])));
  EXPECT_EQ(value[0], -2.5f);
  EXPECT_EQ(cache->bytes(), KvCache::kBlockRows * 4 * 2);
}

// A prefill of 70 rows (across a block boundary) and then single-row steps,
// rank 3 with heads, each answer against the stateless call.
TEST_P(SessionTest, PrefillThenStepsMatchTheStatelessCall) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const float tolerance = dtype == DType::kFloat32 ? 2e-5f : 2e-2f;
    auto cache = NewCache(4, 8, 8, dtype);
    Input keys, values;
    uint32_t seed = 1;
    for (int64_t rows : {70, 1, 1, 1, 3, 1}) {
      const Input q = RandomFloats({1, rows, 32}, seed++), k = RandomFloats({1, rows, 32}, seed++),
                  v = RandomFloats({1, rows, 32}, seed++);
      keys = Concat(keys, k, 1);
      values = Concat(values, v, 1);
      AttentionArgs args;
      args.query = q.view();
      args.key = k.view();
      args.value = v.view();
      args.num_heads = 4;
      args.mask.causal = Causal::kBottomRight;
      absl::StatusOr<AttentionResult> got = Step(args, {cache.get()});
      ASSERT_THAT(got.status(), IsOk());
      AttentionArgs whole = args;
      whole.key = keys.view();
      whole.value = values.view();
      absl::StatusOr<AttentionResult> want = engine_->Attend(whole);
      ASSERT_THAT(want.status(), IsOk());
      EXPECT_EQ(got->output.shape, want->output.shape);
      ExpectNear(Values(got->output.data), Values(want->output.data), tolerance,
                 absl::StrCat("after ", cache->length(), " rows"));
    }
    EXPECT_EQ(cache->length(), 77);
  }
}

// A call into new sessions attends the call's own rows: it is the stateless
// call, bit for bit (float32 tensors), and leaves the rows cached.
TEST_P(SessionTest, PrefillIntoNewSessionsIsTheStatelessCall) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    auto a = NewCache(4, 8, 8, dtype), b = NewCache(4, 8, 8, dtype);
    const Input x = RandomFloats({2, 70, 32}, 30);
    AttentionArgs args;
    args.query = x.view();  // self-attention: key = value = query
    args.num_heads = 4;
    args.mask.causal = Causal::kBottomRight;
    args.need_weights = dtype == DType::kBFloat16;
    absl::StatusOr<AttentionResult> got = Step(args, {a.get(), b.get()});
    ASSERT_THAT(got.status(), IsOk());
    absl::StatusOr<AttentionResult> want = engine_->Attend(args);
    ASSERT_THAT(want.status(), IsOk());
    EXPECT_EQ(got->output.shape, want->output.shape);
    EXPECT_EQ(Values(got->output.data), Values(want->output.data));
    EXPECT_EQ(got->weights.shape, want->weights.shape);
    EXPECT_EQ(Values(got->weights.data), Values(want->weights.data));
    for (int64_t row : {0, 63, 64, 69}) {
      float key[8], value[8];
      b->ReadRows(3, row, 1, key, value);
      for (int64_t e = 0; e < 8; ++e) {
        const float stored = Stored(x.values[(70 + row) * 32 + 24 + e], dtype);
        ASSERT_EQ(key[e], stored) << row;
        ASSERT_EQ(value[e], stored) << row;
      }
    }
  }
  // Rank 4, grouped-query heads, BFLOAT16 tensors on the wire.
  const Input q = RandomFloats({2, 4, 70, 8}, 31), k = RandomFloats({2, 2, 70, 8}, 32),
              v = RandomFloats({2, 2, 70, 6}, 33);
  auto bf16 = [](const Input& in, std::vector<uint16_t>& bits) {
    bits.clear();
    for (float f : in.values) bits.push_back(FloatToBFloat16(f));
    return TensorView{DType::kBFloat16, in.shape, bits.data(), bits.size() * 2};
  };
  std::vector<uint16_t> qb, kb, vb;
  AttentionArgs args;
  args.query = bf16(q, qb);
  args.key = bf16(k, kb);
  args.value = bf16(v, vb);
  args.need_weights = true;
  auto a = NewCache(2, 8, 6), b = NewCache(2, 8, 6);
  absl::StatusOr<AttentionResult> got = Step(args, {a.get(), b.get()});
  ASSERT_THAT(got.status(), IsOk());
  // A session computes in float32 over the rows as float32 (as cached).
  Input qf = q, kf = k, vf = v;
  for (Input* in : {&qf, &kf, &vf}) {
    for (float& f : in->values) f = Stored(f, DType::kBFloat16);
  }
  AttentionArgs as_float = args;
  as_float.query = qf.view();
  as_float.key = kf.view();
  as_float.value = vf.view();
  ExpectStateless(*got, as_float, "grouped-query");
  // Then one row more: the general path over the cached rows.
  const Input q1 = RandomFloats({2, 4, 1, 8}, 34), k1 = RandomFloats({2, 2, 1, 8}, 35),
              v1 = RandomFloats({2, 2, 1, 6}, 36);
  AttentionArgs step;
  step.query = q1.view();
  step.key = k1.view();
  step.value = v1.view();
  step.need_weights = true;
  got = Step(step, {a.get(), b.get()});
  ASSERT_THAT(got.status(), IsOk());
  const Input k_all = Concat(kf, k1, 2), v_all = Concat(vf, v1, 2);
  step.key = k_all.view();
  step.value = v_all.view();
  ExpectStateless(*got, step, "step");
}

// One new session and one with rows already: not the prefill's one call.
TEST_P(SessionTest, PrefillBesideAnOlderSessionAttendsEachOwnRows) {
  auto fresh = NewCache(2, 8, 8), older = NewCache(2, 8, 8);
  const Input x0 = RandomFloats({1, 5, 16}, 37);
  AttentionArgs args;
  args.query = x0.view();
  args.num_heads = 2;
  ASSERT_THAT(Step(args, {older.get()}).status(), IsOk());
  const Input x = RandomFloats({2, 70, 16}, 38);
  args.query = x.view();
  args.mask.causal = Causal::kBottomRight;
  absl::StatusOr<AttentionResult> got = Step(args, {fresh.get(), older.get()});
  ASSERT_THAT(got.status(), IsOk());
  const Input rows[2] = {Row(x, 0), Concat(x0, Row(x, 1), 1)};
  const int64_t half = 70 * 16;
  for (int b = 0; b < 2; ++b) {
    AttentionArgs alone = args;
    const Input q = Row(x, b);
    alone.query = q.view();
    alone.key = rows[b].view();
    absl::StatusOr<AttentionResult> want = engine_->Attend(alone);
    ASSERT_THAT(want.status(), IsOk());
    const std::vector<float> out = Values(got->output.data);
    ExpectNear(std::vector<float>(out.begin() + b * half, out.begin() + (b + 1) * half),
               Values(want->output.data), 2e-5f, absl::StrCat("row ", b));
  }
}

// Rows of one request with caches of different lengths: each as its own call.
TEST_P(SessionTest, RaggedRowsAreEachTheirOwnCall) {
  std::vector<std::unique_ptr<KvCache>> caches;
  std::vector<Input> keys(3), values(3);
  for (int b = 0; b < 3; ++b) {
    caches.push_back(NewCache(2, 8, 8));
    const Input k = RandomFloats({1, 10 + 60 * b, 16}, 10 + b),
                v = RandomFloats({1, 10 + 60 * b, 16}, 20 + b);
    AttentionArgs args;
    args.query = k.view();
    args.key = k.view();
    args.value = v.view();
    args.num_heads = 2;
    ASSERT_THAT(Step(args, {caches[b].get()}).status(), IsOk());
    keys[b] = k;
    values[b] = v;
  }
  for (bool need_weights : {false, true}) {
    SCOPED_TRACE(need_weights ? "general path" : "decode kernel");
    const Input q = RandomFloats({3, 1, 16}, 31), k = RandomFloats({3, 1, 16}, 32),
                v = RandomFloats({3, 1, 16}, 33);
    AttentionArgs args;
    args.query = q.view();
    args.key = k.view();
    args.value = v.view();
    args.num_heads = 2;
    args.mask.causal = Causal::kBottomRight;
    args.need_weights = need_weights;
    absl::StatusOr<AttentionResult> got =
        Step(args, {caches[0].get(), caches[1].get(), caches[2].get()});
    ASSERT_THAT(got.status(), IsOk());
    const int64_t width = 10 + 60 * 2 + (need_weights ? 2 : 1);  // the second step
    if (need_weights) {
      EXPECT_EQ(got->weights.shape, (std::vector<int64_t>{3, 2, 1, width}));
    }
    for (int b = 0; b < 3; ++b) {
      keys[b] = Concat(keys[b], Row(k, b), 1);
      values[b] = Concat(values[b], Row(v, b), 1);
      const Input qb = Row(q, b);
      AttentionArgs whole = args;
      whole.query = qb.view();
      whole.key = keys[b].view();
      whole.value = values[b].view();
      absl::StatusOr<AttentionResult> want = engine_->Attend(whole);
      ASSERT_THAT(want.status(), IsOk());
      const std::vector<float> out = Values(got->output.data);
      ExpectNear({out.begin() + b * 16, out.begin() + (b + 1) * 16}, Values(want->output.data),
                 2e-5f, absl::StrCat("row ", b));
      if (!need_weights) continue;
      const int64_t keys_b = keys[b].shape[1];
      for (int h = 0; h < 2; ++h) {
        const float* row = got->weights.data.data() + (b * 2 + h) * width;
        ExpectNear({row, row + keys_b},
                   {want->weights.data.begin() + h * keys_b,
                    want->weights.data.begin() + (h + 1) * keys_b},
                   2e-5f, absl::StrCat("weights row ", b, " head ", h));
        EXPECT_TRUE(std::all_of(row + keys_b, row + width, [](float w) { return w == 0; }));
      }
    }
  }
}

// Rank 4, 8 query heads over 2 key/value heads, with a cache long enough to
// be split across threads (and one that is not).
TEST_P(SessionTest, GroupedQueryHeadsShareTheirKeyValueHead) {
  for (int64_t prefill : {5, 3000}) {
    SCOPED_TRACE(prefill);
    auto cache = NewCache(2, 16, 16);
    const Input k0 = RandomFloats({1, 2, prefill, 16}, 41),
                v0 = RandomFloats({1, 2, prefill, 16}, 42);
    const Input q0 = RandomFloats({1, 8, prefill, 16}, 43);
    AttentionArgs args;
    args.query = q0.view();
    args.key = k0.view();
    args.value = v0.view();
    args.mask.causal = Causal::kBottomRight;
    ASSERT_THAT(Step(args, {cache.get()}).status(), IsOk());
    const Input q = RandomFloats({1, 8, 2, 16}, 44), k = RandomFloats({1, 2, 2, 16}, 45),
                v = RandomFloats({1, 2, 2, 16}, 46);
    args.query = q.view();
    args.key = k.view();
    args.value = v.view();
    absl::StatusOr<AttentionResult> got = Step(args, {cache.get()});
    ASSERT_THAT(got.status(), IsOk());
    const Input keys = Concat(k0, k, 2), values = Concat(v0, v, 2);
    AttentionArgs whole = args;
    whole.key = keys.view();
    whole.value = values.view();
    absl::StatusOr<AttentionResult> want = engine_->Attend(whole);
    ASSERT_THAT(want.status(), IsOk());
    EXPECT_EQ(got->output.shape, (std::vector<int64_t>{1, 8, 2, 16}));
    ExpectNear(Values(got->output.data), Values(want->output.data), 2e-5f, "output");
  }
}

// The decode kernel's head dims (multiples of 16 are vectorised, the value
// rows in passes of up to 8 chunks of 16 for one or two query rows, 4 for
// four rows or widened BFLOAT16: 256 takes two passes, 80 takes two over
// BFLOAT16), group sizes (query heads per key/value head, 1 to 8: rows
// processed in fours up to 64 dims, in pairs above, and what remains) and
// storage types, with a cache split across threads by block ranges and by
// heads.
TEST_P(SessionTest, DecodeKernelShapesMatch) {
  for (DecodeKernels kernels : kEveryKernelSet) {
    internal::SetDecodeKernels(kernels);
    for (int64_t dim : {32, 64, 80, 128, 256, 40, 33}) {
      for (int64_t group : {1, 3, 8}) {
        for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
          SCOPED_TRACE(absl::StrCat(KernelsName(kernels), " D", dim, " group ", group, " ",
                                    DTypeName(dtype)));
          // 10 blocks: where the cache is worth two threads, two ranges of
          // blocks, each head on its own.
          const int64_t kv_heads = 2, keys = 600;
          auto [cache, k0, v0] = Filled(kv_heads, dim, keys, dtype, 120);
          auto [q, k, v, args] = RandomStep(kv_heads, group, 1, dim, 122);
          absl::StatusOr<AttentionResult> got = Step(args, {cache.get()});
          ASSERT_THAT(got, IsOk());
          absl::StatusOr<AttentionResult> want = StatelessOverStored(args, k0, v0, k, v, dtype);
          ASSERT_THAT(want, IsOk());
          ExpectNear(Values(got->output.data), Values(want->output.data), 2e-5f, "output");
        }
      }
    }
  }
  internal::SetDecodeKernels(DecodeKernels::kBest);
}

// Sessions whose count does not divide among two threads: each session's
// blocks split in two (9 sessions), or its blocks and its heads (3), and
// every session's answer is still its own stateless call's.
TEST_P(SessionTest, DecodeKernelSplitsSessionsThatDoNotDivideAmongThreads) {
  EngineOptions options;
  options.backend = GetParam();
  options.threads = 2;
  std::unique_ptr<Engine> two = std::move(Engine::Create(options)).value();
  for (int64_t batch : {3, 9}) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      SCOPED_TRACE(absl::StrCat(batch, " sessions ", DTypeName(dtype)));
      // 10 blocks each: long enough to be worth two threads and to split.
      const int64_t kv_heads = 2, group = 2, dim = 32, cached = 600;
      std::vector<std::unique_ptr<KvCache>> caches;
      std::vector<Input> k0, v0;
      SessionCall session;
      for (int64_t b = 0; b < batch; ++b) {
        caches.push_back(NewCache(kv_heads, dim, dim, dtype));
        k0.push_back(RandomFloats({1, kv_heads, cached, dim}, static_cast<uint32_t>(170 + 2 * b)));
        v0.push_back(RandomFloats({1, kv_heads, cached, dim}, static_cast<uint32_t>(171 + 2 * b)));
        ASSERT_THAT(caches[b]->Append(cached, k0[b].values.data(), dim, cached * dim,
                                      v0[b].values.data(), dim, cached * dim),
                    IsOk());
        caches[b]->Commit();
        session.caches.push_back(caches[b].get());
      }
      const Input q = RandomFloats({batch, kv_heads * group, 1, dim}, 190),
                  k = RandomFloats({batch, kv_heads, 1, dim}, 191),
                  v = RandomFloats({batch, kv_heads, 1, dim}, 192);
      AttentionArgs args;
      args.query = q.view();
      args.key = k.view();
      args.value = v.view();
      EngineCall call{&args, nullptr};
      call.session = &session;
      absl::StatusOr<AttentionResult> got = std::move(two->AttendBatch({&call, 1}).front());
      for (KvCache* c : session.caches) c->Rollback();
      ASSERT_THAT(got, IsOk());
      const std::vector<float> out = Values(got->output.data);
      const int64_t per_row = kv_heads * group * dim;
      for (int64_t b = 0; b < batch; ++b) {
        AttentionArgs one = args;
        const Input qb = Row(q, b);
        one.query = qb.view();
        absl::StatusOr<AttentionResult> want =
            StatelessOverStored(one, k0[b], v0[b], Row(k, b), Row(v, b), dtype);
        ASSERT_THAT(want, IsOk());
        ExpectNear({out.begin() + b * per_row, out.begin() + (b + 1) * per_row},
                   Values(want->output.data), 2e-5f, absl::StrCat("session ", b));
      }
    }
  }
}

// The softmax step's exponentials, EXACT's and FAST's, in the AVX-512 and
// the AVX2 kernels: within their stated relative error of exp over the
// range a score minus its row's max takes (x <= 0), 0 below -87.34 (where
// exp leaves float32's normal range; -inf included), 1 at 0, NaN for NaN.
// FAST's weights are rounded to bfloat16 (relative error up to 2^-9) after
// it, so its 5e-6 is lost there. (The portable loops take engine/kernels.cc's
// exp, which the engine's tests check.)
TEST(DecodeExpTest, WithinTheirErrorOverTheScoresRange) {
  std::vector<float> x;
  for (int i = 0; i <= 200000; ++i) x.push_back(-87.3f * static_cast<float>(i) / 200000);
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> edges = {-87.4f, -88.0f, -1000.0f, -inf,
                                    std::numeric_limits<float>::quiet_NaN()};
  x.insert(x.end(), edges.begin(), edges.end());
  int ran = 0;
  for (DecodeKernels kernels : {DecodeKernels::kBest, DecodeKernels::kAvx2}) {
    internal::SetDecodeKernels(kernels);
    for (bool fast : {false, true}) {
      SCOPED_TRACE(absl::StrCat(KernelsName(kernels), fast ? " FAST" : " EXACT"));
      std::vector<float> y(x.size());
      if (!internal::DecodeExpForTesting(fast, x.data(), y.data(),
                                         static_cast<int64_t>(x.size()))) {
        continue;
      }
      ++ran;
      const double bound = fast ? 5e-6 : 2.5e-7;
      double worst = 0;
      for (size_t i = 0; i + edges.size() < x.size(); ++i) {
        const double want = std::exp(static_cast<double>(x[i]));
        worst = std::max(worst, std::abs(y[i] / want - 1));
      }
      EXPECT_LE(worst, bound);
      EXPECT_EQ(y[0], 1.0f);
      const size_t e = x.size() - edges.size();
      for (size_t i = e; i + 1 < x.size(); ++i) EXPECT_EQ(y[i], 0.0f) << x[i];
      EXPECT_TRUE(std::isnan(y.back()));
    }
  }
  internal::SetDecodeKernels(DecodeKernels::kBest);
  if (ran == 0) GTEST_SKIP() << "no AVX2 nor AVX-512: the decode pass runs its portable loops";
}

// The passes' account of their time (decode_bench prints it): nothing
// while recording is off; with it on, each pass once and each of its
// threads once, every thread's parts adding up to at most the pass's whole
// time (each thread's run from the pass's start); taking it starts again
// from zero.
TEST(DecodeTimesTest, EachPassAndThreadRecordedWhileOn) {
  EngineOptions options;
  options.threads = 2;
  std::unique_ptr<Engine> engine = std::move(Engine::Create(options)).value();
  // 600 KiB read per step: enough for both threads (kParallelBytes).
  const int64_t kv_heads = 2, dim = 64, cached = 600;
  const FilledCache filled = Filled(kv_heads, dim, cached, DType::kFloat32, 300);
  KvCache* const cache = filled.cache.get();
  SessionCall session{{cache}, false};
  StepRows rows = RandomStep(kv_heads, 4, 1, dim, 302);
  EngineCall call{&rows.args, nullptr};
  call.session = &session;
  auto step = [&] {
    ASSERT_THAT(engine->AttendBatch({&call, 1}).front(), IsOk());
    cache->Rollback();
  };
  internal::TakeDecodeTimes();
  step();
  EXPECT_EQ(internal::TakeDecodeTimes().passes, 0);
  internal::RecordDecodeTimes(true);
  step();
  step();
  internal::RecordDecodeTimes(false);
  step();
  const internal::DecodeTimes t = internal::TakeDecodeTimes();
  EXPECT_EQ(t.passes, 2);
  EXPECT_GE(t.thread_passes, 2);
  EXPECT_LE(t.thread_passes, 2 * engine->threads());
  EXPECT_GT(t.units, 0);
  EXPECT_GT(t.merge, 0);
  for (double part : {t.start, t.merge_wait, t.end}) EXPECT_GE(part, 0);
  const double parts = t.start + t.units + t.merge_wait + t.merge + t.end;
  EXPECT_LE(parts, t.wall * static_cast<double>(t.thread_passes) / 2 * 1.0001 + 1e-3);
  EXPECT_EQ(internal::TakeDecodeTimes().passes, 0);
}

// The rule behind it: at least four units per thread in all, and a
// multiple of the threads, the fewest per session that give both.
TEST(DecodeUnitsTest, EqualSessionsEndLevelOnEveryThread) {
  for (int threads = 1; threads <= 8; ++threads) {
    for (int64_t sessions = 1; sessions <= 40; ++sessions) {
      SCOPED_TRACE(absl::StrCat(sessions, " sessions, ", threads, " threads"));
      const int64_t units = internal::DecodeUnitsPerSession(sessions, threads);
      auto fits = [&](int64_t u) {
        return threads == 1 || (u * sessions >= 4 * threads && u * sessions % threads == 0);
      };
      EXPECT_TRUE(fits(units));
      EXPECT_TRUE(units == 1 || !fits(units - 1));
    }
  }
  EXPECT_EQ(internal::DecodeUnitsPerSession(9, 2), 2);
  EXPECT_EQ(internal::DecodeUnitsPerSession(16, 2), 1);
  EXPECT_EQ(internal::DecodeUnitsPerSession(3, 2), 4);
  EXPECT_EQ(internal::DecodeUnitsPerSession(1, 2), 8);
}

// A lone session's ranges: they cover its blocks in order, none under 4
// blocks, none larger than the one before but the last (which takes what
// is left), each a (2 x threads)th of what was left, rounded up to a
// multiple of 4 blocks.
TEST(DecodeUnitsTest, ALoneSessionsRangesShrinkAsTheyGo) {
  for (int threads = 1; threads <= 4; ++threads) {
    for (int64_t blocks = 1; blocks <= 600; ++blocks) {
      SCOPED_TRACE(absl::StrCat(blocks, " blocks, ", threads, " threads"));
      const std::vector<int64_t> b = internal::ShrinkingBlockRanges(blocks, threads);
      ASSERT_GE(b.size(), 2u);
      EXPECT_EQ(b.front(), 0);
      EXPECT_EQ(b.back(), blocks);
      for (size_t i = 1; i < b.size(); ++i) {
        const int64_t size = b[i] - b[i - 1], left = blocks - b[i - 1];
        const int64_t share = (std::max<int64_t>(4, (left + 2 * threads - 1) / (2 * threads)) + 3) / 4 * 4;
        EXPECT_GE(size, std::min<int64_t>(4, blocks));
        if (i + 1 < b.size()) {
          EXPECT_EQ(size, share);
          EXPECT_EQ(b[i] % 4, 0);
        } else {
          EXPECT_LT(left - share, 4);
        }
      }
    }
  }
  EXPECT_EQ(internal::ShrinkingBlockRanges(128, 2),
            (std::vector<int64_t>{0, 32, 56, 76, 92, 104, 112, 116, 120, 124, 128}));
}

// One long session on two threads, split into shrinking block ranges (129
// blocks: 11 ranges), for each storage type and precision: its answer is
// still its stateless call's.
TEST_P(SessionTest, ALoneLongSessionSplitIntoShrinkingRangesMatches) {
  EngineOptions options;
  options.backend = GetParam();
  options.threads = 2;
  std::unique_ptr<Engine> two = std::move(Engine::Create(options)).value();
  const int64_t kv_heads = 1, group = 4, dim = 32, cached = 128 * 64 + 20;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (bool fast : {false, true}) {
      if (fast && dtype == DType::kFloat32) continue;
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), fast ? " FAST" : ""));
      auto [cache, k0, v0] = Filled(kv_heads, dim, cached, dtype, 220);
      auto [q, k, v, args] = RandomStep(kv_heads, group, 1, dim, 222);
      args.fast = fast;
      SessionCall session{{cache.get()}, false};
      EngineCall call{&args, nullptr};
      call.session = &session;
      absl::StatusOr<AttentionResult> got = std::move(two->AttendBatch({&call, 1}).front());
      cache->Rollback();
      ASSERT_THAT(got, IsOk());
      absl::StatusOr<AttentionResult> want = StatelessOverStored(args, k0, v0, k, v, dtype);
      ASSERT_THAT(want, IsOk());
      ExpectNear(Values(got->output.data), Values(want->output.data), fast ? 2e-3f : 2e-5f,
                 "output");
    }
  }
}

// Steps of four causal rows through the decode kernel, whose last visible
// keys fall before a block boundary, on it and after it (the rows of one
// step seeing different numbers of a block's keys, some none of the last
// block's; with 253 cached, three rows none of the keys from the 257th on,
// whose softmax is summed apart), for both storage types and precision FAST.
TEST_P(SessionTest, DecodeKernelCausalRowsAcrossBlockBoundaries) {
  for (DecodeKernels kernels : kEveryKernelSet) {
    internal::SetDecodeKernels(kernels);
    for (int64_t cached : {58, 62, 124, 126, 190, 250, 253}) {
      for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
        for (bool fast : {false, true}) {
          if (fast && dtype == DType::kFloat32) continue;
          SCOPED_TRACE(absl::StrCat(KernelsName(kernels), " ", cached, " cached rows ",
                                    DTypeName(dtype), fast ? " FAST" : ""));
          const int64_t kv_heads = 2, group = 2, dim = 32, rows = 4;
          auto [cache, k0, v0] = Filled(kv_heads, dim, cached, dtype, 160);
          auto [q, k, v, args] = RandomStep(kv_heads, group, rows, dim, 162);
          args.mask.causal = Causal::kBottomRight;
          args.fast = fast;
          absl::StatusOr<AttentionResult> got = Step(args, {cache.get()});
          ASSERT_THAT(got, IsOk());
          absl::StatusOr<AttentionResult> want = StatelessOverStored(args, k0, v0, k, v, dtype);
          ASSERT_THAT(want, IsOk());
          // FAST rounds the query and the weights to bfloat16 (see below).
          ExpectNear(Values(got->output.data), Values(want->output.data), fast ? 2e-3f : 2e-5f,
                     "output");
        }
      }
    }
  }
  internal::SetDecodeKernels(DecodeKernels::kBest);
}

// Precision FAST over a BFLOAT16 cache: within bfloat16's rounding of the
// exact answer over the same cached rows, by the path the contract gives.
// bf16 products (the query and the weights rounded to bfloat16: errors of
// 1e-4 and more here) by tile multiplies where the CPU has them and the
// shape fits (from kMinTileRows query rows per key/value head), else by dot
// products where the engine chooses them for the step's rows
// (DecodeDotProductsChosen) or the test forces them, one row included;
// otherwise (or where the test forbids them) float32 math, within FAST's
// exponentials' error of the same step under EXACT. Odd dims and an odd
// last block included.
TEST_P(SessionTest, FastPrecisionOverBFloat16CacheIsWithinBFloat16Rounding) {
  using internal::DotProducts;
  const bool avx512_bf16 = __builtin_cpu_supports("avx512bf16");
  for (DotProducts dot : {DotProducts::kChosen, DotProducts::kAlways, DotProducts::kNever}) {
    if (dot == DotProducts::kAlways && !avx512_bf16) continue;
    // Forcing either way takes the tiles away: the step is then the one
    // without them.
    const bool forced = dot != DotProducts::kChosen;
    for (int64_t dim : {64, 128, 33}) {
      for (int64_t group : {1, 2, 4}) {
        SCOPED_TRACE(absl::StrCat("D", dim, " group ", group,
                                  dot == DotProducts::kAlways  ? " dot products"
                                  : dot == DotProducts::kNever ? " float32 math"
                                                               : ""));
        const int64_t kv_heads = 2, keys = 600;  // 600 + 1 rows: the last block's 25th row
        // The same rows in two caches: one steps under FAST, the other EXACT.
        auto cache = NewCache(kv_heads, dim, dim, DType::kBFloat16);
        auto twin = NewCache(kv_heads, dim, dim, DType::kBFloat16);
        const Input k0 = RandomFloats({1, kv_heads, keys, dim}, 150),
                    v0 = RandomFloats({1, kv_heads, keys, dim}, 151);
        AttentionArgs args;
        args.query = k0.view();
        args.key = k0.view();
        args.value = v0.view();
        ASSERT_THAT(Step(args, {cache.get()}), IsOk());
        ASSERT_THAT(Step(args, {twin.get()}), IsOk());
        const Input q = RandomFloats({1, kv_heads * group, 1, dim}, 152),
                    k = RandomFloats({1, kv_heads, 1, dim}, 153),
                    v = RandomFloats({1, kv_heads, 1, dim}, 154);
        args.query = q.view();
        args.key = k.view();
        args.value = v.view();
        args.fast = true;
        internal::UseDecodeTiles(!forced);
        internal::SetDecodeDotProducts(dot);
        absl::StatusOr<AttentionResult> got = Step(args, {cache.get()});
        internal::UseDecodeTiles(true);
        internal::SetDecodeDotProducts(DotProducts::kChosen);
        ASSERT_THAT(got, IsOk());
        AttentionArgs exact = args;
        exact.fast = false;
        absl::StatusOr<AttentionResult> want =
            StatelessOverStored(exact, k0, v0, k, v, DType::kBFloat16);
        ASSERT_THAT(want, IsOk());
        const std::vector<float> g = Values(got->output.data);
        // The query and the weights rounded by up to 2^-9 relative: here up
        // to 5e-4 on outputs that average N(0, 1) values.
        EXPECT_LE(MaxAbsDifference(g, Values(want->output.data)), 2e-3f);
        absl::StatusOr<AttentionResult> exact_step = Step(exact, {twin.get()});
        ASSERT_THAT(exact_step, IsOk());
        const float from_exact = MaxAbsDifference(g, Values(exact_step->output.data));
        const bool tiles = !forced && internal::DecodeTilesAvailable() && dim % 32 == 0 &&
                           group >= internal::kMinTileRows;
        const bool bf16_products =
            avx512_bf16 &&
            (tiles || dot == DotProducts::kAlways ||
             (dot == DotProducts::kChosen && internal::DecodeDotProductsChosen(group)));
        if (bf16_products) {
          EXPECT_GE(from_exact, 1e-4f) << "bf16 products did not run";
        } else {
          // Only the exponentials differ (up to 5e-6 relative): here 4e-7.
          EXPECT_LE(from_exact, 1e-5f) << "float32 math did not run";
        }
      }
    }
  }
}

// Precision FAST with tile multiplies (AMX, where the CPU and the OS have
// them) against the same steps with bf16 dot products (forced, as on CPUs
// where the engine computes those steps in float32): the same products
// of the same bfloat16 roundings, summed in another order, so equal to
// within float32 sums' rounding, and both within bfloat16's rounding of the
// exact answer. The shapes the tiles take (4 to 16 query rows per
// key/value head, key dims a multiple of 32, value dims of 16: value passes
// of 1 to 4 chunks of 16 elements, one to four of 32 key elements; causal
// rows) and two they leave to the dot products (32 rows; key dim 48). On a
// CPU without them, both runs take the dot products and must be equal.
TEST_P(SessionTest, FastTileMultipliesMatchTheDotProducts) {
  struct Case {
    int64_t group, query_len, key_dim, value_dim;
  };
  const Case cases[] = {{4, 1, 128, 128}, {8, 2, 64, 64},   {16, 1, 32, 80}, {4, 2, 96, 256},
                        {2, 2, 128, 16},  {8, 4, 64, 64},   {4, 1, 48, 48}};
  const bool tiles = internal::DecodeTilesAvailable();
  bool tiles_ran = false;
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("group ", c.group, " query_len ", c.query_len, " Dk ", c.key_dim,
                              " Dv ", c.value_dim));
    const int64_t kv_heads = 2, cached = 300;  // 300 + query_len rows: an odd last block
    const Input k0 = RandomFloats({1, kv_heads, cached, c.key_dim}, 210),
                v0 = RandomFloats({1, kv_heads, cached, c.value_dim}, 211);
    // The same rows in two caches: one steps with dot products, one with tiles.
    auto dot_cache = NewCache(kv_heads, c.key_dim, c.value_dim, DType::kBFloat16);
    auto tile_cache = NewCache(kv_heads, c.key_dim, c.value_dim, DType::kBFloat16);
    for (KvCache* cache : {dot_cache.get(), tile_cache.get()}) {
      ASSERT_THAT(cache->Append(cached, k0.values.data(), c.key_dim, cached * c.key_dim,
                                v0.values.data(), c.value_dim, cached * c.value_dim),
                  IsOk());
      cache->Commit();
    }
    const Input q = RandomFloats({1, kv_heads * c.group, c.query_len, c.key_dim}, 212),
                k = RandomFloats({1, kv_heads, c.query_len, c.key_dim}, 213),
                v = RandomFloats({1, kv_heads, c.query_len, c.value_dim}, 214);
    AttentionArgs args;
    args.query = q.view();
    args.key = k.view();
    args.value = v.view();
    args.mask.causal = Causal::kBottomRight;
    args.fast = true;
    // Dot products wherever tiles do not run, in both steps.
    internal::SetDecodeDotProducts(internal::DotProducts::kAlways);
    internal::UseDecodeTiles(false);
    absl::StatusOr<AttentionResult> dot = Step(args, {dot_cache.get()});
    internal::UseDecodeTiles(true);
    absl::StatusOr<AttentionResult> tile = Step(args, {tile_cache.get()});
    internal::SetDecodeDotProducts(internal::DotProducts::kChosen);
    ASSERT_THAT(dot, IsOk());
    ASSERT_THAT(tile, IsOk());
    absl::StatusOr<AttentionResult> want =
        StatelessOverStored(args, k0, v0, k, v, DType::kBFloat16);
    ASSERT_THAT(want, IsOk());
    const std::vector<float> d = Values(dot->output.data), t = Values(tile->output.data);
    ExpectNear(d, Values(want->output.data), 2e-3f, "dot products against EXACT");
    ExpectNear(t, Values(want->output.data), 2e-3f, "tiles against EXACT");
    // Float32 sums of a few hundred products in another order.
    ExpectNear(t, d, 1e-4f, "tiles against dot products");
    const int64_t rows = c.group * c.query_len;
    const bool fits = rows <= 16 && c.key_dim % 32 == 0 && c.value_dim % 16 == 0;
    if (tiles && fits) {
      // Summed in another order: some output differs in its last bits.
      tiles_ran |= t != d;
    } else {
      EXPECT_EQ(t, d) << "the dot products ran both times";
    }
  }
  if (tiles) {
    EXPECT_TRUE(tiles_ran) << "tile multiplies did not run";
  }
}

// Infinite and NaN cached rows give what the stateless call gives: a key
// of +inf / -inf elements makes scores of +-inf (a weight of 0 for -inf, NaN
// rows for +inf, as softmax gives), a NaN value element makes that element
// of its head's outputs NaN. Also under FAST over BFLOAT16 with 4 query
// heads per key/value head (its own multiplies and exponentials), within
// FAST's error.
TEST_P(SessionTest, NonFiniteCachedRowsMatchTheStatelessCall) {
  const int64_t kv_heads = 3, dim = 64, keys = 300;
  for (auto [dtype, fast] : {std::pair{DType::kFloat32, false}, std::pair{DType::kBFloat16, false},
                             std::pair{DType::kBFloat16, true}}) {
    SCOPED_TRACE(absl::StrCat(DTypeName(dtype), fast ? " FAST" : ""));
    const int64_t group = fast ? 4 : 2;
    auto cache = NewCache(kv_heads, dim, dim, dtype);
    Input k0 = RandomFloats({1, kv_heads, keys, dim}, 130),
          v0 = RandomFloats({1, kv_heads, keys, dim}, 131);
    const float inf = std::numeric_limits<float>::infinity();
    // Head 0: every element of key 70 is -inf, of key 200 (another block)
    // -inf; head 1: key 5 is +inf in every element; head 2: value 150 NaN.
    for (int64_t e = 0; e < dim; ++e) {
      k0.values[(0 * keys + 70) * dim + e] = -inf;
      k0.values[(0 * keys + 200) * dim + e] = -inf;
      k0.values[(1 * keys + 5) * dim + e] = inf;
    }
    v0.values[(2 * keys + 150) * dim + 7] = std::numeric_limits<float>::quiet_NaN();
    AttentionArgs args;
    args.query = k0.view();
    args.key = k0.view();
    args.value = v0.view();
    args.mask.causal = Causal::kBottomRight;
    // Prefill's own answer is not compared: the non-finite rows are also
    // queries there.
    ASSERT_THAT(Step(args, {cache.get()}), IsOk());
    // Positive queries: q . k is -inf for head 0's -inf keys, +inf for head 1's.
    Input q = RandomFloats({1, kv_heads * group, 1, dim}, 132);
    for (float& x : q.values) x = std::abs(x) + 0.1f;
    const Input k = RandomFloats({1, kv_heads, 1, dim}, 133),
                v = RandomFloats({1, kv_heads, 1, dim}, 134);
    args.query = q.view();
    args.key = k.view();
    args.value = v.view();
    args.fast = fast;
    absl::StatusOr<AttentionResult> got = Step(args, {cache.get()});
    ASSERT_THAT(got, IsOk());
    absl::StatusOr<AttentionResult> want = StatelessOverStored(args, k0, v0, k, v, dtype);
    ASSERT_THAT(want, IsOk());
    const std::vector<float> g = Values(got->output.data), w = Values(want->output.data);
    ASSERT_EQ(g.size(), w.size());
    int64_t nans = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      const int64_t head = static_cast<int64_t>(i) / dim / group;  // key/value head
      ASSERT_EQ(std::isnan(g[i]), std::isnan(w[i])) << "element " << i << " (key/value head "
                                                    << head << "): " << g[i] << " vs " << w[i];
      nans += std::isnan(w[i]);
      if (!std::isnan(w[i])) {
        EXPECT_NEAR(g[i], w[i], (fast ? 2e-3f : 2e-5f) * (1 + std::abs(w[i]))) << i;
      }
    }
    // Head 1's query rows are NaN, and element 7 of head 2's.
    EXPECT_EQ(nans, group * dim + group);
  }
}

// Scores other than dot products, and weights, take the general path.
TEST_P(SessionTest, OtherScoresAndWeightsMatch) {
  for (ScoreKind kind : {ScoreKind::kGaussian, ScoreKind::kCosine, ScoreKind::kDot,
                         ScoreKind::kNegEuclidean}) {
    auto cache = NewCache(1, 8, 4);
    const Input k0 = RandomFloats({1, 1, 20, 8}, 51), v0 = RandomFloats({1, 1, 20, 4}, 52);
    const Input q = RandomFloats({1, 1, 1, 8}, 53), k = RandomFloats({1, 1, 1, 8}, 54),
                v = RandomFloats({1, 1, 1, 4}, 55);
    AttentionArgs args;
    args.query = k0.view();
    args.key = k0.view();
    args.value = v0.view();
    args.score.kind = kind;
    ASSERT_THAT(Step(args, {cache.get()}).status(), IsOk());
    args.query = q.view();
    args.key = k.view();
    args.value = v.view();
    args.need_weights = true;
    args.average_weights = true;
    absl::StatusOr<AttentionResult> got = Step(args, {cache.get()});
    ASSERT_THAT(got.status(), IsOk());
    const Input keys = Concat(k0, k, 2), values = Concat(v0, v, 2);
    AttentionArgs whole = args;
    whole.key = keys.view();
    whole.value = values.view();
    absl::StatusOr<AttentionResult> want = engine_->Attend(whole);
    ASSERT_THAT(want.status(), IsOk());
    ExpectNear(Values(got->output.data), Values(want->output.data), 2e-5f, "output");
    ExpectNear(Values(got->weights.data), Values(want->weights.data), 2e-5f, "weights");
  }
}

TEST_P(SessionTest, ReadOnlyAttendsWithoutAppending) {
  auto cache = NewCache(2, 4, 4);
  const Input x = RandomFloats({1, 30, 8}, 61);
  AttentionArgs args;
  args.query = x.view();
  args.num_heads = 2;
  ASSERT_THAT(Step(args, {cache.get()}).status(), IsOk());
  const int64_t bytes = cache->bytes();
  const Input q = RandomFloats({1, 5, 8}, 62);
  AttentionArgs read;
  read.query = q.view();
  read.num_heads = 2;
  absl::StatusOr<AttentionResult> got = Step(read, {cache.get()}, nullptr, /*read_only=*/true);
  ASSERT_THAT(got.status(), IsOk());
  EXPECT_EQ(cache->length(), 30);
  EXPECT_EQ(cache->bytes(), bytes);
  AttentionArgs whole = read;
  whole.key = x.view();
  absl::StatusOr<AttentionResult> want = engine_->Attend(whole);
  ASSERT_THAT(want.status(), IsOk());
  ExpectNear(Values(got->output.data), Values(want->output.data), 2e-5f, "output");
  read.key = q.view();
  EXPECT_THAT(Step(read, {cache.get()}, nullptr, true).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("read_only")));
}

// A layer's cache holds its projected keys and values per head; bias_k /
// bias_v and the zero-attention key come after every cached row.
TEST_P(SessionTest, LayersCacheTheirProjections) {
  const testing::GoldenCase c = testing::LoadGoldenCase("mha_bias_kv_zero_attn");
  auto with_extras = std::move(MultiheadAttention::Create(testing::MultiheadConfigOf(c),
                                                          testing::StateDictOf(c)))
                         .value();
  MultiheadConfig plain_config;
  plain_config.embed_dim = 16;
  plain_config.num_heads = 4;
  plain_config.kdim = 6;
  plain_config.vdim = 10;
  StateDict weights;
  uint32_t seed = 70;
  for (const auto& [key, shape] : MultiheadAttention::ExpectedWeights(plain_config)) {
    const Input w = RandomFloats(shape, seed++);
    weights[key] = Tensor{shape, FloatBuffer(w.values.begin(), w.values.end())};
  }
  auto plain = std::move(MultiheadAttention::Create(plain_config, std::move(weights))).value();
  // A 9-row prefill the decode kernel computes; a 70-row one with weights,
  // into two new sessions, is the stateless forward on its own rows.
  struct Prefill {
    int64_t batch;
    std::vector<int64_t> rows;
    bool need_weights;
  };
  for (const Prefill& p : {Prefill{1, {9, 1, 1, 2}, false}, Prefill{2, {70, 1}, true}}) {
    for (const MultiheadAttention* layer : {with_extras.get(), plain.get()}) {
      const MultiheadConfig& config = layer->config();
      SCOPED_TRACE(absl::StrCat("embed_dim ", config.embed_dim, ", batch ", p.batch));
      const int64_t e = config.embed_dim, heads = config.num_heads;
      std::vector<std::unique_ptr<KvCache>> owned;
      std::vector<KvCache*> caches;
      for (int64_t b = 0; b < p.batch; ++b) {
        owned.push_back(NewCache(heads, e / heads, e / heads));
        caches.push_back(owned.back().get());
      }
      Input keys, values;
      for (int64_t rows : p.rows) {
        // Sequence-first, as torch's default.
        const Input q = RandomFloats({rows, p.batch, e}, seed++),
                    k = RandomFloats({rows, p.batch, config.key_dim()}, seed++),
                    v = RandomFloats({rows, p.batch, config.value_dim()}, seed++);
        keys = Concat(keys, k, 0);
        values = Concat(values, v, 0);
        AttentionArgs args;
        args.query = q.view();
        args.key = k.view();
        args.value = v.view();
        args.layout = Layout::kSequenceFirst;
        args.mask.causal = Causal::kBottomRight;
        args.need_weights = p.need_weights;
        absl::StatusOr<AttentionResult> got = Step(args, caches, layer);
        ASSERT_THAT(got.status(), IsOk());
        AttentionArgs whole = args;
        whole.key = keys.view();
        whole.value = values.view();
        whole.need_weights = true;
        absl::StatusOr<AttentionResult> want = layer->Forward(*engine_, whole);
        ASSERT_THAT(want.status(), IsOk());
        EXPECT_EQ(got->output.shape, want->output.shape);
        ExpectNear(Values(got->output.data), Values(want->output.data), 2e-5f,
                   absl::StrCat(rows, " rows"));
        if (p.need_weights) {
          ExpectNear(Values(got->weights.data), Values(want->weights.data), 2e-5f,
                     absl::StrCat(rows, " rows, weights"));
        }
        args.need_weights = true;  // the general path, from a read-only call
        args.key = TensorView{};
        args.value = TensorView{};
        absl::StatusOr<AttentionResult> read = Step(args, caches, layer, true);
        ASSERT_THAT(read.status(), IsOk());
        ExpectNear(Values(read->output.data), Values(want->output.data), 2e-5f, "read-only");
        ExpectNear(Values(read->weights.data), Values(want->weights.data), 2e-5f, "weights");
      }
    }
  }
}

// Session calls batched with each other and with a stateless call: each gets
// what it gets alone.
TEST_P(SessionTest, BatchedSessionCallsGetTheirOwnResults) {
  std::vector<std::unique_ptr<KvCache>> caches, alone;
  std::vector<Input> inputs;
  for (int i = 0; i < 3; ++i) {
    caches.push_back(NewCache(4, 8, 8));
    alone.push_back(NewCache(4, 8, 8));
    inputs.push_back(RandomFloats({1, 40 + i, 32}, 80 + i));
    AttentionArgs args;
    args.query = inputs.back().view();
    args.num_heads = 4;
    ASSERT_THAT(Step(args, {caches[i].get()}).status(), IsOk());
    ASSERT_THAT(Step(args, {alone[i].get()}).status(), IsOk());
  }
  const Input step = RandomFloats({1, 1, 32}, 90), raw = RandomFloats({2, 7, 32}, 91);
  std::vector<AttentionArgs> args(4);
  std::vector<SessionCall> sessions(3);
  std::vector<EngineCall> calls(4);
  for (int i = 0; i < 3; ++i) {
    args[i].query = step.view();
    args[i].num_heads = 4;
    args[i].need_weights = i == 2;
    sessions[i].caches = {caches[i].get()};
    calls[i] = EngineCall{&args[i], nullptr};
    calls[i].session = &sessions[i];
  }
  args[3].query = raw.view();
  args[3].num_heads = 4;
  calls[3] = EngineCall{&args[3], nullptr};
  std::vector<absl::StatusOr<AttentionResult>> batched = engine_->AttendBatch(calls);
  for (int i = 0; i < 3; ++i) {
    ASSERT_THAT(batched[i].status(), IsOk());
    caches[i]->Commit();
    absl::StatusOr<AttentionResult> own = Step(args[i], {alone[i].get()});
    ASSERT_THAT(own.status(), IsOk());
    EXPECT_EQ(Values(batched[i]->output.data), Values(own->output.data)) << i;
    EXPECT_EQ(caches[i]->length(), alone[i]->length());
  }
  absl::StatusOr<AttentionResult> own = engine_->Attend(args[3]);
  ASSERT_THAT(batched[3].status(), IsOk());
  EXPECT_EQ(Values(batched[3]->output.data), Values(own->output.data));
}

// A step over a cache long enough to split among threads (600 rows of two
// key/value heads: 300 KiB) gives the same bits alone on one or two threads
// and batched with fifteen other sessions' steps: its softmax is summed over
// fixed ranges of the cache, whatever the split. (Before, the ranges
// followed the threads and the sessions in the pass.)
TEST_P(SessionTest, ALongSessionsStepIsTheSameAloneBatchedAndOnAnyThreads) {
  auto engine = [&](int threads) {
    EngineOptions options;
    options.backend = GetParam();
    options.threads = threads;
    return std::move(Engine::Create(options)).value();
  };
  const std::unique_ptr<Engine> one = engine(1), two = engine(2);
  constexpr int kSessions = 16;
  std::vector<std::unique_ptr<KvCache>> caches;
  std::vector<Input> prefills;
  for (int i = 0; i < kSessions; ++i) {
    caches.push_back(NewCache(2, 32, 32));
    prefills.push_back(RandomFloats({1, 600, 64}, 200 + i));
    AttentionArgs args;
    args.query = prefills.back().view();
    args.num_heads = 2;
    ASSERT_THAT(Step(args, {caches.back().get()}).status(), IsOk());
  }
  const Input step = RandomFloats({1, 1, 64}, 250);
  std::vector<AttentionArgs> args(kSessions);
  std::vector<SessionCall> sessions(kSessions);
  std::vector<EngineCall> calls(kSessions);
  for (int i = 0; i < kSessions; ++i) {
    args[i].query = step.view();
    args[i].num_heads = 2;
    sessions[i].caches = {caches[i].get()};
    calls[i] = EngineCall{&args[i], nullptr};
    calls[i].session = &sessions[i];
  }
  auto run = [&](Engine& e, size_t count) {
    std::vector<absl::StatusOr<AttentionResult>> results =
        e.AttendBatchFromThisThread({calls.data(), count});
    for (size_t i = 0; i < count; ++i) caches[i]->Rollback();
    EXPECT_THAT(results[0].status(), IsOk());
    return results[0].ok() ? Values(results[0]->output.data) : std::vector<float>();
  };
  const std::vector<float> alone_one = run(*one, 1);
  ASSERT_FALSE(alone_one.empty());
  EXPECT_EQ(run(*two, 1), alone_one);
  EXPECT_EQ(run(*two, kSessions), alone_one);
  EXPECT_EQ(run(*one, kSessions), alone_one);
}

// A pass whose team OpenMP makes smaller than the engine asks: a step led
// from inside another parallel region (nested regions get one thread, as
// under OMP_THREAD_LIMIT=1) answers as the same step does outside it, and
// its threads do not wait for team members that never came.
TEST_P(SessionTest, AStepInsideAnotherParallelRegionAnswersAsOutside) {
  EngineOptions options;
  options.backend = GetParam();
  options.threads = 2;
  const std::unique_ptr<Engine> two = std::move(Engine::Create(options)).value();
  constexpr int kSessions = 3;
  std::vector<std::unique_ptr<KvCache>> caches;
  std::vector<AttentionArgs> args(kSessions);
  std::vector<SessionCall> sessions(kSessions);
  std::vector<EngineCall> calls(kSessions);
  // Grouped-query heads: 4 query heads over 2 key/value heads.
  const Input rows = RandomFloats({1, 2, 4000, 32}, 260), q = RandomFloats({1, 4, 1, 32}, 261),
              kv = RandomFloats({1, 2, 1, 32}, 262);
  for (int i = 0; i < kSessions; ++i) {
    caches.push_back(NewCache(2, 32, 32));
    ASSERT_THAT(caches.back()->Append(4000, rows.values.data(), 32, 4000 * 32, rows.values.data(),
                                      32, 4000 * 32),
                IsOk());
    caches.back()->Commit();
    args[i].query = q.view();
    args[i].key = kv.view();
    args[i].value = kv.view();
    sessions[i].caches = {caches[i].get()};
    calls[i] = EngineCall{&args[i], nullptr};
    calls[i].session = &sessions[i];
  }
  auto run = [&] {
    std::vector<absl::StatusOr<AttentionResult>> results = two->AttendBatchFromThisThread(calls);
    std::vector<float> out;
    for (int i = 0; i < kSessions; ++i) {
      caches[i]->Rollback();
      EXPECT_THAT(results[i].status(), IsOk());
      if (results[i].ok()) {
        const std::vector<float> own = Values(results[i]->output.data);
        out.insert(out.end(), own.begin(), own.end());
      }
    }
    return out;
  };
  const std::vector<float> outside = run();
  ASSERT_FALSE(outside.empty());
  std::vector<float> inside;
#pragma omp parallel num_threads(2)
  {
    if (omp_get_thread_num() == 0) inside = run();
  }
  EXPECT_EQ(inside, outside);
}

TEST_P(SessionTest, RefusedCallsNameTheFieldAndAppendNothing) {
  auto cache = NewCache(2, 4, 4);
  const Input x = RandomFloats({1, 3, 8}, 100);
  AttentionArgs args;
  args.query = x.view();
  args.num_heads = 2;
  ASSERT_THAT(Step(args, {cache.get()}).status(), IsOk());
  const int64_t bytes = cache->bytes();
  struct Case {
    const char* name;
    std::function<void(AttentionArgs&)> change;
    absl::StatusCode code;
    const char* message;
  };
  const Input lens{{1}, {1.0f}};
  // A key or value of two batch rows for one session: the second row's rows
  // were dropped (values) before.
  const Input pair = RandomFloats({2, 1, 8}, 102);
  const Input one = RandomFloats({1, 1, 8}, 103);
  const std::vector<Case> cases = {
      {"key batch", [&](AttentionArgs& a) { a.key = pair.view(); },
       absl::StatusCode::kInvalidArgument, "key: batch 2 does not match query's 1"},
      {"value batch",
       [&](AttentionArgs& a) {
         a.key = one.view();
         a.value = pair.view();
       },
       absl::StatusCode::kInvalidArgument, "value: batch 2 does not match query's 1"},
      {"top left", [](AttentionArgs& a) { a.mask.causal = Causal::kTopLeft; },
       absl::StatusCode::kInvalidArgument, "mask.causal: TOP_LEFT"},
      {"padding", [&](AttentionArgs& a) { a.mask.key_padding_mask = x.view(); },
       absl::StatusCode::kInvalidArgument, "mask.key_padding_mask: not supported with sessions"},
      {"dropout", [](AttentionArgs& a) { a.dropout_p = 0.5; }, absl::StatusCode::kInvalidArgument,
       "dropout_p"},
      {"heads", [](AttentionArgs& a) { a.num_heads = 4; }, absl::StatusCode::kInvalidArgument,
       "query: session.ids[0]'s session holds 2 key/value heads of 4"},
  };
  for (const Case& c : cases) {
    AttentionArgs bad = args;
    c.change(bad);
    EXPECT_THAT(Step(bad, {cache.get()}).status(), StatusIs(c.code, HasSubstr(c.message)))
        << c.name;
    EXPECT_EQ(cache->length(), 3) << c.name;
    EXPECT_EQ(cache->bytes(), bytes) << c.name;
  }
  const Input two = RandomFloats({2, 1, 8}, 101);
  args.query = two.view();
  EXPECT_THAT(Step(args, {cache.get()}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("session.ids: 1 sessions do not match the batch size 2")));
  // Rows neither committed nor dropped: a caller's bug, not the request's.
  args.query = x.view();
  SessionCall session{{cache.get()}, false};
  EngineCall call{&args, nullptr};
  call.session = &session;
  ASSERT_THAT(engine_->AttendBatch({&call, 1}).front().status(), IsOk());
  EXPECT_THAT(engine_->AttendBatch({&call, 1}).front().status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("neither committed")));
  cache->Rollback();
  EXPECT_EQ(cache->length(), 3);
  EXPECT_EQ(cache->bytes(), bytes);
}

TEST_P(SessionTest, CostCountsEveryCachedRow) {
  auto cache = NewCache(1, 64, 64);
  const Input prefill = RandomFloats({1, 1000, 64}, 110), step = RandomFloats({1, 1, 64}, 111);
  AttentionArgs args;
  args.query = prefill.view();
  ASSERT_THAT(Step(args, {cache.get()}).status(), IsOk());
  args.query = step.view();
  SessionCall session{{cache.get()}, false};
  EngineCall call{&args, nullptr};
  call.session = &session;
  absl::StatusOr<CallCost> cost = engine_->CostOf(call);
  ASSERT_THAT(cost.status(), IsOk());
  // q.k and p.v over 1001 keys of 64: 2 * 1001 * 128 multiply-adds at least.
  EXPECT_GE(cost->flops, 2.0 * 1001 * 128);
  EXPECT_EQ(cost->output_elements, 64);
}

INSTANTIATE_TEST_SUITE_P(Backends, SessionTest,
                         ::testing::Values(Backend::kOneDnn, Backend::kReference),
                         [](const auto& info) {
                           return info.param == Backend::kOneDnn ? "onednn" : "reference";
                         });

}  // namespace
}  // namespace attention
