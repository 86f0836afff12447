#ifndef ATTENTION_CLIENT_LOADTEST_LOADTEST_H_
#define ATTENTION_CLIENT_LOADTEST_LOADTEST_H_

// attention_loadtest from its parsed command line to its exit code. The
// binary's main() only turns flags into a LoadtestConfig, so tests run the
// same code.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "client/attention_client.h"
#include "client/loadtest/workload.h"

namespace attention::loadtest {

struct LoadtestConfig {
  std::vector<std::string> targets = {"127.0.0.1:50051"};
  int connections = 1;
  int threads = 1;
  // "grpc", "h2" (RunOptions::transport), or "auto": h2 when it can carry
  // the run (ResolveTransport), else grpc.
  std::string transport = "auto";

  // The load: at most one of concurrency (closed loop), rate (open loop) and
  // schedule; none means concurrency 1.
  int64_t concurrency = 0;
  double rate = 0;
  std::string schedule;
  std::string arrival = "constant";
  int64_t max_in_flight = 0;
  // How long the measurement lasts; unset means 10s, or until `requests`
  // when that is set, or the schedule's length.
  std::optional<absl::Duration> duration;
  int64_t requests = 0;
  absl::Duration warmup;
  absl::Duration timeout = absl::Seconds(10);
  absl::Duration connect_timeout = absl::Seconds(10);
  bool stream = false;

  // Sessions instead of the load above (sessions.h): `sessions` decoders,
  // each creating its session with `prefill` rows (the shape's query length
  // is ignored), making `steps` one-row steps, and closing it. The cache is
  // stored as `session_dtype` ("float32" or "bfloat16"); with
  // session_keep_rows, lost sessions are recreated from the rows kept.
  int64_t sessions = 0;
  int64_t prefill = 128;
  int64_t steps = 128;
  std::string session_dtype = "float32";
  bool session_keep_rows = true;

  // The request: a JSON file, or one built from `shape` with `mask` and
  // `dtype` by name.
  std::string request_file;
  ShapeOptions shape;
  std::string mask = "none";
  std::string dtype = "float32";
  bool verify = false;
  std::string expected_file;  // implies verify
  double verify_atol = 1e-4;
  double verify_rtol = 1e-3;

  std::string json_file;
  std::string csv_file;  // a row per run, appended under the header
  std::string histogram_log_file;
  std::string html_file;  // html_report.h's page; written for failed runs too
  std::vector<std::string> thresholds;
  bool progress = false;  // the live line on `err`
  absl::Duration progress_interval = absl::Seconds(1);

  // Token, TLS and message size; its target and timeout are not used.
  client::ClientOptions client;
};

// The transport "auto" stands for: h2 for unary calls in plaintext to
// targets that are all HOST:PORT, with a request (serialized) of at most
// kMaxH2AutoRequestBytes; else grpc. Other values are returned as they are.
// h2 copies a message's bytes twice more than gRPC's client does: for small
// calls its per-call savings win (a third of the CPU), for a 768 KiB
// request it costs 1.2 times grpc's CPU per call.
inline constexpr size_t kMaxH2AutoRequestBytes = 64 << 10;
std::string ResolveTransport(const LoadtestConfig& config, size_t request_bytes);

// Runs the load test `config` describes: prints the summary on `out`, writes
// the files asked for, and returns kExitOk, kExitThreshold (a threshold
// broke; the summary says which) or kExitSetup (one line "error: ..." on
// `err`: a bad option, an unknown model, an unreachable target, a file that
// cannot be read or written). `interrupted` (may be null) stops the run early.
int RunLoadtest(const LoadtestConfig& config, std::ostream& out, std::ostream& err,
                const std::atomic<bool>* interrupted = nullptr);

// attention_loadtest merge: adds up the histogram logs in `files` and reports
// them as one run made by load testers side by side, with config's outputs
// and thresholds. Exit codes as RunLoadtest's.
int RunMerge(const std::vector<std::string>& files, const LoadtestConfig& config, std::ostream& out,
             std::ostream& err);

// attention_loadtest report: the HTML page (config.html_file) of the runs
// whose --json reports are `files`, overlaid, each labelled by its file.
// kExitOk, or kExitSetup (one line "error: ..." on `err`) when --html is not
// given or a file cannot be read, is not such a report, or cannot be written.
int RunHtmlReport(const std::vector<std::string>& files, const LoadtestConfig& config,
                  std::ostream& out, std::ostream& err);

}  // namespace attention::loadtest

#endif  // ATTENTION_CLIENT_LOADTEST_LOADTEST_H_
