#ifndef ATTENTION_COMMON_TLS_FILES_H_
#define ATTENTION_COMMON_TLS_FILES_H_

// Checks of the PEM files TLS is given, made when a server starts or a client
// is created: gRPC reports a file it cannot use only as a failed handshake or
// connection ("empty address list"), naming neither the file nor why. Each
// error is INVALID_ARGUMENT naming the option (a flag, or a ClientOptions
// field) and the file.

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace attention {

// One option's file: its name ("--tls_cert", "tls_cert_file"), its path,
// and what it holds.
struct PemFile {
  absl::string_view option;
  absl::string_view path;
  const std::string& pem;
};

// `file` holds a certificate: "<option>: <path> holds no PEM certificate".
absl::Status CheckHoldsCertificate(const PemFile& file);

// `key` holds an unencrypted private key, and it is the key of the first
// certificate in `cert`, which has not expired.
absl::Status CheckKeyPair(const PemFile& cert, const PemFile& key);

}  // namespace attention

#endif  // ATTENTION_COMMON_TLS_FILES_H_
