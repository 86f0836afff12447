#ifndef ATTENTION_SERVER_SECURITY_H_
#define ATTENTION_SERVER_SECURITY_H_

// TLS server credentials and bearer-token authentication, both optional.

#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace grpc {
class ServerContextBase;
class ServerCredentials;
}  // namespace grpc

namespace attention::server {

// Credentials for ServerBuilder::AddListeningPort from the --tls_cert,
// --tls_key and --tls_client_ca flags (PEM file paths):
//   cert and key empty           plaintext (InsecureServerCredentials)
//   cert and key                 TLS
//   cert, key and client_ca      mutual TLS: clients must present a certificate
//                                signed by a CA in client_ca_file
// The files are read and checked now: INVALID_ARGUMENT naming the flag and the
// file when only one of cert and key is given, client_ca is given without
// them, a file cannot be read, holds no PEM certificate / private key, or the
// key does not belong to the certificate.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const std::string& cert_file, const std::string& key_file, const std::string& client_ca_file);

// Checks "authorization: Bearer <token>" call metadata against one secret
// token. Comparison time does not depend on where the tokens differ.
// Immutable, so thread-safe.
class TokenAuth {
 public:
  // The token is the file's contents without leading and trailing whitespace.
  // INVALID_ARGUMENT naming --auth_token_file and the path when the file cannot
  // be read, is empty, or the token has inner whitespace or control characters.
  static absl::StatusOr<std::unique_ptr<TokenAuth>> FromFile(const std::string& path);
  // As FromFile, for a token given directly (`source` names it in errors).
  static absl::StatusOr<std::unique_ptr<TokenAuth>> FromToken(absl::string_view token,
                                                              absl::string_view source = "token");

  TokenAuth(const TokenAuth&) = delete;
  TokenAuth& operator=(const TokenAuth&) = delete;

  // OK when the call's "authorization" metadata carries the token; otherwise
  // UNAUTHENTICATED "missing authorization metadata" or "invalid bearer token".
  absl::Status Check(const grpc::ServerContextBase& context) const;
  // The same for one metadata value: "Bearer <token>", the scheme in any case,
  // spaces allowed between scheme and token.
  absl::Status CheckAuthorizationValue(absl::string_view header_value) const;

 private:
  explicit TokenAuth(std::string token) : token_(std::move(token)) {}
  const std::string token_;
};

// True when `a` and `b` are equal, in time that depends only on their lengths.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_SECURITY_H_
