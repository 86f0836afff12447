#include "server/metrics.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "engine/attention.h"
#include "httplib.h"
#include "server/heap_trimmer.h"

namespace attention::server {
namespace {

constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

// Prometheus float text: shortest round-trip form, "+Inf", "-Inf" or "NaN".
// `fixed` avoids exponents (for "le" labels, whose text is part of the series).
std::string FormatValue(double value, bool fixed = false) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buffer[64];
  std::to_chars_result result{buffer, std::errc::value_too_large};
  if (fixed)
    result = std::to_chars(buffer, buffer + sizeof buffer, value, std::chars_format::fixed);
  if (result.ec != std::errc()) result = std::to_chars(buffer, buffer + sizeof buffer, value);
  return std::string(buffer, result.ptr);
}

// A label value with \, " and newline escaped as the format requires.
std::string EscapeLabelValue(absl::string_view value) {
  std::string escaped;
  escaped.reserve(value.size());
  for (const char c : value) {
    switch (c) {
      case '\\':
        escaped += "\\\\";
        break;
      case '"':
        escaped += "\\\"";
        break;
      case '\n':
        escaped += "\\n";
        break;
      default:
        escaped += c;
    }
  }
  return escaped;
}

using Label = std::pair<absl::string_view, absl::string_view>;

// `a="x",b="y"`, without braces.
std::string RenderLabels(std::initializer_list<Label> labels) {
  std::string out;
  for (const auto& [name, value] : labels) {
    if (!out.empty()) out += ',';
    absl::StrAppend(&out, name, "=\"", EscapeLabelValue(value), "\"");
  }
  return out;
}

// `name{labels} value` or `name value`.
void AppendSample(absl::string_view name, absl::string_view labels, absl::string_view value,
                  std::string* out) {
  if (labels.empty()) {
    absl::StrAppend(out, name, " ", value, "\n");
  } else {
    absl::StrAppend(out, name, "{", labels, "} ", value, "\n");
  }
}

void AppendHeader(absl::string_view name, absl::string_view type, absl::string_view help,
                  std::string* out) {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

std::string CodeName(int grpc_code) {
  constexpr int kLastCode = static_cast<int>(absl::StatusCode::kUnauthenticated);
  if (grpc_code < 0 || grpc_code > kLastCode) return absl::StrCat(grpc_code);
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(grpc_code));
}

std::string ReadProcFile(const char* path) {
  std::ifstream file(path);
  return std::string((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
}

// The process collector's metrics of Prometheus's client libraries, from
// /proc/self: CPU seconds, resident and virtual memory, open files, start
// time. A value /proc does not give is left out.
void AppendProcessMetrics(std::string* out) {
  // Each file is closed before /proc/self/fd is counted, which would count
  // it too.
  std::string stat = ReadProcFile("/proc/self/stat");
  // Fields after the command (in parentheses, which may hold spaces): the
  // 3rd field is the state; utime and stime are the 14th and 15th, starttime
  // the 22nd, vsize the 23rd, rss (pages) the 24th.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return;
  std::vector<std::string> fields = absl::StrSplit(stat.substr(close + 2), ' ');
  auto field = [&](size_t n, double* value) {
    return n - 3 < fields.size() && absl::SimpleAtod(fields[n - 3], value);
  };
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
  double utime, stime, start, vsize, rss;
  if (field(14, &utime) && field(15, &stime)) {
    AppendHeader("process_cpu_seconds_total", "counter",
                 "Total user and system CPU time spent in seconds.", out);
    AppendSample("process_cpu_seconds_total", "", FormatValue((utime + stime) / ticks), out);
  }
  if (field(24, &rss)) {
    AppendHeader("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", out);
    AppendSample("process_resident_memory_bytes", "", FormatValue(rss * page), out);
  }
  if (field(23, &vsize)) {
    AppendHeader("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", out);
    AppendSample("process_virtual_memory_bytes", "", FormatValue(vsize), out);
  }
  // starttime is in ticks since boot; the boot time is /proc/stat's btime.
  double boot = -1;
  for (absl::string_view line : absl::StrSplit(ReadProcFile("/proc/stat"), '\n')) {
    if (absl::ConsumePrefix(&line, "btime ") && absl::SimpleAtod(line, &boot)) break;
  }
  if (boot >= 0 && field(22, &start)) {
    AppendHeader("process_start_time_seconds", "gauge",
                 "Start time of the process since unix epoch in seconds.", out);
    AppendSample("process_start_time_seconds", "", FormatValue(boot + start / ticks), out);
  }
  std::error_code error;
  int64_t fds = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", error);
       !error && it != std::filesystem::directory_iterator(); it.increment(error)) {
    ++fds;
  }
  if (!error) {
    AppendHeader("process_open_fds", "gauge", "Number of open file descriptors.", out);
    AppendSample("process_open_fds", "", absl::StrCat(fds), out);
  }
}

}  // namespace

const std::vector<double>& Metrics::LatencyBuckets() {
  static const std::vector<double>* const kBounds =
      new std::vector<double>{0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025,
                              0.005,    0.01,    0.025,  0.05,    0.1,    0.25,  0.5,
                              1,        2.5,     5,      10,      30,     60};
  return *kBounds;
}

const std::vector<double>& Metrics::BatchSizeBuckets() {
  static const std::vector<double>* const kBounds =
      new std::vector<double>{1, 2, 4, 8, 16, 32, 64, 128, 256};
  return *kBounds;
}

Metrics::Metrics()
    : batch_size_(BatchSizeBuckets().size()),
      not_computed_{{"cancelled", 0}, {"deadline_exceeded", 0}},
      interrupted_{{"cancelled", 0}, {"deadline_exceeded", 0}},
      sessions_ended_{{"closed", 0}, {"evicted", 0}, {"expired", 0}} {
  // The limits whose OverLimitError a call can get (engine/engine.cc,
  // memory_budget.cc, session_store.cc, attention_service.cc).
  for (const char* method : {"Attend", "AttendStream"}) {
    for (const char* limit :
         {"max_tensor_elements", "max_score_elements", "max_request_mb", "max_request_gflop",
          "memory_budget_mb", "max_message_mb", "session_memory_mb"}) {
      over_limit_[{method, limit}] = 0;
    }
  }
}

void Metrics::Observe(const std::vector<double>& bounds, double value, Histogram* histogram) {
  // The first bucket whose bound is >= value; past the end is +Inf.
  const size_t bucket = std::lower_bound(bounds.begin(), bounds.end(), value) - bounds.begin();
  ++histogram->counts[bucket];
  histogram->sum += value;
  ++histogram->count;
}

void Metrics::CountRequest(absl::string_view method, absl::string_view model, int grpc_code) {
  RequestKey key{std::string(method), std::string(model), grpc_code};
  absl::MutexLock lock(&mu_);
  ++requests_[std::move(key)];
}

void Metrics::CountOverLimit(absl::string_view method, absl::string_view limit) {
  std::pair<std::string, std::string> key{std::string(method), std::string(limit)};
  absl::MutexLock lock(&mu_);
  ++over_limit_[std::move(key)];
}

void Metrics::ObserveSeconds(absl::string_view stage, absl::string_view method, double seconds) {
  if (std::isnan(seconds)) return;
  seconds = std::max(seconds, 0.0);
  StageKey key{std::string(stage), std::string(method)};
  absl::MutexLock lock(&mu_);
  auto it = latency_.find(key);
  if (it == latency_.end()) {
    it = latency_.emplace(std::move(key), Histogram(LatencyBuckets().size())).first;
  }
  Observe(LatencyBuckets(), seconds, &it->second);
}

void Metrics::ObserveBatchSize(int size) {
  absl::MutexLock lock(&mu_);
  Observe(BatchSizeBuckets(), size, &batch_size_);
}

void Metrics::SetQueueDepth(int64_t depth) { queue_depth_.store(depth, std::memory_order_relaxed); }

void Metrics::AddInFlight(int delta) { in_flight_.fetch_add(delta, std::memory_order_relaxed); }

void Metrics::CountNotComputed(absl::string_view reason) {
  std::string key(reason);
  absl::MutexLock lock(&mu_);
  ++not_computed_[std::move(key)];
}

void Metrics::CountSessionEnded(absl::string_view reason) {
  // Its cache went back to the pool or to malloc: an expiry with no call in
  // sight must wake the trimmer too.
  activity_.fetch_add(1, std::memory_order_relaxed);
  std::string key(reason);
  absl::MutexLock lock(&mu_);
  ++sessions_ended_[std::move(key)];
}

void Metrics::CountInterrupted(absl::string_view reason) {
  std::string key(reason);
  absl::MutexLock lock(&mu_);
  ++interrupted_[std::move(key)];
}

namespace {

// The _bucket (cumulative, then +Inf), _sum and _count lines of one series.
template <typename Histogram>
void AppendHistogram(absl::string_view name, absl::string_view labels,
                     const std::vector<double>& bounds, const Histogram& histogram,
                     std::string* out) {
  const std::string bucket_name = absl::StrCat(name, "_bucket");
  const std::string prefix = labels.empty() ? "" : absl::StrCat(labels, ",");
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds.size(); ++i) {
    cumulative += histogram.counts[i];
    AppendSample(
        bucket_name,
        absl::StrCat(prefix, RenderLabels({{"le", FormatValue(bounds[i], /*fixed=*/true)}})),
        absl::StrCat(cumulative), out);
  }
  AppendSample(bucket_name, absl::StrCat(prefix, RenderLabels({{"le", "+Inf"}})),
               absl::StrCat(histogram.count), out);
  AppendSample(absl::StrCat(name, "_sum"), labels, FormatValue(histogram.sum), out);
  AppendSample(absl::StrCat(name, "_count"), labels, absl::StrCat(histogram.count), out);
}

}  // namespace

std::string Metrics::RenderPrometheus() const {
  std::string out;
  absl::MutexLock lock(&mu_);

  AppendHeader("attention_requests_total", "counter",
               "Finished calls by method, model (empty for raw attention) and gRPC status code.",
               &out);
  for (const auto& [key, count] : requests_) {
    const auto& [method, model, code] = key;
    AppendSample("attention_requests_total",
                 RenderLabels({{"method", method}, {"model", model}, {"code", CodeName(code)}}),
                 absl::StrCat(count), &out);
  }

  AppendHeader("attention_requests_over_limit_total", "counter",
               "Calls refused RESOURCE_EXHAUSTED for going over a per-request limit (named by its "
               "flag), which no retry passes: a caller's mistake, not the server's load.",
               &out);
  for (const auto& [key, count] : over_limit_) {
    AppendSample("attention_requests_over_limit_total",
                 RenderLabels({{"method", key.first}, {"limit", key.second}}), absl::StrCat(count),
                 &out);
  }

  AppendHeader("attention_latency_seconds", "histogram",
               "Seconds per call stage: queue (waiting to be computed), compute (in the engine), "
               "total (the whole call).",
               &out);
  for (const auto& [key, histogram] : latency_) {
    AppendHistogram("attention_latency_seconds",
                    RenderLabels({{"stage", key.first}, {"method", key.second}}), LatencyBuckets(),
                    histogram, &out);
  }

  AppendHeader("attention_batch_size", "histogram", "Requests computed together per engine call.",
               &out);
  AppendHistogram("attention_batch_size", "", BatchSizeBuckets(), batch_size_, &out);

  AppendHeader("attention_queue_depth", "gauge", "Requests waiting for compute.", &out);
  AppendSample("attention_queue_depth", "",
               absl::StrCat(queue_depth_.load(std::memory_order_relaxed)), &out);

  AppendHeader("attention_queue_limit", "gauge",
               "Requests that may wait for compute (--max_queue); more are refused.", &out);
  AppendSample("attention_queue_limit", "",
               absl::StrCat(queue_limit_.load(std::memory_order_relaxed)), &out);

  AppendHeader("attention_in_flight", "gauge", "Calls being handled.", &out);
  AppendSample("attention_in_flight", "", absl::StrCat(in_flight_.load(std::memory_order_relaxed)),
               &out);

  AppendHeader("attention_memory_reserved_bytes", "gauge",
               "Bytes the calls in flight hold of the server's memory budget (--memory_budget_mb).",
               &out);
  AppendSample("attention_memory_reserved_bytes", "",
               absl::StrCat(memory_reserved_.load(std::memory_order_relaxed)), &out);

  AppendHeader("attention_memory_budget_bytes", "gauge",
               "The server's memory budget for calls in flight (--memory_budget_mb); 0: none.",
               &out);
  AppendSample("attention_memory_budget_bytes", "",
               absl::StrCat(memory_budget_.load(std::memory_order_relaxed)), &out);

  AppendHeader("attention_engine_pooled_bytes", "gauge",
               "Freed engine output blocks (1 MiB and more) kept for reuse, up to 512 MiB; freed "
               "after 10 s unused.",
               &out);
  AppendSample("attention_engine_pooled_bytes", "", absl::StrCat(PooledOutputBytes()), &out);

  const HeapTrimStats trim = HeapTrimStatsNow();
  AppendHeader("attention_malloc_trims_total", "counter",
               "Times the heap's free pages were given back to the system, each once the server "
               "had no call in flight for --malloc_trim_idle_seconds.",
               &out);
  AppendSample("attention_malloc_trims_total", "", absl::StrCat(trim.trims), &out);
  AppendHeader("attention_malloc_trim_seconds_total", "counter",
               "Time spent giving the heap's free pages back to the system.", &out);
  AppendSample("attention_malloc_trim_seconds_total", "", absl::StrCat(trim.seconds), &out);

  const auto by_reason = [&out](const char* name, const char* help,
                                const std::map<std::string, uint64_t>& counts) {
    AppendHeader(name, "counter", help, &out);
    for (const auto& [reason, count] : counts) {
      AppendSample(name, RenderLabels({{"reason", reason}}), absl::StrCat(count), &out);
    }
  };
  by_reason("attention_not_computed_total",
            "Requests dropped before compute because their call was cancelled or past its "
            "deadline.",
            not_computed_);
  by_reason("attention_interrupted_total",
            "Requests whose compute was stopped part way, freeing the cores, because their call "
            "was cancelled or past its deadline.",
            interrupted_);

  AppendHeader("attention_sessions_open", "gauge", "Sessions open (docs/sessions.md).", &out);
  AppendSample("attention_sessions_open", "",
               absl::StrCat(sessions_open_.load(std::memory_order_relaxed)), &out);
  AppendHeader("attention_session_cache_bytes", "gauge",
               "Bytes the open sessions hold against --session_memory_mb: their caches' blocks, "
               "and 1 KiB and the id of bookkeeping each.",
               &out);
  AppendSample("attention_session_cache_bytes", "",
               absl::StrCat(session_cache_bytes_.load(std::memory_order_relaxed)), &out);
  AppendHeader("attention_session_pooled_bytes", "gauge",
               "Blocks of closed sessions' caches kept for new sessions, up to 256 MiB; freed "
               "after 10 s unused.",
               &out);
  AppendSample("attention_session_pooled_bytes", "", absl::StrCat(PooledSessionBlockBytes()),
               &out);
  by_reason("attention_sessions_ended_total",
            "Sessions ended: closed by their caller, evicted for memory, or expired when idle.",
            sessions_ended_);
  AppendHeader("attention_session_cache_limit_bytes", "gauge",
               "Bytes all sessions' caches may hold (--session_memory_mb); 0: sessions off.",
               &out);
  AppendSample("attention_session_cache_limit_bytes", "",
               absl::StrCat(session_cache_limit_.load(std::memory_order_relaxed)), &out);
  AppendHeader("attention_session_rows_appended_total", "counter",
               "Key/value rows appended to sessions by requests that succeeded.", &out);
  AppendSample("attention_session_rows_appended_total", "",
               absl::StrCat(session_rows_.load(std::memory_order_relaxed)), &out);
  AppendHeader("attention_build_info", "gauge", "Always 1; the server's version as a label.",
               &out);
  AppendSample("attention_build_info", RenderLabels({{"version", ATTENTION_VERSION}}), "1", &out);
  AppendProcessMetrics(&out);
  return out;
}

struct MetricsServer::Impl {
  httplib::Server http;
  std::thread thread;
  std::atomic<bool> finished{false};
  int port = 0;
  absl::Mutex mu;
  bool ready ABSL_GUARDED_BY(mu) = false;
  std::string not_ready_reason ABSL_GUARDED_BY(mu) = std::string(kStartingReason);
};

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& host,
                                                                    int port,
                                                                    const Metrics* metrics) {
  if (metrics == nullptr) return absl::InvalidArgumentError("metrics server: no metrics");
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics port: ", port, " is outside [0, 65535]"));
  }
  auto impl = std::make_unique<Impl>();
  httplib::Server& http = impl->http;
  http.Get("/metrics", [metrics](const httplib::Request&, httplib::Response& response) {
    response.set_content(metrics->RenderPrometheus(), kContentType);
  });
  http.Get("/healthz", [](const httplib::Request&, httplib::Response& response) {
    response.set_content("ok\n", "text/plain; charset=utf-8");
  });
  Impl* state = impl.get();  // outlives `http`, whose member it is
  http.Get("/readyz", [state](const httplib::Request&, httplib::Response& response) {
    absl::MutexLock lock(&state->mu);
    if (state->ready) {
      response.set_content("ok\n", "text/plain; charset=utf-8");
    } else {
      response.status = 503;
      response.set_content(absl::StrCat(state->not_ready_reason, "\n"),
                           "text/plain; charset=utf-8");
    }
  });
  // httplib's default sets SO_REUSEPORT, which would let a second server bind
  // a port that is already serving; SO_REUSEADDR only allows quick restarts.
  http.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // Scrapes and probes are small: one request per connection, and a short
  // wait for it, so that shutdown is never held up for long and connections
  // that send nothing (a port scan, a stuck client) hold a worker for 1 s
  // only. kMetricsWorkers of them: a load balancer's probes must not queue
  // behind a few such connections, or it takes the replica out of rotation.
  http.new_task_queue = [] { return new httplib::ThreadPool(kMetricsWorkers); };
  http.set_keep_alive_max_count(1);
  http.set_keep_alive_timeout(1);
  http.set_read_timeout(1, 0);

  if (port == 0) {
    impl->port = http.bind_to_any_port(host);
  } else {
    impl->port = http.bind_to_port(host, port) ? port : -1;
  }
  if (impl->port <= 0) {
    return absl::UnavailableError(absl::StrCat("metrics server: cannot listen on ", host, ":", port,
                                               " (address in use or not local?)"));
  }
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] {
    raw->http.listen_after_bind();
    raw->finished.store(true);
  });
  // stop() only acts on a running server: wait for the listener to be up, so
  // the destructor cannot race ahead of it.
  while (!raw->http.is_running() && !raw->finished.load()) std::this_thread::yield();
  return std::unique_ptr<MetricsServer>(new MetricsServer(std::move(impl)));
}

MetricsServer::MetricsServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

MetricsServer::~MetricsServer() {
  impl_->http.stop();
  impl_->thread.join();
}

int MetricsServer::port() const { return impl_->port; }

void MetricsServer::SetReady() {
  absl::MutexLock lock(&impl_->mu);
  impl_->ready = true;
}

void MetricsServer::SetNotReady(absl::string_view reason) {
  absl::MutexLock lock(&impl_->mu);
  impl_->ready = false;
  impl_->not_ready_reason = std::string(reason);
}

}  // namespace attention::server
