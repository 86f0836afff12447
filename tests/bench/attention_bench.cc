// attention_bench: attention throughput of the fused, oneDNN-with-weights and
// reference paths, as GFLOPS and as ratios of oneDNN's own GEMM measured in the
// same run; throughput of one and two concurrent callers; and a peak-RSS check
// of a long fused call. docs/benchmarks.md.

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "benchmark/benchmark.h"
#include "engine/engine.h"
#include "engine/gemm_baseline.h"
#include "common/half.h"
#include "common/status_macros.h"

namespace attention {
namespace {

constexpr double kGiga = 1e9;
constexpr double kMiB = 1024.0 * 1024.0;
constexpr int64_t kGemmSize = 2048;
constexpr double kMaxPeakRssGrowthMiB = 256;
constexpr char kGflops[] = "GFLOPS";
constexpr char kCallsPerSecond[] = "calls/s";
constexpr char kMemoryCheckFlag[] = "--memory_check";
// Google Benchmark flags with another default here: medians of interleaved
// repetitions keep the ratios steady on a busy machine.
constexpr std::pair<const char*, const char*> kFlagDefaults[] = {
    {"--benchmark_repetitions", "3"},
    {"--benchmark_enable_random_interleaving", "true"},
};

struct Shape {
  int64_t batch = 1;
  int64_t heads = 1;
  int64_t query_len = 1;
  int64_t key_len = 1;
  int64_t head_dim = 1;
  bool causal = false;

  std::string Name() const {
    return absl::StrCat("B", batch, "_H", heads, "_L", query_len, "_S", key_len, "_D", head_dim,
                        causal ? "_causal" : "");
  }
  // Q K^T and P V at 2 flops per multiply-add; a causal call skips the masked half.
  // The matmuls only, comparable with the GEMM's flops (engine/cost.h, the
  // limits' count, also counts the softmax and score work).
  double Flops() const {
    const double dense = 4.0 * batch * heads * query_len * key_len * head_dim;
    return causal ? dense / 2 : dense;
  }
  double ScoreMatrixBytes() const { return 4.0 * batch * heads * query_len * key_len; }
};

enum class Path {
  kFused,      // kOneDnn, need_weights = false
  kWeights,    // kOneDnn, need_weights = true
  kReference,  // kReference, need_weights = false
};

enum class Precision {
  kFloat32,   // FLOAT32 inputs
  kBFloat16,  // BFLOAT16 inputs
  kFast,      // FLOAT32 inputs, args.fast
};

enum class Baseline { kF32Gemm, kBf16Gemm, kFusedF32 };
constexpr Baseline kBaselines[] = {Baseline::kF32Gemm, Baseline::kBf16Gemm, Baseline::kFusedF32};

struct Target {
  Baseline baseline;
  double min_ratio;
};

struct AttentionCase {
  Path path;
  Precision precision;
  Shape shape;
  std::optional<Target> target;

  std::string Name() const {
    static constexpr const char* kPaths[] = {"fused", "onednn", "reference"};
    static constexpr const char* kPrecisions[] = {"", "_bf16", "_fast"};
    return absl::StrCat(kPaths[static_cast<int>(path)], kPrecisions[static_cast<int>(precision)],
                        "/", shape.Name());
  }
  std::string FusedF32Name() const {
    return AttentionCase{Path::kFused, Precision::kFloat32, shape, std::nullopt}.Name();
  }
};

const Shape kLongShape{1, 8, 2048, 2048, 64};
const Shape kBatchedShape{8, 8, 512, 512, 64};
const Shape kShortShape{32, 8, 64, 64, 64};
const Shape kCausalShape{1, 1, 8192, 8192, 64, true};
const Shape kWideShape{4, 16, 1024, 1024, 128};
const Shape kMemoryShape{1, 1, 32768, 32768, 64};

// In run order: a ratio to "fused f32 of the same shape" needs that case first.
std::vector<AttentionCase> AttentionCases() {
  const Target fused{Baseline::kF32Gemm, 0.70};
  const Target causal{Baseline::kF32Gemm, 0.60};
  const Target weights{Baseline::kF32Gemm, 0.40};
  const Target bf16_weights{Baseline::kBf16Gemm, 0.40};
  const Target bf16{Baseline::kFusedF32, 1.60};
  return {
      {Path::kFused, Precision::kFloat32, kLongShape, fused},
      {Path::kFused, Precision::kFloat32, kBatchedShape, fused},
      {Path::kFused, Precision::kFloat32, kShortShape, std::nullopt},
      {Path::kFused, Precision::kFloat32, kCausalShape, causal},
      {Path::kFused, Precision::kFloat32, kWideShape, std::nullopt},
      {Path::kFused, Precision::kBFloat16, kWideShape, bf16},
      {Path::kFused, Precision::kFast, kWideShape, bf16},
      {Path::kWeights, Precision::kFloat32, kLongShape, weights},
      {Path::kWeights, Precision::kFloat32, kBatchedShape, weights},
      {Path::kWeights, Precision::kFloat32, kShortShape, weights},
      {Path::kWeights, Precision::kFloat32, kCausalShape, weights},
      {Path::kWeights, Precision::kBFloat16, kWideShape, bf16_weights},
      {Path::kReference, Precision::kFloat32, kShortShape, std::nullopt},
      {Path::kReference, Precision::kFloat32, kBatchedShape, std::nullopt},
  };
}

// Callers of fused f32 at kConcurrencyShape at once, all on one engine or each
// on its own. GFLOPS and calls/s are totals over the callers.
struct ConcurrencyCase {
  int callers;
  bool own_engines;

  // The function name; Google Benchmark adds "/real_time/threads:<callers>".
  std::string Name() const;
  std::string Key() const { return absl::StrCat(Name(), "/threads:", callers); }
};

const Shape kConcurrencyShape = kBatchedShape;
// The first is the baseline of the others' ratios.
constexpr ConcurrencyCase kConcurrencyCases[] = {{1, false}, {2, false}, {2, true}};

std::string ConcurrencyCase::Name() const {
  return absl::StrCat("concurrent/", own_engines ? "own_engines" : "one_engine", "/fused/",
                      kConcurrencyShape.Name());
}

constexpr bool kGemmBf16[] = {false, true};

std::string GemmName(bool bf16) {
  return absl::StrCat("gemm/", bf16 ? "bf16" : "f32", "/M", kGemmSize, "_N", kGemmSize, "_K",
                      kGemmSize);
}

std::string MemoryCheckName() { return absl::StrCat("memory check, fused/", kMemoryShape.Name()); }

// One T per key, built on first use and kept for the life of the process.
// Thread-safe.
template <typename T>
absl::StatusOr<T*> Shared(const std::string& key,
                          const std::function<absl::StatusOr<std::unique_ptr<T>>()>& make) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* cache = new std::map<std::string, absl::StatusOr<std::unique_ptr<T>>>();
  absl::MutexLock lock(&mu);
  auto it = cache->find(key);
  if (it == cache->end()) it = cache->emplace(key, make()).first;
  if (!it->second.ok()) return it->second.status();
  return it->second->get();
}

// Instance 0 of the oneDNN engine is the one every single-caller benchmark
// uses; other instances are further engines of the same options.
absl::StatusOr<Engine*> SharedEngine(Backend backend, int instance = 0) {
  const std::string key = backend == Backend::kReference ? "reference" : "onednn";
  return Shared<Engine>(instance == 0 ? key : absl::StrCat(key, "#", instance), [backend] {
    EngineOptions options;
    options.backend = backend;
    options.max_tensor_elements = 0;
    options.max_score_elements = 0;
    return Engine::Create(options);
  });
}

struct OwnedTensor {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::string bytes;

  TensorView view() const { return TensorView{dtype, shape, bytes.data(), bytes.size()}; }
};

// Uniform in [-1, 1), FLOAT32 or BFLOAT16.
OwnedTensor RandomTensor(DType dtype, std::vector<int64_t> shape, uint32_t seed) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  OwnedTensor t{dtype, std::move(shape), std::string(count * DTypeSize(dtype), '\0')};
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  char* out = t.bytes.data();
  for (int64_t i = 0; i < count; ++i) {
    const float x = dist(rng);
    if (dtype == DType::kBFloat16) {
      const uint16_t b = FloatToBFloat16(x);
      std::memcpy(out + 2 * i, &b, sizeof b);
    } else {
      std::memcpy(out + 4 * i, &x, sizeof x);
    }
  }
  return t;
}

struct AttentionInputs {
  OwnedTensor query, key, value;

  double bytes() const { return query.bytes.size() + key.bytes.size() + value.bytes.size(); }
};

std::unique_ptr<AttentionInputs> MakeInputs(const Shape& s, DType dtype) {
  const int64_t b = s.batch, h = s.heads, d = s.head_dim;
  return std::make_unique<AttentionInputs>(AttentionInputs{
      RandomTensor(dtype, {b, h, s.query_len, d}, 1), RandomTensor(dtype, {b, h, s.key_len, d}, 2),
      RandomTensor(dtype, {b, h, s.key_len, d}, 3)});
}

AttentionArgs MakeArgs(const AttentionInputs& inputs, const Shape& shape, Path path,
                       Precision precision) {
  AttentionArgs args;
  args.query = inputs.query.view();
  args.key = inputs.key.view();
  args.value = inputs.value.view();
  args.mask.causal = shape.causal ? Causal::kTopLeft : Causal::kNone;
  args.need_weights = path == Path::kWeights;
  args.fast = precision == Precision::kFast;
  return args;
}

// Totals over the benchmark's threads: every thread sets the same values, and
// kAvgThreads undoes the sum Google Benchmark makes of them.
void SetRates(benchmark::State& state, double flops_per_call) {
  const benchmark::Counter::Flags flags =
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kAvgThreads;
  state.counters[kGflops] = benchmark::Counter(flops_per_call / kGiga, flags);
  state.counters[kCallsPerSecond] = benchmark::Counter(1, flags);
}

// Times Attend of `c` from `state.threads()` callers at once: all on oneDNN
// engine instance 0 (or the reference engine), or with `own_engines` caller i
// on instance i. With `warm_up` each caller first makes one untimed call, so
// primitive creation stays out of the figures.
void TimeAttend(benchmark::State& state, const AttentionCase& c, bool own_engines, bool warm_up) {
  const absl::StatusOr<Engine*> engine =
      SharedEngine(c.path == Path::kReference ? Backend::kReference : Backend::kOneDnn,
                   own_engines ? state.thread_index() : 0);
  if (!engine.ok()) {
    state.SkipWithError(engine.status().ToString().c_str());
    return;
  }
  const DType dtype = c.precision == Precision::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
  const absl::StatusOr<AttentionInputs*> inputs =
      Shared<AttentionInputs>(absl::StrCat(c.shape.Name(), DTypeName(dtype)),
                              [&]() -> absl::StatusOr<std::unique_ptr<AttentionInputs>> {
                                return MakeInputs(c.shape, dtype);
                              });
  const AttentionArgs args = MakeArgs(**inputs, c.shape, c.path, c.precision);
  if (warm_up) {
    const absl::StatusOr<AttentionResult> result = (*engine)->Attend(args);
    if (!result.ok()) {
      state.SkipWithError(result.status().ToString().c_str());
      return;
    }
  }
  for (auto _ : state) {
    absl::StatusOr<AttentionResult> result = (*engine)->Attend(args);
    if (!result.ok()) {
      state.SkipWithError(result.status().ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(result->output.data.data());
  }
  SetRates(state, c.shape.Flops());
}

// One caller; only the first run of each case (`warmed` false) warms up.
void BM_Attention(benchmark::State& state, const AttentionCase& c, bool& warmed) {
  TimeAttend(state, c, /*own_engines=*/false, /*warm_up=*/!warmed);
  warmed = true;
}

// Every run warms up: a caller's own engine may be new.
void BM_Concurrent(benchmark::State& state, const ConcurrencyCase& c) {
  TimeAttend(state, {Path::kFused, Precision::kFloat32, kConcurrencyShape, std::nullopt},
             c.own_engines, /*warm_up=*/true);
}

// Bytes of a "VmRSS" / "VmHWM" line of /proc/self/status.
absl::StatusOr<double> ProcStatusBytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1)) * 1024;
  }
  return absl::UnavailableError(absl::StrCat("no ", field, " in /proc/self/status"));
}

// Sets VmHWM to the current VmRSS (Linux >= 4.0).
absl::Status ResetPeakRss() {
  std::ofstream clear_refs("/proc/self/clear_refs");
  clear_refs << "5";
  clear_refs.close();
  if (!clear_refs) return absl::UnavailableError("cannot write 5 to /proc/self/clear_refs");
  return absl::OkStatus();
}

// What one fused call at kMemoryShape did to peak RSS.
struct MemoryCheck {
  double input_bytes = 0;
  double peak_rss_growth_bytes = 0;
  double seconds = 0;

  std::string Summary() const {
    const double growth_mib = peak_rss_growth_bytes / kMiB;
    return absl::StrFormat(
        "%s: one cold call, %.2f s (%.1f GFLOPS); peak RSS grew %.1f MiB over its %.1f MiB of "
        "inputs "
        "(target < %.0f MiB): %s; a materialised L x S f32 score matrix would be %.0f MiB.",
        MemoryCheckName(), seconds, kMemoryShape.Flops() / kGiga / seconds, growth_mib,
        input_bytes / kMiB, kMaxPeakRssGrowthMiB,
        growth_mib < kMaxPeakRssGrowthMiB ? "pass" : "FAIL",
        kMemoryShape.ScoreMatrixBytes() / kMiB);
  }
};

// Growth is VmHWM after the call minus VmRSS before it, with the engine
// started and the inputs allocated. Run it before any other call in the
// process, so no earlier call has left memory resident for this one to reuse.
absl::StatusOr<MemoryCheck> RunMemoryCheck() {
  ATTN_ASSIGN_OR_RETURN(Engine * engine, SharedEngine(Backend::kOneDnn));
  const std::unique_ptr<AttentionInputs> inputs = MakeInputs(kMemoryShape, DType::kFloat32);
  const AttentionArgs args = MakeArgs(*inputs, kMemoryShape, Path::kFused, Precision::kFloat32);
  ATTN_ASSIGN_OR_RETURN(const double rss_before, ProcStatusBytes("VmRSS"));
  ATTN_RETURN_IF_ERROR(ResetPeakRss());
  const auto start = std::chrono::steady_clock::now();
  ATTN_RETURN_IF_ERROR(engine->Attend(args).status());
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  ATTN_ASSIGN_OR_RETURN(const double peak, ProcStatusBytes("VmHWM"));
  return MemoryCheck{inputs->bytes(), peak - rss_before, elapsed.count()};
}

// oneDNN's own matmul on the benchmark thread, with OpenMP's default threads.
void BM_Gemm(benchmark::State& state, bool bf16) {
  const absl::StatusOr<GemmBaseline*> gemm = Shared<GemmBaseline>(
      GemmName(bf16), [bf16] { return GemmBaseline::Create(kGemmSize, bf16); });
  absl::Status warm_up = gemm.ok() ? (*gemm)->Run() : gemm.status();
  if (!warm_up.ok()) {
    state.SkipWithError(warm_up.ToString().c_str());
    return;
  }
  for (auto _ : state) {
    if (absl::Status status = (*gemm)->Run(); !status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      break;
    }
  }
  SetRates(state, (*gemm)->flops());
}

// The console output: one line per benchmark (the median when repeated, with
// its coefficient of variation), each attention line labelled with its ratios
// to the same-run baselines. A line waits until its baselines have finished
// (repetitions may be interleaved), and a summary table comes at the end.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  // `engine_threads`: the compute threads of each oneDNN engine.
  RatioReporter(OutputOptions options, std::vector<AttentionCase> cases, int engine_threads)
      : ConsoleReporter(options), cases_(std::move(cases)), engine_threads_(engine_threads) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (run.error_occurred || !run.counters.contains(kGflops)) continue;
      if (run.run_type == Run::RT_Iteration || run.aggregate_name == "median") {
        counters_[Key(run)] = run.counters;
      }
    }
    // A repeated benchmark shows only its median, which comes in a later call;
    // errors show at once.
    if (!runs.empty() && runs[0].run_type == Run::RT_Iteration && runs[0].repetitions > 1 &&
        !runs[0].error_occurred) {
      return;
    }
    pending_.push_back(Shown(runs));
    PrintReady(/*all=*/false);
  }

  void Finalize() override {
    PrintReady(/*all=*/true);
    ConsoleReporter::Finalize();
  }

  void PrintSummary(std::ostream& out) const {
    std::vector<std::string> rows;
    for (bool bf16 : kGemmBf16) {
      if (std::optional<double> gflops = Gflops(GemmName(bf16))) {
        rows.push_back(absl::StrFormat("%-44s %8.1f", GemmName(bf16), *gflops));
      }
    }
    bool any_causal = false;
    for (const AttentionCase& c : cases_) {
      if (std::optional<double> gflops = Gflops(c.Name())) {
        rows.push_back(SummaryRow(c, *gflops));
        any_causal |= c.shape.causal;
      }
    }
    if (!rows.empty()) {
      out << "\nSummary: ratios to baselines measured in this run; targets are informational.\n"
          << absl::StrFormat("%-44s %8s %12s %12s %12s  %-28s %s\n", "benchmark", "GFLOPS",
                             "x f32 GEMM", "x bf16 GEMM", "x fused f32", "target", "result")
          << absl::StrJoin(rows, "\n") << "\n";
    }
    if (any_causal) {
      out << "Causal rows count only the unmasked half (2*B*H*L*S*D flops per call), so their "
             "GFLOPS and ratios are for the work a causal call has to do.\n";
    }
    PrintConcurrency(out);
  }

 private:
  // "name" of a benchmark without Threads(), "name/threads:N" of one with.
  static std::string Key(const Run& run) {
    const std::string& threads = run.run_name.threads;
    return threads.empty() ? run.run_name.function_name
                           : absl::StrCat(run.run_name.function_name, "/", threads);
  }

  void PrintConcurrency(std::ostream& out) const {
    const std::optional<double> one_caller = Counter(kConcurrencyCases[0].Key(), kCallsPerSecond);
    std::vector<std::string> rows;
    for (const ConcurrencyCase& c : kConcurrencyCases) {
      const std::optional<double> calls = Counter(c.Key(), kCallsPerSecond);
      const std::optional<double> gflops = Counter(c.Key(), kGflops);
      if (!calls || !gflops) continue;
      const std::string threads = c.own_engines ? absl::StrCat(c.callers, " x ", engine_threads_)
                                                : absl::StrCat(engine_threads_);
      const std::string who =
          absl::StrFormat("%d caller%s, %s (%s threads)", c.callers, c.callers == 1 ? "" : "s",
                          c.own_engines ? "one engine each" : "one engine", threads);
      rows.push_back(absl::StrFormat("%-44s %8.1f %8.2f %12s", who, *gflops, *calls,
                                     RatioCell(*calls, one_caller)));
    }
    if (rows.empty()) return;
    out << "\nConcurrency: fused/" << kConcurrencyShape.Name()
        << " f32; GFLOPS and calls/s are totals over the callers.\n"
        << absl::StrFormat("%-44s %8s %8s %12s\n", "callers", "GFLOPS", "calls/s", "x 1 caller")
        << absl::StrJoin(rows, "\n") << "\n"
        << "One engine runs one call at a time on its threads, so a second caller should "
           "neither add nor lose throughput (~1.00x); with an engine each, the callers' "
           "threads oversubscribe the cores.\n";
  }

  static const char* BaselineName(Baseline baseline) {
    switch (baseline) {
      case Baseline::kF32Gemm:
        return "f32 GEMM";
      case Baseline::kBf16Gemm:
        return "bf16 GEMM";
      case Baseline::kFusedF32:
        return "fused f32";
    }
    return "";
  }

  static std::optional<double> Ratio(double gflops, std::optional<double> baseline) {
    if (!baseline || *baseline <= 0) return std::nullopt;
    return gflops / *baseline;
  }

  static std::string RatioCell(double gflops, std::optional<double> baseline) {
    const std::optional<double> ratio = Ratio(gflops, baseline);
    return ratio ? absl::StrFormat("%.2fx", *ratio) : "n/a";
  }

  // The median row alone, labelled with the spread, when `runs` has one.
  static std::vector<Run> Shown(const std::vector<Run>& runs) {
    const Run* median = nullptr;
    const Run* cv = nullptr;
    for (const Run& run : runs) {
      if (run.run_type != Run::RT_Aggregate) continue;
      if (run.aggregate_name == "median") median = &run;
      if (run.aggregate_name == "cv") cv = &run;
    }
    if (median == nullptr) return runs;
    Run shown = *median;
    if (cv != nullptr) {
      if (const auto spread = cv->counters.find(kGflops); spread != cv->counters.end()) {
        shown.report_label = absl::StrFormat("cv %.1f%%", 100 * spread->second.value);
      }
    }
    return {shown};
  }

  // Prints the pending benchmarks, in the order they finished, up to the first
  // whose baselines are still running (unless `all`).
  void PrintReady(bool all) {
    while (!pending_.empty() && (all || Ready(pending_.front()))) {
      std::vector<Run> runs = std::move(pending_.front());
      pending_.pop_front();
      for (Run& run : runs) {
        const AttentionCase* c = FindCase(run.run_name.function_name);
        const auto gflops = run.counters.find(kGflops);
        if (c == nullptr || run.error_occurred || gflops == run.counters.end()) continue;
        std::vector<std::string> label = {RatioText(*c, gflops->second.value)};
        if (!run.report_label.empty()) label.push_back(run.report_label);
        run.report_label = absl::StrJoin(label, "; ");
      }
      ConsoleReporter::ReportRuns(runs);
    }
  }

  bool Ready(const std::vector<Run>& runs) const {
    const AttentionCase* c = runs.empty() ? nullptr : FindCase(runs[0].run_name.function_name);
    if (c == nullptr) return true;
    for (Baseline baseline : kBaselines) {
      if (Compared(*c, baseline) && !BaselineGflops(*c, baseline)) return false;
    }
    return true;
  }

  const AttentionCase* FindCase(const std::string& name) const {
    for (const AttentionCase& c : cases_) {
      if (c.Name() == name) return &c;
    }
    return nullptr;
  }

  // Per Key(): a counter of the run, or its median over repetitions.
  std::optional<double> Counter(const std::string& key, const std::string& counter) const {
    const auto it = counters_.find(key);
    if (it == counters_.end()) return std::nullopt;
    const auto value = it->second.find(counter);
    if (value == it->second.end()) return std::nullopt;
    return value->second.value;
  }

  std::optional<double> Gflops(const std::string& key) const { return Counter(key, kGflops); }

  std::optional<double> BaselineGflops(const AttentionCase& c, Baseline baseline) const {
    switch (baseline) {
      case Baseline::kF32Gemm:
        return Gflops(GemmName(/*bf16=*/false));
      case Baseline::kBf16Gemm:
        return Gflops(GemmName(/*bf16=*/true));
      case Baseline::kFusedF32:
        return Gflops(c.FusedF32Name());
    }
    return std::nullopt;
  }

  // Every case against the f32 GEMM; bf16 cases also against the bf16 GEMM
  // and fused f32 of the same shape.
  static bool Compared(const AttentionCase& c, Baseline baseline) {
    return baseline == Baseline::kF32Gemm || c.precision != Precision::kFloat32;
  }

  std::string RatioText(const AttentionCase& c, double gflops) const {
    std::vector<std::string> parts;
    for (Baseline baseline : kBaselines) {
      std::optional<double> ratio = Ratio(gflops, BaselineGflops(c, baseline));
      if (Compared(c, baseline) && ratio) {
        parts.push_back(absl::StrFormat("%.2fx %s", *ratio, BaselineName(baseline)));
      }
    }
    if (c.shape.causal) parts.push_back("causal: flops count only the unmasked half");
    return absl::StrJoin(parts, ", ");
  }

  std::string SummaryRow(const AttentionCase& c, double gflops) const {
    std::string row = absl::StrFormat("%-44s %8.1f", c.Name(), gflops);
    for (Baseline baseline : kBaselines) {
      absl::StrAppendFormat(
          &row, " %12s",
          Compared(c, baseline) ? RatioCell(gflops, BaselineGflops(c, baseline)) : "");
    }
    if (c.target) {
      std::string target =
          absl::StrFormat(">= %.2fx %s", c.target->min_ratio, BaselineName(c.target->baseline));
      if (c.shape.causal) absl::StrAppend(&target, " (unmasked)");
      const std::optional<double> ratio = Ratio(gflops, BaselineGflops(c, c.target->baseline));
      absl::StrAppendFormat(&row, "  %-28s %s", target,
                            !ratio                          ? "n/a"
                            : *ratio >= c.target->min_ratio ? "pass"
                                                            : "FAIL");
    }
    return row;
  }

  std::vector<AttentionCase> cases_;
  int engine_threads_;
  std::map<std::string, benchmark::UserCounters> counters_;
  std::deque<std::vector<Run>> pending_;
};

// Registers in run order: the GEMM baselines first (every ratio needs them),
// then the attention cases, then the concurrent callers.
void RegisterBenchmarks(const std::vector<AttentionCase>& cases) {
  for (bool bf16 : kGemmBf16) {
    benchmark::RegisterBenchmark(GemmName(bf16).c_str(), BM_Gemm, bf16)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  // The reference has no primitives to build and is slow: no untimed call, one
  // iteration, one repetition.
  for (const AttentionCase& c : cases) {
    benchmark::internal::Benchmark* b = benchmark::RegisterBenchmark(
        c.Name().c_str(), [c, warmed = c.path == Path::kReference](
                              benchmark::State& state) mutable { BM_Attention(state, c, warmed); });
    b->UseRealTime()->Unit(benchmark::kMillisecond);
    if (c.path == Path::kReference) b->Iterations(1)->Repetitions(1);
  }
  for (const ConcurrencyCase& c : kConcurrencyCases) {
    benchmark::RegisterBenchmark(c.Name().c_str(), BM_Concurrent, c)
        ->Threads(c.callers)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
}

// True for the filters Google Benchmark reads as "run everything".
bool SelectsAll(const std::string& filter) {
  return filter.empty() || filter == "all" || filter == ".";
}

// The user's filter, widened to keep the GEMM baselines the ratios need.
std::string FilterWithBaselines(const std::string& filter) {
  if (SelectsAll(filter) || filter[0] == '-') return filter;
  return absl::StrCat("^gemm/|", filter);
}

void PrintHelp() {
  benchmark::PrintDefaultHelp();
  std::cout << "          [" << kMemoryCheckFlag << "]\n\nDefaults here:";
  for (const auto& [flag, value] : kFlagDefaults) std::cout << " " << flag << "=" << value;
  std::cout << ".\nWithout --benchmark_filter the run starts with the peak-RSS check ("
            << MemoryCheckName() << "); " << kMemoryCheckFlag
            << " runs only that.\nThe GEMM baselines run with any --benchmark_filter.\n";
}

// The value of `flag` in `args` ("true" when bare), or nullopt when absent.
std::optional<std::string> FlagValue(const std::vector<std::string>& args,
                                     const std::string& flag) {
  for (const std::string& arg : args) {
    if (arg == flag) return "true";
    if (arg.rfind(flag + "=", 0) == 0) return arg.substr(flag.size() + 1);
  }
  return std::nullopt;
}

int Main(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  const bool memory_check_only = std::erase(args, kMemoryCheckFlag) > 0;
  const std::optional<std::string> list_tests = FlagValue(args, "--benchmark_list_tests");
  const bool listing = list_tests && *list_tests != "false" && *list_tests != "0";
  for (const auto& [flag, value] : kFlagDefaults) {
    if (!FlagValue(args, flag)) args.push_back(absl::StrCat(flag, "=", value));
  }
  std::vector<char*> arg_pointers;
  for (std::string& arg : args) arg_pointers.push_back(arg.data());
  int arg_count = static_cast<int>(arg_pointers.size());
  benchmark::Initialize(&arg_count, arg_pointers.data(), PrintHelp);
  if (benchmark::ReportUnrecognizedArguments(arg_count, arg_pointers.data())) return 1;
  const std::string filter = benchmark::GetBenchmarkFilter();

  int engine_threads = 0;
  if (absl::StatusOr<Engine*> engine = SharedEngine(Backend::kOneDnn); engine.ok()) {
    engine_threads = (*engine)->threads();
    benchmark::AddCustomContext("onednn_isa", (*engine)->isa());
    benchmark::AddCustomContext("onednn_threads", absl::StrCat(engine_threads));
  } else {
    std::cerr << "oneDNN engine unavailable: " << engine.status() << "\n";
  }
  std::optional<MemoryCheck> memory_check;
  if (memory_check_only || (SelectsAll(filter) && !listing)) {
    std::cout << MemoryCheckName() << "..." << std::endl;
    if (absl::StatusOr<MemoryCheck> check = RunMemoryCheck(); check.ok()) {
      memory_check = *check;
      std::cout << memory_check->Summary() << "\n\n";
    } else {
      std::cerr << "memory check failed: " << check.status() << "\n";
    }
  }
  if (memory_check_only) return 0;

  const std::vector<AttentionCase> cases = AttentionCases();
  RegisterBenchmarks(cases);
  benchmark::SetBenchmarkFilter(FilterWithBaselines(filter));
  RatioReporter reporter(
      isatty(STDOUT_FILENO) ? RatioReporter::OO_ColorTabular : RatioReporter::OO_Tabular, cases,
      engine_threads);
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.PrintSummary(std::cout);
  if (memory_check) std::cout << memory_check->Summary() << "\n";
  benchmark::Shutdown();
  return 0;
}

}  // namespace
}  // namespace attention

int main(int argc, char** argv) { return attention::Main(argc, argv); }
