// The operator-facing features end to end, on a real server on 127.0.0.1:0:
// bearer-token auth, TLS and mTLS, Prometheus metrics, graceful drain.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "attention/v1/service.grpc.pb.h"
#include "client/tensors.h"
#include "gmock/gmock.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "server/heap_trimmer.h"
#include "server/logging.h"
#include "server/metrics.h"
#include "tests/safetensors_writer.h"
#include "tests/server/test_server.h"
#include "tests/server/tls_certs.h"
#include "tests/status_matchers.h"

namespace attention::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

v1::AttendRequest Small(const std::string& id = "p") {
  v1::AttendRequest r;
  r.set_id(id);
  *r.mutable_query() = Ramp({1, 6, 8});
  r.set_num_heads(2);
  return r;
}

// Prometheus text as {"name{labels}" -> value}.
std::map<std::string, double> ParseMetrics(const std::string& text) {
  std::map<std::string, double> series;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    double value = 0;
    EXPECT_TRUE(absl::SimpleAtod(line.substr(space + 1), &value)) << line;
    series[line.substr(0, space)] = value;
  }
  return series;
}

TEST(AuthTest, CallsNeedTheBearerTokenButHealthDoesNot) {
  const std::string dir = MakeTempDir("auth");
  WriteFile(dir + "/token", "s3cret-token\n");
  ServerOptions options;
  options.auth_token_file = dir + "/token";
  auto server = TestServer::Start(options);
  ASSERT_THAT(server, IsOk());
  client::AttentionClient& anonymous = (*server)->client();
  EXPECT_THAT(anonymous.Attend(Small()),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("authorization")));
  EXPECT_THAT(anonymous.GetServerInfo(),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("")));
  EXPECT_THAT(anonymous.Health(), IsOkAndHolds("SERVING"));

  client::ClientOptions wrong;
  wrong.target = (*server)->server().address();
  wrong.bearer_token = "s3cret";
  EXPECT_THAT((*std::move(client::AttentionClient::Create(wrong)))->Attend(Small()),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("invalid bearer token")));
  client::ClientOptions right = wrong;
  right.bearer_token = "s3cret-token";
  auto authed = client::AttentionClient::Create(right);
  ASSERT_THAT(authed, IsOk());
  EXPECT_THAT((*authed)->Attend(Small()), IsOk());
  EXPECT_THAT((*authed)->ListModels(), IsOk());
}

// A refused call is still a call: counted once per method, and noted for the
// heap trimmer, since receiving its request used memory (an idle server only
// gives memory back after a call has arrived).
TEST(AuthTest, RefusedCallsAreCountedAndNotedForTheTrimmer) {
  const std::string dir = MakeTempDir("auth_counted");
  WriteFile(dir + "/token", "s3cret-token\n");
  ServerOptions options;
  options.auth_token_file = dir + "/token";
  auto server = TestServer::Start(options);
  ASSERT_THAT(server, IsOk());
  const server::Metrics& metrics = (*server)->server().metrics();
  const uint64_t arrived = metrics.activity();
  client::AttentionClient& anonymous = (*server)->client();
  EXPECT_THAT(anonymous.Attend(Small()),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("authorization")));
  EXPECT_EQ(metrics.activity(), arrived + 1);
  std::unique_ptr<client::AttendStream> stream = anonymous.OpenStream();
  EXPECT_THAT(stream->Call(Small()),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("authorization")));
  EXPECT_EQ(metrics.activity(), arrived + 2);
  const std::map<std::string, double> m = ParseMetrics(metrics.RenderPrometheus());
  for (const char* method : {"Attend", "AttendStream"}) {
    EXPECT_EQ(m.at(absl::StrCat("attention_requests_total{method=\"", method,
                                "\",model=\"\",code=\"UNAUTHENTICATED\"}")),
              1)
        << method;
  }
}

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto certs = TlsCerts::Generate();
    ASSERT_THAT(certs, IsOk());
    certs_ = *std::move(certs);
  }
  // A client to `server` trusting the test CA, presenting `cert`/`key` if given.
  static absl::StatusOr<std::unique_ptr<client::AttentionClient>> Client(
      const TestServer& server, const std::string& ca, const std::string& cert = "",
      const std::string& key = "") {
    client::ClientOptions o;
    o.target = const_cast<TestServer&>(server).server().address();
    o.tls_ca_file = ca;
    o.tls_cert_file = cert;
    o.tls_key_file = key;
    o.timeout = absl::Seconds(5);
    return client::AttentionClient::Create(o);
  }
  std::unique_ptr<TlsCerts> certs_;
};

TEST_F(TlsTest, ATokenWithoutTlsIsWarnedAboutAtStartup) {
  const std::string dir = MakeTempDir("auth_warning");
  WriteFile(dir + "/token", "s3cret-token\n");
  ASSERT_THAT(server::InitLogging("info"), IsOk());
  ServerOptions plaintext;
  plaintext.auth_token_file = dir + "/token";
  ::testing::internal::CaptureStderr();
  {
    auto server = TestServer::Start(plaintext);
    ASSERT_THAT(server, IsOk());
  }
  EXPECT_THAT(::testing::internal::GetCapturedStderr(),
              HasSubstr("warning --auth_token_file without --tls_cert: callers' bearer tokens "
                        "cross the network in plaintext"));

  ServerOptions tls = plaintext;
  tls.tls_cert_file = certs_->server_cert();
  tls.tls_key_file = certs_->server_key();
  client::ClientOptions tls_client;
  tls_client.tls_ca_file = certs_->ca_cert();
  ::testing::internal::CaptureStderr();
  {
    auto server = TestServer::Start(tls, tls_client);
    ASSERT_THAT(server, IsOk());
  }
  EXPECT_THAT(::testing::internal::GetCapturedStderr(), Not(HasSubstr("--auth_token_file")));
}

TEST_F(TlsTest, ServesTlsAndRefusesPlaintext) {
  ServerOptions options;
  options.tls_cert_file = certs_->server_cert();
  options.tls_key_file = certs_->server_key();
  client::ClientOptions tls_client;
  tls_client.tls_ca_file = certs_->ca_cert();
  auto server = TestServer::Start(options, tls_client);
  ASSERT_THAT(server, IsOk());
  EXPECT_THAT((*server)->client().Attend(Small()), IsOk());

  client::ClientOptions plain;
  plain.target = (*server)->server().address();
  plain.timeout = absl::Seconds(2);
  EXPECT_THAT((*std::move(client::AttentionClient::Create(plain)))->Attend(Small()),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("")));
}

TEST_F(TlsTest, MutualTlsNeedsAClientCertificateFromTheTrustedCa) {
  ServerOptions options;
  options.tls_cert_file = certs_->server_cert();
  options.tls_key_file = certs_->server_key();
  options.tls_client_ca_file = certs_->ca_cert();
  client::ClientOptions with_cert;
  with_cert.tls_ca_file = certs_->ca_cert();
  with_cert.tls_cert_file = certs_->client_cert();
  with_cert.tls_key_file = certs_->client_key();
  auto server = TestServer::Start(options, with_cert);
  ASSERT_THAT(server, IsOk());
  EXPECT_THAT((*server)->client().Attend(Small()), IsOk());
  auto no_cert = Client(**server, certs_->ca_cert());
  ASSERT_THAT(no_cert, IsOk());
  EXPECT_THAT((*no_cert)->Attend(Small()), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("")));
  auto stranger =
      Client(**server, certs_->ca_cert(), certs_->stranger_cert(), certs_->stranger_key());
  ASSERT_THAT(stranger, IsOk());
  EXPECT_THAT((*stranger)->Attend(Small()),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("")));
}

TEST(MetricsEndToEndTest, ScrapedMetricsCountRequestsByCodeAndTimeThem) {
  ServerOptions options;
  options.metrics_port = 0;
  auto server = TestServer::Start(options);
  ASSERT_THAT(server, IsOk());
  ASSERT_GT((*server)->server().metrics_port(), 0);
  for (int i = 0; i < 3; ++i) ASSERT_THAT((*server)->client().Attend(Small()), IsOk());
  v1::AttendRequest bad = Small();
  bad.set_num_heads(3);
  EXPECT_THAT((*server)->client().Attend(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_heads")));

  httplib::Client http("127.0.0.1", (*server)->server().metrics_port());
  httplib::Result res = http.Get("/metrics");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  ASSERT_EQ(res->status, 200);
  const std::map<std::string, double> m = ParseMetrics(res->body);
  EXPECT_EQ(m.at(R"(attention_requests_total{method="Attend",model="",code="OK"})"), 3);
  EXPECT_EQ(m.at(R"(attention_requests_total{method="Attend",model="",code="INVALID_ARGUMENT"})"),
            1);
  EXPECT_EQ(m.at(R"(attention_latency_seconds_count{stage="total",method="Attend"})"), 4);
  EXPECT_EQ(m.at(R"(attention_latency_seconds_count{stage="compute",method="Attend"})"), 3);
  EXPECT_EQ(m.at(R"(attention_latency_seconds_count{stage="queue",method="Attend"})"), 3);
  EXPECT_GE(m.at("attention_batch_size_count"), 3);  // warm-up batches count too
  EXPECT_EQ(m.at("attention_in_flight"), 0);
  EXPECT_EQ(m.at("attention_queue_depth"), 0);
}

// A request over a per-request limit is RESOURCE_EXHAUSTED, as a full queue
// is, but it is the caller's doing: it counts in
// attention_requests_over_limit_total too, which the error-ratio alert
// subtracts (deploy/prometheus/alerts.yml).
TEST(MetricsEndToEndTest, RequestsOverALimitAreCountedApart) {
  ServerOptions options;
  options.engine.max_tensor_elements = 48;  // Small()'s query has 48
  auto server = TestServer::Start(options);
  ASSERT_THAT(server, IsOk());
  v1::AttendRequest big = Small("big");
  *big.mutable_query() = Ramp({1, 12, 8});
  EXPECT_THAT((*server)->client().Attend(big),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("query: 96 elements")));
  ASSERT_THAT((*server)->client().Attend(Small()), IsOk());
  {
    auto stub = v1::AttentionService::NewStub((*server)->client().channel());
    grpc::ClientContext context;
    auto stream = stub->AttendStream(&context);
    ASSERT_TRUE(stream->Write(big));
    ASSERT_TRUE(stream->Write(Small("small")));
    stream->WritesDone();
    v1::AttendResponse response;
    int answers = 0;
    while (stream->Read(&response)) {
      ++answers;
      EXPECT_EQ(response.status().code(), response.id() == "big"
                                              ? grpc::StatusCode::RESOURCE_EXHAUSTED
                                              : grpc::StatusCode::OK)
          << response.id();
    }
    EXPECT_EQ(answers, 2);
    EXPECT_TRUE(stream->Finish().ok());
  }
  const std::map<std::string, double> m =
      ParseMetrics((*server)->server().metrics().RenderPrometheus());
  for (const char* method : {"Attend", "AttendStream"}) {
    SCOPED_TRACE(method);
    EXPECT_EQ(m.at(absl::StrCat("attention_requests_total{method=\"", method,
                                "\",model=\"\",code=\"RESOURCE_EXHAUSTED\"}")),
              1);
    EXPECT_EQ(m.at(absl::StrCat("attention_requests_over_limit_total{method=\"", method,
                                "\",limit=\"max_tensor_elements\"}")),
              1);
    // The other limits are there from the start, at 0.
    EXPECT_EQ(m.at(absl::StrCat("attention_requests_over_limit_total{method=\"", method,
                                "\",limit=\"max_score_elements\"}")),
              0);
  }
}

// --malloc_trim_idle_seconds: once the calls are over, the server gives its
// heap's free pages back (server/heap_trimmer.h has the unit tests).
TEST(HeapTrimEndToEndTest, TheServerTrimsOnceItsCallsAreOver) {
  ServerOptions options;
  options.malloc_trim_idle_seconds = 0.05;
  auto server = TestServer::Start(options);
  ASSERT_THAT(server, IsOk());
  const int64_t before = server::HeapTrimStatsNow().trims;
  for (int i = 0; i < 3; ++i) ASSERT_THAT((*server)->client().Attend(Small()), IsOk());
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (server::HeapTrimStatsNow().trims == before && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_GT(server::HeapTrimStatsNow().trims, before);
  const std::map<std::string, double> m =
      ParseMetrics((*server)->server().metrics().RenderPrometheus());
  EXPECT_GE(m.at("attention_malloc_trims_total"), 1);
}

// A caller cannot grow the metrics: names of models that are not registered
// all count under one label.
TEST(MetricsTest, UnknownModelNamesShareOneLabel) {
  ServerOptions options;
  options.model_repository = ATTENTION_MODELS_DIR;
  auto server = TestServer::Start(options);
  ASSERT_THAT(server, IsOk());
  for (int i = 0; i < 20; ++i) {
    v1::AttendRequest request = Small();
    request.set_model(absl::StrCat("made-up-", i));
    EXPECT_THAT((*server)->client().Attend(request),
                StatusIs(absl::StatusCode::kNotFound, HasSubstr("made-up-")));
  }
  v1::AttendRequest demo;
  demo.set_model("demo");
  *demo.mutable_query() = Ramp({1, 4, 64});
  ASSERT_THAT((*server)->client().Attend(demo), IsOk());
  const std::string text = (*server)->server().metrics().RenderPrometheus();
  EXPECT_THAT(text, Not(HasSubstr("made-up")));
  const std::map<std::string, double> m = ParseMetrics(text);
  EXPECT_EQ(
      m.at(R"x(attention_requests_total{method="Attend",model="(unknown)",code="NOT_FOUND"})x"),
      20);
  EXPECT_EQ(m.at(R"(attention_requests_total{method="Attend",model="demo",code="OK"})"), 1);
}

// A server whose drain gives calls 30 s, taking calls of any size.
absl::StatusOr<std::unique_ptr<TestServer>> StartForDrain() {
  ServerOptions options;
  options.drain_seconds = 30;
  options.engine.max_score_elements = 0;
  return TestServer::Start(options);
}

// Waits up to 10 s until the server has exactly one call in flight (its
// request sent and parsed: well under a second, but not always under TSan on
// a loaded machine).
bool WaitForOneInFlight(const server::Metrics& metrics) {
  auto in_flight = [&] { return ParseMetrics(metrics.RenderPrometheus())["attention_in_flight"]; };
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (in_flight() < 1 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
  return in_flight() == 1;
}

// A second connection to `server` for checks during a drain: not queued
// behind a big answer, and not retrying UNAVAILABLE.
absl::StatusOr<std::unique_ptr<client::AttentionClient>> DrainChecker(TestServer& server) {
  client::ClientOptions options;
  options.target = server.server().address();
  options.own_connection = true;
  options.max_attempts = 1;
  return client::AttentionClient::Create(options);
}

// Health as `checker` sees it, once it is NOT_SERVING or after 1 s.
absl::StatusOr<std::string> WaitForNotServing(client::AttentionClient& checker) {
  absl::StatusOr<std::string> health;
  for (int i = 0; i < 1000; ++i) {
    health = checker.Health();
    if (health.ok() && *health == "NOT_SERVING") break;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return health;
}

// SIGTERM's path: Shutdown() while a call is computing lets it finish, and its
// whole answer (128 MiB, far more than a socket holds) reach the caller, while
// new calls are refused and idle streams end.
TEST(DrainTest, ShutdownFinishesCallsInFlightAndRefusesNewOnes) {
  auto server = StartForDrain();
  ASSERT_THAT(server, IsOk());
  client::AttentionClient& client = (*server)->client();
  auto checker = DrainChecker(**server);
  ASSERT_THAT(checker, IsOk());
  std::unique_ptr<v1::AttentionService::Stub> stub =
      v1::AttentionService::NewStub((*checker)->channel());
  grpc::ClientContext stream_context;
  auto stream = stub->AttendStream(&stream_context);
  v1::AttendResponse answer;
  ASSERT_TRUE(stream->Write(Small("before")) && stream->Read(&answer));
  ASSERT_EQ(answer.status().code(), 0);

  v1::AttendRequest big;  // a few hundred ms of compute on two cores
  *big.mutable_query() = Ramp({4, 8, 1024, 64});
  big.set_need_weights(true);
  absl::StatusOr<v1::AttendResponse> in_flight;
  std::thread caller([&] { in_flight = client.Attend(big); });
  ASSERT_TRUE(WaitForOneInFlight((*server)->server().metrics()));
  std::thread stopper([&] { (*server)->server().Shutdown(); });
  const absl::StatusOr<std::string> health = WaitForNotServing(**checker);
  EXPECT_THAT(health, IsOkAndHolds("NOT_SERVING"));
  // Refused by the service itself ("shutting down"), while the big call keeps
  // the connection open.
  EXPECT_THAT((*checker)->Attend(Small()),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("shutting down")));
  // The stream open since before the drain, idle, is ended at once rather
  // than when the drain times out; a new one is refused.
  EXPECT_FALSE(stream->Read(&answer));
  const grpc::Status ended = stream->Finish();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(ended.error_message(), HasSubstr("shutting down"));
  grpc::ClientContext new_stream_context;
  auto new_stream = stub->AttendStream(&new_stream_context);
  EXPECT_FALSE(new_stream->Read(&answer));
  const grpc::Status refused = new_stream->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(refused.error_message(), HasSubstr("shutting down"));
  caller.join();
  stopper.join();
  ASSERT_THAT(in_flight, IsOk());
  EXPECT_EQ(in_flight->output().shape_size(), 4);
  EXPECT_EQ(in_flight->weights().data().size(), size_t{4} * 8 * 1024 * 1024 * 4);
  EXPECT_THAT(client.Attend(Small()), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("")));
}

// A connection that never answers gRPC's goodbye (GOAWAY, then a PING) must not
// hold the exit once every call has answered: gRPC waits 20 s for the PING's
// answer, and an idle Python channel gives it only at its next call (about
// 3 s). The server closes such connections a second after the drain.
TEST(DrainTest, AConnectionThatNeverAnswersDoesNotHoldTheExit) {
  auto server = StartForDrain();  // 30 s for calls in flight
  ASSERT_THAT(server, IsOk());
  ASSERT_THAT((*server)->client().Attend(Small()), IsOk());
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>((*server)->server().port()));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  // HTTP/2's preface and an empty SETTINGS frame, then silence.
  const std::string hello =
      std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") + std::string("\0\0\0\x04\0\0\0\0\0", 9);
  ASSERT_EQ(write(fd, hello.data(), hello.size()), static_cast<ssize_t>(hello.size()));
  const absl::Time start = absl::Now();
  (*server)->server().Shutdown();
  (*server)->server().Wait();
  const absl::Duration took = absl::Now() - start;
  close(fd);
  // Before: 20 s. Now about 1 s; 10 leaves room for a loaded machine.
  EXPECT_LT(took, absl::Seconds(10));
}

// A stream with a request computing when the drain starts gets its answer,
// then ends UNAVAILABLE.
TEST(DrainTest, AStreamAnswersWhatItTookThenEnds) {
  auto server = StartForDrain();
  ASSERT_THAT(server, IsOk());
  std::unique_ptr<v1::AttentionService::Stub> stub =
      v1::AttentionService::NewStub((*server)->client().channel());
  grpc::ClientContext context;
  auto stream = stub->AttendStream(&context);
  v1::AttendRequest big;  // about 9 GFLOP
  big.set_id("big");
  *big.mutable_query() = Ramp({4, 8, 1024, 64});
  ASSERT_TRUE(stream->Write(big));
  ASSERT_TRUE(WaitForOneInFlight((*server)->server().metrics()));
  std::thread stopper([&] { (*server)->server().Shutdown(); });
  v1::AttendResponse answer;
  EXPECT_TRUE(stream->Read(&answer));
  EXPECT_EQ(answer.id(), "big");
  EXPECT_EQ(answer.status().code(), 0) << answer.status().message();
  EXPECT_EQ(answer.output().data().size(), size_t{4} * 8 * 1024 * 64 * 4);
  EXPECT_FALSE(stream->Read(&answer));
  const grpc::Status ended = stream->Finish();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(ended.error_message(), HasSubstr("shutting down"));
  stopper.join();
}

// A draining replica refuses new calls UNAVAILABLE before it sends any
// header (a Trailers-Only answer), so that a client's retry policy may send
// them again: gRPC retries no call once headers have arrived. With a second
// replica, every call of a retrying client succeeds while the first drains.
TEST(DrainTest, RefusalsWhileDrainingAreRetriedOnAnotherReplica) {
  ServerOptions draining_options;
  draining_options.drain_seconds = 30;
  draining_options.replica_name = "draining";
  auto draining = TestServer::Start(draining_options);
  ASSERT_THAT(draining, IsOk());
  ServerOptions other_options;
  other_options.replica_name = "other";
  auto other = TestServer::Start(other_options);
  ASSERT_THAT(other, IsOk());
  client::ClientOptions both;
  both.target =
      absl::StrCat("ipv4:", (*draining)->server().address(), ",", (*other)->server().address());
  both.own_connection = true;
  both.timeout = absl::Seconds(20);
  auto retrying = client::AttentionClient::Create(both);
  ASSERT_THAT(retrying, IsOk());
  for (int i = 0; i < 4; ++i) ASSERT_THAT((*retrying)->Attend(Small()), IsOk());  // both connected

  v1::AttendRequest big;  // holds the drain open
  *big.mutable_query() = Ramp({4, 8, 1024, 64});
  absl::StatusOr<v1::AttendResponse> in_flight;
  std::thread caller([&] { in_flight = (*draining)->client().Attend(big); });
  ASSERT_TRUE(WaitForOneInFlight((*draining)->server().metrics()));
  std::thread stopper([&] { (*draining)->server().Shutdown(); });
  auto checker = DrainChecker(**draining);
  ASSERT_THAT(checker, IsOk());
  EXPECT_THAT(WaitForNotServing(**checker), IsOkAndHolds("NOT_SERVING"));
  // The refusal names its replica still, in its trailers.
  std::string refused_by;
  client::CallOptions named;
  named.replica = &refused_by;
  ASSERT_THAT((*checker)->Attend(Small(), named),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("shutting down")));
  EXPECT_EQ(refused_by, "draining");
  // Round robin picks the draining replica for every other attempt; a
  // refused call goes to the other. (Few calls: the retry throttle stops
  // retrying after some 5 failures in a row.)
  std::map<std::string, int> replicas;
  for (int i = 0; i < 4; ++i) {
    std::string replica;
    client::CallOptions call;
    call.replica = &replica;
    EXPECT_THAT((*retrying)->Attend(Small(), call), IsOk()) << i;
    ++replicas[replica];
  }
  EXPECT_EQ(replicas["other"], 4);
  const std::map<std::string, double> m =
      ParseMetrics((*draining)->server().metrics().RenderPrometheus());
  EXPECT_GE(m.at(R"(attention_requests_total{method="Attend",model="",code="UNAVAILABLE"})"), 2)
      << "the draining replica was not picked: nothing was retried";
  caller.join();
  stopper.join();
  EXPECT_THAT(in_flight, IsOk());
}

// GET path on 127.0.0.1:port: {status, body}, or {0, error} when nothing answered.
std::pair<int, std::string> HttpGet(int port, const std::string& path) {
  httplib::Client http("127.0.0.1", port);
  http.set_connection_timeout(5);
  http.set_read_timeout(5);
  httplib::Result result = http.Get(path.c_str());
  if (!result) return {0, httplib::to_string(result.error())};
  return {result->status, result->body};
}

// The metrics port's /readyz (the readiness probe where the kubelet cannot
// speak gRPC to the server, e.g. with TLS) follows grpc.health.v1: 503 naming
// the warm-up until it is done, 200 while serving, 503 naming the drain from
// the moment SIGTERM's drain starts, while calls in flight still run.
// /healthz (liveness) answers 200 throughout.
TEST(ReadinessTest, ReadyzIsUnavailableDuringWarmUpAndDrain) {
  ServerOptions options;
  options.drain_seconds = 30;
  options.engine.max_score_elements = 0;
  options.metrics_port = 0;
  std::pair<int, std::string> warming_ready, warming_live;
  options.before_warm_up = [&](int metrics_port) {
    warming_ready = HttpGet(metrics_port, "/readyz");
    warming_live = HttpGet(metrics_port, "/healthz");
  };
  auto server = TestServer::Start(options);
  ASSERT_THAT(server, IsOk());
  EXPECT_EQ(warming_ready.first, 503) << warming_ready.second;
  EXPECT_THAT(warming_ready.second, HasSubstr("warming up"));
  EXPECT_EQ(warming_live, std::make_pair(200, std::string("ok\n")));
  const int port = (*server)->server().metrics_port();
  EXPECT_EQ(HttpGet(port, "/readyz"), std::make_pair(200, std::string("ok\n")));

  client::AttentionClient& client = (*server)->client();
  v1::AttendRequest big;  // a few hundred ms of compute on two cores
  *big.mutable_query() = Ramp({4, 8, 1024, 64});
  big.set_need_weights(true);
  absl::StatusOr<v1::AttendResponse> in_flight;
  std::thread caller([&] { in_flight = client.Attend(big); });
  ASSERT_TRUE(WaitForOneInFlight((*server)->server().metrics()));
  std::thread stopper([&] { (*server)->server().Shutdown(); });
  std::pair<int, std::string> draining;
  for (int i = 0; i < 2000; ++i) {
    draining = HttpGet(port, "/readyz");
    if (draining.first != 200) break;
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(draining.first, 503) << draining.second;
  EXPECT_THAT(draining.second, HasSubstr("draining"));
  EXPECT_EQ(HttpGet(port, "/healthz"), std::make_pair(200, std::string("ok\n")));
  caller.join();
  stopper.join();
  EXPECT_THAT(in_flight, IsOk());  // the drain let it finish
  EXPECT_EQ(HttpGet(port, "/readyz").first, 503);
}

// --shutdown_delay_seconds: from SIGTERM's start, health is NOT_SERVING and
// /readyz 503 while calls (session calls too) are still answered; new calls
// are refused only once the delay is over, or ended (a second signal).
TEST(DrainTest, ADelayedShutdownServesCallsUntilItsDrainStarts) {
  constexpr double kDelaySeconds = 600;
  ServerOptions options;
  options.shutdown_delay_seconds = kDelaySeconds;
  options.drain_seconds = 30;
  options.metrics_port = 0;
  auto server = TestServer::Start(options);
  ASSERT_THAT(server, IsOk());
  auto checker = DrainChecker(**server);
  ASSERT_THAT(checker, IsOk());
  v1::AttendRequest step = Small();
  step.mutable_session()->add_ids("delayed");
  step.mutable_session()->add_positions(0);
  step.mutable_session()->set_create(true);
  ASSERT_THAT((*checker)->Attend(step), IsOk());

  const absl::Time start = absl::Now();
  std::thread stopper([&] { (*server)->server().Shutdown(); });
  EXPECT_THAT(WaitForNotServing(**checker), IsOkAndHolds("NOT_SERVING"));
  EXPECT_EQ(HttpGet((*server)->server().metrics_port(), "/readyz").first, 503);
  // Still served: a new call, and the next step of a session.
  EXPECT_THAT((*checker)->Attend(Small()), IsOk());
  step.mutable_session()->set_positions(0, step.query().shape(1));
  step.mutable_session()->set_create(false);
  EXPECT_THAT((*checker)->Attend(step), IsOk());
  // Still so a while later (a wait, not a synchronisation: without the delay
  // the drain refuses calls within milliseconds).
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_THAT((*checker)->Attend(Small()), IsOk());
  // A second signal ends the delay: the drain refuses new calls.
  (*server)->server().EndShutdownDelay();
  absl::Status refused;
  while (absl::Now() - start < absl::Seconds(60)) {
    refused = (*checker)->Attend(Small()).status();
    if (!refused.ok()) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("shutting down")));
  stopper.join();
}

// Scale-in: once a drain starts, a request on an open session is NOT_FOUND
// naming it (the session ends with this replica: its caller recreates it on
// another), GetSession too, and a create is UNAVAILABLE (retry elsewhere);
// the call in flight is still answered.
TEST(DrainTest, SessionsAnswerNotFoundOnceDraining) {
  auto server = StartForDrain();
  ASSERT_THAT(server, IsOk());
  client::AttentionClient& client = (*server)->client();
  auto checker = DrainChecker(**server);
  ASSERT_THAT(checker, IsOk());
  v1::AttendRequest create = Small();
  create.mutable_session()->add_ids("leaving");
  create.mutable_session()->add_positions(0);
  create.mutable_session()->set_create(true);
  ASSERT_THAT((*checker)->Attend(create), IsOk());

  v1::AttendRequest big;
  *big.mutable_query() = Ramp({4, 8, 1024, 64});
  absl::StatusOr<v1::AttendResponse> in_flight;
  std::thread caller([&] { in_flight = client.Attend(big); });
  ASSERT_TRUE(WaitForOneInFlight((*server)->server().metrics()));
  std::thread stopper([&] { (*server)->server().Shutdown(); });
  const absl::StatusOr<std::string> health = WaitForNotServing(**checker);
  ASSERT_THAT(health, IsOkAndHolds("NOT_SERVING"));
  v1::AttendRequest step = Small();
  step.mutable_session()->add_ids("leaving");
  step.mutable_session()->add_positions(6);
  EXPECT_THAT((*checker)->Attend(step),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("\"leaving\""), HasSubstr("shutting down"))));
  EXPECT_THAT((*checker)->GetSession("leaving"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"leaving\"")));
  create.mutable_session()->set_ids(0, "arriving");
  EXPECT_THAT((*checker)->Attend(create),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("shutting down")));
  caller.join();
  stopper.join();
  EXPECT_THAT(in_flight, IsOk());
}

// Every answer names the replica (--replica_name, or host:port), as does
// GetServerInfo; a caller's affinity changes nothing on the server.
TEST(ReplicaTest, AnswersNameTheReplica) {
  ServerOptions options;
  options.replica_name = "replica-a";
  auto named = TestServer::Start(options);
  ASSERT_THAT(named, IsOk());
  std::string replica;
  client::CallOptions call;
  call.replica = &replica;
  call.affinity = "group-7";
  ASSERT_THAT((*named)->client().Attend(Small(), call), IsOk());
  EXPECT_EQ(replica, "replica-a");
  absl::StatusOr<v1::ServerInfo> info = (*named)->client().GetServerInfo();
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->replica(), "replica-a");
  // Errors carry it too: the caller sees which replica refused.
  EXPECT_THAT((*named)->client().GetSession("none", call),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("none")));
  EXPECT_EQ(replica, "replica-a");

  auto unnamed = TestServer::Start(ServerOptions());
  ASSERT_THAT(unnamed, IsOk());
  ASSERT_THAT((*unnamed)->client().Attend(Small(), call), IsOk());
  char host[256] = {};
  ASSERT_EQ(gethostname(host, sizeof host - 1), 0);
  EXPECT_EQ(replica, absl::StrCat(host, ":", (*unnamed)->server().port()));
}

// --max_connection_age_seconds: the server closes old connections, and the
// client's next call opens a new one (how DNS-balancing clients find new
// replicas).
TEST(ConnectionAgeTest, OldConnectionsAreClosedAndClientsReconnect) {
  ServerOptions options;
  // Two seconds: the first call and the check after it are inside the
  // connection's age unless a loaded or instrumented run stalls for most of
  // it.
  options.max_connection_age_seconds = 2;
  options.drain_seconds = 1;
  auto server = TestServer::Start(options);
  ASSERT_THAT(server, IsOk());
  client::AttentionClient& client = (*server)->client();
  ASSERT_THAT(client.Attend(Small()), IsOk());
  ASSERT_EQ(client.channel()->GetState(false), GRPC_CHANNEL_READY);
  // Up to 10 s (age, jitter and grace). Waiting for the change, not
  // polling: the channel may leave READY and reconnect between two polls.
  const bool closed = client.channel()->WaitForStateChange(
      GRPC_CHANNEL_READY, std::chrono::system_clock::now() + std::chrono::seconds(10));
  EXPECT_TRUE(closed) << "the connection outlived max_connection_age_seconds";
  EXPECT_THAT(client.Attend(Small()), IsOk());
}

TEST(ConnectionAgeTest, ANegativeAgeIsRefused) {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.max_connection_age_seconds = -1;
  EXPECT_THAT(AttentionServer::Create(options), StatusIs(absl::StatusCode::kInvalidArgument,
                                                         HasSubstr("max_connection_age_seconds")));
}

// --max_concurrent_streams: calls beyond the limit wait on the client's side
// of the connection until one ends, rather than piling into the server.
TEST(StreamLimitTest, ACallBeyondTheLimitWaitsUntilAnotherEnds) {
  ServerOptions options;
  options.max_concurrent_streams = 2;
  auto server = TestServer::Start(options);
  ASSERT_THAT(server, IsOk());
  // All on the client's one connection.
  std::unique_ptr<v1::AttentionService::Stub> stub =
      v1::AttentionService::NewStub((*server)->client().channel());
  using Stream = grpc::ClientReaderWriter<v1::AttendRequest, v1::AttendResponse>;
  grpc::ClientContext contexts[2];
  std::unique_ptr<Stream> open[2];
  for (int i = 0; i < 2; ++i) {
    open[i] = stub->AttendStream(&contexts[i]);
    v1::AttendResponse answer;
    ASSERT_TRUE(open[i]->Write(Small("open")) && open[i]->Read(&answer));
    ASSERT_EQ(answer.status().code(), 0);
  }
  // A third call: a unary one, which the two open streams hold back.
  absl::Notification answered;
  absl::StatusOr<v1::AttendResponse> third = absl::UnknownError("not answered");
  std::thread caller([&] {
    third = (*server)->client().Attend(Small("third"));
    answered.Notify();
  });
  // A wait, not a synchronisation: with the limit broken it is answered in
  // about a millisecond.
  EXPECT_FALSE(answered.WaitForNotificationWithTimeout(absl::Milliseconds(300)));
  open[0]->WritesDone();
  EXPECT_TRUE(open[0]->Finish().ok());
  EXPECT_TRUE(answered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  caller.join();
  EXPECT_THAT(third, IsOk());
  open[1]->WritesDone();
  EXPECT_TRUE(open[1]->Finish().ok());
}

TEST(ServerOptionsTest, NegativeLimitsAreRefusedNamingTheOption) {
  const std::pair<const char*, std::function<void(ServerOptions&)>> cases[] = {
      {"max_concurrent_streams", [](ServerOptions& o) { o.max_concurrent_streams = -1; }},
      {"malloc_trim_idle_seconds", [](ServerOptions& o) { o.malloc_trim_idle_seconds = -1; }},
      {"shutdown_delay_seconds", [](ServerOptions& o) { o.shutdown_delay_seconds = -1; }},
      {"memory_budget_mb", [](ServerOptions& o) { o.memory_budget_mb = -1; }},
  };
  for (const auto& [option, set] : cases) {
    ServerOptions options;
    options.listen = "127.0.0.1:0";
    set(options);
    EXPECT_THAT(AttentionServer::Create(options),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(option)));
  }
}

}  // namespace
}  // namespace attention::testing
