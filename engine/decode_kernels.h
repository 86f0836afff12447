#ifndef ATTENTION_ENGINE_DECODE_KERNELS_H_
#define ATTENTION_ENGINE_DECODE_KERNELS_H_

// The block kernels of the decode pass (engine/decode.cc): what a kernel
// set computes over one cache block, shared by the AVX-512 kernels in
// decode.cc and the AVX2 ones in decode_avx2.cc. Internal to the engine.

#include <cstdint>

#include "engine/kv_cache.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <xmmintrin.h>
#endif

namespace attention::internal::decode {

constexpr int64_t kBlockRows = KvCache::kBlockRows;

// How a step multiplies: float32 math over a FLOAT32 or a BFLOAT16 cache
// (its elements widened exactly), or, for precision FAST over a BFLOAT16
// cache, bf16 products (the query and the softmax weights rounded to
// bfloat16, float32 sums): tile multiplies, or bf16 dot products
// (vdpbf16ps, two multiply-adds per lane and instruction) on CPUs, and for
// steps of as many query rows, where those beat the widening
// (DotProductsFaster).
enum class Math { kFloat32, kBFloat16, kBFloat16Dot };

#if defined(__x86_64__) && defined(__GNUC__)
// The largest and the sum of 4 floats: the last steps of both kernel sets'
// reductions of a register (their FourOf folds it to 4 first). SSE, which
// every x86-64 CPU has.
inline float MaxOf4(__m128 m) {
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
inline float SumOf4(__m128 s) {
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#endif

// Up to kScoreRows query rows' scores against one block's keys at a time:
// each key element loaded once for all of them.
constexpr int kScoreRows = 4;

// What a scores kernel needs for its rows' softmax step (Prepare), row r
// of its `rows`: the block's keys it sees (visible[r]), its running
// [m, l, acc...] (partial[r]), and where the factor Prepare returns goes
// (correction[r]). fast: precision FAST's exponentials.
struct SoftmaxRows {
  const int64_t* visible;
  float* const* partial;
  float* correction;
  bool fast;
};

// The scores scale * q_r . k_j for the `rows` rows q[r] and the block's keys
// kt (engine/kv_cache.h's layout), n of them rows of the sequence, folded
// into each row's softmax: s[r * kBlockRows + j] is left the weight of value
// row j (0 from visible[r] on). q[r] is key_dim floats, or for kBFloat16Dot
// key_dim rounded up to even bfloat16 (the pad 0). next_k (may be null):
// prefetched meanwhile, a stored key row's bytes per row the kernel reads,
// so that the thread keeps memory busy: the next part's keys, or where the
// kernel will read next (engine/decode.cc's BlockKernels). The vector
// kernels compute whole blocks (the rows past n are zeros); the softmax
// step weighs only each row's visible keys.
using ScoresFn = void (*)(const void* const* q, int rows, const void* kt, int64_t n, int64_t d,
                          float scale, float* s, const char* next_k, const SoftmaxRows& softmax);

// acc[r] = acc[r] * correction[r] + sum_{j < n} p[r * kBlockRows + j] v_j
// for `rows` rows, over the block's value rows v (dim d): each value row read
// once for all of them; next_v as next_k. p[r * kBlockRows + j] is 0 for
// j >= n.
using AccumulateFn = void (*)(const float* p, int rows, float* const* acc, const float* correction,
                              const void* v, int64_t n, int64_t d, const char* next_v);

// The AVX2 kernels (with FMA), for CPUs without AVX-512, over a FLOAT32 or
// (bfloat16) a BFLOAT16 cache: float32 math either way (kFloat32 or
// kBFloat16; no bf16 products). Null where this build has none (not x86-64
// with GCC or Clang). accumulate: value dims that are a multiple of 16 only.
struct Avx2Kernels {
  ScoresFn scores;
  AccumulateFn accumulate;
};
Avx2Kernels Avx2KernelsFor(bool bfloat16);
// Whether this CPU runs them (AVX2 and FMA).
bool Avx2Usable();
// y = exp(x) for 8 floats at x and y, as their softmax step computes it
// (`fast`: precision FAST's). Only where Avx2Usable().
void Avx2ExpForTesting(bool fast, const float* x, float* y);

}  // namespace attention::internal::decode

#endif  // ATTENTION_ENGINE_DECODE_KERNELS_H_
