#include "engine/reference.h"

#include <cmath>
#include <limits>
#include <vector>

#include "common/status_macros.h"
#include "engine/backend.h"
#include "engine/internal.h"

namespace attention::internal {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Row-major strides of `shape` right-aligned into `rank` dims, 0 where a dim
// is 1 (broadcast) or missing.
std::vector<int64_t> BroadcastStrides(const std::vector<int64_t>& shape, size_t rank) {
  std::vector<int64_t> strides(rank, 0);
  int64_t stride = 1;
  for (size_t k = 0; k < shape.size(); ++k) {
    size_t src = shape.size() - 1 - k;
    size_t dst = rank - 1 - k;
    strides[dst] = shape[src] == 1 ? 0 : stride;
    stride *= shape[src];
  }
  return strides;
}

// Every mask of a call, evaluated per (b, h, i, j).
class Masks {
 public:
  Masks(const MaskSpec& m, const AttentionShape& s)
      : causal_(m.causal), query_len_(s.query_len), masked_keys_(s.key_len - m.unmasked_tail) {
    if (m.valid_lens.present()) {
      lens_ = LoadInts(m.valid_lens);
      lens_per_row_ = m.valid_lens.shape.size() == 2;
      lens_batch_stride_ = m.valid_lens.shape[0] == 1 ? 0 : (lens_per_row_ ? s.query_len : 1);
    }
    if (m.key_padding_mask.present()) {
      Load(m.key_padding_mask, &padding_);
      padding_.strides = BroadcastStrides(m.key_padding_mask.shape, 2);
    }
    if (m.attn_mask.present()) {
      Load(m.attn_mask, &attn_);
      std::vector<int64_t> shape = m.attn_mask.shape;
      if (shape.size() == 3) shape.insert(shape.begin() + 1, 1);  // [B, L, S] -> [B, 1, L, S]
      attn_.strides = BroadcastStrides(shape, 4);
    }
  }

  // The additive bias for (b, h, i, j); -inf when masked out.
  double Bias(int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (j >= masked_keys_) return 0.0;
    if (causal_ == Causal::kTopLeft && j > i) return kNegInf;
    if (causal_ == Causal::kBottomRight && j > i + (masked_keys_ - query_len_)) return kNegInf;
    if (!lens_.empty()) {
      int64_t len = lens_[b * lens_batch_stride_ + (lens_per_row_ ? i : 0)];
      if (j >= len) return kNegInf;
    }
    double bias = 0;
    if (padding_.present) {
      bias += padding_.At(b * padding_.strides[0] + j * padding_.strides[1]);
    }
    if (attn_.present) {
      const auto& st = attn_.strides;
      bias += attn_.At(b * st[0] + h * st[1] + i * st[2] + j * st[3]);
    }
    return bias;
  }

 private:
  struct Tensor4 {
    bool present = false;
    bool is_bool = false;
    std::vector<float> values;
    std::vector<uint8_t> flags;
    std::vector<int64_t> strides;

    double At(int64_t idx) const {
      if (is_bool) return flags[idx] ? kNegInf : 0.0;
      return values[idx];
    }
  };

  static void Load(const TensorView& v, Tensor4* t) {
    t->present = true;
    t->is_bool = v.dtype == DType::kBool;
    if (t->is_bool) {
      t->flags = LoadBools(v);
    } else {
      t->values = LoadFloats(v);
    }
  }

  Causal causal_;
  int64_t query_len_;
  int64_t masked_keys_;
  std::vector<int64_t> lens_;
  bool lens_per_row_ = false;
  int64_t lens_batch_stride_ = 0;
  Tensor4 padding_, attn_;
};

// Score of one (query row, key row) pair before scale and masks.
class Scorer {
 public:
  Scorer(const AttentionArgs& args, const AttentionShape& s)
      : kind_(args.score.kind), dq_(s.query_dim), dk_(s.key_dim) {
    if (kind_ == ScoreKind::kAdditive) {
      w_q_ = LoadFloats(args.score.w_q);
      w_k_ = LoadFloats(args.score.w_k);
      w_v_ = LoadFloats(args.score.w_v);
      hidden_ = args.score.w_v.shape[0];
      projected_q_.resize(hidden_);
    } else if (kind_ == ScoreKind::kBilinear) {
      w_ = LoadFloats(args.score.w);
      projected_q_.resize(dk_);
    }
    if (kind_ == ScoreKind::kGaussian) {
      double bw = args.score.bandwidth.value_or(1.0);
      gaussian_factor_ = -bw * bw / 2.0;
    }
  }

  // Precomputes what depends on the query row only.
  void SetQuery(const float* q) {
    q_ = q;
    if (kind_ == ScoreKind::kAdditive) {
      for (int64_t u = 0; u < hidden_; ++u) {
        double acc = 0;
        for (int64_t d = 0; d < dq_; ++d) acc += double{w_q_[u * dq_ + d]} * q[d];
        projected_q_[u] = acc;
      }
    } else if (kind_ == ScoreKind::kBilinear) {
      for (int64_t e = 0; e < dk_; ++e) {
        double acc = 0;
        for (int64_t d = 0; d < dq_; ++d) acc += double{q[d]} * w_[d * dk_ + e];
        projected_q_[e] = acc;
      }
    }
  }

  double Score(const float* k) const {
    switch (kind_) {
      case ScoreKind::kScaledDot:
      case ScoreKind::kDot:
        return Dot(q_, k);
      case ScoreKind::kCosine: {
        double norms = std::sqrt(Dot(q_, q_)) * std::sqrt(Dot(k, k));
        return Dot(q_, k) / std::max(norms, 1e-8);
      }
      case ScoreKind::kNegEuclidean:
        return -std::sqrt(SquaredDistance(k));
      case ScoreKind::kGaussian:
        return gaussian_factor_ * SquaredDistance(k);
      case ScoreKind::kAdditive: {
        double acc = 0;
        for (int64_t u = 0; u < hidden_; ++u) {
          double kp = 0;
          for (int64_t d = 0; d < dk_; ++d) kp += double{w_k_[u * dk_ + d]} * k[d];
          acc += double{w_v_[u]} * std::tanh(projected_q_[u] + kp);
        }
        return acc;
      }
      case ScoreKind::kBilinear: {
        double acc = 0;
        for (int64_t e = 0; e < dk_; ++e) acc += projected_q_[e] * k[e];
        return acc;
      }
    }
    return 0;
  }

 private:
  double Dot(const float* a, const float* b) const {
    double acc = 0;
    for (int64_t d = 0; d < dq_; ++d) acc += double{a[d]} * b[d];
    return acc;
  }
  double SquaredDistance(const float* k) const {
    double acc = 0;
    for (int64_t d = 0; d < dq_; ++d) {
      double diff = double{q_[d]} - k[d];
      acc += diff * diff;
    }
    return acc;
  }

  ScoreKind kind_;
  int64_t dq_, dk_;
  int64_t hidden_ = 0;
  std::vector<float> w_q_, w_k_, w_v_, w_;
  std::vector<double> projected_q_;
  double gaussian_factor_ = 0;
  const float* q_ = nullptr;
};

}  // namespace

absl::StatusOr<AttentionResult> ReferenceAttend(const AttentionArgs& args,
                                                const AttentionShape& s,
                                                const std::function<absl::Status()>* interrupt) {
  const TensorView& qv = args.query;
  const TensorView& kv = args.key.present() ? args.key : qv;
  const TensorView& vv = args.value.present() ? args.value : kv;
  const std::vector<float> q = LoadFloats(qv), k = LoadFloats(kv), v = LoadFloats(vv);
  const HeadIndexer qix = MakeHeadIndexer(qv, args.layout, s.rank4, s.heads, s.query_dim);
  const HeadIndexer kix = MakeHeadIndexer(kv, args.layout, s.rank4, s.kv_heads, s.key_dim);
  const HeadIndexer vix = MakeHeadIndexer(vv, args.layout, s.rank4, s.kv_heads, s.value_dim);

  const int64_t B = s.batch, H = s.heads, L = s.query_len, S = s.key_len, Dv = s.value_dim;
  const int64_t group = H / s.kv_heads;

  AttentionResult result;
  TensorView out_view;
  result.output.shape = OutputShape(args, s);
  out_view.shape = result.output.shape;
  const HeadIndexer oix = MakeHeadIndexer(out_view, args.layout, s.rank4, H, Dv);
  result.output.data.assign(static_cast<size_t>(B * H * L * Dv), 0.0f);

  if (args.need_weights) {
    result.weights.shape = WeightsShape(args, s);
    result.weights.data.assign(static_cast<size_t>(B * (args.average_weights ? 1 : H) * L * S),
                               0.0f);
  }

  const Masks masks(args.mask, s);
  Scorer scorer(args, s);
  const double scale = EffectiveScale(args.score, s.query_dim);
  const double p = args.dropout_p;
  const double keep_scale = p > 0 && p < 1 ? 1.0 / (1.0 - p) : 1.0;

  std::vector<double> row(S);
  std::vector<double> acc(Dv);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < L; ++i) {
        if (interrupt != nullptr && i % kReferenceRowsPerPoll == 0) {
          ATTN_RETURN_IF_ERROR((*interrupt)());
        }
        scorer.SetQuery(q.data() + qix.Offset(b, h, i));
        double max = kNegInf;
        for (int64_t j = 0; j < S; ++j) {
          double bias = masks.Bias(b, h, i, j);
          row[j] = bias == kNegInf ? kNegInf
                                   : scale * scorer.Score(k.data() + kix.Offset(b, hk, j)) + bias;
          // A NaN score makes the row NaN (as in PyTorch), not fully masked.
          if (row[j] > max || std::isnan(row[j])) max = row[j];
        }
        if (max == kNegInf) continue;  // fully masked row: zero output and weights
        double sum = 0;
        for (int64_t j = 0; j < S; ++j) {
          row[j] = std::exp(row[j] - max);
          sum += row[j];
        }
        const uint64_t row_index = static_cast<uint64_t>(((b * H + h) * L + i) * S);
        for (int64_t j = 0; j < S; ++j) {
          row[j] /= sum;
          if (p > 0) {
            bool keep = p < 1 && DropoutUniform(args.seed, row_index + j) >= p;
            row[j] = keep ? row[j] * keep_scale : 0.0;
          }
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j < S; ++j) {
          const float* vrow = v.data() + vix.Offset(b, hk, j);
          for (int64_t d = 0; d < Dv; ++d) acc[d] += row[j] * vrow[d];
        }
        float* orow = result.output.data.data() + oix.Offset(b, h, i);
        for (int64_t d = 0; d < Dv; ++d) orow[d] = static_cast<float>(acc[d]);
        if (!args.need_weights) continue;
        if (args.average_weights) {
          float* wrow = result.weights.data.data() + (b * L + i) * S;
          for (int64_t j = 0; j < S; ++j) wrow[j] += static_cast<float>(row[j] / H);
        } else {
          float* wrow = result.weights.data.data() + row_index;
          for (int64_t j = 0; j < S; ++j) wrow[j] = static_cast<float>(row[j]);
        }
      }
    }
  }
  return result;
}

}  // namespace attention::internal

namespace attention::internal {
namespace {

class ReferenceBackend final : public ComputeBackend {
 public:
  std::vector<absl::StatusOr<AttentionResult>> RunBatch(
      absl::Span<const BackendCall> calls) override {
    std::vector<absl::StatusOr<AttentionResult>> results;
    for (const BackendCall& c : calls) {
      // ReferenceAttend polls c.interrupt itself, every block of query rows.
      results.push_back(OutOfMemoryAsStatus("engine", [&]() -> absl::StatusOr<AttentionResult> {
        return ReferenceAttend(*c.args, c.shape, c.interrupt);
      }));
    }
    return results;
  }

  absl::Status LinearBatch(absl::Span<const LinearJob> jobs) override {
    for (const LinearJob& j : jobs) {
      for (int64_t r = 0; r < j.rows; ++r) {
        const float* x = j.x + r * j.in;
        for (int64_t o = 0; o < j.out; ++o) {
          const float* w = j.w + o * j.in;
          double acc = j.bias ? j.bias[o] : 0.0;
          for (int64_t i = 0; i < j.in; ++i) acc += double{x[i]} * w[i];
          j.y[r * j.out + o] = static_cast<float>(acc);
        }
      }
    }
    return absl::OkStatus();
  }
  std::string name() const override { return "reference"; }
  std::string isa() const override { return "generic"; }
  int threads() const override { return 1; }
};

}  // namespace

std::unique_ptr<ComputeBackend> MakeReferenceBackend() {
  return std::make_unique<ReferenceBackend>();
}

}  // namespace attention::internal
