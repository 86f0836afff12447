#ifndef ATTENTION_ENGINE_KERNELS_H_
#define ATTENTION_ENGINE_KERNELS_H_

// Vectorised row operations of the oneDNN backend: the element-wise work
// between its matmuls. Engine-private. Every function works on `n`
// contiguous floats; none allocates.

#include <cstdint>

namespace attention::internal {

// exp(x) for every element, in place; about 1 ulp; -inf and anything below
// about -87.3 give exactly 0.
void ExpInPlace(float* x, int64_t n);

// Largest element; -inf for an empty row or a row of -inf; NaN when any
// element is NaN (so a NaN score makes its row NaN, as in PyTorch, instead of
// being skipped by the comparisons).
float RowMax(const float* x, int64_t n);

// x[j] = exp(x[j] - shift); returns the sum of the new x.
float ExpShiftSum(float* x, int64_t n, float shift);

// y[j] = bf16(exp(x[j] - shift)) for shift >= max x; returns the sum of the
// float values. The exp is only as exact as bf16 needs (relative 4e-6).
float ExpShiftSumToBFloat16(const float* x, uint16_t* y, int64_t n, float shift);

// x[j] *= factor
void Scale(float* x, int64_t n, float factor);
// x[j] = x[j] * scale + bias[j] (bias may be null)
void ScaleAddBias(float* x, int64_t n, float scale, const float* bias);
// x[j] = x[j] * scale / max(row_norm * col_norm[j], 1e-8)   (cosine)
void CosineScale(float* x, int64_t n, float scale, float row_norm, const float* col_norm);
// x[j] += add[j]
void Add(float* x, int64_t n, const float* add);
// C[m x n] = A[m x k] B[k x n], row-major with leading dimensions lda, ldb,
// ldc; for matmuls so small that a library call costs more than the math.
// Each element of C sums over k in order, whatever m is.
void SmallGemm(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
               int64_t m, int64_t n, int64_t k);
// x[j] = mask[j] ? -inf : x[j]
void MaskBool(float* x, int64_t n, const uint8_t* mask);
// x[j] = -inf
void FillNegInf(float* x, int64_t n);

// y[j] = bf16(x[j]), round to nearest even.
void ToBFloat16(const float* x, uint16_t* y, int64_t n);
// y[j] = float(x[j]).
void FromBFloat16(const uint16_t* x, float* y, int64_t n);

// sum_d a[d] * b[d] and sum_d (a[d] - b[d])^2 in float.
float Dot(const float* a, const float* b, int64_t n);
float SquaredDistance(const float* a, const float* b, int64_t n);
// s[j] = scale * sum_e q[e] * kt[e * ld + j] for j < n, e < d: one query row
// against n keys of a FLOAT32 session cache, stored transposed
// (engine/kv_cache.h).
void DotTransposed(const float* q, const float* kt, int64_t ld, int64_t n, int64_t d, float scale,
                   float* s);
// The same over a BFLOAT16 cache's pairs of elements: key j's element e at
// kt[(e / 2) * 2 * ld + 2 * j + e % 2].
void DotPairedBFloat16(const float* q, const uint16_t* kt, int64_t ld, int64_t n, int64_t d,
                       float scale, float* s);
// acc[e] += sum_j p[j] * v[j * d + e] for e < d: softmax-weighted value rows.
void AccumulateRows(const float* p, const float* v, int64_t n, int64_t d, float* acc);
// The same over a BFLOAT16 cache's pairs of rows: row j's element e at
// v[(j / 2) * 2 * d + 2 * e + j % 2].
void AccumulatePairedRowsBFloat16(const float* p, const uint16_t* v, int64_t n, int64_t d,
                                  float* acc);
// sum_u w[u] * tanh(a[u] + b[u])   (additive score)
float TanhDot(const float* w, const float* a, const float* b, int64_t n);

}  // namespace attention::internal

#endif  // ATTENTION_ENGINE_KERNELS_H_
