#include "server/server.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attention/v1/service.grpc.pb.h"
#include "common/status_macros.h"
#include "grpc/grpc.h"
#include "grpc/health/v1/health.pb.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "server/attention_service.h"
#include "server/heap_trimmer.h"
#include "server/metrics.h"
#include "server/reflection_service.h"
#include "server/scheduler.h"
#include "server/security.h"
#include "spdlog/spdlog.h"

namespace attention {
namespace {

// Shutdown: how often it looks whether the calls taken are over, and how long
// it then leaves their answers' last bytes to reach the callers before the
// connections close (a socket's send buffer holds up to a few MiB).
constexpr absl::Duration kDrainPoll = absl::Milliseconds(1);
constexpr absl::Duration kAnswerLinger = absl::Milliseconds(250);
// Shutdown, once every call taken has answered: how long gRPC's goodbye
// (GOAWAY, then a PING each connection must answer) may wait for callers
// before their connections are closed. An idle Python channel answers only
// when it next makes a call, which held the exit about 3 s.
constexpr absl::Duration kCloseGrace = absl::Seconds(1);

// Process-wide gRPC settings every server needs; done once, before any build.
void InitGrpcOnce() {
  static const bool kDone = [] {
    grpc::EnableDefaultHealthCheckService(true);
    return true;
  }();
  (void)kDone;
}

// `mb` megabytes as a gRPC message size limit, saturating at INT_MAX.
absl::StatusOr<int> MessageBytes(int64_t mb) {
  if (mb <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_message_mb: must be positive, got ", mb));
  }
  constexpr int kMaxBytes = std::numeric_limits<int>::max();
  if (mb > (kMaxBytes >> 20)) return kMaxBytes;
  return static_cast<int>(mb << 20);
}

// Host for clients to dial: the listen host, or loopback for a wildcard one.
// This host's name ("localhost" if it has none).
std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

std::string DialHost(absl::string_view listen) {
  const size_t colon = listen.rfind(':');
  const absl::string_view host = colon == absl::string_view::npos ? "" : listen.substr(0, colon);
  if (host.empty() || host == "0.0.0.0" || host == "[::]" || host == "*") return "127.0.0.1";
  return std::string(host);
}

}  // namespace

// Runs one small call of every kind the server will see (raw with and
// without weights, each model), so oneDNN's primitives exist before the first
// caller arrives.
absl::Status WarmUp(const Engine& engine, const ModelRepository& models) {
  std::vector<float> values(2 * 8 * 16, 0.5f);
  AttentionArgs raw;
  raw.query = TensorView{DType::kFloat32, {2, 8, 16}, values.data(), values.size() * sizeof(float)};
  raw.num_heads = 2;
  AttentionArgs raw_weights = raw;
  raw_weights.need_weights = true;
  std::vector<AttentionArgs> model_args;
  std::vector<std::vector<float>> model_inputs;
  std::vector<EngineCall> calls = {{&raw, nullptr}, {&raw_weights, nullptr}};
  const std::vector<const Model*> all = models.models();
  model_args.reserve(all.size());
  model_inputs.reserve(all.size());
  for (const Model* m : all) {
    const int64_t e = m->config.embed_dim();
    model_inputs.emplace_back(static_cast<size_t>(8 * e), 0.5f);
    AttentionArgs& a = model_args.emplace_back();
    a.query = TensorView{DType::kFloat32,
                         {1, 8, e},
                         model_inputs.back().data(),
                         model_inputs.back().size() * sizeof(float)};
    if (m->config.kdim() != e || m->config.vdim() != e) continue;  // needs its own key/value
    calls.push_back({&a, m->layer.get()});
  }
  for (auto& result : engine.AttendBatch(calls)) {
    // A server whose limits refuse even these small calls has nothing to warm.
    if (!result.ok() && !absl::IsResourceExhausted(result.status())) {
      return absl::InternalError(absl::StrCat("warm-up: ", result.status().message()));
    }
  }
  return absl::OkStatus();
}

struct AttentionServer::Impl {
  // First: outlives everything that records into it.
  server::Metrics metrics;
  std::unique_ptr<server::HeapTrimmer> trimmer;  // watches `metrics`
  std::unique_ptr<server::MetricsServer> metrics_server;
  std::unique_ptr<server::TokenAuth> auth;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<ModelRepository> models;
  std::unique_ptr<server::Scheduler> scheduler;
  std::unique_ptr<server::AttentionServiceImpl> service;
  std::unique_ptr<server::ReflectionService> reflection;
  double shutdown_delay_seconds = 0;
  absl::Notification shutdown_delay_ended;
  std::atomic<bool> shutdown_delay_ending{false};  // Notify once
  double drain_seconds = 0;
  std::unique_ptr<grpc::Server> grpc_server;
  int port = 0;
  std::string address;

  absl::Mutex mu;
  bool shut_down ABSL_GUARDED_BY(mu) = false;
};

absl::StatusOr<std::unique_ptr<AttentionServer>> AttentionServer::Create(
    const ServerOptions& options) {
  if (options.listen.empty()) return absl::InvalidArgumentError("listen: empty address");
  ATTN_ASSIGN_OR_RETURN(const int max_message_bytes, MessageBytes(options.max_message_mb));
  // gRPC takes both as int milliseconds.
  constexpr double kMaxSeconds = std::numeric_limits<int>::max() / 1000.0;
  if (!(options.max_connection_age_seconds >= 0 &&
        options.max_connection_age_seconds <= kMaxSeconds)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_connection_age_seconds: ", options.max_connection_age_seconds,
                     " must be in [0, ", kMaxSeconds, "] (0 keeps connections)"));
  }
  if (options.memory_budget_mb < 0 || options.memory_budget_mb > (int64_t{1} << 40)) {
    return absl::InvalidArgumentError(absl::StrCat("memory_budget_mb: ", options.memory_budget_mb,
                                                   " must be in [0, 2^40] (0: no limit)"));
  }
  if (options.session_memory_mb < 0 || options.session_memory_mb > (int64_t{1} << 40)) {
    return absl::InvalidArgumentError(absl::StrCat("session_memory_mb: ", options.session_memory_mb,
                                                   " must be in [0, 2^40] (0: sessions off)"));
  }
  if (options.session_idle_seconds < 0 || static_cast<double>(options.session_idle_seconds) > kMaxSeconds) {
    return absl::InvalidArgumentError(
        absl::StrCat("session_idle_seconds: ", options.session_idle_seconds, " must be in [0, ",
                     kMaxSeconds, "] (0: no expiry)"));
  }
  if (options.max_concurrent_streams < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_concurrent_streams: ", options.max_concurrent_streams, " must be >= 0 (0: no limit)"));
  }
  if (!(options.shutdown_delay_seconds >= 0 && options.shutdown_delay_seconds <= kMaxSeconds)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shutdown_delay_seconds: ", options.shutdown_delay_seconds,
                     " must be in [0, ", kMaxSeconds, "] (0: drain at once)"));
  }
  if (!(options.malloc_trim_idle_seconds >= 0 && options.malloc_trim_idle_seconds <= kMaxSeconds)) {
    return absl::InvalidArgumentError(
        absl::StrCat("malloc_trim_idle_seconds: ", options.malloc_trim_idle_seconds,
                     " must be in [0, ", kMaxSeconds, "] (0: never)"));
  }
  InitGrpcOnce();

  auto impl = std::make_unique<Impl>();
  if (options.malloc_trim_idle_seconds > 0) {
    impl->trimmer = std::make_unique<server::HeapTrimmer>(
        absl::Seconds(options.malloc_trim_idle_seconds), [metrics = &impl->metrics] {
          return server::ServerActivity{metrics->in_flight(), metrics->activity()};
        });
  }
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                        server::MakeServerCredentials(options.tls_cert_file, options.tls_key_file,
                                                      options.tls_client_ca_file));
  if (!options.auth_token_file.empty()) {
    ATTN_ASSIGN_OR_RETURN(impl->auth, server::TokenAuth::FromFile(options.auth_token_file));
    if (options.tls_cert_file.empty()) {
      spdlog::warn(
          "--auth_token_file without --tls_cert: callers' bearer tokens cross the network in "
          "plaintext; serve TLS, or keep the server behind a proxy that does");
    }
  }
  if (options.metrics_port >= 0) {
    ATTN_ASSIGN_OR_RETURN(
        impl->metrics_server,
        server::MetricsServer::Start(options.metrics_host, options.metrics_port, &impl->metrics));
  }
  ATTN_ASSIGN_OR_RETURN(impl->engine, Engine::Create(options.engine));
  if (options.model_repository.empty()) {
    impl->models = ModelRepository::Empty();
  } else {
    ATTN_ASSIGN_OR_RETURN(impl->models, ModelRepository::Load(options.model_repository));
  }
  if (options.max_queue < 1 || options.max_batch_size < 1 || options.max_queue_delay_us < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_queue ", options.max_queue, " and max_batch_size ", options.max_batch_size,
        " must be >= 1, max_queue_delay_us ", options.max_queue_delay_us, " >= 0"));
  }
  impl->shutdown_delay_seconds = options.shutdown_delay_seconds;
  impl->drain_seconds = options.drain_seconds;
  server::Metrics* metrics = &impl->metrics;
  metrics->SetLimits(options.max_queue, options.memory_budget_mb << 20,
                     options.session_memory_mb << 20);
  server::SchedulerHooks hooks;
  hooks.queue_depth = [metrics](int64_t depth) { metrics->SetQueueDepth(depth); };
  hooks.batch_size = [metrics](int32_t size) { metrics->ObserveBatchSize(size); };
  hooks.not_computed = [metrics](const char* reason) { metrics->CountNotComputed(reason); };
  hooks.interrupted = [metrics](const char* reason) { metrics->CountInterrupted(reason); };
  impl->scheduler =
      std::make_unique<server::Scheduler>(impl->engine.get(), options.max_queue, std::move(hooks));
  server::ServiceOptions service_options;
  service_options.max_message_bytes = max_message_bytes;
  service_options.max_queue = options.max_queue;
  service_options.max_batch_size = options.max_batch_size;
  service_options.max_queue_delay_us = options.max_queue_delay_us;
  service_options.memory_budget_bytes = options.memory_budget_mb << 20;
  service_options.session_memory_bytes = options.session_memory_mb << 20;
  service_options.session_idle_seconds = options.session_idle_seconds;
  impl->service = std::make_unique<server::AttentionServiceImpl>(
      impl->engine.get(), impl->models.get(), impl->scheduler.get(), &impl->metrics,
      impl->auth.get(), service_options);

  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, credentials, &impl->port);
  builder.SetMaxReceiveMessageSize(max_message_bytes);
  builder.SetMaxSendMessageSize(max_message_bytes);
  // A second server on a taken port must fail, not silently share the traffic.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  if (options.max_concurrent_streams > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_concurrent_streams);
  }
  if (options.max_connection_age_seconds > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS,
                               static_cast<int>(options.max_connection_age_seconds * 1000));
    builder.AddChannelArgument(
        GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
        static_cast<int>(std::min(options.drain_seconds, kMaxSeconds) * 1000));
  }
  builder.RegisterService(impl->service.get());
  // The health service is gRPC's own; reflection describes it from the
  // project's copy of health.proto, which only naming its descriptor links
  // into the binary.
  const std::string health_service = grpc::health::v1::HealthCheckRequest::descriptor()
                                         ->file()
                                         ->FindServiceByName("Health")
                                         ->full_name();
  impl->reflection = std::make_unique<server::ReflectionService>(
      std::vector<std::string>{v1::AttentionService::service_full_name(), health_service,
                               grpc::reflection::v1alpha::ServerReflection::service_full_name()},
      impl->auth.get());
  builder.RegisterService(impl->reflection.get());
  impl->grpc_server = builder.BuildAndStart();
  if (impl->grpc_server == nullptr || impl->port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen));
  }
  impl->address = absl::StrCat(DialHost(options.listen), ":", impl->port);
  impl->service->SetReplica(options.replica_name.empty()
                                ? absl::StrCat(HostName(), ":", impl->port)
                                : options.replica_name);

  // NOT_SERVING until the engine has run every kind of call once.
  grpc::HealthCheckServiceInterface* health = impl->grpc_server->GetHealthCheckService();
  health->SetServingStatus("", false);
  health->SetServingStatus(v1::AttentionService::service_full_name(), false);
  if (options.before_warm_up) {
    options.before_warm_up(impl->metrics_server ? impl->metrics_server->port() : -1);
  }
  if (absl::Status warm = WarmUp(*impl->engine, *impl->models); !warm.ok()) {
    impl->grpc_server->Shutdown();
    return warm;
  }
  health->SetServingStatus("", true);
  health->SetServingStatus(v1::AttentionService::service_full_name(), true);
  if (impl->metrics_server) impl->metrics_server->SetReady();  // /readyz follows health
  const std::vector<int>& cpus = impl->engine->bound_cpus();
  spdlog::info("serving on {} (engine {} {} x{}{}, {} models, tls {}, auth {}, metrics port {})",
               impl->address, impl->engine->backend_name(), impl->engine->isa(),
               impl->engine->threads(),
               cpus.empty() ? "" : absl::StrCat(" bound to CPUs ", absl::StrJoin(cpus, ",")),
               impl->models->models().size(), options.tls_cert_file.empty() ? "off" : "on",
               impl->auth ? "on" : "off", impl->metrics_server ? impl->metrics_server->port() : -1);
  return std::unique_ptr<AttentionServer>(new AttentionServer(std::move(impl)));
}

AttentionServer::AttentionServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

AttentionServer::~AttentionServer() {
  Shutdown();
  Wait();
}

int AttentionServer::port() const { return impl_->port; }

std::string AttentionServer::address() const { return impl_->address; }

void AttentionServer::Shutdown() {
  absl::MutexLock lock(&impl_->mu);
  if (impl_->shut_down) return;
  impl_->shut_down = true;
  const auto stop_announcing = [&] {
    impl_->grpc_server->GetHealthCheckService()->Shutdown();
    if (impl_->metrics_server) {
      impl_->metrics_server->SetNotReady("draining: the server is shutting down");
    }
  };
  server::AttentionServiceImpl& service = *impl_->service;
  if (impl_->shutdown_delay_seconds > 0) {
    stop_announcing();
    // Health checkers (a proxy's, a load balancer's) take the replica out
    // meanwhile, so the calls that would otherwise be refused below go to
    // the others instead.
    spdlog::info("shutting down: NOT_SERVING, still serving calls for {} s before the drain "
                 "(a second SIGTERM or SIGINT drains at once)",
                 impl_->shutdown_delay_seconds);
    impl_->shutdown_delay_ended.WaitForNotificationWithTimeout(
        absl::Seconds(impl_->shutdown_delay_seconds));
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(impl_->drain_seconds);
  spdlog::info("draining: NOT_SERVING, refusing new calls, {} s for calls in flight",
               impl_->drain_seconds);
  // The connections stay open until the calls taken have answered and their
  // answers have left: gRPC closes a connection as soon as its last call
  // ends after a shutdown began, and the close resets it when the caller's
  // flow-control updates arrive after it, discarding what the socket still
  // held of an answer (docs/benchmarks.md, "Decisions"). Meanwhile the
  // service refuses new calls UNAVAILABLE. Without a delay it refuses them
  // before health turns NOT_SERVING, so no caller that has seen NOT_SERVING
  // is served.
  service.StartDraining();
  if (impl_->shutdown_delay_seconds <= 0) stop_announcing();
  while (service.open_calls() > 0 && absl::Now() < deadline) {
    absl::SleepFor(kDrainPoll);
  }
  const absl::Time quiet = std::min(service.last_call_end() + kAnswerLinger, deadline);
  if (absl::Now() < quiet) absl::SleepFor(quiet - absl::Now());
  const int64_t open = service.open_calls();
  spdlog::info("drained: {} calls still open; closing connections", open);
  // Calls still open past the deadline are cancelled, and every connection
  // then closed; with none open, connections get kCloseGrace to say goodbye.
  const absl::Time close_by = open == 0 ? std::min(deadline, absl::Now() + kCloseGrace) : deadline;
  impl_->grpc_server->Shutdown(absl::ToChronoTime(close_by));
}

void AttentionServer::EndShutdownDelay() {
  if (!impl_->shutdown_delay_ending.exchange(true)) impl_->shutdown_delay_ended.Notify();
}

int AttentionServer::metrics_port() const {
  return impl_->metrics_server ? impl_->metrics_server->port() : -1;
}

const server::Metrics& AttentionServer::metrics() const { return impl_->metrics; }

void AttentionServer::Wait() { impl_->grpc_server->Wait(); }

}  // namespace attention
