#ifndef ATTENTION_SERVER_SERVER_H_
#define ATTENTION_SERVER_SERVER_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/engine.h"

namespace attention {

struct ServerOptions {
  // HOST:PORT; port 0 picks a free port (see AttentionServer::port()).
  std::string listen = "127.0.0.1:50051";
  // Largest request or response; below 1 is INVALID_ARGUMENT from Create, above
  // 2047 is capped at gRPC's limit of 2 GiB - 1 bytes.
  int64_t max_message_mb = 256;
  // Folder of model folders (config.pbtxt + weights.safetensors) to serve;
  // empty serves no models.
  std::string model_repository;
  EngineOptions engine;
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
  // "127.0.0.1:<port>" form of the bound address, for clients.
  std::string address() const;

  // Stops accepting calls and waits for in-flight ones. Idempotent.
  void Shutdown();
  // Blocks until Shutdown() has completed.
  void Wait();

 private:
  struct Impl;
  explicit AttentionServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace attention

#endif  // ATTENTION_SERVER_SERVER_H_
