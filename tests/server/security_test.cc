#include "server/security.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "attention/v1/service.grpc.pb.h"
#include "client/attention_client.h"
#include "gmock/gmock.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/server_context.h"
#include "gtest/gtest.h"
#include "tests/server/tls_certs.h"
#include "tests/status_matchers.h"

namespace attention::server {
namespace {

using ::attention::testing::IsOk;
using ::attention::testing::IsOkAndHolds;
using ::attention::testing::StatusIs;
using ::attention::testing::TlsCerts;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::NotNull;

// Certificates shared by every test of a suite (made once: openssl is slow).
class CertsSuite : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<TlsCerts>> certs = TlsCerts::Generate();
    ASSERT_THAT(certs, IsOk());
    certs_ = *std::move(certs);
  }
  static void TearDownTestSuite() { certs_.reset(); }
  void SetUp() override { ASSERT_THAT(certs_, NotNull()) << "certificates were not made"; }

  static const TlsCerts& certs() { return *certs_; }

  // Writes `text` to `name` in the certificates' folder; returns the path.
  static std::string WriteFile(const std::string& name, const std::string& text) {
    const std::string path = certs_->Path(name);
    std::ofstream(path, std::ios::trunc) << text;
    return path;
  }

 private:
  static std::unique_ptr<TlsCerts> certs_;
};

std::unique_ptr<TlsCerts> CertsSuite::certs_;

// --- TokenAuth ------------------------------------------------------------------

using TokenAuthTest = CertsSuite;

TEST_F(TokenAuthTest, FromFileTrimsTheTrailingNewline) {
  absl::StatusOr<std::unique_ptr<TokenAuth>> auth =
      TokenAuth::FromFile(WriteFile("token", "s3cret-Token_1\n"));
  ASSERT_THAT(auth, IsOk());
  EXPECT_THAT((*auth)->CheckAuthorizationValue("Bearer s3cret-Token_1"), IsOk());
  EXPECT_THAT((*auth)->CheckAuthorizationValue("Bearer s3cret-Token_1\n"), IsOk());
}

TEST_F(TokenAuthTest, FromFileRejectsAnEmptyFile) {
  const std::string path = WriteFile("blank_token", " \r\n\n");
  EXPECT_THAT(TokenAuth::FromFile(path),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("--auth_token_file"), HasSubstr(path), HasSubstr("empty"))));
}

TEST_F(TokenAuthTest, FromFileNamesAFileItCannotRead) {
  const std::string path = certs().Path("no_such_token");
  EXPECT_THAT(TokenAuth::FromFile(path),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("--auth_token_file"), HasSubstr(path))));
}

TEST(TokenAuthFromTokenTest, RejectsInnerWhitespaceAndControlCharacters) {
  EXPECT_THAT(TokenAuth::FromToken("two words"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("whitespace")));
  EXPECT_THAT(TokenAuth::FromToken("bell\a"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("control")));
}

TEST(TokenAuthFromTokenTest, RejectsBytesOutsideAsciiNoClientCanSend) {
  EXPECT_THAT(TokenAuth::FromToken("t\xc3\xb6k"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outside ASCII")));
}

class CheckAuthorizationValueTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TokenAuth>> auth = TokenAuth::FromToken("s3cret");
    ASSERT_THAT(auth, IsOk());
    auth_ = *std::move(auth);
  }
  absl::Status Check(const std::string& value) { return auth_->CheckAuthorizationValue(value); }

  std::unique_ptr<TokenAuth> auth_;
};

TEST_F(CheckAuthorizationValueTest, AcceptsTheTokenWithAnyCaseOfScheme) {
  EXPECT_THAT(Check("Bearer s3cret"), IsOk());
  EXPECT_THAT(Check("bearer s3cret"), IsOk());
  EXPECT_THAT(Check("BEARER   s3cret"), IsOk());
}

TEST_F(CheckAuthorizationValueTest, RejectsOtherTokens) {
  for (const char* value : {"Bearer s3creT", "Bearer s3cre", "Bearer s3crett", "Bearer ",
                            "Bearer x", "Bearer s3cret s3cret"}) {
    EXPECT_THAT(Check(value),
                StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("invalid bearer token")))
        << value;
  }
}

TEST_F(CheckAuthorizationValueTest, RejectsOtherSchemes) {
  for (const char* value : {"Basic s3cret", "s3cret", "", "Bearers3cret", "Token s3cret"}) {
    EXPECT_THAT(Check(value), StatusIs(absl::StatusCode::kUnauthenticated,
                                       HasSubstr("invalid bearer token: the authorization scheme")))
        << value;
  }
}

TEST(ConstantTimeEqualsTest, ComparesWholeStrings) {
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "ab"));
  EXPECT_FALSE(ConstantTimeEquals("ab", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("", "a"));
  // A shorter string padded with NULs must not equal the longer one.
  EXPECT_FALSE(ConstantTimeEquals(absl::string_view("ab\0", 3), "ab"));
}

// --- MakeServerCredentials --------------------------------------------------------

using MakeServerCredentialsTest = CertsSuite;

TEST_F(MakeServerCredentialsTest, NoCertificateIsPlaintext) {
  EXPECT_THAT(MakeServerCredentials("", "", ""), IsOkAndHolds(NotNull()));
}

TEST_F(MakeServerCredentialsTest, CertificateAndKeyMakeTls) {
  EXPECT_THAT(MakeServerCredentials(certs().server_cert(), certs().server_key(), ""),
              IsOkAndHolds(NotNull()));
  EXPECT_THAT(MakeServerCredentials(certs().server_cert(), certs().server_key(), certs().ca_cert()),
              IsOkAndHolds(NotNull()));
}

TEST_F(MakeServerCredentialsTest, NeedsBothCertificateAndKey) {
  EXPECT_THAT(MakeServerCredentials(certs().server_cert(), "", ""),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--tls_cert is set but --tls_key is not")));
  EXPECT_THAT(MakeServerCredentials("", certs().server_key(), ""),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--tls_key is set but --tls_cert is not")));
  EXPECT_THAT(MakeServerCredentials("", "", certs().ca_cert()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--tls_client_ca needs --tls_cert and --tls_key")));
}

TEST_F(MakeServerCredentialsTest, NamesTheFlagAndFileItCannotRead) {
  const std::string missing = certs().Path("missing.pem");
  EXPECT_THAT(MakeServerCredentials(missing, certs().server_key(), ""),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("--tls_cert: cannot read"), HasSubstr(missing))));
  EXPECT_THAT(MakeServerCredentials(certs().server_cert(), missing, ""),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("--tls_key: cannot read"), HasSubstr(missing))));
  EXPECT_THAT(MakeServerCredentials(certs().server_cert(), certs().server_key(), missing),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("--tls_client_ca: cannot read"), HasSubstr(missing))));
}

TEST_F(MakeServerCredentialsTest, RejectsFilesThatAreNotWhatTheFlagWants) {
  const std::string garbage = WriteFile("garbage.pem", "not a certificate\n");
  EXPECT_THAT(MakeServerCredentials(certs().server_key(), certs().server_key(), ""),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("--tls_cert"), HasSubstr("no PEM certificate"))));
  EXPECT_THAT(MakeServerCredentials(certs().server_cert(), certs().server_cert(), ""),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("--tls_key"), HasSubstr("no unencrypted PEM private key"))));
  EXPECT_THAT(MakeServerCredentials(certs().server_cert(), certs().server_key(), garbage),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("--tls_client_ca"), HasSubstr(garbage))));
}

TEST_F(MakeServerCredentialsTest, RejectsAKeyOfAnotherCertificate) {
  EXPECT_THAT(MakeServerCredentials(certs().server_cert(), certs().client_key(), ""),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(certs().client_key()), HasSubstr("is not the key of"),
                             HasSubstr(certs().server_cert()))));
}

// Runs `command` (shell words) with openssl in the certificates' folder;
// `made` is its output file there.
void MakeWithOpenssl(const TlsCerts& certs, const std::string& command) {
  const std::string line =
      absl::StrCat("cd '", certs.dir(), "' && openssl ", command, " > openssl_extra.log 2>&1");
  ASSERT_EQ(std::system(line.c_str()), 0) << line;
}

TEST_F(MakeServerCredentialsTest, RejectsAnExpiredCertificate) {
  // Served, it failed every handshake while the server looked healthy.
  const std::string expired = certs().Path("expired.pem");
  MakeWithOpenssl(certs(),
                  "x509 -req -in server.csr -CA ca.pem -CAkey ca.key -set_serial 9 -days -1 "
                  "-out expired.pem");
  EXPECT_THAT(MakeServerCredentials(expired, certs().server_key(), ""),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(absl::StrCat("--tls_cert: ", expired, " expired on ")),
                             HasSubstr(" UTC; the peer refuses it"))));
}

// The client's own files, checked when it is made: gRPC failed every call
// with them "UNAVAILABLE: empty address list" (a CA file holding a key, a
// key of another certificate, an encrypted key), or every handshake (an
// expired client certificate: the server closes the connection).
using ClientTlsFilesTest = CertsSuite;

TEST_F(ClientTlsFilesTest, FilesGrpcCannotUseAreRefusedNamingThem) {
  MakeWithOpenssl(certs(), "pkey -in client.key -aes256 -passout pass:x -out encrypted.key");
  MakeWithOpenssl(certs(),
                  "x509 -req -in client.csr -CA ca.pem -CAkey ca.key -set_serial 10 -days -1 "
                  "-out client_expired.pem");
  const auto refused = [](client::ClientOptions options, const std::string& text) {
    options.target = "127.0.0.1:1";
    EXPECT_THAT(client::AttentionClient::Create(options),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(text)));
  };
  client::ClientOptions options;
  options.tls_ca_file = certs().server_key();
  refused(options, absl::StrCat("tls_ca_file: ", certs().server_key(),
                                " holds no PEM certificate (BEGIN CERTIFICATE)"));
  options.tls_ca_file = certs().ca_cert();
  options.tls_cert_file = certs().client_cert();
  options.tls_key_file = certs().stranger_key();
  refused(options, absl::StrCat("tls_key_file: ", certs().stranger_key(),
                                " is not the key of the certificate in tls_cert_file ",
                                certs().client_cert()));
  options.tls_key_file = certs().Path("encrypted.key");
  refused(options, "encrypted.key holds no unencrypted PEM private key");
  options.tls_cert_file = certs().client_key();
  options.tls_key_file = certs().client_key();
  refused(options, absl::StrCat("tls_cert_file: ", certs().client_key(), " holds no PEM certificate"));
  options.tls_cert_file = certs().Path("client_expired.pem");
  refused(options, "client_expired.pem expired on ");
  options.tls_cert_file = certs().client_cert();
  options.target = "127.0.0.1:1";
  EXPECT_THAT(client::AttentionClient::Create(options), IsOk());
}

// --- End to end: a gRPC server with these credentials and TokenAuth ------------------

// GetServerInfo only: checks the token when there is a TokenAuth, the way the
// real service's handlers do.
class AuthCheckingService final : public v1::AttentionService::CallbackService {
 public:
  explicit AuthCheckingService(const TokenAuth* auth) : auth_(auth) {}

  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const v1::GetServerInfoRequest*,
                                          v1::ServerInfo* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    const absl::Status status = auth_ == nullptr ? absl::OkStatus() : auth_->Check(*context);
    if (!status.ok()) {
      reactor->Finish(grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                                   std::string(status.message())));
      return reactor;
    }
    response->set_version("tls-test");
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  const TokenAuth* const auth_;
};

// A gRPC server on 127.0.0.1:0 with grpc.health.v1 and AuthCheckingService.
class SecureTestServer {
 public:
  static absl::StatusOr<std::unique_ptr<SecureTestServer>> Start(
      std::shared_ptr<grpc::ServerCredentials> credentials, const TokenAuth* auth = nullptr) {
    grpc::EnableDefaultHealthCheckService(true);
    auto server = std::unique_ptr<SecureTestServer>(new SecureTestServer(auth));
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", std::move(credentials), &server->port_);
    builder.RegisterService(&server->service_);
    server->server_ = builder.BuildAndStart();
    if (server->server_ == nullptr || server->port_ == 0) {
      return absl::UnavailableError("test server did not start");
    }
    return server;
  }

  ~SecureTestServer() {
    if (server_ != nullptr) server_->Shutdown();
  }

  int port() const { return port_; }

 private:
  explicit SecureTestServer(const TokenAuth* auth) : service_(auth) {}

  AuthCheckingService service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

class TlsEndToEndTest : public CertsSuite {
 protected:
  // Starts a server with MakeServerCredentials(server cert, key, client_ca).
  void StartServer(const std::string& client_ca = "", const TokenAuth* auth = nullptr) {
    absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
        MakeServerCredentials(certs().server_cert(), certs().server_key(), client_ca);
    ASSERT_THAT(credentials, IsOk());
    absl::StatusOr<std::unique_ptr<SecureTestServer>> server =
        SecureTestServer::Start(*std::move(credentials), auth);
    ASSERT_THAT(server, IsOk());
    server_ = *std::move(server);
  }

  // Client options for the server, trusting the test CA.
  client::ClientOptions TlsOptions() const {
    client::ClientOptions options;
    options.target = "127.0.0.1:" + std::to_string(server_->port());
    options.tls_ca_file = certs().ca_cert();
    options.timeout = absl::Seconds(20);
    return options;
  }

  static absl::StatusOr<std::string> Health(const client::ClientOptions& options) {
    absl::StatusOr<std::unique_ptr<client::AttentionClient>> client =
        client::AttentionClient::Create(options);
    if (!client.ok()) return client.status();
    return (*client)->Health();
  }

  static absl::StatusOr<std::string> ServerVersion(const client::ClientOptions& options) {
    absl::StatusOr<std::unique_ptr<client::AttentionClient>> client =
        client::AttentionClient::Create(options);
    if (!client.ok()) return client.status();
    absl::StatusOr<v1::ServerInfo> info = (*client)->GetServerInfo();
    if (!info.ok()) return info.status();
    return info->version();
  }

  std::unique_ptr<SecureTestServer> server_;
};

TEST_F(TlsEndToEndTest, ClientTrustingTheCaConnects) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  EXPECT_THAT(Health(TlsOptions()), IsOkAndHolds("SERVING"));
  EXPECT_THAT(ServerVersion(TlsOptions()), IsOkAndHolds("tls-test"));
  // The DNS name, without resolving "localhost" (c-ares leaks under ASan).
  client::ClientOptions by_name = TlsOptions();
  by_name.tls_server_name_override = "localhost";
  EXPECT_THAT(Health(by_name), IsOkAndHolds("SERVING"));
}

TEST_F(TlsEndToEndTest, ServerNameOverrideMustMatchTheCertificate) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  client::ClientOptions options = TlsOptions();
  options.tls_server_name_override = "attention.test";
  EXPECT_THAT(Health(options), IsOkAndHolds("SERVING"));
  options.tls_server_name_override = "other.test";
  EXPECT_THAT(Health(options), StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
}

TEST_F(TlsEndToEndTest, PlaintextAndUntrustingClientsAreRefused) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  client::ClientOptions plaintext = TlsOptions();
  plaintext.tls_ca_file.clear();
  // gRPC says only "Socket closed"; the client says what could be why.
  EXPECT_THAT(Health(plaintext),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("Socket closed"),
                             HasSubstr("closes plaintext connections: if this one does, set "
                                       "tls_ca_file (attention_cli: --tls_ca)"))));
  client::ClientOptions other_ca = TlsOptions();
  other_ca.tls_ca_file = certs().other_ca_cert();
  EXPECT_THAT(Health(other_ca), StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
}

TEST_F(TlsEndToEndTest, MutualTlsNeedsAClientCertificateTheCaSigned) {
  ASSERT_NO_FATAL_FAILURE(StartServer(certs().ca_cert()));
  EXPECT_THAT(Health(TlsOptions()),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("Socket closed"),
                             HasSubstr("requires client certificates (mTLS) closes the connection "
                                       "of a client without one: if this one does, set "
                                       "tls_cert_file and tls_key_file"))));

  client::ClientOptions stranger = TlsOptions();
  stranger.tls_cert_file = certs().stranger_cert();
  stranger.tls_key_file = certs().stranger_key();
  EXPECT_THAT(Health(stranger),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("whose certificate its --tls_client_ca did not sign: check "
                                 "tls_cert_file")));

  client::ClientOptions known = TlsOptions();
  known.tls_cert_file = certs().client_cert();
  known.tls_key_file = certs().client_key();
  EXPECT_THAT(Health(known), IsOkAndHolds("SERVING"));
  EXPECT_THAT(ServerVersion(known), IsOkAndHolds("tls-test"));
}

TEST_F(TlsEndToEndTest, TokenAuthChecksCallMetadata) {
  absl::StatusOr<std::unique_ptr<TokenAuth>> auth = TokenAuth::FromToken("s3cret");
  ASSERT_THAT(auth, IsOk());
  ASSERT_NO_FATAL_FAILURE(StartServer("", auth->get()));

  client::ClientOptions options = TlsOptions();
  EXPECT_THAT(ServerVersion(options), StatusIs(absl::StatusCode::kUnauthenticated,
                                               HasSubstr("missing authorization metadata")));
  options.bearer_token = "wrong";
  EXPECT_THAT(ServerVersion(options),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("invalid bearer token")));
  options.bearer_token = "s3cret";
  EXPECT_THAT(ServerVersion(options), IsOkAndHolds("tls-test"));
  // Health is not behind the token: probes carry no secrets.
  options.bearer_token.clear();
  EXPECT_THAT(Health(options), IsOkAndHolds("SERVING"));
}

TEST_F(TlsEndToEndTest, ClientRejectsHalfAClientCertificateAndUnreadableFiles) {
  client::ClientOptions options;
  options.tls_cert_file = certs().client_cert();
  EXPECT_THAT(client::AttentionClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tls_cert_file is set but tls_key_file is not")));
  options = client::ClientOptions();
  options.tls_ca_file = certs().Path("missing_ca.pem");
  EXPECT_THAT(client::AttentionClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tls_ca_file: cannot read"), HasSubstr("missing_ca.pem"))));
}

}  // namespace
}  // namespace attention::server
