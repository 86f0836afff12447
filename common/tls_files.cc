#include "common/tls_files.h"

#include <openssl/asn1.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <ctime>
#include <memory>

#include "absl/strings/str_cat.h"

namespace attention {
namespace {

struct BioDeleter {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Deleter {
  void operator()(X509* cert) const { X509_free(cert); }
};
struct KeyDeleter {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};
using Certificate = std::unique_ptr<X509, X509Deleter>;
using PrivateKey = std::unique_ptr<EVP_PKEY, KeyDeleter>;

std::unique_ptr<BIO, BioDeleter> MemoryBio(const std::string& pem) {
  return std::unique_ptr<BIO, BioDeleter>(
      BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// Never asks for a passphrase: encrypted keys fail to load.
int NoPassphrase(char*, int, int, void*) { return -1; }

Certificate FirstCertificate(const std::string& pem) {
  auto bio = MemoryBio(pem);
  Certificate cert(PEM_read_bio_X509(bio.get(), nullptr, NoPassphrase, nullptr));
  ERR_clear_error();
  return cert;
}

absl::Status NoCertificate(const PemFile& file) {
  return absl::InvalidArgumentError(
      absl::StrCat(file.option, ": ", file.path, " holds no PEM certificate (BEGIN CERTIFICATE)"));
}

// An expired certificate fails every handshake it is shown in, at the other
// end ("certificate verify failed", or a connection closed), naming nothing.
absl::Status CheckNotExpired(const PemFile& file, const X509& cert) {
  const ASN1_TIME* not_after = X509_get0_notAfter(&cert);
  if (X509_cmp_current_time(not_after) >= 0) return absl::OkStatus();
  std::tm when{};
  char text[32] = "an unreadable date";
  if (ASN1_TIME_to_tm(not_after, &when) == 1) {
    std::strftime(text, sizeof text, "%Y-%m-%d %H:%M:%S UTC", &when);
  }
  ERR_clear_error();
  return absl::InvalidArgumentError(
      absl::StrCat(file.option, ": ", file.path, " expired on ", text, "; the peer refuses it"));
}

}  // namespace

absl::Status CheckHoldsCertificate(const PemFile& file) {
  return FirstCertificate(file.pem) == nullptr ? NoCertificate(file) : absl::OkStatus();
}

absl::Status CheckKeyPair(const PemFile& cert, const PemFile& key) {
  const Certificate certificate = FirstCertificate(cert.pem);
  if (certificate == nullptr) return NoCertificate(cert);
  if (absl::Status valid = CheckNotExpired(cert, *certificate); !valid.ok()) return valid;
  auto bio = MemoryBio(key.pem);
  const PrivateKey private_key(PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassphrase, nullptr));
  ERR_clear_error();
  if (private_key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        key.option, ": ", key.path, " holds no unencrypted PEM private key (BEGIN PRIVATE KEY)"));
  }
  const bool matches = X509_check_private_key(certificate.get(), private_key.get()) == 1;
  ERR_clear_error();
  if (!matches) {
    return absl::InvalidArgumentError(absl::StrCat(key.option, ": ", key.path,
                                                   " is not the key of the certificate in ",
                                                   cert.option, " ", cert.path));
  }
  return absl::OkStatus();
}

}  // namespace attention
