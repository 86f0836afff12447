#include "server/attention_service.h"

#include <chrono>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/status_macros.h"
#include "server/convert.h"

#ifndef ATTENTION_VERSION
#error "ATTENTION_VERSION must be defined by the build"
#endif

namespace attention::server {
namespace {

grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace

AttentionServiceImpl::AttentionServiceImpl(const Engine* engine, const ModelRepository* models,
                                           int64_t max_message_bytes)
    : engine_(engine), models_(models), max_message_bytes_(max_message_bytes) {}

absl::StatusOr<const Model*> AttentionServiceImpl::FindModel(absl::string_view name) const {
  const Model* model = models_->Find(name);
  if (model == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("model: \"", name, "\" is not registered (ListModels shows what is)"));
  }
  return model;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* context,
                                                       const v1::AttendRequest* request,
                                                       v1::AttendResponse* response) {
  return Finish(context, DoAttend(*context, *request, response));
}

absl::Status AttentionServiceImpl::DoAttend(const grpc::CallbackServerContext& context,
                                            const v1::AttendRequest& request,
                                            v1::AttendResponse* response) const {
  if (context.deadline() <= std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError("deadline passed before compute started");
  }
  if (context.IsCancelled()) {
    return absl::CancelledError("call cancelled before compute started");
  }
  const Model* model = nullptr;
  if (!request.model().empty()) {
    ATTN_ASSIGN_OR_RETURN(model, FindModel(request.model()));
  }
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<EngineRequest> converted, ToEngineRequest(request));
  if (model && model->config.precision() == v1::AttendRequest::FAST) converted->args.fast = true;

  const absl::Time start = absl::Now();
  ATTN_ASSIGN_OR_RETURN(AttentionResult result,
                        model ? model->layer->Forward(*engine_, converted->args)
                              : engine_->Attend(converted->args));
  const absl::Duration compute = absl::Now() - start;

  response->set_id(request.id());
  ATTN_RETURN_IF_ERROR(
      ToWireTensor(result.output, converted->output_dtype, response->mutable_output()));
  if (request.need_weights()) {
    ATTN_RETURN_IF_ERROR(
        ToWireTensor(result.weights, converted->output_dtype, response->mutable_weights()));
  }
  // Requests go straight to the engine: nothing waits in a queue yet.
  response->set_queue_us(0);
  response->set_compute_us(absl::ToInt64Microseconds(compute));
  response->set_batch_size(1);
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetServerInfo(
    grpc::CallbackServerContext* context, const v1::GetServerInfoRequest* /*request*/,
    v1::ServerInfo* response) {
  const EngineOptions& options = engine_->options();
  response->set_version(ATTENTION_VERSION);
  response->set_engine_backend(engine_->backend_name());
  response->set_engine_isa(engine_->isa());
  response->set_engine_threads(engine_->threads());
  v1::Limits* limits = response->mutable_limits();
  limits->set_max_message_bytes(max_message_bytes_);
  limits->set_max_tensor_elements(options.max_tensor_elements);
  limits->set_max_score_elements(options.max_score_elements);
  for (int kind = v1::Score::Kind_MIN; kind <= v1::Score::Kind_MAX; ++kind) {
    if (v1::Score::Kind_IsValid(kind)) {
      response->add_supported_scores(static_cast<v1::Score::Kind>(kind));
    }
  }
  for (int dtype = v1::Tensor::DType_MIN; dtype <= v1::Tensor::DType_MAX; ++dtype) {
    if (v1::Tensor::DType_IsValid(dtype)) {
      response->add_supported_dtypes(static_cast<v1::Tensor::DType>(dtype));
    }
  }
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(grpc::CallbackServerContext* context,
                                                           const v1::ListModelsRequest* /*request*/,
                                                           v1::ListModelsResponse* response) {
  for (const Model* model : models_->models()) *response->add_models() = model->config;
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModel(grpc::CallbackServerContext* context,
                                                         const v1::GetModelRequest* request,
                                                         v1::GetModelResponse* response) {
  absl::StatusOr<const Model*> model = FindModel(request->name());
  if (model.ok()) *response->mutable_config() = (*model)->config;
  return Finish(context, model.status());
}

}  // namespace attention::server
