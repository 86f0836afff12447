#ifndef ATTENTION_SERVER_ATTENTION_SERVICE_H_
#define ATTENTION_SERVER_ATTENTION_SERVICE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "attention/v1/service.grpc.pb.h"
#include "engine/engine.h"

namespace attention::server {

// attention.v1.AttentionService on gRPC's callback API: converts requests
// (server/convert.h), runs them on the engine and converts the answers.
// AttendStream is not served yet (UNIMPLEMENTED). Thread-safe.
class AttentionServiceImpl final : public v1::AttentionService::CallbackService {
 public:
  // `engine` must outlive the service. `max_message_bytes` is reported in
  // GetServerInfo's limits.
  AttentionServiceImpl(const Engine* engine, int64_t max_message_bytes);

  AttentionServiceImpl(const AttentionServiceImpl&) = delete;
  AttentionServiceImpl& operator=(const AttentionServiceImpl&) = delete;

  // DEADLINE_EXCEEDED / CANCELLED when the call is over before compute starts;
  // otherwise the conversion's and the engine's errors.
  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const v1::AttendRequest* request,
                                   v1::AttendResponse* response) override;
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const v1::GetServerInfoRequest* request,
                                          v1::ServerInfo* response) override;
  // No model repository yet: the list is empty.
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const v1::ListModelsRequest* request,
                                       v1::ListModelsResponse* response) override;
  // NOT_FOUND for every name.
  grpc::ServerUnaryReactor* GetModel(grpc::CallbackServerContext* context,
                                     const v1::GetModelRequest* request,
                                     v1::GetModelResponse* response) override;

 private:
  absl::Status DoAttend(const grpc::CallbackServerContext& context,
                        const v1::AttendRequest& request, v1::AttendResponse* response) const;

  const Engine* const engine_;
  const int64_t max_message_bytes_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_ATTENTION_SERVICE_H_
