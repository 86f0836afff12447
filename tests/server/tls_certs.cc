#include "tests/server/tls_certs.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace attention::testing {
namespace {

// openssl's config: no distinguished-name prompts, and the extensions each
// kind of certificate needs (gRPC checks the SAN and key usages).
constexpr char kConfig[] = R"([req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca_ext]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost,DNS:attention.test,IP:127.0.0.1,IP:::1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
[client_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
)";

// Runs in the folder: ca NAME CN; leaf NAME CN CA SERIAL EXTENSIONS.
constexpr char kScript[] = R"(set -eu
key="-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes"
ca() {
  openssl req -x509 -config openssl.cnf -extensions ca_ext $key -days 2 \
    -subj "/CN=$2" -keyout "$1.key" -out "$1.pem"
}
leaf() {
  openssl req -new -config openssl.cnf $key -subj "/CN=$2" -keyout "$1.key" -out "$1.csr"
  openssl x509 -req -in "$1.csr" -CA "$3.pem" -CAkey "$3.key" -set_serial "$4" -days 2 \
    -extfile openssl.cnf -extensions "$5" -out "$1.pem"
}
ca ca "attention test CA"
ca other_ca "attention other CA"
leaf server localhost ca 2 server_ext
leaf client "attention test client" ca 3 client_ext
leaf stranger "attention stranger" other_ca 4 client_ext
)";

absl::Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  if (!out.flush()) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TlsCerts>> TlsCerts::Generate() {
  std::string pattern = (std::filesystem::temp_directory_path() / "attention-tls-XXXXXX").string();
  std::vector<char> buffer(pattern.begin(), pattern.end());
  buffer.push_back('\0');
  if (mkdtemp(buffer.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp ", pattern, " failed"));
  }
  std::unique_ptr<TlsCerts> certs(new TlsCerts(buffer.data()));
  if (absl::Status s = WriteText(certs->Path("openssl.cnf"), kConfig); !s.ok()) return s;
  if (absl::Status s = WriteText(certs->Path("make_certs.sh"), kScript); !s.ok()) return s;
  const std::string command =
      absl::StrCat("cd '", certs->dir(), "' && sh make_certs.sh > openssl.log 2>&1");
  if (std::system(command.c_str()) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("making test certificates with openssl failed (is it installed?): ",
                     ReadFileOrEmpty(certs->Path("openssl.log"))));
  }
  return certs;
}

TlsCerts::~TlsCerts() {
  std::error_code ignored;
  std::filesystem::remove_all(dir_, ignored);
}

}  // namespace attention::testing
