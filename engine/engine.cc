#include "engine/engine.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/mib_string.h"
#include "common/status_macros.h"
#include "engine/backend.h"
#include "engine/internal.h"
#include "engine/layer_forward.h"
#include "engine/multihead.h"
#include "engine/reference.h"
#include "engine/session_forward.h"
#include "engine/thread_binding.h"

namespace attention {
namespace {

// The payload that marks an OverLimitError; its value is the limit's name.
constexpr absl::string_view kOverLimitPayload = "attention.v1/over_limit";

absl::Status CheckTensorLimit(const TensorView& v, const char* field, int64_t limit) {
  if (limit == 0 || !v.present()) return absl::OkStatus();
  ATTN_ASSIGN_OR_RETURN(int64_t n, internal::CheckedElementCount(v.shape, field));
  if (n <= limit) return absl::OkStatus();
  return OverLimitError("max_tensor_elements",
                        absl::StrCat(field, ": ", n, " elements exceed the limit of ", limit,
                                     " elements per tensor"));
}

// Every tensor of `args` against max_tensor_elements.
absl::Status CheckTensorLimits(const AttentionArgs& args, const EngineOptions& o) {
  const std::pair<const TensorView*, const char*> tensors[] = {
      {&args.query, "query"},
      {&args.key, "key"},
      {&args.value, "value"},
      {&args.mask.attn_mask, "mask.attn_mask"},
      {&args.mask.key_padding_mask, "mask.key_padding_mask"},
      {&args.mask.valid_lens, "mask.valid_lens"},
      {&args.score.w_q, "score.w_q"},
      {&args.score.w_k, "score.w_k"},
      {&args.score.w_v, "score.w_v"},
      {&args.score.w, "score.w"}};
  for (const auto& [view, field] : tensors) {
    ATTN_RETURN_IF_ERROR(CheckTensorLimit(*view, field, o.max_tensor_elements));
  }
  return absl::OkStatus();
}

// B*H*L*S against max_score_elements when the call returns its weights, and
// the output B*H*L*Dv against max_tensor_elements.
absl::Status CheckShapeLimits(const AttentionShape& s, bool need_weights, const EngineOptions& o) {
  int64_t scores = 1;
  bool overflow = false;
  for (int64_t d : {s.batch, s.heads, s.query_len, s.key_len}) {
    overflow |= __builtin_mul_overflow(scores, d, &scores);
  }
  // The output [B, H, L, Dv] is bounded too: Dv can exceed S.
  int64_t outputs = 1;
  for (int64_t d : {s.batch, s.heads, s.query_len, s.value_dim}) {
    overflow |= __builtin_mul_overflow(outputs, d, &outputs);
  }
  if (overflow) {
    return OverLimitError("max_tensor_elements",
                          absl::StrCat("query, key: B*H*L*S = ", s.batch, "*", s.heads, "*",
                                       s.query_len, "*", s.key_len, " or B*H*L*Dv overflows"));
  }
  if (need_weights && o.max_score_elements != 0 && scores > o.max_score_elements) {
    return OverLimitError(
        "max_score_elements",
        absl::StrCat(
            "need_weights: B*H*L*S = ", s.batch, "*", s.heads, "*", s.query_len, "*", s.key_len,
            " = ", scores, " exceeds the limit of ", o.max_score_elements,
            " score elements per request that returns its weights (without weights any length "
            "passes this limit)"));
  }
  if (o.max_tensor_elements != 0 && outputs > o.max_tensor_elements) {
    return OverLimitError("max_tensor_elements",
                          absl::StrCat("output: ", outputs, " elements exceed the limit of ",
                                       o.max_tensor_elements, " elements per tensor"));
  }
  return absl::OkStatus();
}

absl::Status CheckLimits(const AttentionArgs& args, const AttentionShape& s,
                         const EngineOptions& o) {
  ATTN_RETURN_IF_ERROR(CheckTensorLimits(args, o));
  return CheckShapeLimits(s, args.need_weights, o);
}

// A call's cost against max_request_bytes and max_request_flops.
absl::Status CheckCost(const CallCost& c, const EngineOptions& o) {
  if (o.max_request_bytes != 0 && c.bytes() > static_cast<double>(o.max_request_bytes)) {
    const MiBPair over = MiBOverLimit(c.bytes(), static_cast<double>(o.max_request_bytes));
    return OverLimitError(
        "max_request_mb",
        absl::StrCat("request: would allocate ", over.bytes, " (output ",
                     MiBString(c.output_bytes()), ", weights ", MiBString(c.weights_bytes()),
                     ", working memory ", MiBString(c.scratch_bytes), "), over the limit of ",
                     over.limit, " per request"));
  }
  if (o.max_request_flops != 0 && c.flops > o.max_request_flops) {
    return OverLimitError(
        "max_request_gflop",
        absl::StrCat("request: needs ", std::llround(c.flops / 1e9),
                     " GFLOP of compute, over the limit of ",
                     std::llround(o.max_request_flops / 1e9), " GFLOP per request"));
  }
  return absl::OkStatus();
}

// The limits of a layer call, checked before its projections run (they cost
// as much as the attention): its inputs as for raw attention, the scores and
// output of the attention between the projections, with the layer's heads
// and the keys add_bias_kv / add_zero_attn append, and the whole call's cost.
absl::StatusOr<CallCost> CheckLayerLimits(const AttentionArgs& args,
                                          const internal::LayerPlan& plan,
                                          const MultiheadAttention& layer, int threads,
                                          const EngineOptions& o) {
  const MultiheadConfig& c = layer.config();
  ATTN_RETURN_IF_ERROR(CheckTensorLimits(args, o));
  const bool batch_first = args.layout == Layout::kBatchFirst;
  const int64_t extra_keys = (c.add_bias_kv ? 1 : 0) + (c.add_zero_attn ? 1 : 0);
  AttentionShape s;
  s.batch = std::max(args.query.shape[batch_first ? 0 : 1], plan.kv_batch);
  s.heads = c.num_heads;
  s.query_len = args.query.shape[batch_first ? 1 : 0];
  s.key_len = plan.kv_len + extra_keys;
  s.value_dim = c.embed_dim / c.num_heads;
  ATTN_RETURN_IF_ERROR(CheckShapeLimits(s, args.need_weights, o));
  const CallCost cost =
      internal::LayerCallCost(layer, args, s.batch, s.query_len, plan.kv_len, extra_keys, threads);
  ATTN_RETURN_IF_ERROR(CheckCost(cost, o));
  return cost;
}

// The limits of a raw call of resolved shape `s`, and its cost.
absl::StatusOr<CallCost> CheckRawLimits(const AttentionArgs& args, const AttentionShape& s,
                                        int threads, const EngineOptions& o) {
  ATTN_RETURN_IF_ERROR(CheckLimits(args, s, o));
  const CallCost cost = internal::RawCallCost(args, s, threads);
  ATTN_RETURN_IF_ERROR(CheckCost(cost, o));
  return cost;
}

// The limits of a call with sessions: its tensors, the attention over every
// cached row (its output, and weights when asked), and its cost.
absl::StatusOr<CallCost> CheckSessionLimits(const internal::SessionPlan& plan, int threads,
                                            const EngineOptions& o) {
  ATTN_RETURN_IF_ERROR(CheckTensorLimits(*plan.args, o));
  ATTN_RETURN_IF_ERROR(CheckShapeLimits(internal::FullShape(plan), plan.args->need_weights, o));
  const CallCost cost = internal::SessionCost(plan, threads);
  ATTN_RETURN_IF_ERROR(CheckCost(cost, o));
  return cost;
}

}  // namespace

absl::Status OverLimitError(absl::string_view limit, absl::string_view message) {
  absl::Status status = absl::ResourceExhaustedError(message);
  status.SetPayload(kOverLimitPayload, absl::Cord(limit));
  return status;
}

std::string RequestOverLimit(const absl::Status& status) {
  if (!absl::IsResourceExhausted(status)) return "";
  const auto limit = status.GetPayload(kOverLimitPayload);  // absl::optional<absl::Cord>
  return limit.has_value() ? std::string(*limit) : "";
}

// The worker thread runs every Attend / AttendBatch, in arrival order, and the
// backend's parallelism (OpenMP) fans out from it. AttendBatchFromThisThread
// bypasses it: its caller's thread leads the OpenMP team instead.
struct Engine::Impl {
  std::unique_ptr<internal::ComputeBackend> backend;
  // options.threads, or one per CPU the creating thread may run on: counted
  // once (std::thread::hardware_concurrency, which counted CPUs before, read
  // a file under /sys per call: 20-35 us on the Intel host, docs/decode-log.md).
  int cost_threads = 1;
  // Engine::bound_cpus.
  std::vector<int> bound_cpus;

  absl::Mutex mu;
  std::deque<std::function<void()>> queue ABSL_GUARDED_BY(mu);
  bool stopping ABSL_GUARDED_BY(mu) = false;
  std::thread worker;

  void Loop() {
    while (true) {
      std::function<void()> task;
      {
        absl::MutexLock lock(&mu);
        mu.Await(absl::Condition(
            +[](Impl* impl) ABSL_EXCLUSIVE_LOCKS_REQUIRED(impl->mu) {
              return impl->stopping || !impl->queue.empty();
            },
            this));
        if (queue.empty()) return;
        task = std::move(queue.front());
        queue.pop_front();
      }
      task();
    }
  }

  void RunOnWorker(std::function<void()> task) {
    absl::Notification done;
    {
      absl::MutexLock lock(&mu);
      queue.push_back([&] {
        task();
        done.Notify();
      });
    }
    done.WaitForNotification();
  }
};

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options) {
  if (options.max_tensor_elements < 0 || options.max_score_elements < 0 ||
      options.max_request_bytes < 0 || !(options.max_request_flops >= 0)) {
    return absl::InvalidArgumentError("engine limits must be >= 0 (0 means no limit)");
  }
  if (options.threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("engine threads ", options.threads, " must be >= 0 (0 means one per CPU)"));
  }
  auto impl = std::make_unique<Impl>();
  // One per CPU this process may run on (its affinity mask: a container's
  // cpuset, taskset), not per CPU online, which hardware_concurrency counts:
  // under `taskset -c 0` that made two threads share one CPU.
  const std::vector<int> allowed = internal::AllowedCpus();
  const int threads = options.threads > 0 ? options.threads
                      : allowed.empty()
                          ? static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))
                          : static_cast<int>(allowed.size());
  impl->cost_threads = threads;
  if (options.backend == Backend::kReference) {
    impl->backend = internal::MakeReferenceBackend();
  } else {
    ATTN_ASSIGN_OR_RETURN(impl->backend, internal::MakeOneDnnBackend(threads));
  }
  if (options.bind_threads) {
    impl->bound_cpus = internal::CpusToBind(allowed, impl->backend->threads());
  }
  impl->worker = std::thread([p = impl.get()] {
    internal::BindTeamOfThisThread(p->bound_cpus);
    p->Loop();
  });
  return std::unique_ptr<Engine>(new Engine(options, std::move(impl)));
}

Engine::Engine(const EngineOptions& options, std::unique_ptr<Impl> impl)
    : options_(options), impl_(std::move(impl)) {}

Engine::~Engine() {
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->stopping = true;
  }
  impl_->worker.join();
}

int Engine::CostThreads() const { return impl_->cost_threads; }

std::string Engine::backend_name() const { return impl_->backend->name(); }
std::string Engine::isa() const { return impl_->backend->isa(); }
int Engine::threads() const { return impl_->backend->threads(); }
const std::vector<int>& Engine::bound_cpus() const { return impl_->bound_cpus; }
bool Engine::BindThisThread() const { return internal::BindTeamOfThisThread(impl_->bound_cpus); }

absl::StatusOr<AttentionResult> Engine::Attend(const AttentionArgs& args) const {
  const EngineCall call{&args, nullptr};
  return std::move(AttendBatch({&call, 1}).front());
}

absl::StatusOr<CallCost> Engine::CostOf(const EngineCall& call) const {
  if (call.session != nullptr) {
    ATTN_ASSIGN_OR_RETURN(const internal::SessionPlan plan, internal::PlanSession(call));
    return CheckSessionLimits(plan, CostThreads(), options_);
  }
  if (call.layer != nullptr) {
    ATTN_ASSIGN_OR_RETURN(internal::LayerPlan plan, internal::PlanLayer(*call.layer, *call.args));
    return CheckLayerLimits(*call.args, plan, *call.layer, CostThreads(), options_);
  }
  ATTN_ASSIGN_OR_RETURN(AttentionShape shape, ResolveShape(*call.args));
  return CheckRawLimits(*call.args, shape, CostThreads(), options_);
}

std::vector<absl::StatusOr<AttentionResult>> Engine::AttendBatch(
    absl::Span<const EngineCall> calls) const {
  return Batch(calls, /*from_this_thread=*/false);
}

std::vector<absl::StatusOr<AttentionResult>> Engine::AttendBatchFromThisThread(
    absl::Span<const EngineCall> calls) const {
  return Batch(calls, /*from_this_thread=*/true);
}

std::vector<absl::StatusOr<AttentionResult>> Engine::Batch(absl::Span<const EngineCall> calls,
                                                           bool from_this_thread) const {
  const size_t n = calls.size();
  std::vector<absl::StatusOr<AttentionResult>> results(n);
  std::vector<std::optional<internal::LayerPlan>> plans(n);
  std::vector<std::optional<AttentionShape>> shapes(n);
  std::vector<std::optional<internal::SessionPlan>> sessions(n);
  auto resolve = [&](const AttentionArgs& args) -> absl::StatusOr<AttentionShape> {
    ATTN_ASSIGN_OR_RETURN(AttentionShape shape, ResolveShape(args));
    ATTN_RETURN_IF_ERROR(CheckRawLimits(args, shape, CostThreads(), options_).status());
    return shape;
  };
  // Validation runs on the caller's thread; only work reaches the compute thread.
  for (size_t i = 0; i < n; ++i) {
    if (calls[i].session != nullptr) {
      absl::StatusOr<internal::SessionPlan> plan = OutOfMemoryAsStatus(
          "session planning", [&] { return internal::PlanSession(calls[i]); });
      absl::Status limits = plan.status();
      if (plan.ok()) limits = CheckSessionLimits(*plan, CostThreads(), options_).status();
      if (limits.ok()) {
        sessions[i] = std::move(plan).value();
      } else {
        results[i] = limits;
      }
    } else if (calls[i].layer != nullptr) {
      absl::StatusOr<internal::LayerPlan> plan = OutOfMemoryAsStatus(
          "layer planning", [&] { return internal::PlanLayer(*calls[i].layer, *calls[i].args); });
      absl::Status limits = plan.status();
      if (plan.ok()) {
        limits = CheckLayerLimits(*calls[i].args, *plan, *calls[i].layer, CostThreads(), options_)
                     .status();
      }
      if (limits.ok()) {
        plans[i] = std::move(plan).value();
      } else {
        results[i] = limits;
      }
    } else {
      absl::StatusOr<AttentionShape> shape = resolve(*calls[i].args);
      if (shape.ok()) {
        shapes[i] = *shape;
      } else {
        results[i] = shape.status();
      }
    }
  }
  auto compute = [&] {
    internal::ComputeBackend& backend = *impl_->backend;
    // Each call's own allocations fail that call only, never the batch.
    auto fail_layer = [&](size_t i, absl::Status status) {
      results[i] = std::move(status);
      plans[i].reset();
    };
    auto fail_session = [&](size_t i, absl::Status status) {
      results[i] = std::move(status);
      sessions[i].reset();
    };
    // The layer plan of call i, a session's or not; null for raw calls.
    auto layer_plan = [&](size_t i) -> internal::LayerPlan* {
      if (plans[i]) return &*plans[i];
      if (sessions[i] && sessions[i]->layer_plan) return &*sessions[i]->layer_plan;
      return nullptr;
    };
    std::vector<internal::LinearJob> jobs;
    for (size_t i = 0; i < n; ++i) {
      internal::LayerPlan* lp = layer_plan(i);
      if (lp == nullptr) continue;
      absl::StatusOr<std::vector<internal::LinearJob>> projections = OutOfMemoryAsStatus(
          "layer input projections", [&]() -> absl::StatusOr<std::vector<internal::LinearJob>> {
            return internal::InputProjections(*lp);
          });
      if (projections.ok()) {
        // A read-only session call projects its query only.
        for (const internal::LinearJob& job : *projections) {
          if (job.rows > 0) jobs.push_back(job);
        }
      } else if (plans[i]) {
        fail_layer(i, projections.status());
      } else {
        fail_session(i, projections.status());
      }
    }
    const absl::Status projected = backend.LinearBatch(jobs);
    // Sessions: the new rows into the caches, then the decode kernel for
    // every call it computes, in one pass.
    std::vector<internal::DecodeItem> decode_items;
    std::vector<size_t> decoded;
    for (size_t i = 0; i < n; ++i) {
      if (!sessions[i]) continue;
      absl::Status appended = projected;
      if (appended.ok()) {
        appended = OutOfMemoryAsStatus("session append", [&] {
          return internal::AppendRows(*sessions[i], backend.threads());
        });
      }
      if (appended.ok() && calls[i].interrupt != nullptr) appended = (*calls[i].interrupt)();
      if (!appended.ok()) {
        fail_session(i, appended);
        continue;
      }
      if (!sessions[i]->decode) continue;
      const std::vector<internal::DecodeItem> items = internal::DecodeItems(*sessions[i]);
      decode_items.insert(decode_items.end(), items.begin(), items.end());
      decoded.push_back(i);
    }
    // One pass for every call: memory it cannot get fails them all (their
    // rows are then rolled back, as for any failed session call).
    const absl::Status decoded_all = OutOfMemoryAsStatus("session decode", [&] {
      internal::RunDecode(decode_items, backend.threads());
      return absl::OkStatus();
    });
    for (size_t i : decoded) {
      if (decoded_all.ok()) {
        results[i] = internal::TakeResult(*sessions[i]);
      } else {
        fail_session(i, decoded_all);
      }
    }
    for (size_t i = 0; i < n; ++i) {
      if (!plans[i]) continue;
      if (!projected.ok()) {
        fail_layer(i, projected);
        continue;
      }
      absl::StatusOr<AttentionShape> shape = OutOfMemoryAsStatus("layer inner attention", [&] {
        internal::BuildInner(*plans[i]);
        return resolve(plans[i]->inner);
      });
      if (shape.ok()) {
        shapes[i] = *shape;
      } else {
        fail_layer(i, shape.status());
      }
    }
    std::vector<internal::BackendCall> work;
    std::vector<size_t> index;
    for (size_t i = 0; i < n; ++i) {
      if (!shapes[i]) continue;
      work.push_back({plans[i] ? &plans[i]->inner : calls[i].args, *shapes[i], calls[i].interrupt});
      index.push_back(i);
    }
    // Session calls the decode kernel does not compute: one backend call per
    // batch row, in the same pass.
    struct RowCallRange {
      size_t call, first, count;  // the call, its first work item, how many
    };
    std::vector<RowCallRange> row_calls;
    for (size_t i = 0; i < n; ++i) {
      if (!sessions[i] || sessions[i]->decode) continue;
      absl::StatusOr<std::vector<internal::BackendCall>> rows = OutOfMemoryAsStatus(
          "session rows",
          [&] { return internal::RowCalls(*sessions[i], backend.threads(), calls[i].interrupt); });
      if (!rows.ok()) {
        fail_session(i, rows.status());
        continue;
      }
      row_calls.push_back({i, work.size(), rows->size()});
      work.insert(work.end(), rows->begin(), rows->end());
    }
    std::vector<absl::StatusOr<AttentionResult>> computed = backend.RunBatch(work);
    for (size_t w = 0; w < index.size(); ++w) results[index[w]] = std::move(computed[w]);
    for (const RowCallRange& range : row_calls) {
      const size_t i = range.call;
      const auto begin = computed.begin() + static_cast<ptrdiff_t>(range.first);
      std::vector<absl::StatusOr<AttentionResult>> rows(
          std::make_move_iterator(begin),
          std::make_move_iterator(begin + static_cast<ptrdiff_t>(range.count)));
      internal::SessionPlan& plan = *sessions[i];
      absl::Status gathered = OutOfMemoryAsStatus("session results", [&] {
        return internal::GatherRowResults(plan, std::move(rows));
      });
      if (gathered.ok()) {
        results[i] = internal::TakeResult(*sessions[i]);
      } else {
        fail_session(i, gathered);
      }
    }

    jobs.clear();
    std::vector<FloatBuffer> projected_out(n);
    std::vector<size_t> layer_calls;
    for (size_t i = 0; i < n; ++i) {
      const internal::LayerPlan* lp = layer_plan(i);
      if (lp == nullptr || !results[i].ok()) continue;
      absl::StatusOr<internal::LinearJob> job = OutOfMemoryAsStatus(
          "layer output projection", [&]() -> absl::StatusOr<internal::LinearJob> {
            return internal::OutputProjection(*lp, results[i]->output.data, projected_out[i]);
          });
      if (job.ok()) {
        jobs.push_back(*job);
        layer_calls.push_back(i);
      } else {
        results[i] = job.status();
      }
    }
    const absl::Status out = backend.LinearBatch(jobs);
    for (size_t i : layer_calls) {
      if (out.ok()) {
        results[i]->output.data = std::move(projected_out[i]);
      } else {
        results[i] = out;
      }
    }
  };
  if (from_this_thread) {
    compute();
  } else {
    impl_->RunOnWorker(compute);
  }
  return results;
}

}  // namespace attention
