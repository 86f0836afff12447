#include "engine/kv_cache.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#ifdef __SSE__
#include <xmmintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "common/half.h"

namespace attention {
namespace {

constexpr int64_t kMaxDim = int64_t{1} << 20;

// out[c * out_stride + r] = x[r * x_stride + c] for r < rows, c < cols:
// FLOAT32 keys into a block (rows: the rows, out_stride: kBlockRows) and
// back out (rows: the elements). Four by four in registers where SSE is
// there; `x` is read in order (a walk down rows a power of two apart would
// use a few cache sets only).
void Transpose(const float* x, int64_t x_stride, int64_t rows, int64_t cols, float* out,
               int64_t out_stride) {
  int64_t r = 0;
#ifdef __SSE__
  for (; r + 4 <= rows; r += 4) {
    const float* in = x + r * x_stride;
    int64_t c = 0;
    for (; c + 4 <= cols; c += 4) {
      __m128 a = _mm_loadu_ps(in + c), b = _mm_loadu_ps(in + x_stride + c),
             d = _mm_loadu_ps(in + 2 * x_stride + c), e = _mm_loadu_ps(in + 3 * x_stride + c);
      _MM_TRANSPOSE4_PS(a, b, d, e);
      _mm_storeu_ps(out + c * out_stride + r, a);
      _mm_storeu_ps(out + (c + 1) * out_stride + r, b);
      _mm_storeu_ps(out + (c + 2) * out_stride + r, d);
      _mm_storeu_ps(out + (c + 3) * out_stride + r, e);
    }
    for (; c < cols; ++c) {
      for (int64_t t = 0; t < 4; ++t) out[c * out_stride + r + t] = in[t * x_stride + c];
    }
  }
#endif
  for (; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[c * out_stride + r] = x[r * x_stride + c];
  }
}

}  // namespace

void KvCache::FreeBlock::operator()(void* p) const { FreeSessionBlock(p); }

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(int64_t kv_heads, int64_t key_dim,
                                                         int64_t value_dim, DType dtype) {
  for (auto [name, dim] : {std::pair<const char*, int64_t>{"kv_heads", kv_heads},
                           {"key_dim", key_dim},
                           {"value_dim", value_dim}}) {
    if (dim < 1 || dim > kMaxDim) {
      return absl::InvalidArgumentError(
          absl::StrCat("session cache: ", name, " ", dim, " must be in [1, ", kMaxDim, "]"));
    }
  }
  if (kv_heads * (key_dim + value_dim) > kMaxDim * 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("session cache: ", kv_heads, " heads of ", key_dim, " + ", value_dim,
                     " elements per row exceed ", kMaxDim * 4, " elements per row"));
  }
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat("session.cache_dtype: ", DTypeName(dtype),
                                                   " is not a cache dtype (FLOAT32, BFLOAT16)"));
  }
  return std::unique_ptr<KvCache>(new KvCache(kv_heads, key_dim, value_dim, dtype));
}

KvCache::KvCache(int64_t kv_heads, int64_t key_dim, int64_t value_dim, DType dtype)
    : kv_heads_(kv_heads), key_dim_(key_dim), value_dim_(value_dim), dtype_(dtype) {}

KvCache::~KvCache() = default;

int64_t KvCache::block_bytes() const {
  return kv_heads_ * HeadStride() * static_cast<int64_t>(ElementSize());
}

int64_t KvCache::BytesFor(int64_t rows) const {
  return (rows + kBlockRows - 1) / kBlockRows * block_bytes();
}

int64_t KvCache::bytes() const { return blocks() * block_bytes(); }

const void* KvCache::KeyBlock(int64_t block, int64_t head) const {
  return static_cast<const char*>(blocks_[block].get()) +
         head * HeadStride() * static_cast<int64_t>(ElementSize());
}

const void* KvCache::ValueBlock(int64_t block, int64_t head) const {
  return static_cast<const char*>(KeyBlock(block, head)) +
         kBlockRows * StoredKeyDim() * static_cast<int64_t>(ElementSize());
}

absl::Status KvCache::Append(int64_t rows, const float* k, int64_t k_row_stride,
                             int64_t k_head_stride, const float* v, int64_t v_row_stride,
                             int64_t v_head_stride, int threads) {
  if (rows <= 0) return absl::OkStatus();
  const int64_t first = length_ + pending_;
  const int64_t end = first + rows;
  // Every block the rows need, before any row is written.
  const size_t had = blocks_.size();
  const size_t size = static_cast<size_t>(block_bytes());
  while (blocks() * kBlockRows < end) {
    void* p = AllocateSessionBlock(size);
    if (p == nullptr) {
      blocks_.resize(had);
      return absl::ResourceExhaustedError(
          absl::StrCat("session cache: could not allocate a block of ", block_bytes(), " bytes"));
    }
    // Kernels read whole blocks: zeros past the last row, and in a BFLOAT16
    // key row's pad element. A block these rows fill needs neither.
    const int64_t block_first = blocks() * kBlockRows;
    if (block_first + kBlockRows > end || StoredKeyDim() != key_dim_) std::memset(p, 0, size);
    blocks_.emplace_back(p);
  }
  // A part is one head's rows in one block, in order of head: two threads
  // each writing half the heads of a 1024-row prefill took 0.31 ms where
  // each writing half the blocks took 0.40 (2026-11-28).
  const int64_t stored_pairs = StoredKeyDim() / 2;
  const int64_t first_block = first / kBlockRows;
  const int64_t written_blocks = blocks() - first_block;
  const int64_t parts = written_blocks * kv_heads_;
  const auto write_part = [&](int64_t part) {
    const int64_t h = part / written_blocks;
    const int64_t block = first_block + part % written_blocks;
    const int64_t r = std::max(first, block * kBlockRows) - first;  // the call's row
    const int64_t j0 = (first + r) % kBlockRows;
    const int64_t n = std::min(kBlockRows - j0, rows - r);
    const float* key = k + r * k_row_stride + h * k_head_stride;
    const float* value = v + r * v_row_stride + h * v_head_stride;
    // A BFLOAT16 key row as rounded (on the stack for the usual dims).
    uint16_t own[512];
    std::vector<uint16_t> large;
    if (dtype_ == DType::kBFloat16 && StoredKeyDim() > 512) {
      large.resize(static_cast<size_t>(StoredKeyDim()));
    }
    uint16_t* const rounded = large.empty() ? own : large.data();
    void* kb = const_cast<void*>(KeyBlock(block, h));
    void* vb = const_cast<void*>(ValueBlock(block, h));
    if (dtype_ == DType::kFloat32) {
      Transpose(key, k_row_stride, n, key_dim_, static_cast<float*>(kb) + j0, kBlockRows);
      float* vf = static_cast<float*>(vb) + j0 * value_dim_;
      for (int64_t j = 0; j < n; ++j) {
        std::memcpy(vf + j * value_dim_, value + j * v_row_stride,
                    static_cast<size_t>(value_dim_) * sizeof(float));
      }
    } else {
      // Each row rounded in one contiguous pass (it vectorises), then
      // placed: a key pair is one 32-bit word, the even element low.
      uint32_t* kw = static_cast<uint32_t*>(kb) + j0;
      uint16_t* const vh = static_cast<uint16_t*>(vb);
      for (int64_t j = 0; j < n; ++j) {
        const float* x = key + j * k_row_stride;
        for (int64_t e = 0; e < key_dim_; ++e) rounded[e] = FloatToBFloat16(x[e]);
        if (key_dim_ % 2 != 0) rounded[key_dim_] = 0;  // the pad element
        for (int64_t i = 0; i < stored_pairs; ++i) {
          kw[i * kBlockRows + j] = rounded[2 * i] | uint32_t{rounded[2 * i + 1]} << 16;
        }
      }
      // Values: a pair of rows is a row of words, the even row low.
      const auto value_half = [&](int64_t j) {
        const int64_t row = j0 + j;
        uint16_t* out = vh + (row / 2) * 2 * value_dim_ + row % 2;
        const float* x = value + j * v_row_stride;
        for (int64_t e = 0; e < value_dim_; ++e) out[2 * e] = FloatToBFloat16(x[e]);
      };
      int64_t j = 0;
      if (j0 % 2 != 0) value_half(j++);
      for (; j + 1 < n; j += 2) {
        uint32_t* out = static_cast<uint32_t*>(vb) + (j0 + j) / 2 * value_dim_;
        const float* x0 = value + j * v_row_stride;
        const float* x1 = x0 + v_row_stride;
        for (int64_t e = 0; e < value_dim_; ++e) {
          out[e] = FloatToBFloat16(x0[e]) | uint32_t{FloatToBFloat16(x1[e])} << 16;
        }
      }
      if (j < n) value_half(j);
    }
  };
  // A prefill's parts spread over the threads; a step's few rows are not
  // worth waking them. (Unused in the fuzz build, whose Clang compiles the
  // loop serially: CMakeLists.txt.)
  [[maybe_unused]] const bool parallel =
      threads > 1 && parts > 1 && rows * kv_heads_ * (key_dim_ + value_dim_) >= (1 << 16);
#pragma omp parallel for num_threads(parallel ? threads : 1) schedule(static) if (parallel)
  for (int64_t part = 0; part < parts; ++part) write_part(part);
  pending_ += rows;
  return absl::OkStatus();
}

void KvCache::Commit() {
  length_ += pending_;
  pending_ = 0;
}

void KvCache::Rollback() {
  const int64_t end = length_ + pending_;
  pending_ = 0;
  blocks_.resize(static_cast<size_t>((length_ + kBlockRows - 1) / kBlockRows));
  // The dropped rows of the block kept: zeros again, as kernels expect.
  if (length_ % kBlockRows != 0) {
    ZeroRows(length_ % kBlockRows, std::min(end - (length_ / kBlockRows) * kBlockRows, kBlockRows));
  }
}

void KvCache::ZeroRows(int64_t from, int64_t to) {
  const int64_t block = blocks() - 1;
  // Stores of the element's type: a memset call per element took 20 us to
  // roll back one row of 16 H8 D64 sessions, these 6 (2026-11-25).
  const auto zero = [&](auto element) {
    using T = decltype(element);
    for (int64_t h = 0; h < kv_heads_; ++h) {
      T* kb = static_cast<T*>(const_cast<void*>(KeyBlock(block, h)));
      T* vb = static_cast<T*>(const_cast<void*>(ValueBlock(block, h)));
      for (int64_t j = from; j < to; ++j) {
        for (int64_t e = 0; e < key_dim_; ++e) kb[KeyIndex(j, e)] = T{0};
        for (int64_t e = 0; e < value_dim_; ++e) vb[ValueIndex(j, e)] = T{0};
      }
    }
  };
  if (dtype_ == DType::kFloat32) {
    zero(float{});
  } else {
    zero(uint16_t{});
  }
}

void KvCache::ReadRows(int64_t head, int64_t first, int64_t n, float* keys, float* values) const {
  for (int64_t i = 0; i < n;) {
    const int64_t block = (first + i) / kBlockRows;
    const int64_t j0 = (first + i) % kBlockRows;
    const int64_t m = std::min(kBlockRows - j0, n - i);
    float* ko = keys + i * key_dim_;
    float* vo = values + i * value_dim_;
    if (dtype_ == DType::kFloat32) {
      const float* kb = static_cast<const float*>(KeyBlock(block, head)) + j0;
      Transpose(kb, kBlockRows, key_dim_, m, ko, key_dim_);
      std::memcpy(vo, static_cast<const float*>(ValueBlock(block, head)) + j0 * value_dim_,
                  static_cast<size_t>(m * value_dim_) * sizeof(float));
    } else {
      const uint32_t* kw = static_cast<const uint32_t*>(KeyBlock(block, head)) + j0;
      for (int64_t j = 0; j < m; ++j) {
        for (int64_t e = 0; e < key_dim_; ++e) {
          ko[j * key_dim_ + e] = BFloat16ToFloat(
              static_cast<uint16_t>(kw[(e / 2) * kBlockRows + j] >> (16 * (e % 2))));
        }
      }
      const uint16_t* vb = static_cast<const uint16_t*>(ValueBlock(block, head));
      for (int64_t j = 0; j < m; ++j) {
        const int64_t row = j0 + j;
        const uint16_t* in = vb + (row / 2) * 2 * value_dim_ + row % 2;
        float* out = vo + j * value_dim_;
        for (int64_t e = 0; e < value_dim_; ++e) out[e] = BFloat16ToFloat(in[2 * e]);
      }
    }
    i += m;
  }
}

}  // namespace attention
