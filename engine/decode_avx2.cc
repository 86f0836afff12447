// The decode pass's block kernels for x86-64 CPUs with AVX2 and FMA but no
// AVX-512 (x86-64-v3: AMD before Zen 4, Intel's client cores, and VMs whose
// hypervisor does not pass AVX-512 on). The AVX-512 kernels in decode.cc
// are the model: the same cache layout, one pass over a block's keys for up
// to four query rows and one over its values, the next part prefetched
// meanwhile. What differs is the registers: 16 of 8 floats, so a block's 64
// scores of four rows (32 registers) do not fit at once. The keys are
// taken in column passes (four rows: 16 keys at a time, each pass reading
// its own 64 bytes of every 256-byte key element), the scores stored, and
// each row's softmax step is taken on them from L1; the values likewise in
// passes of a few 8-float chunks. Every cache line is still read once.

#include <algorithm>
#include <cmath>
#include <limits>

#include "engine/decode_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ATTN_DECODE_AVX2 1
#define ATTN_AVX2 __attribute__((target("avx2,fma")))
// As in decode.cc: loops over rows, registers and chunks unrolled whole,
// so that the sums they index stay in registers.
#define ATTN_UNROLL _Pragma("GCC unroll 16")
#endif

namespace attention::internal::decode {

#ifdef ATTN_DECODE_AVX2
namespace {

constexpr int64_t kKeyElementBytes = kBlockRows * 4;  // a FLOAT32 key element, or a BFLOAT16 pair

// Into L2, as the AVX-512 kernels prefetch (decode.cc says why T1).
ATTN_AVX2 inline void Prefetch(const char* p, int64_t bytes) {
#pragma GCC unroll 1
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
}

// A BFLOAT16 cache's 32-bit words of two bfloat16 each, 8 words: the first
// elements as float32 (a shift), and the second (a mask).
ATTN_AVX2 inline __m256 FirstOfPairs(__m256i x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}
ATTN_AVX2 inline __m256 SecondOfPairs(__m256i x) {
  return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Registers of 8 keys (scores) or 8 value elements (sums) per query row in
// one pass of kRows rows: as many as leave room for the rows' broadcast
// factors and a loaded register among the 16.
template <int kRows>
constexpr int kWidthOf = kRows == 1   ? 8
                         : kRows == 2 ? 4
                                      : 2;

// A BFLOAT16 cache's pair of key elements (2i, 2i + 1) of kWidth x 8 keys
// at row, into the sums; kSecond false: the last pair of an odd d, which
// has one element.
template <int kRows, int kWidth, bool kSecond>
ATTN_AVX2 inline void ScorePair(const float* const* qr, const char* row, int64_t i,
                                __m256 (&acc)[kRows][kWidth]) {
  // The first elements of every register, then the second: with both
  // elements' factors of four rows live at once, GCC kept two sums on the
  // stack.
  __m256i x[kWidth];
  ATTN_UNROLL
  for (int t = 0; t < kWidth; ++t) {
    x[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * t));
    const __m256 first_k = FirstOfPairs(x[t]);
    ATTN_UNROLL
    for (int r = 0; r < kRows; ++r) {
      acc[r][t] = _mm256_fmadd_ps(first_k, _mm256_set1_ps(qr[r][2 * i]), acc[r][t]);
    }
  }
  if constexpr (kSecond) {
    ATTN_UNROLL
    for (int t = 0; t < kWidth; ++t) {
      const __m256 second_k = SecondOfPairs(x[t]);
      ATTN_UNROLL
      for (int r = 0; r < kRows; ++r) {
        acc[r][t] = _mm256_fmadd_ps(second_k, _mm256_set1_ps(qr[r][2 * i + 1]), acc[r][t]);
      }
    }
  }
}

// Scores of kRows rows against the keys [8 first, 8 (first + kWidth)) of
// the block, times scale, stored at s + r * kBlockRows. FLOAT32: key
// element e of 8 keys is 32 bytes at e * kKeyElementBytes + 32 t;
// BFLOAT16: the pair (2i, 2i + 1) of 8 keys is one register of words.
template <Math kMath, int kRows, int kWidth, bool kPrefetch>
ATTN_AVX2 void ScoresPass(const void* const* q, const char* kt, int64_t d, float scale, float* s,
                          const char* next_k, int first) {
  const int64_t offset = int64_t{32} * first;
  __m256 acc[kRows][kWidth];
  ATTN_UNROLL
  for (int r = 0; r < kRows; ++r) {
    ATTN_UNROLL
    for (int t = 0; t < kWidth; ++t) acc[r][t] = _mm256_setzero_ps();
  }
  const float* qr[kRows];
  ATTN_UNROLL
  for (int r = 0; r < kRows; ++r) qr[r] = static_cast<const float*>(q[r]);
  if constexpr (kMath == Math::kFloat32) {
    for (int64_t e = 0; e < d; ++e) {
      const char* row = kt + e * kKeyElementBytes + offset;
      __m256 k[kWidth];
      ATTN_UNROLL
      for (int t = 0; t < kWidth; ++t)
        k[t] = _mm256_loadu_ps(reinterpret_cast<const float*>(row + 32 * t));
      ATTN_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const __m256 qe = _mm256_set1_ps(qr[r][e]);
        ATTN_UNROLL
        for (int t = 0; t < kWidth; ++t) acc[r][t] = _mm256_fmadd_ps(k[t], qe, acc[r][t]);
      }
      if constexpr (kPrefetch) Prefetch(next_k + e * kKeyElementBytes + offset, 32 * kWidth);
    }
  } else {
    // Whole pairs, then the last element of an odd d: with the test for it
    // inside the loop, GCC moves the sums between registers (decode.cc).
    const int64_t whole = d / 2;
    for (int64_t i = 0; i < whole; ++i) {
      ScorePair<kRows, kWidth, true>(qr, kt + i * kKeyElementBytes + offset, i, acc);
      if constexpr (kPrefetch) Prefetch(next_k + i * kKeyElementBytes + offset, 32 * kWidth);
    }
    if (d % 2 != 0) {
      ScorePair<kRows, kWidth, false>(qr, kt + whole * kKeyElementBytes + offset, whole, acc);
      if constexpr (kPrefetch) Prefetch(next_k + whole * kKeyElementBytes + offset, 32 * kWidth);
    }
  }
  const __m256 sv = _mm256_set1_ps(scale);
  ATTN_UNROLL
  for (int r = 0; r < kRows; ++r) {
    ATTN_UNROLL
    for (int t = 0; t < kWidth; ++t) {
      _mm256_storeu_ps(s + r * kBlockRows + 8 * (first + t), _mm256_mul_ps(acc[r][t], sv));
    }
  }
}

// exp(x) for 8 lanes, as decode.cc's Exp16 (engine/kernels.cc's reduction
// and polynomial, fused multiply-adds): 0 below -87.34, NaN stays NaN. Only
// called with x <= 0 or NaN.
ATTN_AVX2 inline __m256 Exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  const __m256 xc = _mm256_max_ps(lo, x);  // x when NaN
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 t = _mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), magic);
  const __m256 n = _mm256_sub_ps(t, magic);
  const __m256i ni = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(magic));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256 scale =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, scale));
}

// exp(x) for 8 lanes under precision FAST, as decode.cc's Exp16Fast (the
// same reduction and degree-4 polynomial, relative error under 5e-6), with
// 2^n built in the exponent bits where AVX-512 has vscalefps: n >= -126
// wherever the result is not 0, so the bits are a normal float.
ATTN_AVX2 inline __m256 Exp8Fast(__m256 x) {
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 t = _mm256_mul_ps(x, log2e);
  const __m256 underflow = _mm256_cmp_ps(t, _mm256_set1_ps(-126.0f), _CMP_LT_OQ);
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_fmsub_ps(x, log2e, n);
  __m256 p = _mm256_set1_ps(9.582851082e-3f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.590642616e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402409911e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931241751e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256 scale = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, scale));
}

ATTN_AVX2 inline __m128 FourOf(__m256 x, bool max) {
  const __m128 a = _mm256_castps256_ps128(x), b = _mm256_extractf128_ps(x, 1);
  return max ? _mm_max_ps(a, b) : _mm_add_ps(a, b);
}
ATTN_AVX2 inline float MaxOf(__m256 x) { return MaxOf4(FourOf(x, true)); }
ATTN_AVX2 inline float SumOf(__m256 x) { return SumOf4(FourOf(x, false)); }

// One row's softmax step over a block's scores at s (decode.cc's Prepare,
// and its AVX-512 SoftmaxStep's shortcuts): folds the visible ones into the
// running [m, l, ...] at row_partial, leaves the weights at s (0 from
// `visible` on) and returns the factor for the row's sums.
template <bool kFastExp>
ATTN_AVX2 float SoftmaxStep(float* s, int64_t visible, float* row_partial) {
  static_assert(kBlockRows == 64);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float& m = row_partial[0];
  float& l = row_partial[1];
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 x[8], lanes[8];
  // Once a row's max has settled, most blocks have no score above it (nor
  // NaN): then the block's max is not needed, nor an exp for the correction.
  const __m256 old_max = _mm256_set1_ps(m);
  __m256 above = _mm256_setzero_ps();
  ATTN_UNROLL
  for (int t = 0; t < 8; ++t) {
    const int count = static_cast<int>(std::clamp<int64_t>(visible - 8 * t, 0, 8));
    lanes[t] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(count), iota));
    x[t] = _mm256_loadu_ps(s + 8 * t);
    above = _mm256_or_ps(above, _mm256_and_ps(lanes[t], _mm256_cmp_ps(x[t], old_max, _CMP_NLE_UQ)));
  }
  float m_new = m;
  if (_mm256_movemask_ps(above) != 0) {
    const __m256 none = _mm256_set1_ps(kNegInf);
    __m256 block_max = none, nan = _mm256_setzero_ps();
    ATTN_UNROLL
    for (int t = 0; t < 8; ++t) {
      nan = _mm256_or_ps(nan, _mm256_and_ps(lanes[t], _mm256_cmp_ps(x[t], x[t], _CMP_UNORD_Q)));
      block_max = _mm256_max_ps(block_max, _mm256_blendv_ps(none, x[t], lanes[t]));
    }
    const float seen =
        _mm256_movemask_ps(nan) != 0 ? std::numeric_limits<float>::quiet_NaN() : MaxOf(block_max);
    if (std::isnan(seen) || seen > m) m_new = seen;
  }
  if (m_new == kNegInf) {  // nothing seen yet
    ATTN_UNROLL
    for (int t = 0; t < 8; ++t) _mm256_storeu_ps(s + 8 * t, _mm256_setzero_ps());
    return 1.0f;
  }
  const float correction = m == kNegInf ? 0.0f : m == m_new ? 1.0f : std::exp(m - m_new);
  const __m256 shift = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  ATTN_UNROLL
  for (int t = 0; t < 8; ++t) {
    const __m256 shifted = _mm256_sub_ps(x[t], shift);
    const __m256 p = _mm256_and_ps(lanes[t], kFastExp ? Exp8Fast(shifted) : Exp8(shifted));
    _mm256_storeu_ps(s + 8 * t, p);
    sum = _mm256_add_ps(sum, p);
  }
  l = l * correction + SumOf(sum);
  m = m_new;
  return correction;
}

template <Math kMath, int kRows, bool kPrefetch>
void ScoresRows(const void* const* q, const char* kt, int64_t d, float scale, float* s,
                const char* next_k, const SoftmaxRows& softmax) {
  constexpr int kWidth = kWidthOf<kRows>;
  for (int first = 0; first < 8; first += kWidth) {
    ScoresPass<kMath, kRows, kWidth, kPrefetch>(q, kt, d, scale, s, next_k, first);
  }
  for (int r = 0; r < kRows; ++r) {
    float* sr = s + r * kBlockRows;
    softmax.correction[r] = softmax.fast
                                ? SoftmaxStep<true>(sr, softmax.visible[r], softmax.partial[r])
                                : SoftmaxStep<false>(sr, softmax.visible[r], softmax.partial[r]);
  }
}

template <Math kMath, int kRows>
void ScoresOf(const void* const* q, const void* kt, int64_t d, float scale, float* s,
              const char* next_k, const SoftmaxRows& softmax) {
  const char* keys = static_cast<const char*>(kt);
  if (next_k != nullptr) {
    ScoresRows<kMath, kRows, true>(q, keys, d, scale, s, next_k, softmax);
  } else {
    ScoresRows<kMath, kRows, false>(q, keys, d, scale, s, next_k, softmax);
  }
}

template <Math kMath>
void Scores(const void* const* q, int rows, const void* kt, int64_t, int64_t d, float scale,
            float* s, const char* next_k, const SoftmaxRows& softmax) {
  switch (rows) {
    case 1:
      return ScoresOf<kMath, 1>(q, kt, d, scale, s, next_k, softmax);
    case 2:
      return ScoresOf<kMath, 2>(q, kt, d, scale, s, next_k, softmax);
    case 3:
      return ScoresOf<kMath, 3>(q, kt, d, scale, s, next_k, softmax);
    default:
      return ScoresOf<kMath, 4>(q, kt, d, scale, s, next_k, softmax);
  }
}

// A BFLOAT16 pair of value rows' chunks at `pair` into the sums a, with
// the weights p[r * kBlockRows] and p[r * kBlockRows + 1]; kSecond false:
// the first row only (the last of an odd count).
template <int kRows, int kPass, bool kSecond>
ATTN_AVX2 inline void ValuePair(const float* p, const char* pair, __m256 (&a)[kRows][kPass]) {
  // The first row, then the second (ScorePair says why).
  __m256 x[kPass];
  ATTN_UNROLL
  for (int k = 0; k < kPass; ++k) {
    x[k] = _mm256_loadu_ps(reinterpret_cast<const float*>(pair + 32 * k));
    const __m256 first_v = FirstOfPairs(_mm256_castps_si256(x[k]));
    ATTN_UNROLL
    for (int r = 0; r < kRows; ++r) {
      a[r][k] = _mm256_fmadd_ps(_mm256_set1_ps(p[r * kBlockRows]), first_v, a[r][k]);
    }
  }
  if constexpr (kSecond) {
    ATTN_UNROLL
    for (int k = 0; k < kPass; ++k) {
      const __m256 second_v = SecondOfPairs(_mm256_castps_si256(x[k]));
      ATTN_UNROLL
      for (int r = 0; r < kRows; ++r) {
        a[r][k] = _mm256_fmadd_ps(_mm256_set1_ps(p[r * kBlockRows + 1]), second_v, a[r][k]);
      }
    }
  }
}

// Chunks [c0, c0 + kPass) (8 elements each) of kRows rows' sums, over the
// block's n value rows (d elements): the sums stay in registers across the
// block, and each loaded chunk serves every row. FLOAT32: row j's chunk c
// is 32 bytes at (j d + 8 c) 4; BFLOAT16: rows 2i and 2i + 1 share theirs,
// 32 bytes at (2 i d + 16 c) 2, the first row's elements widened by a
// shift, the second's by a mask. next_v: the next part's same bytes come
// in meanwhile.
template <Math kMath, int kRows, int kPass, bool kPrefetch>
ATTN_AVX2 void AccumulatePass(const float* p, float* const* acc, const float* correction,
                              const char* v, int64_t n, int64_t d, int64_t c0, const char* next_v) {
  const int64_t row_bytes = d * 4;  // a FLOAT32 row, or a BFLOAT16 pair of rows
  const int64_t offset = c0 * 32;
  __m256 a[kRows][kPass];
  ATTN_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const __m256 c = _mm256_set1_ps(correction[r]);
    ATTN_UNROLL
    for (int k = 0; k < kPass; ++k)
      a[r][k] = _mm256_mul_ps(_mm256_loadu_ps(acc[r] + 8 * (c0 + k)), c);
  }
  if constexpr (kMath == Math::kFloat32) {
    for (int64_t j = 0; j < n; ++j) {
      const char* row = v + j * row_bytes + offset;
      ATTN_UNROLL
      for (int k = 0; k < kPass; ++k) {
        const __m256 x = _mm256_loadu_ps(reinterpret_cast<const float*>(row + 32 * k));
        ATTN_UNROLL
        for (int r = 0; r < kRows; ++r) {
          a[r][k] = _mm256_fmadd_ps(_mm256_set1_ps(p[r * kBlockRows + j]), x, a[r][k]);
        }
      }
      if constexpr (kPrefetch) Prefetch(next_v + j * row_bytes + offset, 32 * kPass);
    }
  } else {
    // Whole pairs, then the last row of an odd n (the row past it may be
    // another sequence's leftovers, whose NaN a zero weight would not hide).
    int64_t i = 0;
    for (; 2 * i + 1 < n; ++i) {
      ValuePair<kRows, kPass, true>(p + 2 * i, v + i * row_bytes + offset, a);
      if constexpr (kPrefetch) Prefetch(next_v + i * row_bytes + offset, 32 * kPass);
    }
    if (2 * i < n) {
      ValuePair<kRows, kPass, false>(p + 2 * i, v + i * row_bytes + offset, a);
      if constexpr (kPrefetch) Prefetch(next_v + i * row_bytes + offset, 32 * kPass);
    }
  }
  ATTN_UNROLL
  for (int r = 0; r < kRows; ++r) {
    ATTN_UNROLL
    for (int k = 0; k < kPass; ++k) _mm256_storeu_ps(acc[r] + 8 * (c0 + k), a[r][k]);
  }
}

// kRows rows, every chunk of the value rows (d / 8 of them, even), in
// passes of up to kWidthOf<kRows>.
template <Math kMath, int kRows>
void AccumulateRows(const float* p, float* const* acc, const float* correction, const char* v,
                    int64_t n, int64_t d, const char* next_v) {
  constexpr int kMost = kWidthOf<kRows>;
  const int64_t chunks = d / 8;
  for (int64_t c0 = 0; c0 < chunks; c0 += kMost) {
    switch (std::min<int64_t>(kMost, chunks - c0)) {
#define ATTN_PASS(k)                                                                     \
  case k:                                                                                \
    if constexpr (k <= kMost) {                                                          \
      if (next_v != nullptr) {                                                           \
        AccumulatePass<kMath, kRows, k, true>(p, acc, correction, v, n, d, c0, next_v);  \
      } else {                                                                           \
        AccumulatePass<kMath, kRows, k, false>(p, acc, correction, v, n, d, c0, next_v); \
      }                                                                                  \
    }                                                                                    \
    break;
      ATTN_PASS(2)
      ATTN_PASS(4)
      ATTN_PASS(6)
      ATTN_PASS(8)
#undef ATTN_PASS
      default:
        break;
    }
  }
}

// Rows four at a time; the first four's passes bring the next part's
// values in (every row group reads the same bytes).
template <Math kMath>
void Accumulate(const float* p, int rows, float* const* acc, const float* correction, const void* v,
                int64_t n, int64_t d, const char* next_v) {
  const char* values = static_cast<const char*>(v);
  for (int r = 0; r < rows; r += 4) {
    const char* prefetch = r == 0 ? next_v : nullptr;
    const float* pr = p + r * kBlockRows;
    float* const* ar = acc + r;
    const float* cr = correction + r;
    switch (std::min(4, rows - r)) {
      case 4:
        AccumulateRows<kMath, 4>(pr, ar, cr, values, n, d, prefetch);
        break;
      case 3:
        AccumulateRows<kMath, 3>(pr, ar, cr, values, n, d, prefetch);
        break;
      case 2:
        AccumulateRows<kMath, 2>(pr, ar, cr, values, n, d, prefetch);
        break;
      default:
        AccumulateRows<kMath, 1>(pr, ar, cr, values, n, d, prefetch);
        break;
    }
  }
}

}  // namespace

Avx2Kernels Avx2KernelsFor(bool bfloat16) {
  if (bfloat16) return {&Scores<Math::kBFloat16>, &Accumulate<Math::kBFloat16>};
  return {&Scores<Math::kFloat32>, &Accumulate<Math::kFloat32>};
}

bool Avx2Usable() {
  static const bool usable = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return usable;
}

ATTN_AVX2 void Avx2ExpForTesting(bool fast, const float* x, float* y) {
  const __m256 v = _mm256_loadu_ps(x);
  _mm256_storeu_ps(y, fast ? Exp8Fast(v) : Exp8(v));
}

#else  // no AVX2 kernels in this build

Avx2Kernels Avx2KernelsFor(bool) { return {nullptr, nullptr}; }
bool Avx2Usable() { return false; }
void Avx2ExpForTesting(bool, const float*, float*) {}

#endif

}  // namespace attention::internal::decode
