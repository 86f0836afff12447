// The service's RPCs other than the numbers of Attend, and AttentionServer's
// own contract (binding, options, shutdown).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/attention_client.h"
#include "client/tensors.h"
#include "engine/thread_binding.h"
#include "gmock/gmock.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "server/server.h"
#include "tests/server/test_server.h"
#include "tests/status_matchers.h"

namespace attention::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::Eq;
using ::testing::Ge;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::MatchesRegex;
using ::testing::Not;
using ::testing::Property;

// query [2, 3, 4], key [2, 5, 4], value [2, 5, 6], valid_lens [2].
v1::AttendRequest SmallRequest() {
  v1::AttendRequest r;
  r.set_id("request-7");
  *r.mutable_query() = Ramp({2, 3, 4});
  *r.mutable_key() = Ramp({2, 5, 4});
  *r.mutable_value() = Ramp({2, 5, 6});
  *r.mutable_mask()->mutable_valid_lens() = *client::MakeInt64Tensor({2}, {5, 2});
  r.set_need_weights(true);
  return r;
}

// The tensor's `data` bytes replaced by the same values in `float_data`.
v1::Tensor AsFloatData(const v1::Tensor& t) {
  v1::Tensor copy = t;
  EXPECT_THAT(client::ExpandToFloatData(&copy), IsOk());
  return copy;
}

class ServiceTest : public ServerSuite<> {
 protected:
  // The output of `request`, or an empty tensor after a failed expectation.
  static v1::Tensor OutputOf(const v1::AttendRequest& request) {
    absl::StatusOr<v1::AttendResponse> response = client().Attend(request);
    EXPECT_THAT(response, IsOk());
    return response.ok() ? response->output() : v1::Tensor();
  }
};

TEST_F(ServiceTest, ServerInfoDescribesTheServer) {
  absl::StatusOr<v1::ServerInfo> info = client().GetServerInfo();
  ASSERT_THAT(info, IsOk());
  EXPECT_THAT(info->version(), MatchesRegex("[0-9]+\\.[0-9]+\\.[0-9]+"));
  // The service never runs the reference backend unless asked.
  EXPECT_EQ(info->engine_backend(), "onednn");
  EXPECT_THAT(info->engine_isa(), Not(IsEmpty()));
  EXPECT_NE(info->engine_isa(), "generic");
  // One per CPU this process may run on, or fewer under OMP_THREAD_LIMIT (the
  // TSan build runs with 1).
  int threads = static_cast<int>(internal::AllowedCpus().size());
  if (const char* limit = std::getenv("OMP_THREAD_LIMIT")) threads = std::min(threads, std::atoi(limit));
  EXPECT_EQ(info->engine_threads(), threads);
}

TEST(ServiceEngineTest, ReportsTheReferenceBackendWhenAskedFor) {
  ServerOptions options;
  options.engine.backend = Backend::kReference;
  absl::StatusOr<std::unique_ptr<TestServer>> server = TestServer::Start(options);
  ASSERT_THAT(server, IsOk());
  absl::StatusOr<v1::ServerInfo> info = (*server)->client().GetServerInfo();
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->engine_backend(), "reference");
  EXPECT_EQ(info->engine_isa(), "generic");
  EXPECT_EQ(info->engine_threads(), 1);
}

TEST_F(ServiceTest, ServerInfoReportsTheLimits) {
  absl::StatusOr<v1::ServerInfo> info = client().GetServerInfo();
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->limits().max_message_bytes(), ServerOptions().max_message_mb << 20);
  EXPECT_EQ(info->limits().max_tensor_elements(), EngineOptions().max_tensor_elements);
  EXPECT_EQ(info->limits().max_score_elements(), EngineOptions().max_score_elements);
}

TEST_F(ServiceTest, ServerInfoListsEveryScoreAndDType) {
  absl::StatusOr<v1::ServerInfo> info = client().GetServerInfo();
  ASSERT_THAT(info, IsOk());
  EXPECT_THAT(
      info->supported_scores(),
      ElementsAre(v1::Score::SCALED_DOT, v1::Score::DOT, v1::Score::ADDITIVE, v1::Score::BILINEAR,
                  v1::Score::COSINE, v1::Score::NEG_EUCLIDEAN, v1::Score::GAUSSIAN));
  EXPECT_THAT(info->supported_dtypes(),
              ElementsAre(v1::Tensor::FLOAT32, v1::Tensor::BFLOAT16, v1::Tensor::FLOAT16,
                          v1::Tensor::BOOL, v1::Tensor::INT32, v1::Tensor::INT64));
}

TEST_F(ServiceTest, HealthIsServingForTheServerAndTheService) {
  EXPECT_THAT(client().Health(), IsOkAndHolds(Eq("SERVING")));
  EXPECT_THAT(client().Health("attention.v1.AttentionService"), IsOkAndHolds(Eq("SERVING")));
}

TEST_F(ServiceTest, ListModelsIsEmpty) {
  EXPECT_THAT(client().ListModels(),
              IsOkAndHolds(Property(&v1::ListModelsResponse::models_size, 0)));
}

TEST_F(ServiceTest, GetModelIsNotFound) {
  EXPECT_THAT(client().GetModel("x"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("model: \"x\" is not registered")));
}

TEST_F(ServiceTest, GetModelClipsALongNameInTheMessage) {
  absl::StatusOr<v1::GetModelResponse> response = client().GetModel(std::string(100000, 'm'));
  EXPECT_THAT(response, StatusIs(absl::StatusCode::kNotFound, HasSubstr("model: \"mmmm")));
  EXPECT_LE(response.status().message().size(), 1030u);
}

// gRPC rounds deadlines up to whole milliseconds, so a deadline that ends
// before the server looks can only be given as one already in the past.
TEST_F(ServiceTest, ExpiredDeadlineIsDeadlineExceeded) {
  std::unique_ptr<v1::AttentionService::Stub> stub =
      v1::AttentionService::NewStub(client().channel());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() - std::chrono::seconds(1));
  v1::AttendResponse response;
  EXPECT_EQ(stub->Attend(&context, SmallRequest(), &response).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
}

TEST_F(ServiceTest, AttendEchoesTheIdAndReportsTimings) {
  const absl::Time sent = absl::Now();
  absl::StatusOr<v1::AttendResponse> response = client().Attend(SmallRequest());
  const int64_t round_trip_us = absl::ToInt64Microseconds(absl::Now() - sent);
  ASSERT_THAT(response, IsOk());
  EXPECT_EQ(response->id(), "request-7");
  EXPECT_EQ(response->batch_size(), 1);  // a lone caller
  EXPECT_THAT(response->compute_us(), Ge(0));
  EXPECT_THAT(response->queue_us(), Ge(0));
  // Both are parts of the call's time on the server, so of its round trip.
  // (How long a lone job waits is the scheduler's, tested without a clock in
  // scheduler_test.)
  EXPECT_LE(response->queue_us() + response->compute_us(), round_trip_us);
}

TEST_F(ServiceTest, AttendReturnsWeightsOnlyWhenAsked) {
  v1::AttendRequest request = SmallRequest();
  EXPECT_THAT(client().Attend(request),
              IsOkAndHolds(Property(&v1::AttendResponse::has_weights, true)));
  request.set_need_weights(false);
  EXPECT_THAT(client().Attend(request),
              IsOkAndHolds(Property(&v1::AttendResponse::has_weights, false)));
}

TEST_F(ServiceTest, AttendOutputShapeAndDType) {
  const v1::Tensor output = OutputOf(SmallRequest());
  EXPECT_EQ(output.dtype(), v1::Tensor::FLOAT32);
  EXPECT_THAT(output.shape(), ElementsAre(2, 3, 6));
  EXPECT_EQ(output.data().size(), 2u * 3 * 6 * sizeof(float));
}

TEST_F(ServiceTest, OmittedKeyAndValueMeanSelfAttention) {
  v1::AttendRequest explicit_kv;
  *explicit_kv.mutable_query() = Ramp({2, 3, 4});
  *explicit_kv.mutable_key() = explicit_kv.query();
  *explicit_kv.mutable_value() = explicit_kv.query();
  v1::AttendRequest omitted = explicit_kv;
  omitted.clear_key();
  omitted.clear_value();
  EXPECT_EQ(OutputOf(omitted).data(), OutputOf(explicit_kv).data());
}

TEST_F(ServiceTest, EmptyTensorMessageMeansAbsent) {
  v1::AttendRequest request = SmallRequest();
  request.mutable_mask()->mutable_attn_mask();
  v1::AttendRequest without = SmallRequest();
  EXPECT_EQ(OutputOf(request).data(), OutputOf(without).data());
}

TEST_F(ServiceTest, FloatDataGivesTheSameOutputAsData) {
  const v1::AttendRequest bytes = SmallRequest();
  v1::AttendRequest floats = bytes;
  *floats.mutable_query() = AsFloatData(bytes.query());
  *floats.mutable_key() = AsFloatData(bytes.key());
  *floats.mutable_value() = AsFloatData(bytes.value());
  EXPECT_EQ(OutputOf(floats).data(), OutputOf(bytes).data());
}

TEST_F(ServiceTest, IntDataGivesTheSameOutputAsData) {
  const v1::AttendRequest bytes = SmallRequest();
  for (v1::Tensor::DType dtype : {v1::Tensor::INT64, v1::Tensor::INT32}) {
    v1::AttendRequest ints = bytes;
    v1::Tensor* lens = ints.mutable_mask()->mutable_valid_lens();
    lens->set_dtype(dtype);
    lens->clear_data();
    lens->add_int_data(5);
    lens->add_int_data(2);
    EXPECT_EQ(OutputOf(ints).data(), OutputOf(bytes).data()) << v1::Tensor::DType_Name(dtype);
  }
}

TEST_F(ServiceTest, BoolIntDataGivesTheSameOutputAsData) {
  v1::AttendRequest bytes = SmallRequest();
  bytes.mutable_mask()->clear_valid_lens();
  *bytes.mutable_mask()->mutable_key_padding_mask() = *client::MakeBoolTensor(
      {2, 5}, {false, false, true, false, true, false, true, true, true, true});
  v1::AttendRequest ints = bytes;
  v1::Tensor* mask = ints.mutable_mask()->mutable_key_padding_mask();
  mask->clear_data();
  for (int64_t v : {0, 0, 1, 0, 1, 0, 1, 1, 1, 1}) mask->add_int_data(v);
  EXPECT_EQ(OutputOf(ints).data(), OutputOf(bytes).data());
}

TEST(AttentionServerTest, ReportsTheBoundPortAndAddress) {
  absl::StatusOr<std::unique_ptr<TestServer>> server = TestServer::Start();
  ASSERT_THAT(server, IsOk());
  EXPECT_GT((*server)->server().port(), 0);
  EXPECT_EQ((*server)->server().address(),
            "127.0.0.1:" + std::to_string((*server)->server().port()));
}

TEST(AttentionServerTest, PortInUseIsUnavailableAndNamesTheAddress) {
  absl::StatusOr<std::unique_ptr<TestServer>> first = TestServer::Start();
  ASSERT_THAT(first, IsOk());
  ServerOptions options;
  options.listen = (*first)->server().address();
  EXPECT_THAT(AttentionServer::Create(options),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr(options.listen)));
}

TEST(AttentionServerTest, UnassignableAddressIsUnavailableAndNamesTheAddress) {
  ServerOptions options;
  options.listen = "192.0.2.1:0";  // TEST-NET-1 (RFC 5737): never a local address.
  EXPECT_THAT(AttentionServer::Create(options),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("192.0.2.1:0")));
}

TEST(AttentionServerTest, RejectsNonPositiveMessageLimit) {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.max_message_mb = 0;
  EXPECT_THAT(AttentionServer::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_message_mb")));
}

TEST(AttentionServerTest, HugeMessageLimitSaturates) {
  ServerOptions options;
  options.max_message_mb = int64_t{1} << 50;
  absl::StatusOr<std::unique_ptr<TestServer>> server = TestServer::Start(options);
  ASSERT_THAT(server, IsOk());
  EXPECT_THAT((*server)->client().GetServerInfo(),
              IsOkAndHolds(Property(&v1::ServerInfo::limits,
                                    Property(&v1::Limits::max_message_bytes, INT32_MAX))));
}

TEST(AttentionServerTest, ShutdownIsIdempotentAndEndsWait) {
  absl::StatusOr<std::unique_ptr<TestServer>> server = TestServer::Start();
  ASSERT_THAT(server, IsOk());
  (*server)->server().Shutdown();
  (*server)->server().Shutdown();
  (*server)->server().Wait();
  EXPECT_THAT((*server)->client().GetServerInfo(),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
}

}  // namespace
}  // namespace attention::testing
