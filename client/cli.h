#ifndef ATTENTION_CLIENT_CLI_H_
#define ATTENTION_CLIENT_CLI_H_

// attention_cli: single calls to an attention service, JSON in and JSON out.
// The binary's main() only forwards to RunCli, so tests run the same code.

#include <iosfwd>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/attention_client.h"

namespace attention::client {

// Exit codes of RunCli.
inline constexpr int kCliOk = 0;
inline constexpr int kCliError = 1;  // the call failed, or health is not SERVING
inline constexpr int kCliUsage = 2;  // the command line is wrong

// One parsed command line.
struct CliCommand {
  // "call", "health", "info", "models", "model", "session" or "close";
  // empty with `help`.
  std::string command;
  // call: the request file, "-" for standard input.
  std::string input = "-";
  // model: the model's name.
  std::string model;
  // session: the one id; close: one or more.
  std::vector<std::string> session_ids;
  // health: the service to check, "" for the whole server.
  std::string service;
  // call: keep output/weights as they came (base64 `data`) instead of `float_data`.
  bool raw = false;
  // call, session, close: the "attention-affinity" metadata; empty: the
  // first session id.
  std::string affinity;
  // --token_file: read into client.bearer_token once the flags are parsed.
  std::string token_file;
  bool help = false;
  ClientOptions client;
};

// Parses `args` (without the program name). Flags may come before or after the
// command, as `--flag value` or `--flag=value`; `--` ends the flags.
// INVALID_ARGUMENT naming the offending argument.
absl::StatusOr<CliCommand> ParseCliArgs(const std::vector<std::string>& args);

// The --help text.
std::string CliUsage();

// The names of the flags RunCli accepts (without "--").
std::vector<std::string> CliFlagNames();

// Runs one command line (without the program name). Reads a `call` request
// from `in` when its input is "-", writes results to `out`, and on failure
// one line "error: CODE: message" to `err`. Returns kCliOk, kCliError or
// kCliUsage.
int RunCli(const std::vector<std::string>& args, std::istream& in, std::ostream& out,
           std::ostream& err);

}  // namespace attention::client

#endif  // ATTENTION_CLIENT_CLI_H_
