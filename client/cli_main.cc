#include <iostream>
#include <string>
#include <vector>

#include "client/cli.h"
#include "common/client_process.h"

int main(int argc, char** argv) {
  attention::SetUpClientProcess();
  const std::vector<std::string> args(argv + 1, argv + argc);
  return attention::client::RunCli(args, std::cin, std::cout, std::cerr);
}
