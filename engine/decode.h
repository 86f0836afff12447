#ifndef ATTENTION_ENGINE_DECODE_H_
#define ATTENTION_ENGINE_DECODE_H_

// Attention of a few query rows over a session's cache (engine/kv_cache.h):
// the decode step of a generating model. Memory-bound: each cached key and
// value row is read once per step, for every query head that shares its
// key/value head, and long caches are split across threads whose partial
// softmaxes are merged at the end (flash-decoding). Engine-private.

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "engine/kv_cache.h"

namespace attention::internal {

// One key/value head of one session, and the query rows that attend over it:
// `group` query heads (those sharing this key/value head) x `query_len` rows.
struct DecodeItem {
  const KvCache* cache = nullptr;
  int64_t kv_head = 0;
  // Cached rows attended: the first `keys` rows of the cache.
  int64_t keys = 0;
  // Keys after the cached ones, float32, never masked (a layer's bias_k /
  // bias_v and zero-attention keys).
  const float* tail_k[2] = {nullptr, nullptr};
  const float* tail_v[2] = {nullptr, nullptr};
  int tail = 0;
  int64_t group = 1;
  int64_t query_len = 1;
  // Row i of query head g of the group: q + g * q_head_stride + i * q_pos_stride
  // (key_dim floats); its output likewise in `out` (value_dim floats).
  const float* q = nullptr;
  int64_t q_head_stride = 0, q_pos_stride = 0;
  float* out = nullptr;
  int64_t out_head_stride = 0, out_pos_stride = 0;
  float scale = 1.0f;
  // BOTTOM_RIGHT: query row i sees cached keys j <= i + keys - query_len.
  bool causal = false;
  // Precision FAST: on CPUs with AVX-512 or AVX2, exponentials to a relative error
  // under 5e-6; over a BFLOAT16 cache, bf16 products (the query and the
  // softmax weights rounded to bfloat16, float32 sums) by tile multiplies
  // (from kMinTileRows query rows, group x query_len) or, where they are the
  // faster (DecodeDotProductsChosen), dot products; float32 math otherwise.
  bool fast = false;
};

// Below this many query rows per key/value head, FAST takes no tiles: they
// would be mostly empty. Such steps, and on CPUs without tiles every step,
// take bf16 dot products where those beat float32 math
// (DecodeDotProductsChosen), as they do on the AMD hosts measured, and
// float32 math elsewhere (docs/decode-log.md has the measurements).
inline constexpr int64_t kMinTileRows = 4;

// Most query rows (group x query_len) of one item.
inline constexpr int64_t kMaxDecodeRows = 64;

// Computes every item's output on up to `threads` OpenMP threads. A row
// that sees no key gets a zero output, as the other paths give. Throws
// std::bad_alloc, from the calling thread, when memory for the pass runs
// out (the outputs are then undefined).
void RunDecode(absl::Span<const DecodeItem> items, int threads);

// How many units (ranges of a session's blocks, or of its heads) RunDecode
// wants of each of `sessions` sessions, on `threads` threads: at least four
// per thread in all, so that every thread stays busy to the end of the pass
// when sessions differ in length, and a multiple of the threads, so that
// sessions of one length end level (one unit each of 9 sessions on 2
// threads ran 5 and 4; docs/decode-log.md has what splitting
// them gained). A cache too short to split gets fewer. A lone session whose
// blocks split takes more, in ranges that shrink as they go, so that the
// threads end level even when they run at different speeds.
int64_t DecodeUnitsPerSession(int64_t sessions, int threads);

// The ranges a lone session's `blocks` blocks split into on `threads`
// threads (their bounds, from 0 to blocks): each a (2 x threads)th of the
// blocks left, at least 4 (a thread's share of a part: less costs more in
// merging than it saves), rounded up to a multiple of 4 (the ranges whose
// softmax is summed apart, so that a result does not depend on the split),
// the last taking what is left. The threads take
// them in order as they finish: equal ranges, four per thread, ended with
// one thread idle for up to a range while the other finished its last, as
// the two threads of a VM do not run at one speed (one streamed 25% slower
// than the other through a whole step). docs/decode-log.md has
// what they gained.
std::vector<int64_t> ShrinkingBlockRanges(int64_t blocks, int threads);

// Tests and benchmarks: which kernels RunDecode computes with. kBest, the
// default: AVX-512 where the CPU has it, else AVX2 (with FMA), else
// portable loops; kAvx2: the AVX2 kernels on every CPU that has AVX2 and
// FMA (portable loops elsewhere); kPortable: portable loops on every CPU.
enum class DecodeKernels { kBest, kAvx2, kPortable };
void SetDecodeKernels(DecodeKernels use);
// The vector kernels RunDecode uses on this CPU under kBest: "AVX-512",
// "AVX2" or "portable".
const char* DecodeKernelsChosen();

// Tests: y = exp(x) over n floats as the softmax step of the kernels
// SetDecodeKernels selects computes it, `fast` as under precision FAST.
// False (y untouched) where those are the portable loops.
bool DecodeExpForTesting(bool fast, const float* x, float* y, int64_t n);

// Whether this CPU and OS let RunDecode use tile matrix multiplies (AMX)
// for precision FAST over BFLOAT16 caches (from kMinTileRows up to
// 16 query rows per key/value head, key dims a multiple of 32, value dims
// of 16).
bool DecodeTilesAvailable();
// Tests and benchmarks: false makes RunDecode compute those steps as a CPU
// without tiles does (true, the default, uses tiles wherever they are
// available).
void UseDecodeTiles(bool use);

// Whether FAST's steps of `rows` query rows per key/value head (group x
// query_len) that take no tiles use bf16 dot products on this CPU
// (avx512_bf16, not an Intel CPU, where float32 math is the faster) or
// float32 math.
bool DecodeDotProductsChosen(int64_t rows);
// Tests and benchmarks: which of the two those steps take. kAlways: bf16
// dot products on every CPU with avx512_bf16; kNever: float32 math on every
// CPU; kChosen, the default: what DecodeDotProductsChosen says.
enum class DotProducts { kChosen, kAlways, kNever };
void SetDecodeDotProducts(DotProducts use);

// Benchmarks: where RunDecode's passes spent their time, in microseconds
// summed over the passes and over each pass's threads, while recording is
// on (RecordDecodeTimes). A pass's threads each wait to start (the leading
// thread while OpenMP wakes the team, the others until woken), compute their
// units, wait until the sessions whose outputs they merge are computed to
// the end (by the other threads' last units), merge, and wait for the team's
// end; `wall` is each pass's whole time, once per pass.
struct DecodeTimes {
  int64_t passes = 0;
  int64_t thread_passes = 0;  // passes times their threads
  double wall = 0, start = 0, units = 0, merge_wait = 0, merge = 0, end = 0;

  DecodeTimes& operator+=(const DecodeTimes& o) {
    passes += o.passes;
    thread_passes += o.thread_passes;
    wall += o.wall;
    start += o.start;
    units += o.units;
    merge_wait += o.merge_wait;
    merge += o.merge;
    end += o.end;
    return *this;
  }
};
// Off by default (a pass then reads no clock).
void RecordDecodeTimes(bool on);
// What was recorded since the last call, and starts again from zero.
DecodeTimes TakeDecodeTimes();

}  // namespace attention::internal

#endif  // ATTENTION_ENGINE_DECODE_H_
