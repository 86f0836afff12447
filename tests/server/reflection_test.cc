// gRPC server reflection (server/reflection_service.h), through a real
// server: what grpcurl asks, and the bearer token it needs like every call
// but health. gRPC's own reflection plugin answered without the token.

#include <memory>
#include <string>
#include <vector>

#include "attention/v1/service.grpc.pb.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "tests/safetensors_writer.h"
#include "tests/server/test_server.h"
#include "tests/status_matchers.h"

namespace attention::testing {
namespace {

using ::grpc::reflection::v1alpha::ServerReflection;
using ::grpc::reflection::v1alpha::ServerReflectionRequest;
using ::grpc::reflection::v1alpha::ServerReflectionResponse;
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class ReflectionTest : public ::testing::Test {
 protected:
  // A server whose calls need `token` ("" for none).
  void Start(const std::string& token) {
    ServerOptions options;
    if (!token.empty()) {
      const std::string dir = MakeTempDir("reflection");
      WriteFile(dir + "/token", token);
      options.auth_token_file = dir + "/token";
    }
    absl::StatusOr<std::unique_ptr<TestServer>> server = TestServer::Start(options);
    ASSERT_THAT(server, IsOk());
    server_ = *std::move(server);
    stub_ = ServerReflection::NewStub(server_->client().channel());
  }

  // Sends `requests` on one reflection stream with `token` ("" for none);
  // the responses, and the call's status.
  grpc::Status Ask(const std::vector<ServerReflectionRequest>& requests, const std::string& token,
                   std::vector<ServerReflectionResponse>* responses) {
    grpc::ClientContext context;
    if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
    auto stream = stub_->ServerReflectionInfo(&context);
    for (const ServerReflectionRequest& request : requests) {
      if (!stream->Write(request)) break;
      ServerReflectionResponse response;
      if (!stream->Read(&response)) break;
      responses->push_back(response);
    }
    stream->WritesDone();
    return stream->Finish();
  }

  static ServerReflectionRequest ListServices() {
    ServerReflectionRequest r;
    r.set_list_services("*");
    return r;
  }

  static ServerReflectionRequest Symbol(const std::string& symbol) {
    ServerReflectionRequest r;
    r.set_file_containing_symbol(symbol);
    return r;
  }

  std::unique_ptr<TestServer> server_;
  std::unique_ptr<ServerReflection::Stub> stub_;
};

TEST_F(ReflectionTest, ListsTheServicesAndDescribesThemWithTheirImports) {
  Start("");
  std::vector<ServerReflectionResponse> responses;
  ASSERT_TRUE(Ask({ListServices(), Symbol("attention.v1.AttentionService")}, "", &responses).ok());
  ASSERT_EQ(responses.size(), 2u);
  std::vector<std::string> services;
  for (const auto& s : responses[0].list_services_response().service())
    services.push_back(s.name());
  EXPECT_THAT(services, ElementsAre("attention.v1.AttentionService", "grpc.health.v1.Health",
                                    "grpc.reflection.v1alpha.ServerReflection"));

  // The file first, then what it imports: a client can rebuild every type.
  std::vector<std::string> files;
  for (const std::string& bytes : responses[1].file_descriptor_response().file_descriptor_proto()) {
    google::protobuf::FileDescriptorProto file;
    ASSERT_TRUE(file.ParseFromString(bytes));
    files.push_back(file.name());
  }
  ASSERT_FALSE(files.empty());
  EXPECT_EQ(files[0], "attention/v1/service.proto");
  EXPECT_THAT(files, Contains("attention/v1/attention.proto"));
  EXPECT_THAT(files, Contains("attention/v1/tensor.proto"));
}

TEST_F(ReflectionTest, AnUnknownSymbolIsNotFoundAndTheStreamGoesOn) {
  Start("");
  std::vector<ServerReflectionResponse> responses;
  ASSERT_TRUE(
      Ask({Symbol("attention.v1.Nothing"), Symbol("attention.v1.AttendRequest")}, "", &responses)
          .ok());
  ASSERT_EQ(responses.size(), 2u);
  EXPECT_EQ(responses[0].error_response().error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(responses[0].error_response().error_message(),
              HasSubstr("symbol \"attention.v1.Nothing\" not found"));
  EXPECT_EQ(responses[1].file_descriptor_response().file_descriptor_proto_size() > 0, true);
}

// Regression: with --auth_token_file, gRPC's reflection plugin described the
// API to callers without the token.
TEST_F(ReflectionTest, NeedsTheBearerTokenWhenAuthIsOn) {
  Start("s3cret-token");
  std::vector<ServerReflectionResponse> responses;
  const grpc::Status anonymous = Ask({ListServices()}, "", &responses);
  EXPECT_EQ(anonymous.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(responses.empty());
  const grpc::Status wrong = Ask({ListServices()}, "s3cret", &responses);
  EXPECT_EQ(wrong.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(wrong.error_message(), HasSubstr("invalid bearer token"));
  EXPECT_TRUE(responses.empty());
  EXPECT_TRUE(Ask({ListServices()}, "s3cret-token", &responses).ok());
  ASSERT_EQ(responses.size(), 1u);
  EXPECT_EQ(responses[0].list_services_response().service_size(), 3);
}

}  // namespace
}  // namespace attention::testing
