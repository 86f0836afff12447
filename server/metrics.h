#ifndef ATTENTION_SERVER_METRICS_H_
#define ATTENTION_SERVER_METRICS_H_

// The server's Prometheus metrics, and the small HTTP server that exposes them.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace attention::server {

// Counters, gauges and histograms of one server, rendered in the Prometheus
// text exposition format 0.0.4:
//   attention_requests_total{method,model,code}            counter
//   attention_requests_over_limit_total{method,limit}      counter
//   attention_latency_seconds{stage,method}                histogram
//   attention_batch_size                                   histogram
//   attention_queue_depth, attention_in_flight             gauges
//   attention_memory_reserved_bytes                        gauge
//   attention_engine_pooled_bytes                          gauge (the process's)
//   attention_malloc_trims_total                           counter (the process's)
//   attention_malloc_trim_seconds_total                    counter (the process's)
//   attention_not_computed_total{reason}                   counter
//   attention_interrupted_total{reason}                    counter
//   attention_sessions_open, attention_session_cache_bytes gauges
//   attention_session_pooled_bytes                         gauge (the process's)
//   attention_sessions_ended_total{reason}                 counter
//   attention_session_rows_appended_total                  counter
//   attention_queue_limit, attention_memory_budget_bytes,
//   attention_session_cache_limit_bytes                    gauges (SetLimits)
//   attention_build_info{version}                          gauge, 1
//   process_cpu_seconds_total, process_resident_memory_bytes,
//   process_virtual_memory_bytes, process_start_time_seconds,
//   process_open_fds                                       the process's, from /proc
// Label values are free text (escaped when rendered). Thread-safe; recording
// takes one short mutex hold (gauges are lock-free).
class Metrics {
 public:
  // Upper bounds ("le") of the latency buckets, in seconds: 25us to 60s in a
  // 1-2.5-5 progression. Observations above the last go to "+Inf" only.
  static const std::vector<double>& LatencyBuckets();
  // Upper bounds of the batch-size buckets: 1, 2, 4, ..., 256.
  static const std::vector<double>& BatchSizeBuckets();

  Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // One finished call of `method` ("Attend", ...) for `model` ("" for raw
  // attention) with gRPC status code `grpc_code` (rendered by name: "OK",
  // "INVALID_ARGUMENT", ...; unknown numbers as digits).
  void CountRequest(absl::string_view method, absl::string_view model, int grpc_code);
  // One of those calls refused RESOURCE_EXHAUSTED for going over the
  // per-request `limit` (its flag's name, engine's OverLimitError). Attend
  // and AttendStream with every limit the server has are rendered from the
  // start, at 0, so that alerts may subtract them from the errors.
  void CountOverLimit(absl::string_view method, absl::string_view limit);
  // One latency observation of `stage` ("queue", "compute" or "total") for
  // `method`. Negative values count as 0; NaN is dropped.
  void ObserveSeconds(absl::string_view stage, absl::string_view method, double seconds);
  // One engine call that ran `size` requests together.
  void ObserveBatchSize(int size);
  // Requests now waiting for compute.
  void SetQueueDepth(int64_t depth);
  // Calls being handled; +1 when one starts, -1 when it finishes.
  void AddInFlight(int delta);
  // The limits the server runs with, rendered beside what uses them:
  // --max_queue, --memory_budget_mb and --session_memory_mb, in requests and
  // bytes.
  void SetLimits(int64_t queue, int64_t memory_budget_bytes, int64_t session_cache_bytes) {
    queue_limit_.store(queue, std::memory_order_relaxed);
    memory_budget_.store(memory_budget_bytes, std::memory_order_relaxed);
    session_cache_limit_.store(session_cache_bytes, std::memory_order_relaxed);
  }
  // Bytes the calls in flight have reserved of the server's memory budget.
  void SetMemoryReserved(int64_t bytes) {
    memory_reserved_.store(bytes, std::memory_order_relaxed);
  }
  // Calls being handled now; and a count of what used or freed memory so far:
  // calls (and stream requests) that arrived, refused ones too
  // (NoteCallArrived), and sessions that ended, by any reason
  // (CountSessionEnded). The heap trimmer's signal that it may have work.
  int64_t in_flight() const { return in_flight_.load(std::memory_order_relaxed); }
  uint64_t activity() const { return activity_.load(std::memory_order_relaxed); }
  void NoteCallArrived() { activity_.fetch_add(1, std::memory_order_relaxed); }
  // A request dropped before compute because its call was over; `reason` is
  // "cancelled" or "deadline_exceeded" (both are rendered from the start, at 0).
  void CountNotComputed(absl::string_view reason);
  // A request whose compute was stopped part way because its call was over;
  // `reason` as for CountNotComputed.
  void CountInterrupted(absl::string_view reason);

  // Sessions open now, and the bytes of their caches.
  void SetSessions(int64_t open, int64_t cache_bytes) {
    sessions_open_.store(open, std::memory_order_relaxed);
    session_cache_bytes_.store(cache_bytes, std::memory_order_relaxed);
  }
  // A session ended: "closed" (by its caller), "evicted" (for memory) or
  // "expired" (idle); all rendered from the start, at 0.
  void CountSessionEnded(absl::string_view reason);
  // Rows committed to sessions.
  void AddSessionRows(int64_t rows) { session_rows_.fetch_add(rows, std::memory_order_relaxed); }

  // Every metric with # HELP and # TYPE lines; series sorted by labels.
  std::string RenderPrometheus() const;

 private:
  struct Histogram {
    explicit Histogram(size_t buckets) : counts(buckets + 1, 0) {}
    std::vector<uint64_t> counts;  // per bucket, not cumulative; last is +Inf
    double sum = 0;
    uint64_t count = 0;
  };
  using RequestKey = std::tuple<std::string, std::string, int>;  // method, model, code
  using StageKey = std::pair<std::string, std::string>;          // stage, method

  static void Observe(const std::vector<double>& bounds, double value, Histogram* histogram);

  mutable absl::Mutex mu_;
  std::map<RequestKey, uint64_t> requests_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, std::string>, uint64_t> over_limit_  // method, limit
      ABSL_GUARDED_BY(mu_);
  std::map<StageKey, Histogram> latency_ ABSL_GUARDED_BY(mu_);
  Histogram batch_size_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> not_computed_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> interrupted_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> sessions_ended_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> sessions_open_{0};
  std::atomic<int64_t> session_cache_bytes_{0};
  std::atomic<int64_t> session_rows_{0};
  std::atomic<int64_t> queue_depth_{0};
  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> memory_reserved_{0};
  std::atomic<int64_t> queue_limit_{0};
  std::atomic<int64_t> memory_budget_{0};
  std::atomic<int64_t> session_cache_limit_{0};
  std::atomic<uint64_t> activity_{0};
};

// An HTTP server on its own threads answering
//   GET /metrics  the Metrics' RenderPrometheus() (text/plain; version=0.0.4)
//   GET /healthz  200 "ok" while the process is up (liveness)
//   GET /readyz   200 "ok" once SetReady() was called, until SetNotReady();
//                 before, and after, 503 with the reason (readiness: the
//                 gRPC health status as HTTP, for probes that cannot speak
//                 gRPC, e.g. the kubelet's to a TLS server)
// and 404 for anything else. Thread-safe.
class MetricsServer {
 public:
  // Connections served at once; each waits at most 1 s for its request.
  static constexpr int kMetricsWorkers = 8;

  // Binds `host`:`port` (0 picks a free port) and starts serving `metrics`,
  // which must outlive the server. INVALID_ARGUMENT for a null `metrics` or a
  // port outside [0, 65535]; UNAVAILABLE when the address cannot be bound
  // (e.g. the port is in use).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& host, int port,
                                                              const Metrics* metrics);

  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;
  // Stops listening and joins the threads; a scrape in progress is finished
  // first (connections idle for over a second are dropped).
  ~MetricsServer();

  // The bound port.
  int port() const;

  // Readiness for GET /readyz. A server starts not ready, with the reason
  // kStartingReason.
  void SetReady();
  void SetNotReady(absl::string_view reason);
  static constexpr absl::string_view kStartingReason =
      "warming up: not serving until every kind of call has run once";

 private:
  struct Impl;
  explicit MetricsServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_METRICS_H_
