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
                                           Scheduler* scheduler, const ServiceOptions& options)
    : engine_(engine), models_(models), scheduler_(scheduler), options_(options) {}

absl::StatusOr<const Model*> AttentionServiceImpl::FindModel(absl::string_view name) const {
  const Model* model = models_->Find(name);
  if (model == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("model: \"", name, "\" is not registered (ListModels shows what is)"));
  }
  return model;
}

absl::StatusOr<Job> AttentionServiceImpl::MakeJob(const grpc::CallbackServerContext& context,
                                                  const v1::AttendRequest& request) const {
  if (context.deadline() <= std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError("deadline passed before compute started");
  }
  if (context.IsCancelled()) {
    return absl::CancelledError("call cancelled before compute started");
  }
  Job job;
  if (!request.model().empty()) {
    ATTN_ASSIGN_OR_RETURN(job.model, FindModel(request.model()));
  }
  ATTN_ASSIGN_OR_RETURN(job.request, ToEngineRequest(request));
  AttentionArgs& args = job.request->args;
  job.max_batch_size = options_.max_batch_size;
  job.max_queue_delay = absl::Microseconds(options_.max_queue_delay_us);
  if (job.model != nullptr) {
    const v1::ModelConfig& config = job.model->config;
    if (config.precision() == v1::AttendRequest::FAST) args.fast = true;
    if (config.batching().max_batch_size() > 0) {
      job.max_batch_size = config.batching().max_batch_size();
    }
    if (config.batching().has_max_queue_delay_us()) {
      job.max_queue_delay = absl::Microseconds(config.batching().max_queue_delay_us());
    }
    job.batch_key = absl::StrCat("model/", config.name());
  } else {
    // Raw calls batch with calls of the same head split.
    job.batch_key = absl::StrCat("raw/", args.num_heads, "/",
                                 args.query.shape.empty() ? 0 : args.query.shape.back());
  }
  job.deadline = absl::FromChrono(context.deadline());
  return job;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* context,
                                                       const v1::AttendRequest* request,
                                                       v1::AttendResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<Job> job = MakeJob(*context, *request);
  if (!job.ok()) {
    reactor->Finish(ToGrpcStatus(job.status()));
    return reactor;
  }
  job->cancelled = [context] { return context->IsCancelled(); };
  const v1::Tensor::DType output_dtype = job->request->output_dtype;
  job->done = [request, response, reactor, output_dtype](absl::StatusOr<AttentionResult> result,
                                                         const JobTiming& timing) {
    absl::Status status = result.status();
    if (status.ok()) status = FillResponse(*request, *result, output_dtype, timing, response);
    reactor->Finish(ToGrpcStatus(status));
  };
  if (absl::Status queued = scheduler_->Submit(*std::move(job)); !queued.ok()) {
    reactor->Finish(ToGrpcStatus(queued));
  }
  return reactor;
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
  limits->set_max_message_bytes(options_.max_message_bytes);
  limits->set_max_tensor_elements(options.max_tensor_elements);
  limits->set_max_score_elements(options.max_score_elements);
  limits->set_max_queue(options_.max_queue);
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
