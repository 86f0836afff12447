#ifndef ATTENTION_SERVER_SERVER_H_
#define ATTENTION_SERVER_SERVER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/engine.h"

namespace attention {

namespace server {
class Metrics;
}

struct ServerOptions {
  // HOST:PORT; port 0 picks a free port (see AttentionServer::port()).
  std::string listen = "127.0.0.1:50051";
  // Largest request or response; below 1 is INVALID_ARGUMENT from Create, above
  // 2047 is capped at gRPC's limit of 2 GiB - 1 bytes.
  int64_t max_message_mb = 256;
  // Folder of model folders (config.pbtxt + weights.safetensors) to serve;
  // empty serves no models.
  std::string model_repository;

  // Admission and dynamic batching (a model's config.pbtxt may override the
  // batch size and delay).
  int64_t max_queue = 1024;     // requests waiting for compute; more: RESOURCE_EXHAUSTED
  int32_t max_batch_size = 32;  // requests per engine call; 1 turns batching off
  // Longest a request waits for others to join its batch. 0: a batch is
  // whatever queued while the engine was busy with the one before, so an
  // idle engine never waits.
  int64_t max_queue_delay_us = 0;

  // TLS: server certificate and key (PEM files); both empty serves plaintext.
  // With client_ca_file, clients must present a certificate it signed (mTLS).
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  // A file holding the bearer token callers must send as
  // "authorization: Bearer <token>"; empty disables auth. Health is exempt.
  std::string auth_token_file;

  // Prometheus text on http://<metrics_host>:<metrics_port>/metrics; -1 disables,
  // 0 picks a free port (see AttentionServer::metrics_port()).
  int metrics_port = -1;
  std::string metrics_host = "127.0.0.1";

  // SIGTERM / Shutdown(): first, for shutdown_delay_seconds, health is
  // NOT_SERVING (and /readyz 503) while calls are still served, so that
  // load balancers and proxies checking health stop sending before any call
  // is refused; then new calls are refused and in-flight calls get
  // drain_seconds to finish.
  double shutdown_delay_seconds = 0;
  double drain_seconds = 30;

  // Connections older than this are asked to go away (HTTP/2 GOAWAY; calls in
  // flight get drain_seconds more), so clients that balance over DNS
  // (dns:/// + round_robin) re-resolve and spread onto replicas added since
  // they connected. 0 keeps connections for ever.
  double max_connection_age_seconds = 0;

  // Calls (unary calls and streams) one connection may have open at once:
  // HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS. A client holds the calls beyond
  // it on its own side until one ends, so a caller that sends faster than the
  // server answers waits there, instead of piling calls into the server's
  // transport, where --max_queue does not see them. An open AttendStream
  // holds its place for as long as it is open. 0: no limit.
  int32_t max_concurrent_streams = 256;

  // Once no call has been in flight for this long, give the memory malloc
  // keeps after it is freed back to the system (server/heap_trimmer.h), so
  // RSS falls back after a burst. 0: never.
  double malloc_trim_idle_seconds = 1;

  // Memory all calls in flight may hold at once, in MiB: each call reserves
  // its request, the engine's allocations and its answer from admission until
  // it is answered; a call that would pass the budget is RESOURCE_EXHAUSTED.
  // The container's memory limit must also hold session_memory_mb, the pools
  // of freed blocks (512 MiB of output blocks, 256 MiB of closed sessions')
  // and the process: docs/serving.md, "The container's memory limit". 0: no
  // limit.
  int64_t memory_budget_mb = 1536;
  // Sessions (docs/sessions.md): MiB all their caches may hold (0: sessions
  // off), and seconds an idle one is kept (0: until closed or evicted). The
  // caches are outside memory_budget_mb: leave room for both.
  int64_t session_memory_mb = 1024;
  int64_t session_idle_seconds = 600;
  // The replica's name in its answers' "attention-replica" metadata and in
  // GetServerInfo; empty: this host's name and the bound port (host:port).
  std::string replica_name;
  EngineOptions engine;
  // For tests: called with the metrics port (-1: none) once the gRPC and
  // metrics servers are up, before the warm-up (health NOT_SERVING, /readyz
  // 503 meanwhile).
  std::function<void(int metrics_port)> before_warm_up;
};

// The gRPC server: AttentionService, grpc.health.v1 and reflection.
// Thread-safe.
class AttentionServer {
 public:
  // Loads the model repository, builds the engine, binds and starts serving.
  // UNAVAILABLE when the address cannot be bound; the repository's and the
  // engine's errors otherwise (each names the file, key and numbers).
  static absl::StatusOr<std::unique_ptr<AttentionServer>> Create(const ServerOptions& options);

  AttentionServer(const AttentionServer&) = delete;
  AttentionServer& operator=(const AttentionServer&) = delete;
  ~AttentionServer();  // Shuts down if still running.

  // The bound port.
  int port() const;
  // The metrics HTTP port, or -1 when metrics are off.
  int metrics_port() const;
  // What the server has counted so far (also served on the metrics port).
  const server::Metrics& metrics() const;
  // "127.0.0.1:<port>" form of the bound address, for clients.
  std::string address() const;

  // With shutdown_delay_seconds, turns NOT_SERVING and serves on that long;
  // then refuses new calls (without a delay, just before turning
  // NOT_SERVING) and waits for in-flight ones. Idempotent.
  void Shutdown();
  // Ends the shutdown delay now (a second SIGTERM or SIGINT): the drain
  // starts at once. Also for a Shutdown() still to come. Thread-safe.
  void EndShutdownDelay();
  // Blocks until Shutdown() has completed.
  void Wait();

 private:
  struct Impl;
  explicit AttentionServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace attention

#endif  // ATTENTION_SERVER_SERVER_H_
