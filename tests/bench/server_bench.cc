// attention_server_bench: end-to-end QPS and latency of AttentionServer, each
// beside a bare gRPC echo of the same request and response bytes
// (tests/bench/echo.proto) and beside the engine alone on the same shape, all
// in one process and one run; 64 small callers with dynamic batching on and
// off; FLOAT32 against BFLOAT16 on the wire. Targets are informational: the
// exit code is 1 only when a server cannot start or a call fails.
// docs/benchmarks.md.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/flags_help.h"
#include "attention/v1/service.grpc.pb.h"
#include "client/attention_client.h"
#include "client/tensors.h"
#include "engine/engine.h"
#include "engine/multihead.h"
#include "common/status_macros.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"
#include "server/model_repository.h"
#include "server/openmp_defaults.h"
#include "server/server.h"
#include "tests/bench/echo.grpc.pb.h"

#ifndef ATTENTION_MODELS_DIR
#error "ATTENTION_MODELS_DIR must be defined by the build"
#endif

ABSL_FLAG(double, seconds, 2.0,
          "Measured seconds of each small and medium load (server, echo or engine alone); large "
          "loads take 2x, 64-caller loads 1.5x. Loads being compared alternate over 3 rounds, "
          "each after a warm-up.");
ABSL_FLAG(int, engine_threads, 0,
          "Compute threads of the servers' engines and of the engine-only runs; 0 means one per "
          "core, the server's default.");
ABSL_FLAG(int64_t, batch_delay_us, attention::ServerOptions().max_queue_delay_us,
          "max_queue_delay_us of the batching server of the 64-caller comparison (default: the "
          "server's)");
ABSL_FLAG(std::vector<std::string>, sections, std::vector<std::string>({"e2e", "batching", "wire"}),
          "Which tables to run: e2e (server vs echo vs engine), batching (64 small callers), "
          "wire (f32 vs bf16).");
ABSL_FLAG(int64_t, echo_busy_us, 0,
          "Each echo call first busy-waits this many microseconds on gRPC's thread, as a server "
          "computing inline does: with the engine column's time, the echo carries the server's "
          "compute, and 'x echo' shows the server's overhead beyond it.");
ABSL_FLAG(std::vector<std::string>, workloads,
          std::vector<std::string>({"small", "medium", "large"}),
          "Workloads of the e2e and wire tables: small, medium, large.");

namespace attention {
namespace {

using Clock = std::chrono::steady_clock;

// Closed-loop callers per workload; each has one call in flight at a time.
constexpr int kSmallCallers = 4;  // small and medium
constexpr int kLargeCallers = 1;
constexpr int kManyCallers = 64;
// Callers share a channel (one TCP connection) in groups of this many.
constexpr int kCallersPerChannel = 8;
// Batch size of the second server of the 64-caller comparison (its delay is
// --batch_delay_us); every other run uses a server with batching off
// (max_batch_size 1).
constexpr int32_t kBatchSize = 64;

constexpr int64_t kMaxMessageMb = 256;
// Each comparison alternates its loads over kRounds rounds.
constexpr int kRounds = 3;
constexpr double kWarmUpSeconds = 0.5;
constexpr double kRewarmSeconds = 0.2;
constexpr auto kCallTimeout = std::chrono::seconds(60);
// The echo's canned answer and the server's differ only in the varints of
// queue_us and compute_us.
constexpr int64_t kResponseBytesSlack = 8;

// The targets.
constexpr double kMinEchoQpsRatio = 0.8;      // small, medium: server QPS / echo QPS
constexpr double kMaxLargeTimeRatio = 1.15;   // large: time / (echo time + engine time)
constexpr double kMinBatchingQpsRatio = 2.0;  // 64 small callers: on / off
constexpr double kP99SingleLatencies = 3.0;   // p99 on <= delay + this x single latency

enum class Mode { kUnary, kStream };

const char* ModeName(Mode mode) { return mode == Mode::kUnary ? "unary" : "stream"; }

// --- requests -------------------------------------------------------------------

struct Workload {
  std::string name;   // "small", "medium", "large"
  std::string shape;  // for the tables
  int callers = 1;
  double time_scale = 1;  // x --seconds
  v1::AttendRequest request;
};

absl::StatusOr<v1::Tensor> RandomTensor(const std::vector<int64_t>& shape, v1::Tensor::DType dtype,
                                        uint32_t seed) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> values(count);
  for (float& v : values) v = dist(rng);
  return client::MakeFloatTensor(shape, values, dtype);
}

// Self-attention of `model` on query [B, L, E], or raw attention on rank-4
// query, key and value of `shape`; inputs and output as `dtype`.
absl::StatusOr<v1::AttendRequest> MakeRequest(const std::string& model,
                                              const std::vector<int64_t>& shape,
                                              v1::Tensor::DType dtype) {
  v1::AttendRequest request;
  request.set_id("bench");
  request.set_model(model);
  request.set_output_dtype(dtype);
  ATTN_ASSIGN_OR_RETURN(*request.mutable_query(), RandomTensor(shape, dtype, 1));
  if (model.empty()) {
    ATTN_ASSIGN_OR_RETURN(*request.mutable_key(), RandomTensor(shape, dtype, 2));
    ATTN_ASSIGN_OR_RETURN(*request.mutable_value(), RandomTensor(shape, dtype, 3));
  }
  return request;
}

absl::StatusOr<Workload> MakeWorkload(const std::string& name, v1::Tensor::DType dtype) {
  Workload w;
  w.name = name;
  if (name == "small") {
    w.shape = "demo B1 L16 E64";
    w.callers = kSmallCallers;
    ATTN_ASSIGN_OR_RETURN(w.request, MakeRequest("demo", {1, 16, 64}, dtype));
  } else if (name == "medium") {
    w.shape = "B1 H8 L=S=128 D64";
    w.callers = kSmallCallers;
    ATTN_ASSIGN_OR_RETURN(w.request, MakeRequest("", {1, 8, 128, 64}, dtype));
  } else {
    w.shape = "B8 H8 L=S=512 D64";
    w.callers = kLargeCallers;
    w.time_scale = 2;
    ATTN_ASSIGN_OR_RETURN(w.request, MakeRequest("", {8, 8, 512, 64}, dtype));
  }
  if (dtype == v1::Tensor::BFLOAT16) absl::StrAppend(&w.shape, " bf16");
  return w;
}

// --- the echo server ------------------------------------------------------------

// The canned answers for the workload being measured: the real server's
// response to its request, unary and on a stream (which adds `status`).
struct CannedResponses {
  v1::AttendResponse unary;
  v1::AttendResponse stream;
};

// --echo_busy_us: spins on the calling thread, as compute would hold it.
void EchoBusyWait() {
  static const absl::Duration busy = absl::Microseconds(absl::GetFlag(FLAGS_echo_busy_us));
  if (busy <= absl::ZeroDuration()) return;
  const Clock::time_point until = Clock::now() + absl::ToChronoNanoseconds(busy);
  while (Clock::now() < until) {
  }
}

// One AttendStream call: reads a request, writes the canned answer, repeats.
// Deletes itself in OnDone.
class EchoStream final : public grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse> {
 public:
  explicit EchoStream(std::shared_ptr<const CannedResponses> canned) : canned_(std::move(canned)) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
      return;
    }
    EchoBusyWait();
    response_ = canned_->stream;
    StartWrite(&response_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed"));
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  const std::shared_ptr<const CannedResponses> canned_;
  v1::AttendRequest request_;
  v1::AttendResponse response_;
};

// attention.bench.Echo: answers every request with a copy of the canned
// response, so a call costs gRPC and protobuf alone. Thread-safe.
class EchoService final : public bench::Echo::CallbackService {
 public:
  EchoService() : canned_(std::make_shared<CannedResponses>()) {}

  // Calls from now on get these answers.
  void SetResponses(CannedResponses canned) {
    auto shared = std::make_shared<const CannedResponses>(std::move(canned));
    absl::MutexLock lock(&mu_);
    canned_ = std::move(shared);
  }

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const v1::AttendRequest* /*request*/,
                                   v1::AttendResponse* response) override {
    EchoBusyWait();
    *response = Canned()->unary;
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* AttendStream(
      grpc::CallbackServerContext* /*context*/) override {
    return new EchoStream(Canned());
  }

 private:
  std::shared_ptr<const CannedResponses> Canned() const {
    absl::ReaderMutexLock lock(&mu_);
    return canned_;
  }

  mutable absl::Mutex mu_;
  std::shared_ptr<const CannedResponses> canned_ ABSL_GUARDED_BY(mu_);
};

// EchoService on 127.0.0.1:<free port>, with the real server's message limits.
class EchoServer {
 public:
  static absl::StatusOr<std::unique_ptr<EchoServer>> Create() {
    auto echo = std::unique_ptr<EchoServer>(new EchoServer());
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.SetMaxReceiveMessageSize(kMaxMessageMb << 20);
    builder.SetMaxSendMessageSize(kMaxMessageMb << 20);
    builder.RegisterService(&echo->service_);
    echo->server_ = builder.BuildAndStart();
    if (echo->server_ == nullptr || port == 0) {
      return absl::UnavailableError("echo server: cannot listen on 127.0.0.1:0");
    }
    echo->address_ = absl::StrCat("127.0.0.1:", port);
    return echo;
  }

  ~EchoServer() {
    if (server_ != nullptr) server_->Shutdown();
  }

  EchoService& service() { return service_; }
  const std::string& address() const { return address_; }

 private:
  EchoServer() = default;
  EchoService service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

// --- closed-loop load -----------------------------------------------------------

// Calls are counted when they complete in [from, to); the time before `from`
// warms up connections, flow-control windows and the engine's primitives.
struct Window {
  Clock::time_point from;
  Clock::time_point to;
};

struct Samples {
  std::vector<double> latency_us;
  // CPU time of this whole process (callers, servers and engine) while the
  // window was open; 0 when not measured.
  double cpu_seconds = 0;
  int64_t batch_size_sum = 0;
  int64_t queue_us_sum = 0;
  int64_t compute_us_sum = 0;
  int64_t response_bytes = 0;
  int64_t errors = 0;
  std::string first_error;

  // False, and nothing added, when `done` is outside the window.
  bool AddLatency(Clock::time_point sent, Clock::time_point done, const Window& window) {
    if (done < window.from || done >= window.to) return false;
    latency_us.push_back(std::chrono::duration<double, std::micro>(done - sent).count());
    return true;
  }

  void Add(const v1::AttendResponse& response, Clock::time_point sent, Clock::time_point done,
           const Window& window) {
    if (!AddLatency(sent, done, window)) return;
    batch_size_sum += response.batch_size();
    queue_us_sum += response.queue_us();
    compute_us_sum += response.compute_us();
    response_bytes = static_cast<int64_t>(response.ByteSizeLong());
  }

  void AddError(const std::string& message) {
    if (errors++ == 0) first_error = message;
  }

  void Merge(const Samples& other) {
    latency_us.insert(latency_us.end(), other.latency_us.begin(), other.latency_us.end());
    batch_size_sum += other.batch_size_sum;
    queue_us_sum += other.queue_us_sum;
    compute_us_sum += other.compute_us_sum;
    response_bytes = std::max(response_bytes, other.response_bytes);
    cpu_seconds += other.cpu_seconds;
    if (errors == 0 && other.errors > 0) first_error = other.first_error;
    errors += other.errors;
  }
};

// One closed-loop caller: a call, its answer, the next call, until the window
// closes; then it counts `finished` down once.
class Caller {
 public:
  virtual ~Caller() = default;
  virtual void Start() = 0;
  // Valid once `finished` has reached zero.
  const Samples& samples() const { return samples_; }

 protected:
  Caller(const v1::AttendRequest* request, Window window, absl::BlockingCounter* finished)
      : request_(request), window_(window), finished_(finished) {}

  const v1::AttendRequest* const request_;
  const Window window_;
  absl::BlockingCounter* const finished_;
  Samples samples_;
};

// Unary calls through a stub's callback API; each call is issued from the
// previous one's callback, so at most one runs at a time and the members need
// no lock.
template <typename Stub>
class UnaryCaller final : public Caller {
 public:
  UnaryCaller(Stub* stub, const v1::AttendRequest* request, Window window,
              absl::BlockingCounter* finished)
      : Caller(request, window, finished), stub_(stub) {}

  void Start() override { Call(); }

 private:
  void Call() {
    // This runs in the finished call's callback: its context is kept until the
    // next callback rather than destroyed under gRPC's feet.
    previous_context_ = std::move(context_);
    context_ = std::make_unique<grpc::ClientContext>();
    context_->set_deadline(std::chrono::system_clock::now() + kCallTimeout);
    response_.Clear();
    sent_ = Clock::now();
    stub_->async()->Attend(context_.get(), request_, &response_,
                           [this](grpc::Status status) { OnDone(status); });
  }

  void OnDone(const grpc::Status& status) {
    const Clock::time_point now = Clock::now();
    if (!status.ok()) {
      samples_.AddError(absl::StrCat(status.error_code(), ": ", status.error_message()));
      finished_->DecrementCount();
      return;
    }
    samples_.Add(response_, sent_, now, window_);
    if (now < window_.to) {
      Call();
    } else {
      finished_->DecrementCount();
    }
  }

  Stub* const stub_;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientContext> previous_context_;
  v1::AttendResponse response_;
  Clock::time_point sent_;
};

// One bidi stream with one request in flight: the next is written when the
// answer to the previous one has been read.
template <typename Stub>
class StreamCaller final : public Caller,
                           public grpc::ClientBidiReactor<v1::AttendRequest, v1::AttendResponse> {
 public:
  StreamCaller(Stub* stub, const v1::AttendRequest* request, Window window,
               absl::BlockingCounter* finished)
      : Caller(request, window, finished), stub_(stub) {}

  void Start() override {
    context_.set_deadline(std::chrono::system_clock::now() + kCallTimeout +
                          (window_.to - Clock::now()));
    stub_->async()->AttendStream(&context_, this);
    StartRead(&response_);
    {
      absl::MutexLock lock(&mu_);
      SendLocked();
    }
    StartCall();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) return;  // the stream is over; OnDone says why
    if (send_pending_) {
      send_pending_ = false;
      writing_ = true;
      StartWrite(request_);
    } else if (closing_) {
      StartWritesDone();
    }
  }

  void OnReadDone(bool ok) override {
    const Clock::time_point now = Clock::now();
    if (!ok) return;
    absl::MutexLock lock(&mu_);
    if (response_.status().code() != 0) {
      samples_.AddError(
          absl::StrCat(response_.status().code(), ": ", response_.status().message()));
      CloseLocked();
      return;
    }
    samples_.Add(response_, sent_, now, window_);
    if (now < window_.to) {
      StartRead(&response_);
      SendLocked();
    } else {
      CloseLocked();
    }
  }

  void OnDone(const grpc::Status& status) override {
    if (!status.ok()) {
      samples_.AddError(absl::StrCat(status.error_code(), ": ", status.error_message()));
    }
    finished_->DecrementCount();
  }

 private:
  // Writes the request now, or when the previous write completes.
  void SendLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    sent_ = Clock::now();
    if (writing_) {
      send_pending_ = true;
      return;
    }
    writing_ = true;
    StartWrite(request_);
  }

  void CloseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    closing_ = true;
    if (!writing_) StartWritesDone();
  }

  Stub* const stub_;
  grpc::ClientContext context_;
  v1::AttendResponse response_;
  absl::Mutex mu_;
  Clock::time_point sent_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool send_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
};

// A channel with its own TCP connection (channels with equal arguments would
// otherwise share one), connected before it is returned.
absl::StatusOr<std::shared_ptr<grpc::Channel>> Connect(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(kMaxMessageMb << 20);
  args.SetMaxReceiveMessageSize(kMaxMessageMb << 20);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10))) {
    return absl::UnavailableError(absl::StrCat("cannot connect to ", address));
  }
  return channel;
}

struct LoadResult {
  int callers = 0;
  int64_t calls = 0;
  double qps = 0;
  double mean_us = 0;
  double p50_us = 0;
  double p99_us = 0;
  double mean_batch = 0;
  double mean_queue_us = 0;
  double mean_compute_us = 0;
  double cpu_cores = 0;  // CPU time / measured time: cores this process kept busy
  int64_t request_bytes = 0;
  int64_t response_bytes = 0;
};

// Nearest-rank percentile of sorted `values`.
double Percentile(const std::vector<double>& values, double p) {
  const size_t rank = static_cast<size_t>(std::ceil(p * values.size()));
  return values[std::clamp<size_t>(rank, 1, values.size()) - 1];
}

// One load to measure: `callers` closed-loop callers of one service, on
// channels kept across its runs; `run` makes one run of a warm-up and then
// `measure`, INTERNAL when any call failed (with the first error).
struct Load {
  std::string name;
  int callers = 0;
  int64_t request_bytes = 0;
  std::function<absl::StatusOr<Samples>(absl::Duration warm_up, absl::Duration measure)> run;
};

// CPU time of this process so far: all its threads.
double ProcessCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + t.tv_nsec * 1e-9;
}

// A Load of `callers` callers of `Service` (AttentionService or Echo) at
// `address`, kCallersPerChannel to a channel. `request` must outlive it.
template <typename Service>
absl::StatusOr<Load> MakeLoad(std::string name, const std::string& address, Mode mode, int callers,
                              const v1::AttendRequest* request) {
  using Stub = typename Service::Stub;
  auto stubs = std::make_shared<std::vector<std::unique_ptr<Stub>>>();
  for (int i = 0; i < callers; i += kCallersPerChannel) {
    ATTN_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, Connect(address));
    stubs->push_back(Service::NewStub(channel));
  }
  Load load{std::move(name), callers, static_cast<int64_t>(request->ByteSizeLong()), nullptr};
  load.run = [stubs, address, mode, callers, request](
                 absl::Duration warm_up, absl::Duration measure) -> absl::StatusOr<Samples> {
    const Clock::time_point start = Clock::now();
    const Window window{start + absl::ToChronoNanoseconds(warm_up),
                        start + absl::ToChronoNanoseconds(warm_up + measure)};
    absl::BlockingCounter finished(callers);
    std::vector<std::unique_ptr<Caller>> all;
    for (int i = 0; i < callers; ++i) {
      Stub* stub = (*stubs)[i / kCallersPerChannel].get();
      if (mode == Mode::kUnary) {
        all.push_back(std::make_unique<UnaryCaller<Stub>>(stub, request, window, &finished));
      } else {
        all.push_back(std::make_unique<StreamCaller<Stub>>(stub, request, window, &finished));
      }
    }
    for (std::unique_ptr<Caller>& caller : all) caller->Start();
    std::this_thread::sleep_until(window.from);
    const double cpu_from = ProcessCpuSeconds();
    std::this_thread::sleep_until(window.to);
    const double cpu_to = ProcessCpuSeconds();
    finished.Wait();
    Samples samples;
    for (const std::unique_ptr<Caller>& caller : all) samples.Merge(caller->samples());
    samples.cpu_seconds = cpu_to - cpu_from;
    if (samples.errors > 0) {
      return absl::InternalError(absl::StrCat(samples.errors, " failed calls to ", address,
                                              ", the first: ", samples.first_error));
    }
    return samples;
  };
  return load;
}

// The engine alone: one caller's calls of what the server's dispatcher runs
// for `request` (Engine::AttendBatchFromThisThread of one call: raw attention or
// `layer`'s forward), on the calling thread, as the dispatcher does. Conversion
// to and from the wire is the server's, not counted here. `request` must
// outlive the Load.
Load MakeEngineLoad(const Engine* engine, const MultiheadAttention* layer,
                    const v1::AttendRequest* request) {
  auto view = [](const v1::Tensor& t) -> TensorView {
    if (t.shape().empty()) return {};
    return TensorView{t.dtype() == v1::Tensor::BFLOAT16 ? DType::kBFloat16 : DType::kFloat32,
                      {t.shape().begin(), t.shape().end()},
                      t.data().data(),
                      t.data().size()};
  };
  AttentionArgs args;
  args.query = view(request->query());
  args.key = view(request->key());
  args.value = view(request->value());
  args.num_heads = request->num_heads();
  Load load{"engine", 1, static_cast<int64_t>(request->ByteSizeLong()), nullptr};
  load.run = [engine, layer, args](absl::Duration warm_up,
                                   absl::Duration measure) -> absl::StatusOr<Samples> {
    const Clock::time_point start = Clock::now();
    const Window window{start + absl::ToChronoNanoseconds(warm_up),
                        start + absl::ToChronoNanoseconds(warm_up + measure)};
    Samples samples;
    for (Clock::time_point now = start; now < window.to;) {
      const Clock::time_point sent = now;
      const EngineCall call{&args, layer};
      std::vector<absl::StatusOr<AttentionResult>> results =
          engine->AttendBatchFromThisThread({&call, 1});
      if (!results[0].ok()) return results[0].status();
      now = Clock::now();
      samples.AddLatency(sent, now, window);
    }
    return samples;
  };
  return load;
}

// Runs `loads` in turn, kRounds times over, each for `measure` in all, so
// that ratios between them see the same noise of a shared machine. The first
// round of each warms up for kWarmUpSeconds, later ones for kRewarmSeconds.
absl::StatusOr<std::vector<LoadResult>> Interleave(const std::vector<Load>& loads,
                                                   absl::Duration measure) {
  std::vector<Samples> samples(loads.size());
  for (int round = 0; round < kRounds; ++round) {
    const absl::Duration warm_up = absl::Seconds(round == 0 ? kWarmUpSeconds : kRewarmSeconds);
    for (size_t i = 0; i < loads.size(); ++i) {
      ATTN_ASSIGN_OR_RETURN(Samples s, loads[i].run(warm_up, measure / kRounds));
      samples[i].Merge(s);
    }
  }
  std::vector<LoadResult> results;
  for (size_t i = 0; i < loads.size(); ++i) {
    std::vector<double>& latency = samples[i].latency_us;
    if (latency.empty()) {
      return absl::InternalError(absl::StrCat(loads[i].name, ": no call completed in time"));
    }
    std::sort(latency.begin(), latency.end());
    LoadResult r;
    r.callers = loads[i].callers;
    r.calls = static_cast<int64_t>(latency.size());
    const double n = static_cast<double>(r.calls);
    r.qps = n / absl::ToDoubleSeconds(measure);
    double sum = 0;
    for (double l : latency) sum += l;
    r.mean_us = sum / n;
    r.p50_us = Percentile(latency, 0.50);
    r.p99_us = Percentile(latency, 0.99);
    r.mean_batch = samples[i].batch_size_sum / n;
    r.mean_queue_us = samples[i].queue_us_sum / n;
    r.mean_compute_us = samples[i].compute_us_sum / n;
    r.cpu_cores = samples[i].cpu_seconds / absl::ToDoubleSeconds(measure);
    r.request_bytes = loads[i].request_bytes;
    r.response_bytes = samples[i].response_bytes;
    results.push_back(r);
  }
  return results;
}

// --- the servers ----------------------------------------------------------------

absl::StatusOr<std::unique_ptr<AttentionServer>> StartServer(int32_t max_batch_size,
                                                             int64_t max_queue_delay_us) {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.max_message_mb = kMaxMessageMb;
  options.model_repository = ATTENTION_MODELS_DIR;
  options.max_batch_size = max_batch_size;
  options.max_queue_delay_us = max_queue_delay_us;
  options.drain_seconds = 5;
  options.engine.threads = absl::GetFlag(FLAGS_engine_threads);
  return AttentionServer::Create(options);
}

// The real server's answers to `request`, unary (through the client library)
// and as the first answer of a stream.
absl::StatusOr<CannedResponses> Capture(client::AttentionClient& client,
                                        const v1::AttendRequest& request) {
  CannedResponses canned;
  ATTN_ASSIGN_OR_RETURN(canned.unary, client.Attend(request));
  std::unique_ptr<v1::AttentionService::Stub> stub =
      v1::AttentionService::NewStub(client.channel());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kCallTimeout);
  auto stream = stub->AttendStream(&context);
  const bool ok = stream->Write(request) && stream->Read(&canned.stream) && stream->WritesDone();
  const grpc::Status status = stream->Finish();
  if (!ok || !status.ok() || canned.stream.status().code() != 0) {
    return absl::InternalError(absl::StrCat("AttendStream: ", status.error_message(), " ",
                                            canned.stream.status().message()));
  }
  return canned;
}

// --- the report -----------------------------------------------------------------

std::string Ms(double us) { return absl::StrFormat("%.3f", us / 1000); }

std::string Bytes(int64_t bytes) {
  if (bytes >= (int64_t{1} << 20)) return absl::StrFormat("%.1fM", bytes / 1048576.0);
  if (bytes >= 1024) return absl::StrFormat("%.1fK", bytes / 1024.0);
  return absl::StrCat(bytes);
}

std::string Verdict(bool met) { return met ? "met" : "MISSED"; }

void PrintLine(const std::string& line) { std::cout << line << std::endl; }

// What is measured, and against which target, for the summary at the end.
struct Check {
  std::string what;
  double value = 0;
  std::string target;
  bool met = false;
};

class Report {
 public:
  void Add(Check check) { checks_.push_back(std::move(check)); }

  void PrintSummary() const {
    PrintLine("\nTargets (informational; ratios come from the same run):");
    for (const Check& c : checks_) {
      PrintLine(absl::StrFormat("  %-58s %7.3fx  target %-9s %s", c.what, c.value, c.target,
                                Verdict(c.met)));
    }
  }

 private:
  std::vector<Check> checks_;
};

struct Context {
  const Engine* engine = nullptr;
  const MultiheadAttention* demo = nullptr;
  AttentionServer* server = nullptr;  // batching off
  client::AttentionClient* client = nullptr;
  EchoServer* echo = nullptr;
  absl::Duration seconds;
  std::vector<std::string> workloads;
  Report* report = nullptr;
};

Load EngineLoad(const Context& ctx, const Workload& w) {
  return MakeEngineLoad(ctx.engine, w.request.model().empty() ? nullptr : ctx.demo, &w.request);
}

// The end-to-end table: each workload in each mode on the server and on the
// echo, interleaved, with the engine alone on the same shape.
absl::Status RunEndToEnd(const Context& ctx) {
  PrintLine(
      "\n== End to end: server (batching off) vs bare gRPC echo of the same bytes vs engine "
      "alone ==\n"
      "QPS: completed calls/s over all callers; latencies in ms; compute: the server's mean "
      "compute_us;\nengine: the engine alone, one caller, mean ms per call; x echo: server QPS "
      "/ echo QPS;\nx bound: server QPS / (1 / (1/echo QPS + engine time)), i.e. against a "
      "server whose calls cost\nthe echo's share of the cores plus the engine's, nothing "
      "overlapping; x sum: server mean latency / (echo\nmean latency + engine time); cpu: cores "
      "this process (callers and server, or callers and echo) kept\nbusy while measured, out of "
      "the machine's " +
      std::to_string(std::thread::hardware_concurrency()) + ".\n");
  PrintLine(absl::StrFormat(
      "%-7s %-6s %3s %15s | %8s %7s %7s %7s %4s | %8s %7s %7s %4s | %7s | %6s %7s %6s", "load",
      "mode", "cal", "req+resp bytes", "srv QPS", "p50", "p99", "compute", "cpu", "echo QPS", "p50",
      "p99", "cpu", "engine", "x echo", "x bound", "x sum"));
  std::vector<std::string> shapes;
  for (const std::string& name : ctx.workloads) {
    ATTN_ASSIGN_OR_RETURN(Workload w, MakeWorkload(name, v1::Tensor::FLOAT32));
    shapes.push_back(absl::StrCat(name, ": ", w.shape));
    ATTN_ASSIGN_OR_RETURN(CannedResponses canned, Capture(*ctx.client, w.request));
    ctx.echo->service().SetResponses(canned);
    const absl::Duration measure = ctx.seconds * w.time_scale;
    for (Mode mode : {Mode::kUnary, Mode::kStream}) {
      std::vector<Load> loads(3);
      ATTN_ASSIGN_OR_RETURN(
          loads[0], MakeLoad<v1::AttentionService>("server", ctx.server->address(), mode, w.callers,
                                                   &w.request));
      ATTN_ASSIGN_OR_RETURN(loads[1], MakeLoad<bench::Echo>("echo", ctx.echo->address(), mode,
                                                            w.callers, &w.request));
      loads[2] = EngineLoad(ctx, w);
      ATTN_ASSIGN_OR_RETURN(std::vector<LoadResult> results, Interleave(loads, measure));
      const LoadResult& server = results[0];
      const LoadResult& echo = results[1];
      const LoadResult& engine = results[2];
      const double qps_ratio = server.qps / echo.qps;
      const double bound_ratio = server.qps * (1 / echo.qps + engine.mean_us * 1e-6);
      const double sum_ratio = server.mean_us / (echo.mean_us + engine.mean_us);
      PrintLine(absl::StrFormat(
          "%-7s %-6s %3d %7s+%-7s | %8.0f %7s %7s %7s %4.2f | %8.0f %7s %7s %4.2f | %7s | %5.2fx "
          "%6.2fx %5.2fx",
          name, ModeName(mode), w.callers, Bytes(server.request_bytes),
          Bytes(server.response_bytes), server.qps, Ms(server.p50_us), Ms(server.p99_us),
          Ms(server.mean_compute_us), server.cpu_cores, echo.qps, Ms(echo.p50_us), Ms(echo.p99_us),
          echo.cpu_cores, Ms(engine.mean_us), qps_ratio, bound_ratio, sum_ratio));
      if (std::abs(echo.response_bytes - server.response_bytes) > kResponseBytesSlack) {
        PrintLine(absl::StrFormat("  warning: echo answers %d bytes, the server %d",
                                  echo.response_bytes, server.response_bytes));
      }
      const std::string what = absl::StrCat(name, " ", ModeName(mode), ", ", w.callers, " caller",
                                            w.callers == 1 ? "" : "s", ": ");
      if (w.name == "large") {
        ctx.report->Add({absl::StrCat(what, "time / (echo + engine)"), sum_ratio,
                         absl::StrFormat("<= %.2fx", kMaxLargeTimeRatio),
                         sum_ratio <= kMaxLargeTimeRatio});
      } else {
        ctx.report->Add({absl::StrCat(what, "QPS / echo QPS"), qps_ratio,
                         absl::StrFormat(">= %.2fx", kMinEchoQpsRatio),
                         qps_ratio >= kMinEchoQpsRatio});
      }
    }
  }
  PrintLine(absl::StrFormat(
      "%s.\nsmall and medium: %d callers on one channel; large: %d caller. A stream carries one "
      "request at a time.",
      absl::StrJoin(shapes, "; "), kSmallCallers, kLargeCallers));
  return absl::OkStatus();
}

void PrintManyRow(const std::string& who, const LoadResult& r, bool server) {
  PrintLine(absl::StrFormat("%-34s %4d %9.0f %8s %8s %8s %7s %9s %9s", who, r.callers, r.qps,
                            Ms(r.mean_us), Ms(r.p50_us), Ms(r.p99_us),
                            server ? absl::StrFormat("%.1f", r.mean_batch) : "-",
                            server ? absl::StrFormat("%.0f", r.mean_queue_us) : "-",
                            server ? absl::StrFormat("%.0f", r.mean_compute_us) : "-"));
}

// 64 small callers, batching off (the shared server) and on (a second server).
absl::Status RunBatching(const Context& ctx) {
  PrintLine(absl::StrFormat(
      "\n== %d concurrent small (demo L16) unary callers, %d channels of %d: batching on vs off "
      "==\n",
      kManyCallers, kManyCallers / kCallersPerChannel, kCallersPerChannel));
  ATTN_ASSIGN_OR_RETURN(Workload w, MakeWorkload("small", v1::Tensor::FLOAT32));
  ATTN_ASSIGN_OR_RETURN(CannedResponses canned, Capture(*ctx.client, w.request));
  ctx.echo->service().SetResponses(canned);
  const absl::Duration measure = ctx.seconds * 1.5;
  PrintLine(absl::StrFormat("%-34s %4s %9s %8s %8s %8s %7s %9s %9s", "server", "cal", "QPS", "mean",
                            "p50", "p99", "batch", "queue_us", "compute"));
  std::vector<Load> singles(2);
  ATTN_ASSIGN_OR_RETURN(singles[0], MakeLoad<v1::AttentionService>("server", ctx.server->address(),
                                                                   Mode::kUnary, 1, &w.request));
  ATTN_ASSIGN_OR_RETURN(
      singles[1], MakeLoad<bench::Echo>("echo", ctx.echo->address(), Mode::kUnary, 1, &w.request));
  ATTN_ASSIGN_OR_RETURN(std::vector<LoadResult> single_results, Interleave(singles, ctx.seconds));
  const LoadResult& single = single_results[0];
  PrintManyRow("batching off, single caller", single, true);
  PrintManyRow("bare gRPC echo, single caller", single_results[1], false);

  const int64_t delay_us = absl::GetFlag(FLAGS_batch_delay_us);
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<AttentionServer> batching,
                        StartServer(kBatchSize, delay_us));
  std::vector<Load> many(3);
  ATTN_ASSIGN_OR_RETURN(many[0], MakeLoad<bench::Echo>("echo", ctx.echo->address(), Mode::kUnary,
                                                       kManyCallers, &w.request));
  ATTN_ASSIGN_OR_RETURN(
      many[1], MakeLoad<v1::AttentionService>("batching off", ctx.server->address(), Mode::kUnary,
                                              kManyCallers, &w.request));
  ATTN_ASSIGN_OR_RETURN(
      many[2], MakeLoad<v1::AttentionService>("batching on", batching->address(), Mode::kUnary,
                                              kManyCallers, &w.request));
  ATTN_ASSIGN_OR_RETURN(std::vector<LoadResult> many_results, Interleave(many, measure));
  const LoadResult& off = many_results[1];
  const LoadResult& on = many_results[2];
  PrintManyRow("bare gRPC echo", many_results[0], false);
  PrintManyRow("batching off (max_batch_size 1)", off, true);
  PrintManyRow(absl::StrFormat("batching on (%d, %d us delay)", kBatchSize, delay_us), on, true);
  const double qps_ratio = on.qps / off.qps;
  const double p99_bound_us = delay_us + kP99SingleLatencies * single.p50_us;
  PrintLine(absl::StrFormat(
      "on/off QPS %.2fx; on p99 %s ms vs bound %s ms (delay %d us + %.0f x single-caller p50 "
      "%s ms)",
      qps_ratio, Ms(on.p99_us), Ms(p99_bound_us), delay_us, kP99SingleLatencies,
      Ms(single.p50_us)));
  // What the transport alone allows: no server can answer faster than the
  // echo, and by Little's law closed-loop callers then wait callers / QPS on
  // average.
  const LoadResult& echo = many_results[0];
  PrintLine(absl::StrFormat(
      "ceilings from the echo: on/off QPS <= %.2fx (echo QPS / batching-off QPS); mean latency "
      ">= %s ms (%d callers / echo QPS), echo p99 %s ms",
      echo.qps / off.qps, Ms(kManyCallers / echo.qps * 1e6), kManyCallers, Ms(echo.p99_us)));
  ctx.report->Add({absl::StrFormat("%d small callers: QPS batching on / off", kManyCallers),
                   qps_ratio, absl::StrFormat(">= %.2fx", kMinBatchingQpsRatio),
                   qps_ratio >= kMinBatchingQpsRatio});
  ctx.report->Add({absl::StrFormat("%d small callers, batching on: p99 / bound (ms %s)",
                                   kManyCallers, Ms(p99_bound_us)),
                   on.p99_us / p99_bound_us, "<= 1.00x", on.p99_us <= p99_bound_us});
  return absl::OkStatus();
}

// FLOAT32 against BFLOAT16 inputs and output_dtype, unary, on the shared server.
absl::Status RunWireDtypes(const Context& ctx) {
  PrintLine("\n== f32 vs bf16 on the wire (inputs and output_dtype), unary, batching off ==\n");
  PrintLine(absl::StrFormat("%-7s %-8s %3s %9s %9s %9s %8s %8s %8s %8s %9s", "load", "dtype", "cal",
                            "bytes", "req", "resp", "QPS", "p50", "p99", "engine", "x f32 QPS"));
  for (const std::string& name : ctx.workloads) {
    if (name == "small") continue;  // a model's layer: its inputs are few, its bytes fewer
    std::vector<Workload> workloads;
    for (v1::Tensor::DType dtype : {v1::Tensor::FLOAT32, v1::Tensor::BFLOAT16}) {
      ATTN_ASSIGN_OR_RETURN(workloads.emplace_back(), MakeWorkload(name, dtype));
    }
    std::vector<Load> loads;
    for (const Workload& w : workloads) {
      ATTN_ASSIGN_OR_RETURN(loads.emplace_back(),
                            MakeLoad<v1::AttentionService>(w.shape, ctx.server->address(),
                                                           Mode::kUnary, w.callers, &w.request));
    }
    for (const Workload& w : workloads) loads.push_back(EngineLoad(ctx, w));
    ATTN_ASSIGN_OR_RETURN(std::vector<LoadResult> results,
                          Interleave(loads, ctx.seconds * workloads.front().time_scale));
    for (size_t i = 0; i < workloads.size(); ++i) {
      const LoadResult& r = results[i];
      PrintLine(absl::StrFormat("%-7s %-8s %3d %9s %9s %9s %8.0f %8s %8s %8s %8.2fx", name,
                                v1::Tensor::DType_Name(workloads[i].request.query().dtype()),
                                r.callers, Bytes(r.request_bytes + r.response_bytes),
                                Bytes(r.request_bytes), Bytes(r.response_bytes), r.qps,
                                Ms(r.p50_us), Ms(r.p99_us),
                                Ms(results[workloads.size() + i].mean_us), r.qps / results[0].qps));
    }
  }
  PrintLine("\"engine\": the engine alone on the same inputs (BFLOAT16 inputs are its bf16 path).");
  return absl::OkStatus();
}

absl::Status Run() {
  Context ctx;
  ctx.seconds = absl::Seconds(absl::GetFlag(FLAGS_seconds));
  if (ctx.seconds <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--seconds must be > 0");
  }
  const std::vector<std::string> sections = absl::GetFlag(FLAGS_sections);
  for (const std::string& section : sections) {
    if (section != "e2e" && section != "batching" && section != "wire") {
      return absl::InvalidArgumentError(
          absl::StrCat("--sections: unknown \"", section, "\" (e2e, batching, wire)"));
    }
  }
  ctx.workloads = absl::GetFlag(FLAGS_workloads);
  for (const std::string& name : ctx.workloads) {
    if (name != "small" && name != "medium" && name != "large") {
      return absl::InvalidArgumentError(
          absl::StrCat("--workloads: unknown \"", name, "\" (small, medium, large)"));
    }
  }
  EngineOptions engine_options;  // as the servers'
  engine_options.threads = absl::GetFlag(FLAGS_engine_threads);
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(engine_options));
  ATTN_ASSIGN_OR_RETURN(Model demo, LoadModel(ATTENTION_MODELS_DIR "/demo"));
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<AttentionServer> server,
                        StartServer(/*max_batch_size=*/1, /*max_queue_delay_us=*/0));
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<EchoServer> echo, EchoServer::Create());
  client::ClientOptions client_options;
  client_options.target = server->address();
  client_options.max_message_mb = kMaxMessageMb;
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<client::AttentionClient> client,
                        client::AttentionClient::Create(client_options));
  ATTN_ASSIGN_OR_RETURN(v1::ServerInfo info, client->GetServerInfo());
  PrintLine(absl::StrFormat(
      "attention_server_bench: server %s (engine %s, %s, %d threads), echo %s, %d cores.\n"
      "Each load is measured for %.1f s in all (large 2x, 64 callers 1.5x), "
      "in %d rounds alternating\nwith the loads it is compared with, after a %.1f s warm-up "
      "(%.1f s in later rounds). Callers are closed\nloops (one call in flight each) on the "
      "gRPC callback API, %d to a channel (its own TCP connection);\nclient, servers and "
      "engine share this machine's cores.",
      server->address(), info.engine_backend(), info.engine_isa(), info.engine_threads(),
      echo->address(), std::thread::hardware_concurrency(), absl::ToDoubleSeconds(ctx.seconds),
      kRounds, kWarmUpSeconds, kRewarmSeconds, kCallersPerChannel));
  if (const int64_t busy = absl::GetFlag(FLAGS_echo_busy_us); busy > 0) {
    PrintLine(
        absl::StrFormat("--echo_busy_us=%d: each echo call busy-waits %d us first.", busy, busy));
  }

  Report report;
  ctx.engine = engine.get();
  ctx.demo = demo.layer.get();
  ctx.server = server.get();
  ctx.client = client.get();
  ctx.echo = echo.get();
  ctx.report = &report;
  for (const std::string& section : sections) {
    if (section == "e2e") {
      ATTN_RETURN_IF_ERROR(RunEndToEnd(ctx));
    } else if (section == "batching") {
      ATTN_RETURN_IF_ERROR(RunBatching(ctx));
    } else {
      ATTN_RETURN_IF_ERROR(RunWireDtypes(ctx));
    }
  }
  report.PrintSummary();
  return absl::OkStatus();
}

}  // namespace
}  // namespace attention

int main(int argc, char** argv) {
  // As attention_server does: idle OpenMP threads sleep instead of spinning on
  // the cores gRPC needs (may execute this binary again).
  attention::server::ReexecWithOpenMpDefaults(argv);
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  attention::SetUsageAndHelpFile(
      "Measures attention_server end to end beside a bare gRPC echo on the same machine.",
      "tests/bench/server_bench.cc");
  absl::ParseCommandLine(argc, argv);
  if (absl::Status status = attention::Run(); !status.ok()) {
    std::cerr << "attention_server_bench: " << status << "\n";
    return 1;
  }
  return 0;
}
