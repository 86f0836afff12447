#ifndef ATTENTION_ENGINE_ATTENTION_H_
#define ATTENTION_ENGINE_ATTENTION_H_

// The engine's public types: plain C++ only (no gRPC, protobuf or oneDNN).
// Field names in error messages are the wire's (`query`, `mask.valid_lens`,
// `score.w_q`, ...), so a server can pass engine errors straight through.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace attention {

enum class DType { kFloat32, kBFloat16, kFloat16, kBool, kInt32, kInt64 };

// Bytes per element of `dtype`.
size_t DTypeSize(DType dtype);
// "FLOAT32", "BOOL", ... as on the wire.
const char* DTypeName(DType dtype);

// A borrowed, row-major, little-endian tensor. `data` must stay valid for the
// call it is passed to; `size_bytes` is how many bytes `data` holds, checked
// against shape x DTypeSize(dtype).
struct TensorView {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t size_bytes = 0;

  bool present() const { return data != nullptr || !shape.empty(); }
};

// Memory for engine outputs. Blocks of 1 MiB and more are kept, up to
// 512 MiB in all, when freed and handed out again to later calls of a similar
// size: a fresh 128 MiB block costs about 75 ms of page faults to touch, a
// reused one none. A block unused for 10 s (SetOutputPoolIdleLimit) is freed
// at the next allocation of any size, so a burst of large calls does not hold
// memory for good (a server with no calls at all keeps its pool). Thread-safe.
void* AllocateOutputMemory(size_t bytes);
void FreeOutputMemory(void* p, size_t bytes);
// Bytes of freed blocks the pool keeps for reuse now (this process's RSS
// includes them).
size_t PooledOutputBytes();
// How long a pooled block (of either pool) may go unused before it is freed;
// returns the previous limit. For tests.
std::chrono::nanoseconds SetOutputPoolIdleLimit(std::chrono::nanoseconds limit);

// Memory for session cache blocks (engine/kv_cache.h), 64-byte aligned; null
// when none can be had. Pooled likewise, up to 256 MiB, but reused only for
// blocks of the same size: a session's blocks, freed when it closes, serve
// the next sessions' of its shape without page faults.
// PooledSessionBlockBytes: what the pool keeps now (in the RSS).
void* AllocateSessionBlock(size_t bytes);
void FreeSessionBlock(void* p);
size_t PooledSessionBlockBytes();

// An allocator that leaves new elements of trivial types uninitialised: the
// engine writes every element of its outputs, from several threads, so
// zero-filling them first would only cost time (60 ms for 128 MiB here).
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
  T* allocate(size_t n) { return static_cast<T*>(AllocateOutputMemory(n * sizeof(T))); }
  void deallocate(T* p, size_t n) noexcept { FreeOutputMemory(p, n * sizeof(T)); }
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

using FloatBuffer = std::vector<float, DefaultInitAllocator<float>>;

// An owned float32 tensor.
struct Tensor {
  std::vector<int64_t> shape;
  FloatBuffer data;
};

enum class ScoreKind {
  kScaledDot,
  kDot,
  kAdditive,
  kBilinear,
  kCosine,
  kNegEuclidean,
  kGaussian,
};

enum class Causal { kNone, kTopLeft, kBottomRight };
enum class Layout { kBatchFirst, kSequenceFirst };

struct ScoreSpec {
  ScoreKind kind = ScoreKind::kScaledDot;
  std::optional<double> scale;
  TensorView w_q, w_k, w_v;  // kAdditive
  TensorView w;              // kBilinear
  std::optional<double> bandwidth;  // kGaussian; unset means 1
};

// Absent masks have no shape and no data (TensorView::present() is false).
struct MaskSpec {
  TensorView valid_lens;
  TensorView key_padding_mask;
  TensorView attn_mask;
  Causal causal = Causal::kNone;
  // The last `unmasked_tail` keys are never masked (the keys that
  // add_bias_kv / add_zero_attn append); masks are shaped for the S - unmasked_tail
  // keys before them.
  int64_t unmasked_tail = 0;
};

// One attention call; the semantics are those of docs/api.md, "Semantics".
struct AttentionArgs {
  TensorView query;
  TensorView key;    // absent: key = query
  TensorView value;  // absent: value = key
  Layout layout = Layout::kBatchFirst;
  int64_t num_heads = 0;  // rank-3 inputs; 0 means 1
  ScoreSpec score;
  MaskSpec mask;
  bool need_weights = false;
  bool average_weights = false;
  double dropout_p = 0.0;
  uint64_t seed = 0;
  // Precision FAST: bf16 matmuls with float32 accumulation on CPUs with
  // avx512_bf16 (BFLOAT16 inputs always run so); float32 math elsewhere.
  bool fast = false;
};

struct AttentionResult {
  Tensor output;   // [B, L, Ev] ([L, B, Ev] sequence-first) or [B, H, L, Dv]
  Tensor weights;  // [B, H, L, S] or [B, L, S]; empty unless need_weights
};

// The resolved sizes of one call, after broadcasting and head splitting.
struct AttentionShape {
  int64_t batch = 0;       // B
  int64_t heads = 0;       // H, query heads
  int64_t kv_heads = 0;    // Hk, divides H
  int64_t query_len = 0;   // L
  int64_t key_len = 0;     // S
  int64_t query_dim = 0;   // Dq, per head
  int64_t key_dim = 0;     // Dk, per head
  int64_t value_dim = 0;   // Dv, per head
  bool rank4 = false;
};

// Checks `args` (ranks, shapes, byte counts, dtypes, broadcasting, score
// parameters, mask shapes and values) and resolves its sizes.
// INVALID_ARGUMENT names the field and the numbers.
absl::StatusOr<AttentionShape> ResolveShape(const AttentionArgs& args);

}  // namespace attention

#endif  // ATTENTION_ENGINE_ATTENTION_H_
