#ifndef ATTENTION_ENGINE_KV_CACHE_H_
#define ATTENTION_ENGINE_KV_CACHE_H_

// The keys and values of one sequence, kept between engine calls (a server's
// session): paged storage, as vLLM's paged KV cache. Rows live in fixed
// blocks of kBlockRows rows; a block holds, for each key/value head, its
// kBlockRows keys and then its kBlockRows value rows, each head's part
// contiguous. Keys are stored transposed, so that a query's scores against a
// block are kBlockRows-wide multiply-adds with no horizontal sums; values
// row by row. Element e of the block's row j:
//   FLOAT32   key at e * kBlockRows + j, value at j * value_dim + e;
//   BFLOAT16  in pairs, each 32-bit word two elements that one bf16
//             multiply-add pair (vdpbf16ps) takes: keys pair elements
//             e = 2i, 2i + 1 of a row, key at (e / 2) * 2 * kBlockRows +
//             2 * j + e % 2 (key_dim rounded up to even, the pad element 0);
//             values pair rows j = 2i, 2i + 1, value at (j / 2) * 2 *
//             value_dim + 2 * e + j % 2. Widening either to float32 is then
//             a shift or a mask, with no shuffle.
// Appending writes only the new rows (into the last block, or a new one);
// nothing cached is ever copied or moved as the sequence grows.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "engine/attention.h"

namespace attention {

class KvCache {
 public:
  static constexpr int64_t kBlockRows = 64;

  // `kv_heads` heads of `key_dim` key and `value_dim` value elements per row,
  // stored as `dtype` (kFloat32 or kBFloat16; BFLOAT16 rounds to nearest
  // even). INVALID_ARGUMENT for dims below 1 or above 2^20, another dtype.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(int64_t kv_heads, int64_t key_dim,
                                                         int64_t value_dim, DType dtype);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  int64_t kv_heads() const { return kv_heads_; }
  int64_t key_dim() const { return key_dim_; }
  int64_t value_dim() const { return value_dim_; }
  DType dtype() const { return dtype_; }

  // Rows of the sequence (committed).
  int64_t length() const { return length_; }
  // Rows appended since the last Commit / Rollback.
  int64_t pending() const { return pending_; }
  // Bytes of the blocks held now.
  int64_t bytes() const;
  // Bytes the blocks for `rows` rows take (whole blocks).
  int64_t BytesFor(int64_t rows) const;
  int64_t block_bytes() const;

  // Appends `rows` rows after length() + pending(), pending until Commit.
  // Row r of head h: key at k + r * k_row_stride + h * k_head_stride
  // (key_dim floats), value likewise. Many rows are written on up to
  // `threads` OpenMP threads. RESOURCE_EXHAUSTED when a block cannot be
  // allocated (then nothing is appended).
  absl::Status Append(int64_t rows, const float* k, int64_t k_row_stride, int64_t k_head_stride,
                      const float* v, int64_t v_row_stride, int64_t v_head_stride, int threads = 1);
  // Makes the pending rows part of the sequence.
  void Commit();
  // Drops the pending rows, and the blocks only they used.
  void Rollback();

  // Rows [block * kBlockRows, ...) of head `head`, elements of dtype(), laid
  // out as above. Rows past length() + pending() are zeros. For kernels.
  const void* KeyBlock(int64_t block, int64_t head) const;
  const void* ValueBlock(int64_t block, int64_t head) const;
  int64_t blocks() const { return static_cast<int64_t>(blocks_.size()); }

  // Rows [first, first + n) (within length() + pending()) of head `head` as
  // float32, row by row: keys [n, key_dim], values [n, value_dim].
  void ReadRows(int64_t head, int64_t first, int64_t n, float* keys, float* values) const;

 private:
  KvCache(int64_t kv_heads, int64_t key_dim, int64_t value_dim, DType dtype);
  struct FreeBlock {
    void operator()(void* p) const;
  };
  size_t ElementSize() const { return dtype_ == DType::kBFloat16 ? 2 : 4; }
  // Key elements stored per row (BFLOAT16 pairs them: rounded up to even).
  int64_t StoredKeyDim() const {
    return dtype_ == DType::kBFloat16 ? (key_dim_ + 1) / 2 * 2 : key_dim_;
  }
  // Elements of one head's part of a block (keys then values).
  int64_t HeadStride() const { return kBlockRows * (StoredKeyDim() + value_dim_); }
  // Where element e of a block's row j is, in elements from its head's keys
  // or values.
  int64_t KeyIndex(int64_t j, int64_t e) const {
    return dtype_ == DType::kBFloat16 ? (e / 2) * 2 * kBlockRows + 2 * j + e % 2
                                      : e * kBlockRows + j;
  }
  int64_t ValueIndex(int64_t j, int64_t e) const {
    return dtype_ == DType::kBFloat16 ? (j / 2) * 2 * value_dim_ + 2 * e + j % 2
                                      : j * value_dim_ + e;
  }
  // Zeros rows [from, to) of the last block (`from` and `to` in it).
  void ZeroRows(int64_t from, int64_t to);

  const int64_t kv_heads_, key_dim_, value_dim_;
  const DType dtype_;
  int64_t length_ = 0;
  int64_t pending_ = 0;
  std::vector<std::unique_ptr<void, FreeBlock>> blocks_;
};

// The sessions of an engine call (EngineCall::session): batch row b appends
// its new rows to caches[b] and attends over all of that cache's rows.
//
// The call's key / value (absent: key = query, value = key) are the new
// rows, [B, S_new, Ek] / [B, Hk, S_new, D] as for raw attention; a layer's
// call appends their projections, per head (Hk = the layer's heads, D =
// embed_dim / heads), and its bias_k / bias_v and zero-attention keys come
// after every cached row. With read_only, key and value must be absent and
// nothing is appended. Every cache must have the call's key/value heads, key
// and value dims, and no pending rows.
//
// The result is that of the same call without sessions whose key and value
// are each row's cached rows (this call's included): for batch rows of
// different lengths, as if each row were its own call; weights are
// [B, H, L, S_max] with zeros past a shorter row's keys. Masks other than
// causal NONE / BOTTOM_RIGHT, and dropout, are INVALID_ARGUMENT.
//
// The call leaves its rows pending in every cache, whether it succeeds or
// not: its caller then commits them (KvCache::Commit) or drops them
// (Rollback), on every cache of the call.
struct SessionCall {
  std::vector<KvCache*> caches;
  bool read_only = false;
};

}  // namespace attention

#endif  // ATTENTION_ENGINE_KV_CACHE_H_
