#include "engine/kernels.h"

#include <cstring>
#include <limits>

#include "common/half.h"

// Each hot loop is compiled three times, for AVX-512 (x86-64-v4), for AVX2
// with FMA (x86-64-v3) and for any x86-64, and the loader picks the widest
// the CPU it runs on has. Not under TSan:
// GCC instruments the ifunc resolvers too, and the loader runs them before
// TSan's runtime is up, which crashes every program at startup.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_THREAD__)
#define ATTN_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ATTN_CLONES
#endif

namespace attention::internal {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// Cephes-style expf: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6
// polynomial, 2^n by building the exponent bits. Branch-free, so loops vectorise.
inline float Exp(float x) {
  const float lo = -87.33654f, hi = 88.37626f;
  const bool underflow = !(x >= lo);  // also true for NaN? no: NaN handled below
  const float xc = x < lo ? lo : (x > hi ? hi : x);
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float t = xc * 1.44269504088896341f + magic;
  const float n = t - magic;
  const int32_t ni = static_cast<int32_t>(FloatToBits(t) - FloatToBits(magic));
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const float scale = BitsToFloat(static_cast<uint32_t>(ni + 127) << 23);
  float result = y * scale;
  result = underflow ? 0.0f : result;
  return x != x ? x : result;  // NaN stays NaN
}

// exp(x) for x <= 0 (a score minus its row max), for outputs rounded to bf16
// (8 significant bits): a degree-4 polynomial, relative error below 4e-6, and
// no NaN or overflow handling; -inf gives exactly 0.
inline float ExpNonPositiveForBf16(float x) {
  const float lo = -87.33654f;
  const bool underflow = !(x >= lo);
  const float xc = underflow ? lo : x;
  const float magic = 12582912.0f;
  const float t = xc * 1.44269504088896341f + magic;
  const float n = t - magic;
  const int32_t ni = static_cast<int32_t>(FloatToBits(t) - FloatToBits(magic));
  const float r = xc - n * 0.693147180559945f;
  float p = 4.16666667e-2f;
  p = p * r + 1.66666667e-1f;
  p = p * r + 5.0e-1f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float scale = BitsToFloat(static_cast<uint32_t>(ni + 127) << 23);
  return underflow ? 0.0f : p * scale;
}

}  // namespace

ATTN_CLONES void ExpInPlace(float* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) x[j] = Exp(x[j]);
}

ATTN_CLONES float RowMax(const float* x, int64_t n) {
  float m = kNegInf;
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t j = 0; j < n; ++j) {
    m = x[j] > m ? x[j] : m;
    nan |= x[j] != x[j];
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

ATTN_CLONES float ExpShiftSum(float* x, int64_t n, float shift) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float e = Exp(x[j] - shift);
    x[j] = e;
    sum += e;
  }
  return sum;
}

ATTN_CLONES float ExpShiftSumToBFloat16(const float* x, uint16_t* y, int64_t n, float shift) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float e = ExpNonPositiveForBf16(x[j] - shift);
    sum += e;
    // FloatToBFloat16 without its NaN case: e is finite and >= 0 here, and
    // this is the hottest loop of bf16 attention.
    const uint32_t u = FloatToBits(e);
    y[j] = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  return sum;
}

ATTN_CLONES void Scale(float* x, int64_t n, float factor) {
  for (int64_t j = 0; j < n; ++j) x[j] *= factor;
}

ATTN_CLONES void ScaleAddBias(float* x, int64_t n, float scale, const float* bias) {
  if (bias == nullptr) {
    for (int64_t j = 0; j < n; ++j) x[j] *= scale;
  } else {
    for (int64_t j = 0; j < n; ++j) x[j] = x[j] * scale + bias[j];
  }
}

ATTN_CLONES void CosineScale(float* x, int64_t n, float scale, float row_norm,
                             const float* col_norm) {
  for (int64_t j = 0; j < n; ++j) {
    const float d = row_norm * col_norm[j];
    x[j] = x[j] * scale / (d > 1e-8f ? d : 1e-8f);
  }
}

ATTN_CLONES void Add(float* x, int64_t n, const float* add) {
  for (int64_t j = 0; j < n; ++j) x[j] += add[j];
}

ATTN_CLONES void MaskBool(float* x, int64_t n, const uint8_t* mask) {
  for (int64_t j = 0; j < n; ++j) x[j] = mask[j] ? kNegInf : x[j];
}

void FillNegInf(float* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) x[j] = kNegInf;
}

ATTN_CLONES void ToBFloat16(const float* x, uint16_t* y, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] = FloatToBFloat16(x[j]);
}

ATTN_CLONES void FromBFloat16(const uint16_t* x, float* y, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] = BFloat16ToFloat(x[j]);
}

// 16 floats; on AVX-512 one register.
typedef float Float16x __attribute__((vector_size(64)));

// SmallGemm's core: rows [0, R) of C, columns [0, 16), accumulated in
// registers (through memory, each += would wait on the store before it).
template <int R>
[[gnu::always_inline]] inline void GemmBlock(const float* a, int64_t lda, const float* b,
                                             int64_t ldb, float* c, int64_t ldc, int64_t k) {
  Float16x acc[R] = {};
  for (int64_t kk = 0; kk < k; ++kk) {
    Float16x bk;
    std::memcpy(&bk, b + kk * ldb, sizeof bk);
    for (int r = 0; r < R; ++r) acc[r] += a[r * lda + kk] * bk;
  }
  for (int r = 0; r < R; ++r) std::memcpy(c + r * ldc, &acc[r], sizeof acc[r]);
}

ATTN_CLONES void SmallGemm(const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                           int64_t ldc, int64_t m, int64_t n, int64_t k) {
  constexpr int64_t kWidth = 16, kRows = 4;
  const int64_t full = n - n % kWidth;
  for (int64_t j0 = 0; j0 < full; j0 += kWidth) {
    int64_t i = 0;
    for (; i + kRows <= m; i += kRows) {
      GemmBlock<kRows>(a + i * lda, lda, b + j0, ldb, c + i * ldc + j0, ldc, k);
    }
    for (; i < m; ++i) GemmBlock<1>(a + i * lda, lda, b + j0, ldb, c + i * ldc + j0, ldc, k);
  }
  if (full == n) return;
  for (int64_t i = 0; i < m; ++i) {  // the last n % 16 columns
    const float* ai = a + i * lda;
    float* ci = c + i * ldc;
    for (int64_t j = full; j < n; ++j) {
      float acc = 0.0f;
      for (int64_t kk = 0; kk < k; ++kk) acc += ai[kk] * b[kk * ldb + j];
      ci[j] = acc;
    }
  }
}

ATTN_CLONES float Dot(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < n; ++d) acc += a[d] * b[d];
  return acc;
}

ATTN_CLONES float SquaredDistance(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < n; ++d) {
    const float diff = a[d] - b[d];
    acc += diff * diff;
  }
  return acc;
}

ATTN_CLONES float TanhDot(const float* w, const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t u = 0; u < n; ++u) {
    // tanh(x) = 1 - 2 / (exp(2x) + 1), exact at +-inf.
    const float e = Exp(2.0f * (a[u] + b[u]));
    acc += w[u] * (1.0f - 2.0f / (e + 1.0f));
  }
  return acc;
}

ATTN_CLONES void DotTransposed(const float* q, const float* kt, int64_t ld, int64_t n, int64_t d,
                               float scale, float* s) {
  for (int64_t j = 0; j < n; ++j) s[j] = 0.0f;
  for (int64_t e = 0; e < d; ++e) {
    const float qe = q[e];
    const float* row = kt + e * ld;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) s[j] += qe * row[j];
  }
  for (int64_t j = 0; j < n; ++j) s[j] *= scale;
}

ATTN_CLONES void DotPairedBFloat16(const float* q, const uint16_t* kt, int64_t ld, int64_t n,
                                   int64_t d, float scale, float* s) {
  for (int64_t j = 0; j < n; ++j) s[j] = 0.0f;
  for (int64_t e = 0; e < d; ++e) {
    const float qe = q[e];
    const uint16_t* pairs = kt + (e / 2) * 2 * ld + e % 2;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      s[j] += qe * BitsToFloat(static_cast<uint32_t>(pairs[2 * j]) << 16);
    }
  }
  for (int64_t j = 0; j < n; ++j) s[j] *= scale;
}

ATTN_CLONES void AccumulateRows(const float* p, const float* v, int64_t n, int64_t d, float* acc) {
  for (int64_t j = 0; j < n; ++j) {
    const float pj = p[j];
    const float* vj = v + j * d;
#pragma omp simd
    for (int64_t e = 0; e < d; ++e) acc[e] += pj * vj[e];
  }
}

ATTN_CLONES void AccumulatePairedRowsBFloat16(const float* p, const uint16_t* v, int64_t n,
                                              int64_t d, float* acc) {
  for (int64_t j = 0; j < n; ++j) {
    const float pj = p[j];
    const uint16_t* vj = v + (j / 2) * 2 * d + j % 2;
#pragma omp simd
    for (int64_t e = 0; e < d; ++e) acc[e] += pj * BitsToFloat(static_cast<uint32_t>(vj[2 * e]) << 16);
  }
}

}  // namespace attention::internal
