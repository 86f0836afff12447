// Sessions in the engine, against same-run baselines (issue targets in
// docs/benchmarks.md, "Sessions"):
//   - decode: one query row per session against its cache, FLOAT32 cache
//     bytes read per second against a memory-read probe (every engine thread
//     streaming a buffer far larger than the CPU's caches), per shape;
//   - BFLOAT16 cache: steps per second against the FLOAT32 cache's;
//   - prefill of P rows into a new session against the same stateless call,
//     and of P rows more into a session holding P (no target).
// Beside each decode figure: the share of the CPU's multiply-add peak (a
// same-run probe of independent FMAs on every engine thread) the step used.
// A one-row step does group x (key_dim + value_dim) multiply-adds per cached
// key and head for (key_dim + value_dim) x element bytes read, so grouped
// queries and BFLOAT16 raise the work per byte: where the memory target asks
// for most of the peak, the kernel is bound by arithmetic, not memory.
// Each figure is the median of 7 rounds, each of which calls the probes and
// every step of a shape in turn, round and round, in a new random order
// each pass (so a ratio compares times taken over the same second on the
// shared machine), each call but the multiply-add probe's starting with its
// data flushed from the CPU's caches. Prints a table and "PASS" / "MISS"
// per target, and under each shape where its FLOAT32 and FAST steps' time
// went (StepTimes); with --enforce exits 1 on a miss. The steps and the probes
// run as the server's dispatcher runs its passes: from the calling thread,
// under OMP_WAIT_POLICY=PASSIVE (unless the environment sets a policy), the
// threads bound where the server binds them. Timed, so not a unit test:
// `bash deploy/bench.sh decode` runs it.
//
//   decode_bench [--enforce] [--quick] [--only TEXT] [--back-to-back]
//                [--predecessors]
//     --quick: smaller shapes (a smoke run); --only: the decode shapes whose
//     name contains TEXT, no prefill ("prefill": the prefill only);
//     --back-to-back: a step call is 8 steps over copies of the sessions
//     (Sessions, below) rather than one;
//     --predecessors: no table, but each shape's FLOAT32 step timed after
//     each of several other calls (what ran before a step changes its time)

#include <omp.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/decode.h"
#include "engine/engine.h"
#include "engine/kv_cache.h"
#include "server/openmp_defaults.h"

namespace attention {
namespace {

// Targets (issue 20).
constexpr double kDecodeBandwidthRatio = 0.8;
constexpr double kBFloat16SpeedUp = 1.8;
constexpr double kPrefillRatio = 1.1;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A timed call and what runs, untimed, before each call of it.
struct Timed {
  std::function<void()> call;
  std::function<void()> before = [] {};
};

// Seconds per call of each of `fns`, called in turn (one call each, round
// and round) until every one has run for at least `min_seconds` in all: on
// a shared machine, a neighbour's load then falls on all of them alike.
// Each pass calls them in a new random order, so that every call follows
// each other one about equally often: in a fixed order, the first step
// after the probes (or after a 20 ms pause) ran 2-14% slower than the same
// step right after another step (docs/decode-log.md).
std::vector<double> TimeInterleaved(const std::vector<Timed>& fns, double min_seconds) {
  for (const Timed& f : fns) {  // warm-up
    f.before();
    f.call();
  }
  std::vector<double> spent(fns.size(), 0.0);
  std::vector<int> calls(fns.size(), 0);
  std::vector<size_t> order(fns.size());
  std::iota(order.begin(), order.end(), size_t{0});
  static std::mt19937 rng(1);
  while (*std::min_element(spent.begin(), spent.end()) < min_seconds) {
    std::shuffle(order.begin(), order.end(), rng);
    for (const size_t i : order) {
      fns[i].before();
      const absl::Time start = absl::Now();
      fns[i].call();
      spent[i] += absl::ToDoubleSeconds(absl::Now() - start);
      ++calls[i];
    }
  }
  for (size_t i = 0; i < fns.size(); ++i) spent[i] /= calls[i];
  return spent;
}

// A span of memory: its first byte and its size.
struct Bytes {
  const void* data;
  size_t size;
};

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("clflushopt"))) void FlushLines(uintptr_t first, uintptr_t end) {
  for (uintptr_t line = first; line < end; line += 64) {
    _mm_clflushopt(reinterpret_cast<void*>(line));
  }
}
#endif

// Writes `spans` back to memory and drops them from every level of the
// CPU's caches, on `threads` threads, each a share of every span: the next
// read of them comes from memory, whatever the size of the caches (a read
// of three times the L3 in between did that on one machine, and not on the
// next, whose L3 held 300 MiB). A no-op where x86's cache-line flush is
// missing.
void Flush(const std::vector<Bytes>& spans, int threads) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool clflushopt = __builtin_cpu_supports("clflushopt");
  if (!clflushopt) return;
#pragma omp parallel num_threads(threads)
  {
    const uintptr_t t = static_cast<uintptr_t>(omp_get_thread_num());
    const uintptr_t n = static_cast<uintptr_t>(omp_get_num_threads());
    for (const Bytes& span : spans) {
      const uintptr_t first = reinterpret_cast<uintptr_t>(span.data) / 64;
      const uintptr_t end = (reinterpret_cast<uintptr_t>(span.data) + span.size + 63) / 64;
      const uintptr_t lines = end - first;
      FlushLines((first + lines * t / n) * 64, (first + lines * (t + 1) / n) * 64);
    }
  }
  _mm_sfence();
#else
  (void)spans, (void)threads;
#endif
}

// Sums 64-bit words with eight independent accumulators (integer adds of
// one cycle each, so the loop waits on memory only), prefetching 8 KiB
// ahead into L2, and touching one word of each 4 KiB page 64 KiB ahead so
// that its address translation is looked up before the reads reach it.
// Each is what a loop left to the hardware missed: a plain loop left the
// reads to the hardware's prefetchers, and on one machine read 15-17 GB/s
// where the prefetching loop read 22-24 and the decode kernel (which
// prefetches) 20-22; on the AMD EPYC VM (nested paging) the prefetching
// loop read 55-66 GB/s where the same with the pages touched ahead read
// 69-84, and the decode kernel, touching its pages ahead, 57-62 (2026-12-05).
// A bar the kernel clears by far measures the loop, not the memory.
uint64_t SumWords(const uint64_t* p, size_t n) {
  constexpr size_t kAhead = 8192 / sizeof(uint64_t);
  constexpr size_t kPage = 4096 / sizeof(uint64_t);
  constexpr size_t kTranslateAhead = 65536 / sizeof(uint64_t);
  uint64_t a[8] = {};
  for (size_t i = 0; i + 8 <= n; i += 8) {
    if (i % kPage == 0 && i + kTranslateAhead < n)
      __builtin_prefetch(p + i + kTranslateAhead, 0, 1);
    if (i + kAhead < n) __builtin_prefetch(p + i + kAhead, 0, 2);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) a[j] += p[i + j];  // unrolled: the sums stay in registers
  }
  return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
}

// `threads` threads each streaming their share of a buffer far larger than
// the CPU's caches (summed, so the reads cannot be skipped).
class ReadProbe {
 public:
  ReadProbe(size_t bytes, int threads) : buffer_(bytes / sizeof(uint64_t)), threads_(threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t i = 0; i < buffer_.size(); ++i) buffer_[i] = i;
  }
  size_t bytes() const { return buffer_.size() * sizeof(uint64_t); }
  // Reads the whole buffer once.
  void Pass() {
    const size_t n = buffer_.size();
    uint64_t total = 0;
#pragma omp parallel num_threads(threads_) reduction(+ : total)
    {
      const size_t share = n / static_cast<size_t>(omp_get_num_threads()) / 8 * 8;
      const size_t first = share * static_cast<size_t>(omp_get_thread_num());
      total += SumWords(buffer_.data() + first, share);
    }
    sink_ = sink_ + total;
  }
  // Out of the CPU's caches.
  void Flush() { attention::Flush({{buffer_.data(), bytes()}}, threads_); }

 private:
  std::vector<uint64_t> buffer_;
  const int threads_;
  volatile uint64_t sink_ = 0;
};

#if defined(__x86_64__) && defined(__GNUC__)
// The 12 chains of the loops below: their start, and their sum's first
// lane (what keeps the loops' work from being dropped).
__attribute__((target("avx512f"))) inline void StartChains(__m512 (&a)[12]) {
#pragma GCC unroll 12
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(0.001f * static_cast<float>(i));
}
__attribute__((target("avx512f"))) inline float FirstLaneOfSum(const __m512 (&a)[12]) {
  __m512 sum = a[0];
#pragma GCC unroll 12
  for (int i = 1; i < 12; ++i) sum = _mm512_add_ps(sum, a[i]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  return lanes[0];
}

// 16-lane FMAs on 12 independent chains (more than latency x throughput),
// each in a register: every loop over the chains is unrolled whole, or -O2
// keeps them in an array on the stack and the probe times stores.
__attribute__((target("avx512f"))) float FmaLoop(int64_t n) {
  __m512 a[12];
  StartChains(a);
  const __m512 b = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(0.0001f);
  for (int64_t k = 0; k < n; ++k) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], b, c);
    // Keeps the loop from being folded.
    asm volatile("" : "+v"(a[0]), "+v"(a[6]), "+v"(a[11]));
  }
  return FirstLaneOfSum(a);
}

// The same with 8-lane FMAs, for CPUs with AVX2 and FMA but no AVX-512.
__attribute__((target("avx2,fma"))) float FmaLoop8(int64_t n) {
  __m256 a[12];
#pragma GCC unroll 12
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(0.001f * static_cast<float>(i));
  const __m256 b = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(0.0001f);
  for (int64_t k = 0; k < n; ++k) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], b, c);
    asm volatile("" : "+x"(a[0]), "+x"(a[6]), "+x"(a[11]));
  }
  __m256 sum = a[0];
#pragma GCC unroll 12
  for (int i = 1; i < 12; ++i) sum = _mm256_add_ps(sum, a[i]);
  return _mm_cvtss_f32(_mm256_castps256_ps128(sum));
}

// The same chains of bf16 dot products (vdpbf16ps: two multiply-adds per
// lane and instruction): against FmaLoop, what each costs on this CPU,
// which decides whether FAST's steps without tiles take them
// (internal::DecodeDotProductsChosen).
__attribute__((target("avx512f,avx512bf16"))) float DotLoop(int64_t n) {
  __m512 a[12];
  StartChains(a);
  __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5f), _mm512_set1_ps(0.25f));
  const __m512bh c = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.001f), _mm512_set1_ps(0.002f));
  for (int64_t k = 0; k < n; ++k) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbf16_ps(a[i], b, c);
    asm volatile("" : "+v"(a[0]), "+v"(a[6]), "+v"(a[11]), "+v"(b));
  }
  return FirstLaneOfSum(a);
}

// Nanoseconds per instruction of FmaLoop and DotLoop on this thread, the
// medians of 7 alternating timings each.
std::pair<double, double> FmaAndDotNanoseconds() {
  constexpr int64_t kIterations = 1'000'000;
  std::vector<double> fma, dot;
  volatile float sink = 0;
  for (int r = 0; r < 7; ++r) {
    absl::Time t0 = absl::Now();
    sink = sink + FmaLoop(kIterations);
    fma.push_back(absl::ToDoubleNanoseconds(absl::Now() - t0) / (kIterations * 12));
    t0 = absl::Now();
    sink = sink + DotLoop(kIterations);
    dot.push_back(absl::ToDoubleNanoseconds(absl::Now() - t0) / (kIterations * 12));
  }
  return {Median(fma), Median(dot)};
}
#endif

// Float multiply-adds on `threads` threads at once, a few milliseconds'
// worth per Pass, in the CPU's widest vectors (16 lanes with AVX-512, else
// 8 with AVX2 and FMA); available() is false where the probe has no kernel.
class MultiplyAddProbe {
 public:
  explicit MultiplyAddProbe(int threads) : threads_(threads) {
#if defined(__x86_64__) && defined(__GNUC__)
    lanes_ = __builtin_cpu_supports("avx512f")                                 ? 16
             : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 8
                                                                               : 0;
#endif
  }
  bool available() const { return lanes_ > 0; }
  int lanes() const { return lanes_; }
  double multiply_adds_per_pass() const {
    return static_cast<double>(threads_) * kIterations * 12 * lanes_;
  }
  void Pass() {
#if defined(__x86_64__) && defined(__GNUC__)
    if (!available()) return;
    float total = 0;
    const bool wide = lanes_ == 16;
#pragma omp parallel num_threads(threads_) reduction(+ : total)
    total += wide ? FmaLoop(kIterations) : FmaLoop8(kIterations);
    sink_ = sink_ + total;
#endif
  }

 private:
  static constexpr int64_t kIterations = 4'000'000;
  const int threads_;
  int lanes_ = 0;
  volatile float sink_ = 0;
};

std::vector<float> RandomFloats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

struct Shape {
  const char* name;
  int64_t batch, heads, kv_heads, keys, dim;
  // An issue target's shape (PASS / MISS), or shown beside them.
  bool target = true;
};

// Sessions of `s.keys - 1` rows each in caches of `dtype`, and their
// one-row steps (appended, attended over `s.keys` keys, dropped again
// before the next step, so that every step sees the same length). The
// step's row lands in the last block,
// as 63 of a decoder's 64 steps' rows do: with `s.keys` (a multiple of 64)
// cached, every step would start a block, allocate and zero it, which a
// decoder does once in 64 steps.
class Decoder {
 public:
  Decoder(const Shape& s, DType dtype) {
    // Rows appended in chunks of one random block, reused: the values do not
    // matter to the time.
    const int64_t chunk = 1024;
    const int64_t cached = s.keys - 1;
    const std::vector<float> rows = RandomFloats(static_cast<size_t>(chunk * s.kv_heads * s.dim), 1);
    for (int64_t b = 0; b < s.batch; ++b) {
      caches_.push_back(std::move(KvCache::Create(s.kv_heads, s.dim, s.dim, dtype)).value());
      for (int64_t done = 0; done < cached; done += chunk) {
        const int64_t n = std::min(chunk, cached - done);
        const int64_t row = s.kv_heads * s.dim;
        if (!caches_.back()->Append(n, rows.data(), row, s.dim, rows.data(), row, s.dim).ok()) {
          std::fprintf(stderr, "could not fill a cache\n");
          std::exit(2);
        }
      }
      caches_.back()->Commit();
      session_.caches.push_back(caches_.back().get());
    }
    q_ = RandomFloats(static_cast<size_t>(s.batch * s.heads * s.dim), 2);
    kv_ = RandomFloats(static_cast<size_t>(s.batch * s.kv_heads * s.dim), 3);
    args_.query = TensorView{DType::kFloat32, {s.batch, s.heads, 1, s.dim}, q_.data(), q_.size() * 4};
    args_.key =
        TensorView{DType::kFloat32, {s.batch, s.kv_heads, 1, s.dim}, kv_.data(), kv_.size() * 4};
    args_.value = args_.key;
    args_.mask.causal = Causal::kBottomRight;
    const double element = dtype == DType::kFloat32 ? 4 : 2;
    bytes_per_step_ = static_cast<double>(s.batch * s.kv_heads * s.keys * 2 * s.dim) * element;
  }
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  double bytes_per_step() const { return bytes_per_step_; }

  // The last step's row dropped, then every cached block out of the CPU's
  // caches: the next step sees the same cache, from memory, as a step of
  // one of a server's many sessions does.
  void Reset(int threads) {
    DropRow();
    std::vector<Bytes> blocks;
    for (const auto& c : caches_) {
      for (int64_t b = 0; b < c->blocks(); ++b) {
        blocks.push_back({c->KeyBlock(b, 0), static_cast<size_t>(c->block_bytes())});
      }
    }
    attention::Flush(blocks, threads);
  }

  // One step (`fast`: precision FAST), computed on this thread, as the
  // server's scheduler computes its batches: the probes' OpenMP team is then
  // the step's. Through the engine's worker thread, a second team's threads
  // idled beside the first's, and the hop cost a grouped-query step (1.5 ms)
  // about 8% (2026-11-25, one run).
  // The step's row stays in the caches, uncommitted, until DropRow (a
  // decoder's step commits it): dropping it rewrites the block's lines the
  // row took, which the step's pass has pushed out of the CPU's caches,
  // about 40 us of a B16 H8 D64 step's time (2026-12-06), no part of a step.
  void Step(const Engine& engine, bool fast) {
    DropRow();
    args_.fast = fast;
    EngineCall call{&args_, nullptr};
    call.session = &session_;
    absl::StatusOr<AttentionResult> r =
        std::move(engine.AttendBatchFromThisThread({&call, 1}).front());
    if (!r.ok()) {
      std::fprintf(stderr, "decode step: %s\n", r.status().ToString().c_str());
      std::exit(2);
    }
    row_pending_ = true;
  }
  void DropRow() {
    if (!row_pending_) return;
    for (KvCache* c : session_.caches) c->Rollback();
    row_pending_ = false;
  }

 private:
  std::vector<std::unique_ptr<KvCache>> caches_;
  SessionCall session_;
  std::vector<float> q_, kv_;
  AttentionArgs args_;
  double bytes_per_step_ = 0;
  bool row_pending_ = false;
};

// A shape's sessions (a Decoder) stepped once per timed call, or with
// --back-to-back, copies of them, as many as hold 256 MiB of cache or more,
// stepped 8 times per call one after another, as a busy server steps its
// sessions: each step's cache then comes from memory because the others
// pushed it out of the CPU's caches, not because it was flushed (which
// probably also leaves its pages' translations fresh), and only a call's
// first step runs right after another call (a 1.5 ms step right after the
// probes ran 10-16% slower: --predecessors). docs/decode-log.md
// compares the two.
class Sessions {
 public:
  // --back-to-back: steps per call, and the cache the copies hold at least.
  static constexpr int kBackToBackSteps = 8;
  static constexpr int kColdMiB = 256;

  Sessions(const Shape& s, DType dtype, bool back_to_back)
      : steps_per_call_(back_to_back ? kBackToBackSteps : 1) {
    const double cold_bytes = static_cast<double>(kColdMiB) * (1 << 20);
    do {
      decoders_.push_back(std::make_unique<Decoder>(s, dtype));
    } while (back_to_back &&
             static_cast<double>(decoders_.size()) * decoders_[0]->bytes_per_step() < cold_bytes);
  }

  double bytes_per_step() const { return decoders_[0]->bytes_per_step(); }
  int steps_per_call() const { return steps_per_call_; }
  // steps_per_call() steps, one session after another; back to back, each
  // step's row dropped right after it (the next step may be the same
  // session's).
  void Steps(const Engine& engine, bool fast) {
    for (int i = 0; i < steps_per_call_; ++i) {
      decoders_[next_]->Step(engine, fast);
      if (steps_per_call_ > 1) decoders_[next_]->DropRow();
      next_ = (next_ + 1) % decoders_.size();
    }
  }
  // Every session as Decoder::Reset leaves it.
  void Reset(int threads) {
    for (const auto& d : decoders_) d->Reset(threads);
  }

 private:
  const int steps_per_call_;
  std::vector<std::unique_ptr<Decoder>> decoders_;
  size_t next_ = 0;
};

// A step's time beyond the cache's bytes: the decode passes' own account of
// where it went (internal::DecodeTimes) and the calls' whole time, summed
// over the steps a row of the table timed (all rounds).
class StepTimes {
 public:
  // `sessions`' steps, recorded.
  void Steps(const Engine& engine, Sessions& sessions, bool fast) {
    internal::RecordDecodeTimes(true);
    const absl::Time start = absl::Now();
    sessions.Steps(engine, fast);
    call_us_ += absl::ToDoubleMicroseconds(absl::Now() - start);
    internal::RecordDecodeTimes(false);
    times_ += internal::TakeDecodeTimes();
  }
  // Means per step, and per step and thread.
  void Print(const char* shape, const char* cache) const {
    if (times_.passes == 0 || times_.thread_passes == 0) return;
    const double passes = static_cast<double>(times_.passes);
    const double thread_passes = static_cast<double>(times_.thread_passes);
    std::printf(
        "%-24s %-9s %.0f us a step: its pass %.0f (per thread: start %.0f, units %.0f, last "
        "units %.0f, merges %.0f, end %.0f), around it %.0f\n",
        shape, cache, call_us_ / passes, times_.wall / passes, times_.start / thread_passes,
        times_.units / thread_passes, times_.merge_wait / thread_passes,
        times_.merge / thread_passes, times_.end / thread_passes,
        (call_us_ - times_.wall) / passes);
  }

 private:
  internal::DecodeTimes times_;
  double call_us_ = 0;
};

// Prefill of `keys` rows (causal) into a session holding `held` rows (0: a
// new one), and the same call stateless (its key every row), interleaved
// (TimeInterleaved, at least a second each per round) over `rounds` rounds:
// the median seconds of each, and the median of the rounds' ratios.
struct PrefillFigures {
  double session = 0, stateless = 0, ratio = 0;
};

PrefillFigures Prefill(const Engine& engine, int64_t heads, int64_t keys, int64_t held, int64_t dim,
                       int rounds) {
  const int64_t e = heads * dim;
  const std::vector<float> x = RandomFloats(static_cast<size_t>((held + keys) * e), 4);
  AttentionArgs args;  // the new rows; key = value = query
  args.query = TensorView{
      DType::kFloat32, {1, keys, e}, x.data() + held * e, static_cast<size_t>(keys * e) * 4};
  args.num_heads = heads;
  args.mask.causal = Causal::kBottomRight;
  AttentionArgs stateless = args;
  stateless.key = TensorView{DType::kFloat32, {1, held + keys, e}, x.data(), x.size() * 4};
  std::unique_ptr<KvCache> older =
      std::move(KvCache::Create(heads, dim, dim, DType::kFloat32)).value();
  if (!older->Append(held, x.data(), e, dim, x.data(), e, dim).ok()) std::exit(2);
  older->Commit();
  const std::vector<Timed> calls = {
      {[&] {
        if (!engine.Attend(stateless).ok()) std::exit(2);
      }},
      {[&] {
        std::unique_ptr<KvCache> created;
        KvCache* cache = older.get();
        if (held == 0) {
          created = std::move(KvCache::Create(heads, dim, dim, DType::kFloat32)).value();
          cache = created.get();
        }
        SessionCall s{{cache}, false};
        EngineCall call{&args, nullptr};
        call.session = &s;
        if (!engine.AttendBatch({&call, 1}).front().ok()) std::exit(2);
        cache->Rollback();  // the held session keeps its length
      }},
  };
  std::vector<double> session, plain, ratio;
  for (int r = 0; r < rounds; ++r) {
    const std::vector<double> t = TimeInterleaved(calls, 1.0);
    plain.push_back(t[0]);
    session.push_back(t[1]);
    ratio.push_back(t[1] / t[0]);
  }
  return {Median(session), Median(plain), Median(ratio)};
}

// Busy-waits `ms` milliseconds on `threads` threads (no memory traffic).
void Spin(double ms, int threads) {
#pragma omp parallel num_threads(threads)
  {
    const absl::Time start = absl::Now();
    while (absl::ToDoubleMilliseconds(absl::Now() - start) < ms) {
    }
  }
}

// --predecessors: what ran just before a step changes its time. The
// shape's FLOAT32 step, flushed first as in the table (but where said),
// timed after each of these in turn, 60 times; the median of each and its
// ratio to the first (docs/decode-log.md has what it showed).
void Predecessors(const Engine& engine, const Shape& s, ReadProbe& probe, MultiplyAddProbe& fma,
                  int threads) {
  Decoder f32(s, DType::kFloat32), bf16(s, DType::kBFloat16);
  std::vector<double> probe_seconds;
  struct Before {
    const char* name;
    std::function<void()> run;
    bool flush = true;  // the step's cache flushed after `run`
  };
  const std::vector<Before> befores = {
      {"a FLOAT32 step (this cache)", [&] { f32.Step(engine, false); }},
      {"a BFLOAT16 step (another cache)", [&] { bf16.Step(engine, false); }},
      {"a FLOAT32 step, then 16 ms spinning",
       [&] {
         f32.Step(engine, false);
         Spin(16, threads);
       }},
      {"the multiply-add probe", [&] { fma.Pass(); }},
      {"the read probe",
       [&] {
         const absl::Time start = absl::Now();
         probe.Pass();
         probe_seconds.push_back(absl::ToDoubleSeconds(absl::Now() - start));
       }},
      {"the read probe, no flush after it",
       [&] {
         f32.Reset(threads);
         probe.Pass();  // 1 GiB: the cache stays out of the CPU's caches
       },
       false},
  };
  constexpr int kReps = 60;
  std::vector<std::vector<double>> us(befores.size());
  for (int rep = 0; rep < kReps; ++rep) {
    for (size_t i = 0; i < befores.size(); ++i) {
      befores[i].run();
      if (befores[i].flush) f32.Reset(threads);
      const absl::Time start = absl::Now();
      f32.Step(engine, false);
      us[i].push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
    }
  }
  const double probe_gb = static_cast<double>(probe.bytes()) / Median(probe_seconds) / 1e9;
  std::printf(
      "\n%s, FLOAT32 step (median of %d) after each, and its GB/s against the read "
      "probe's %.2f:\n",
      s.name, kReps, probe_gb);
  const double first = Median(us[0]);
  for (size_t i = 0; i < befores.size(); ++i) {
    const double t = Median(us[i]);
    const double gb = f32.bytes_per_step() / t / 1e3;
    std::printf("  %-36s %9.1f us %6.2fx %8.2f GB/s %6.2fx\n", befores[i].name, t, t / first, gb,
                gb / probe_gb);
  }
}

int Main(int argc, char** argv) {
  bool enforce = false, quick = false, predecessors = false, back_to_back = false;
  const char* only = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--enforce") == 0) {
      enforce = true;
    } else if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--back-to-back") == 0) {
      back_to_back = true;
    } else if (std::strcmp(argv[i], "--predecessors") == 0) {
      predecessors = true;
    } else if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) {
      only = argv[++i];
    } else {
      std::fprintf(stderr,
                   "usage: decode_bench [--enforce] [--quick] [--only TEXT] [--back-to-back] "
                   "[--predecessors]\n");
      return 2;
    }
  }
  std::unique_ptr<Engine> engine = std::move(Engine::Create({})).value();
  const int threads = engine->threads();
  // This thread leads every pass, as the server's dispatcher does, bound as
  // it is (the engine's threads bound to CPUs).
  const bool bound = engine->BindThisThread();
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  const std::string binding =
      bound ? absl::StrCat("bound to CPUs ", absl::StrJoin(engine->bound_cpus(), ","))
            : "not bound";
  std::printf("OMP_WAIT_POLICY=%s, the engine's threads %s\n",
              policy != nullptr ? policy : "(unset)", binding.c_str());
  const std::vector<Shape> shapes =
      quick ? std::vector<Shape>{{"B4 H8 S=2048 D64", 4, 8, 8, 2048, 64}}
            : std::vector<Shape>{{"B1 H32 S=32768 D128", 1, 32, 32, 32768, 128},
                                 {"B16 H8 S=4096 D64", 16, 8, 8, 4096, 64},
                                 {"B1 H32 Hk8 S=8192 D128", 1, 32, 8, 8192, 128},
                                 // Sessions that do not divide among the threads
                                 // (engine/decode.h, DecodeUnitsPerSession).
                                 {"B9 H8 S=4096 D64", 9, 8, 8, 4096, 64, false}};
  bool ok = true;
  auto verdict = [&](bool pass) {
    ok &= pass;
    return pass ? "PASS" : "MISS";
  };
  // The machine is shared: every figure is a ratio within one round (the
  // probes and the FLOAT32, BFLOAT16 and BFLOAT16 FAST steps called in
  // turn), and the table gives the median over the rounds.
  constexpr int kRounds = 7;
  ReadProbe probe(size_t{1} << 30, threads);
  MultiplyAddProbe fma(threads);
  if (predecessors) {
    std::printf("probe: %d threads streaming 1 GiB\n", threads);
    for (const Shape& s : shapes) {
      if (only == nullptr || std::strstr(s.name, only) != nullptr) {
        Predecessors(*engine, s, probe, fma, threads);
      }
    }
    return 0;
  }
  std::printf(
      "%d rounds per shape, each calling in turn (shuffled), for at least 0.2 s each: the "
      "memory-read probe\n(%d threads streaming 1 GiB, prefetching), a multiply-add "
      "probe (%d threads of independent %d-lane FMAs)\nand each step, the probe and the "
      "steps each starting with its data flushed from the CPU's caches;\n",
      kRounds, threads, threads, fma.lanes());
  if (back_to_back) {
    std::printf(
        "a step call is %d steps back to back over copies of the sessions (%d MiB or "
        "more of cache); ",
        Sessions::kBackToBackSteps, Sessions::kColdMiB);
  } else {
    std::printf("a step call is one step; ");
  }
  std::printf("medians of the rounds' ratios\n");
  // FAST takes tile multiplies (AMX) where the CPU has them: the same
  // steps as a CPU without them computes them are then shown beside them
  // ("NO TILES"). On a CPU with bf16 dot products, the steps are also shown
  // with the one of float32 math and dot products that FAST does not take
  // there for the shape's query rows per key/value head ("BF16 DOT" or
  // "FAST F32"): the A/B behind the choice.
  const auto math_of = [](int64_t rows) {
    return internal::DecodeDotProductsChosen(rows) ? "bf16 dot products" : "float32 math";
  };
  const std::string chosen_math =
      internal::DecodeDotProductsChosen(1) ==
              internal::DecodeDotProductsChosen(internal::kMinTileRows)
          ? math_of(1)
          : absl::StrCat(math_of(1), " below ", internal::kMinTileRows,
                         " query rows per key/value head, ", math_of(internal::kMinTileRows),
                         " from ", internal::kMinTileRows);
#if defined(__x86_64__) && defined(__GNUC__)
  const bool bf16_dot = __builtin_cpu_supports("avx512bf16");
  if (bf16_dot) {
    const auto [fma_ns, dot_ns] = FmaAndDotNanoseconds();
    std::printf(
        "one thread: a 16-lane FMA per %.3f ns, a bf16 dot product (vdpbf16ps) per %.3f ns "
        "(%.2fx); FAST without tiles takes %s\n",
        fma_ns, dot_ns, dot_ns / fma_ns, chosen_math.c_str());
  }
#else
  const bool bf16_dot = false;
#endif
  // A variant steps the BFLOAT16 sessions under FAST, or with float32_cache
  // the FLOAT32 ones, with other kernels or math than the engine chooses;
  // other_math: the math (dot products or float32) FAST does not take for
  // the shape (its name then says which).
  struct Variant {
    const char* name;
    bool tiles;
    internal::DotProducts dot;
    internal::DecodeKernels kernels = internal::DecodeKernels::kBest;
    bool float32_cache = false;
    bool other_math = false;
  };
  // That math for a shape of `rows` query rows per key/value head: its
  // name and how to make FAST take it.
  const auto other_math_of = [](int64_t rows) {
    return internal::DecodeDotProductsChosen(rows)
               ? std::pair{"FAST F32", internal::DotProducts::kNever}
               : std::pair{"BF16 DOT", internal::DotProducts::kAlways};
  };
  std::vector<Variant> variants;
  // The decode kernels this CPU takes, and beside them the FLOAT32 steps
  // with the next narrower ones (AVX2 on an AVX-512 CPU, the portable loops
  // on an AVX2 one): what the wider vectors gain.
  const std::string kernels = internal::DecodeKernelsChosen();
  if (kernels != "portable") {
    const bool avx512 = kernels == "AVX-512";
    variants.push_back(
        {avx512 ? "F32 AVX2" : "F32 PORTABLE", true, internal::DotProducts::kChosen,
         avx512 ? internal::DecodeKernels::kAvx2 : internal::DecodeKernels::kPortable, true});
    std::printf("decode kernels: %s; %s: the FLOAT32 steps with the %s\n", kernels.c_str(),
                variants.back().name, avx512 ? "AVX2 kernels" : "portable loops");
  }
  if (internal::DecodeTilesAvailable()) {
    variants.push_back({"NO TILES", false, internal::DotProducts::kChosen});
    std::printf(
        "BF16 FAST: tile multiplies (AMX) where the step has 4 to 16 query rows per "
        "key/value head;\nNO TILES: the same steps as without them (%s)\n",
        chosen_math.c_str());
  }
  if (bf16_dot) {
    variants.push_back(
        {"", false, internal::DotProducts::kChosen, internal::DecodeKernels::kBest, false, true});
    std::printf(
        "FAST F32 or BF16 DOT: the same steps with float32 math or bf16 dot products, whichever "
        "FAST does not take for the shape on this CPU\n");
  }
  std::printf("\n%-24s %-9s %9s %9s %10s %9s %10s %7s %s\n", "decode (1 row/session)", "cache",
              "step us", "probe", "GB/s read", "vs probe", "FMA peak", "target", "steps/s vs FLOAT32");
  for (const Shape& s : shapes) {
    if (only != nullptr && std::strstr(s.name, only) == nullptr) continue;
    Sessions f32(s, DType::kFloat32, back_to_back), bf16(s, DType::kBFloat16, back_to_back);
    // Per round: probe GB/s, FMA peak, and each step's seconds.
    std::vector<double> bandwidth, peak, t_f32, t_bf16, t_fast;
    std::vector<double> f32_vs_probe, bf16_vs_probe, fast_vs_probe, f32_peak, bf16_peak, bf16_up,
        fast_up;
    // Per variant.
    std::vector<std::vector<double>> t_var(variants.size()), var_vs_probe(variants.size()),
        var_up(variants.size());
    const int64_t rows = s.heads / s.kv_heads;  // per key/value head
    const double group = static_cast<double>(rows);
    // Where the FLOAT32 and FAST steps' time went.
    StepTimes f32_times, fast_times;
    for (int r = 0; r < kRounds; ++r) {
      std::vector<Timed> calls = {
          {[&] { probe.Pass(); }, [&] { probe.Flush(); }},
          {[&] { fma.Pass(); }},
          {[&] { f32_times.Steps(*engine, f32, false); }, [&] { f32.Reset(threads); }},
          {[&] { bf16.Steps(*engine, false); }, [&] { bf16.Reset(threads); }},
          {[&] { fast_times.Steps(*engine, bf16, true); }, [&] { bf16.Reset(threads); }}};
      for (const Variant& v : variants) {
        Sessions& sessions = v.float32_cache ? f32 : bf16;
        calls.push_back({[&] {
                           internal::UseDecodeTiles(v.tiles);
                           internal::SetDecodeDotProducts(v.other_math ? other_math_of(rows).second
                                                                       : v.dot);
                           internal::SetDecodeKernels(v.kernels);
                           sessions.Steps(*engine, !v.float32_cache);
                           internal::UseDecodeTiles(true);
                           internal::SetDecodeDotProducts(internal::DotProducts::kChosen);
                           internal::SetDecodeKernels(internal::DecodeKernels::kBest);
                         },
                         [&] { sessions.Reset(threads); }});
      }
      const std::vector<double> t = TimeInterleaved(calls, 0.2);
      bandwidth.push_back(static_cast<double>(probe.bytes()) / t[0]);
      peak.push_back(fma.available() ? fma.multiply_adds_per_pass() / t[1] : 0);
      t_f32.push_back(t[2] / f32.steps_per_call());
      t_bf16.push_back(t[3] / bf16.steps_per_call());
      t_fast.push_back(t[4] / bf16.steps_per_call());
      f32_vs_probe.push_back(f32.bytes_per_step() / t_f32.back() / bandwidth.back());
      bf16_vs_probe.push_back(bf16.bytes_per_step() / t_bf16.back() / bandwidth.back());
      fast_vs_probe.push_back(bf16.bytes_per_step() / t_fast.back() / bandwidth.back());
      // A one-row step's multiply-adds per byte: group / element bytes.
      f32_peak.push_back(f32.bytes_per_step() / t_f32.back() * group / 4 / peak.back());
      bf16_peak.push_back(bf16.bytes_per_step() / t_bf16.back() * group / 2 / peak.back());
      bf16_up.push_back(t_f32.back() / t_bf16.back());
      fast_up.push_back(t_f32.back() / t_fast.back());
      for (size_t v = 0; v < variants.size(); ++v) {
        const Sessions& sessions = variants[v].float32_cache ? f32 : bf16;
        t_var[v].push_back(t[5 + v] / sessions.steps_per_call());
        var_vs_probe[v].push_back(sessions.bytes_per_step() / t_var[v].back() / bandwidth.back());
        var_up[v].push_back(t_f32.back() / t_var[v].back());
      }
    }
    const double probe_gb = Median(bandwidth) / 1e9;
    auto row = [&](const char* cache, const std::vector<double>& t, double bytes,
                   const std::vector<double>& vs_probe, const char* fma, const char* verdict_text,
                   const char* speed_up) {
      std::printf("%-24s %-9s %9.1f %9.2f %10.2f %8.2fx %10s %7s %s\n", s.name, cache,
                  Median(t) * 1e6, probe_gb, bytes / Median(t) / 1e9, Median(vs_probe), fma,
                  verdict_text, speed_up);
    };
    auto text = [](const char* format, double x) {
      char out[32];
      std::snprintf(out, sizeof out, format, x);
      return std::string(out);
    };
    const bool have_peak = Median(peak) > 0;
    row("FLOAT32", t_f32, f32.bytes_per_step(), f32_vs_probe,
        have_peak ? text("%.2fx", Median(f32_peak)).c_str() : "",
        s.target ? verdict(Median(f32_vs_probe) >= kDecodeBandwidthRatio) : "", "");
    // BFLOAT16 under precision EXACT and FAST: the target is the speed a
    // caller who picks the smaller cache for speed gets, FAST; EXACT is
    // shown beside it.
    row("BF16", t_bf16, bf16.bytes_per_step(), bf16_vs_probe,
        have_peak ? text("%.2fx", Median(bf16_peak)).c_str() : "", "",
        text("%.2fx", Median(bf16_up)).c_str());
    row("BF16 FAST", t_fast, bf16.bytes_per_step(), fast_vs_probe, "",
        s.target ? verdict(Median(fast_up) >= kBFloat16SpeedUp) : "",
        text("%.2fx", Median(fast_up)).c_str());
    for (size_t v = 0; v < variants.size(); ++v) {
      const Sessions& sessions = variants[v].float32_cache ? f32 : bf16;
      row(variants[v].other_math ? other_math_of(rows).first : variants[v].name, t_var[v],
          sessions.bytes_per_step(), var_vs_probe[v], "", "",
          text("%.2fx", Median(var_up[v])).c_str());
    }
    f32_times.Print(s.name, "FLOAT32");
    fast_times.Print(s.name, "BF16 FAST");
  }
  if (only != nullptr && std::strcmp(only, "prefill") != 0) return enforce && !ok ? 1 : 0;
  const int64_t prefill = quick ? 1024 : 4096;
  const PrefillFigures p = Prefill(*engine, 8, prefill, 0, 64, kRounds);
  std::printf("\nprefill H8 P=%lld D64 causal: session %.1f ms, stateless %.1f ms: %.2fx %s\n",
              static_cast<long long>(prefill), p.session * 1e3, p.stateless * 1e3, p.ratio,
              verdict(p.ratio <= kPrefillRatio));
  // The same rows appended to a session that holds as many (a prompt sent in
  // two parts, or a conversation's next turn): no target.
  const PrefillFigures c = Prefill(*engine, 8, prefill, prefill, 64, kRounds);
  std::printf(
      "then P=%lld more rows into it: session %.1f ms, stateless %.1f ms: %.2fx (no target)\n",
      static_cast<long long>(prefill), c.session * 1e3, c.stateless * 1e3, c.ratio);
  return enforce && !ok ? 1 : 0;
}

}  // namespace
}  // namespace attention

int main(int argc, char** argv) {
  // As attention_server does: OpenMP threads sleep between passes
  // (OMP_WAIT_POLICY=PASSIVE unless the environment sets it; may execute
  // this binary again).
  attention::server::ReexecWithOpenMpDefaults(argv);
  return attention::Main(argc, argv);
}
