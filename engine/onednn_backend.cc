// The oneDNN backend. Work is split over (batch, head, block of query rows)
// across OpenMP threads; inside a work item every matmul is a oneDNN
// primitive run single-threaded, and the element-wise work between them
// (scale, masks, softmax, dropout) is engine/kernels.cc.
//
// need_weights = false: FlashAttention-style online softmax over blocks of
// keys; no L x S buffer; key blocks masked for every row of a query block
// (causal, valid_lens) are skipped.
// need_weights = true: a block of query rows against all keys, written
// straight into the weights output, exact softmax, then one matmul with V.

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/half.h"
#include "engine/backend.h"
#include "engine/cost.h"
#include "engine/internal.h"
#include "engine/kernels.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attention::internal {
namespace {

constexpr int64_t kQueryBlock = 64;
constexpr int64_t kKeyBlock = 512;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------
// Matmuls: C[M x N] (+)= A[M x K] * B[K x N], every operand strided, built once
// per shape class and cached. B is read transposed (element (k, n) at
// b[n * ldb + k]) when `b_transposed`.

struct MatmulKey {
  int64_t m, n, k, lda, ldb, ldc;
  bool b_transposed, bf16, accumulate;
  bool scaled = false;  // C = scale * A B, scale given at run time
  bool bias = false;    // C = A B + bias[n]
  auto Tie() const {
    return std::tie(m, n, k, lda, ldb, ldc, b_transposed, bf16, accumulate, scaled, bias);
  }
  bool operator<(const MatmulKey& o) const { return Tie() < o.Tie(); }
};

struct Matmul {
  dnnl::matmul primitive;
  dnnl::memory::desc a, b, c, bias;
  size_t scratchpad_bytes = 0;
};

class MatmulCache {
 public:
  explicit MatmulCache(const dnnl::engine& engine) : engine_(engine) {}

  // Thread-safe; the returned primitive lives as long as the cache.
  const Matmul& Get(const MatmulKey& key) {
    absl::MutexLock lock(&mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    using dt = dnnl::memory::data_type;
    const dt in = key.bf16 ? dt::bf16 : dt::f32;
    Matmul mm;
    mm.a = dnnl::memory::desc({key.m, key.k}, in, dnnl::memory::dims{key.lda, 1});
    mm.b = dnnl::memory::desc(
        {key.k, key.n}, in,
        key.b_transposed ? dnnl::memory::dims{1, key.ldb} : dnnl::memory::dims{key.ldb, 1});
    mm.c = dnnl::memory::desc({key.m, key.n}, dt::f32, dnnl::memory::dims{key.ldc, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (key.scaled) attr.set_output_scales(0, {DNNL_RUNTIME_F32_VAL});
    if (key.accumulate) {
      dnnl::post_ops ops;
      ops.append_sum(1.0f);
      attr.set_post_ops(ops);
    }
    if (key.bias) mm.bias = dnnl::memory::desc({1, key.n}, dt::f32, dnnl::memory::dims{key.n, 1});
    dnnl::matmul::primitive_desc pd(key.bias ? dnnl::matmul::desc(mm.a, mm.b, mm.bias, mm.c)
                                             : dnnl::matmul::desc(mm.a, mm.b, mm.c),
                                    attr, engine_);
    mm.scratchpad_bytes = pd.scratchpad_desc().get_size();
    mm.primitive = dnnl::matmul(pd);
    return cache_.emplace(key, std::move(mm)).first->second;
  }

 private:
  dnnl::engine engine_;
  absl::Mutex mu_;
  std::map<MatmulKey, Matmul> cache_ ABSL_GUARDED_BY(mu_);
};

// What one OpenMP thread owns during a call.
struct ThreadContext {
  dnnl::engine engine;
  dnnl::stream stream;
  std::vector<uint8_t> scratchpad;
  std::vector<float> scores;    // a block of score rows
  std::vector<uint16_t> probs;  // the same rows in bf16, for bf16 matmuls
  std::vector<float> acc;       // output accumulator of the online softmax
  std::vector<float> row_max, row_sum;
  std::vector<float> head_weights;  // one head's weight rows, for the head average

  explicit ThreadContext(const dnnl::engine& e) : engine(e), stream(e) {}

  // Runs one matmul: a small float32 one as plain loops, any other as a
  // cached oneDNN primitive whose memory objects are made once per thread and
  // only re-pointed afterwards.
  void RunMatmul(MatmulCache& cache, const MatmulKey& key, const void* a, const void* b, float* c,
                 float scale = 1.0f, const float* bias = nullptr) {
    if (!key.bf16 && key.m * key.n * key.k <= kSmallMatmulVolume) {
      SmallMatmul(key, static_cast<const float*>(a), static_cast<const float*>(b), c,
                  key.scaled ? scale : 1.0f, key.bias ? bias : nullptr);
      return;
    }
    const Matmul& mm = cache.Get(key);
    auto [it, added] = bound.try_emplace(&mm);
    Bound& bd = it->second;
    if (added) {
      bd.args[DNNL_ARG_SRC] = dnnl::memory(mm.a, engine, nullptr);
      bd.args[DNNL_ARG_WEIGHTS] = dnnl::memory(mm.b, engine, nullptr);
      bd.args[DNNL_ARG_DST] = dnnl::memory(mm.c, engine, nullptr);
      bd.args[DNNL_ARG_SCRATCHPAD] =
          dnnl::memory(dnnl::memory::desc({static_cast<int64_t>(mm.scratchpad_bytes)},
                                          dnnl::memory::data_type::u8, dnnl::memory::dims{1}),
                       engine, nullptr);
      if (key.scaled) {
        bd.args[DNNL_ARG_ATTR_OUTPUT_SCALES] = dnnl::memory(
            {{1}, dnnl::memory::data_type::f32, dnnl::memory::dims{1}}, engine, &bd.scale);
      }
      if (key.bias) bd.args[DNNL_ARG_BIAS] = dnnl::memory(mm.bias, engine, nullptr);
    }
    if (key.bias) bd.args[DNNL_ARG_BIAS].set_data_handle(const_cast<float*>(bias));
    if (scratchpad.size() < mm.scratchpad_bytes) scratchpad.resize(mm.scratchpad_bytes);
    bd.args[DNNL_ARG_SRC].set_data_handle(const_cast<void*>(a));
    bd.args[DNNL_ARG_WEIGHTS].set_data_handle(const_cast<void*>(b));
    bd.args[DNNL_ARG_DST].set_data_handle(c);
    bd.args[DNNL_ARG_SCRATCHPAD].set_data_handle(scratchpad.data());
    bd.scale = scale;
    mm.primitive.execute(stream, bd.args);
  }

  // A oneDNN call costs microseconds however little its work, and attention
  // over short sequences is made of many tiny matmuls (16 x 16 x 16 for
  // 4 heads of 16 over 16 tokens): up to this m * n * k they are plain loops.
  // The choice depends on the shape alone, and a call is split the same way
  // batched or not, so batching still leaves results bit-identical.
  static constexpr int64_t kSmallMatmulVolume = 32 * 32 * 32;

  void SmallMatmul(const MatmulKey& key, const float* a, const float* b, float* c, float scale,
                   const float* bias) {
    const int64_t m = key.m, n = key.n, k = key.k;
    int64_t ldb = key.ldb;
    if (key.b_transposed) {  // B(kk, j) = b[j * ldb + kk]: make it row-major
      small_b.resize(static_cast<size_t>(k * n));
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t kk = 0; kk < k; ++kk) small_b[kk * n + j] = b[j * ldb + kk];
      }
      b = small_b.data();
      ldb = n;
    }
    if (key.accumulate) {
      small_c.resize(static_cast<size_t>(m * n));
      SmallGemm(a, key.lda, b, ldb, small_c.data(), n, m, n, k);
      for (int64_t i = 0; i < m; ++i) {
        float* row = small_c.data() + i * n;
        if (scale != 1.0f) Scale(row, n, scale);
        Add(c + i * key.ldc, n, row);
      }
      return;
    }
    SmallGemm(a, key.lda, b, ldb, c, key.ldc, m, n, k);
    if (scale != 1.0f || bias != nullptr) {
      for (int64_t i = 0; i < m; ++i) ScaleAddBias(c + i * key.ldc, n, scale, bias);
    }
  }

  std::vector<float> small_b, small_c;

  struct Bound {
    std::unordered_map<int, dnnl::memory> args;
    float scale = 1.0f;
  };
  // std::map: Bound::scale's address must not move.
  std::map<const Matmul*, Bound> bound;
};

// One ThreadContext per OpenMP thread of a pass, kept from pass to pass: made
// afresh, each pass would recreate its oneDNN stream and memory objects and
// regrow its buffers, which for a small call costs more than the math.
// Concurrent passes (callers of Engine::Attend beside the scheduler) each
// take their own team. Thread-safe.
class ThreadContextPool {
 public:
  using Team = std::vector<std::unique_ptr<ThreadContext>>;

  explicit ThreadContextPool(const dnnl::engine& engine) : engine_(engine) {}

  // A team of at least `threads` contexts, returned by Release.
  std::unique_ptr<Team> Acquire(int threads) {
    std::unique_ptr<Team> team;
    {
      absl::MutexLock lock(&mu_);
      if (!free_.empty()) {
        team = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (team == nullptr) team = std::make_unique<Team>();
    while (static_cast<int>(team->size()) < threads) {
      team->push_back(std::make_unique<ThreadContext>(engine_));
    }
    return team;
  }

  void Release(std::unique_ptr<Team> team) {
    absl::MutexLock lock(&mu_);
    free_.push_back(std::move(team));
  }

  // Runs body(context, k) for every k in [0, total), items handed out one at a
  // time, on `threads` OpenMP threads, each with its own context of a team
  // taken from the pool. A one-thread pass runs on the calling thread without
  // an OpenMP region: entering and leaving one costs more than the math of a
  // small call. Callers have set omp_set_num_threads(threads).
  template <typename Body>
  void ForEachItem(int threads, int64_t total, Body body) {
    std::unique_ptr<Team> team = Acquire(threads);
    if (threads == 1) {
      for (int64_t k = 0; k < total; ++k) body(*(*team)[0], k);
    } else {
#pragma omp parallel
      {
        ThreadContext& t = *(*team)[omp_get_thread_num()];
#pragma omp for schedule(dynamic, 1)
        for (int64_t k = 0; k < total; ++k) body(t, k);
      }
    }
    Release(std::move(team));
  }

 private:
  dnnl::engine engine_;
  absl::Mutex mu_;
  std::vector<std::unique_ptr<Team>> free_ ABSL_GUARDED_BY(mu_);
};

// ---------------------------------------------------------------------------
// Operands: one of query / key / value (or a tensor derived from one), read
// per (batch, head, row) through a HeadIndexer; rows are contiguous.

struct Operand {
  const void* data = nullptr;
  bool bf16 = false;
  HeadIndexer ix;
  int64_t cols = 0;

  int64_t ld() const { return ix.pos_stride; }
  const void* Row(int64_t b, int64_t h, int64_t r) const {
    return static_cast<const char*>(data) + ix.Offset(b, h, r) * (bf16 ? 2 : 4);
  }
  const float* RowF(int64_t b, int64_t h, int64_t r) const {
    return static_cast<const float*>(Row(b, h, r));
  }
};

using HalfBuffer = std::vector<uint16_t, DefaultInitAllocator<uint16_t>>;

// Owns converted copies of inputs, in the engine's reused output memory (no
// zero-fill, no fresh page faults on every call).
class Storage {
 public:
  // `v` as float32 / bf16: its own data when already so, else a copy made
  // once per call.
  const float* Floats(const TensorView& v) {
    if (v.dtype == DType::kFloat32) return static_cast<const float*>(v.data);
    auto [it, added] = float_copies_.try_emplace(KeyOf(v));
    if (added) {
      const int64_t n = static_cast<int64_t>(v.size_bytes / DTypeSize(v.dtype));
      it->second.resize(static_cast<size_t>(n));
      float* out = it->second.data();
      if (v.dtype == DType::kBFloat16) {
        const auto* in = static_cast<const uint16_t*>(v.data);
        constexpr int64_t kChunk = 1 << 16;
#pragma omp parallel for schedule(static)
        for (int64_t c = 0; c < n; c += kChunk)
          FromBFloat16(in + c, out + c, std::min(kChunk, n - c));
      } else {
        const std::vector<float> loaded = LoadFloats(v);
        std::copy(loaded.begin(), loaded.end(), out);
      }
    }
    return it->second.data();
  }
  const uint16_t* BFloat16s(const TensorView& v) {
    if (v.dtype == DType::kBFloat16) return static_cast<const uint16_t*>(v.data);
    auto [it, added] = half_copies_.try_emplace(KeyOf(v));
    if (added) {
      const int64_t n = static_cast<int64_t>(v.size_bytes / DTypeSize(v.dtype));
      it->second.resize(static_cast<size_t>(n));
      const float* f = Floats(v);
      uint16_t* out = it->second.data();
      constexpr int64_t kChunk = 1 << 16;
#pragma omp parallel for schedule(static)
      for (int64_t c = 0; c < n; c += kChunk) ToBFloat16(f + c, out + c, std::min(kChunk, n - c));
    }
    return it->second.data();
  }
  FloatBuffer& NewFloats(size_t n) {
    floats_.emplace_back(n);
    return floats_.back();
  }
  HalfBuffer& NewHalves(size_t n) {
    halves_.emplace_back(n);
    return halves_.back();
  }

 private:
  // Views of one buffer may differ in dtype and length (a query and a key
  // that is a prefix of it): each is its own input.
  using Key = std::tuple<const void*, DType, size_t>;
  static Key KeyOf(const TensorView& v) { return {v.data, v.dtype, v.size_bytes}; }

  std::map<Key, FloatBuffer> float_copies_;
  std::map<Key, HalfBuffer> half_copies_;
  // Deques: references handed out stay valid as more buffers are added.
  std::deque<FloatBuffer> floats_;
  std::deque<HalfBuffer> halves_;
};

// Every mask of a call, ready for the row pass.
struct Masks {
  int64_t masked_keys = 0;  // keys at or past this are never masked
  int64_t query_len = 0;
  Causal causal = Causal::kNone;
  int64_t causal_offset = 0;
  std::vector<int64_t> lens;
  bool lens_per_row = false;
  int64_t lens_batch_stride = 0;
  const float* padding_f = nullptr;
  const uint8_t* padding_b = nullptr;
  int64_t padding_batch_stride = 0;
  const float* attn_f = nullptr;
  const uint8_t* attn_b = nullptr;
  int64_t attn_strides[4] = {0, 0, 0, 0};

  // Keys [RowLimit, masked_keys) of row i are masked by causal / valid_lens.
  int64_t RowLimit(int64_t b, int64_t i) const {
    int64_t limit = masked_keys;
    if (causal != Causal::kNone) limit = std::min(limit, i + causal_offset + 1);
    if (!lens.empty())
      limit = std::min(limit, lens[b * lens_batch_stride + (lens_per_row ? i : 0)]);
    return std::max<int64_t>(limit, 0);
  }

  // Applies every mask to scores s[0, n) of keys [j0, j0 + n) of row (b, h, i).
  void Apply(float* s, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n) const {
    const int64_t end = std::min(j0 + n, masked_keys);
    if (end <= j0) return;
    const int64_t m = end - j0;
    if (padding_f) Add(s, m, padding_f + b * padding_batch_stride + j0);
    if (padding_b) MaskBool(s, m, padding_b + b * padding_batch_stride + j0);
    if (attn_f || attn_b) {
      const int64_t base = b * attn_strides[0] + h * attn_strides[1] + i * attn_strides[2];
      if (attn_strides[3] == 0) {  // one column broadcast over every key
        const bool masked = attn_b && attn_b[base];
        const float add = attn_f ? attn_f[base] : 0.0f;
        for (int64_t j = 0; j < m; ++j) s[j] = masked ? kNegInf : s[j] + add;
      } else if (attn_f) {
        Add(s, m, attn_f + base + j0);
      } else {
        MaskBool(s, m, attn_b + base + j0);
      }
    }
    const int64_t limit = RowLimit(b, i);
    if (limit < end) FillNegInf(s + std::max<int64_t>(limit - j0, 0), end - std::max(limit, j0));
  }
};

std::vector<int64_t> BroadcastStrides(const std::vector<int64_t>& shape, size_t rank) {
  std::vector<int64_t> strides(rank, 0);
  int64_t stride = 1;
  for (size_t k = 0; k < shape.size(); ++k) {
    strides[rank - 1 - k] = shape[shape.size() - 1 - k] == 1 ? 0 : stride;
    stride *= shape[shape.size() - 1 - k];
  }
  return strides;
}

Masks PrepareMasks(const MaskSpec& m, const AttentionShape& s, Storage& storage) {
  Masks out;
  out.masked_keys = s.key_len - m.unmasked_tail;
  out.query_len = s.query_len;
  out.causal = m.causal;
  out.causal_offset = m.causal == Causal::kBottomRight ? out.masked_keys - s.query_len : 0;
  if (m.valid_lens.present()) {
    out.lens = LoadInts(m.valid_lens);
    out.lens_per_row = m.valid_lens.shape.size() == 2;
    out.lens_batch_stride = m.valid_lens.shape[0] == 1 ? 0 : (out.lens_per_row ? s.query_len : 1);
  }
  if (m.key_padding_mask.present()) {
    const TensorView& v = m.key_padding_mask;
    out.padding_batch_stride = v.shape[0] == 1 ? 0 : v.shape[1];
    if (v.dtype == DType::kBool) {
      out.padding_b = static_cast<const uint8_t*>(v.data);
    } else {
      out.padding_f = storage.Floats(v);
    }
  }
  if (m.attn_mask.present()) {
    const TensorView& v = m.attn_mask;
    std::vector<int64_t> shape = v.shape;
    if (shape.size() == 3) shape.insert(shape.begin() + 1, 1);  // [B, L, S] -> [B, 1, L, S]
    const std::vector<int64_t> st = BroadcastStrides(shape, 4);
    std::copy(st.begin(), st.end(), out.attn_strides);
    if (v.dtype == DType::kBool) {
      out.attn_b = static_cast<const uint8_t*>(v.data);
    } else {
      out.attn_f = storage.Floats(v);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------
// One call, prepared.

struct Problem {
  AttentionShape s;
  const AttentionArgs* args = nullptr;
  ScoreKind kind = ScoreKind::kScaledDot;
  bool gemm_scores = true;  // scores by matmul (else by the direct loops below)
  bool bf16 = false;        // matmuls in bf16
  float scale = 1.0f;
  Operand q, k, v;                  // matmul operands (q may be derived: bilinear)
  Operand qf, kf;                   // float32 q and k for direct scores
  const float* row_norm = nullptr;  // cosine: |q| per (b, h, i), [B, H, L]
  const float* col_norm = nullptr;  // cosine: |k| per (b, hk, j), [Bk, Hk, S]
  const float* key_bias = nullptr;  // gaussian: -bw^2/2 |k|^2 per (b, hk, j)
  int64_t key_batches = 1;          // batch dim of key: B or 1
  int64_t query_batches = 1;        // batch dim of query: B or 1
  // additive: W_q q per query row [Bq, H, L, hidden], W_k k per key, w_v
  const float* add_q = nullptr;
  const float* add_k = nullptr;
  const float* add_w = nullptr;
  int64_t hidden = 0;
  Masks masks;
  HeadIndexer out_ix;
  int64_t group = 1;  // query heads per key head
  // The call's interrupt (EngineCall::interrupt; may be null): polled
  // between work items, and by the additive score per row of a key block.
  const std::function<absl::Status()>* interrupt = nullptr;

  int64_t KeyHead(int64_t h) const { return h / group; }
  int64_t KeyBatch(int64_t b) const { return key_batches == 1 ? 0 : b; }
};

Operand MakeOperand(const TensorView& v, const AttentionArgs& a, const AttentionShape& s,
                    int64_t heads, int64_t dim, bool bf16, Storage& storage) {
  Operand op;
  op.ix = MakeHeadIndexer(v, a.layout, s.rank4, heads, dim);
  op.cols = dim;
  op.bf16 = bf16;
  op.data = bf16 ? static_cast<const void*>(storage.BFloat16s(v))
                 : static_cast<const void*>(storage.Floats(v));
  return op;
}

int64_t BatchOf(const TensorView& v, const AttentionArgs& a, bool rank4) {
  return (rank4 || a.layout == Layout::kBatchFirst) ? v.shape[0] : v.shape[1];
}

Problem Prepare(const AttentionArgs& a, const AttentionShape& s, bool cpu_bf16, Storage& st) {
  Problem p;
  p.s = s;
  p.args = &a;
  p.kind = a.score.kind;
  p.group = s.heads / s.kv_heads;
  const TensorView& qv = a.query;
  const TensorView& kv = a.key.present() ? a.key : qv;
  const TensorView& vv = a.value.present() ? a.value : kv;
  p.key_batches = BatchOf(kv, a, s.rank4);
  p.gemm_scores = p.kind != ScoreKind::kAdditive && p.kind != ScoreKind::kNegEuclidean;
  const bool bf16_input =
      qv.dtype == DType::kBFloat16 || kv.dtype == DType::kBFloat16 || vv.dtype == DType::kBFloat16;
  // Gaussian scores are bw^2 q.k - bw^2/2 |k|^2: bf16 rounding of q and k
  // (relative 2^-9) is multiplied by bw^2 |q||k| before the terms cancel, so
  // they keep float32 matmuls.
  p.bf16 = cpu_bf16 && (a.fast || bf16_input) && p.kind != ScoreKind::kGaussian;
  p.scale = static_cast<float>(EffectiveScale(a.score, s.query_dim));

  const int64_t H = s.heads, Hk = s.kv_heads, L = s.query_len, S = s.key_len;
  p.v = MakeOperand(vv, a, s, Hk, s.value_dim, p.bf16, st);
  // Float32 q and k: read by every score kind but the plain dot products.
  const bool plain_dot = p.kind == ScoreKind::kScaledDot || p.kind == ScoreKind::kDot;
  if (!plain_dot) {
    p.qf = MakeOperand(qv, a, s, H, s.query_dim, false, st);
    p.kf = MakeOperand(kv, a, s, Hk, s.key_dim, false, st);
  }
  const int64_t Bq = BatchOf(qv, a, s.rank4), Bk = p.key_batches;
  p.query_batches = Bq;

  if (p.kind == ScoreKind::kBilinear) {
    // q' = q W per head, [Bq, H, L, Dk]; then scores are q' . k.
    const std::vector<float> w = LoadFloats(a.score.w);
    const int64_t dq = s.query_dim, dk = s.key_dim;
    FloatBuffer& qw = st.NewFloats(static_cast<size_t>(Bq * H * L * dk));
#pragma omp parallel for collapse(3) schedule(static)
    for (int64_t b = 0; b < Bq; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < L; ++i) {
          const float* qrow = p.qf.RowF(b, h, i);
          float* out = qw.data() + ((b * H + h) * L + i) * dk;
          for (int64_t e = 0; e < dk; ++e) {
            double acc = 0;
            for (int64_t d = 0; d < dq; ++d) acc += double{qrow[d]} * w[d * dk + e];
            out[e] = static_cast<float>(acc);
          }
        }
    Operand derived;
    derived.cols = dk;
    derived.ix = HeadIndexer{Bq == 1 ? 0 : H * L * dk, L * dk, dk};
    if (p.bf16) {
      HalfBuffer& half = st.NewHalves(qw.size());
      ToBFloat16(qw.data(), half.data(), static_cast<int64_t>(qw.size()));
      derived.data = half.data();
      derived.bf16 = true;
    } else {
      derived.data = qw.data();
    }
    p.q = derived;
  } else if (p.gemm_scores) {
    p.q = MakeOperand(qv, a, s, H, s.query_dim, p.bf16, st);
  }
  if (p.gemm_scores) p.k = MakeOperand(kv, a, s, Hk, s.key_dim, p.bf16, st);

  if (p.kind == ScoreKind::kCosine) {
    FloatBuffer& rn = st.NewFloats(static_cast<size_t>(Bq * H * L));
#pragma omp parallel for collapse(3) schedule(static)
    for (int64_t b = 0; b < Bq; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < L; ++i) {
          const float* r = p.qf.RowF(b, h, i);
          rn[(b * H + h) * L + i] = std::sqrt(Dot(r, r, s.query_dim));
        }
    FloatBuffer& cn = st.NewFloats(static_cast<size_t>(Bk * Hk * S));
#pragma omp parallel for collapse(3) schedule(static)
    for (int64_t b = 0; b < Bk; ++b)
      for (int64_t h = 0; h < Hk; ++h)
        for (int64_t j = 0; j < S; ++j) {
          const float* r = p.kf.RowF(b, h, j);
          cn[(b * Hk + h) * S + j] = std::sqrt(Dot(r, r, s.key_dim));
        }
    p.row_norm = rn.data();
    p.col_norm = cn.data();
  }
  if (p.kind == ScoreKind::kGaussian) {
    // -bw^2/2 |q - k|^2 = bw^2 q.k - bw^2/2 |k|^2 - bw^2/2 |q|^2; the last term
    // is the same for every key of a row, and softmax does not see it.
    const double bw = a.score.bandwidth.value_or(1.0);
    const float factor = static_cast<float>(bw * bw);
    const float base_scale = a.score.scale ? static_cast<float>(*a.score.scale) : 1.0f;
    p.scale = factor * base_scale;
    FloatBuffer& kb = st.NewFloats(static_cast<size_t>(Bk * Hk * S));
#pragma omp parallel for collapse(3) schedule(static)
    for (int64_t b = 0; b < Bk; ++b)
      for (int64_t h = 0; h < Hk; ++h)
        for (int64_t j = 0; j < S; ++j) {
          const float* r = p.kf.RowF(b, h, j);
          kb[(b * Hk + h) * S + j] = -0.5f * p.scale * Dot(r, r, s.key_dim);
        }
    p.key_bias = kb.data();
  }
  if (p.kind == ScoreKind::kAdditive) {
    const std::vector<float> wq = LoadFloats(a.score.w_q), wk = LoadFloats(a.score.w_k);
    p.hidden = a.score.w_v.shape[0];
    p.add_w = st.Floats(a.score.w_v);
    auto project = [&](const Operand& src, int64_t batches, int64_t heads, int64_t rows,
                       const std::vector<float>& w, int64_t dim) {
      FloatBuffer& out = st.NewFloats(static_cast<size_t>(batches * heads * rows * p.hidden));
#pragma omp parallel for collapse(3) schedule(static)
      for (int64_t b = 0; b < batches; ++b)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t r = 0; r < rows; ++r) {
            const float* x = src.RowF(b, h, r);
            float* y = out.data() + ((b * heads + h) * rows + r) * p.hidden;
            for (int64_t u = 0; u < p.hidden; ++u) y[u] = Dot(w.data() + u * dim, x, dim);
          }
      return out.data();
    };
    p.add_q = project(p.qf, Bq, H, L, wq, s.query_dim);
    p.add_k = project(p.kf, Bk, Hk, S, wk, s.key_dim);
  }
  p.masks = PrepareMasks(a.mask, s, st);
  return p;
}

// Thrown out of a work item by a non-OK poll of the call's interrupt inside
// it; the item's Guarded returns the status.
struct Interrupted {
  absl::Status status;
};

// Scores of rows [i0, i0 + m) of head (b, h) against keys [j0, j0 + n), scaled
// and masked, into s (row stride ld).
void Scores(const Problem& p, MatmulCache& cache, ThreadContext& t, int64_t b, int64_t h,
            int64_t i0, int64_t m, int64_t j0, int64_t n, float* s, int64_t ld) {
  const int64_t hk = p.KeyHead(h), bk = p.KeyBatch(b);
  const int64_t S = p.s.key_len;
  // Plain dot-product kinds take their scale inside the matmul.
  const bool scale_in_matmul = p.kind == ScoreKind::kScaledDot || p.kind == ScoreKind::kDot ||
                               p.kind == ScoreKind::kBilinear;
  if (p.gemm_scores) {
    MatmulKey key{m, n, p.q.cols, p.q.ld(), p.k.ld(), ld, true, p.bf16, false};
    key.scaled = scale_in_matmul;
    t.RunMatmul(cache, key, p.q.Row(b, h, i0), p.k.Row(b, hk, j0), s, p.scale);
  }
  for (int64_t r = 0; r < m; ++r) {
    float* row = s + r * ld;
    const int64_t i = i0 + r;
    switch (p.kind) {
      case ScoreKind::kCosine:
        CosineScale(
            row, n, p.scale,
            p.row_norm[((p.query_batches == 1 ? 0 : b) * p.s.heads + h) * p.s.query_len + i],
            p.col_norm + (bk * p.s.kv_heads + hk) * S + j0);
        break;
      case ScoreKind::kGaussian:
        ScaleAddBias(row, n, p.scale, p.key_bias + (bk * p.s.kv_heads + hk) * S + j0);
        break;
      case ScoreKind::kNegEuclidean: {
        const float* q = p.qf.RowF(b, h, i);
        for (int64_t j = 0; j < n; ++j) {
          row[j] =
              -p.scale * std::sqrt(SquaredDistance(q, p.kf.RowF(b, hk, j0 + j), p.s.query_dim));
        }
        break;
      }
      case ScoreKind::kAdditive: {
        // n x hidden units per row: a block of 64 query rows over a wide
        // hidden layer and thousands of keys takes seconds, so the call is
        // stopped part way through it.
        if (p.interrupt != nullptr) {
          if (absl::Status status = (*p.interrupt)(); !status.ok()) {
            throw Interrupted{std::move(status)};
          }
        }
        const int64_t bq = p.qf.ix.batch_stride == 0 ? 0 : b;
        const float* aq = p.add_q + ((bq * p.s.heads + h) * p.s.query_len + i) * p.hidden;
        for (int64_t j = 0; j < n; ++j) {
          const float* ak = p.add_k + ((bk * p.s.kv_heads + hk) * S + j0 + j) * p.hidden;
          row[j] = p.scale * TanhDot(p.add_w, aq, ak, p.hidden);
        }
        break;
      }
      default:
        break;  // scaled by the matmul
    }
    p.masks.Apply(row, b, h, i, j0, n);
  }
}

void Dropout(const AttentionArgs& a, float* row, int64_t n, uint64_t first_index) {
  const double keep_scale = a.dropout_p < 1 ? 1.0 / (1.0 - a.dropout_p) : 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const bool keep = a.dropout_p < 1 && DropoutUniform(a.seed, first_index + j) >= a.dropout_p;
    row[j] = keep ? static_cast<float>(row[j] * keep_scale) : 0.0f;
  }
}

// Output row pointer for (b, h, i).
float* OutRow(const Problem& p, AttentionResult& r, int64_t b, int64_t h, int64_t i) {
  return r.output.data.data() + p.out_ix.Offset(b, h, i);
}

// need_weights = false: one (b, h, query block) with online softmax.
void FusedBlock(const Problem& p, MatmulCache& cache, ThreadContext& t, AttentionResult& result,
                int64_t b, int64_t h, int64_t i0, int64_t m) {
  const AttentionArgs& a = *p.args;
  const int64_t S = p.s.key_len, Dv = p.s.value_dim, hk = p.KeyHead(h);
  t.scores.resize(static_cast<size_t>(kQueryBlock * kKeyBlock));
  if (p.bf16) t.probs.resize(t.scores.size());
  t.acc.assign(static_cast<size_t>(m * Dv), 0.0f);
  t.row_max.assign(static_cast<size_t>(m), kNegInf);
  t.row_sum.assign(static_cast<size_t>(m), 0.0f);

  int64_t reach = 0;  // keys past this are masked for every row of the block
  for (int64_t r = 0; r < m; ++r) reach = std::max(reach, p.masks.RowLimit(b, i0 + r));
  const std::pair<int64_t, int64_t> ranges[] = {{0, reach}, {p.masks.masked_keys, S}};
  for (const auto& [begin, end] : ranges) {
    for (int64_t j0 = begin; j0 < end; j0 += kKeyBlock) {
      const int64_t n = std::min(kKeyBlock, end - j0);
      Scores(p, cache, t, b, h, i0, m, j0, n, t.scores.data(), kKeyBlock);
      for (int64_t r = 0; r < m; ++r) {
        float* row = t.scores.data() + r * kKeyBlock;
        const float block_max = RowMax(row, n);
        // NaN sticks: once a row has seen one, it is NaN (docs/errors.md, "Non-finite numbers").
        const float new_max = std::isnan(block_max) || std::isnan(t.row_max[r])
                                  ? std::numeric_limits<float>::quiet_NaN()
                                  : std::max(t.row_max[r], block_max);
        if (new_max == kNegInf || std::isnan(new_max)) {
          std::fill(row, row + n, 0.0f);
          if (std::isnan(new_max)) t.row_max[r] = t.row_sum[r] = new_max;
        } else {
          const float alpha = t.row_max[r] == kNegInf ? 0.0f : std::exp(t.row_max[r] - new_max);
          t.row_max[r] = new_max;
          if (alpha != 1.0f) Scale(t.acc.data() + r * Dv, Dv, alpha);
          if (p.bf16 && a.dropout_p == 0) {
            // Only here: t.probs is empty (data() null) for float32 math, and
            // even unused, null + offset is undefined behaviour.
            uint16_t* probs = t.probs.data() + r * kKeyBlock;
            t.row_sum[r] = t.row_sum[r] * alpha + ExpShiftSumToBFloat16(row, probs, n, new_max);
            continue;
          }
          t.row_sum[r] = t.row_sum[r] * alpha + ExpShiftSum(row, n, new_max);
          if (a.dropout_p > 0) {
            Dropout(a, row, n,
                    static_cast<uint64_t>(((b * p.s.heads + h) * p.s.query_len + i0 + r) * S + j0));
          }
        }
        if (p.bf16) ToBFloat16(row, t.probs.data() + r * kKeyBlock, n);
      }
      const MatmulKey key{m, Dv, n, kKeyBlock, p.v.ld(), Dv, false, p.bf16, true};
      const void* probs = p.bf16 ? static_cast<const void*>(t.probs.data()) : t.scores.data();
      t.RunMatmul(cache, key, probs, p.v.Row(b, hk, j0), t.acc.data());
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    float* out = OutRow(p, result, b, h, i0 + r);
    const float* acc = t.acc.data() + r * Dv;
    // 0 for a row with no unmasked key; NaN stays NaN.
    const float inv = t.row_sum[r] == 0.0f ? 0.0f : 1.0f / t.row_sum[r];
    for (int64_t d = 0; d < Dv; ++d) out[d] = acc[d] * inv;
  }
}

// need_weights = true: rows [i0, i0 + m) of (b, h) against every key, exact
// softmax into `weights` (row stride S), then the output rows.
void WeightsBlock(const Problem& p, MatmulCache& cache, ThreadContext& t, AttentionResult& result,
                  int64_t b, int64_t h, int64_t i0, int64_t m, float* weights) {
  const AttentionArgs& a = *p.args;
  const int64_t S = p.s.key_len, Dv = p.s.value_dim, hk = p.KeyHead(h);
  // Keys masked for every row of the block (causal, valid_lens) get no
  // matmul; rounded up to whole key blocks so few shape classes arise.
  int64_t reach = 0;
  for (int64_t r = 0; r < m; ++r) reach = std::max(reach, p.masks.RowLimit(b, i0 + r));
  const int64_t computed =
      p.masks.masked_keys < S ? S : std::min(S, (reach + kKeyBlock - 1) / kKeyBlock * kKeyBlock);
  for (int64_t j0 = 0; j0 < computed; j0 += kKeyBlock) {
    Scores(p, cache, t, b, h, i0, m, j0, std::min(kKeyBlock, computed - j0), weights + j0, S);
  }
  if (computed < S) {
    for (int64_t r = 0; r < m; ++r)
      std::fill(weights + r * S + computed, weights + (r + 1) * S, 0.0f);
  }
  if (computed == 0) {  // every key masked for every row: zero output, no matmul
    for (int64_t r = 0; r < m; ++r) std::fill_n(OutRow(p, result, b, h, i0 + r), Dv, 0.0f);
    return;
  }
  for (int64_t r = 0; r < m; ++r) {
    float* row = weights + r * S;
    const float max = RowMax(row, computed);
    if (max == kNegInf) {
      std::fill(row, row + computed, 0.0f);
      continue;
    }
    Scale(row, computed, 1.0f / ExpShiftSum(row, computed, max));
    if (a.dropout_p > 0) {
      Dropout(a, row, S, static_cast<uint64_t>(((b * p.s.heads + h) * p.s.query_len + i0 + r) * S));
    }
  }
  const void* probs = weights;
  if (p.bf16) {
    t.probs.resize(static_cast<size_t>(m * computed));
    for (int64_t r = 0; r < m; ++r) {
      ToBFloat16(weights + r * S, t.probs.data() + r * computed, computed);
    }
    probs = t.probs.data();
  }
  const MatmulKey key{m,     Dv,     computed, p.bf16 ? computed : S, p.v.ld(), p.out_ix.pos_stride,
                      false, p.bf16, false};
  t.RunMatmul(cache, key, probs, p.v.Row(b, hk, 0), OutRow(p, result, b, h, i0));
}

std::string IsaName(dnnl::cpu_isa isa) {
  switch (isa) {
    case dnnl::cpu_isa::avx512_core_amx:
      return "avx512_core_amx";
    case dnnl::cpu_isa::avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core:
      return "avx512_core";
    case dnnl::cpu_isa::avx2_vnni:
      return "avx2_vnni";
    case dnnl::cpu_isa::avx2:
      return "avx2";
    case dnnl::cpu_isa::avx:
      return "avx";
    case dnnl::cpu_isa::sse41:
      return "sse41";
    default:
      return absl::StrCat("isa_", static_cast<int>(isa));
  }
}

class OneDnnBackend final : public ComputeBackend {
 public:
  // Every team must get the threads it asks for: oneDNN splits a primitive's
  // work for omp_get_max_threads() threads, and in a team that got fewer
  // (not nested, so it parallelises itself) the missing threads' share is
  // silently never computed. So never more than OMP_THREAD_LIMIT, and no
  // dynamic teams (see UseThreadsFor).
  explicit OneDnnBackend(int threads)
      : threads_(std::max(1, std::min(threads, omp_get_thread_limit()))),
        engine_(dnnl::engine::kind::cpu, 0),
        cache_(engine_),
        contexts_(engine_) {
    const dnnl::cpu_isa isa = dnnl::get_effective_cpu_isa();
    isa_ = IsaName(isa);
    cpu_bf16_ = isa == dnnl::cpu_isa::avx512_core_bf16 || isa == dnnl::cpu_isa::avx512_core_amx;
  }

  // Both passes return at once when given nothing: the engine makes them in
  // every batch, a session's decode step too, and an empty one still took a
  // team and set OpenMP's thread count (2-8 us of a cold grouped-query step,
  // 2026-11-29).
  std::vector<absl::StatusOr<AttentionResult>> RunBatch(
      absl::Span<const BackendCall> calls) override {
    if (calls.empty()) return {};
    double flops = 0;
    for (const BackendCall& call : calls) flops += RawCallCost(*call.args, call.shape, 1).flops;
    const int threads = UseThreadsFor(flops);
    const size_t n = calls.size();
    std::vector<absl::StatusOr<AttentionResult>> results(n);
    std::deque<Storage> storages(n);
    std::vector<Problem> problems(n);
    std::vector<WorkSplit> layouts(n);
    struct Item {
      size_t call;
      int64_t index;
    };
    std::vector<Item> items;
    for (size_t c = 0; c < n; ++c) {
      try {
        results[c] = Setup(*calls[c].args, calls[c].shape, storages[c], problems[c], layouts[c]);
      } catch (const dnnl::error& e) {
        results[c] = absl::InternalError(absl::StrCat("oneDNN: ", e.what()));
      } catch (const std::bad_alloc&) {
        results[c] = absl::ResourceExhaustedError("engine: out of memory for this request");
      }
      if (!results[c].ok()) continue;
      problems[c].interrupt = calls[c].interrupt;
      for (int64_t i = 0; i < layouts[c].items; ++i) items.push_back({c, i});
    }
    const int64_t total = static_cast<int64_t>(items.size());
    // Set once a call has failed or been interrupted: its other items are
    // skipped. The first failure of each call replaces its result once the
    // pass is over, not during it: items already running write into it.
    std::unique_ptr<std::atomic<bool>[]> stopped(new std::atomic<bool>[n]);
    for (size_t c = 0; c < n; ++c) stopped[c] = false;
    std::vector<absl::Status> failed(n);
    contexts_.ForEachItem(threads, total, [&](ThreadContext& t, int64_t k) {
      const Item& item = items[k];
      if (stopped[item.call].load(std::memory_order_relaxed)) return;
      const std::function<absl::Status()>* interrupt = calls[item.call].interrupt;
      absl::Status status = interrupt ? (*interrupt)() : absl::OkStatus();
      if (status.ok()) {
        status = Guarded([&] {
          RunItem(problems[item.call], layouts[item.call], item.index, t, *results[item.call]);
        });
      }
      if (!status.ok()) {
        stopped[item.call] = true;
#pragma omp critical
        if (failed[item.call].ok()) failed[item.call] = status;
      }
    });
    for (size_t c = 0; c < n; ++c) {
      if (!failed[c].ok()) results[c] = failed[c];
    }
    return results;
  }

  absl::Status LinearBatch(absl::Span<const LinearJob> jobs) override {
    if (jobs.empty()) return absl::OkStatus();
    struct Item {
      const LinearJob* job;
      int64_t row0;
    };
    std::vector<Item> items;
    double flops = 0;
    for (const LinearJob& j : jobs) {
      for (int64_t r = 0; r < j.rows; r += kLinearRows) items.push_back({&j, r});
      flops += 2.0 * j.rows * j.in * static_cast<double>(j.out);
    }
    const int threads = UseThreadsFor(flops);
    const int64_t total = static_cast<int64_t>(items.size());
    absl::Status first_error;
    contexts_.ForEachItem(threads, total, [&](ThreadContext& t, int64_t k) {
      const LinearJob& j = *items[k].job;
      const int64_t r0 = items[k].row0, m = std::min(kLinearRows, j.rows - r0);
      absl::Status status = Guarded([&] {
        MatmulKey key{m, j.out, j.in, j.in, j.in, j.out, true, false, false};
        key.bias = j.bias != nullptr;
        t.RunMatmul(cache_, key, j.x + r0 * j.in, j.w, j.y + r0 * j.out, 1.0f, j.bias);
      });
      if (!status.ok()) {
#pragma omp critical
        if (first_error.ok()) first_error = status;
      }
    });
    return first_error;
  }

  std::string name() const override { return "onednn"; }
  std::string isa() const override { return isa_; }
  int threads() const override { return threads_; }

 private:
  // Rows per projection matmul: fixed, so a call's rows are split the same
  // way whether or not it is batched.
  static constexpr int64_t kLinearRows = 256;
  // Below this much work (a fraction of a millisecond on one core) a pass
  // runs on the compute thread alone. A pass ends when its slowest thread
  // does, and on a machine whose cores also run gRPC a team member can wait
  // milliseconds to be scheduled, far longer than such a pass takes alone.
  // Work items, and so results, are the same either way.
  static constexpr double kParallelFlops = 3e7;

  // OpenMP threads for a pass of `flops`, set on the calling thread: oneDNN
  // reads the same setting, so a small pass runs single-threaded all the way
  // down. OMP_DYNAMIC=true would let libgomp shrink teams under load, leaving
  // work undone (see the constructor): it is turned off for our passes.
  int UseThreadsFor(double flops) const {
    const int threads = flops >= kParallelFlops ? threads_ : 1;
    omp_set_dynamic(0);
    omp_set_num_threads(threads);
    return threads;
  }

  // How a call splits into work items.
  struct WorkSplit {
    int64_t blocks = 0;          // query blocks per (b, h)
    bool per_head_items = true;  // false: averaged weights, one item per (b, block)
    int64_t items = 0;
  };

  template <typename F>
  static absl::Status Guarded(F&& f) {
    try {
      f();
      return absl::OkStatus();
    } catch (const dnnl::error& e) {
      return absl::InternalError(absl::StrCat("oneDNN: ", e.what()));
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError("engine: out of memory for this request");
    } catch (Interrupted& e) {
      return std::move(e.status);
    }
  }

  // Prepares one call and allocates its outputs (left uninitialised: its work
  // items write every element).
  absl::StatusOr<AttentionResult> Setup(const AttentionArgs& a, const AttentionShape& s,
                                        Storage& storage, Problem& p, WorkSplit& layout) {
    p = Prepare(a, s, cpu_bf16_, storage);
    const int64_t B = s.batch, H = s.heads, L = s.query_len, S = s.key_len, Dv = s.value_dim;
    AttentionResult result;
    result.output.shape = OutputShape(a, s);
    TensorView out_view;
    out_view.shape = result.output.shape;
    p.out_ix = MakeHeadIndexer(out_view, a.layout, s.rank4, H, Dv);
    result.output.data.resize(static_cast<size_t>(B * H * L * Dv));
    if (a.need_weights) {
      result.weights.shape = WeightsShape(a, s);
      result.weights.data.resize(static_cast<size_t>(B * (a.average_weights ? 1 : H) * L * S));
    }
    layout.blocks = (L + kQueryBlock - 1) / kQueryBlock;
    layout.per_head_items = !(a.need_weights && a.average_weights);
    layout.items = B * layout.blocks * (layout.per_head_items ? H : 1);
    return result;
  }

  void RunItem(const Problem& p, const WorkSplit& layout, int64_t item, ThreadContext& t,
               AttentionResult& result) {
    const AttentionArgs& a = *p.args;
    const int64_t H = p.s.heads, L = p.s.query_len, S = p.s.key_len;
    const int64_t qb = item % layout.blocks;
    const int64_t rest = item / layout.blocks;
    const int64_t i0 = qb * kQueryBlock, m = std::min(kQueryBlock, L - i0);
    if (!a.need_weights) {
      FusedBlock(p, cache_, t, result, rest / H, rest % H, i0, m);
    } else if (layout.per_head_items) {
      const int64_t b = rest / H, h = rest % H;
      float* w = result.weights.data.data() + ((b * H + h) * L + i0) * S;
      WeightsBlock(p, cache_, t, result, b, h, i0, m, w);
    } else {
      const int64_t b = rest;
      std::vector<float>& head_weights = t.head_weights;
      head_weights.resize(static_cast<size_t>(m * S));
      float* avg = result.weights.data.data() + (b * L + i0) * S;
      std::fill(avg, avg + m * S, 0.0f);
      for (int64_t h = 0; h < H; ++h) {
        WeightsBlock(p, cache_, t, result, b, h, i0, m, head_weights.data());
        for (int64_t e = 0; e < m * S; ++e) avg[e] += head_weights[e] / H;
      }
    }
  }

  int threads_;
  dnnl::engine engine_;
  MatmulCache cache_;
  ThreadContextPool contexts_;
  std::string isa_;
  bool cpu_bf16_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeOneDnnBackend(int threads) {
  try {
    return std::make_unique<OneDnnBackend>(threads);
  } catch (const dnnl::error& e) {
    return absl::InternalError(absl::StrCat("oneDNN cannot start: ", e.what()));
  }
}

}  // namespace attention::internal
