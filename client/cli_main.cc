#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "client/cli.h"
#include "grpc/support/log.h"
#include "openssl/crypto.h"

namespace {

// gRPC's own log lines (a failed handshake logs several) would come before
// the one `error:` line the CLI promises; GRPC_VERBOSITY, when set, keeps them.
void DropGrpcLog(gpr_log_func_args*) {}

}  // namespace

int main(int argc, char** argv) {
  // gRPC goes on with connection attempts a little after its channels are
  // gone: OpenSSL's own clean-up at exit then freed what a TLS handshake
  // still used, and the process ended in a segfault about one exit in 25
  // after a failed TLS connection. The process's memory goes with it anyway.
  OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT, nullptr);
  if (std::getenv("GRPC_VERBOSITY") == nullptr) gpr_set_log_function(DropGrpcLog);
  const std::vector<std::string> args(argv + 1, argv + argc);
  return attention::client::RunCli(args, std::cin, std::cout, std::cerr);
}
