#include "server/attention_service.h"

#include <atomic>
#include <chrono>
#include <deque>
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

// One AttendStream call. Reads, job completions and writes arrive on
// different threads; mu_ orders them. Deletes itself in OnDone.
class AttentionServiceImpl::StreamReactor final
    : public grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse> {
 public:
  StreamReactor(AttentionServiceImpl* service, grpc::CallbackServerContext* context)
      : service_(service), context_(context) {
    absl::MutexLock lock(&mu_);
    ReadNextLocked();
  }

  void OnReadDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    reading_ = false;
    if (!ok) {  // the caller half-closed, or the call is over
      reads_done_ = true;
      MaybeFinishLocked();
      return;
    }
    std::shared_ptr<v1::AttendRequest> request = std::move(next_);
    ++in_flight_;
    absl::StatusOr<Job> job = service_->MakeJob(*context_, *request);
    if (job.ok()) {
      const v1::Tensor::DType output_dtype = job->request->output_dtype;
      job->cancelled = [this] { return cancelled_.load(); };
      job->done = [this, request, output_dtype](absl::StatusOr<AttentionResult> result,
                                                const JobTiming& timing) {
        v1::AttendResponse response;
        absl::Status status = result.status();
        if (status.ok()) status = FillResponse(*request, *result, output_dtype, timing, &response);
        absl::MutexLock lock(&mu_);
        AnswerLocked(*request, status, std::move(response));
      };
      // The job's views point into *request, which the job's `done` keeps alive.
      absl::Status queued = service_->scheduler_->Submit(*std::move(job));
      if (!queued.ok()) AnswerLocked(*request, queued, {});
    } else {
      AnswerLocked(*request, job.status(), {});
    }
    if (in_flight_ < kMaxStreamInFlight) ReadNextLocked();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    writes_.pop_front();
    --in_flight_;
    if (!ok) cancelled_ = true;
    if (cancelled_) DropWritesLocked();
    WriteNextLocked();
    if (!reading_ && !reads_done_ && !cancelled_ && in_flight_ < kMaxStreamInFlight) {
      ReadNextLocked();
    }
    MaybeFinishLocked();
  }

  void OnCancel() override {
    cancelled_ = true;
    absl::MutexLock lock(&mu_);
    if (!writing_) DropWritesLocked();
    MaybeFinishLocked();
  }

  void OnDone() override { delete this; }

 private:
  void ReadNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    next_ = std::make_shared<v1::AttendRequest>();
    reading_ = true;
    StartRead(next_.get());
  }

  // Queues the answer to `request`: the response, or its error in `status`.
  void AnswerLocked(const v1::AttendRequest& request, const absl::Status& status,
                    v1::AttendResponse response) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (cancelled_) {
      --in_flight_;
      MaybeFinishLocked();
      return;
    }
    if (!status.ok()) {
      response.Clear();
      response.set_id(request.id());
      const grpc::Status wire = ToGrpcStatus(status);
      response.mutable_status()->set_code(wire.error_code());
      response.mutable_status()->set_message(wire.error_message());
    } else {
      response.mutable_status()->set_code(0);
    }
    writes_.push_back(std::move(response));
    WriteNextLocked();
  }

  // The caller is gone: answers not yet written never will be.
  void DropWritesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    in_flight_ -= static_cast<int>(writes_.size());
    writes_.clear();
  }

  void WriteNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || writes_.empty() || cancelled_) return;
    writing_ = true;
    StartWrite(&writes_.front());
  }

  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || in_flight_ > 0 || writing_ || reading_) return;
    if (!reads_done_ && !cancelled_) return;
    finished_ = true;
    Finish(cancelled_ ? grpc::Status::CANCELLED : grpc::Status::OK);
  }

  AttentionServiceImpl* const service_;
  grpc::CallbackServerContext* const context_;
  std::atomic<bool> cancelled_{false};
  absl::Mutex mu_;
  std::shared_ptr<v1::AttendRequest> next_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::AttendResponse> writes_ ABSL_GUARDED_BY(mu_);  // front is being written
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // read, not yet written (or dropped)
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* AttentionServiceImpl::AttendStream(
    grpc::CallbackServerContext* context) {
  return new StreamReactor(this, context);
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
