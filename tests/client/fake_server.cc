#include "tests/client/fake_server.h"

#include <chrono>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/tensors.h"
#include "grpc/grpc.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/server_context.h"
#include "gtest/gtest.h"

namespace attention::testing {
namespace {

std::string Authorization(const grpc::ServerContext& context) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return "";
  return std::string(it->second.data(), it->second.size());
}

}  // namespace

class FakeAttentionServer::AttentionImpl final : public v1::AttentionService::Service {
 public:
  explicit AttentionImpl(State* state) : state_(state) {}

  grpc::Status Attend(grpc::ServerContext* context, const v1::AttendRequest* request,
                      v1::AttendResponse* response) override {
    Record(*context);
    const bool hang = CountAndStall(*context);
    if (hang || request->id() == "hang") {
      const absl::Time give_up = absl::Now() + absl::Seconds(30);
      while (!context->IsCancelled() && absl::Now() < give_up)
        absl::SleepFor(absl::Milliseconds(5));
      return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    }
    return Answer(*request, response);
  }

  grpc::Status AttendStream(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::AttendResponse, v1::AttendRequest>* stream) override {
    Record(*context);
    v1::AttendRequest request;
    while (stream->Read(&request)) {
      CountAndStall(*context);
      v1::AttendResponse response;
      const grpc::Status status = Answer(request, &response);
      if (!status.ok()) {
        response.Clear();
        response.set_id(request.id());
        response.mutable_status()->set_message(status.error_message());
      }
      response.mutable_status()->set_code(status.error_code());
      if (!stream->Write(response)) break;
    }
    return grpc::Status::OK;
  }

  grpc::Status GetServerInfo(grpc::ServerContext* context, const v1::GetServerInfoRequest*,
                             v1::ServerInfo* info) override {
    Record(*context);
    info->set_version("fake-1.0");
    info->set_engine_backend("reference");
    info->add_supported_scores(v1::Score::SCALED_DOT);
    return grpc::Status::OK;
  }

  grpc::Status ListModels(grpc::ServerContext* context, const v1::ListModelsRequest*,
                          v1::ListModelsResponse* response) override {
    Record(*context);
    v1::ModelConfig* model = response->add_models();
    model->set_name("demo");
    model->set_embed_dim(8);
    model->set_num_heads(2);
    return grpc::Status::OK;
  }

  grpc::Status GetModel(grpc::ServerContext* context, const v1::GetModelRequest* request,
                        v1::GetModelResponse* response) override {
    Record(*context);
    if (request->name() != "demo") {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          absl::StrCat("model \"", request->name(), "\" is not registered"));
    }
    response->mutable_config()->set_name("demo");
    return grpc::Status::OK;
  }

 private:
  void Record(const grpc::ServerContext& context) {
    absl::MutexLock lock(&state_->mu);
    state_->authorization = Authorization(context);
  }

  // Counts an Attend call or stream message, and waits out a stall. True
  // for the call HangCall chose.
  bool CountAndStall(const grpc::ServerContext& context) {
    absl::Time until;
    bool hang;
    {
      absl::MutexLock lock(&state_->mu);
      state_->peers.insert(context.peer());
      if (++state_->attend_calls == state_->stall_call) {
        state_->stalled_until = absl::Now() + state_->stall;
      }
      hang = state_->attend_calls == state_->hang_call;
      until = state_->stalled_until;
    }
    absl::SleepFor(until - absl::Now());
    return hang;
  }

  static grpc::Status Answer(const v1::AttendRequest& request, v1::AttendResponse* response) {
    if (request.id() == "fail") {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "mask.valid_lens: shape [3] does not match batch size 2");
    }
    absl::StatusOr<std::vector<float>> query = client::ReadFloats(request.query());
    if (!query.ok()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("query: ", query.status().message()));
    }
    const std::vector<int64_t> shape(request.query().shape().begin(),
                                     request.query().shape().end());
    absl::StatusOr<v1::Tensor> output =
        client::MakeFloatTensor(shape, *query, request.output_dtype());
    if (!output.ok()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("output_dtype: ", output.status().message()));
    }
    response->set_id(request.id());
    *response->mutable_output() = *std::move(output);
    if (request.need_weights()) {
      *response->mutable_weights() = *client::MakeFloatTensor({1, 1}, {0.5f}, v1::Tensor::FLOAT16);
    }
    response->set_queue_us(3);
    response->set_compute_us(7);
    response->set_batch_size(1);
    return grpc::Status::OK;
  }

  State* state_;
};

class FakeAttentionServer::HealthImpl final : public grpc::health::v1::Health::Service {
 public:
  explicit HealthImpl(State* state) : state_(state) {}

  grpc::Status Check(grpc::ServerContext*, const grpc::health::v1::HealthCheckRequest* request,
                     grpc::health::v1::HealthCheckResponse* response) override {
    absl::MutexLock lock(&state_->mu);
    state_->health_service = request->service();
    if (request->service() == "missing") {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service");
    }
    response->set_status(state_->health);
    return grpc::Status::OK;
  }

 private:
  State* state_;
};

FakeAttentionServer::FakeAttentionServer(absl::Duration max_connection_age)
    : attention_(std::make_unique<AttentionImpl>(&state_)),
      health_(std::make_unique<HealthImpl>(&state_)) {
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  if (max_connection_age > absl::ZeroDuration()) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS,
                               static_cast<int>(absl::ToInt64Milliseconds(max_connection_age)));
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, 30'000);
  }
  builder.RegisterService(attention_.get());
  builder.RegisterService(health_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port == 0) {
    ADD_FAILURE() << "the fake server could not start on 127.0.0.1:0";
    return;
  }
  address_ = absl::StrCat("127.0.0.1:", port);
}

FakeAttentionServer::~FakeAttentionServer() {
  if (server_ != nullptr) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
}

void FakeAttentionServer::set_health(grpc::health::v1::HealthCheckResponse::ServingStatus status) {
  absl::MutexLock lock(&state_.mu);
  state_.health = status;
}

std::string FakeAttentionServer::last_authorization() const {
  absl::MutexLock lock(&state_.mu);
  return state_.authorization;
}

std::string FakeAttentionServer::last_health_service() const {
  absl::MutexLock lock(&state_.mu);
  return state_.health_service;
}

int64_t FakeAttentionServer::attend_calls() const {
  absl::MutexLock lock(&state_.mu);
  return state_.attend_calls;
}

size_t FakeAttentionServer::distinct_peers() const {
  absl::MutexLock lock(&state_.mu);
  return state_.peers.size();
}

void FakeAttentionServer::HangCall(int64_t call) {
  absl::MutexLock lock(&state_.mu);
  state_.hang_call = call;
}

void FakeAttentionServer::StallCall(int64_t call, absl::Duration stall) {
  absl::MutexLock lock(&state_.mu);
  state_.stall_call = call;
  state_.stall = stall;
}

}  // namespace attention::testing
