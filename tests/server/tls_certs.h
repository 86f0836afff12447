#ifndef ATTENTION_TESTS_SERVER_TLS_CERTS_H_
#define ATTENTION_TESTS_SERVER_TLS_CERTS_H_

// Throwaway TLS certificates for tests, made with the openssl command line.

#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace attention::testing {

// PEM files in a fresh temporary folder, deleted with the object (EC P-256
// keys, valid for two days):
//   ca_cert                 a self-signed test CA
//   server_cert, server_key signed by the CA, for localhost, attention.test,
//                           127.0.0.1 and ::1 (serverAuth)
//   client_cert, client_key signed by the CA (clientAuth), for mTLS
//   other_ca_cert           a second, unrelated CA
//   stranger_cert, stranger_key  a client certificate the second CA signed,
//                           which a server trusting only ca_cert must refuse
class TlsCerts {
 public:
  // FAILED_PRECONDITION when openssl is missing or fails (with its output).
  static absl::StatusOr<std::unique_ptr<TlsCerts>> Generate();

  TlsCerts(const TlsCerts&) = delete;
  TlsCerts& operator=(const TlsCerts&) = delete;
  ~TlsCerts();

  const std::string& dir() const { return dir_; }
  std::string ca_cert() const { return Path("ca.pem"); }
  std::string server_cert() const { return Path("server.pem"); }
  std::string server_key() const { return Path("server.key"); }
  std::string client_cert() const { return Path("client.pem"); }
  std::string client_key() const { return Path("client.key"); }
  std::string other_ca_cert() const { return Path("other_ca.pem"); }
  std::string stranger_cert() const { return Path("stranger.pem"); }
  std::string stranger_key() const { return Path("stranger.key"); }

  // `name` inside dir().
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

 private:
  explicit TlsCerts(std::string dir) : dir_(std::move(dir)) {}
  std::string dir_;
};

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_SERVER_TLS_CERTS_H_
