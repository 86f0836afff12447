// Sessions end to end (docs/benchmarks.md, "Sessions"): decode steps of B16
// H8 D64 over 4096 cached rows per session through a real AttentionServer,
// against the same step in the engine alone plus a bare gRPC echo of the
// step's request and answer bytes (tests/bench/echo.proto), all in one
// process and one run, under OpenMP's wait policy as attention_server sets
// it; and a step request's bytes at two cached lengths.
// Prints the figures and "PASS" / "MISS"; with --enforce exits 1 on a miss.
//
//   session_server_bench [--enforce]

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attention/v1/service.grpc.pb.h"
#include "client/attention_client.h"
#include "client/tensors.h"
#include "engine/engine.h"
#include "engine/kv_cache.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "server/openmp_defaults.h"
#include "server/server.h"
#include "tests/bench/echo.grpc.pb.h"

namespace attention {
namespace {

constexpr int64_t kSessions = 16, kHeads = 8, kDim = 64, kCached = 4096;
constexpr double kStepRatio = 1.25;  // server step / (engine step + echo)

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds per call of `f` over one round of at least 0.3 s; `between`, if
// given, runs after each call, untimed.
template <typename F, typename G>
double TimeRound(F f, G between) {
  int calls = 0;
  const absl::Time start = absl::Now();
  double timed = 0;
  do {
    const absl::Time call = absl::Now();
    f();
    timed += absl::ToDoubleSeconds(absl::Now() - call);
    ++calls;
    between();
  } while (absl::Now() - start < absl::Seconds(0.3));
  return timed / calls;
}
template <typename F>
double TimeRound(F f) {
  return TimeRound(f, [] {});
}

std::vector<float> RandomValues(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "session_server_bench: %s\n", what.c_str());
  std::exit(2);
}

// A step of every session: one new row each (query = key = value), rank 3
// with 8 heads of 64.
v1::AttendRequest StepRequest(const std::vector<int64_t>& positions) {
  v1::AttendRequest r;
  r.set_num_heads(kHeads);
  *r.mutable_query() = *client::MakeFloatTensor({kSessions, 1, kHeads * kDim},
                                                RandomValues(kSessions * kHeads * kDim, 7));
  for (int64_t b = 0; b < kSessions; ++b) {
    r.mutable_session()->add_ids(absl::StrCat("decoder-", b));
    r.mutable_session()->add_positions(positions[b]);
  }
  return r;
}

// The bare echo: answers with a canned response, so a call costs gRPC and
// protobuf alone.
class EchoService final : public bench::Echo::CallbackService {
 public:
  explicit EchoService(v1::AttendResponse canned) : canned_(std::move(canned)) {}
  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const v1::AttendRequest*, v1::AttendResponse* response) override {
    *response = canned_;
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  const v1::AttendResponse canned_;
};

// The engine alone: the same sessions' step over caches grown (GrowTo) to
// the server's sessions' length, its rows dropped again after it (Drop,
// untimed: the server's steps commit theirs).
class EngineStep {
 public:
  EngineStep()
      : engine_(std::move(Engine::Create({})).value()),
        rows_(RandomValues(kCached * kHeads * kDim, 3)) {
    for (int64_t b = 0; b < kSessions; ++b) {
      caches_.push_back(std::move(KvCache::Create(kHeads, kDim, kDim, DType::kFloat32)).value());
      session_.caches.push_back(caches_.back().get());
    }
    q_ = RandomValues(kSessions * kHeads * kDim, 4);
    args_.query =
        TensorView{DType::kFloat32, {kSessions, 1, kHeads * kDim}, q_.data(), q_.size() * 4};
    args_.num_heads = kHeads;
  }

  // Appends rows until every cache holds `rows` (at most kCached at a time),
  // or one more where `rows` is a multiple of the block's rows: the step's
  // row then lands in the last block, as 63 of a decoder's 64 steps' rows do
  // (decode_bench's Decoder says why).
  void GrowTo(int64_t rows) {
    if (rows % KvCache::kBlockRows == 0) ++rows;
    for (const std::unique_ptr<KvCache>& c : caches_) {
      while (c->length() < rows) {
        const int64_t n = std::min(kCached, rows - c->length());
        if (!c->Append(n, rows_.data(), kHeads * kDim, kDim, rows_.data(), kHeads * kDim, kDim)
                 .ok()) {
          Fail("engine cache");
        }
        c->Commit();
      }
    }
  }

  void Step() {
    EngineCall call{&args_, nullptr};
    call.session = &session_;
    // On this thread, as the server's scheduler computes its batches: through
    // the engine's worker thread the baseline would include a hop the
    // server's step does not take.
    if (!engine_->AttendBatchFromThisThread({&call, 1}).front().ok()) Fail("engine step");
  }
  void Drop() {
    for (KvCache* c : session_.caches) c->Rollback();
  }

  // While it lives, the calling thread is bound to the engine's first CPU
  // and its passes' team to the others, as the server's scheduler's thread
  // is (Engine::BindThisThread), so that its passes' threads do not share a
  // CPU; then the thread may run where it could before.
  class Binding {
   public:
    explicit Binding(const EngineStep& step)
        : saved_(pthread_getaffinity_np(pthread_self(), sizeof own_, &own_) == 0) {
      step.engine_->BindThisThread();
    }
    ~Binding() {
      if (saved_) pthread_setaffinity_np(pthread_self(), sizeof own_, &own_);
    }
    Binding(const Binding&) = delete;
    Binding& operator=(const Binding&) = delete;

   private:
    cpu_set_t own_;
    const bool saved_;
  };
  bool bound() const { return !engine_->bound_cpus().empty(); }

 private:
  std::unique_ptr<Engine> engine_;
  const std::vector<float> rows_;
  std::vector<std::unique_ptr<KvCache>> caches_;
  SessionCall session_;
  std::vector<float> q_;
  AttentionArgs args_;
};

int Main(int argc, char** argv) {
  const bool enforce = argc > 1 && std::strcmp(argv[1], "--enforce") == 0;
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.drain_seconds = 5;
  absl::StatusOr<std::unique_ptr<AttentionServer>> server = AttentionServer::Create(options);
  if (!server.ok()) Fail(server.status().ToString());
  client::ClientOptions client_options;
  client_options.target = (*server)->address();
  std::unique_ptr<client::AttentionClient> client =
      std::move(client::AttentionClient::Create(client_options)).value();
  // Prefill: one create request per session of kCached rows.
  std::vector<int64_t> positions(kSessions, 0);
  for (int64_t b = 0; b < kSessions; ++b) {
    v1::AttendRequest r;
    r.set_num_heads(kHeads);
    *r.mutable_query() = *client::MakeFloatTensor({1, kCached, kHeads * kDim},
                                                  RandomValues(kCached * kHeads * kDim, 10 + b));
    r.mutable_session()->add_ids(absl::StrCat("decoder-", b));
    r.mutable_session()->add_positions(0);
    r.mutable_session()->set_create(true);
    absl::StatusOr<v1::AttendResponse> answer = client->Attend(r);
    if (!answer.ok()) Fail(absl::StrCat("prefill: ", answer.status().ToString()));
    positions[b] = answer->session_positions(0);
  }
  // Steps grow the sessions by one row each: a few hundred steps move the
  // length by a few percent.
  v1::AttendResponse last_answer;
  // The server's own timing of every step (its answers' queue_us and
  // compute_us): how much of a step the engine's work is, inside the server.
  std::vector<double> queue_us, compute_us;
  // Built once, as the echo's request is: only the positions change.
  v1::AttendRequest step = StepRequest(positions);
  auto server_step = [&] {
    for (int64_t b = 0; b < kSessions; ++b) step.mutable_session()->set_positions(b, positions[b]);
    absl::StatusOr<v1::AttendResponse> answer = client->Attend(step);
    if (!answer.ok()) Fail(absl::StrCat("step: ", answer.status().ToString()));
    for (int64_t b = 0; b < kSessions; ++b) positions[b] = answer->session_positions(b);
    last_answer = *std::move(answer);
    queue_us.push_back(static_cast<double>(last_answer.queue_us()));
    compute_us.push_back(static_cast<double>(last_answer.compute_us()));
  };
  server_step();
  // The same steps as messages of one AttendStream (client::Session's
  // stream): what a decoder saves by not opening an HTTP/2 stream per step.
  std::unique_ptr<client::AttendStream> stream = client->OpenStream();
  auto stream_step = [&] {
    for (int64_t b = 0; b < kSessions; ++b) step.mutable_session()->set_positions(b, positions[b]);
    absl::StatusOr<v1::AttendResponse> answer = stream->Call(step);
    if (!answer.ok()) Fail(absl::StrCat("stream step: ", answer.status().ToString()));
    for (int64_t b = 0; b < kSessions; ++b) positions[b] = answer->session_positions(b);
  };
  stream_step();
  // The echo of the same bytes.
  EchoService echo(last_answer);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&echo);
  std::unique_ptr<grpc::Server> echo_server = builder.BuildAndStart();
  if (echo_server == nullptr) Fail("echo server");
  auto stub = bench::Echo::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                                       grpc::InsecureChannelCredentials()));
  const v1::AttendRequest echo_request = StepRequest(positions);
  auto echo_call = [&] {
    grpc::ClientContext context;
    v1::AttendResponse response;
    if (!stub->Attend(&context, echo_request, &response).ok()) Fail("echo call");
  };
  EngineStep engine;
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  std::printf("OMP_WAIT_POLICY=%s; the engine alone's steps %s\n",
              policy != nullptr ? policy : "(unset)",
              engine.bound() ? "bound to CPUs as the server's scheduler is"
                             : "unbound, as the server's scheduler is on this machine");
  engine.GrowTo(positions[0]);
  {
    const EngineStep::Binding bound(engine);
    engine.Step();
    engine.Drop();
  }
  echo_call();
  // The three alternate over rounds, so that load from elsewhere on the
  // machine falls on all of them; the ratio is the median of the rounds'.
  std::vector<double> servers, engines, echoes, ratios, streams, stream_ratios;
  for (int round = 0; round < 7; ++round) {
    // The engine's caches at the server's sessions' length midway through
    // its round (steps grow them by one row each).
    const int64_t before = positions[0];
    servers.push_back(TimeRound(server_step));
    engine.GrowTo((before + positions[0]) / 2);
    {
      const EngineStep::Binding bound(engine);
      engines.push_back(TimeRound([&] { engine.Step(); }, [&] { engine.Drop(); }));
    }
    echoes.push_back(TimeRound(echo_call));
    ratios.push_back(servers.back() / (engines.back() + echoes.back()));
    streams.push_back(TimeRound(stream_step));
    stream_ratios.push_back(streams.back() / servers.back());
  }
  if (!stream->Close().ok()) Fail("closing the stream");
  echo_server->Shutdown();
  const int64_t request_bytes = static_cast<int64_t>(StepRequest(positions).ByteSizeLong());
  const int64_t early_bytes =
      static_cast<int64_t>(StepRequest(std::vector<int64_t>(kSessions, 1024)).ByteSizeLong());
  (*server)->Shutdown();
  const double server_step_s = Median(servers), engine_step = Median(engines),
               echo_s = Median(echoes);
  const double ratio = Median(ratios);
  const bool met = ratio <= kStepRatio;
  std::printf(
      "decode step, B%lld H%lld D%lld over ~%lld cached rows per session:\n"
      "  medians: through the server %.1f us; engine alone %.1f us; bare gRPC echo of its "
      "%lld-byte "
      "request and %lld-byte answer %.1f us\n"
      "  (the server's own timing, medians over its steps: queue %.0f us, compute %.0f us)\n"
      "  server / (engine + echo), median of 7 alternating rounds = %.2fx (target <= %.2fx) %s\n"
      "  step request bytes: %lld at 1024 cached rows, %lld at %lld (only the new rows travel)\n"
      "  the same steps on one AttendStream: median %.1f us, %.2fx the unary step (median of the "
      "rounds')\n",
      static_cast<long long>(kSessions), static_cast<long long>(kHeads),
      static_cast<long long>(kDim), static_cast<long long>(kCached), server_step_s * 1e6,
      engine_step * 1e6, static_cast<long long>(request_bytes),
      static_cast<long long>(last_answer.ByteSizeLong()), echo_s * 1e6, Median(queue_us),
      Median(compute_us), ratio, kStepRatio, met ? "PASS" : "MISS",
      static_cast<long long>(early_bytes), static_cast<long long>(request_bytes),
      static_cast<long long>(positions[0]), Median(streams) * 1e6, Median(stream_ratios));
  return enforce && !met ? 1 : 0;
}

}  // namespace
}  // namespace attention

int main(int argc, char** argv) {
  // As attention_server does: OpenMP threads sleep between passes
  // (OMP_WAIT_POLICY=PASSIVE unless the environment sets it; may execute
  // this binary again).
  attention::server::ReexecWithOpenMpDefaults(argv);
  return attention::Main(argc, argv);
}
