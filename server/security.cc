#include "server/security.h"


#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "common/tls_files.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/string_ref.h"
#include "server/files.h"

namespace attention::server {
namespace {

constexpr absl::string_view kCertFlag = "--tls_cert";
constexpr absl::string_view kKeyFlag = "--tls_key";
constexpr absl::string_view kClientCaFlag = "--tls_client_ca";
constexpr absl::string_view kTokenFlag = "--auth_token_file";

// The whole of `path`; INVALID_ARGUMENT "<flag>: cannot read <path>: <reason>".
absl::StatusOr<std::string> ReadFlagFile(absl::string_view flag, const std::string& path) {
  absl::StatusOr<std::string> contents = ReadFile(path);
  if (!contents.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read ", contents.status().message()));
  }
  return contents;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const std::string& cert_file, const std::string& key_file, const std::string& client_ca_file) {
  if (cert_file.empty() && key_file.empty()) {
    if (!client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(kClientCaFlag, " needs ", kCertFlag, " and ", kKeyFlag));
    }
    return grpc::InsecureServerCredentials();
  }
  if (cert_file.empty() || key_file.empty()) {
    return absl::InvalidArgumentError(
        cert_file.empty() ? absl::StrCat(kKeyFlag, " is set but ", kCertFlag, " is not")
                          : absl::StrCat(kCertFlag, " is set but ", kKeyFlag, " is not"));
  }
  ATTN_ASSIGN_OR_RETURN(std::string cert_pem, ReadFlagFile(kCertFlag, cert_file));
  ATTN_ASSIGN_OR_RETURN(std::string key_pem, ReadFlagFile(kKeyFlag, key_file));
  ATTN_RETURN_IF_ERROR(
      CheckKeyPair({kCertFlag, cert_file, cert_pem}, {kKeyFlag, key_file, key_pem}));

  grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  if (!client_ca_file.empty()) {
    ATTN_ASSIGN_OR_RETURN(options.pem_root_certs, ReadFlagFile(kClientCaFlag, client_ca_file));
    ATTN_RETURN_IF_ERROR(
        CheckHoldsCertificate({kClientCaFlag, client_ca_file, options.pem_root_certs}));
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  options.pem_key_cert_pairs.push_back({std::move(key_pem), std::move(cert_pem)});
  return grpc::SslServerCredentials(options);
}

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  const size_t length = std::max(a.size(), b.size());
  unsigned char difference = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < length; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    difference |= x ^ y;
  }
  return difference == 0;
}

absl::StatusOr<std::unique_ptr<TokenAuth>> TokenAuth::FromFile(const std::string& path) {
  ATTN_ASSIGN_OR_RETURN(std::string contents, ReadFlagFile(kTokenFlag, path));
  return FromToken(contents, absl::StrCat(kTokenFlag, ": ", path));
}

absl::StatusOr<std::unique_ptr<TokenAuth>> TokenAuth::FromToken(absl::string_view token,
                                                                absl::string_view source) {
  token = absl::StripAsciiWhitespace(token);
  if (token.empty())
    return absl::InvalidArgumentError(absl::StrCat(source, ": the token is empty"));
  for (const char c : token) {
    const unsigned char byte = static_cast<unsigned char>(c);
    if (byte <= ' ' || byte == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat(source,
                       ": the token has whitespace or control characters; gRPC metadata cannot "
                       "carry them"));
    }
    if (byte > 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat(source,
                       ": the token has bytes outside ASCII (UTF-8 text?); gRPC metadata cannot "
                       "carry them, so no client could send it"));
    }
  }
  return std::unique_ptr<TokenAuth>(new TokenAuth(std::string(token)));
}

absl::Status TokenAuth::Check(const grpc::ServerContextBase& context) const {
  const auto& metadata = context.client_metadata();
  const auto it = metadata.find(grpc::string_ref("authorization"));
  if (it == metadata.end()) return absl::UnauthenticatedError("missing authorization metadata");
  return CheckAuthorizationValue(absl::string_view(it->second.data(), it->second.size()));
}

absl::Status TokenAuth::CheckAuthorizationValue(absl::string_view header_value) const {
  const size_t space = header_value.find(' ');
  if (space == absl::string_view::npos ||
      !absl::EqualsIgnoreCase(header_value.substr(0, space), "bearer")) {
    return absl::UnauthenticatedError(
        "invalid bearer token: the authorization scheme is not Bearer");
  }
  if (!ConstantTimeEquals(absl::StripAsciiWhitespace(header_value.substr(space + 1)), token_)) {
    return absl::UnauthenticatedError("invalid bearer token");
  }
  return absl::OkStatus();
}

}  // namespace attention::server
