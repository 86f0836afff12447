#include "engine/session_forward.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/multihead.h"

namespace attention::internal {
namespace {

TensorView FloatView(const float* data, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return TensorView{DType::kFloat32, std::move(shape), data, static_cast<size_t>(n) * 4};
}

// The checks every session call shares: masks, dropout, read_only.
absl::Status CheckSessionArgs(const AttentionArgs& a, const SessionCall& s) {
  const std::pair<const TensorView*, const char*> masks[] = {
      {&a.mask.valid_lens, "mask.valid_lens"},
      {&a.mask.key_padding_mask, "mask.key_padding_mask"},
      {&a.mask.attn_mask, "mask.attn_mask"}};
  for (const auto& [view, field] : masks) {
    if (view->present()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": not supported with sessions (a session's keys are its rows; causal "
                 "BOTTOM_RIGHT is the decoder's mask)"));
    }
  }
  if (a.mask.causal == Causal::kTopLeft) {
    return absl::InvalidArgumentError(
        "mask.causal: TOP_LEFT is not defined with sessions; BOTTOM_RIGHT is the decoder's mask");
  }
  if (a.dropout_p != 0) {
    return absl::InvalidArgumentError("dropout_p: not supported with sessions");
  }
  if (s.read_only && (a.key.present() || a.value.present())) {
    return absl::InvalidArgumentError(absl::StrCat(
        a.key.present() ? "key" : "value",
        ": must be absent with session.read_only (a read-only request appends nothing)"));
  }
  if (s.caches.empty()) return absl::InvalidArgumentError("session: no sessions given");
  for (const KvCache* cache : s.caches) {
    if (cache == nullptr) return absl::InternalError("session: a null cache");
  }
  if (!a.query.present()) return absl::InvalidArgumentError("query: is required");
  return absl::OkStatus();
}

// Resolves a raw call's shape; a read-only call's from its query and the
// first cache's heads and dims.
absl::Status PlanRaw(SessionPlan& p) {
  const AttentionArgs& a = *p.args;
  if (!p.session->read_only) {
    ATTN_ASSIGN_OR_RETURN(p.shape, ResolveShape(a));
  } else {
    ATTN_RETURN_IF_ERROR(CheckView(a.query, "query", Allowed::kFloat, {3, 4}));
    const KvCache& c = *p.session->caches[0];
    const bool rank4 = a.query.shape.size() == 4;
    const bool batch_first = rank4 || a.layout == Layout::kBatchFirst;
    const int64_t B = a.query.shape[batch_first ? 0 : 1];
    const int64_t hk = c.kv_heads(), dk = c.key_dim(), dv = c.value_dim();
    p.stand_in.assign(static_cast<size_t>(B * hk * std::max(dk, dv)), 0.0f);
    auto shaped = [&](int64_t d) -> std::vector<int64_t> {
      if (rank4) return {B, hk, 1, d};
      return batch_first ? std::vector<int64_t>{B, 1, hk * d} : std::vector<int64_t>{1, B, hk * d};
    };
    AttentionArgs resolved = a;
    resolved.key = FloatView(p.stand_in.data(), shaped(dk));
    resolved.value = FloatView(p.stand_in.data(), shaped(dv));
    ATTN_ASSIGN_OR_RETURN(p.shape, ResolveShape(resolved));
    p.shape.key_len = 0;
  }
  const bool batch_first = p.shape.rank4 || a.layout == Layout::kBatchFirst;
  const int64_t query_batch = a.query.shape[batch_first ? 0 : 1];
  // Each batch row is a session: a key or value of another batch would give
  // rows to sessions the request does not name (the stateless call takes
  // them; here they would be lost).
  for (const auto& [view, name] : {std::pair{&a.key, "key"}, std::pair{&a.value, "value"}}) {
    if (view->present() && view->shape[batch_first ? 0 : 1] != query_batch) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": batch ", view->shape[batch_first ? 0 : 1],
                       " does not match query's ", query_batch, " (one row per session)"));
    }
  }
  p.shape.batch = query_batch;
  p.score = a.score;
  return absl::OkStatus();
}

absl::Status PlanLayerCall(SessionPlan& p) {
  const AttentionArgs& a = *p.args;
  const MultiheadConfig& c = p.layer->config();
  const bool batch_first = a.layout == Layout::kBatchFirst;
  if (!p.session->read_only) {
    ATTN_ASSIGN_OR_RETURN(p.layer_plan, PlanLayer(*p.layer, a));
  } else {
    // PlanLayer's checks of the query; there are no keys or values.
    ATTN_RETURN_IF_ERROR(CheckLayerSettings(*p.layer, a));
    ATTN_RETURN_IF_ERROR(CheckView(a.query, "query", Allowed::kFloat, {3}));
    if (a.query.shape[2] != c.embed_dim) {
      return absl::InvalidArgumentError(absl::StrCat("query: last dim ", a.query.shape[2],
                                                     " does not match the model's embed_dim ",
                                                     c.embed_dim));
    }
    LayerPlan lp;
    lp.layer = p.layer;
    lp.args = &a;
    if (a.query.dtype == DType::kFloat32) {
      lp.q = static_cast<const float*>(a.query.data);
    } else {
      lp.q_copy = LoadFloats(a.query);
      lp.q = lp.q_copy.data();
    }
    lp.q_rows = a.query.shape[0] * a.query.shape[1];
    lp.kv_batch = a.query.shape[batch_first ? 0 : 1];
    p.layer_plan = std::move(lp);
  }
  const LayerPlan& lp = *p.layer_plan;
  const int64_t B = a.query.shape[batch_first ? 0 : 1];
  if (lp.kv_batch != B) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key: batch ", lp.kv_batch, " does not match query's ", B, " (one row per session)"));
  }
  const int64_t d = c.embed_dim / c.num_heads;
  p.shape.batch = B;
  p.shape.heads = p.shape.kv_heads = c.num_heads;
  p.shape.query_len = a.query.shape[batch_first ? 1 : 0];
  p.shape.key_len = lp.kv_len;
  p.shape.query_dim = p.shape.key_dim = p.shape.value_dim = d;
  p.tail = (c.add_bias_kv ? 1 : 0) + (c.add_zero_attn ? 1 : 0);
  p.score = c.score;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SessionPlan> PlanSession(const EngineCall& call) {
  const AttentionArgs& a = *call.args;
  const SessionCall& sc = *call.session;
  ATTN_RETURN_IF_ERROR(CheckSessionArgs(a, sc));
  SessionPlan p;
  p.args = &a;
  p.session = &sc;
  p.layer = call.layer;
  ATTN_RETURN_IF_ERROR(p.layer != nullptr ? PlanLayerCall(p) : PlanRaw(p));
  const AttentionShape& s = p.shape;
  const int64_t sessions = static_cast<int64_t>(sc.caches.size());
  if (sessions != s.batch) {
    return absl::InvalidArgumentError(absl::StrCat("session.ids: ", sessions,
                                                   " sessions do not match the batch size ",
                                                   s.batch, " of query (one per batch row)"));
  }
  p.keys.resize(static_cast<size_t>(s.batch));
  for (int64_t b = 0; b < s.batch; ++b) {
    const KvCache& c = *sc.caches[b];
    if (c.pending() != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "session.ids[", b, "]: its cache has ", c.pending(), " rows neither committed nor dropped"));
    }
    if (c.kv_heads() != s.kv_heads || c.key_dim() != s.key_dim || c.value_dim() != s.value_dim) {
      // The tensor whose shape differs (by the self-attention rule, the
      // query may stand for the keys, and the keys for the values); a
      // read-only request's shape is its first session's.
      const bool keys_differ = c.kv_heads() != s.kv_heads || c.key_dim() != s.key_dim;
      const char* field = sc.read_only                        ? "session.ids"
                          : !keys_differ && a.value.present() ? "value"
                          : a.key.present()                   ? "key"
                                                              : "query";
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": session.ids[", b, "]'s session holds ", c.kv_heads(), " key/value heads of ",
          c.key_dim(), " (keys) and ", c.value_dim(), " (values); this request has ", s.kv_heads,
          " of ", s.key_dim, " and ", s.value_dim));
    }
    if (c.length() > (int64_t{1} << 40) - s.key_len) {
      return absl::InvalidArgumentError(absl::StrCat("session.ids[", b, "]: too many rows"));
    }
    p.keys[b] = c.length() + s.key_len;
    p.max_keys = std::max(p.max_keys, p.keys[b]);
  }
  p.scale = static_cast<float>(EffectiveScale(p.score, s.query_dim));
  p.decode = (p.score.kind == ScoreKind::kScaledDot || p.score.kind == ScoreKind::kDot) &&
             !a.need_weights && (s.heads / s.kv_heads) * s.query_len <= kMaxDecodeRows;
  // Every row's keys are this call's own rows (plus a layer's tail).
  p.direct = !p.decode && !sc.read_only && s.key_len > 0 &&
             std::all_of(sc.caches.begin(), sc.caches.end(),
                         [](const KvCache* c) { return c->length() == 0; });
  return p;
}

AttentionShape FullShape(const SessionPlan& plan) {
  AttentionShape s = plan.shape;
  s.key_len = plan.max_keys + plan.tail;
  return s;
}

CallCost SessionCost(const SessionPlan& plan, int threads) {
  AttentionArgs costed = *plan.args;
  costed.score = plan.score;
  const AttentionShape s = FullShape(plan);
  CallCost cost = RawCallCost(costed, s, threads);
  const double B = static_cast<double>(s.batch), H = static_cast<double>(s.heads),
               Hk = static_cast<double>(s.kv_heads), L = static_cast<double>(s.query_len),
               S = static_cast<double>(s.key_len);
  if (!plan.decode && !plan.direct) {  // each row's contiguous copy
    cost.scratch_bytes +=
        B * (H * L * static_cast<double>(s.query_dim) +
             Hk * S * static_cast<double>(s.key_dim + s.value_dim)) * 4;
  }
  if (plan.layer_plan) {
    const MultiheadConfig& c = plan.layer->config();
    const double e = static_cast<double>(c.embed_dim);
    const double q_rows = static_cast<double>(plan.layer_plan->q_rows);
    const double kv_rows = static_cast<double>(plan.layer_plan->kv_rows);
    cost.flops += 2 * e * (2 * q_rows * e + kv_rows * static_cast<double>(c.key_dim() + c.value_dim()));
    cost.scratch_bytes += (2 * q_rows + 2 * kv_rows) * e * 4;
  }
  return cost;
}

absl::Status AppendRows(SessionPlan& plan, int threads) {
  const AttentionArgs& a = *plan.args;
  const AttentionShape& s = plan.shape;
  const bool batch_first = s.rank4 || a.layout == Layout::kBatchFirst;
  const int64_t n = s.key_len;
  if (plan.layer_plan) {
    const LayerPlan& lp = *plan.layer_plan;
    const int64_t e = plan.layer->config().embed_dim;
    if (n > 0) {
      const std::vector<int64_t> kv_shape = batch_first ? std::vector<int64_t>{s.batch, n, e}
                                                        : std::vector<int64_t>{n, s.batch, e};
      const HeadIndexer ix = MakeHeadIndexer(FloatView(lp.pk.data(), kv_shape), a.layout, false,
                                             s.kv_heads, s.key_dim);
      for (int64_t b = 0; b < s.batch; ++b) {
        ATTN_RETURN_IF_ERROR(plan.session->caches[b]->Append(
            n, lp.pk.data() + ix.Offset(b, 0, 0), ix.pos_stride, ix.head_stride,
            lp.pv.data() + ix.Offset(b, 0, 0), ix.pos_stride, ix.head_stride, threads));
      }
    }
    plan.q = lp.pq.data();
    const std::vector<int64_t> q_shape =
        batch_first ? std::vector<int64_t>{s.batch, s.query_len, e}
                    : std::vector<int64_t>{s.query_len, s.batch, e};
    plan.q_ix = MakeHeadIndexer(FloatView(plan.q, q_shape), a.layout, false, s.heads, s.query_dim);
    plan.out_shape = q_shape;
  } else {
    if (n > 0) {
      const TensorView& k = a.key.present() ? a.key : a.query;
      const TensorView& v = a.value.present() ? a.value : k;
      auto floats = [](const TensorView& view, std::vector<float>& copy) {
        if (view.dtype == DType::kFloat32) return static_cast<const float*>(view.data);
        copy = LoadFloats(view);
        return static_cast<const float*>(copy.data());
      };
      plan.k = floats(k, plan.k_copy);
      plan.v = &v == &k ? plan.k : floats(v, plan.v_copy);
      const HeadIndexer kix = MakeHeadIndexer(k, a.layout, s.rank4, s.kv_heads, s.key_dim);
      const HeadIndexer vix = MakeHeadIndexer(v, a.layout, s.rank4, s.kv_heads, s.value_dim);
      for (int64_t b = 0; b < s.batch; ++b) {
        ATTN_RETURN_IF_ERROR(plan.session->caches[b]->Append(
            n, plan.k + kix.Offset(b, 0, 0), kix.pos_stride, kix.head_stride,
            plan.v + vix.Offset(b, 0, 0), vix.pos_stride, vix.head_stride, threads));
      }
    }
    if (a.query.dtype == DType::kFloat32) {
      plan.q = static_cast<const float*>(a.query.data);
    } else {
      plan.q_copy = LoadFloats(a.query);
      plan.q = plan.q_copy.data();
    }
    plan.q_ix = MakeHeadIndexer(a.query, a.layout, s.rank4, s.heads, s.query_dim);
    plan.out_shape = OutputShape(a, s);
  }
  if (plan.direct) return absl::OkStatus();  // the backend allocates the output
  int64_t out_elements = 1;
  for (int64_t d : plan.out_shape) out_elements *= d;
  plan.out.resize(static_cast<size_t>(out_elements));
  plan.out_ix = MakeHeadIndexer(FloatView(plan.out.data(), plan.out_shape), a.layout,
                                s.rank4 && !plan.layer_plan, s.heads, s.value_dim);
  plan.zero_row.assign(static_cast<size_t>(std::max(s.key_dim, s.value_dim)), 0.0f);
  return absl::OkStatus();
}

namespace {

// The layer's keys after the cached ones, for key/value head `head`.
int TailRows(const SessionPlan& plan, int64_t head, const float** k, const float** v) {
  if (!plan.layer_plan) return 0;
  const MultiheadConfig& c = plan.layer->config();
  const int64_t d = plan.shape.key_dim;
  int t = 0;
  if (c.add_bias_kv) {
    k[t] = plan.layer->weight("bias_k")->data.data() + head * d;
    v[t] = plan.layer->weight("bias_v")->data.data() + head * d;
    ++t;
  }
  if (c.add_zero_attn) {
    k[t] = plan.zero_row.data();
    v[t] = plan.zero_row.data();
    ++t;
  }
  return t;
}

}  // namespace

std::vector<DecodeItem> DecodeItems(SessionPlan& plan) {
  const AttentionShape& s = plan.shape;
  const int64_t group = s.heads / s.kv_heads;
  std::vector<DecodeItem> items;
  items.reserve(static_cast<size_t>(s.batch * s.kv_heads));
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      DecodeItem it;
      it.cache = plan.session->caches[b];
      it.kv_head = h;
      it.keys = plan.keys[b];
      it.tail = TailRows(plan, h, it.tail_k, it.tail_v);
      it.group = group;
      it.query_len = s.query_len;
      it.q = plan.q + plan.q_ix.Offset(b, h * group, 0);
      it.q_head_stride = plan.q_ix.head_stride;
      it.q_pos_stride = plan.q_ix.pos_stride;
      it.out = plan.out.data() + plan.out_ix.Offset(b, h * group, 0);
      it.out_head_stride = plan.out_ix.head_stride;
      it.out_pos_stride = plan.out_ix.pos_stride;
      it.scale = plan.scale;
      it.causal = plan.args->mask.causal == Causal::kBottomRight;
      it.fast = plan.args->fast;
      items.push_back(it);
    }
  }
  return items;
}

absl::StatusOr<std::vector<BackendCall>> RowCalls(SessionPlan& plan, int threads,
                                                  const std::function<absl::Status()>* interrupt) {
  const AttentionArgs& a = *plan.args;
  const AttentionShape& s = plan.shape;
  if (plan.direct) {
    if (plan.layer_plan) {
      BuildInner(*plan.layer_plan);
      plan.direct_args = plan.layer_plan->inner;
    } else {
      // The call as it came, its tensors as float32 (as appended).
      plan.direct_args = a;
      plan.direct_args.query = FloatView(plan.q, a.query.shape);
      if (a.key.present()) plan.direct_args.key = FloatView(plan.k, a.key.shape);
      if (a.value.present()) plan.direct_args.value = FloatView(plan.v, a.value.shape);
    }
    ATTN_ASSIGN_OR_RETURN(const AttentionShape shape, ResolveShape(plan.direct_args));
    return std::vector<BackendCall>{{&plan.direct_args, shape, interrupt}};
  }
  const size_t B = static_cast<size_t>(s.batch);
  plan.row_q.resize(B);
  plan.row_k.resize(B);
  plan.row_v.resize(B);
  plan.row_args.clear();
  plan.row_args.reserve(B);
  std::vector<BackendCall> calls;
  int64_t copied = 0;  // floats the copies below write
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t keys = plan.keys[b] + plan.tail;
    // Every element is written below.
    plan.row_q[b].resize(static_cast<size_t>(s.heads * s.query_len * s.query_dim));
    plan.row_k[b].resize(static_cast<size_t>(s.kv_heads * keys * s.key_dim));
    plan.row_v[b].resize(static_cast<size_t>(s.kv_heads * keys * s.value_dim));
    copied +=
        static_cast<int64_t>(plan.row_q[b].size() + plan.row_k[b].size() + plan.row_v[b].size());
    AttentionArgs r;
    r.query = FloatView(plan.row_q[b].data(), {1, s.heads, s.query_len, s.query_dim});
    r.key = FloatView(plan.row_k[b].data(), {1, s.kv_heads, keys, s.key_dim});
    r.value = FloatView(plan.row_v[b].data(), {1, s.kv_heads, keys, s.value_dim});
    r.score = plan.score;
    r.mask.causal = a.mask.causal;
    r.mask.unmasked_tail = plan.tail;
    r.need_weights = a.need_weights;
    r.average_weights = a.average_weights;
    r.fast = a.fast;
    plan.row_args.push_back(r);
    ATTN_ASSIGN_OR_RETURN(const AttentionShape shape, ResolveShape(plan.row_args.back()));
    calls.push_back({&plan.row_args.back(), shape, interrupt});
  }
  // One item per batch row and key/value head: its cached rows (and a
  // layer's tail) and its group's query rows, head-major.
  const int64_t group = s.heads / s.kv_heads;
  const auto copy = [&](int64_t item) {
    const int64_t b = item / s.kv_heads, h = item % s.kv_heads;
    const int64_t cached = plan.keys[b];
    const int64_t keys = cached + plan.tail;
    float* kh = plan.row_k[b].data() + h * keys * s.key_dim;
    float* vh = plan.row_v[b].data() + h * keys * s.value_dim;
    plan.session->caches[b]->ReadRows(h, 0, cached, kh, vh);
    const float* tk[2];
    const float* tv[2];
    const int t = TailRows(plan, h, tk, tv);
    for (int r = 0; r < t; ++r) {
      std::memcpy(kh + (cached + r) * s.key_dim, tk[r], s.key_dim * sizeof(float));
      std::memcpy(vh + (cached + r) * s.value_dim, tv[r], s.value_dim * sizeof(float));
    }
    for (int64_t qh = h * group; qh < (h + 1) * group; ++qh) {
      for (int64_t i = 0; i < s.query_len; ++i) {
        std::memcpy(plan.row_q[b].data() + (qh * s.query_len + i) * s.query_dim,
                    plan.q + plan.q_ix.Offset(b, qh, i), s.query_dim * sizeof(float));
      }
    }
  };
  const int64_t items = s.batch * s.kv_heads;
  // Small copies are not worth waking the threads. (Unused in the fuzz
  // build, whose Clang compiles the loop serially: CMakeLists.txt.)
  [[maybe_unused]] const bool parallel = threads > 1 && items > 1 && copied >= (1 << 16);
#pragma omp parallel for num_threads(parallel ? threads : 1) schedule(dynamic, 1) if (parallel)
  for (int64_t item = 0; item < items; ++item) copy(item);
  return calls;
}

absl::Status GatherRowResults(SessionPlan& plan,
                              std::vector<absl::StatusOr<AttentionResult>> results) {
  const AttentionArgs& a = *plan.args;
  const AttentionShape& s = plan.shape;
  if (plan.direct) {
    if (!results[0].ok()) return results[0].status();
    plan.out = std::move(results[0]->output.data);
    plan.weights = std::move(results[0]->weights);
    return absl::OkStatus();
  }
  const int64_t width = plan.max_keys + plan.tail;
  if (a.need_weights) {
    plan.weights.shape = a.average_weights
                             ? std::vector<int64_t>{s.batch, s.query_len, width}
                             : std::vector<int64_t>{s.batch, s.heads, s.query_len, width};
    int64_t n = 1;
    for (int64_t d : plan.weights.shape) n *= d;
    plan.weights.data.assign(static_cast<size_t>(n), 0.0f);
  }
  for (int64_t b = 0; b < s.batch; ++b) {
    if (!results[b].ok()) return results[b].status();
    const AttentionResult& r = *results[b];
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t i = 0; i < s.query_len; ++i) {
        std::memcpy(plan.out.data() + plan.out_ix.Offset(b, h, i),
                    r.output.data.data() + (h * s.query_len + i) * s.value_dim,
                    s.value_dim * sizeof(float));
      }
    }
    if (!a.need_weights) continue;
    const int64_t keys = plan.keys[b] + plan.tail;
    const int64_t rows = (a.average_weights ? 1 : s.heads) * s.query_len;
    for (int64_t row = 0; row < rows; ++row) {
      std::memcpy(plan.weights.data.data() + (b * rows + row) * width,
                  r.weights.data.data() + row * keys, keys * sizeof(float));
    }
  }
  return absl::OkStatus();
}

AttentionResult TakeResult(SessionPlan& plan) {
  AttentionResult result;
  result.output.shape = plan.out_shape;
  result.output.data = std::move(plan.out);
  result.weights = std::move(plan.weights);
  return result;
}

}  // namespace attention::internal
