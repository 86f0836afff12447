#include "engine/decode.h"

#include <omp.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ATTN_DECODE_AVX512 1
#define ATTN_AVX512 __attribute__((target("avx512f")))
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "engine/kernels.h"

namespace attention::internal {
namespace {

constexpr int64_t kBlockRows = KvCache::kBlockRows;
// A thread's share of one item is at least this many cache blocks (256
// rows): less would spend more on merging partial results than it saves.
constexpr int64_t kMinChunkBlocks = 4;
// Below this many cached bytes read in all, a pass runs on one thread:
// waking a team costs more than streaming them.
constexpr double kParallelBytes = 256 * 1024;

// One thread's share: blocks [first_block, end_block) of an item's cache,
// plus its tail keys when `with_tail`. Its partial results, one per query
// row r: running max m, sum of exponentials l and the weighted sum of
// values acc, at partial + r * (value_dim + 2): [m, l, acc...].
struct Unit {
  const DecodeItem* item = nullptr;
  int64_t first_block = 0, end_block = 0;
  bool with_tail = false;
  float* partial = nullptr;
};

// Folds a block's scores s[0, visible) of one query row (already scaled)
// into the row's running softmax [m, l, ...] at row_partial and turns s[0, n)
// into the weights of the block's value rows: exp(s - max) below `visible`,
// 0 from there on. Returns the factor the row's weighted sum of values must
// be multiplied by first (the old max's exponentials rescaled to the new).
float Prepare(float* s, int64_t visible, int64_t n, float* row_partial) {
  float& m = row_partial[0];
  float& l = row_partial[1];
  const float block_max = visible > 0 ? RowMax(s, visible) : -std::numeric_limits<float>::infinity();
  const float m_new = std::isnan(block_max) || block_max > m ? block_max : m;
  if (visible <= 0 || m_new == -std::numeric_limits<float>::infinity()) {  // nothing seen yet
    std::fill(s, s + n, 0.0f);
    return 1.0f;
  }
  const float correction = m == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m - m_new);
  const float sum = ExpShiftSum(s, visible, m_new);
  std::fill(s + visible, s + n, 0.0f);
  l = l * correction + sum;
  m = m_new;
  return correction;
}

// Up to kScoreRows query rows' scores against one block's keys at a time:
// each key element loaded once for all of them.
constexpr int kScoreRows = 4;

// s[r * kBlockRows + j] = scale * q_r . k_j for the `rows` rows q[r] and
// the block's keys kt (transposed, engine/kv_cache.h); n of them are rows
// of the sequence. next_k (may be null): the next block's keys, `next_bytes`
// of them, prefetched meanwhile so that the thread keeps memory busy.
using ScoresFn = void (*)(const float* const* q, int rows, const void* kt, int64_t n, int64_t d,
                          float scale, float* s, const char* next_k);
// Prepare for the kBlockRows scores of one row at s (n of them keys).
using PrepareFn = float (*)(float* s, int64_t visible, int64_t n, float* row_partial);
// acc[r] = acc[r] * correction[r] + sum_{j < n} p[r * kBlockRows + j] v_j
// for `rows` rows, over value rows v (row-major, dim d): each value row read
// once for all of them; next_v as next_k.
using AccumulateFn = void (*)(const float* p, int rows, float* const* acc,
                              const float* correction, const void* v, int64_t n, int64_t d,
                              const char* next_v);

template <bool kBf16>
void GenericScores(const float* const* q, int rows, const void* kt, int64_t n, int64_t d,
                   float scale, float* s, const char*) {
  for (int r = 0; r < rows; ++r) {
    if (kBf16) {
      DotTransposedBFloat16(q[r], static_cast<const uint16_t*>(kt), kBlockRows, n, d, scale,
                            s + r * kBlockRows);
    } else {
      DotTransposed(q[r], static_cast<const float*>(kt), kBlockRows, n, d, scale,
                    s + r * kBlockRows);
    }
  }
}

template <bool kBf16>
void GenericAccumulate(const float* p, int rows, float* const* acc, const float* correction,
                       const void* v, int64_t n, int64_t d, const char*) {
  for (int r = 0; r < rows; ++r) {
    if (correction[r] != 1.0f) Scale(acc[r], d, correction[r]);
    if (kBf16) {
      AccumulateRowsBFloat16(p + r * kBlockRows, static_cast<const uint16_t*>(v), n, d, acc[r]);
    } else {
      AccumulateRows(p + r * kBlockRows, static_cast<const float*>(v), n, d, acc[r]);
    }
  }
}

#ifdef ATTN_DECODE_AVX512

// 16 elements at `p` (float32 or bfloat16) as float32.
template <bool kBf16>
ATTN_AVX512 inline __m512 Load16(const void* p) {
  if constexpr (kBf16) {
    const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(p));
    // The maskz forms: GCC 12 warns on the plain ones' undefined operand.
    return _mm512_castsi512_ps(
        _mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_cvtepu16_epi32(0xFFFF, h), 16));
  } else {
    return _mm512_loadu_ps(static_cast<const float*>(p));
  }
}

template <int kRows, bool kBf16>
ATTN_AVX512 void Avx512ScoresOf(const float* const* q, const void* kt, int64_t d, float scale,
                                float* s, const char* next_k) {
  constexpr int64_t kElement = kBf16 ? 2 : 4;
  constexpr int64_t kRowBytes = kBlockRows * kElement;  // one key element, every key
  const char* base = static_cast<const char*>(kt);
  __m512 acc[kRows][4];
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  for (int64_t e = 0; e < d; ++e) {
    const char* row = base + e * kRowBytes;
    const __m512 k0 = Load16<kBf16>(row), k1 = Load16<kBf16>(row + 16 * kElement),
                 k2 = Load16<kBf16>(row + 32 * kElement), k3 = Load16<kBf16>(row + 48 * kElement);
    for (int r = 0; r < kRows; ++r) {
      const __m512 qe = _mm512_set1_ps(q[r][e]);
      acc[r][0] = _mm512_fmadd_ps(k0, qe, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(k1, qe, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(k2, qe, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(k3, qe, acc[r][3]);
    }
    if (next_k != nullptr) {
      for (int64_t off = 0; off < kRowBytes; off += 64) {
        _mm_prefetch(next_k + e * kRowBytes + off, _MM_HINT_T0);
      }
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < 4; ++t) {
      _mm512_storeu_ps(s + r * kBlockRows + 16 * t, _mm512_mul_ps(acc[r][t], sv));
    }
  }
}

// Whole blocks are computed (the rows past n are zeros); n only bounds
// what the caller reads.
template <bool kBf16>
ATTN_AVX512 void Avx512Scores(const float* const* q, int rows, const void* kt, int64_t, int64_t d,
                              float scale, float* s, const char* next_k) {
  switch (rows) {
    case 1: return Avx512ScoresOf<1, kBf16>(q, kt, d, scale, s, next_k);
    case 2: return Avx512ScoresOf<2, kBf16>(q, kt, d, scale, s, next_k);
    case 3: return Avx512ScoresOf<3, kBf16>(q, kt, d, scale, s, next_k);
    default: return Avx512ScoresOf<4, kBf16>(q, kt, d, scale, s, next_k);
  }
}

// exp(x) for 16 lanes, as engine/kernels.cc's Exp (same reduction and
// polynomial, fused multiply-adds): 0 below -87.34, NaN stays NaN. Only
// called with x <= 0 or NaN (a score minus its row's max), so no overflow.
ATTN_AVX512 inline __m512 Exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.33654f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  // The second operand when NaN. (The maskz forms here: GCC 12 warns on the
  // plain ones' undefined operand.)
  const __m512 xc = _mm512_maskz_max_ps(0xFFFF, lo, x);
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 t = _mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), magic);
  const __m512 n = _mm512_sub_ps(t, magic);
  const __m512i ni = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_castps_si512(magic));
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y =
      _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512 scale =
      _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, _mm512_add_epi32(ni, _mm512_set1_epi32(127)), 23));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), _mm512_mul_ps(y, scale));
}

// The largest and the sum of x's lanes (NaN lanes: see the callers).
ATTN_AVX512 inline float MaxOf(__m512 x) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, x);
  float m = lanes[0];
  for (int i = 1; i < 16; ++i) m = lanes[i] > m ? lanes[i] : m;
  return m;
}
ATTN_AVX512 inline float SumOf(__m512 x) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, x);
  float sum = 0.0f;
  for (int i = 0; i < 16; ++i) sum += lanes[i];
  return sum;
}

// Prepare for a whole block (n <= kBlockRows = 64 scores, four registers),
// with no calls: the exponentials of a grouped-query step are a fifth of its
// arithmetic.
ATTN_AVX512 float Avx512Prepare(float* s, int64_t visible, int64_t, float* row_partial) {
  static_assert(kBlockRows == 64);
  float& m = row_partial[0];
  float& l = row_partial[1];
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 lanes[4];
  __m512 x[4];
  __m512 block_max = neg_inf;
  __mmask16 nan = 0;
  for (int t = 0; t < 4; ++t) {
    const int64_t count = std::clamp<int64_t>(visible - 16 * t, 0, 16);
    lanes[t] = static_cast<__mmask16>((uint32_t{1} << count) - 1);
    x[t] = _mm512_loadu_ps(s + 16 * t);
    nan |= _mm512_mask_cmp_ps_mask(lanes[t], x[t], x[t], _CMP_UNORD_Q);
    block_max = _mm512_mask_max_ps(block_max, lanes[t], block_max, x[t]);
  }
  const float seen = nan != 0 ? std::numeric_limits<float>::quiet_NaN()
                              : MaxOf(block_max);
  const float m_new = std::isnan(seen) || seen > m ? seen : m;
  if (m_new == -std::numeric_limits<float>::infinity()) {  // nothing seen yet
    for (int t = 0; t < 4; ++t) _mm512_storeu_ps(s + 16 * t, _mm512_setzero_ps());
    return 1.0f;
  }
  const float correction = m == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m - m_new);
  const __m512 shift = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int t = 0; t < 4; ++t) {
    const __m512 p = _mm512_maskz_mov_ps(lanes[t], Exp16(_mm512_sub_ps(x[t], shift)));
    sum = _mm512_add_ps(sum, p);
    _mm512_storeu_ps(s + 16 * t, p);
  }
  l = l * correction + SumOf(sum);
  m = m_new;
  return correction;
}

// Chunks [c0, c0 + kPass) (16 elements each) of kRows rows' sums, over value
// rows of row_elements: the sums stay in registers across the block, and
// each loaded value chunk serves every row.
template <bool kBf16, int kRows, int kPass>
ATTN_AVX512 void Avx512AccumulatePass(const float* p, float* const* acc, const float* correction,
                                      const void* v, int64_t n, int64_t row_elements, int64_t c0,
                                      const char* next_v) {
  constexpr int64_t kElement = kBf16 ? 2 : 4;
  const int64_t row_bytes = row_elements * kElement;
  const char* base = static_cast<const char*>(v) + c0 * 16 * kElement;
  __m512 a[kRows][kPass];
  for (int r = 0; r < kRows; ++r) {
    const __m512 c = _mm512_set1_ps(correction[r]);
    for (int k = 0; k < kPass; ++k) a[r][k] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + 16 * (c0 + k)), c);
  }
  for (int64_t j = 0; j < n; ++j) {
    const char* row = base + j * row_bytes;
    __m512 vj[kPass];
    for (int k = 0; k < kPass; ++k) vj[k] = Load16<kBf16>(row + k * 16 * kElement);
    for (int r = 0; r < kRows; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r * kBlockRows + j]);
      for (int k = 0; k < kPass; ++k) a[r][k] = _mm512_fmadd_ps(pj, vj[k], a[r][k]);
    }
    if (next_v != nullptr) {
      for (int64_t off = 0; off < row_bytes; off += 64) {
        _mm_prefetch(next_v + j * row_bytes + off, _MM_HINT_T0);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int k = 0; k < kPass; ++k) _mm512_storeu_ps(acc[r] + 16 * (c0 + k), a[r][k]);
  }
}

// kRows rows, every chunk of the value rows, in passes of as many chunks as
// the registers hold beside them (kRows x pass sums, pass value chunks).
template <bool kBf16, int kRows>
ATTN_AVX512 void Avx512AccumulateRows(const float* p, float* const* acc, const float* correction,
                                      const void* v, int64_t n, int64_t d, const char* next_v) {
  constexpr int kMostChunks = kRows == 1 ? 8 : kRows == 2 ? 8 : 4;
  const int64_t chunks = d / 16;
  for (int64_t c0 = 0; c0 < chunks; c0 += kMostChunks) {
    // The next block comes in during the first pass only.
    const char* prefetch = c0 == 0 ? next_v : nullptr;
    switch (std::min<int64_t>(kMostChunks, chunks - c0)) {
#define ATTN_PASS(k)                                                                          \
  case k:                                                                                     \
    if constexpr (k <= kMostChunks) {                                                         \
      Avx512AccumulatePass<kBf16, kRows, k>(p, acc, correction, v, n, d, c0, prefetch);       \
    }                                                                                         \
    break;
      ATTN_PASS(1)
      ATTN_PASS(2)
      ATTN_PASS(3)
      ATTN_PASS(4)
      ATTN_PASS(5)
      ATTN_PASS(6)
      ATTN_PASS(7)
      ATTN_PASS(8)
#undef ATTN_PASS
      default:
        break;
    }
  }
}

// Value dims that are a multiple of 16; up to four rows at a time.
template <bool kBf16>
ATTN_AVX512 void Avx512Accumulate(const float* p, int rows, float* const* acc,
                                  const float* correction, const void* v, int64_t n, int64_t d,
                                  const char* next_v) {
  for (int r = 0; r < rows; r += 4) {
    const char* prefetch = r == 0 ? next_v : nullptr;
    const float* pr = p + r * kBlockRows;
    switch (std::min(4, rows - r)) {
      case 4: Avx512AccumulateRows<kBf16, 4>(pr, acc + r, correction + r, v, n, d, prefetch); break;
      case 3: Avx512AccumulateRows<kBf16, 3>(pr, acc + r, correction + r, v, n, d, prefetch); break;
      case 2: Avx512AccumulateRows<kBf16, 2>(pr, acc + r, correction + r, v, n, d, prefetch); break;
      default: Avx512AccumulateRows<kBf16, 1>(pr, acc + r, correction + r, v, n, d, prefetch); break;
    }
  }
}

#endif  // ATTN_DECODE_AVX512

// The kernels for `dtype` rows of key_dim / value_dim elements: AVX-512 on
// CPUs that have it (values: for the common head dims), portable loops
// otherwise.
struct BlockKernels {
  ScoresFn scores;
  PrepareFn prepare;
  AccumulateFn accumulate;
};

BlockKernels KernelsFor(int64_t value_dim, bool bf16) {
  BlockKernels k{bf16 ? &GenericScores<true> : &GenericScores<false>, &Prepare,
                 bf16 ? &GenericAccumulate<true> : &GenericAccumulate<false>};
#ifdef ATTN_DECODE_AVX512
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (!avx512) return k;
  k.scores = bf16 ? &Avx512Scores<true> : &Avx512Scores<false>;
  k.prepare = &Avx512Prepare;
  if (value_dim % 16 == 0) k.accumulate = bf16 ? &Avx512Accumulate<true> : &Avx512Accumulate<false>;
#else
  (void)value_dim;
#endif
  return k;
}

void RunUnit(const Unit& u) {
  const DecodeItem& it = *u.item;
  const KvCache& cache = *it.cache;
  const int64_t dk = cache.key_dim(), dv = cache.value_dim();
  const int64_t rows = it.group * it.query_len;
  const bool bf16 = cache.dtype() == DType::kBFloat16;
  // Scores of every query row against one block.
  alignas(64) float scores[kMaxDecodeRows * kBlockRows];
  float correction[kMaxDecodeRows];
  for (int64_t r = 0; r < rows; ++r) {
    float* p = u.partial + r * (dv + 2);
    p[0] = -std::numeric_limits<float>::infinity();
    p[1] = 0.0f;
    std::memset(p + 2, 0, static_cast<size_t>(dv) * sizeof(float));
  }
  const BlockKernels kernels = KernelsFor(dv, bf16);
  const float* q[kMaxDecodeRows];
  float* acc[kMaxDecodeRows];
  for (int64_t r = 0; r < rows; ++r) {
    q[r] = it.q + (r / it.query_len) * it.q_head_stride + (r % it.query_len) * it.q_pos_stride;
    acc[r] = u.partial + r * (dv + 2) + 2;
  }
  // Keys: scores of up to kScoreRows query rows at a time, so a block's keys
  // come from memory once for the whole group; values likewise, from cache
  // after the first row.
  for (int64_t block = u.first_block; block < u.end_block; ++block) {
    const int64_t first = block * kBlockRows;
    const int64_t n = std::min(kBlockRows, it.keys - first);
    const void* kb = cache.KeyBlock(block, it.kv_head);
    const void* vb = cache.ValueBlock(block, it.kv_head);
    const bool more = block + 1 < u.end_block;
    const char* next_k =
        more ? static_cast<const char*>(cache.KeyBlock(block + 1, it.kv_head)) : nullptr;
    const char* next_v =
        more ? static_cast<const char*>(cache.ValueBlock(block + 1, it.kv_head)) : nullptr;
    for (int64_t r = 0; r < rows; r += kScoreRows) {
      const int count = static_cast<int>(std::min<int64_t>(kScoreRows, rows - r));
      kernels.scores(q + r, count, kb, n, dk, it.scale, scores + r * kBlockRows,
                     r == 0 ? next_k : nullptr);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r % it.query_len;
      int64_t visible = n;
      if (it.causal) visible = std::min(n, i + it.keys - it.query_len - first + 1);
      correction[r] = kernels.prepare(scores + r * kBlockRows, visible, n, u.partial + r * (dv + 2));
    }
    kernels.accumulate(scores, static_cast<int>(rows), acc, correction, vb, n, dv, next_v);
  }
  if (!u.with_tail) return;
  for (int64_t r = 0; r < rows; ++r) {
    for (int t = 0; t < it.tail; ++t) {
      float dot = 0.0f;
      for (int64_t e = 0; e < dk; ++e) dot += q[r][e] * it.tail_k[t][e];
      scores[t] = dot * it.scale;
    }
    const float c = Prepare(scores, it.tail, it.tail, u.partial + r * (dv + 2));
    if (c != 1.0f) Scale(acc[r], dv, c);
    for (int t = 0; t < it.tail; ++t) AccumulateRows(scores + t, it.tail_v[t], 1, dv, acc[r]);
  }
}

// out = sum_u acc_u e^(m_u - M) / sum_u l_u e^(m_u - M) over an item's units.
void Merge(const DecodeItem& it, const float* partials, int64_t units) {
  const int64_t dv = it.cache->value_dim();
  const int64_t rows = it.group * it.query_len;
  const int64_t stride = rows * (dv + 2);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t g = r / it.query_len, i = r % it.query_len;
    float* out = it.out + g * it.out_head_stride + i * it.out_pos_stride;
    float max = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int64_t u = 0; u < units; ++u) {
      const float* p = partials + u * stride + r * (dv + 2);
      if (p[1] > 0 || std::isnan(p[1])) {
        nan |= std::isnan(p[0]) || std::isnan(p[1]);
        max = std::max(max, p[0]);
      }
    }
    std::fill(out, out + dv, 0.0f);
    if (nan) {
      std::fill(out, out + dv, std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    if (max == -std::numeric_limits<float>::infinity()) continue;  // saw no key
    float total = 0.0f;
    for (int64_t u = 0; u < units; ++u) {
      const float* p = partials + u * stride + r * (dv + 2);
      if (!(p[1] > 0)) continue;
      const float w = std::exp(p[0] - max);
      total += p[1] * w;
      for (int64_t e = 0; e < dv; ++e) out[e] += p[2 + e] * w;
    }
    Scale(out, dv, 1.0f / total);
  }
}

}  // namespace

void RunDecode(absl::Span<const DecodeItem> items, int threads) {
  if (items.empty()) return;
  double bytes = 0;
  for (const DecodeItem& it : items) {
    bytes += static_cast<double>(it.keys) * static_cast<double>(it.cache->block_bytes()) /
             static_cast<double>(kBlockRows * it.cache->kv_heads());
  }
  if (bytes < kParallelBytes) threads = 1;
  // Enough units for every thread to stay busy to the end of the pass
  // (items differ in length), each at least kMinChunkBlocks blocks.
  const int64_t target_units = threads == 1 ? 1 : 4 * static_cast<int64_t>(threads);
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t chunks_wanted = (target_units + n - 1) / n;
  std::vector<Unit> units;
  std::vector<int64_t> first_unit(items.size() + 1);
  std::vector<int64_t> partial_offset;
  int64_t partial_floats = 0;
  for (int64_t k = 0; k < n; ++k) {
    const DecodeItem& it = items[k];
    first_unit[k] = static_cast<int64_t>(units.size());
    const int64_t blocks = (it.keys + kBlockRows - 1) / kBlockRows;
    const int64_t chunks = std::max<int64_t>(
        1, std::min(chunks_wanted, blocks / kMinChunkBlocks));
    const int64_t rows = it.group * it.query_len;
    for (int64_t c = 0; c < chunks; ++c) {
      Unit u;
      u.item = &it;
      u.first_block = blocks * c / chunks;
      u.end_block = blocks * (c + 1) / chunks;
      u.with_tail = c == chunks - 1 && it.tail > 0;
      units.push_back(u);
      partial_offset.push_back(partial_floats);
      partial_floats += rows * (it.cache->value_dim() + 2);
    }
  }
  first_unit[n] = static_cast<int64_t>(units.size());
  std::vector<float> partials(static_cast<size_t>(partial_floats));
  for (size_t u = 0; u < units.size(); ++u) units[u].partial = partials.data() + partial_offset[u];
  const int64_t total = static_cast<int64_t>(units.size());
  const int team = static_cast<int>(std::min<int64_t>(threads, total));
  if (team <= 1) {
    for (const Unit& u : units) RunUnit(u);
    for (int64_t k = 0; k < n; ++k) {
      Merge(items[k], units[first_unit[k]].partial, first_unit[k + 1] - first_unit[k]);
    }
    return;
  }
#pragma omp parallel num_threads(team)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < total; ++u) RunUnit(units[u]);
#pragma omp for schedule(static)
    for (int64_t k = 0; k < n; ++k) {
      Merge(items[k], units[first_unit[k]].partial, first_unit[k + 1] - first_unit[k]);
    }
  }
}

}  // namespace attention::internal
