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
// into the row's running softmax [m, l, acc...] at row_partial: rescales acc
// to the new max and turns s[0, n) into the weights of the block's value
// rows, exp(s - max) below `visible` and 0 from there on, which the caller
// then adds to acc.
void Prepare(float* s, int64_t visible, int64_t n, int64_t value_dim, float* row_partial) {
  float& m = row_partial[0];
  float& l = row_partial[1];
  const float block_max = visible > 0 ? RowMax(s, visible) : -std::numeric_limits<float>::infinity();
  const float m_new = std::isnan(block_max) || block_max > m ? block_max : m;
  if (visible <= 0 || m_new == -std::numeric_limits<float>::infinity()) {  // nothing seen yet
    std::fill(s, s + n, 0.0f);
    return;
  }
  const float correction = m == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m - m_new);
  const float sum = ExpShiftSum(s, visible, m_new);
  std::fill(s + visible, s + n, 0.0f);
  if (correction != 1.0f) Scale(row_partial + 2, value_dim, correction);
  l = l * correction + sum;
  m = m_new;
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
// acc[r] += sum_{j < n} p[r * kBlockRows + j] v_j for `rows` rows, over
// value rows v (row-major, dim d): each value row read once for all of them;
// next_v as next_k.
using AccumulateFn = void (*)(const float* p, int rows, float* const* acc, const void* v,
                              int64_t n, int64_t d, const char* next_v);

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
void GenericAccumulate(const float* p, int rows, float* const* acc, const void* v, int64_t n,
                       int64_t d, const char*) {
  for (int r = 0; r < rows; ++r) {
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

// d = 16 * kChunks, kRows rows: the sums stay in registers across the block.
template <bool kBf16, int kChunks, int kRows>
ATTN_AVX512 void Avx512AccumulateOf(const float* p, float* const* acc, const void* v, int64_t n,
                                    const char* next_v) {
  constexpr int64_t kElement = kBf16 ? 2 : 4;
  constexpr int64_t kRowBytes = kChunks * 16 * kElement;
  const char* base = static_cast<const char*>(v);
  __m512 a[kRows][kChunks];
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kChunks; ++c) a[r][c] = _mm512_loadu_ps(acc[r] + 16 * c);
  }
  for (int64_t j = 0; j < n; ++j) {
    const char* row = base + j * kRowBytes;
    __m512 vj[kChunks];
    for (int c = 0; c < kChunks; ++c) vj[c] = Load16<kBf16>(row + c * 16 * kElement);
    for (int r = 0; r < kRows; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r * kBlockRows + j]);
      for (int c = 0; c < kChunks; ++c) a[r][c] = _mm512_fmadd_ps(pj, vj[c], a[r][c]);
    }
    if (next_v != nullptr) {
      for (int64_t off = 0; off < kRowBytes; off += 64) {
        _mm_prefetch(next_v + j * kRowBytes + off, _MM_HINT_T0);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(acc[r] + 16 * c, a[r][c]);
  }
}

// As many rows at once as the registers hold beside one value row.
template <bool kBf16, int kChunks>
ATTN_AVX512 void Avx512Accumulate(const float* p, int rows, float* const* acc, const void* v,
                                  int64_t n, int64_t, const char* next_v) {
  constexpr int kMost = kChunks <= 4 ? 4 : kChunks <= 8 ? 2 : 1;
  for (int r = 0; r < rows; r += kMost) {
    const char* prefetch = r == 0 ? next_v : nullptr;
    const float* pr = p + r * kBlockRows;
    switch (std::min(kMost, rows - r)) {
      case 4: Avx512AccumulateOf<kBf16, kChunks, (kMost >= 4 ? 4 : 1)>(pr, acc + r, v, n, prefetch); break;
      case 3: Avx512AccumulateOf<kBf16, kChunks, (kMost >= 3 ? 3 : 1)>(pr, acc + r, v, n, prefetch); break;
      case 2: Avx512AccumulateOf<kBf16, kChunks, (kMost >= 2 ? 2 : 1)>(pr, acc + r, v, n, prefetch); break;
      default: Avx512AccumulateOf<kBf16, kChunks, 1>(pr, acc + r, v, n, prefetch); break;
    }
  }
}

#endif  // ATTN_DECODE_AVX512

// The kernels for `dtype` rows of key_dim / value_dim elements: AVX-512 on
// CPUs that have it (values: for the common head dims), portable loops
// otherwise.
struct BlockKernels {
  ScoresFn scores;
  AccumulateFn accumulate;
};

BlockKernels KernelsFor(int64_t value_dim, bool bf16) {
  BlockKernels k{bf16 ? &GenericScores<true> : &GenericScores<false>,
                 bf16 ? &GenericAccumulate<true> : &GenericAccumulate<false>};
#ifdef ATTN_DECODE_AVX512
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (!avx512) return k;
  k.scores = bf16 ? &Avx512Scores<true> : &Avx512Scores<false>;
  switch (value_dim) {
#define ATTN_CASE(chunks)                                                               \
  case 16 * (chunks):                                                                   \
    k.accumulate = bf16 ? &Avx512Accumulate<true, chunks> : &Avx512Accumulate<false, chunks>; \
    break;
    ATTN_CASE(2)
    ATTN_CASE(4)
    ATTN_CASE(5)
    ATTN_CASE(6)
    ATTN_CASE(8)
    ATTN_CASE(16)
#undef ATTN_CASE
    default:
      break;
  }
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
      Prepare(scores + r * kBlockRows, visible, n, dv, u.partial + r * (dv + 2));
    }
    kernels.accumulate(scores, static_cast<int>(rows), acc, vb, n, dv, next_v);
  }
  if (!u.with_tail) return;
  for (int64_t r = 0; r < rows; ++r) {
    for (int t = 0; t < it.tail; ++t) {
      float dot = 0.0f;
      for (int64_t e = 0; e < dk; ++e) dot += q[r][e] * it.tail_k[t][e];
      scores[t] = dot * it.scale;
    }
    Prepare(scores, it.tail, it.tail, dv, u.partial + r * (dv + 2));
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
