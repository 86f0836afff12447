#include <iostream>
#include <string>
#include <vector>

#include "client/cli.h"

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  return attention::client::RunCli(args, std::cin, std::cout, std::cerr);
}
