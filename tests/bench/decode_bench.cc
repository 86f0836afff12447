// Sessions in the engine, against same-run baselines (issue targets in
// docs/benchmarks.md, "Sessions"):
//   - decode: one query row per session against its cache, FLOAT32 cache
//     bytes read per second against a memory-read probe (every engine thread
//     streaming a buffer far larger than the CPU's caches), per shape;
//   - BFLOAT16 cache: steps per second against the FLOAT32 cache's;
//   - prefill of P rows into a new session against the same stateless call.
// Beside each decode figure: the share of the CPU's multiply-add peak (a
// same-run probe of independent FMAs on every engine thread) the step used.
// A one-row step does group x (key_dim + value_dim) multiply-adds per cached
// key and head for (key_dim + value_dim) x element bytes read, so grouped
// queries and BFLOAT16 raise the work per byte: where the memory target asks
// for most of the peak, the kernel is bound by arithmetic, not memory.
// Each figure is the median of several timed rounds. Prints a table and
// "PASS" / "MISS" per target; with --enforce exits 1 on a miss. Timed, so
// not a unit test: `bash deploy/bench.sh decode` runs it.
//
//   decode_bench [--enforce] [--quick]   --quick: smaller shapes (a smoke run)

#include <omp.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/engine.h"
#include "engine/kv_cache.h"

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

// Seconds per call of `f`, the median of `rounds` rounds of at least
// `min_seconds` each.
template <typename F>
double TimePerCall(F f, int rounds, double min_seconds) {
  f();  // warm-up
  std::vector<double> per_call;
  for (int r = 0; r < rounds; ++r) {
    int calls = 0;
    const absl::Time start = absl::Now();
    double elapsed = 0;
    do {
      f();
      ++calls;
      elapsed = absl::ToDoubleSeconds(absl::Now() - start);
    } while (elapsed < min_seconds);
    per_call.push_back(elapsed / calls);
  }
  return Median(per_call);
}

// Sums 64-bit words with eight independent accumulators: integer adds of
// one cycle each, so the loop waits on memory only.
uint64_t SumWords(const uint64_t* p, size_t n) {
  uint64_t a[8] = {};
  for (size_t i = 0; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) a[j] += p[i + j];
  }
  return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
}

// Bytes per second `threads` threads read from a buffer of `bytes` bytes,
// each streaming its share (summed, so the reads cannot be skipped).
double ReadBandwidth(size_t bytes, int threads) {
  const size_t n = bytes / sizeof(uint64_t);
  std::vector<uint64_t> buffer(n);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (size_t i = 0; i < n; ++i) buffer[i] = i;
  volatile uint64_t sink = 0;
  const double seconds = TimePerCall(
      [&] {
        uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
        {
          const size_t share = n / static_cast<size_t>(omp_get_num_threads()) / 8 * 8;
          const size_t first = share * static_cast<size_t>(omp_get_thread_num());
          total += SumWords(buffer.data() + first, share);
        }
        sink = sink + total;
      },
      5, 0.3);
  return static_cast<double>(bytes) / seconds;
}

#if defined(__x86_64__) && defined(__GNUC__)
// 16-lane FMAs on 12 independent chains (more than latency x throughput).
__attribute__((target("avx512f"))) float FmaLoop(int64_t n) {
  __m512 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(0.001f * static_cast<float>(i));
  const __m512 b = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(0.0001f);
  for (int64_t k = 0; k < n; ++k) {
    for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], b, c);
    // Keeps the chains in registers and the loop from being folded.
    asm volatile("" : "+v"(a[0]), "+v"(a[6]), "+v"(a[11]));
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, a[0]);
  float sum = lanes[0];
  for (int i = 1; i < 12; ++i) {
    _mm512_store_ps(lanes, a[i]);
    sum += lanes[0];
  }
  return sum;
}
#endif

// Float multiply-adds per second on `threads` threads at once, or 0 where
// the probe has no kernel (no AVX-512).
double MultiplyAddPeak(int threads) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (!__builtin_cpu_supports("avx512f")) return 0;
  constexpr int64_t kIterations = 4'000'000;
  volatile float sink = 0;
  const double seconds = TimePerCall(
      [&] {
        float total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
        total += FmaLoop(kIterations);
        sink = sink + total;
      },
      5, 0.2);
  return static_cast<double>(threads) * kIterations * 12 * 16 / seconds;
#else
  (void)threads;
  return 0;
#endif
}

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
};

struct DecodeFigures {
  double step_seconds = 0;
  double bytes_per_step = 0;
};

// Sessions of `s.keys` rows each, then one-row steps (appended, attended,
// dropped again so every step sees the same length).
DecodeFigures Decode(const Engine& engine, const Shape& s, DType dtype, bool fast = false) {
  std::vector<std::unique_ptr<KvCache>> caches;
  SessionCall session;
  // Rows appended in chunks of one random block, reused: the values do not
  // matter to the time.
  const int64_t chunk = 1024;
  const std::vector<float> rows = RandomFloats(static_cast<size_t>(chunk * s.kv_heads * s.dim), 1);
  for (int64_t b = 0; b < s.batch; ++b) {
    caches.push_back(std::move(KvCache::Create(s.kv_heads, s.dim, s.dim, dtype)).value());
    for (int64_t done = 0; done < s.keys; done += chunk) {
      const int64_t n = std::min(chunk, s.keys - done);
      const int64_t row = s.kv_heads * s.dim;
      if (!caches.back()->Append(n, rows.data(), row, s.dim, rows.data(), row, s.dim).ok()) {
        std::fprintf(stderr, "could not fill a cache\n");
        std::exit(2);
      }
    }
    caches.back()->Commit();
    session.caches.push_back(caches.back().get());
  }
  const std::vector<float> q = RandomFloats(static_cast<size_t>(s.batch * s.heads * s.dim), 2);
  const std::vector<float> kv = RandomFloats(static_cast<size_t>(s.batch * s.kv_heads * s.dim), 3);
  AttentionArgs args;
  args.query = TensorView{DType::kFloat32, {s.batch, s.heads, 1, s.dim}, q.data(), q.size() * 4};
  args.key = TensorView{DType::kFloat32, {s.batch, s.kv_heads, 1, s.dim}, kv.data(), kv.size() * 4};
  args.value = args.key;
  args.mask.causal = Causal::kBottomRight;
  args.fast = fast;
  EngineCall call{&args, nullptr};
  call.session = &session;
  DecodeFigures f;
  f.step_seconds = TimePerCall(
      [&] {
        absl::StatusOr<AttentionResult> r = std::move(engine.AttendBatch({&call, 1}).front());
        if (!r.ok()) {
          std::fprintf(stderr, "decode step: %s\n", r.status().ToString().c_str());
          std::exit(2);
        }
        for (KvCache* c : session.caches) c->Rollback();
      },
      7, 0.2);
  const double element = dtype == DType::kFloat32 ? 4 : 2;
  f.bytes_per_step = static_cast<double>(s.batch * s.kv_heads * (s.keys + 1) * 2 * s.dim) * element;
  return f;
}

// Prefill of `keys` rows (causal) into a new session, and the same call
// stateless: seconds each.
std::pair<double, double> Prefill(const Engine& engine, int64_t heads, int64_t keys,
                                  int64_t dim) {
  const std::vector<float> x = RandomFloats(static_cast<size_t>(keys * heads * dim), 4);
  AttentionArgs args;
  args.query = TensorView{DType::kFloat32, {1, keys, heads * dim}, x.data(), x.size() * 4};
  args.num_heads = heads;
  args.mask.causal = Causal::kBottomRight;
  const double stateless = TimePerCall(
      [&] {
        if (!engine.Attend(args).ok()) std::exit(2);
      },
      5, 0.5);
  const double session = TimePerCall(
      [&] {
        std::unique_ptr<KvCache> cache =
            std::move(KvCache::Create(heads, dim, dim, DType::kFloat32)).value();
        SessionCall s{{cache.get()}, false};
        EngineCall call{&args, nullptr};
        call.session = &s;
        if (!engine.AttendBatch({&call, 1}).front().ok()) std::exit(2);
        cache->Commit();
      },
      5, 0.5);
  return {session, stateless};
}

int Main(int argc, char** argv) {
  bool enforce = false, quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--enforce") == 0) {
      enforce = true;
    } else if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: decode_bench [--enforce] [--quick]\n");
      return 2;
    }
  }
  std::unique_ptr<Engine> engine = std::move(Engine::Create({})).value();
  const int threads = engine->threads();
  const std::vector<Shape> shapes =
      quick ? std::vector<Shape>{{"B4 H8 S=2048 D64", 4, 8, 8, 2048, 64}}
            : std::vector<Shape>{{"B1 H32 S=32768 D128", 1, 32, 32, 32768, 128},
                                 {"B16 H8 S=4096 D64", 16, 8, 8, 4096, 64},
                                 {"B1 H32 Hk8 S=8192 D128", 1, 32, 8, 8192, 128}};
  bool ok = true;
  auto verdict = [&](bool pass) {
    ok &= pass;
    return pass ? "PASS" : "MISS";
  };
  const double probe = ReadBandwidth(size_t{1} << 30, threads);
  std::printf("memory-read probe: %d threads streaming 1 GiB: %.2f GB/s\n\n", threads,
              probe / 1e9);
  const double peak = MultiplyAddPeak(threads);
  if (peak > 0) {
    std::printf("multiply-add probe: %d threads of independent 16-lane FMAs: %.1f G/s\n", threads,
                peak / 1e9);
  }
  std::printf("\n%-24s %-9s %10s %10s %9s %10s %7s\n", "decode (1 row/session)", "cache",
              "step us", "GB/s read", "vs probe", "FMA peak", "target");
  // The share of the multiply-add peak a step used (blank without a probe).
  auto peak_used = [&](const Shape& s, const DecodeFigures& f, double element) {
    if (peak <= 0) return std::string();
    const double per_byte = static_cast<double>(s.heads / s.kv_heads) / element;
    char text[32];
    std::snprintf(text, sizeof text, "%.2fx", f.bytes_per_step / f.step_seconds * per_byte / peak);
    return std::string(text);
  };
  for (const Shape& s : shapes) {
    const DecodeFigures f32 = Decode(*engine, s, DType::kFloat32);
    const double rate = f32.bytes_per_step / f32.step_seconds;
    std::printf("%-24s %-9s %10.1f %10.2f %8.2fx %10s %7s\n", s.name, "FLOAT32",
                f32.step_seconds * 1e6, rate / 1e9, rate / probe, peak_used(s, f32, 4).c_str(),
                verdict(rate / probe >= kDecodeBandwidthRatio));
    // BFLOAT16 with float32 math (precision EXACT), and with bf16 dot
    // products (precision FAST): the target is the speed a caller who picks
    // the smaller cache for speed gets, FAST; EXACT is shown beside it.
    for (bool fast : {false, true}) {
      const DecodeFigures bf16 = Decode(*engine, s, DType::kBFloat16, fast);
      const double speed_up = f32.step_seconds / bf16.step_seconds;
      std::printf("%-24s %-9s %10.1f %10.2f %8.2fx %10s %7s  (steps/s vs FLOAT32: %.2fx)\n", s.name,
                  fast ? "BF16 FAST" : "BF16", bf16.step_seconds * 1e6,
                  bf16.bytes_per_step / bf16.step_seconds / 1e9,
                  bf16.bytes_per_step / bf16.step_seconds / probe,
                  fast ? "" : peak_used(s, bf16, 2).c_str(),
                  fast ? verdict(speed_up >= kBFloat16SpeedUp) : "", speed_up);
    }
  }
  const int64_t prefill = quick ? 1024 : 4096;
  const auto [session, stateless] = Prefill(*engine, 8, prefill, 64);
  std::printf("\nprefill H8 P=%lld D64 causal: session %.1f ms, stateless %.1f ms: %.2fx %s\n",
              static_cast<long long>(prefill), session * 1e3, stateless * 1e3, session / stateless,
              verdict(session / stateless <= kPrefillRatio));
  return enforce && !ok ? 1 : 0;
}

}  // namespace
}  // namespace attention

int main(int argc, char** argv) { return attention::Main(argc, argv); }
