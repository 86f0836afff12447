// attention_server: serves attention.v1.AttentionService until SIGTERM or SIGINT.

#include <malloc.h>
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/flags_help.h"
#include "engine/engine.h"
#include "server/logging.h"
#include "server/openmp_defaults.h"
#include "server/server.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "HOST:PORT to listen on; port 0 picks one");
ABSL_FLAG(int64_t, max_message_mb, 256, "Largest request or response message, in MiB");
ABSL_FLAG(int64_t, max_tensor_elements, attention::EngineOptions().max_tensor_elements,
          "Largest element count of any one tensor in a request; 0 means no limit");
ABSL_FLAG(int64_t, max_score_elements, attention::EngineOptions().max_score_elements,
          "Largest B*H*L*S of one request that returns its weights (without weights the "
          "scores are never held whole); 0 means no limit");
ABSL_FLAG(int64_t, max_request_mb, attention::EngineOptions().max_request_bytes >> 20,
          "Most memory one request may make the engine allocate (output, weights, working "
          "memory), in MiB; 0 means no limit");
ABSL_FLAG(double, max_request_gflop, attention::EngineOptions().max_request_flops / 1e9,
          "Most compute one request may take, in GFLOP (a multiply-add counts 2; an additive "
          "score's tanh counts per hidden unit); 0 means no limit");
ABSL_FLAG(int64_t, memory_budget_mb, attention::ServerOptions().memory_budget_mb,
          "Memory all calls in flight may hold at once (requests, the engine's allocations, "
          "answers), in MiB; a call that would pass it gets RESOURCE_EXHAUSTED. The container's "
          "memory limit must hold it, --session_memory_mb and 1536 MiB more (pools of freed "
          "blocks, the process; docs/serving.md); 0 means no limit");
ABSL_FLAG(int64_t, session_memory_mb, attention::ServerOptions().session_memory_mb,
          "Memory all sessions' key/value caches may hold, in MiB, outside --memory_budget_mb; "
          "past it idle sessions are evicted, least recently used first; 0 turns sessions off");
ABSL_FLAG(int64_t, session_idle_seconds, attention::ServerOptions().session_idle_seconds,
          "Seconds a session with no request is kept before it expires; 0 keeps it until "
          "closed or evicted");
ABSL_FLAG(std::string, replica_name, "",
          "This replica's name, sent in every answer's attention-replica metadata and in "
          "GetServerInfo (callers behind a proxy see which replica served them); empty: the "
          "host's name and the bound port, HOST:PORT");
ABSL_FLAG(std::string, model_repository, ATTENTION_DEFAULT_MODEL_REPOSITORY,
          "Folder of model folders (config.pbtxt + weights.safetensors) to serve; empty for "
          "none");
ABSL_FLAG(std::string, engine, "onednn",
          "Compute backend: onednn, or reference (plain loops, the test oracle; slow)");
ABSL_FLAG(int32_t, engine_threads, 0,
          "Threads the engine computes on; 0 means one per CPU the process may run on. A "
          "batch uses up to all of them; small calls compute beside each other, one thread "
          "each, up to this many");
ABSL_FLAG(bool, bind_engine_threads, true,
          "Bind each engine thread to a CPU of its own when the process may run on exactly "
          "--engine_threads CPUs (docs/serving.md, \"CPU binding\"); false leaves their "
          "placement to the OS");
ABSL_FLAG(int64_t, max_queue, attention::ServerOptions().max_queue,
          "Requests that may wait for compute at once; more get RESOURCE_EXHAUSTED");
ABSL_FLAG(int32_t, max_batch_size, attention::ServerOptions().max_batch_size,
          "Requests packed into one engine call (a model's config.pbtxt may override); 1 "
          "turns dynamic batching off");
ABSL_FLAG(int64_t, max_queue_delay_us, attention::ServerOptions().max_queue_delay_us,
          "Longest a request waits for others to join its batch (a model's config.pbtxt may "
          "override)");
ABSL_FLAG(double, shutdown_delay_seconds, attention::ServerOptions().shutdown_delay_seconds,
          "On SIGTERM, before the drain: health turns NOT_SERVING (and /readyz 503) while calls "
          "are still served for this long, so that proxies checking health stop sending first (a "
          "second signal ends the wait)");
ABSL_FLAG(double, drain_seconds, attention::ServerOptions().drain_seconds,
          "On SIGTERM: new calls are refused, health turns NOT_SERVING, and calls in flight "
          "get this long to finish before they are cancelled");
ABSL_FLAG(double, max_connection_age_seconds, attention::ServerOptions().max_connection_age_seconds,
          "Connections older than this are asked to reconnect (after up to --drain_seconds for "
          "their calls), so DNS-balancing clients spread onto new replicas; 0: never");
ABSL_FLAG(int32_t, max_concurrent_streams, attention::ServerOptions().max_concurrent_streams,
          "Calls (unary calls and streams) one connection may have open at once; clients hold "
          "the rest on their side until one ends. 0: no limit");
ABSL_FLAG(std::string, tls_cert, "", "Server certificate (PEM); with --tls_key serves TLS");
ABSL_FLAG(std::string, tls_key, "", "Server private key (PEM)");
ABSL_FLAG(std::string, tls_client_ca, "",
          "CA certificate (PEM) that client certificates must chain to: mutual TLS");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding the token callers must send as 'authorization: Bearer <token>'; "
          "health checks are exempt");
ABSL_FLAG(int32_t, metrics_port, -1,
          "Serve Prometheus metrics on http://--metrics_host:PORT/metrics, with /healthz "
          "(liveness) and /readyz (200 only while health is SERVING); -1 off, 0 picks one");
ABSL_FLAG(std::string, metrics_host, "127.0.0.1", "Address for the metrics endpoint");
ABSL_FLAG(std::string, log_level, "info",
          "trace, debug (one line per request), info, warn, error or off");
ABSL_FLAG(double, malloc_trim_idle_seconds, attention::ServerOptions().malloc_trim_idle_seconds,
          "Once no call has been in flight for this long, give the memory malloc keeps after "
          "it is freed back to the system (malloc_trim), so RSS falls back after a burst; 0: "
          "never");
ABSL_FLAG(std::string, port_file, "",
          "If set, the bound port number is written to this file once the server serves");

namespace {

// Writes `port` to `path` through a temporary file, so readers never see a
// partial number.
absl::Status WritePortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << port << "\n";
    if (!out.flush()) return absl::InternalError(absl::StrCat("port_file: cannot write ", tmp));
  }
  std::error_code error;
  std::filesystem::rename(tmp, path, error);
  if (error) {
    return absl::InternalError(
        absl::StrCat("port_file: cannot rename ", tmp, " to ", path, ": ", error.message()));
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  // Blocked first, before anything starts a thread, so that only the waiter
  // below receives them; the mask outlives the execution below, so a
  // SIGTERM arriving during start-up waits for the waiter rather than
  // ending the process unlogged.
  // SIGHUP too: it would end the process at once, dropping calls in flight
  // and every session, where an operator sending it expects a reload.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  // Idle engine threads sleep rather than spin (unless the environment says
  // otherwise): may execute this binary again, before anything else happens.
  attention::server::ReexecWithOpenMpDefaults(argv);
  // Two malloc arenas, unless the environment says otherwise. glibc gives
  // threads their own arenas (up to 8 per core), and memory freed in one
  // cannot serve another: as gRPC's threads, which also compute small calls,
  // come and go, RSS would rise in steps (docs/benchmarks.md, "Decisions").
  if (std::getenv("MALLOC_ARENA_MAX") == nullptr) mallopt(M_ARENA_MAX, 2);
  // absl::Mutex's deadlock detection (on in Debian's build) keeps a lock
  // graph on every Lock: a cost on each call's path. The tests keep it on.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  attention::SetUsageAndHelpFile("Serves attention.v1.AttentionService over gRPC.",
                                 "server/main.cc");
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    std::fprintf(stderr, "attention_server: unexpected argument %s\n", positional[1]);
    return 1;
  }

  if (absl::Status logging = attention::server::InitLogging(absl::GetFlag(FLAGS_log_level));
      !logging.ok()) {
    std::fprintf(stderr, "attention_server: %s\n", logging.ToString().c_str());
    return 1;
  }

  attention::ServerOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  options.model_repository = absl::GetFlag(FLAGS_model_repository);
  const std::string engine = absl::GetFlag(FLAGS_engine);
  if (engine == "reference") {
    options.engine.backend = attention::Backend::kReference;
  } else if (engine != "onednn") {
    std::fprintf(stderr, "attention_server: --engine=%s: want onednn or reference\n",
                 engine.c_str());
    return 1;
  }
  options.engine.threads = absl::GetFlag(FLAGS_engine_threads);
  options.engine.bind_threads = absl::GetFlag(FLAGS_bind_engine_threads);
  options.max_queue = absl::GetFlag(FLAGS_max_queue);
  options.max_batch_size = absl::GetFlag(FLAGS_max_batch_size);
  options.max_queue_delay_us = absl::GetFlag(FLAGS_max_queue_delay_us);
  options.shutdown_delay_seconds = absl::GetFlag(FLAGS_shutdown_delay_seconds);
  options.drain_seconds = absl::GetFlag(FLAGS_drain_seconds);
  options.max_connection_age_seconds = absl::GetFlag(FLAGS_max_connection_age_seconds);
  options.max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_streams);
  options.malloc_trim_idle_seconds = absl::GetFlag(FLAGS_malloc_trim_idle_seconds);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  options.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  options.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  options.metrics_host = absl::GetFlag(FLAGS_metrics_host);
  options.engine.max_tensor_elements = absl::GetFlag(FLAGS_max_tensor_elements);
  options.engine.max_score_elements = absl::GetFlag(FLAGS_max_score_elements);
  const int64_t max_request_mb = absl::GetFlag(FLAGS_max_request_mb);
  const double max_request_gflop = absl::GetFlag(FLAGS_max_request_gflop);
  if (max_request_mb < 0 || max_request_mb > (int64_t{1} << 40) || !(max_request_gflop >= 0)) {
    std::fprintf(stderr,
                 "attention_server: --max_request_mb=%lld and --max_request_gflop=%g: want 0 (no "
                 "limit) or more\n",
                 static_cast<long long>(max_request_mb), max_request_gflop);
    return 1;
  }
  options.engine.max_request_bytes = max_request_mb << 20;
  options.memory_budget_mb = absl::GetFlag(FLAGS_memory_budget_mb);
  options.session_memory_mb = absl::GetFlag(FLAGS_session_memory_mb);
  options.session_idle_seconds = absl::GetFlag(FLAGS_session_idle_seconds);
  options.replica_name = absl::GetFlag(FLAGS_replica_name);
  options.engine.max_request_flops = max_request_gflop * 1e9;
  absl::StatusOr<std::unique_ptr<attention::AttentionServer>> server =
      attention::AttentionServer::Create(options);
  if (!server.ok()) {
    std::fprintf(stderr, "attention_server: %s\n", server.status().ToString().c_str());
    return 1;
  }
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty()) {
    if (absl::Status written = WritePortFile(port_file, (*server)->port()); !written.ok()) {
      std::fprintf(stderr, "attention_server: %s\n", written.ToString().c_str());
      return 1;
    }
  }
  if ((*server)->metrics_port() >= 0) {
    spdlog::info("metrics on http://{}:{}/metrics", absl::GetFlag(FLAGS_metrics_host),
                 (*server)->metrics_port());
  }

  std::thread waiter([&stop_signals, s = server->get()] {
    // SIGHUP is logged and ignored: there is nothing to reload.
    auto ignored = [](int signal) {
      if (signal != SIGHUP) return false;
      spdlog::warn(
          "signal {} (SIGHUP): ignored; the server reads its files (--tls_cert, --tls_key, "
          "--tls_client_ca, --auth_token_file, --model_repository) once, at start: restart it to "
          "load new ones",
          signal);
      return true;
    };
    int signal = 0;
    do {
      sigwait(&stop_signals, &signal);
    } while (ignored(signal));
    spdlog::info("signal {}: shutting down", signal);
    std::atomic<bool> stopped{false};
    std::thread stopper([s, &stopped] {
      s->Shutdown();
      stopped = true;
    });
    // Meanwhile a second signal ends --shutdown_delay_seconds.
    const timespec poll{0, 100'000'000};
    while (!stopped) {
      if (const int again = sigtimedwait(&stop_signals, nullptr, &poll);
          again > 0 && !ignored(again)) {
        spdlog::info("signal {} again: draining now", again);
        s->EndShutdownDelay();
      }
    }
    stopper.join();
  });
  (*server)->Wait();
  waiter.join();
  spdlog::info("stopped");
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
  // Every call taken has been answered and every connection closed. gRPC's
  // own teardown (grpc_shutdown, from the server's destructor) at times then
  // waited 10 s or more for one of its executor threads to end a poll, past
  // the grace period Kubernetes or Compose leaves after the drain: so the
  // process ends here. Sanitizer builds tear down in full, so that leaks and
  // races at exit are still found.
  spdlog::shutdown();
  std::fflush(nullptr);
  std::_Exit(0);
#endif
  return 0;
}
