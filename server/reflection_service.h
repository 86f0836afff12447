#ifndef ATTENTION_SERVER_REFLECTION_SERVICE_H_
#define ATTENTION_SERVER_REFLECTION_SERVICE_H_

#include <string>
#include <vector>

#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "server/security.h"

namespace attention::server {

// gRPC server reflection (grpc.reflection.v1alpha, what grpcurl asks), on the
// callback API, answering from the descriptors compiled into the binary.
// gRPC's own reflection plugin takes any call, so with --auth_token_file it
// would describe the API to callers without the token; this one checks the
// token first, as every call but health does. Thread-safe.
class ReflectionService final
    : public grpc::reflection::v1alpha::ServerReflection::CallbackService {
 public:
  // `services`: the fully-qualified names list_services reports. `auth` may
  // be null (no auth); it must outlive the service.
  ReflectionService(std::vector<std::string> services, const TokenAuth* auth);

  // UNAUTHENTICATED without the token; otherwise one response per request:
  // list_services; file_by_filename, file_containing_symbol and
  // file_containing_extension (the file, then each file it imports, once);
  // all_extension_numbers_of_type. What is not found is an error_response
  // with NOT_FOUND, naming it.
  grpc::ServerBidiReactor<grpc::reflection::v1alpha::ServerReflectionRequest,
                          grpc::reflection::v1alpha::ServerReflectionResponse>*
  ServerReflectionInfo(grpc::CallbackServerContext* context) override;

 private:
  class Reactor;
  grpc::reflection::v1alpha::ServerReflectionResponse Answer(
      const grpc::reflection::v1alpha::ServerReflectionRequest& request) const;

  const std::vector<std::string> services_;
  const TokenAuth* const auth_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_REFLECTION_SERVICE_H_
