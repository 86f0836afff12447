#include "engine/kv_cache.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "common/half.h"

namespace attention {
namespace {

constexpr int64_t kMaxDim = int64_t{1} << 20;
constexpr size_t kBlockAlignment = 64;

}  // namespace

void KvCache::FreeBlock::operator()(void* p) const { std::free(p); }

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
         kBlockRows * key_dim_ * static_cast<int64_t>(ElementSize());
}

namespace {

// Stores n elements at dst, `stride` elements apart (keys are stored
// transposed, values row-major), and loads them back.
void Store(const float* src, int64_t n, DType dtype, void* dst, int64_t stride) {
  if (dtype == DType::kFloat32) {
    float* out = static_cast<float*>(dst);
    for (int64_t i = 0; i < n; ++i) out[i * stride] = src[i];
    return;
  }
  uint16_t* out = static_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i * stride] = FloatToBFloat16(src[i]);
}

void Load(const void* src, int64_t n, DType dtype, int64_t stride, float* dst) {
  if (dtype == DType::kFloat32) {
    const float* in = static_cast<const float*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = in[i * stride];
    return;
  }
  const uint16_t* in = static_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = BFloat16ToFloat(in[i * stride]);
}

}  // namespace

absl::Status KvCache::Append(int64_t rows, const float* k, int64_t k_row_stride,
                             int64_t k_head_stride, const float* v, int64_t v_row_stride,
                             int64_t v_head_stride) {
  const size_t es = ElementSize();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = length_ + pending_;
    const int64_t block = row / kBlockRows;
    if (block == blocks()) {
      const size_t size =
          (static_cast<size_t>(block_bytes()) + kBlockAlignment - 1) / kBlockAlignment * kBlockAlignment;
      void* p = std::aligned_alloc(kBlockAlignment, size);
      if (p == nullptr) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "session cache: could not allocate a block of ", block_bytes(), " bytes"));
      }
      // Zeros past the last row: kernels read whole blocks.
      std::memset(p, 0, size);
      blocks_.emplace_back(p);
    }
    const int64_t in_block = row % kBlockRows;
    for (int64_t h = 0; h < kv_heads_; ++h) {
      char* key = static_cast<char*>(const_cast<void*>(KeyBlock(block, h)));
      char* value = static_cast<char*>(const_cast<void*>(ValueBlock(block, h)));
      Store(k + r * k_row_stride + h * k_head_stride, key_dim_, dtype_,
            key + in_block * static_cast<int64_t>(es), kBlockRows);
      Store(v + r * v_row_stride + h * v_head_stride, value_dim_, dtype_,
            value + in_block * value_dim_ * static_cast<int64_t>(es), 1);
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
  pending_ = 0;
  blocks_.resize(static_cast<size_t>((length_ + kBlockRows - 1) / kBlockRows));
}

void KvCache::ReadKey(int64_t row, int64_t head, float* out) const {
  const char* block = static_cast<const char*>(KeyBlock(row / kBlockRows, head));
  Load(block + (row % kBlockRows) * static_cast<int64_t>(ElementSize()), key_dim_, dtype_,
       kBlockRows, out);
}

void KvCache::ReadValue(int64_t row, int64_t head, float* out) const {
  const char* block = static_cast<const char*>(ValueBlock(row / kBlockRows, head));
  Load(block + (row % kBlockRows) * value_dim_ * static_cast<int64_t>(ElementSize()), value_dim_,
       dtype_, 1, out);
}

}  // namespace attention
