#include "engine/kv_cache.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "common/half.h"

namespace attention {
namespace {

constexpr int64_t kMaxDim = int64_t{1} << 20;

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
                             int64_t v_head_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = length_ + pending_;
    const int64_t block = row / kBlockRows;
    if (block == blocks()) {
      const size_t size = static_cast<size_t>(block_bytes());
      void* p = AllocateSessionBlock(size);
      if (p == nullptr) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "session cache: could not allocate a block of ", block_bytes(), " bytes"));
      }
      // Zeros past the last row: kernels read whole blocks.
      std::memset(p, 0, size);
      blocks_.emplace_back(p);
    }
    const int64_t j = row % kBlockRows;
    for (int64_t h = 0; h < kv_heads_; ++h) {
      const float* key = k + r * k_row_stride + h * k_head_stride;
      const float* value = v + r * v_row_stride + h * v_head_stride;
      if (dtype_ == DType::kFloat32) {
        float* kb = static_cast<float*>(const_cast<void*>(KeyBlock(block, h))) + j;
        float* vb = static_cast<float*>(const_cast<void*>(ValueBlock(block, h))) + j * value_dim_;
        for (int64_t e = 0; e < key_dim_; ++e) kb[e * kBlockRows] = key[e];
        std::memcpy(vb, value, static_cast<size_t>(value_dim_) * sizeof(float));
      } else {
        uint16_t* kb = static_cast<uint16_t*>(const_cast<void*>(KeyBlock(block, h))) + 2 * j;
        uint16_t* vb = static_cast<uint16_t*>(const_cast<void*>(ValueBlock(block, h))) +
                       (j / 2) * 2 * value_dim_ + j % 2;
        for (int64_t e = 0; e < key_dim_; ++e) {
          kb[(e / 2) * 2 * kBlockRows + e % 2] = FloatToBFloat16(key[e]);
        }
        for (int64_t e = 0; e < value_dim_; ++e) vb[2 * e] = FloatToBFloat16(value[e]);
      }
    }
    ++pending_;
  }
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

void KvCache::ReadKey(int64_t row, int64_t head, float* out) const {
  const int64_t j = row % kBlockRows;
  const void* block = KeyBlock(row / kBlockRows, head);
  if (dtype_ == DType::kFloat32) {
    const float* in = static_cast<const float*>(block) + j;
    for (int64_t e = 0; e < key_dim_; ++e) out[e] = in[e * kBlockRows];
  } else {
    const uint16_t* in = static_cast<const uint16_t*>(block) + 2 * j;
    for (int64_t e = 0; e < key_dim_; ++e) {
      out[e] = BFloat16ToFloat(in[(e / 2) * 2 * kBlockRows + e % 2]);
    }
  }
}

void KvCache::ReadValue(int64_t row, int64_t head, float* out) const {
  const int64_t j = row % kBlockRows;
  const void* block = ValueBlock(row / kBlockRows, head);
  if (dtype_ == DType::kFloat32) {
    std::memcpy(out, static_cast<const float*>(block) + j * value_dim_,
                static_cast<size_t>(value_dim_) * sizeof(float));
  } else {
    const uint16_t* in = static_cast<const uint16_t*>(block) + (j / 2) * 2 * value_dim_ + j % 2;
    for (int64_t e = 0; e < value_dim_; ++e) out[e] = BFloat16ToFloat(in[2 * e]);
  }
}

}  // namespace attention
