#include "engine/decode.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "engine/kernels.h"

namespace attention::internal {
namespace {

constexpr int64_t kBlockRows = KvCache::kBlockRows;
// A thread's share of one item is at least this many cache blocks (256
// rows): less would spend more on merging partial results than it saves.
constexpr int64_t kMinChunkBlocks = 4;
// Below this many cached bytes read in all, a pass runs on one thread:
// waking a team costs more than streaming them.
constexpr double kParallelBytes = 256 * 1024;

// One thread's share: blocks [first_block, end_block) of an item's cache,
// plus its tail keys when `with_tail`. Its partial results, one per query
// row r: running max m, sum of exponentials l and the weighted sum of
// values acc, at partial + r * (value_dim + 2): [m, l, acc...].
struct Unit {
  const DecodeItem* item = nullptr;
  int64_t first_block = 0, end_block = 0;
  bool with_tail = false;
  float* partial = nullptr;
};

// Folds scores s[0, visible) of one query row (already scaled, overwritten
// with their exponentials) and the value rows they weigh into the row's
// running softmax [m, l, acc...].
template <typename ValueRows>
void Fold(float* s, int64_t visible, int64_t value_dim, float* row_partial, ValueRows values) {
  if (visible <= 0) return;
  float& m = row_partial[0];
  float& l = row_partial[1];
  float* acc = row_partial + 2;
  const float block_max = RowMax(s, visible);
  const float m_new = std::isnan(block_max) || block_max > m ? block_max : m;
  if (m_new == -std::numeric_limits<float>::infinity()) return;  // every score -inf so far
  const float correction = m == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m - m_new);
  const float sum = ExpShiftSum(s, visible, m_new);
  if (correction != 1.0f) Scale(acc, value_dim, correction);
  l = l * correction + sum;
  m = m_new;
  values(s, visible, acc);
}

void RunUnit(const Unit& u) {
  const DecodeItem& it = *u.item;
  const KvCache& cache = *it.cache;
  const int64_t dk = cache.key_dim(), dv = cache.value_dim();
  const int64_t rows = it.group * it.query_len;
  const bool bf16 = cache.dtype() == DType::kBFloat16;
  float scores[kBlockRows];
  for (int64_t r = 0; r < rows; ++r) {
    float* p = u.partial + r * (dv + 2);
    p[0] = -std::numeric_limits<float>::infinity();
    p[1] = 0.0f;
    std::memset(p + 2, 0, static_cast<size_t>(dv) * sizeof(float));
  }
  // Query rows in the inner loop: a block's keys and values are read from
  // memory once and from cache by the other heads of the group.
  for (int64_t block = u.first_block; block < u.end_block; ++block) {
    const int64_t first = block * kBlockRows;
    const int64_t n = std::min(kBlockRows, it.keys - first);
    const void* kb = cache.KeyBlock(block, it.kv_head);
    const void* vb = cache.ValueBlock(block, it.kv_head);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t g = r / it.query_len, i = r % it.query_len;
      const float* q = it.q + g * it.q_head_stride + i * it.q_pos_stride;
      int64_t visible = n;
      if (it.causal) visible = std::min(n, i + it.keys - it.query_len - first + 1);
      if (visible <= 0) continue;
      if (bf16) {
        DotRowsBFloat16(q, static_cast<const uint16_t*>(kb), visible, dk, it.scale, scores);
      } else {
        DotRows(q, static_cast<const float*>(kb), visible, dk, it.scale, scores);
      }
      Fold(scores, visible, dv, u.partial + r * (dv + 2), [&](const float* w, int64_t m, float* acc) {
        if (bf16) {
          AccumulateRowsBFloat16(w, static_cast<const uint16_t*>(vb), m, dv, acc);
        } else {
          AccumulateRows(w, static_cast<const float*>(vb), m, dv, acc);
        }
      });
    }
  }
  if (!u.with_tail) return;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t g = r / it.query_len, i = r % it.query_len;
    const float* q = it.q + g * it.q_head_stride + i * it.q_pos_stride;
    for (int t = 0; t < it.tail; ++t) DotRows(q, it.tail_k[t], 1, dk, it.scale, scores + t);
    Fold(scores, it.tail, dv, u.partial + r * (dv + 2), [&](const float* w, int64_t m, float* acc) {
      for (int64_t t = 0; t < m; ++t) AccumulateRows(w + t, it.tail_v[t], 1, dv, acc);
    });
  }
}

// out = sum_u acc_u e^(m_u - M) / sum_u l_u e^(m_u - M) over an item's units.
void Merge(const DecodeItem& it, const float* partials, int64_t units) {
  const int64_t dv = it.cache->value_dim();
  const int64_t rows = it.group * it.query_len;
  const int64_t stride = rows * (dv + 2);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t g = r / it.query_len, i = r % it.query_len;
    float* out = it.out + g * it.out_head_stride + i * it.out_pos_stride;
    float max = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int64_t u = 0; u < units; ++u) {
      const float* p = partials + u * stride + r * (dv + 2);
      if (p[1] > 0 || std::isnan(p[1])) {
        nan |= std::isnan(p[0]) || std::isnan(p[1]);
        max = std::max(max, p[0]);
      }
    }
    std::fill(out, out + dv, 0.0f);
    if (nan) {
      std::fill(out, out + dv, std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    if (max == -std::numeric_limits<float>::infinity()) continue;  // saw no key
    float total = 0.0f;
    for (int64_t u = 0; u < units; ++u) {
      const float* p = partials + u * stride + r * (dv + 2);
      if (!(p[1] > 0)) continue;
      const float w = std::exp(p[0] - max);
      total += p[1] * w;
      for (int64_t e = 0; e < dv; ++e) out[e] += p[2 + e] * w;
    }
    Scale(out, dv, 1.0f / total);
  }
}

}  // namespace

void RunDecode(absl::Span<const DecodeItem> items, int threads) {
  if (items.empty()) return;
  double bytes = 0;
  for (const DecodeItem& it : items) {
    bytes += static_cast<double>(it.keys) * static_cast<double>(it.cache->block_bytes()) /
             static_cast<double>(kBlockRows * it.cache->kv_heads());
  }
  if (bytes < kParallelBytes) threads = 1;
  // Enough units for every thread to stay busy to the end of the pass
  // (items differ in length), each at least kMinChunkBlocks blocks.
  const int64_t target_units = threads == 1 ? 1 : 4 * static_cast<int64_t>(threads);
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t chunks_wanted = (target_units + n - 1) / n;
  std::vector<Unit> units;
  std::vector<int64_t> first_unit(items.size() + 1);
  std::vector<int64_t> partial_offset;
  int64_t partial_floats = 0;
  for (int64_t k = 0; k < n; ++k) {
    const DecodeItem& it = items[k];
    first_unit[k] = static_cast<int64_t>(units.size());
    const int64_t blocks = (it.keys + kBlockRows - 1) / kBlockRows;
    const int64_t chunks = std::max<int64_t>(
        1, std::min(chunks_wanted, blocks / kMinChunkBlocks));
    const int64_t rows = it.group * it.query_len;
    for (int64_t c = 0; c < chunks; ++c) {
      Unit u;
      u.item = &it;
      u.first_block = blocks * c / chunks;
      u.end_block = blocks * (c + 1) / chunks;
      u.with_tail = c == chunks - 1 && it.tail > 0;
      units.push_back(u);
      partial_offset.push_back(partial_floats);
      partial_floats += rows * (it.cache->value_dim() + 2);
    }
  }
  first_unit[n] = static_cast<int64_t>(units.size());
  std::vector<float> partials(static_cast<size_t>(partial_floats));
  for (size_t u = 0; u < units.size(); ++u) units[u].partial = partials.data() + partial_offset[u];
  const int64_t total = static_cast<int64_t>(units.size());
  const int team = static_cast<int>(std::min<int64_t>(threads, total));
  if (team <= 1) {
    for (const Unit& u : units) RunUnit(u);
    for (int64_t k = 0; k < n; ++k) {
      Merge(items[k], units[first_unit[k]].partial, first_unit[k + 1] - first_unit[k]);
    }
    return;
  }
#pragma omp parallel num_threads(team)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < total; ++u) RunUnit(units[u]);
#pragma omp for schedule(static)
    for (int64_t k = 0; k < n; ++k) {
      Merge(items[k], units[first_unit[k]].partial, first_unit[k + 1] - first_unit[k]);
    }
  }
}

}  // namespace attention::internal
