#ifndef ATTENTION_ENGINE_GEMM_BASELINE_H_
#define ATTENTION_ENGINE_GEMM_BASELINE_H_

// oneDNN's own dense matmul, for benchmarks to measure the engine against
// the best the library does on this machine. Plain C++ only.

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace attention {

// C[n x n] = A[n x n] B[n x n], row-major, float32 C; A and B are float32 or
// bfloat16, filled once with seeded uniform values in [-1, 1). The primitive
// and its memory are built once by Create and reused by every Run.
// Not thread-safe: one caller at a time.
class GemmBaseline {
 public:
  static constexpr int64_t kMaxSize = 32768;

  // Builds the matmul and its operands. INVALID_ARGUMENT unless
  // 1 <= n <= kMaxSize; UNIMPLEMENTED when oneDNN has no such matmul on this
  // CPU; RESOURCE_EXHAUSTED when the operands cannot be allocated; INTERNAL
  // for any other oneDNN failure.
  static absl::StatusOr<std::unique_ptr<GemmBaseline>> Create(int64_t n, bool bf16);

  GemmBaseline(const GemmBaseline&) = delete;
  GemmBaseline& operator=(const GemmBaseline&) = delete;
  ~GemmBaseline();

  // Computes C once and returns when it is done. Runs on the calling thread,
  // fanning out over that thread's OpenMP threads (OMP_NUM_THREADS, else one
  // per core). INTERNAL when oneDNN fails, RESOURCE_EXHAUSTED when it runs out
  // of memory.
  absl::Status Run();

  int64_t n() const { return n_; }
  bool bf16() const { return bf16_; }
  // Floating-point operations of one Run: 2 n^3.
  double flops() const { return 2.0 * static_cast<double>(n_) * n_ * n_; }

 private:
  struct Impl;
  GemmBaseline(int64_t n, bool bf16, std::unique_ptr<Impl> impl);

  int64_t n_;
  bool bf16_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace attention

#endif  // ATTENTION_ENGINE_GEMM_BASELINE_H_
