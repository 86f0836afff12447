#include "engine/decode.h"

#include <omp.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#define ATTN_DECODE_AVX512 1
#define ATTN_AVX512 __attribute__((target("avx512f")))
#define ATTN_AVX512_BF16 __attribute__((target("avx512f,avx512bf16")))
// Before each loop over a kernel's query rows, key registers or value
// chunks (compile-time counts): unrolled whole, the sums they index stay in
// registers at every optimisation level. Left to -O2, GCC kept them on the
// stack, a load and a store around every multiply-add: a grouped-query step
// ran at 0.6x of the unrolled one.
#define ATTN_UNROLL _Pragma("GCC unroll 16")
// A loop left rolled (PrefetchSlice).
#define ATTN_ROLLED _Pragma("GCC unroll 1")
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "engine/decode_kernels.h"
#include "engine/kernels.h"

namespace attention::internal {
namespace {

using decode::AccumulateFn;
using decode::kBlockRows;
using decode::kScoreRows;
using decode::Math;
using decode::ScoresFn;
using decode::SoftmaxRows;
// A thread's share of one item is at least this many cache blocks (256
// rows): less would spend more on merging partial results than it saves.
constexpr int64_t kMinChunkBlocks = 4;
// Each item's softmax is summed over fixed ranges of this many blocks from
// the cache's start, one partial result each, merged in order: whatever
// thread or unit computes a range, and whatever else is in the pass, an
// item's answer is the same to the bit (batched or alone, on any number of
// threads). Units split sessions on these ranges' bounds.
constexpr int64_t kSumBlocks = kMinChunkBlocks;
// Below this many cached bytes read in all, a pass runs on one thread:
// waking a team costs more than streaming them.
constexpr double kParallelBytes = 256 * 1024;
// How far ahead of its reads a one-row step prefetches the part it reads,
// where its kernels do (BlockKernels::scores_ahead): a few hundred cycles
// of reading at the memory's pace. A plain read of a cache's blocks read as
// fast 1 KiB ahead and 5% slower 32 KiB ahead (docs/decode-log.md).
constexpr int64_t kPrefetchAhead = 4096;
// The same for steps of several query rows per key/value head: their
// kernels compute longer per byte, and the later rows' value passes read
// the part again from cache, prefetching nothing, so the reads need more
// in flight. 8 KiB ahead, grouped-query steps (four rows, D128) ran 8-15%
// (FLOAT32) and 2-10% (FAST) faster than with the next part into L2; 4 KiB
// ahead, FAST ran about 10% slower than 8, and 2 or 16 KiB ahead both ran
// slower (AMD EPYC with avx512_bf16, 2026-12-06, docs/decode-log.md).
constexpr int64_t kPrefetchAheadRows = 8192;
// How many parts (one head's keys and values in one block) ahead of the
// one being read a unit touches each page of, so that the page's address
// translation is there before the prefetches and reads reach it
// (TranslateAhead).
constexpr int64_t kTranslateAheadParts = 2;
// The smallest page: one translation per this many bytes.
constexpr int64_t kPageBytes = 4096;

// One thread's share: blocks [first_block, end_block) of the cache of items
// [first_item, end_item), key/value heads of one session, plus their tail
// keys when `with_tail`. A block holds every head's rows, each head's keys
// and values contiguous, so the unit reads its heads' parts of a block in
// memory order, head after head: one run of up to a block's bytes, where a
// head at a time would jump from block to block in runs of one head's part
// (cold, 64 KiB runs read at 0.6x the speed of 512 KiB ones on this
// machine's memory). Item k's partial results, one per kSumBlocks range of
// blocks c and query row r: running max m, sum of exponentials l and the
// weighted sum of values acc, at partials + partial_offset[k - first_item] +
// (c * rows + r) * (value_dim + 2): [m, l, acc...]. first_block is a
// multiple of kSumBlocks, and so is end_block unless it is the cache's end.
struct Unit {
  int64_t first_item = 0, end_item = 0;
  int64_t first_block = 0, end_block = 0;
  bool with_tail = false;
  // The session's index among the pass's sessions.
  int64_t session = 0;
  // In floats, from the start of the pass's partial results.
  std::vector<int64_t> partial_offset;
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

template <bool kBf16>
void GenericScores(const void* const* q, int rows, const void* kt, int64_t n, int64_t d,
                   float scale, float* s, const char*, const SoftmaxRows& softmax) {
  for (int r = 0; r < rows; ++r) {
    const float* qr = static_cast<const float*>(q[r]);
    float* const sr = s + r * kBlockRows;
    if (kBf16) {
      DotPairedBFloat16(qr, static_cast<const uint16_t*>(kt), kBlockRows, n, d, scale, sr);
    } else {
      DotTransposed(qr, static_cast<const float*>(kt), kBlockRows, n, d, scale, sr);
    }
    softmax.correction[r] = Prepare(sr, softmax.visible[r], n, softmax.partial[r]);
  }
}

template <bool kBf16>
void GenericAccumulate(const float* p, int rows, float* const* acc, const float* correction,
                       const void* v, int64_t n, int64_t d, const char*) {
  for (int r = 0; r < rows; ++r) {
    if (correction[r] != 1.0f) Scale(acc[r], d, correction[r]);
    if (kBf16) {
      AccumulatePairedRowsBFloat16(p + r * kBlockRows, static_cast<const uint16_t*>(v), n, d,
                                   acc[r]);
    } else {
      AccumulateRows(p + r * kBlockRows, static_cast<const float*>(v), n, d, acc[r]);
    }
  }
}

#ifdef ATTN_DECODE_AVX512

// A BFLOAT16 cache's 32-bit words of two bfloat16 each, 16 words: the first
// elements as float32 (a shift), and the second (a mask).
ATTN_AVX512 inline __m512 FirstOfPairs(__m512i x) {
  // The maskz forms: GCC 12 warns on the plain ones' undefined operand.
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, x, 16));
}
ATTN_AVX512 inline __m512 SecondOfPairs(__m512i x) {
  return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Start bringing the bytes at p (whole cache lines) in while the thread
// computes (without it, steps of several query rows per cached row read
// 15-30% less of the memory probe's bandwidth). What the kernels prefetch
// is the caller's choice (BlockKernels); where to, kTo:
// - kL2 (T1): the next part, a slice at a time. On an Intel host
//   non-temporal prefetches (NTA) were lost before their rows were read,
//   and every step read half as fast (0.43x of the probe where T1 read
//   1.3x of the same probe); T0 read FLOAT32 caches about 10% slower than
//   T1 there (docs/decode-log.md). On an AMD host all three read alike.
// - kL1 (T0): the part being read, kPrefetchAhead (one-row steps) or
//   kPrefetchAheadRows bytes ahead of the reads (those lines are read a
//   few hundred cycles later).
// Ahead of a block's last part the addresses are past the block's end,
// another allocation or none: a prefetch never faults (an unmapped line is
// dropped), and the next block's first lines come in as the CPU's own
// prefetchers bring them.
enum class Fetch { kNone, kL2, kL1 };
template <Fetch kTo>
constexpr auto kHintOf = kTo == Fetch::kL1 ? _MM_HINT_T0 : _MM_HINT_T1;

// kBytes known at compile time (a key kernel's row): unrolled.
template <int64_t kBytes, Fetch kTo = Fetch::kL2>
ATTN_AVX512 inline void Prefetch(const char* p) {
  ATTN_UNROLL
  for (int64_t off = 0; off < kBytes; off += 64) _mm_prefetch(p + off, kHintOf<kTo>);
}

// A count of bytes known only at run time (a value kernel's slice per row),
// in a loop left rolled: GCC's unrolled form of it was a chain of compares
// and branches per value row, which cost B16 H8 D64 steps about 5% and
// grouped-query steps 3-9% (2026-11-25).
template <Fetch kTo = Fetch::kL2>
ATTN_AVX512 inline void PrefetchSlice(const char* p, int64_t bytes) {
  ATTN_ROLLED
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, kHintOf<kTo>);
}

// The 16 floats at p, in a register of their own when kUses multiply-adds
// read them. Left alone, GCC folded the load into each multiply-add as a
// memory operand, loading the same 64 bytes once per query row: the value
// kernel of two rows issued 16 loads per value row where 8 do, the scores
// kernels of two and three rows 8 and 12 per key element where 4 do. Kept
// in a register, a grouped-query FLOAT32 step over a cache in L3 ran 9%
// faster; cold, within the noise (docs/decode-log.md).
template <int kUses>
ATTN_AVX512 inline __m512 LoadOnce(const float* p) {
  __m512 x = _mm512_loadu_ps(p);
  if constexpr (kUses > 1) __asm__("" : "+v"(x));
  return x;
}

// A scores kernel's kRows x 4 registers of sums, zeroed.
template <int kRows>
ATTN_AVX512 inline void ZeroScores(__m512 (&acc)[kRows][4]) {
  ATTN_UNROLL
  for (int r = 0; r < kRows; ++r) {
    ATTN_UNROLL
    for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_setzero_ps();
  }
}

// Defined with the softmax step, below.
template <int kRows>
ATTN_AVX512 inline void FinishScores(const __m512 (&acc)[kRows][4], float scale, float* s,
                                     const SoftmaxRows& softmax);

// Scores of kRows rows against the block's 64 keys, in four registers of 16
// keys each, then each row's softmax step (FinishScores). Whole blocks are
// computed (the rows past n are zeros); the step weighs only each row's
// visible keys.
template <int kRows, Fetch kPrefetch>
ATTN_AVX512 void Avx512ScoresFloat32(const void* const* q, const void* kt, int64_t d, float scale,
                                     float* s, const char* next_k, const SoftmaxRows& softmax) {
  constexpr int64_t kRowBytes = kBlockRows * 4;  // one key element, every key
  const char* base = static_cast<const char*>(kt);
  __m512 acc[kRows][4];
  ZeroScores<kRows>(acc);
  for (int64_t e = 0; e < d; ++e) {
    const float* row = reinterpret_cast<const float*>(base + e * kRowBytes);
    const __m512 k0 = LoadOnce<kRows>(row), k1 = LoadOnce<kRows>(row + 16),
                 k2 = LoadOnce<kRows>(row + 32), k3 = LoadOnce<kRows>(row + 48);
    ATTN_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const __m512 qe = _mm512_set1_ps(static_cast<const float*>(q[r])[e]);
      acc[r][0] = _mm512_fmadd_ps(k0, qe, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(k1, qe, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(k2, qe, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(k3, qe, acc[r][3]);
    }
    if constexpr (kPrefetch != Fetch::kNone) Prefetch<kRowBytes, kPrefetch>(next_k + e * kRowBytes);
  }
  FinishScores<kRows>(acc, scale, s, softmax);
}

// One pair of key elements (2i, 2i + 1) of the block's 64 keys, four
// registers of 16 pairs, each widened by a shift and a mask; kSecond false:
// the last pair of an odd d, which has one element.
template <int kRows, bool kSecond>
ATTN_AVX512 inline void ScorePair(const void* const* q, const char* row, int64_t i,
                                  __m512 (&acc)[kRows][4]) {
  ATTN_UNROLL
  for (int t = 0; t < 4; ++t) {
    const __m512i x = _mm512_loadu_si512(row + 64 * t);
    const __m512 first_k = FirstOfPairs(x);
    ATTN_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float* qr = static_cast<const float*>(q[r]);
      acc[r][t] = _mm512_fmadd_ps(first_k, _mm512_set1_ps(qr[2 * i]), acc[r][t]);
    }
    if constexpr (kSecond) {
      const __m512 second_k = SecondOfPairs(x);
      ATTN_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const float* qr = static_cast<const float*>(q[r]);
        acc[r][t] = _mm512_fmadd_ps(second_k, _mm512_set1_ps(qr[2 * i + 1]), acc[r][t]);
      }
    }
  }
}

// The same over a BFLOAT16 cache, float32 math: each pair of key elements
// (e, e + 1) of 16 keys is one register. The whole pairs are a loop of
// their own, the last pair of an odd d after it: with the test inside the
// loop, GCC moved the sums between registers in every pair. (This and the
// value kernel's loop below made grouped-query steps 2% faster,
// 2026-11-28.)
template <int kRows, Fetch kPrefetch>
ATTN_AVX512 void Avx512ScoresBFloat16(const void* const* q, const void* kt, int64_t d, float scale,
                                      float* s, const char* next_k, const SoftmaxRows& softmax) {
  constexpr int64_t kPairBytes = kBlockRows * 4;  // two key elements, every key
  const char* base = static_cast<const char*>(kt);
  __m512 acc[kRows][4];
  ZeroScores<kRows>(acc);
  const int64_t whole = d / 2;
  for (int64_t i = 0; i < whole; ++i) {
    ScorePair<kRows, true>(q, base + i * kPairBytes, i, acc);
    if constexpr (kPrefetch != Fetch::kNone)
      Prefetch<kPairBytes, kPrefetch>(next_k + i * kPairBytes);
  }
  if (d % 2 != 0) {
    ScorePair<kRows, false>(q, base + whole * kPairBytes, whole, acc);
    if constexpr (kPrefetch != Fetch::kNone)
      Prefetch<kPairBytes, kPrefetch>(next_k + whole * kPairBytes);
  }
  FinishScores<kRows>(acc, scale, s, softmax);
}

// The same with bf16 dot products: q[r] is bfloat16 pairs, one 32-bit word
// per pair of key elements, multiplied with the cache's pairs as they are.
template <int kRows, Fetch kPrefetch>
ATTN_AVX512_BF16 void Avx512ScoresBFloat16Dot(const void* const* q, const void* kt, int64_t d,
                                              float scale, float* s, const char* next_k,
                                              const SoftmaxRows& softmax) {
  constexpr int64_t kPairBytes = kBlockRows * 4;
  const char* base = static_cast<const char*>(kt);
  __m512 acc[kRows][4];
  ZeroScores<kRows>(acc);
  const int64_t pairs = (d + 1) / 2;
  for (int64_t i = 0; i < pairs; ++i) {
    const char* row = base + i * kPairBytes;
    const __m512i k0 = _mm512_loadu_si512(row), k1 = _mm512_loadu_si512(row + 64),
                  k2 = _mm512_loadu_si512(row + 128), k3 = _mm512_loadu_si512(row + 192);
    ATTN_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const __m512bh qi = reinterpret_cast<__m512bh>(
          _mm512_set1_epi32(static_cast<const int32_t*>(q[r])[i]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], reinterpret_cast<__m512bh>(k0), qi);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], reinterpret_cast<__m512bh>(k1), qi);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], reinterpret_cast<__m512bh>(k2), qi);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], reinterpret_cast<__m512bh>(k3), qi);
    }
    if constexpr (kPrefetch != Fetch::kNone)
      Prefetch<kPairBytes, kPrefetch>(next_k + i * kPairBytes);
  }
  FinishScores<kRows>(acc, scale, s, softmax);
}

template <Math kMath, int kRows, Fetch kPrefetch>
void Avx512ScoresWith(const void* const* q, const void* kt, int64_t d, float scale, float* s,
                      const char* next_k, const SoftmaxRows& softmax) {
  if constexpr (kMath == Math::kFloat32) {
    Avx512ScoresFloat32<kRows, kPrefetch>(q, kt, d, scale, s, next_k, softmax);
  } else if constexpr (kMath == Math::kBFloat16) {
    Avx512ScoresBFloat16<kRows, kPrefetch>(q, kt, d, scale, s, next_k, softmax);
  } else {
    Avx512ScoresBFloat16Dot<kRows, kPrefetch>(q, kt, d, scale, s, next_k, softmax);
  }
}

// Prefetching or not is decided once per block, not tested per key element
// in the loop (whose time then varied by a third with the code's layout).
template <Math kMath, int kRows, Fetch kTo>
void Avx512ScoresOf(const void* const* q, const void* kt, int64_t d, float scale, float* s,
                    const char* next_k, const SoftmaxRows& softmax) {
  if (next_k != nullptr) {
    Avx512ScoresWith<kMath, kRows, kTo>(q, kt, d, scale, s, next_k, softmax);
  } else {
    Avx512ScoresWith<kMath, kRows, Fetch::kNone>(q, kt, d, scale, s, next_k, softmax);
  }
}

// next_k (may be null) prefetched into kTo.
template <Math kMath, Fetch kTo>
void Avx512Scores(const void* const* q, int rows, const void* kt, int64_t, int64_t d, float scale,
                  float* s, const char* next_k, const SoftmaxRows& softmax) {
  switch (rows) {
    case 1:
      return Avx512ScoresOf<kMath, 1, kTo>(q, kt, d, scale, s, next_k, softmax);
    case 2:
      return Avx512ScoresOf<kMath, 2, kTo>(q, kt, d, scale, s, next_k, softmax);
    case 3:
      return Avx512ScoresOf<kMath, 3, kTo>(q, kt, d, scale, s, next_k, softmax);
    default:
      return Avx512ScoresOf<kMath, 4, kTo>(q, kt, d, scale, s, next_k, softmax);
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

// exp(x) for 16 lanes, for precision FAST, whose weights are then rounded
// to bfloat16 (8 significant bits): 2^n * 2^f with t = x log2(e), n = t
// rounded and f = t - n in [-1/2, 1/2] (one fused multiply-subtract from x,
// so t's rounding does not enter f); 2^f by a degree-4 polynomial with
// 2^0 = 1 exactly (relative error 2.9e-6, fitted in float32 on that
// interval), times 2^n by vscalefps. With log2(e)'s own rounding, relative
// error under 5e-6 for x >= -87.34. 10 vector operations to Exp16's 20,
// with the same edges: 0 where t < -126 (x < -87.34), so never a subnormal;
// NaN stays NaN.
ATTN_AVX512 inline __m512 Exp16Fast(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 t = _mm512_mul_ps(x, log2e);
  const __mmask16 underflow = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_LT_OQ);
  const __m512 n =
      _mm512_maskz_roundscale_ps(0xFFFF, t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_fmsub_ps(x, log2e, n);
  __m512 p = _mm512_set1_ps(9.582851082e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.590642616e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402409911e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931241751e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~underflow), p, n);
}

ATTN_AVX512 void ExpForTesting(bool fast, const float* x, float* y) {
  const __m512 v = _mm512_load_ps(x);
  _mm512_store_ps(y, fast ? Exp16Fast(v) : Exp16(v));
}

// MergeRow (below) with AVX-512: the ranges' weights 16 at a time (one
// Exp16), the sums in registers 128 elements at a time. The portable loop
// (SSE2 at -O3) stores the sums back after each range and calls exp for
// each: with it, a grouped-query pass's merges took each thread 22-27 us,
// with this 16-19 (docs/decode-log.md).
ATTN_AVX512 float Avx512MergeRow(const float* first, int64_t stride, int64_t units, int64_t dv,
                                 float max, float* out) {
  constexpr int kRegs = 8;
  float total = 0.0f;
  for (int64_t u0 = 0; u0 < units; u0 += 16) {
    const int count = static_cast<int>(std::min<int64_t>(16, units - u0));
    alignas(64) float m[16], w[16];
    uint32_t seen = 0;
    for (int i = 0; i < 16; ++i) {
      m[i] = -std::numeric_limits<float>::infinity();
      if (i >= count) continue;
      const float* p = first + (u0 + i) * stride;
      if (p[1] > 0) {
        m[i] = p[0];
        seen |= uint32_t{1} << i;
      }
    }
    _mm512_store_ps(w, Exp16(_mm512_sub_ps(_mm512_load_ps(m), _mm512_set1_ps(max))));
    for (uint32_t left = seen; left != 0; left &= left - 1) {
      const int i = __builtin_ctz(left);
      total += first[(u0 + i) * stride + 1] * w[i];
    }
    for (int64_t c = 0; c < dv; c += 16 * kRegs) {
      __mmask16 lanes[kRegs];
      __m512 a[kRegs];
      ATTN_UNROLL
      for (int k = 0; k < kRegs; ++k) {
        const int64_t n = std::clamp<int64_t>(dv - c - 16 * k, 0, 16);
        lanes[k] = static_cast<__mmask16>((uint32_t{1} << n) - 1);
        a[k] = _mm512_maskz_loadu_ps(lanes[k], out + c + 16 * k);
      }
      for (uint32_t left = seen; left != 0; left &= left - 1) {
        const int i = __builtin_ctz(left);
        const float* acc = first + (u0 + i) * stride + 2 + c;
        const __m512 wi = _mm512_set1_ps(w[i]);
        ATTN_UNROLL
        for (int k = 0; k < kRegs; ++k) {
          a[k] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes[k], acc + 16 * k), wi, a[k]);
        }
      }
      ATTN_UNROLL
      for (int k = 0; k < kRegs; ++k) _mm512_mask_storeu_ps(out + c + 16 * k, lanes[k], a[k]);
    }
  }
  return total;
}

// The largest and the sum of x's lanes (NaN lanes: see the callers), in a
// tree of shuffles: a lane-by-lane loop through memory, a chain of 16
// dependent steps per row and block, made a grouped-query step whose cache
// is in L2 4-5% slower. Written out rather than _mm512_reduce_max_ps /
// _mm512_reduce_add_ps, whose undefined operands GCC 12 warns about at -O3.
ATTN_AVX512 inline __m128 FourOf(__m512 x, bool max) {
  const __m256 lo = _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xF, _mm512_castps_pd(x), 0));
  const __m256 hi = _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xF, _mm512_castps_pd(x), 1));
  const __m256 eight = max ? _mm256_max_ps(lo, hi) : _mm256_add_ps(lo, hi);
  const __m128 a = _mm256_castps256_ps128(eight), b = _mm256_extractf128_ps(eight, 1);
  return max ? _mm_max_ps(a, b) : _mm_add_ps(a, b);
}
ATTN_AVX512 inline float MaxOf(__m512 x) { return decode::MaxOf4(FourOf(x, true)); }
ATTN_AVX512 inline float SumOf(__m512 x) { return decode::SumOf4(FourOf(x, false)); }

// Prepare for a whole block's scores x (n <= kBlockRows = 64, four
// registers), with no calls: the exponentials of a grouped-query step are a
// fifth of its arithmetic. The weights are left in p. kFastExp: Exp16Fast,
// for precision FAST.
template <bool kFastExp>
ATTN_AVX512 inline float SoftmaxStep(const __m512 (&x)[4], int64_t visible, float* row_partial,
                                     __m512 (&p)[4]) {
  static_assert(kBlockRows == 64);
  float& m = row_partial[0];
  float& l = row_partial[1];
  __mmask16 lanes[4];
  // Once a row's max has settled, most blocks have no score above it (nor
  // NaN): then the block's max is not needed, nor an exp for the correction.
  const __m512 old_max = _mm512_set1_ps(m);
  __mmask16 above = 0;
  ATTN_UNROLL
  for (int t = 0; t < 4; ++t) {
    const int64_t count = std::clamp<int64_t>(visible - 16 * t, 0, 16);
    lanes[t] = static_cast<__mmask16>((uint32_t{1} << count) - 1);
    above |= _mm512_mask_cmp_ps_mask(lanes[t], x[t], old_max, _CMP_NLE_UQ);
  }
  float m_new = m;
  if (above != 0) {
    __m512 block_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __mmask16 nan = 0;
    ATTN_UNROLL
    for (int t = 0; t < 4; ++t) {
      nan |= _mm512_mask_cmp_ps_mask(lanes[t], x[t], x[t], _CMP_UNORD_Q);
      block_max = _mm512_mask_max_ps(block_max, lanes[t], block_max, x[t]);
    }
    const float seen = nan != 0 ? std::numeric_limits<float>::quiet_NaN() : MaxOf(block_max);
    if (std::isnan(seen) || seen > m) m_new = seen;
  }
  if (m_new == -std::numeric_limits<float>::infinity()) {  // nothing seen yet
    ATTN_UNROLL
    for (int t = 0; t < 4; ++t) p[t] = _mm512_setzero_ps();
    return 1.0f;
  }
  const float correction = m == -std::numeric_limits<float>::infinity() ? 0.0f
                           : m == m_new                                ? 1.0f
                                                                       : std::exp(m - m_new);
  const __m512 shift = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  ATTN_UNROLL
  for (int t = 0; t < 4; ++t) {
    const __m512 shifted = _mm512_sub_ps(x[t], shift);
    p[t] = _mm512_maskz_mov_ps(lanes[t], kFastExp ? Exp16Fast(shifted) : Exp16(shifted));
    sum = _mm512_add_ps(sum, p[t]);
  }
  l = l * correction + SumOf(sum);
  m = m_new;
  return correction;
}

// A scores kernel's end: row r's scores are acc[r][t] lane i (key 16 t + i)
// times scale, each row's softmax step taken on them, the weights stored at
// s + r * kBlockRows.
template <int kRows>
ATTN_AVX512 inline void FinishScores(const __m512 (&acc)[kRows][4], float scale, float* s,
                                     const SoftmaxRows& softmax) {
  const __m512 sv = _mm512_set1_ps(scale);
  ATTN_UNROLL
  for (int r = 0; r < kRows; ++r) {
    __m512 x[4], p[4];
    ATTN_UNROLL
    for (int t = 0; t < 4; ++t) x[t] = _mm512_mul_ps(acc[r][t], sv);
    softmax.correction[r] =
        softmax.fast ? SoftmaxStep<true>(x, softmax.visible[r], softmax.partial[r], p)
                     : SoftmaxStep<false>(x, softmax.visible[r], softmax.partial[r], p);
    ATTN_UNROLL
    for (int t = 0; t < 4; ++t) _mm512_storeu_ps(s + r * kBlockRows + 16 * t, p[t]);
  }
}

// The FAST softmax step of the block's scores at s, with the weights
// rounded to bfloat16 into w (64 of them): the tile multiplies' operand, so
// that they need no pass of their own to convert.
ATTN_AVX512_BF16 float PrepareToBFloat16(const float* s, int64_t visible, float* row_partial,
                                         uint16_t* w) {
  __m512 x[4], p[4];
  ATTN_UNROLL
  for (int t = 0; t < 4; ++t) x[t] = _mm512_loadu_ps(s + 16 * t);
  const float correction = SoftmaxStep<true>(x, visible, row_partial, p);
  _mm512_storeu_si512(w, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p[1], p[0])));
  _mm512_storeu_si512(w + 32, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p[3], p[2])));
  return correction;
}

// a[r][k] = chunk c0 + k of row r's sums times correction[r]: an
// accumulate kernel's registers.
template <int kRows, int kPass>
ATTN_AVX512 inline void LoadSums(float* const* acc, const float* correction, int64_t c0,
                                 __m512 (&a)[kRows][kPass]) {
  ATTN_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const __m512 c = _mm512_set1_ps(correction[r]);
    ATTN_UNROLL
    for (int k = 0; k < kPass; ++k) a[r][k] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + 16 * (c0 + k)), c);
  }
}

// Their registers back into the sums.
template <int kRows, int kPass>
ATTN_AVX512 inline void StoreSums(const __m512 (&a)[kRows][kPass], float* const* acc, int64_t c0) {
  ATTN_UNROLL
  for (int r = 0; r < kRows; ++r) {
    ATTN_UNROLL
    for (int k = 0; k < kPass; ++k) _mm512_storeu_ps(acc[r] + 16 * (c0 + k), a[r][k]);
  }
}

// Chunks [c0, c0 + kPass) (16 elements each) of kRows rows' sums, over the
// value rows (d elements): the sums stay in registers across the block, and
// each loaded value chunk serves every row. FLOAT32 cache: row j's chunk is
// 64 bytes at (j * d + 16 c) * 4; BFLOAT16: rows 2i and 2i + 1 share their
// chunks, 64 bytes at (2 i * d + 32 c) * 2, the first row's elements widened
// by a shift, the second's by a mask.
template <int kRows, int kPass, Fetch kPrefetch>
ATTN_AVX512 void Avx512AccumulateFloat32(const float* p, float* const* acc, const float* correction,
                                         const void* v, int64_t n, int64_t d, int64_t c0,
                                         const char* next_v, int64_t step) {
  const int64_t row_bytes = d * 4;
  const char* base = static_cast<const char*>(v) + c0 * 64;
  __m512 a[kRows][kPass];
  LoadSums<kRows, kPass>(acc, correction, c0, a);
  for (int64_t j = 0; j < n; ++j) {
    const char* row = base + j * row_bytes;
    __m512 vj[kPass];
    ATTN_UNROLL
    for (int k = 0; k < kPass; ++k) {
      vj[k] = LoadOnce<kRows>(reinterpret_cast<const float*>(row + 64 * k));
    }
    ATTN_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r * kBlockRows + j]);
      ATTN_UNROLL
      for (int k = 0; k < kPass; ++k) a[r][k] = _mm512_fmadd_ps(pj, vj[k], a[r][k]);
    }
    if constexpr (kPrefetch != Fetch::kNone) PrefetchSlice<kPrefetch>(next_v + j * step, step);
  }
  StoreSums<kRows, kPass>(a, acc, c0);
}

// A BFLOAT16 pair of value rows' chunks [c0, c0 + kPass), at `pair`, into
// the sums a, with the weights p[r * kBlockRows] and p[r * kBlockRows + 1];
// kSecond false: the first row only (the last of an odd count).
template <int kRows, int kPass, bool kSecond>
ATTN_AVX512 inline void ValuePair(const float* p, const char* pair, __m512 (&a)[kRows][kPass]) {
  ATTN_UNROLL
  for (int k = 0; k < kPass; ++k) {
    const __m512i x = _mm512_loadu_si512(pair + 64 * k);
    const __m512 first_v = FirstOfPairs(x);
    ATTN_UNROLL
    for (int r = 0; r < kRows; ++r) {
      a[r][k] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * kBlockRows]), first_v, a[r][k]);
      if constexpr (kSecond) {
        a[r][k] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * kBlockRows + 1]), SecondOfPairs(x), a[r][k]);
      }
    }
  }
}

template <int kRows, int kPass, Fetch kPrefetch>
ATTN_AVX512 void Avx512AccumulateBFloat16(const float* p, float* const* acc,
                                          const float* correction, const void* v, int64_t n,
                                          int64_t d, int64_t c0, const char* next_v, int64_t step) {
  const int64_t pair_bytes = d * 4;  // two rows
  const char* base = static_cast<const char*>(v) + c0 * 64;
  __m512 a[kRows][kPass];
  LoadSums<kRows, kPass>(acc, correction, c0, a);
  // Whole pairs, then the last row of an odd n: with the test for it
  // inside the loop, GCC computed every pair's addresses anew, short of
  // registers for them.
  const char* pair = base;
  const char* prefetch = next_v;
  int64_t j = 0;
  for (; j + 1 < n; j += 2, pair += pair_bytes) {
    ValuePair<kRows, kPass, true>(p + j, pair, a);
    if constexpr (kPrefetch != Fetch::kNone) {
      PrefetchSlice<kPrefetch>(prefetch, step);
      prefetch += step;
    }
  }
  if (j < n) {
    ValuePair<kRows, kPass, false>(p + j, pair, a);
    if constexpr (kPrefetch != Fetch::kNone) PrefetchSlice<kPrefetch>(prefetch, step);
  }
  StoreSums<kRows, kPass>(a, acc, c0);
}

// The BFLOAT16 form with bf16 dot products: each row's weights rounded to
// bfloat16 pairs (p_2i, p_2i+1), one 32-bit word against the pair of value
// rows. The pair past an odd n is a zero weight and a zero row.
template <int kRows, int kPass, Fetch kPrefetch>
ATTN_AVX512_BF16 void Avx512AccumulateBFloat16Dot(const float* p, float* const* acc,
                                                  const float* correction, const void* v, int64_t n,
                                                  int64_t d, int64_t c0, const char* next_v,
                                                  int64_t step) {
  const int64_t pair_bytes = d * 4;
  const char* base = static_cast<const char*>(v) + c0 * 64;
  alignas(64) int32_t weights[kRows][kBlockRows / 2];
  __m512 a[kRows][kPass];
  ATTN_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const float* pr = p + r * kBlockRows;
    ATTN_UNROLL
    for (int t = 0; t < kBlockRows / 32; ++t) {
      const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(pr + 32 * t + 16), _mm512_loadu_ps(pr + 32 * t));
      _mm512_store_si512(weights[r] + 16 * t, reinterpret_cast<__m512i>(w));
    }
  }
  LoadSums<kRows, kPass>(acc, correction, c0, a);
  for (int64_t i = 0; 2 * i < n; ++i) {
    const char* pair = base + i * pair_bytes;
    __m512i vi[kPass];
    ATTN_UNROLL
    for (int k = 0; k < kPass; ++k) vi[k] = _mm512_loadu_si512(pair + 64 * k);
    ATTN_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const __m512bh w = reinterpret_cast<__m512bh>(_mm512_set1_epi32(weights[r][i]));
      ATTN_UNROLL
      for (int k = 0; k < kPass; ++k) {
        a[r][k] = _mm512_dpbf16_ps(a[r][k], reinterpret_cast<__m512bh>(vi[k]), w);
      }
    }
    if constexpr (kPrefetch != Fetch::kNone) PrefetchSlice<kPrefetch>(next_v + i * step, step);
  }
  StoreSums<kRows, kPass>(a, acc, c0);
}

template <Math kMath, int kRows, int kPass, Fetch kPrefetch>
void Avx512AccumulateWith(const float* p, float* const* acc, const float* correction, const void* v,
                          int64_t n, int64_t d, int64_t c0, const char* next_v, int64_t step) {
  if constexpr (kMath == Math::kFloat32) {
    Avx512AccumulateFloat32<kRows, kPass, kPrefetch>(p, acc, correction, v, n, d, c0, next_v, step);
  } else if constexpr (kMath == Math::kBFloat16) {
    Avx512AccumulateBFloat16<kRows, kPass, kPrefetch>(p, acc, correction, v, n, d, c0, next_v,
                                                      step);
  } else {
    Avx512AccumulateBFloat16Dot<kRows, kPass, kPrefetch>(p, acc, correction, v, n, d, c0, next_v,
                                                         step);
  }
}

// next_v (may be null): `step` bytes of it come in per value row (a pair of
// rows for BFLOAT16), from next_v + step * row.
template <Math kMath, int kRows, int kPass, Fetch kTo>
void Avx512AccumulatePass(const float* p, float* const* acc, const float* correction, const void* v,
                          int64_t n, int64_t d, int64_t c0, const char* next_v, int64_t step) {
  if (next_v != nullptr) {
    Avx512AccumulateWith<kMath, kRows, kPass, kTo>(p, acc, correction, v, n, d, c0, next_v, step);
  } else {
    Avx512AccumulateWith<kMath, kRows, kPass, Fetch::kNone>(p, acc, correction, v, n, d, c0, next_v,
                                                            step);
  }
}

// The most value chunks one pass of kRows rows takes: as many as the
// registers hold beside them (kRows x pass sums, a chunk's values and the
// rows' weights). The same for every math: a BFLOAT16 chunk widened into
// two registers is used at once, so it needs three, not two per chunk of
// the pass (pairs of rows took 4 chunks until 2026-11-27: grouped-query
// steps over BFLOAT16 with float32 math were 5-7% slower).
template <Math kMath, int kRows>
constexpr int kMostChunksOf = kRows <= 2 ? 8 : 4;

// kRows rows, every chunk of the value rows, in passes of kMostChunksOf.
template <Math kMath, int kRows, Fetch kTo>
void Avx512AccumulateRows(const float* p, float* const* acc, const float* correction, const void* v,
                          int64_t n, int64_t d, const char* next_v, int64_t step) {
  constexpr int kMostChunks = kMostChunksOf<kMath, kRows>;
  const int64_t chunks = d / 16;
  for (int64_t c0 = 0; c0 < chunks; c0 += kMostChunks) {
    // This group's slice of the next part comes in during the last pass
    // only: brought in earlier, it would push out of L1 the rows the later
    // passes read again.
    const char* prefetch = c0 + kMostChunks >= chunks ? next_v : nullptr;
    switch (std::min<int64_t>(kMostChunks, chunks - c0)) {
#define ATTN_PASS(k)                                                                               \
  case k:                                                                                          \
    if constexpr (k <= kMostChunks) {                                                              \
      Avx512AccumulatePass<kMath, kRows, k, kTo>(p, acc, correction, v, n, d, c0, prefetch, step); \
    }                                                                                              \
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

// Value dims that are a multiple of 16. Rows go four at a time where one
// pass over the value rows holds their sums (up to 4 chunks: d <= 64), and
// two at a time where it does not and two rows' passes hold more chunks
// (d up to 128): four rows' sums of d = 128 would take two
// passes, each reading the first or second half of every value row, and a
// cold cache read in such strided halves streamed 7-14% slower
// (grouped-query FLOAT32 steps, 2026-11-25; BFLOAT16, float32 math: 6%,
// 2026-11-27). Two rows' sums take the whole
// rows in one pass, so the first pair reads the part from memory in order
// and the second pair reads it again from L1 or L2. (Out of the CPU's
// caches that wins; a cache already in L2 or L3 steps about 10% slower.)
// next_v (may be null) comes in, into kTo. The next part (kL2): a slice
// per group spread over its rows. The part being read, ahead of the reads
// (kL1, next_v a fixed distance past v): the first group a whole value row
// per row read, so that it stays that far ahead, and the later groups,
// which read the rows again from cache, nothing.
template <Math kMath, Fetch kTo>
void Avx512Accumulate(const float* p, int rows, float* const* acc, const float* correction,
                      const void* v, int64_t n, int64_t d, const char* next_v) {
  constexpr bool kPairsHoldMore = kMostChunksOf<kMath, 2> > kMostChunksOf<kMath, 4>;
  const int group = kPairsHoldMore && d / 16 > kMostChunksOf<kMath, 4> ? 2 : 4;
  const int64_t groups = (rows + group - 1) / group;
  // Bytes of a FLOAT32 value row, or of a BFLOAT16 pair of rows.
  const int64_t row_bytes = d * 4;
  constexpr bool kAhead = kTo == Fetch::kL1;
  const int64_t step =
      kAhead ? row_bytes : std::max<int64_t>(64, (row_bytes / groups + 63) / 64 * 64);
  const int64_t iterations = kMath == Math::kFloat32 ? n : (n + 1) / 2;
  for (int r = 0; r < rows; r += group) {
    const char* prefetch =
        next_v == nullptr || (kAhead && r > 0) ? nullptr : next_v + (r / group) * iterations * step;
    const float* pr = p + r * kBlockRows;
    float* const* ar = acc + r;
    const float* cr = correction + r;
    switch (std::min(group, rows - r)) {
      case 4:
        Avx512AccumulateRows<kMath, 4, kTo>(pr, ar, cr, v, n, d, prefetch, step);
        break;
      case 3:
        Avx512AccumulateRows<kMath, 3, kTo>(pr, ar, cr, v, n, d, prefetch, step);
        break;
      case 2:
        Avx512AccumulateRows<kMath, 2, kTo>(pr, ar, cr, v, n, d, prefetch, step);
        break;
      default:
        Avx512AccumulateRows<kMath, 1, kTo>(pr, ar, cr, v, n, d, prefetch, step);
        break;
    }
  }
}

// Tile matrix multiplies (AMX), for precision FAST over a BFLOAT16 cache on
// CPUs that have them: TDPBF16PS multiplies a tile of up to 16 query rows
// by 16 pairs of bfloat16 rows of 16 keys (or value elements), float32
// sums, the same products and rounding of the query and the weights as the
// bf16 dot products above, summed in another order. The cache's pairs are
// already the tiles' layout: a block's keys (e, e + 1) of 16 keys are 64
// bytes of a 256-byte row per pair of elements, and its values (2i, 2i + 1)
// of 16 elements are 64 bytes of a value_dim * 4-byte row per pair of rows.
// On the Intel host where vdpbf16ps kept a grouped-query step (four query
// rows per key/value head) near its arithmetic limit, the tiles made it
// 8-16% faster (docs/decode-log.md).
#define ATTN_TILES __attribute__((target("avx512f,avx512bf16,amx-tile,amx-bf16")))

// The tile instructions, by tile number (a literal). Written here rather
// than taken from GCC 12's intrinsics, whose asm statements do not tell the
// compiler what memory tile loads read and tile stores write: it could then
// drop the stores of the weights a tile load reads, or read a tile store's
// destination before the store (and a tile configuration's bytes past its
// first 8, below, which made the tiles unconfigured: SIGILL).
#define ATTN_TILE_LOAD(t, base, stride)                                                 \
  __asm__ volatile("{tileloadd\t(%0,%1,1), %%tmm" #t "|tileloadd\t%%tmm" #t ", [%0+%1*1]}" \
                   :                                                                    \
                   : "r"(static_cast<const void*>(base)), "r"(static_cast<long>(stride))  \
                   : "memory")
#define ATTN_TILE_STORE(t, base, stride)                                                  \
  __asm__ volatile("{tilestored\t%%tmm" #t ", (%0,%1,1)|tilestored\t[%0+%1*1], %%tmm" #t "}" \
                   :                                                                      \
                   : "r"(static_cast<void*>(base)), "r"(static_cast<long>(stride))          \
                   : "memory")
#define ATTN_TILE_DOT(c, a, b)                                   \
  __asm__ volatile("{tdpbf16ps\t%%tmm" #b ", %%tmm" #a ", %%tmm" #c \
                   "|tdpbf16ps\t%%tmm" #c ", %%tmm" #a ", %%tmm" #b "}" ::)
#define ATTN_TILE_ZERO(t) __asm__ volatile("tilezero\t%%tmm" #t ::)

// Tiles: 0-3 sums (rows x 16 floats), 4 the query's or the weights' rows
// (rows x 32 bfloat16), 6 and 7 the cache's (16 pairs x 16 columns).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

ATTN_TILES void LoadTileConfig(int rows) {
  TileConfig c;
  for (int t : {0, 1, 2, 3, 4}) {
    c.rows[t] = static_cast<uint8_t>(rows);
    c.bytes_per_row[t] = 64;
  }
  for (int t : {6, 7}) {
    c.rows[t] = 16;
    c.bytes_per_row[t] = 64;
  }
  // The whole 64 bytes are the operand (GCC 12's _tile_loadconfig names
  // only their first 8, and its stores of the rest could be dropped).
  __asm__ volatile("ldtilecfg\t%0" : : "m"(c));
}

ATTN_TILES void ReleaseTiles() { __asm__ volatile("tilerelease" ::: "memory"); }

// Whether this process may use the tiles: the CPU has AMX-TILE and
// AMX-BF16, and Linux grants the process their state (arch_prctl; kernels
// before 5.16 do not).
bool TilesUsable() {
  static const bool usable = [] {
#if defined(__linux__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;
    if ((d & kAmxBf16) == 0 || (d & kAmxTile) == 0) return false;
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
#else
    return false;
#endif
  }();
  return usable;
}

// Shapes the tile kernels take: up to 16 query rows, key_dim a multiple of
// 32 (whole tiles of 16 pairs), value_dim of 16.
bool TilesFit(int64_t rows, int64_t key_dim, int64_t value_dim) {
  return rows <= 16 && key_dim % 32 == 0 && value_dim % 16 == 0;
}

// s[r * kBlockRows + j] = q_r . k_j for the block's 64 keys, the tiles
// configured for `rows` rows: q holds the rows' bfloat16 pairs (scaled),
// q_stride bytes apart. next_k (may be null): the next part's keys,
// brought into L2 meanwhile, a quarter slice after each tile load (one
// slice after the four: 2-4% slower, 2026-11-27).
ATTN_TILES void TileScores(const uint16_t* q, int64_t q_stride, const void* kt, int64_t d,
                           float* s, const char* next_k) {
  constexpr int64_t kPairBytes = kBlockRows * 4;
  constexpr int64_t kSliceBytes = 16 * kPairBytes;
  constexpr int64_t kQuarter = kSliceBytes / 4;
  const char* keys = static_cast<const char*>(kt);
  const char* query = reinterpret_cast<const char*>(q);
  ATTN_TILE_ZERO(0);
  ATTN_TILE_ZERO(1);
  ATTN_TILE_ZERO(2);
  ATTN_TILE_ZERO(3);
  for (int64_t step = 0; step < d / 32; ++step) {
    const char* pairs = keys + step * kSliceBytes;
    const char* next = next_k == nullptr ? nullptr : next_k + step * kSliceBytes;
    ATTN_TILE_LOAD(4, query + step * 64, q_stride);
    ATTN_TILE_LOAD(6, pairs, kPairBytes);
    if (next != nullptr) Prefetch<kQuarter>(next);
    ATTN_TILE_DOT(0, 4, 6);
    ATTN_TILE_LOAD(7, pairs + 64, kPairBytes);
    if (next != nullptr) Prefetch<kQuarter>(next + kQuarter);
    ATTN_TILE_DOT(1, 4, 7);
    ATTN_TILE_LOAD(6, pairs + 128, kPairBytes);
    if (next != nullptr) Prefetch<kQuarter>(next + 2 * kQuarter);
    ATTN_TILE_DOT(2, 4, 6);
    ATTN_TILE_LOAD(7, pairs + 192, kPairBytes);
    if (next != nullptr) Prefetch<kQuarter>(next + 3 * kQuarter);
    ATTN_TILE_DOT(3, 4, 7);
  }
  constexpr int64_t kScoreStride = kBlockRows * 4;
  ATTN_TILE_STORE(0, s, kScoreStride);
  ATTN_TILE_STORE(1, s + 16, kScoreStride);
  ATTN_TILE_STORE(2, s + 32, kScoreStride);
  ATTN_TILE_STORE(3, s + 48, kScoreStride);
}

// acc[r] = acc[r] * correction[r] + sum_j w[r * kBlockRows + j] v_j over
// the block's 64 value rows (the weights past the sequence are 0, its rows
// zeros), the tiles configured for `rows` rows: w holds the weights rounded
// to bfloat16 (PrepareToBFloat16), four chunks of 16 value elements at a
// time in the sum tiles, then added to the sums in registers. next_v as
// next_k, a slice per four chunks and half block.
ATTN_TILES void TileAccumulate(const uint16_t* weights, int rows, float* const* acc,
                               const float* correction, const void* v, int64_t d,
                               const char* next_v) {
  const int64_t pair_bytes = d * 4;
  const int64_t chunks = d / 16;
  const int64_t passes = (chunks + 3) / 4;
  // The next part's values: pair_bytes * 32 bytes, a slice per pass and half.
  const int64_t slice = (pair_bytes * 32 / (2 * passes) + 63) / 64 * 64;
  alignas(64) float sums[16 * kBlockRows];
  const char* values = static_cast<const char*>(v);
  for (int64_t pass = 0; pass < passes; ++pass) {
    const int c = static_cast<int>(std::min<int64_t>(4, chunks - 4 * pass));
    ATTN_TILE_ZERO(0);
    ATTN_TILE_ZERO(1);
    ATTN_TILE_ZERO(2);
    ATTN_TILE_ZERO(3);
    for (int half = 0; half < 2; ++half) {
      ATTN_TILE_LOAD(4, weights + 32 * half, kBlockRows * 2);
      const char* pairs = values + half * 16 * pair_bytes + pass * 4 * 64;
      ATTN_TILE_LOAD(6, pairs, pair_bytes);
      ATTN_TILE_DOT(0, 4, 6);
      if (c > 1) {
        ATTN_TILE_LOAD(7, pairs + 64, pair_bytes);
        ATTN_TILE_DOT(1, 4, 7);
      }
      if (c > 2) {
        ATTN_TILE_LOAD(6, pairs + 128, pair_bytes);
        ATTN_TILE_DOT(2, 4, 6);
      }
      if (c > 3) {
        ATTN_TILE_LOAD(7, pairs + 192, pair_bytes);
        ATTN_TILE_DOT(3, 4, 7);
      }
      if (next_v != nullptr) PrefetchSlice(next_v + (2 * pass + half) * slice, slice);
    }
    constexpr int64_t kSumStride = kBlockRows * 4;
    ATTN_TILE_STORE(0, sums, kSumStride);
    if (c > 1) ATTN_TILE_STORE(1, sums + 16, kSumStride);
    if (c > 2) ATTN_TILE_STORE(2, sums + 32, kSumStride);
    if (c > 3) ATTN_TILE_STORE(3, sums + 48, kSumStride);
    for (int r = 0; r < rows; ++r) {
      const __m512 cr = _mm512_set1_ps(correction[r]);
      float* ar = acc[r] + 64 * pass;
      for (int k = 0; k < c; ++k) {
        const __m512 x = _mm512_loadu_ps(sums + r * kBlockRows + 16 * k);
        _mm512_storeu_ps(ar + 16 * k, _mm512_fmadd_ps(_mm512_loadu_ps(ar + 16 * k), cr, x));
      }
    }
  }
}

#undef ATTN_TILE_LOAD
#undef ATTN_TILE_STORE
#undef ATTN_TILE_DOT
#undef ATTN_TILE_ZERO
#undef ATTN_TILES

#else  // ATTN_DECODE_AVX512

bool TilesUsable() { return false; }
bool TilesFit(int64_t, int64_t, int64_t) { return false; }
void LoadTileConfig(int) {}
void ReleaseTiles() {}
void TileScores(const uint16_t*, int64_t, const void*, int64_t, float*, const char*) {}
void TileAccumulate(const uint16_t*, int, float* const*, const float*, const void*, int64_t,
                    const char*) {}
float PrepareToBFloat16(const float*, int64_t, float*, uint16_t*) { return 1.0f; }

#endif  // ATTN_DECODE_AVX512

// The kernels for a cache of `value_dim` value elements: AVX-512 on CPUs
// that have it, else AVX2 (decode_avx2.cc; values of either: dims that are
// a multiple of 16), portable loops otherwise. `math` is what the step
// asked for; `scores_math` is set to what the scores kernel does (bf16 dot
// products need avx512_bf16).
struct BlockKernels {
  ScoresFn scores;
  AccumulateFn accumulate;
  Math scores_math;
  // Whether to prefetch the next part for items of one query row (into L2,
  // as for steps of several rows per cached row, grouped-query, which ran
  // twice as slow without, 2026-12-04). The AVX2 kernels' one-row steps ran
  // 20-35% faster without (B16 H8 D64, B9 and B1 H32 D128, FLOAT32 and
  // BFLOAT16, AMD EPYC with memory at 34-51 GB/s, 2026-12-04): there the
  // CPU's own prefetchers keep up with a plain stream, and the next part's
  // prefetches only compete with them.
  bool prefetch_one_row = true;
  // Where set, items take these instead, prefetching the part they read
  // kPrefetchAhead (one query row) or kPrefetchAheadRows bytes ahead of the
  // reads, into L1. FAST's one-row steps with the AVX-512 kernels ran about
  // 10% (B16 H8 D64) and 5% (B1 H32 D128) faster so than with the next
  // part, FLOAT32's within the noise, and slower with nothing or into L2
  // (AMD EPYC with avx512_bf16, 2026-12-05); grouped-query steps, see
  // kPrefetchAheadRows (docs/decode-log.md). Not on Intel's CPUs
  // (KernelsFor).
  ScoresFn scores_ahead = nullptr;
  AccumulateFn accumulate_ahead = nullptr;
};

std::atomic<DecodeKernels> kernels_use{DecodeKernels::kBest};
std::atomic<bool> tiles_allowed{true};
std::atomic<DotProducts> dot_products_use{DotProducts::kChosen};

// RecordDecodeTimes' switch, and what the passes recorded.
std::atomic<bool> record_times{false};
ABSL_CONST_INIT absl::Mutex times_mu(absl::kConstInit);
DecodeTimes recorded_times ABSL_GUARDED_BY(times_mu);

using Clock = std::chrono::steady_clock;

double MicrosecondsBetween(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::micro>(to - from).count();
}

// One thread's times through a pass, from the pass's start, while
// recording is on (a no-op otherwise): each Mark adds the time since the
// previous one to a field.
class PassMarks {
 public:
  PassMarks(bool on, Clock::time_point pass_start) : on_(on), last_(pass_start) {}
  void Mark(double DecodeTimes::*field) {
    if (!on_) return;
    const Clock::time_point now = Clock::now();
    times_.*field += MicrosecondsBetween(last_, now);
    last_ = now;
  }
  // Into what the passes recorded, as one thread's pass.
  void Record() {
    if (!on_) return;
    times_.thread_passes = 1;
    absl::MutexLock lock(&times_mu);
    recorded_times += times_;
  }

 private:
  const bool on_;
  Clock::time_point last_;
  DecodeTimes times_;
};

// Whether bf16 dot products beat float32 math for FAST's steps (without
// tiles) of `rows` query rows per key/value head on this CPU: not on
// Intel's. There one vdpbf16ps takes as long as four
// FMAs (one per 0.84 ns on a thread against an FMA per 0.21 ns, 2026-11-27),
// so its two multiply-adds per lane cost twice the FMAs' widened float32
// ones, and a grouped-query FAST step ran 6% faster in float32
// (docs/decode-log.md). The AMD hosts measured ran them faster
// than float32 math for one and two query rows per key/value head
// (2026-11-28, 2026-12-04), and, since grouped-query steps prefetch the
// part they read (kPrefetchAheadRows), for four too by a few percent: in
// eight full runs of decode_bench the other math's row read dot products
// 3-10% faster in five and float32 math 1-2% faster in three (2026-12-06;
// before it, dot products were 2.5% slower on average).
bool DotProductsFaster(int64_t rows) {
  static_cast<void>(rows);
#ifdef ATTN_DECODE_AVX512
  static const bool faster = __builtin_cpu_supports("avx512bf16") && !__builtin_cpu_is("intel");
  return faster;
#else
  return false;
#endif
}

// DotProductsFaster, unless a test or a benchmark says otherwise.
bool UseDotProducts(int64_t rows) {
  switch (dot_products_use.load(std::memory_order_relaxed)) {
    case DotProducts::kAlways:
      return true;
    case DotProducts::kNever:
      return false;
    case DotProducts::kChosen:
      break;
  }
  return DotProductsFaster(rows);
}

#ifdef ATTN_DECODE_AVX512
template <Math kMath>
void SetAvx512Kernels(bool vector_values, bool ahead, BlockKernels& k) {
  k.scores = &Avx512Scores<kMath, Fetch::kL2>;
  if (vector_values) k.accumulate = &Avx512Accumulate<kMath, Fetch::kL2>;
  if (ahead) {
    k.scores_ahead = &Avx512Scores<kMath, Fetch::kL1>;
    k.accumulate_ahead = vector_values ? &Avx512Accumulate<kMath, Fetch::kL1> : k.accumulate;
  }
}
#endif

// The vector kernels this CPU runs: the widest it has.
enum class VectorKernels { kNone, kAvx2, kAvx512 };
VectorKernels BestVectorKernels() {
#ifdef ATTN_DECODE_AVX512
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (avx512) return VectorKernels::kAvx512;
#endif
  return decode::Avx2Usable() ? VectorKernels::kAvx2 : VectorKernels::kNone;
}

// Those KernelsFor takes, under what SetDecodeKernels selects.
VectorKernels VectorKernelsInUse() {
  switch (kernels_use.load(std::memory_order_relaxed)) {
    case DecodeKernels::kPortable:
      return VectorKernels::kNone;
    case DecodeKernels::kAvx2:
      return decode::Avx2Usable() ? VectorKernels::kAvx2 : VectorKernels::kNone;
    case DecodeKernels::kBest:
      break;
  }
  return BestVectorKernels();
}

BlockKernels KernelsFor(int64_t value_dim, Math math) {
  const bool bf16 = math != Math::kFloat32;
  BlockKernels k{bf16 ? &GenericScores<true> : &GenericScores<false>,
                 bf16 ? &GenericAccumulate<true> : &GenericAccumulate<false>,
                 bf16 ? Math::kBFloat16 : Math::kFloat32};
  const VectorKernels vector = VectorKernelsInUse();
  // The AVX2 kernels, like the AVX-512 ones, take value dims that are a
  // multiple of 16 (whole cache lines of FLOAT32 rows per pass).
  const bool vector_values = value_dim % 16 == 0;
  if (vector == VectorKernels::kAvx2) {
    // No bf16 products without avx512_bf16: float32 math (k.scores_math as
    // the portable loops'), as on Intel's CPUs.
    const decode::Avx2Kernels avx2 = decode::Avx2KernelsFor(bf16);
    k.scores = avx2.scores;
    if (vector_values) k.accumulate = avx2.accumulate;
    k.prefetch_one_row = false;
    return k;
  }
#ifdef ATTN_DECODE_AVX512
  static const bool avx512_bf16 = __builtin_cpu_supports("avx512bf16");
  if (vector != VectorKernels::kAvx512) return k;
  if (math == Math::kBFloat16Dot && !avx512_bf16) math = Math::kBFloat16;
  k.scores_math = math;
  // Items prefetch ahead where one pass of a group of rows reads their
  // value rows (kMostChunksOf: one row or two up to 128 elements): a row
  // read in several passes, a part at a time, would take its prefetched
  // lines out of L1 before the later passes come to them. Not on Intel's
  // CPUs, where it is not measured and the next part met the targets (T0
  // there read 10% slower than T1 when it was the next part that came in).
  static const bool intel = __builtin_cpu_is("intel");
  const bool ahead = !intel && value_dim <= 16 * kMostChunksOf<Math::kFloat32, 2>;
  switch (math) {
    case Math::kFloat32:
      SetAvx512Kernels<Math::kFloat32>(vector_values, ahead, k);
      break;
    case Math::kBFloat16:
      SetAvx512Kernels<Math::kBFloat16>(vector_values, ahead, k);
      break;
    case Math::kBFloat16Dot:
      SetAvx512Kernels<Math::kBFloat16Dot>(vector_values, ahead, k);
      break;
  }
#endif
  return k;
}

// Asks for one line of each page of [first, first + bytes) (a prefetch
// into L2, which never faults), so that the pages' address translations
// are looked up now, while the thread reads what comes before them: a
// prefetch or read that reaches a page whose translation is not cached
// waits for a page walk, long under a VM's nested paging, and the CPU's
// own prefetchers stop at page bounds. On the AMD EPYC VM, with each
// part's pages touched two parts ahead, one-row steps read 3-23% faster
// and grouped-query ones up to 9%; touched 4 or 8 parts ahead, about the
// same (docs/decode-log.md).
void TranslateAhead(const void* first, int64_t bytes) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(first);
  const uintptr_t end = start + static_cast<uintptr_t>(bytes);
  __builtin_prefetch(first, 0, 1);
  for (uintptr_t page = start / kPageBytes * kPageBytes + kPageBytes; page < end;
       page += kPageBytes) {
    __builtin_prefetch(reinterpret_cast<const void*>(page), 0, 1);
  }
}

// An item's query rows as the kernels take them, and its sums.
struct ItemRows {
  const float* qf[kMaxDecodeRows];
  const void* q[kMaxDecodeRows];
  float* acc[kMaxDecodeRows];
  float* partial;
};

void RunUnit(const Unit& u, absl::Span<const DecodeItem> items, float* partials) {
  const DecodeItem& first = items[u.first_item];
  const KvCache& cache = *first.cache;
  const int64_t dk = cache.key_dim(), dv = cache.value_dim();
  // Every item of a unit is one call's head of one session: the same cache,
  // length, rows and precision (RunDecode groups them so).
  const int64_t rows = first.group * first.query_len;
  const int64_t count = u.end_item - u.first_item;
  // Precision FAST over a BFLOAT16 cache: bf16 products, by tile
  // multiplies where the CPU has them and the shape fits (enough rows per
  // key/value head), else by dot products where those beat float32 math.
  const bool bf16_products = cache.dtype() == DType::kBFloat16 && first.fast;
  const bool tile_shape = bf16_products && rows >= kMinTileRows && TilesFit(rows, dk, dv) &&
                          tiles_allowed.load(std::memory_order_relaxed) && TilesUsable();
  const Math math = cache.dtype() == DType::kFloat32                        ? Math::kFloat32
                    : bf16_products && (tile_shape || UseDotProducts(rows)) ? Math::kBFloat16Dot
                                                                            : Math::kBFloat16;
  const BlockKernels kernels = KernelsFor(dv, math);
  // Kernels that prefetch the part they read, how far ahead (tiles take
  // the next part).
  const bool ahead = !tile_shape && kernels.scores_ahead != nullptr;
  const int64_t ahead_bytes = rows == 1 ? kPrefetchAhead : kPrefetchAheadRows;
  const ScoresFn scores_fn = ahead ? kernels.scores_ahead : kernels.scores;
  const AccumulateFn accumulate_fn = ahead ? kernels.accumulate_ahead : kernels.accumulate;
  // Scores of every query row against one block.
  alignas(64) float scores[kMaxDecodeRows * kBlockRows];
  // With tiles, the weights rounded to bfloat16.
  alignas(64) uint16_t weights[kMaxDecodeRows * kBlockRows];
  float correction[kMaxDecodeRows];
  thread_local std::vector<ItemRows> states;
  states.resize(static_cast<size_t>(count));
  // bf16 dot products take the query rows as bfloat16 pairs, scaled
  // before rounding (as SDPA scales q), so that the scores come out of the
  // multiplies scaled: the tile path's scores then go straight to the
  // softmax step.
  const bool dot = kernels.scores_math == Math::kBFloat16Dot;
  thread_local std::vector<uint16_t> q_bf16;
  thread_local std::vector<float> q_scaled;
  const int64_t dk_even = (dk + 1) / 2 * 2;
  const bool tiles = dot && tile_shape;
  if (dot) {
    q_bf16.assign(static_cast<size_t>(count * rows * dk_even), 0);
    q_scaled.resize(static_cast<size_t>(dk));
  }
  // Item k's partial results for the kSumBlocks range `range`, empty.
  const auto start_range = [&](int64_t k, int64_t range) {
    ItemRows& st = states[k];
    st.partial = partials + u.partial_offset[k] + range * rows * (dv + 2);
    for (int64_t r = 0; r < rows; ++r) {
      float* p = st.partial + r * (dv + 2);
      p[0] = -std::numeric_limits<float>::infinity();
      p[1] = 0.0f;
      std::memset(p + 2, 0, static_cast<size_t>(dv) * sizeof(float));
      st.acc[r] = p + 2;
    }
  };
  for (int64_t k = 0; k < count; ++k) {
    const DecodeItem& it = items[u.first_item + k];
    ItemRows& st = states[k];
    start_range(k, u.first_block / kSumBlocks);
    for (int64_t r = 0; r < rows; ++r) {
      st.qf[r] = it.q + (r / it.query_len) * it.q_head_stride + (r % it.query_len) * it.q_pos_stride;
      st.q[r] = st.qf[r];
      if (dot) {
        uint16_t* qb = q_bf16.data() + (k * rows + r) * dk_even;
        for (int64_t e = 0; e < dk; ++e) q_scaled[e] = st.qf[r][e] * it.scale;
        ToBFloat16(q_scaled.data(), qb, dk);
        st.q[r] = qb;
      }
    }
  }
  // Keys: scores of up to kScoreRows query rows at a time (with tiles, all
  // of them), so a block's keys come from memory once for the whole group;
  // values likewise, from cache after the first row. Meanwhile the next
  // head's part comes in (the next block's first head after the last).
  if (tiles) LoadTileConfig(static_cast<int>(rows));
  // The unit reads its parts in order, head after head within a block:
  // part i is block first_block + i / count, item i % count. Each part's
  // pages are touched kTranslateAheadParts parts before it is read.
  const int64_t parts = (u.end_block - u.first_block) * count;
  const int64_t part_bytes = cache.block_bytes() / cache.kv_heads();
  const auto translate_part = [&](int64_t i) {
    if (i >= parts) return;
    TranslateAhead(
        cache.KeyBlock(u.first_block + i / count, items[u.first_item + i % count].kv_head),
        part_bytes);
  };
  for (int64_t i = 0; i < kTranslateAheadParts; ++i) translate_part(i);
  for (int64_t block = u.first_block; block < u.end_block; ++block) {
    if (block != u.first_block && block % kSumBlocks == 0) {
      for (int64_t k = 0; k < count; ++k) start_range(k, block / kSumBlocks);
    }
    const int64_t first_row = block * kBlockRows;
    const int64_t n = std::min(kBlockRows, first.keys - first_row);
    for (int64_t k = 0; k < count; ++k) {
      const DecodeItem& it = items[u.first_item + k];
      ItemRows& st = states[k];
      translate_part((block - u.first_block) * count + k + kTranslateAheadParts);
      const void* kb = cache.KeyBlock(block, it.kv_head);
      const void* vb = cache.ValueBlock(block, it.kv_head);
      const char* next_k = nullptr;
      const char* next_v = nullptr;
      if (ahead) {
        next_k = static_cast<const char*>(kb) + ahead_bytes;
        next_v = static_cast<const char*>(vb) + ahead_bytes;
      } else if ((rows > 1 || kernels.prefetch_one_row) &&
                 (k + 1 < count || block + 1 < u.end_block)) {
        const int64_t next_block = k + 1 < count ? block : block + 1;
        const int64_t next_head = items[u.first_item + (k + 1) % count].kv_head;
        next_k = static_cast<const char*>(cache.KeyBlock(next_block, next_head));
        next_v = static_cast<const char*>(cache.ValueBlock(next_block, next_head));
      }
      int64_t visible[kMaxDecodeRows];
      float* row_partial[kMaxDecodeRows];
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = r % it.query_len;
        visible[r] = n;
        if (it.causal) visible[r] = std::min(n, i + it.keys - it.query_len - first_row + 1);
        row_partial[r] = st.partial + r * (dv + 2);
      }
      if (tiles) {
        TileScores(q_bf16.data() + k * rows * dk_even, dk_even * 2, kb, dk, scores, next_k);
        for (int64_t r = 0; r < rows; ++r) {
          correction[r] = PrepareToBFloat16(scores + r * kBlockRows, visible[r], row_partial[r],
                                            weights + r * kBlockRows);
        }
      } else {
        for (int64_t r = 0; r < rows; r += kScoreRows) {
          const int c = static_cast<int>(std::min<int64_t>(kScoreRows, rows - r));
          const SoftmaxRows softmax{visible + r, row_partial + r, correction + r, first.fast};
          scores_fn(st.q + r, c, kb, n, dk, dot ? 1.0f : it.scale, scores + r * kBlockRows,
                    r == 0 ? next_k : nullptr, softmax);
        }
      }
      if (tiles) {
        TileAccumulate(weights, static_cast<int>(rows), st.acc, correction, vb, dv, next_v);
      } else {
        accumulate_fn(scores, static_cast<int>(rows), st.acc, correction, vb, n, dv, next_v);
      }
    }
  }
  if (tiles) ReleaseTiles();
  if (!u.with_tail) return;
  for (int64_t k = 0; k < count; ++k) {
    const DecodeItem& it = items[u.first_item + k];
    ItemRows& st = states[k];
    for (int64_t r = 0; r < rows; ++r) {
      for (int t = 0; t < it.tail; ++t) {
        float dot = 0.0f;
        for (int64_t e = 0; e < dk; ++e) dot += st.qf[r][e] * it.tail_k[t][e];
        scores[t] = dot * it.scale;
      }
      const float c = Prepare(scores, it.tail, it.tail, st.partial + r * (dv + 2));
      if (c != 1.0f) Scale(st.acc[r], dv, c);
      for (int t = 0; t < it.tail; ++t) AccumulateRows(scores + t, it.tail_v[t], 1, dv, st.acc[r]);
    }
  }
}

// For one query row whose ranges' largest max is `max` (finite, no NaN
// among them): out (dv floats, zeros) += acc_u e^(m_u - max) over the ranges
// u that saw a key (l_u > 0), in order, range u's [m, l, acc...] at
// first + u * stride; returns sum_u l_u e^(m_u - max), the same order.
float PortableMergeRow(const float* first, int64_t stride, int64_t units, int64_t dv, float max,
                       float* out) {
  float total = 0.0f;
  for (int64_t u = 0; u < units; ++u) {
    const float* p = first + u * stride;
    if (!(p[1] > 0)) continue;
    const float w = std::exp(p[0] - max);
    total += p[1] * w;
    for (int64_t e = 0; e < dv; ++e) out[e] += p[2 + e] * w;
  }
  return total;
}

// out = sum_c acc_c e^(m_c - M) / sum_c l_c e^(m_c - M) over an item's
// kSumBlocks ranges c, in order.
void Merge(const DecodeItem& it, const float* partials, int64_t units) {
  const int64_t dv = it.cache->value_dim();
  const int64_t rows = it.group * it.query_len;
  const int64_t stride = rows * (dv + 2);
  const bool avx512 = VectorKernelsInUse() == VectorKernels::kAvx512;
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
    const float* first = partials + r * (dv + 2);
    float total = 0.0f;
#ifdef ATTN_DECODE_AVX512
    if (avx512) total = Avx512MergeRow(first, stride, units, dv, max, out);
#endif
    if (!avx512) total = PortableMergeRow(first, stride, units, dv, max, out);
    Scale(out, dv, 1.0f / total);
  }
}

// Waits until done(), for the rest of a pass's work on another thread of
// its team: spinning, then yielding the CPU (to a team member or other work
// that shares it), never sleeping. Under OMP_WAIT_POLICY=PASSIVE, the
// server's, libgomp's barriers put a waiting thread to sleep, and waking it
// took 50-140 us on the AMD EPYC VM (docs/decode-log.md).
template <typename Done>
void WaitWithinPass(Done done) {
  // About 20 us of pauses on the AMD EPYC VM, then yields.
  constexpr int kSpins = 1024;
  for (int spins = 0; !done();) {
    if (spins < kSpins) {
      ++spins;
#if defined(__x86_64__) && defined(__GNUC__)
      _mm_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
}

// Whether items a and b are heads of one session in one call, which a unit
// computes together.
bool SameSession(const DecodeItem& a, const DecodeItem& b) {
  return a.cache == b.cache && a.keys == b.keys && a.group == b.group &&
         a.query_len == b.query_len && a.fast == b.fast;
}

// Room for `floats` partial results (RunUnit sets its own): this thread's
// buffer, kept from call to call up to 4 MiB and grown, not zeroed, per
// call (a fresh vector's page faults and zeroing were 9-13 us of a
// grouped-query step, 2026-11-27), else `own`, for this call.
float* PartialsBuffer(int64_t floats, std::vector<float>& own) {
  const size_t size = static_cast<size_t>(floats);
  if (floats > (int64_t{4} << 20) / static_cast<int64_t>(sizeof(float))) {
    own.resize(size);
    return own.data();
  }
  thread_local std::vector<float> kept;
  if (kept.size() < size) kept.resize(size);
  return kept.data();
}

// [0, blocks) in `count` ranges of about equal size, each bound but the last
// a multiple of kSumBlocks (count <= blocks / kSumBlocks keeps them apart):
// their bounds.
std::vector<int64_t> EqualRanges(int64_t blocks, int64_t count) {
  std::vector<int64_t> bounds;
  for (int64_t c = 0; c < count; ++c) bounds.push_back(blocks * c / count / kSumBlocks * kSumBlocks);
  bounds.push_back(blocks);
  return bounds;
}

}  // namespace

std::vector<int64_t> ShrinkingBlockRanges(int64_t blocks, int threads) {
  if (blocks <= 0) return {0, 0};
  std::vector<int64_t> bounds = {0};
  const int64_t parts = 2 * static_cast<int64_t>(threads);
  for (int64_t left = blocks; left > 0;) {
    int64_t size = std::max(kMinChunkBlocks, (left + parts - 1) / parts);
    size = (size + kSumBlocks - 1) / kSumBlocks * kSumBlocks;
    if (left - size < kMinChunkBlocks) size = left;
    bounds.push_back(bounds.back() + size);
    left -= size;
  }
  return bounds;
}

int64_t DecodeUnitsPerSession(int64_t sessions, int threads) {
  if (threads <= 1 || sessions < 1) return 1;
  int64_t units = (4 * static_cast<int64_t>(threads) + sessions - 1) / sessions;
  while (units * sessions % threads != 0) ++units;  // at most until units == threads
  return units;
}

void RunDecode(absl::Span<const DecodeItem> items, int threads) {
  if (items.empty()) return;
  double bytes = 0;
  for (const DecodeItem& it : items) {
    bytes += static_cast<double>(it.keys) * static_cast<double>(it.cache->block_bytes()) /
             static_cast<double>(kBlockRows * it.cache->kv_heads());
  }
  if (bytes < kParallelBytes) threads = 1;
  const bool timed = record_times.load(std::memory_order_relaxed);
  const Clock::time_point pass_start = timed ? Clock::now() : Clock::time_point{};
  // The pass's whole time, once it ends (however it ends).
  struct WallMark {
    bool on;
    Clock::time_point start;
    ~WallMark() {
      if (!on) return;
      const double wall = MicrosecondsBetween(start, Clock::now());
      absl::MutexLock lock(&times_mu);
      recorded_times.passes += 1;
      recorded_times.wall += wall;
    }
  } wall_mark{timed, pass_start};
  // Sessions: runs of consecutive items that are heads of one session.
  std::vector<int64_t> session_start;
  const int64_t n = static_cast<int64_t>(items.size());
  for (int64_t k = 0; k < n; ++k) {
    if (k == 0 || !SameSession(items[k - 1], items[k])) session_start.push_back(k);
  }
  const int64_t sessions = static_cast<int64_t>(session_start.size());
  session_start.push_back(n);
  // A session's blocks split into ranges of at least kMinChunkBlocks
  // blocks (a lone session's shrinking as they go), and where a cache is
  // too short for enough of them, its heads split too.
  const int64_t units_wanted = DecodeUnitsPerSession(sessions, threads);
  // Item k's partials: one per kSumBlocks range of its cache (chunks[k] of
  // them), rows * (value_dim + 2) floats each, from partial_offset[k].
  std::vector<int64_t> chunks(items.size()), partial_offset(items.size());
  std::vector<Unit> units;
  int64_t partial_floats = 0;
  for (int64_t g = 0; g < sessions; ++g) {
    const int64_t first = session_start[g], end = session_start[g + 1];
    const DecodeItem& it = items[first];
    const int64_t blocks = (it.keys + kBlockRows - 1) / kBlockRows;
    const int64_t heads = end - first;
    const int64_t c_count_wanted =
        std::max<int64_t>(1, std::min(units_wanted, blocks / kMinChunkBlocks));
    const int64_t h_count = std::min(heads, (units_wanted + c_count_wanted - 1) / c_count_wanted);
    const std::vector<int64_t> bounds =
        sessions == 1 && h_count == 1 && c_count_wanted > 1
            ? ShrinkingBlockRanges(blocks, threads)
            : EqualRanges(blocks, c_count_wanted);
    const int64_t c_count = static_cast<int64_t>(bounds.size()) - 1;
    const int64_t ranges = std::max<int64_t>(1, (blocks + kSumBlocks - 1) / kSumBlocks);
    const int64_t stride = it.group * it.query_len * (it.cache->value_dim() + 2);
    for (int64_t k = first; k < end; ++k) {
      chunks[k] = ranges;
      partial_offset[k] = partial_floats;
      partial_floats += ranges * stride;
    }
    for (int64_t c = 0; c < c_count; ++c) {
      for (int64_t h = 0; h < h_count; ++h) {
        Unit u;
        u.first_item = first + heads * h / h_count;
        u.end_item = first + heads * (h + 1) / h_count;
        u.first_block = bounds[c];
        u.end_block = bounds[c + 1];
        u.with_tail = c == c_count - 1;
        u.session = g;
        for (int64_t k = u.first_item; k < u.end_item; ++k) {
          u.partial_offset.push_back(partial_offset[k]);
        }
        units.push_back(std::move(u));
      }
    }
  }
  std::vector<float> own_partials;
  float* const partials = PartialsBuffer(partial_floats, own_partials);
  const int64_t total = static_cast<int64_t>(units.size());
  const int team = static_cast<int>(std::min<int64_t>(threads, total));
  if (team <= 1) {
    PassMarks marks(timed, pass_start);
    marks.Mark(&DecodeTimes::start);
    for (const Unit& u : units) RunUnit(u, items, partials);
    marks.Mark(&DecodeTimes::units);
    for (int64_t k = 0; k < n; ++k) Merge(items[k], partials + partial_offset[k], chunks[k]);
    marks.Mark(&DecodeTimes::merge);
    marks.Record();
    return;
  }
  // An exception must not leave an OpenMP region (std::terminate): a unit
  // that cannot get its thread's small buffers is noted, and the pass
  // throws once the team is done.
  std::atomic<bool> out_of_memory{false};
  // The team takes the units in order, then the items' merges in order, each
  // merge once its session's units are done, so that the first sessions'
  // merges run while the last units do. No barrier between the two, and the
  // leading thread waits for the others before the region's end, where it
  // then arrives last: under OMP_WAIT_POLICY=PASSIVE, libgomp's barriers put
  // a thread that waits to sleep, and each cost a wake (WaitWithinPass).
  std::vector<std::atomic<int64_t>> units_left(static_cast<size_t>(sessions));
  for (const Unit& u : units) units_left[u.session].fetch_add(1, std::memory_order_relaxed);
  std::vector<int64_t> session_of(items.size());
  for (int64_t g = 0; g < sessions; ++g) {
    for (int64_t k = session_start[g]; k < session_start[g + 1]; ++k) session_of[k] = g;
  }
  std::atomic<int64_t> next_unit{0}, next_merge{0};
  std::atomic<int> others_done{0};
#pragma omp parallel num_threads(team)
  {
    PassMarks marks(timed, pass_start);
    marks.Mark(&DecodeTimes::start);
    for (int64_t u; (u = next_unit.fetch_add(1, std::memory_order_relaxed)) < total;) {
      try {
        if (!out_of_memory.load(std::memory_order_relaxed)) RunUnit(units[u], items, partials);
      } catch (const std::bad_alloc&) {
        out_of_memory.store(true, std::memory_order_relaxed);
      }
      units_left[units[u].session].fetch_sub(1, std::memory_order_release);
    }
    marks.Mark(&DecodeTimes::units);
    for (int64_t k; (k = next_merge.fetch_add(1, std::memory_order_relaxed)) < n;) {
      const std::atomic<int64_t>& left = units_left[session_of[k]];
      WaitWithinPass([&] { return left.load(std::memory_order_acquire) == 0; });
      marks.Mark(&DecodeTimes::merge_wait);
      if (!out_of_memory.load(std::memory_order_relaxed)) {
        Merge(items[k], partials + partial_offset[k], chunks[k]);
      }
      marks.Mark(&DecodeTimes::merge);
    }
    // The team OpenMP gave, which may be smaller than asked (OMP_THREAD_LIMIT,
    // or a pass inside another parallel region).
    const int others = omp_get_num_threads() - 1;
    if (omp_get_thread_num() != 0) {
      others_done.fetch_add(1, std::memory_order_release);
    } else {
      WaitWithinPass([&] { return others_done.load(std::memory_order_acquire) == others; });
    }
    marks.Mark(&DecodeTimes::end);
    marks.Record();
  }
  if (out_of_memory.load()) throw std::bad_alloc();
}

void RecordDecodeTimes(bool on) { record_times.store(on, std::memory_order_relaxed); }

DecodeTimes TakeDecodeTimes() {
  absl::MutexLock lock(&times_mu);
  return std::exchange(recorded_times, DecodeTimes{});
}

void SetDecodeKernels(DecodeKernels use) { kernels_use.store(use, std::memory_order_relaxed); }

const char* DecodeKernelsChosen() {
  switch (BestVectorKernels()) {
    case VectorKernels::kAvx512:
      return "AVX-512";
    case VectorKernels::kAvx2:
      return "AVX2";
    case VectorKernels::kNone:
      break;
  }
  return "portable";
}

bool DecodeExpForTesting(bool fast, const float* x, float* y, int64_t n) {
  const VectorKernels vector = VectorKernelsInUse();
  if (vector == VectorKernels::kNone) return false;
  const int64_t lanes = vector == VectorKernels::kAvx512 ? 16 : 8;
  for (int64_t i = 0; i < n; i += lanes) {
    const int64_t count = std::min<int64_t>(lanes, n - i);
    alignas(64) float in[16] = {}, out[16];
    std::memcpy(in, x + i, static_cast<size_t>(count) * sizeof(float));
#ifdef ATTN_DECODE_AVX512
    if (vector == VectorKernels::kAvx512) ExpForTesting(fast, in, out);
#endif
    if (vector == VectorKernels::kAvx2) decode::Avx2ExpForTesting(fast, in, out);
    std::memcpy(y + i, out, static_cast<size_t>(count) * sizeof(float));
  }
  return true;
}

bool DecodeTilesAvailable() { return TilesUsable(); }

void UseDecodeTiles(bool use) { tiles_allowed.store(use, std::memory_order_relaxed); }

bool DecodeDotProductsChosen(int64_t rows) { return DotProductsFaster(rows); }

void SetDecodeDotProducts(DotProducts use) {
  dot_products_use.store(use, std::memory_order_relaxed);
}

}  // namespace attention::internal
