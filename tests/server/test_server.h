#ifndef ATTENTION_TESTS_SERVER_TEST_SERVER_H_
#define ATTENTION_TESTS_SERVER_TEST_SERVER_H_

// A real AttentionServer on 127.0.0.1:0 with a client connected to it, and
// small builders for requests, shared by the server tests.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "client/attention_client.h"
#include "client/tensors.h"
#include "gtest/gtest.h"
#include "server/metrics.h"
#include "server/server.h"

namespace attention::testing {

class TestServer {
 public:
  // Starts a server with `options` on 127.0.0.1:0 and connects a client with
  // `client_options` (its target is replaced by the server's address).
  static absl::StatusOr<std::unique_ptr<TestServer>> Start(
      ServerOptions options = {}, client::ClientOptions client_options = {}) {
    options.listen = "127.0.0.1:0";
    absl::StatusOr<std::unique_ptr<AttentionServer>> server = AttentionServer::Create(options);
    if (!server.ok()) return server.status();
    client_options.target = (*server)->address();
    absl::StatusOr<std::unique_ptr<client::AttentionClient>> client =
        client::AttentionClient::Create(client_options);
    if (!client.ok()) return client.status();
    return std::unique_ptr<TestServer>(new TestServer(*std::move(server), *std::move(client)));
  }

  AttentionServer& server() { return *server_; }
  client::AttentionClient& client() { return *client_; }

 private:
  TestServer(std::unique_ptr<AttentionServer> server,
             std::unique_ptr<client::AttentionClient> client)
      : server_(std::move(server)), client_(std::move(client)) {}

  std::unique_ptr<AttentionServer> server_;
  std::unique_ptr<client::AttentionClient> client_;
};

// The Attend calls `server`'s latency histogram counted at `stage` ("queue",
// "compute" or "total"): a call refused before the queue adds to "total"
// only.
inline double AttendLatencyCount(AttentionServer& server, absl::string_view stage) {
  const std::string text = server.metrics().RenderPrometheus();
  const std::string name =
      absl::StrCat("\nattention_latency_seconds_count{stage=\"", stage, "\",method=\"Attend\"} ");
  const size_t at = text.find(name);
  return at == std::string::npos ? 0 : std::stod(text.substr(at + name.size()));
}

// A fixture base holding one TestServer, with default options, for all tests
// of its suite. `Base` is ::testing::Test or a ::testing::TestWithParam<T>.
// A suite that needs other options defines SetUpTestSuite calling
// StartSuiteServer(options).
template <typename Base = ::testing::Test>
class ServerSuite : public Base {
 protected:
  static void SetUpTestSuite() { StartSuiteServer({}); }
  static void StartSuiteServer(ServerOptions options) {
    absl::StatusOr<std::unique_ptr<TestServer>> started = TestServer::Start(std::move(options));
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = *std::move(started);
  }
  static void TearDownTestSuite() { server_.reset(); }
  void SetUp() override { ASSERT_NE(server_, nullptr) << "the suite's server did not start"; }

  static client::AttentionClient& client() { return server_->client(); }

  static inline std::unique_ptr<TestServer> server_;
};

// FLOAT32 tensor of `shape` holding 0.1, 0.2, ... (distinct, small values).
inline v1::Tensor Ramp(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> values(static_cast<size_t>(n));
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.1f * static_cast<float>(i + 1);
  return *client::MakeFloatTensor(shape, values);
}

// A valid raw call: query [2, 3, 4], key [2, 5, 4], value [2, 5, 6]
// (B = 2, L = 3, S = 5, E = 4, Ev = 6).
inline v1::AttendRequest ValidRequest() {
  v1::AttendRequest r;
  *r.mutable_query() = Ramp({2, 3, 4});
  *r.mutable_key() = Ramp({2, 5, 4});
  *r.mutable_value() = Ramp({2, 5, 6});
  return r;
}

// The code of a request the server rejects as malformed or out of its contract.
inline constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

// A wire tensor with `dtype`, `shape` and raw `data`, unchecked.
inline v1::Tensor RawTensor(v1::Tensor::DType dtype, const std::vector<int64_t>& shape,
                            std::string data) {
  v1::Tensor t;
  t.set_dtype(dtype);
  t.mutable_shape()->Assign(shape.begin(), shape.end());
  t.set_data(std::move(data));
  return t;
}

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_SERVER_TEST_SERVER_H_
