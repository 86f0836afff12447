#ifndef ATTENTION_COMMON_CLIENT_PROCESS_H_
#define ATTENTION_COMMON_CLIENT_PROCESS_H_

// What attention_cli and attention_loadtest set first in main.

#include <openssl/crypto.h>

#include <cstdlib>

#include "grpc/support/log.h"

namespace attention {

inline void DropGrpcLog(gpr_log_func_args*) {}

// - OpenSSL without its clean-up at exit: gRPC goes on with connection
//   attempts a little after its channels are gone, and that clean-up freed
//   what a TLS handshake still used; the process ended in a segfault about
//   one exit in 25 after a failed TLS connection. Its memory goes with the
//   process anyway.
// - gRPC's own log lines left out unless GRPC_VERBOSITY is set: a failed
//   handshake or a proxy's 503 page logs an ERROR, which broke into the
//   CLI's one `error:` line and the tester's progress line and summary.
inline void SetUpClientProcess() {
  OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT, nullptr);
  if (std::getenv("GRPC_VERBOSITY") == nullptr) gpr_set_log_function(DropGrpcLog);
}

}  // namespace attention

#endif  // ATTENTION_COMMON_CLIENT_PROCESS_H_
