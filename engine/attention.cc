#include "engine/attention.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <new>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/half.h"
#include "common/shape_string.h"
#include "common/status_macros.h"
#include "engine/internal.h"

namespace attention {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kBool:
      return 1;
    case DType::kInt64:
      return 8;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "FLOAT32";
    case DType::kBFloat16:
      return "BFLOAT16";
    case DType::kFloat16:
      return "FLOAT16";
    case DType::kBool:
      return "BOOL";
    case DType::kInt32:
      return "INT32";
    case DType::kInt64:
      return "INT64";
  }
  return "UNKNOWN";
}

namespace {

constexpr int64_t kNever = std::numeric_limits<int64_t>::max();

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Blocks of at least `min_pooled` bytes, kept by size when freed (up to
// `cap` bytes in all), each with when it was freed. Memory comes from
// malloc (so tests that replace malloc see every block), 64 to 127 bytes
// more than asked: what is handed out starts at the first 64-byte boundary
// at least 64 bytes in, and the 16 bytes before it hold the block's size
// and where malloc's memory starts.
class MemoryPool {
 public:
  // exact: reuse only blocks of the size asked for; otherwise any that
  // wastes at most half of itself.
  MemoryPool(size_t min_pooled, size_t cap, bool exact)
      : min_pooled_(min_pooled), cap_(cap), exact_(exact) {}

  void* Allocate(size_t bytes) {
    ReleaseIdleBlocks();
    if (bytes >= min_pooled_) {
      absl::MutexLock lock(&mu_);
      // The smallest free block that fits, if it wastes at most half of itself.
      auto it = free_blocks_.lower_bound(bytes);
      if (it != free_blocks_.end() && it->first <= (exact_ ? bytes : 2 * bytes)) {
        // Of that size, the block freed last: the others can then go unused
        // long enough to be freed, rather than all taking turns for good.
        it = std::prev(free_blocks_.upper_bound(it->first));
        void* user = it->second.user;  // its header still holds its real size
        free_bytes_ -= it->first;
        free_blocks_.erase(it);
        return user;
      }
    }
    void* p = std::malloc(bytes + 128);
    if (p == nullptr) return nullptr;
    const uintptr_t user = (reinterpret_cast<uintptr_t>(p) + 64 + 63) / 64 * 64;
    reinterpret_cast<void**>(user)[-2] = p;
    reinterpret_cast<size_t*>(user)[-1] = bytes;
    return reinterpret_cast<void*>(user);
  }

  void Free(void* user) {
    if (user == nullptr) return;
    const size_t size = static_cast<size_t*>(user)[-1];
    if (size >= min_pooled_) {
      absl::MutexLock lock(&mu_);
      if (free_bytes_ + size <= cap_) {
        const int64_t now = NowNs();
        free_blocks_.emplace(size, Block{user, now});
        free_bytes_ += size;
        if (now < oldest_freed_ns_.load(std::memory_order_relaxed)) {
          oldest_freed_ns_.store(now, std::memory_order_relaxed);
        }
        return;
      }
    }
    std::free(static_cast<void**>(user)[-2]);
  }

  size_t pooled_bytes() {
    absl::MutexLock lock(&mu_);
    return free_bytes_;
  }

  int64_t SetIdleLimit(int64_t ns) {
    return idle_limit_ns_.exchange(ns, std::memory_order_relaxed);
  }

 private:
  struct Block {
    void* user;
    int64_t freed_ns;
  };

  // Frees the blocks pooled for longer than the idle limit.
  void ReleaseIdleBlocks() {
    const int64_t now = NowNs();
    const int64_t limit = idle_limit_ns_.load(std::memory_order_relaxed);
    const int64_t oldest = oldest_freed_ns_.load(std::memory_order_relaxed);
    if (oldest == kNever || now - oldest < limit) return;
    std::vector<void*> stale;
    {
      absl::MutexLock lock(&mu_);
      int64_t still_oldest = kNever;
      for (auto it = free_blocks_.begin(); it != free_blocks_.end();) {
        if (now - it->second.freed_ns >= limit) {
          stale.push_back(static_cast<void**>(it->second.user)[-2]);
          free_bytes_ -= it->first;
          it = free_blocks_.erase(it);
        } else {
          still_oldest = std::min(still_oldest, it->second.freed_ns);
          ++it;
        }
      }
      oldest_freed_ns_.store(still_oldest, std::memory_order_relaxed);
    }
    for (void* p : stale) std::free(p);
  }

  const size_t min_pooled_, cap_;
  const bool exact_;
  absl::Mutex mu_;
  std::multimap<size_t, Block> free_blocks_ ABSL_GUARDED_BY(mu_);
  size_t free_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<int64_t> idle_limit_ns_{int64_t{10} * 1000 * 1000 * 1000};
  // No pooled block was freed before this (kNever: none is pooled), so most
  // allocations see that nothing is stale without taking the lock.
  std::atomic<int64_t> oldest_freed_ns_{kNever};
};

MemoryPool& OutputPool() {
  static MemoryPool* pool = new MemoryPool(size_t{1} << 20, size_t{512} << 20, /*exact=*/false);
  return *pool;
}

MemoryPool& SessionBlockPool() {
  // Exact sizes: a session counts its blocks' sizes against
  // --session_memory_mb, and a larger block reused for a smaller one would
  // hold up to twice what it counts, for as long as the session lives.
  static MemoryPool* pool = new MemoryPool(0, size_t{256} << 20, /*exact=*/true);
  return *pool;
}

}  // namespace

void* AllocateOutputMemory(size_t bytes) {
  void* p = OutputPool().Allocate(bytes);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

void FreeOutputMemory(void* user, size_t /*bytes*/) { OutputPool().Free(user); }

size_t PooledOutputBytes() { return OutputPool().pooled_bytes(); }

std::chrono::nanoseconds SetOutputPoolIdleLimit(std::chrono::nanoseconds limit) {
  const int64_t previous = OutputPool().SetIdleLimit(limit.count());
  SessionBlockPool().SetIdleLimit(limit.count());
  return std::chrono::nanoseconds(previous);
}

void* AllocateSessionBlock(size_t bytes) { return SessionBlockPool().Allocate(bytes); }

void FreeSessionBlock(void* p) { SessionBlockPool().Free(p); }

size_t PooledSessionBlockBytes() { return SessionBlockPool().pooled_bytes(); }

namespace internal {

bool IsFloat(DType d) {
  return d == DType::kFloat32 || d == DType::kBFloat16 || d == DType::kFloat16;
}

std::vector<int64_t> OutputShape(const AttentionArgs& args, const AttentionShape& s) {
  const int64_t B = s.batch, H = s.heads, L = s.query_len, Dv = s.value_dim;
  if (s.rank4) return {B, H, L, Dv};
  if (args.layout == Layout::kBatchFirst) return {B, L, H * Dv};
  return {L, B, H * Dv};
}

std::vector<int64_t> WeightsShape(const AttentionArgs& args, const AttentionShape& s) {
  if (args.average_weights) return {s.batch, s.query_len, s.key_len};
  return {s.batch, s.heads, s.query_len, s.key_len};
}

absl::StatusOr<int64_t> CheckedElementCount(const std::vector<int64_t>& shape,
                                            const std::string& field) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": shape ", ShapeString(shape), " has too many elements"));
    }
  }
  return n;
}

namespace {

template <typename T>
T LoadAt(const TensorView& v, size_t i) {
  T x;
  std::memcpy(&x, static_cast<const char*>(v.data) + i * sizeof(T), sizeof(T));
  return x;
}

size_t ElementsOf(const TensorView& v) { return v.size_bytes / DTypeSize(v.dtype); }

}  // namespace

std::vector<float> LoadFloats(const TensorView& view) {
  size_t n = ElementsOf(view);
  std::vector<float> out(n);
  switch (view.dtype) {
    case DType::kFloat32:
      if (n) std::memcpy(out.data(), view.data, n * sizeof(float));
      break;
    case DType::kBFloat16:
      for (size_t i = 0; i < n; ++i) out[i] = BFloat16ToFloat(LoadAt<uint16_t>(view, i));
      break;
    case DType::kFloat16:
      for (size_t i = 0; i < n; ++i) out[i] = Float16ToFloat(LoadAt<uint16_t>(view, i));
      break;
    default:
      out.clear();
  }
  return out;
}

std::vector<int64_t> LoadInts(const TensorView& view) {
  size_t n = ElementsOf(view);
  std::vector<int64_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = view.dtype == DType::kInt32 ? LoadAt<int32_t>(view, i) : LoadAt<int64_t>(view, i);
  }
  return out;
}

std::vector<uint8_t> LoadBools(const TensorView& view) {
  const auto* p = static_cast<const uint8_t*>(view.data);
  return std::vector<uint8_t>(p, p + view.size_bytes);
}

HeadIndexer MakeHeadIndexer(const TensorView& view, Layout layout, bool rank4, int64_t heads,
                            int64_t head_dim) {
  const auto& s = view.shape;
  HeadIndexer ix;
  if (rank4) {  // [B, H, P, D]
    ix.pos_stride = head_dim;
    ix.head_stride = s[2] * head_dim;
    ix.batch_stride = s[0] == 1 ? 0 : heads * s[2] * head_dim;
  } else if (layout == Layout::kBatchFirst) {  // [B, P, E]
    ix.head_stride = head_dim;
    ix.pos_stride = s[2];
    ix.batch_stride = s[0] == 1 ? 0 : s[1] * s[2];
  } else {  // [P, B, E]
    ix.head_stride = head_dim;
    ix.pos_stride = s[1] * s[2];
    ix.batch_stride = s[1] == 1 ? 0 : s[2];
  }
  return ix;
}

double DropoutUniform(uint64_t seed, uint64_t index) {
  // splitmix64 over the pair; 53 random bits.
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + index + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

double EffectiveScale(const ScoreSpec& score, int64_t query_dim) {
  if (score.scale) return *score.scale;
  if (score.kind == ScoreKind::kScaledDot) return 1.0 / std::sqrt(static_cast<double>(query_dim));
  return 1.0;
}

// Checks dtype, rank, dims >= 1, overflow and byte count of a present view.
absl::Status CheckView(const TensorView& v, const std::string& field, Allowed allowed,
                       std::initializer_list<size_t> ranks) {
  bool dtype_ok =
      allowed == Allowed::kInteger
          ? (v.dtype == DType::kInt32 || v.dtype == DType::kInt64)
          : IsFloat(v.dtype) || (allowed == Allowed::kFloatOrBool && v.dtype == DType::kBool);
  if (!dtype_ok) {
    const char* want = allowed == Allowed::kFloat         ? "FLOAT32, BFLOAT16 or FLOAT16"
                       : allowed == Allowed::kFloatOrBool ? "BOOL, FLOAT32, BFLOAT16 or FLOAT16"
                                                          : "INT32 or INT64";
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": dtype ", DTypeName(v.dtype), " is not allowed; want ", want));
  }
  bool rank_ok = false;
  std::string rank_list;
  for (size_t r : ranks) {
    rank_ok |= v.shape.size() == r;
    absl::StrAppend(&rank_list, rank_list.empty() ? "" : " or ", r);
  }
  if (!rank_ok) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": shape ", ShapeString(v.shape),
                                                   " has rank ", v.shape.size(), "; want rank ",
                                                   rank_list));
  }
  for (size_t i = 0; i < v.shape.size(); ++i) {
    if (v.shape[i] < 1) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": shape ", ShapeString(v.shape),
                                                     " has dim ", i, " = ", v.shape[i],
                                                     "; every dim must be >= 1"));
    }
  }
  ATTN_ASSIGN_OR_RETURN(int64_t n, internal::CheckedElementCount(v.shape, field));
  int64_t bytes;
  if (__builtin_mul_overflow(n, static_cast<int64_t>(DTypeSize(v.dtype)), &bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": shape ", ShapeString(v.shape), " has too many elements"));
  }
  if (v.data == nullptr || static_cast<uint64_t>(bytes) != v.size_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": data has ", v.data ? v.size_bytes : 0,
                                                   " bytes; shape ", ShapeString(v.shape), " of ",
                                                   DTypeName(v.dtype), " needs ", bytes));
  }
  if (v.dtype == DType::kBool) {
    const auto* p = static_cast<const uint8_t*>(v.data);
    for (size_t i = 0; i < v.size_bytes; ++i) {
      if (p[i] > 1) {
        return absl::InvalidArgumentError(absl::StrCat(field, ": BOOL element ", i, " is ",
                                                       static_cast<int>(p[i]), "; want 0 or 1"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace internal

namespace {

using internal::Allowed;
using internal::CheckView;

const char* ScoreName(ScoreKind kind) {
  switch (kind) {
    case ScoreKind::kScaledDot:
      return "SCALED_DOT";
    case ScoreKind::kDot:
      return "DOT";
    case ScoreKind::kAdditive:
      return "ADDITIVE";
    case ScoreKind::kBilinear:
      return "BILINEAR";
    case ScoreKind::kCosine:
      return "COSINE";
    case ScoreKind::kNegEuclidean:
      return "NEG_EUCLIDEAN";
    case ScoreKind::kGaussian:
      return "GAUSSIAN";
  }
  return "UNKNOWN";
}

// `got` must equal `want`, or be 1 when `broadcast` allows it.
absl::Status CheckDim(const std::string& field, const TensorView& v, size_t dim, const char* what,
                      int64_t want, bool broadcast) {
  int64_t got = v.shape[dim];
  if (got == want || (broadcast && got == 1)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": shape ", ShapeString(v.shape), " dim ",
                                                 dim, " is ", got, "; want ", what, " = ", want,
                                                 broadcast ? " (or 1 to broadcast)" : ""));
}

absl::Status CheckFinite(const std::string& field, double x) {
  if (std::isfinite(x)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", x, " is not a finite number"));
}

absl::Status CheckScore(const ScoreSpec& s, const AttentionShape& shape) {
  if (s.scale) ATTN_RETURN_IF_ERROR(CheckFinite("score.scale", *s.scale));
  const bool additive = s.kind == ScoreKind::kAdditive;
  const bool bilinear = s.kind == ScoreKind::kBilinear;
  const bool gaussian = s.kind == ScoreKind::kGaussian;
  struct Param {
    const char* field;
    const TensorView& view;
    bool used;
  } params[] = {{"score.w_q", s.w_q, additive},
                {"score.w_k", s.w_k, additive},
                {"score.w_v", s.w_v, additive},
                {"score.w", s.w, bilinear}};
  for (const auto& p : params) {
    if (p.view.present() && !p.used) {
      return absl::InvalidArgumentError(
          absl::StrCat(p.field, ": is not used by score ", ScoreName(s.kind), "; leave it unset"));
    }
    if (!p.view.present() && p.used) {
      return absl::InvalidArgumentError(
          absl::StrCat(p.field, ": is required by score ", ScoreName(s.kind)));
    }
  }
  if (s.bandwidth && !gaussian) {
    return absl::InvalidArgumentError(absl::StrCat("score.bandwidth: is not used by score ",
                                                   ScoreName(s.kind), "; leave it unset"));
  }
  if (s.bandwidth) ATTN_RETURN_IF_ERROR(CheckFinite("score.bandwidth", *s.bandwidth));

  const bool compares_directly = !additive && !bilinear;
  if (compares_directly && shape.query_dim != shape.key_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key: head dim ", shape.key_dim, " does not match query's head dim ", shape.query_dim,
        " (score ", ScoreName(s.kind), " compares q and k directly)"));
  }
  if (additive) {
    ATTN_RETURN_IF_ERROR(CheckView(s.w_q, "score.w_q", Allowed::kFloat, {2}));
    ATTN_RETURN_IF_ERROR(CheckView(s.w_k, "score.w_k", Allowed::kFloat, {2}));
    ATTN_RETURN_IF_ERROR(CheckView(s.w_v, "score.w_v", Allowed::kFloat, {1}));
    const int64_t hidden = s.w_q.shape[0];
    ATTN_RETURN_IF_ERROR(CheckDim("score.w_q", s.w_q, 1, "query head dim", shape.query_dim, false));
    ATTN_RETURN_IF_ERROR(CheckDim("score.w_k", s.w_k, 0, "score.w_q's hidden size", hidden, false));
    ATTN_RETURN_IF_ERROR(CheckDim("score.w_k", s.w_k, 1, "key head dim", shape.key_dim, false));
    ATTN_RETURN_IF_ERROR(CheckDim("score.w_v", s.w_v, 0, "score.w_q's hidden size", hidden, false));
  }
  if (bilinear) {
    ATTN_RETURN_IF_ERROR(CheckView(s.w, "score.w", Allowed::kFloat, {2}));
    ATTN_RETURN_IF_ERROR(CheckDim("score.w", s.w, 0, "query head dim", shape.query_dim, false));
    ATTN_RETURN_IF_ERROR(CheckDim("score.w", s.w, 1, "key head dim", shape.key_dim, false));
  }
  return absl::OkStatus();
}

absl::Status CheckMasks(const MaskSpec& m, const AttentionShape& shape) {
  const int64_t B = shape.batch, H = shape.heads, L = shape.query_len;
  const int64_t S = shape.key_len - m.unmasked_tail;
  if (m.unmasked_tail < 0 || S < 0) {
    return absl::InvalidArgumentError(absl::StrCat("mask: unmasked_tail ", m.unmasked_tail,
                                                   " is outside [0, S = ", shape.key_len, "]"));
  }
  if (m.valid_lens.present()) {
    const std::string f = "mask.valid_lens";
    ATTN_RETURN_IF_ERROR(CheckView(m.valid_lens, f, Allowed::kInteger, {1, 2}));
    ATTN_RETURN_IF_ERROR(CheckDim(f, m.valid_lens, 0, "batch size B", B, true));
    if (m.valid_lens.shape.size() == 2) {
      ATTN_RETURN_IF_ERROR(CheckDim(f, m.valid_lens, 1, "query length L", L, false));
    }
    std::vector<int64_t> lens = internal::LoadInts(m.valid_lens);
    for (size_t i = 0; i < lens.size(); ++i) {
      if (lens[i] < 0 || lens[i] > S) {
        return absl::InvalidArgumentError(absl::StrCat(f, ": element ", i, " is ", lens[i],
                                                       "; want 0 <= len <= key length S = ", S));
      }
    }
  }
  if (m.key_padding_mask.present()) {
    const std::string f = "mask.key_padding_mask";
    ATTN_RETURN_IF_ERROR(CheckView(m.key_padding_mask, f, Allowed::kFloatOrBool, {2}));
    ATTN_RETURN_IF_ERROR(CheckDim(f, m.key_padding_mask, 0, "batch size B", B, true));
    ATTN_RETURN_IF_ERROR(CheckDim(f, m.key_padding_mask, 1, "key length S", S, false));
  }
  if (m.attn_mask.present()) {
    const std::string f = "mask.attn_mask";
    const TensorView& a = m.attn_mask;
    ATTN_RETURN_IF_ERROR(CheckView(a, f, Allowed::kFloatOrBool, {2, 3, 4}));
    const size_t r = a.shape.size();
    if (r >= 3) ATTN_RETURN_IF_ERROR(CheckDim(f, a, 0, "batch size B", B, true));
    if (r == 4) ATTN_RETURN_IF_ERROR(CheckDim(f, a, 1, "heads H", H, true));
    ATTN_RETURN_IF_ERROR(CheckDim(f, a, r - 2, "query length L", L, true));
    ATTN_RETURN_IF_ERROR(CheckDim(f, a, r - 1, "key length S", S, true));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<AttentionShape> ResolveShape(const AttentionArgs& args) {
  if (!args.query.present()) return absl::InvalidArgumentError("query: is required");
  ATTN_RETURN_IF_ERROR(CheckView(args.query, "query", Allowed::kFloat, {3, 4}));
  const TensorView& q = args.query;
  const bool rank4 = q.shape.size() == 4;
  const TensorView& k = args.key.present() ? args.key : q;
  const TensorView& v = args.value.present() ? args.value : k;
  const size_t want_rank = q.shape.size();
  if (args.key.present()) {
    ATTN_RETURN_IF_ERROR(CheckView(args.key, "key", Allowed::kFloat, {want_rank}));
  }
  if (args.value.present()) {
    ATTN_RETURN_IF_ERROR(CheckView(args.value, "value", Allowed::kFloat, {want_rank}));
  }
  if (args.num_heads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_heads: ", args.num_heads, " is negative; want >= 1 (0 means 1)"));
  }

  AttentionShape s;
  s.rank4 = rank4;
  int64_t bq, bk, bv, sv;
  if (rank4) {
    if (args.layout != Layout::kBatchFirst) {
      return absl::InvalidArgumentError(
          "layout: SEQUENCE_FIRST applies to rank-3 inputs only; rank-4 inputs are [B, H, L, D]");
    }
    bq = q.shape[0], bk = k.shape[0], bv = v.shape[0];
    s.heads = q.shape[1];
    s.kv_heads = k.shape[1];
    s.query_len = q.shape[2];
    s.key_len = k.shape[2];
    sv = v.shape[2];
    s.query_dim = q.shape[3];
    s.key_dim = k.shape[3];
    s.value_dim = v.shape[3];
    if (args.num_heads != 0 && args.num_heads != s.heads) {
      return absl::InvalidArgumentError(
          absl::StrCat("num_heads: ", args.num_heads, " does not match query's ", s.heads,
                       " heads (rank-4 inputs carry their heads; leave num_heads unset)"));
    }
    if (v.shape[1] != s.kv_heads) {
      return absl::InvalidArgumentError(
          absl::StrCat("value: ", v.shape[1], " heads do not match key's ", s.kv_heads));
    }
    if (s.heads % s.kv_heads != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("key: ", s.kv_heads, " heads do not divide query's ", s.heads,
                       " heads (grouped-query attention needs H to be a multiple of Hk)"));
    }
  } else {
    const bool bf = args.layout == Layout::kBatchFirst;
    const int b = bf ? 0 : 1, p = bf ? 1 : 0;
    bq = q.shape[b], bk = k.shape[b], bv = v.shape[b];
    s.query_len = q.shape[p];
    s.key_len = k.shape[p];
    sv = v.shape[p];
    s.heads = s.kv_heads = args.num_heads == 0 ? 1 : args.num_heads;
    struct Split {
      const char* field;
      int64_t dim;
      int64_t* per_head;
    } splits[] = {{"query", q.shape[2], &s.query_dim},
                  {"key", k.shape[2], &s.key_dim},
                  {"value", v.shape[2], &s.value_dim}};
    for (const auto& sp : splits) {
      if (sp.dim % s.heads != 0) {
        return absl::InvalidArgumentError(absl::StrCat("num_heads: ", s.heads, " does not divide ",
                                                       sp.field, "'s last dim ", sp.dim));
      }
      *sp.per_head = sp.dim / s.heads;
    }
  }
  if (sv != s.key_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "value: sequence length ", sv, " does not match key's sequence length ", s.key_len));
  }
  s.batch = std::max({bq, bk, bv});
  struct Batch {
    const char* field;
    int64_t b;
  } batches[] = {{"query", bq}, {"key", bk}, {"value", bv}};
  // The first tensor of the largest batch, to name against the others.
  const Batch& largest = *std::find_if(std::begin(batches), std::end(batches),
                                       [&](const Batch& bt) { return bt.b == s.batch; });
  for (const auto& bt : batches) {
    if (bt.b != s.batch && bt.b != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(bt.field, ": batch size ", bt.b, " does not match ", largest.field,
                       "'s batch size ", s.batch, " (a batch dim of 1 broadcasts)"));
    }
  }
  ATTN_RETURN_IF_ERROR(CheckScore(args.score, s));
  ATTN_RETURN_IF_ERROR(CheckMasks(args.mask, s));
  if (!std::isfinite(args.dropout_p) || args.dropout_p < 0 || args.dropout_p > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("dropout_p: ", args.dropout_p, " is outside [0, 1]"));
  }
  return s;
}

}  // namespace attention
