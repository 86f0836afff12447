#include "server/reflection_service.h"

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "server/convert.h"

namespace attention::server {
namespace {

using google::protobuf::DescriptorPool;
using google::protobuf::FileDescriptor;
using grpc::reflection::v1alpha::ServerReflectionRequest;
using grpc::reflection::v1alpha::ServerReflectionResponse;

// `file`, then every file it imports (transitively), each once.
void AddFileAndImports(const FileDescriptor* file, std::set<std::string>& seen,
                       ServerReflectionResponse& response) {
  if (!seen.insert(file->name()).second) return;
  google::protobuf::FileDescriptorProto proto;
  file->CopyTo(&proto);
  response.mutable_file_descriptor_response()->add_file_descriptor_proto(proto.SerializeAsString());
  for (int i = 0; i < file->dependency_count(); ++i) {
    AddFileAndImports(file->dependency(i), seen, response);
  }
}

void SetError(grpc::StatusCode code, std::string message, ServerReflectionResponse& response) {
  response.mutable_error_response()->set_error_code(code);
  response.mutable_error_response()->set_error_message(std::move(message));
}

}  // namespace

ReflectionService::ReflectionService(std::vector<std::string> services, const TokenAuth* auth)
    : services_(std::move(services)), auth_(auth) {}

ServerReflectionResponse ReflectionService::Answer(const ServerReflectionRequest& request) const {
  const DescriptorPool* pool = DescriptorPool::generated_pool();
  ServerReflectionResponse response;
  response.set_valid_host(request.host());
  *response.mutable_original_request() = request;
  std::set<std::string> seen;
  auto send_file = [&](const FileDescriptor* file, absl::string_view what) {
    if (file == nullptr) {
      SetError(grpc::StatusCode::NOT_FOUND, absl::StrCat(what, " not found"), response);
    } else {
      AddFileAndImports(file, seen, response);
    }
  };
  switch (request.message_request_case()) {
    case ServerReflectionRequest::kListServices:
      for (const std::string& name : services_) {
        response.mutable_list_services_response()->add_service()->set_name(name);
      }
      break;
    case ServerReflectionRequest::kFileByFilename:
      send_file(pool->FindFileByName(request.file_by_filename()),
                absl::StrCat("file \"", request.file_by_filename(), "\""));
      break;
    case ServerReflectionRequest::kFileContainingSymbol:
      send_file(pool->FindFileContainingSymbol(request.file_containing_symbol()),
                absl::StrCat("symbol \"", request.file_containing_symbol(), "\""));
      break;
    case ServerReflectionRequest::kFileContainingExtension: {
      const auto& e = request.file_containing_extension();
      const auto* type = pool->FindMessageTypeByName(e.containing_type());
      const auto* extension =
          type == nullptr ? nullptr : pool->FindExtensionByNumber(type, e.extension_number());
      send_file(
          extension == nullptr ? nullptr : extension->file(),
          absl::StrCat("extension ", e.extension_number(), " of \"", e.containing_type(), "\""));
      break;
    }
    case ServerReflectionRequest::kAllExtensionNumbersOfType: {
      const std::string& name = request.all_extension_numbers_of_type();
      const auto* type = pool->FindMessageTypeByName(name);
      if (type == nullptr) {
        SetError(grpc::StatusCode::NOT_FOUND, absl::StrCat("type \"", name, "\" not found"),
                 response);
        break;
      }
      std::vector<const google::protobuf::FieldDescriptor*> extensions;
      pool->FindAllExtensions(type, &extensions);
      auto* numbers = response.mutable_all_extension_numbers_response();
      numbers->set_base_type_name(name);
      for (const auto* extension : extensions) numbers->add_extension_number(extension->number());
      break;
    }
    case ServerReflectionRequest::MESSAGE_REQUEST_NOT_SET:
      SetError(grpc::StatusCode::INVALID_ARGUMENT, "message_request: none is set", response);
      break;
  }
  return response;
}

// One call: reads a request, writes its answer, and so on until the caller
// half-closes. Deletes itself in OnDone.
class ReflectionService::Reactor final
    : public grpc::ServerBidiReactor<ServerReflectionRequest, ServerReflectionResponse> {
 public:
  Reactor(const ReflectionService* service, grpc::CallbackServerContext* context)
      : service_(service) {
    if (service_->auth_ != nullptr) {
      if (absl::Status admitted = service_->auth_->Check(*context); !admitted.ok()) {
        Finish(ToGrpcStatus(admitted));
        return;
      }
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the caller half-closed, or the call is over
      Finish(grpc::Status::OK);
      return;
    }
    response_ = service_->Answer(request_);
    StartWrite(&response_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::CANCELLED);
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  const ReflectionService* const service_;
  ServerReflectionRequest request_;
  ServerReflectionResponse response_;
};

grpc::ServerBidiReactor<ServerReflectionRequest, ServerReflectionResponse>*
ReflectionService::ServerReflectionInfo(grpc::CallbackServerContext* context) {
  return new Reactor(this, context);
}

}  // namespace attention::server
