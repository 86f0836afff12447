// attention_loadtest: load tests an attention service. docs/loadtest.md;
// --help lists the flags. main() only turns flags into a LoadtestConfig.

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdint>
#include <iostream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/attention_client.h"
#include "client/loadtest/loadtest.h"
#include "client/loadtest/thresholds.h"
#include "common/client_process.h"
#include "common/flags_help.h"

ABSL_FLAG(std::vector<std::string>, target, std::vector<std::string>({"127.0.0.1:50051"}),
          "HOST:PORT, dns:///NAME:PORT or any gRPC target; repeat the flag for several, which "
          "calls go to round-robin");
ABSL_FLAG(int, connections, 1, "Channels, each its own TCP connection, to each target");
ABSL_FLAG(int, threads, 1, "Threads polling for answers (--transport grpc)");
ABSL_FLAG(std::string, transport, "auto",
          "h2: gRPC's wire protocol over HTTP/2 by nghttp2 on one thread, a third to three "
          "fifths of grpc's CPU per call; plaintext unary calls to HOST:PORT targets, no "
          "retries. grpc: gRPC's C++ client (streams, TLS, dns:/// and other gRPC targets, "
          "--max_attempts). auto: h2 when it can carry the run and the request is at most "
          "64 KiB, else grpc");
ABSL_FLAG(int64_t, concurrency, 0,
          "Closed loop: calls in flight, each sent when the previous one returns (default 1 "
          "when neither --rate nor --schedule is given)");
ABSL_FLAG(double, rate, 0,
          "Open loop: calls per second, sent on schedule whatever the answers do; latency is "
          "measured from each call's intended send time");
ABSL_FLAG(std::string, arrival, "constant",
          "Open loops: constant (evenly spaced sends) or poisson (exponential gaps, seeded by "
          "--seed)");
ABSL_FLAG(std::string, schedule, "",
          "Steps and ramps instead of --rate or --concurrency: KIND:PHASE,... with KIND rate or "
          "concurrency and PHASE VALUE@DURATION (hold) or FROM..TO@DURATION (linear ramp), e.g. "
          "rate:100@5s,100..1000@20s,1000@10s");
ABSL_FLAG(int64_t, max_in_flight, 0,
          "Open loops: at most this many calls unanswered; a send that finds them all busy waits, "
          "late (wrk2's connections). 0: no limit");
ABSL_FLAG(std::optional<absl::Duration>, duration, std::nullopt,
          "How long to measure, after --warmup (default 10s; with --requests, until they are "
          "sent)");
ABSL_FLAG(int64_t, requests, 0, "Measured calls to send; 0: no limit");
ABSL_FLAG(absl::Duration, warmup, absl::ZeroDuration(),
          "Load at the schedule's first value before the measurement, not counted");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10), "Deadline of each call; 0 for none");
ABSL_FLAG(absl::Duration, connect_timeout, absl::Seconds(10),
          "How long each connection may take before the run gives up");
ABSL_FLAG(bool, stream, false,
          "Send each call as a message on AttendStream (one stream per connection; with "
          "--sessions, one per decoder) instead of a unary Attend; latency is per message");

ABSL_FLAG(int64_t, sessions, 0,
          "Decoders with sessions instead of --concurrency, --rate or --schedule: N decoders, "
          "each on its own thread, create a session with --prefill rows, make --steps one-row "
          "steps and close it; 0: no sessions");
ABSL_FLAG(int64_t, prefill, 128, "--sessions: rows each session is created with");
ABSL_FLAG(int64_t, steps, 128, "--sessions: one-row steps each decoder makes after its prefill");
ABSL_FLAG(std::string, session_dtype, "float32",
          "--sessions: how the server stores the cached rows, float32 or bfloat16");
ABSL_FLAG(bool, session_keep_rows, true,
          "--sessions: keep every row sent and recreate a session the server lost (NOT_FOUND) "
          "from them; false ends a decoder whose session is lost");

ABSL_FLAG(std::string, model, "", "A registered model to call; empty for raw attention");
ABSL_FLAG(std::string, request, "",
          "An AttendRequest in protobuf's JSON mapping to send instead of one built from the "
          "shape flags");
ABSL_FLAG(int64_t, batch, 1, "B: batch size");
ABSL_FLAG(int64_t, seq_len, 16, "L: query length");
ABSL_FLAG(int64_t, kv_len, 0, "S: key and value length; 0 means L");
ABSL_FLAG(int64_t, embed_dim, 0, "E: query features; 0 means the model's, or 64");
ABSL_FLAG(int64_t, heads, 1, "Raw attention: heads the features are split into");
ABSL_FLAG(int64_t, kv_heads, 0,
          "Raw attention: send rank 4, query [B, heads, L, E/heads] and key and value "
          "[B, kv_heads, S, E/heads] (fewer than --heads: grouped-query); 0: rank 3");
ABSL_FLAG(std::string, mask, "none",
          "none, causal, causal_bottom_right, valid_lens, key_padding or attn_mask");
ABSL_FLAG(std::string, dtype, "float32", "Inputs and outputs: float32, bfloat16 or float16");
ABSL_FLAG(bool, need_weights, false, "Ask for the attention weights too");
ABSL_FLAG(uint64_t, seed, 1, "Seeds the request's data and masks and Poisson arrivals");
ABSL_FLAG(bool, verify, false,
          "Check every answer: shapes, byte counts, finite values (and --expected's values)");
ABSL_FLAG(std::string, expected, "",
          "An AttendResponse in JSON that every answer must match (implies --verify)");
ABSL_FLAG(double, verify_atol, 1e-4, "--expected: absolute tolerance");
ABSL_FLAG(double, verify_rtol, 1e-3, "--expected: tolerance relative to the expected value");

ABSL_FLAG(std::string, json, "", "Write the results as JSON to this file");
ABSL_FLAG(std::string, html, "",
          "Write the report as one self-contained HTML page with charts to this file; "
          "`attention_loadtest report RUN.json... --html FILE` makes one from --json reports");
ABSL_FLAG(std::string, csv, "",
          "Append a row of results to this CSV file (writing the header if it is new)");
ABSL_FLAG(std::string, histogram_log, "",
          "Write the histograms and counts to this file; `attention_loadtest merge FILE...` "
          "adds such logs up");
ABSL_FLAG(std::vector<std::string>, threshold, {},
          "A gate such as p99<20ms, p99.9<=50ms, max<1s, errors<0.1%, errors<5 or rps>1000; "
          "repeat the flag (or separate with commas) for several. A broken one makes the exit "
          "code 2");
ABSL_FLAG(std::optional<bool>, progress, std::nullopt,
          "Draw a live progress line on stderr: true or false; unset draws it when stderr is a "
          "terminal");

ABSL_FLAG(std::string, token, "", "Send \"authorization: Bearer TOKEN\"");
ABSL_FLAG(std::string, token_file, "",
          "Send the token in this file (surrounding whitespace removed): unlike --token, kept "
          "out of the process list");
ABSL_FLAG(std::string, tls_ca, "", "Use TLS, trusting the CA certificates in this PEM file");
ABSL_FLAG(std::string, tls_cert, "", "With --tls_key: present this client certificate (PEM)");
ABSL_FLAG(std::string, tls_key, "", "The private key of --tls_cert (PEM)");
ABSL_FLAG(std::string, tls_server_name, "", "Expect the server's certificate to name this");
ABSL_FLAG(int64_t, max_message_mb, 256, "Largest message sent or received");
ABSL_FLAG(int, max_attempts, attention::client::ClientOptions().max_attempts,
          "Attempts per call, retries of UNAVAILABLE included (gRPC's retry policy, 0.1s to 1s "
          "apart); 1 turns retries off, at most 5. An error counts once, after the last attempt");
ABSL_FLAG(absl::Duration, reconnect_backoff_max,
          attention::client::ClientOptions().reconnect_backoff_max,
          "Longest wait between attempts to reconnect to a target that is down (from 100ms, "
          "x1.6 per failure)");

namespace {

constexpr char kUsage[] = R"(load tests an attention service.

  attention_loadtest [--target HOST:PORT]... [--concurrency N | --rate R | --schedule S]
                     [--duration 10s | --requests N] [--model NAME | shape flags | --request FILE]
                     [--json FILE] [--html FILE] [--csv FILE] [--histogram_log FILE]
                     [--threshold 'p99<20ms']...
  attention_loadtest --sessions N [--prefill P] [--steps T] [--session_dtype bfloat16]
                     [--stream] [--model NAME | shape flags] [--json FILE] [--threshold ...]
  attention_loadtest merge LOG... [--json FILE] [--threshold ...]
  attention_loadtest report RUN.json [RUN2.json...] --html FILE

Exit codes: 0 ok, 1 bad command line or setup failure, 2 a threshold was broken.)";

std::atomic<bool> interrupted{false};

// The first Ctrl-C ends the run and reports; a second one kills.
void OnInterrupt(int /*signal*/) {
  interrupted.store(true);
  std::signal(SIGINT, SIG_DFL);
}

// absl keeps only the last value of a repeated flag, so the occurrences of
// --NAME are taken out of `args` here; with `split_commas` their values are
// split at commas too (targets may not be: "ipv4:HOST:PORT,HOST:PORT" is one).
std::vector<std::string> TakeRepeatedFlag(absl::string_view name, bool split_commas,
                                          std::vector<char*>* args) {
  std::vector<std::string> values;
  std::vector<char*> kept = {args->front()};
  for (size_t i = 1; i < args->size(); ++i) {
    absl::string_view arg = (*args)[i];
    if (arg == "--") {
      kept.insert(kept.end(), args->begin() + i, args->end());
      break;
    }
    absl::string_view body = arg;
    if (!absl::ConsumePrefix(&body, "--")) absl::ConsumePrefix(&body, "-");
    std::optional<absl::string_view> value;
    if (body == name && i + 1 < args->size()) {
      value = (*args)[++i];
    } else if (absl::ConsumePrefix(&body, name) && absl::ConsumePrefix(&body, "=")) {
      value = body;
    }
    if (!value.has_value()) {
      kept.push_back((*args)[i]);
      continue;
    }
    if (!split_commas) {
      values.emplace_back(*value);
      continue;
    }
    for (absl::string_view part : absl::StrSplit(*value, ',', absl::SkipEmpty())) {
      values.emplace_back(part);
    }
  }
  *args = std::move(kept);
  return values;
}

attention::loadtest::LoadtestConfig ConfigFromFlags() {
  attention::loadtest::LoadtestConfig config;
  config.targets = absl::GetFlag(FLAGS_target);
  config.connections = absl::GetFlag(FLAGS_connections);
  config.threads = absl::GetFlag(FLAGS_threads);
  config.transport = absl::GetFlag(FLAGS_transport);
  config.concurrency = absl::GetFlag(FLAGS_concurrency);
  config.rate = absl::GetFlag(FLAGS_rate);
  config.arrival = absl::GetFlag(FLAGS_arrival);
  config.schedule = absl::GetFlag(FLAGS_schedule);
  config.max_in_flight = absl::GetFlag(FLAGS_max_in_flight);
  config.duration = absl::GetFlag(FLAGS_duration);
  config.requests = absl::GetFlag(FLAGS_requests);
  config.warmup = absl::GetFlag(FLAGS_warmup);
  config.timeout = absl::GetFlag(FLAGS_timeout);
  config.connect_timeout = absl::GetFlag(FLAGS_connect_timeout);
  config.stream = absl::GetFlag(FLAGS_stream);
  config.sessions = absl::GetFlag(FLAGS_sessions);
  config.prefill = absl::GetFlag(FLAGS_prefill);
  config.steps = absl::GetFlag(FLAGS_steps);
  config.session_dtype = absl::GetFlag(FLAGS_session_dtype);
  config.session_keep_rows = absl::GetFlag(FLAGS_session_keep_rows);

  config.request_file = absl::GetFlag(FLAGS_request);
  config.shape.model = absl::GetFlag(FLAGS_model);
  config.shape.batch = absl::GetFlag(FLAGS_batch);
  config.shape.query_len = absl::GetFlag(FLAGS_seq_len);
  config.shape.key_len = absl::GetFlag(FLAGS_kv_len);
  config.shape.embed_dim = absl::GetFlag(FLAGS_embed_dim);
  config.shape.heads = absl::GetFlag(FLAGS_heads);
  config.shape.kv_heads = absl::GetFlag(FLAGS_kv_heads);
  config.shape.need_weights = absl::GetFlag(FLAGS_need_weights);
  config.shape.seed = absl::GetFlag(FLAGS_seed);
  config.mask = absl::GetFlag(FLAGS_mask);
  config.dtype = absl::GetFlag(FLAGS_dtype);
  config.verify = absl::GetFlag(FLAGS_verify);
  config.expected_file = absl::GetFlag(FLAGS_expected);
  config.verify_atol = absl::GetFlag(FLAGS_verify_atol);
  config.verify_rtol = absl::GetFlag(FLAGS_verify_rtol);

  config.json_file = absl::GetFlag(FLAGS_json);
  config.csv_file = absl::GetFlag(FLAGS_csv);
  config.html_file = absl::GetFlag(FLAGS_html);
  config.histogram_log_file = absl::GetFlag(FLAGS_histogram_log);
  const std::optional<bool> progress = absl::GetFlag(FLAGS_progress);
  config.progress = progress.has_value() ? *progress : isatty(STDERR_FILENO) == 1;

  config.client.bearer_token = absl::GetFlag(FLAGS_token);
  config.client.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  config.client.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  config.client.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  config.client.tls_server_name_override = absl::GetFlag(FLAGS_tls_server_name);
  config.client.max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  config.client.max_attempts = absl::GetFlag(FLAGS_max_attempts);
  config.client.reconnect_backoff_max = absl::GetFlag(FLAGS_reconnect_backoff_max);
  return config;
}

}  // namespace

int main(int argc, char** argv) {
  attention::SetUpClientProcess();
  // absl::Mutex's deadlock detection (on in Debian's build) keeps a lock graph
  // on every Lock, gRPC's own included: CPU the tester would spend on each call.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  attention::SetUsageAndHelpFile(kUsage, "client/loadtest_main.cc");
  std::vector<char*> args(argv, argv + argc);
  const std::vector<std::string> targets =
      TakeRepeatedFlag("target", /*split_commas=*/false, &args);
  const std::vector<std::string> thresholds =
      TakeRepeatedFlag("threshold", /*split_commas=*/true, &args);
  const std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  attention::loadtest::LoadtestConfig config = ConfigFromFlags();
  absl::StatusOr<std::string> token = attention::client::BearerTokenFromFlags(
      config.client.bearer_token, absl::GetFlag(FLAGS_token_file));
  if (!token.ok()) {
    std::cerr << "error: " << token.status().message() << "\n";
    return attention::loadtest::kExitSetup;
  }
  config.client.bearer_token = *std::move(token);
  if (!targets.empty()) config.targets = targets;
  config.thresholds = thresholds;

  if (positional.size() > 1 && absl::string_view(positional[1]) == "merge") {
    const std::vector<std::string> files(positional.begin() + 2, positional.end());
    return attention::loadtest::RunMerge(files, config, std::cout, std::cerr);
  }
  if (positional.size() > 1 && absl::string_view(positional[1]) == "report") {
    const std::vector<std::string> files(positional.begin() + 2, positional.end());
    return attention::loadtest::RunHtmlReport(files, config, std::cout, std::cerr);
  }
  if (positional.size() > 1) {
    std::cerr
        << "error: unexpected argument \"" << positional[1]
        << "\"; the commands are merge and report. Run 'attention_loadtest --help' for usage.\n";
    return attention::loadtest::kExitSetup;
  }
  std::signal(SIGINT, OnInterrupt);
  return attention::loadtest::RunLoadtest(config, std::cout, std::cerr, &interrupted);
}
