// Checks the cost model (engine/cost.h) against what calls really take, for
// every score kind and a model layer, with and without weights:
//   - time: each case's flops per second, by the model's count, within
//     kRateFactor of the scaled-dot case's in the same run;
//   - memory: the peak RSS a call adds within kBytesFactor of the model's
//     bytes (plus kBytesSlack), both ways: the model may neither miss
//     allocations nor count far more than there are.
// Each case runs in a process of its own (this binary, re-run with --case),
// as peak RSS only ever grows. Timed, so not a unit test: deploy/bench.sh
// and CI's slower checks run it. Prints a table; exits 1 if a case is out.
//
//   cost_model_check            every case
//   cost_model_check --case N   one case, printing "flops bytes seconds peak_bytes"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/cost.h"
#include "engine/engine.h"
#include "engine/multihead.h"

namespace attention {
namespace {

// Stated factors (docs/benchmarks.md, "Cost model").
constexpr double kRateFactor = 3;
constexpr double kBytesFactor = 2;
constexpr double kBytesSlack = 8.0 * (1 << 20);

struct Case {
  const char* name;
  ScoreKind kind;
  bool need_weights;
  bool layer;
};

const Case kCases[] = {
    {"scaled_dot", ScoreKind::kScaledDot, false, false},
    {"scaled_dot+weights", ScoreKind::kScaledDot, true, false},
    {"dot", ScoreKind::kDot, false, false},
    {"additive", ScoreKind::kAdditive, false, false},
    {"bilinear", ScoreKind::kBilinear, false, false},
    {"cosine", ScoreKind::kCosine, false, false},
    {"neg_euclidean", ScoreKind::kNegEuclidean, false, false},
    {"gaussian", ScoreKind::kGaussian, false, false},
    {"gaussian+weights", ScoreKind::kGaussian, true, false},
    {"layer", ScoreKind::kScaledDot, false, true},
    {"layer+weights", ScoreKind::kScaledDot, true, true},
};

std::vector<float> Random(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.5f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

TensorView View(const std::vector<float>& v, std::vector<int64_t> shape) {
  return TensorView{DType::kFloat32, std::move(shape), v.data(), v.size() * sizeof(float)};
}

double PeakRssBytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) * 1024;
}

// Runs case `c` in this process; prints "flops bytes seconds peak_bytes".
int RunCase(const Case& c) {
  EngineOptions options;
  options.max_request_bytes = 0;
  options.max_request_flops = 0;
  options.max_score_elements = 0;
  std::unique_ptr<Engine> engine = std::move(Engine::Create(options)).value();

  // Raw: B1 H4 L=S=2048 D64 (the additive score: H1 L=S=1024, hidden 64).
  const bool additive = c.kind == ScoreKind::kAdditive;
  const int64_t heads = additive ? 1 : 4, len = additive ? 1024 : 2048, dim = 64;
  const int64_t embed = 256, layer_len = 2048;
  std::vector<float> q, k, v, w_q, w_k, w_v, w;
  AttentionArgs args;
  std::unique_ptr<MultiheadAttention> layer;
  if (c.layer) {
    MultiheadConfig config;
    config.embed_dim = embed;
    config.num_heads = 4;
    StateDict weights;
    for (const auto& [key, shape] : MultiheadAttention::ExpectedWeights(config)) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      Tensor t{shape, {}};
      std::vector<float> values = Random(n, 7);
      t.data.assign(values.begin(), values.end());
      for (float& x : t.data) x *= 0.1f;
      weights.emplace(key, std::move(t));
    }
    layer = std::move(MultiheadAttention::Create(config, std::move(weights))).value();
    q = Random(layer_len * embed, 1);
    args.query = View(q, {1, layer_len, embed});
  } else {
    q = Random(heads * len * dim, 1);
    k = Random(heads * len * dim, 2);
    v = Random(heads * len * dim, 3);
    args.query = View(q, {1, heads, len, dim});
    args.key = View(k, {1, heads, len, dim});
    args.value = View(v, {1, heads, len, dim});
    args.score.kind = c.kind;
    if (additive) {
      constexpr int64_t kHidden = 64;
      w_q = Random(kHidden * dim, 4);
      w_k = Random(kHidden * dim, 5);
      w_v = Random(kHidden, 6);
      args.score.w_q = View(w_q, {kHidden, dim});
      args.score.w_k = View(w_k, {kHidden, dim});
      args.score.w_v = View(w_v, {kHidden});
    } else if (c.kind == ScoreKind::kBilinear) {
      w = Random(dim * dim, 4);
      args.score.w = View(w, {dim, dim});
    }
  }
  args.need_weights = c.need_weights;
  const EngineCall call{&args, layer.get()};
  const absl::StatusOr<CallCost> cost = engine->CostOf(call);
  if (!cost.ok()) {
    std::fprintf(stderr, "%s: %s\n", c.name, cost.status().ToString().c_str());
    return 1;
  }
  // oneDNN's primitives and the threads' pools, made by a small call first,
  // are the process's, not this call's.
  {
    AttentionArgs small = args;
    std::vector<float> sq = Random(8 * (c.layer ? embed : heads * dim), 9);
    small.query = c.layer ? View(sq, {1, 8, embed}) : View(sq, {1, heads, 8, dim});
    if (!c.layer) small.key = small.value = small.query;
    (void)engine->AttendBatchFromThisThread({{&small, layer.get()}});
  }
  const double before = PeakRssBytes();
  double best = 1e300;
  for (int run = 0; run < 3; ++run) {
    const absl::Time start = absl::Now();
    const std::vector<absl::StatusOr<AttentionResult>> result =
        engine->AttendBatchFromThisThread({&call, 1});
    best = std::min(best, absl::ToDoubleSeconds(absl::Now() - start));
    if (!result.front().ok()) {
      std::fprintf(stderr, "%s: %s\n", c.name, result.front().status().ToString().c_str());
      return 1;
    }
  }
  std::printf("%.6g %.6g %.6g %.6g\n", cost->flops, cost->bytes(), best, PeakRssBytes() - before);
  return 0;
}

struct Measured {
  double flops = 0, bytes = 0, seconds = 0, peak = 0;
};

bool RunInChild(const char* self, int index, Measured* out) {
  const std::string command = std::string(self) + " --case " + std::to_string(index);
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return false;
  const int read =
      std::fscanf(pipe, "%lf %lf %lf %lf", &out->flops, &out->bytes, &out->seconds, &out->peak);
  return pclose(pipe) == 0 && read == 4;
}

int RunAll(const char* self) {
  constexpr int n = sizeof(kCases) / sizeof(kCases[0]);
  std::vector<Measured> measured(n);
  for (int i = 0; i < n; ++i) {
    if (!RunInChild(self, i, &measured[i])) {
      std::fprintf(stderr, "case %s failed to run\n", kCases[i].name);
      return 1;
    }
  }
  const double base_rate = measured[0].flops / measured[0].seconds;
  std::printf("Cost model vs measured (rates relative to scaled_dot, %.1f GFLOP/s here)\n",
              base_rate / 1e9);
  std::printf("%-20s %9s %8s %9s %10s %10s %7s  %s\n", "case", "GFLOP", "ms", "GFLOP/s",
              "model MiB", "peak MiB", "ratio", "verdict");
  int failures = 0;
  for (int i = 0; i < n; ++i) {
    const Measured& m = measured[i];
    const double rate = m.flops / m.seconds;
    const double rate_ratio = rate / base_rate;
    const bool rate_ok = rate_ratio <= kRateFactor && rate_ratio >= 1 / kRateFactor;
    const bool bytes_ok = m.peak <= kBytesFactor * m.bytes + kBytesSlack &&
                          m.bytes <= kBytesFactor * m.peak + kBytesSlack;
    const char* verdict = rate_ok && bytes_ok ? "ok" : !rate_ok ? "RATE OUT" : "BYTES OUT";
    if (!(rate_ok && bytes_ok)) ++failures;
    std::printf("%-20s %9.2f %8.1f %9.1f %10.1f %10.1f %7.2f  %s\n", kCases[i].name, m.flops / 1e9,
                m.seconds * 1e3, rate / 1e9, m.bytes / 1048576, m.peak / 1048576, rate_ratio,
                verdict);
  }
  std::printf(
      "Limits: rate within %.0fx of scaled_dot's; peak RSS within %.0fx of the model's "
      "bytes, +%.0f MiB, both ways.\n",
      kRateFactor, kBytesFactor, kBytesSlack / 1048576);
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace attention

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "--case") == 0) {
    const int index = std::atoi(argv[2]);
    constexpr int n = sizeof(attention::kCases) / sizeof(attention::kCases[0]);
    if (index < 0 || index >= n) return 2;
    return attention::RunCase(attention::kCases[index]);
  }
  if (argc != 1) {
    std::fprintf(stderr, "usage: %s [--case N]\n", argv[0]);
    return 2;
  }
  char self[4096] = {};
  if (readlink("/proc/self/exe", self, sizeof(self) - 1) <= 0) return 1;
  return attention::RunAll(self);
}
