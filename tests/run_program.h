#ifndef ATTENTION_TESTS_RUN_PROGRAM_H_
#define ATTENTION_TESTS_RUN_PROGRAM_H_

// Running a program from a test and reading what it wrote.

#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace attention::testing {

// The whole of a text file; empty when it cannot be read.
inline std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// What a finished program returned and printed.
struct Outcome {
  int exit_code = -1;  // -1 when it did not exit (a signal)
  std::string out;
  std::string err;
};

// Runs the shell command line `command` with its stdout and stderr going to
// `dir`/out and `dir`/err.
inline Outcome RunCommand(const std::string& command, const std::string& dir) {
  const int status = std::system((command + " >" + dir + "/out 2>" + dir + "/err").c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, ReadWholeFile(dir + "/out"),
          ReadWholeFile(dir + "/err")};
}

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_RUN_PROGRAM_H_
