#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "client/cli.h"
#include "grpc/support/log.h"

namespace {

// gRPC's own log lines (a failed handshake logs several) would come before
// the one `error:` line the CLI promises; GRPC_VERBOSITY, when set, keeps them.
void DropGrpcLog(gpr_log_func_args*) {}

}  // namespace

int main(int argc, char** argv) {
  if (std::getenv("GRPC_VERBOSITY") == nullptr) gpr_set_log_function(DropGrpcLog);
  const std::vector<std::string> args(argv + 1, argv + argc);
  return attention::client::RunCli(args, std::cin, std::cout, std::cerr);
}
