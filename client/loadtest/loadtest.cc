#include "client/loadtest/loadtest.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/attention_client.h"
#include "client/loadtest/h2_transport.h"
#include "client/loadtest/html_report.h"
#include "client/loadtest/report.h"
#include "client/loadtest/runner.h"
#include "client/loadtest/schedule.h"
#include "client/loadtest/sessions.h"
#include "client/loadtest/stats.h"
#include "client/loadtest/thresholds.h"
#include "client/loadtest/workload.h"
#include "common/status_macros.h"

namespace attention::loadtest {
namespace {

constexpr absl::Duration kDefaultDuration = absl::Seconds(10);

// A flag's number as briefly as it reads back exactly: "1e+12", "100000001",
// "nan" (absl::StrCat keeps 6 digits: 100000001 would read "1e+08").
std::string NumberText(double value) {
  char text[32];
  const auto [end, error] = std::to_chars(text, text + sizeof text, value);
  return error == std::errc() ? std::string(text, end) : absl::StrCat(value);
}

// The measured schedule the load options ask for.
absl::StatusOr<Schedule> MakeSchedule(const LoadtestConfig& config) {
  // --schedule's limits. First: a NaN rate compares false both ways, so it
  // would pass below for no rate at all; an infinite or huge one would queue
  // calls without end.
  if (!std::isfinite(config.rate) || config.rate < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rate ", NumberText(config.rate), " is not a non-negative number"));
  }
  if (config.rate > static_cast<double>(kMaxRate)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rate ", NumberText(config.rate), " is above ", kMaxRate, "/s"));
  }
  if (config.concurrency < 0 || config.concurrency > kMaxConcurrency) {
    return absl::InvalidArgumentError(absl::StrCat("--concurrency is a whole number from 0 to ",
                                                   kMaxConcurrency, ", not ", config.concurrency));
  }
  const int loads = (config.concurrency > 0 ? 1 : 0) + (config.rate > 0 ? 1 : 0) +
                    (config.schedule.empty() ? 0 : 1);
  if (loads > 1) {
    return absl::InvalidArgumentError("give one of --concurrency, --rate and --schedule");
  }
  if (!config.schedule.empty()) {
    if (config.duration.has_value()) {
      return absl::InvalidArgumentError(
          "--duration and --schedule both set the length; the schedule's phases already do");
    }
    return Schedule::Parse(config.schedule);
  }
  absl::Duration length = kDefaultDuration;
  if (config.duration.has_value()) {
    length = *config.duration;
    if (length <= absl::ZeroDuration() || length == absl::InfiniteDuration()) {
      return absl::InvalidArgumentError(absl::StrCat("--duration ", absl::FormatDuration(length),
                                                     " is not a positive, finite duration"));
    }
  } else if (config.requests > 0) {
    length = absl::InfiniteDuration();
  }
  if (config.rate > 0) return Schedule::Constant(LoadKind::kRate, config.rate, length);
  return Schedule::Constant(LoadKind::kConcurrency,
                            static_cast<double>(std::max<int64_t>(config.concurrency, 1)), length);
}

// The mean rate of a rate schedule.
double MeanValue(const Schedule& schedule) {
  double area = 0;
  double seconds = 0;
  for (const Phase& phase : schedule.phases()) {
    if (phase.length == absl::InfiniteDuration()) return phase.from;
    const double length = absl::ToDoubleSeconds(phase.length);
    area += (phase.from + phase.to) / 2 * length;
    seconds += length;
  }
  return seconds > 0 ? area / seconds : 0;
}

std::string ShapeText(const v1::Tensor& tensor) {
  return absl::StrCat("[", absl::StrJoin(tensor.shape(), ", "), "] ",
                      absl::AsciiStrToLower(v1::Tensor::DType_Name(tensor.dtype())));
}

std::string DescribeRequest(const v1::AttendRequest& request, const std::string& file) {
  std::string text = file.empty() ? "" : absl::StrCat(file, ": ");
  if (!request.model().empty()) {
    absl::StrAppend(&text, "model ", request.model());
  } else {
    // Rank 4 carries its heads in its shapes (key omitted: the query's).
    const bool rank4 = request.query().shape_size() == 4;
    const int64_t heads =
        rank4 ? request.query().shape(1) : std::max<int64_t>(1, request.num_heads());
    const int64_t kv_heads = rank4 && request.has_key() ? request.key().shape(1) : heads;
    absl::StrAppend(&text, "raw attention, ", heads, heads > 1 ? " heads" : " head");
    if (kv_heads != heads) absl::StrAppend(&text, " over ", kv_heads, " key/value");
  }
  absl::StrAppend(&text, ", query ", ShapeText(request.query()));
  if (request.has_key()) absl::StrAppend(&text, ", key ", ShapeText(request.key()));
  const v1::Mask& mask = request.mask();
  if (mask.causal() != v1::Mask::NONE) {
    absl::StrAppend(&text, ", causal ", v1::Mask::Causal_Name(mask.causal()));
  }
  if (mask.has_valid_lens()) absl::StrAppend(&text, ", valid_lens");
  if (mask.has_key_padding_mask()) absl::StrAppend(&text, ", key_padding_mask");
  if (mask.has_attn_mask()) absl::StrAppend(&text, ", attn_mask");
  if (request.need_weights()) absl::StrAppend(&text, ", need_weights");
  return text;
}

absl::Status WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file << contents;
  file.close();
  if (!file) return absl::InvalidArgumentError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

// Appends the report's row under the header already in `path`, or writes
// both when the file is new, empty or holds another header. Only a regular
// file is read for its header, and only as far as the header goes: a pipe
// (/dev/stdout under `| tail`) would wait for the tester's own output, and
// /dev/zero or /dev/full never end a line. Anything else gets both.
absl::Status AppendCsv(const std::string& path, const Report& report) {
  const std::string header = CsvHeader();
  std::string first_line;
  std::error_code error;
  if (std::filesystem::is_regular_file(path, error)) {
    std::ifstream existing(path, std::ios::binary);
    first_line.resize(header.size() + 1);
    existing.read(first_line.data(), static_cast<std::streamsize>(first_line.size()));
    first_line.resize(static_cast<size_t>(existing.gcount()));
    if (absl::EndsWith(first_line, "\n")) first_line.pop_back();
  }
  if (first_line != header)
    return WriteFile(path, absl::StrCat(header, "\n", CsvRow(report), "\n"));
  std::ofstream file(path, std::ios::app);
  file << CsvRow(report) << "\n";
  file.close();
  if (!file) return absl::InvalidArgumentError(absl::StrCat("cannot append to ", path));
  return absl::OkStatus();
}

// --html: the page of one run, or of why it failed (`json` empty, `error`
// set).
absl::Status WriteHtml(const std::string& path, std::string json, std::string error) {
  ATTN_ASSIGN_OR_RETURN(const std::string html,
                        FormatHtml({HtmlRun{"run", std::move(json), std::move(error)}}));
  return WriteFile(path, html);
}

// A setup or run failure: the error line, and the page saying so with --html.
int Fail(const LoadtestConfig& config, const absl::Status& status, std::ostream& err) {
  err << "error: " << status.message() << "\n";
  if (!config.html_file.empty()) {
    if (absl::Status written = WriteHtml(config.html_file, "", std::string(status.message()));
        !written.ok()) {
      err << "error: " << written.message() << "\n";
    }
  }
  return kExitSetup;
}

absl::StatusOr<std::vector<Threshold>> ParseThresholds(const std::vector<std::string>& texts) {
  std::vector<Threshold> thresholds;
  for (const std::string& text : texts) {
    ATTN_ASSIGN_OR_RETURN(Threshold threshold, ParseThreshold(text));
    thresholds.push_back(std::move(threshold));
  }
  return thresholds;
}

// Thresholds, the summary and the files; the exit code.
int Conclude(Report& report, const std::vector<Threshold>& thresholds, const LoadtestConfig& config,
             std::ostream& out, std::ostream& err) {
  report.thresholds = EvaluateThresholds(thresholds, report.stats);
  out << FormatSummary(report);
  out.flush();
  absl::Status written = absl::OkStatus();
  if (!out) written = absl::InvalidArgumentError("cannot write the summary to standard output");
  if (!config.json_file.empty()) written.Update(WriteFile(config.json_file, FormatJson(report)));
  if (!config.html_file.empty())
    written.Update(WriteHtml(config.html_file, FormatJson(report), ""));
  if (!config.csv_file.empty()) written.Update(AppendCsv(config.csv_file, report));
  if (!config.histogram_log_file.empty()) {
    written.Update(WriteFile(config.histogram_log_file, report.stats.ToLog()));
  }
  if (!written.ok()) {
    err << "error: " << written.message() << "\n";
    return kExitSetup;
  }
  return ThresholdExitCode(report.thresholds);
}

std::string FormatProgress(const Progress& progress) {
  const double seconds = absl::ToDoubleSeconds(progress.elapsed);
  return absl::StrFormat(
      "[%s %6.1fs] target %.0f  sent %d  done %d  %.0f/s  errors %d  in flight %d  p99 %s",
      progress.warming_up ? "warm-up" : "running", seconds, progress.target, progress.sent,
      progress.completed, progress.rps, progress.errors, progress.in_flight,
      progress.p99_ns > 0 ? FormatLatency(static_cast<double>(progress.p99_ns)) : "-");
}

// Everything before the first call: thresholds, schedule, request, verifier.
struct Prepared {
  std::vector<Threshold> thresholds;
  // Set with --sessions, which runs these instead of `options`.
  std::optional<SessionLoadOptions> sessions;
  RunOptions options;
  v1::AttendRequest request;
  std::optional<Verifier> verifier;
  RunDescription description;
};

absl::StatusOr<v1::ModelConfig> FetchModel(const LoadtestConfig& config, const std::string& model) {
  client::ClientOptions options = config.client;
  options.target = config.targets.front();
  options.timeout = config.connect_timeout;
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<client::AttentionClient> client,
                        client::AttentionClient::Create(options));
  absl::StatusOr<v1::GetModelResponse> response = client->GetModel(model);
  if (!response.ok()) {
    return absl::Status(
        response.status().code(),
        absl::StrCat("model ", model, " on ", options.target, ": ", response.status().message()));
  }
  return response->config();
}

// The flags of other loads that --sessions does not take, when they are set.
absl::Status CheckSessionFlags(const LoadtestConfig& config) {
  const LoadtestConfig defaults;
  std::vector<absl::string_view> set;
  auto check = [&set](bool is_set, absl::string_view flag) {
    if (is_set) set.push_back(flag);
  };
  check(config.concurrency != 0, "--concurrency");
  check(config.rate != 0, "--rate");
  check(!config.schedule.empty(), "--schedule");
  check(config.arrival != defaults.arrival, "--arrival");
  check(config.max_in_flight != 0, "--max_in_flight");
  check(config.duration.has_value(), "--duration");
  check(config.requests != 0, "--requests");
  check(config.warmup != absl::ZeroDuration(), "--warmup");
  check(config.transport == "h2", "--transport h2");
  // Each decoder runs on a thread of its own.
  check(config.threads != defaults.threads, "--threads");
  check(!config.request_file.empty(), "--request");
  check(!config.expected_file.empty(), "--expected");
  check(config.shape.batch != 1, "--batch");
  check(config.shape.key_len != 0, "--kv_len");
  check(config.shape.need_weights, "--need_weights");
  if (set.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--sessions runs decoders of --prefill and --steps calls; it does not take ",
                   absl::StrJoin(set, ", ")));
}

// --sessions: the decoders' requests and options.
absl::Status PrepareSessions(const LoadtestConfig& config, Prepared* prepared) {
  ATTN_RETURN_IF_ERROR(CheckSessionFlags(config));
  if (config.prefill < 1 || config.steps < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--prefill is ", config.prefill, " and --steps ",
                                                   config.steps, "; want 1 or more and 0 or more"));
  }
  // The prefill is the query's length (--seq_len's, which BuildRequest names).
  if (config.prefill > kMaxTensorElements) {
    return absl::InvalidArgumentError(
        absl::StrCat("--prefill is ", config.prefill, "; want 1 to ", kMaxTensorElements));
  }
  ShapeOptions shape = config.shape;
  ATTN_ASSIGN_OR_RETURN(shape.mask, ParseMaskKind(config.mask));
  if (shape.mask != MaskKind::kNone && shape.mask != MaskKind::kCausalBottomRight) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--sessions takes --mask none or causal_bottom_right (the decoder's mask), not ",
        config.mask));
  }
  ATTN_ASSIGN_OR_RETURN(shape.dtype, ParseFloatDType(config.dtype));
  v1::Tensor::DType cache_dtype;
  if (config.session_dtype == "float32") {
    cache_dtype = v1::Tensor::FLOAT32;
  } else if (config.session_dtype == "bfloat16") {
    cache_dtype = v1::Tensor::BFLOAT16;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--session_dtype \"", config.session_dtype, "\" is not float32 or bfloat16"));
  }
  std::optional<v1::ModelConfig> model;
  if (!shape.model.empty()) {
    ATTN_ASSIGN_OR_RETURN(model, FetchModel(config, shape.model));
  }
  const v1::ModelConfig* model_ptr = model.has_value() ? &*model : nullptr;

  SessionLoadOptions& options = prepared->sessions.emplace();
  shape.query_len = shape.key_len = config.prefill;
  ATTN_ASSIGN_OR_RETURN(options.prefill, BuildRequest(shape, model_ptr));
  shape.query_len = shape.key_len = 1;
  ++shape.seed;
  ATTN_ASSIGN_OR_RETURN(options.step, BuildRequest(shape, model_ptr));
  // The cache holds, per key/value head, its keys and values: rank 4, the
  // key and value tensors' heads and dims; rank 3, the head's share of the
  // query's features for each (with a model: the projections').
  const v1::AttendRequest& step = options.step;
  if (step.key().shape_size() == 4) {
    options.cache_row_bytes =
        CacheRowBytes(step.key().shape(1), step.key().shape(3), step.value().shape(3), cache_dtype);
  } else {
    const int64_t embed_dim = step.query().shape(2);
    const int64_t heads = model_ptr != nullptr ? model_ptr->num_heads() : shape.heads;
    options.cache_row_bytes =
        CacheRowBytes(heads, embed_dim / heads, embed_dim / heads, cache_dtype);
  }
  options.targets = config.targets;
  options.connections = config.connections;
  if (config.stream) {
    // Each decoder holds its stream open for its whole run, and a connection
    // carries only so many: more decoders than that get more connections.
    const int64_t targets = static_cast<int64_t>(config.targets.size());
    const int64_t per_target = (config.sessions + targets - 1) / targets;
    options.connections = static_cast<int>(std::max<int64_t>(
        config.connections, (per_target + kStreamsPerConnection - 1) / kStreamsPerConnection));
  }
  options.client = config.client;
  options.client.timeout = config.timeout;
  options.connect_timeout = config.connect_timeout;
  options.sessions = config.sessions;
  options.prefill_rows = config.prefill;
  options.steps = config.steps;
  options.cache_dtype = cache_dtype;
  options.keep_rows = config.session_keep_rows;
  options.stream = config.stream;
  if (config.verify) {
    ATTN_ASSIGN_OR_RETURN(AnswerShapes shapes, ExpectedShapes(options.step, model_ptr));
    ATTN_ASSIGN_OR_RETURN(
        prepared->verifier,
        Verifier::Create(std::move(shapes), std::nullopt, config.verify_atol, config.verify_rtol));
  }

  RunDescription& run = prepared->description;
  run.targets = config.targets;
  run.connections = options.connections;
  run.threads = static_cast<int>(config.sessions);
  run.stream = config.stream;
  run.transport = "grpc";
  run.schedule =
      absl::StrCat(config.sessions, config.sessions == 1 ? " session" : " sessions", " x (prefill ",
                   config.prefill, " rows + ", config.steps, " one-row steps)");
  run.workload = absl::StrCat(DescribeRequest(options.step, ""), ", ", config.session_dtype,
                              " cache", config.session_keep_rows ? ", rows kept" : "");
  return absl::OkStatus();
}

// The flags only gRPC's client heeds that are set to other than their
// defaults: they pick it under auto, and h2 refuses them.
std::vector<absl::string_view> GrpcOnlyFlags(const LoadtestConfig& config) {
  std::vector<absl::string_view> set;
  if (config.threads != LoadtestConfig().threads) set.push_back("--threads");
  if (config.client.max_attempts != client::ClientOptions().max_attempts) {
    set.push_back("--max_attempts");
  }
  return set;
}

// A report file whose folder is missing fails before the run, not after it.
absl::Status CheckOutputFolders(const LoadtestConfig& config) {
  const std::pair<absl::string_view, const std::string*> files[] = {
      {"--json", &config.json_file},
      {"--csv", &config.csv_file},
      {"--histogram_log", &config.histogram_log_file},
      {"--html", &config.html_file}};
  for (const auto& [flag, file] : files) {
    if (file->empty()) continue;
    const std::filesystem::path folder = std::filesystem::path(*file).parent_path();
    std::error_code ec;
    if (!folder.empty() && !std::filesystem::is_directory(folder, ec)) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, " ", *file, ": the folder ", folder.string(), " does not exist"));
    }
  }
  return absl::OkStatus();
}

// The flags --sessions and the other loads both take, checked before
// --sessions branches off.
absl::Status CheckSharedFlags(const LoadtestConfig& config) {
  if (config.targets.empty()) return absl::InvalidArgumentError("no --target given");
  if (absl::Status token = client::CheckBearerToken(config.client.bearer_token); !token.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--token: ", token.message()));
  }
  if (config.transport != "auto" && config.transport != "grpc" && config.transport != "h2") {
    return absl::InvalidArgumentError(
        absl::StrCat("--transport: \"", config.transport, "\" is not one of auto, grpc and h2"));
  }
  // Before any connection (a model's lookup), so that the flags' conflict is
  // what is said, not a connection failing.
  if (config.transport == "h2") ATTN_RETURN_IF_ERROR(CheckH2Carries(config.stream, config.client));
  ATTN_RETURN_IF_ERROR(CheckConnectionsAndThreads(config.connections, config.threads));
  if (config.timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--timeout is ", absl::FormatDuration(config.timeout), "; want 0 (no deadline) or more"));
  }
  if (config.connect_timeout <= absl::ZeroDuration() ||
      config.connect_timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--connect_timeout ",
                                                   absl::FormatDuration(config.connect_timeout),
                                                   " is not a positive, finite duration"));
  }
  return CheckOutputFolders(config);
}

absl::Status Prepare(const LoadtestConfig& config, Prepared* prepared) {
  ATTN_RETURN_IF_ERROR(CheckSharedFlags(config));
  ATTN_ASSIGN_OR_RETURN(prepared->thresholds, ParseThresholds(config.thresholds));
  if (config.sessions != 0) return PrepareSessions(config, prepared);
  ATTN_ASSIGN_OR_RETURN(Schedule schedule, MakeSchedule(config));
  ATTN_ASSIGN_OR_RETURN(const Arrival arrival, ParseArrival(config.arrival));
  if (const std::vector<absl::string_view> flags = GrpcOnlyFlags(config);
      config.transport == "h2" && !flags.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--transport h2 polls on one thread and does not retry; ",
                     absl::StrJoin(flags, " and "), " need --transport grpc (or auto)"));
  }
  const bool open_loop = schedule.kind() == LoadKind::kRate;
  if (!open_loop && (arrival != Arrival::kConstant || config.max_in_flight > 0)) {
    return absl::InvalidArgumentError(
        "--arrival and --max_in_flight apply to open loops (--rate or a rate: schedule)");
  }
  if (config.requests < 0 || config.max_in_flight < 0) {
    return absl::InvalidArgumentError("--requests and --max_in_flight must not be negative");
  }

  ShapeOptions shape = config.shape;
  ATTN_ASSIGN_OR_RETURN(shape.mask, ParseMaskKind(config.mask));
  ATTN_ASSIGN_OR_RETURN(shape.dtype, ParseFloatDType(config.dtype));
  v1::AttendRequest& request = prepared->request;
  if (!config.request_file.empty()) {
    ATTN_RETURN_IF_ERROR(ReadJsonFile(config.request_file, &request));
  }
  const std::string model = config.request_file.empty() ? shape.model : request.model();
  std::optional<v1::ModelConfig> model_config;
  if (!model.empty()) {
    ATTN_ASSIGN_OR_RETURN(model_config, FetchModel(config, model));
  }
  const v1::ModelConfig* model_ptr = model_config.has_value() ? &*model_config : nullptr;
  if (config.request_file.empty()) {
    ATTN_ASSIGN_OR_RETURN(request, BuildRequest(shape, model_ptr));
  }
  const std::string transport = ResolveTransport(config, request.ByteSizeLong());
  if (config.verify || !config.expected_file.empty()) {
    ATTN_ASSIGN_OR_RETURN(AnswerShapes shapes, ExpectedShapes(request, model_ptr));
    std::optional<v1::AttendResponse> expected;
    if (!config.expected_file.empty()) {
      expected.emplace();
      ATTN_RETURN_IF_ERROR(ReadJsonFile(config.expected_file, &*expected));
    }
    ATTN_ASSIGN_OR_RETURN(prepared->verifier,
                          Verifier::Create(std::move(shapes), std::move(expected),
                                           config.verify_atol, config.verify_rtol));
  }

  RunOptions& options = prepared->options;
  options.targets = config.targets;
  options.connections = config.connections;
  options.client = config.client;
  options.client.timeout = config.timeout;
  options.connect_timeout = config.connect_timeout;
  options.schedule = schedule;
  options.arrival = arrival;
  options.max_in_flight = config.max_in_flight;
  options.warmup = config.warmup;
  options.max_requests = config.requests;
  options.stream = config.stream;
  options.threads = config.threads;
  options.transport = transport == "h2" ? Transport::kH2 : Transport::kGrpc;
  options.seed = config.shape.seed;
  options.progress_interval = config.progress_interval;

  RunDescription& run = prepared->description;
  run.targets = config.targets;
  run.connections = config.connections;
  run.threads = config.threads;
  run.stream = config.stream;
  run.transport = transport;
  run.open_loop = open_loop;
  run.schedule = schedule.ToString();
  if (open_loop) {
    run.arrival = ArrivalName(arrival);
    run.target_rps = MeanValue(schedule);
    run.max_in_flight = config.max_in_flight;
  }
  run.warmup_s = absl::ToDoubleSeconds(config.warmup);
  run.workload = DescribeRequest(request, config.request_file);
  if (config.requests > 0) absl::StrAppend(&run.schedule, ", ", config.requests, " requests");
  return absl::OkStatus();
}

// --sessions: the decoders' run, into `report`.
absl::Status RunSessionLoad(Prepared& prepared, const std::atomic<bool>* interrupted,
                            Report* report) {
  SessionLoadOptions& options = *prepared.sessions;
  if (prepared.verifier.has_value()) options.verifier = &*prepared.verifier;
  options.interrupted = interrupted;
  ATTN_ASSIGN_OR_RETURN(SessionRunResult result, RunSessions(options));
  report->stats = std::move(result.stats);
  report->sessions = std::move(result.sessions);
  report->timeline = std::move(result.timeline);
  return absl::OkStatus();
}

// The other loads: the schedule's run, into `report`, with the progress line
// on `err` when the config asks for it.
absl::Status RunScheduledLoad(Prepared& prepared, const LoadtestConfig& config, std::ostream& err,
                              const std::atomic<bool>* interrupted, Report* report) {
  RunOptions& options = prepared.options;
  if (prepared.verifier.has_value()) options.verifier = &*prepared.verifier;
  options.interrupted = interrupted;
  size_t drawn = 0;
  if (config.progress) {
    options.on_progress = [&err, &drawn](const Progress& progress) {
      const std::string line = FormatProgress(progress);
      err << "\r" << line << std::string(drawn > line.size() ? drawn - line.size() : 0, ' ')
          << std::flush;
      drawn = line.size();
    };
  }
  absl::StatusOr<RunResult> result = RunLoad(options, prepared.request);
  if (drawn > 0) err << "\r" << std::string(drawn, ' ') << "\r" << std::flush;
  if (!result.ok()) return result.status();
  report->stats = std::move(result->stats);
  report->timeline = std::move(result->timeline);
  return absl::OkStatus();
}

}  // namespace

std::string ResolveTransport(const LoadtestConfig& config, size_t request_bytes) {
  if (config.transport != "auto") return config.transport;
  if (config.sessions != 0) return "grpc";
  if (config.stream || request_bytes > kMaxH2AutoRequestBytes || config.client.UsesTls() ||
      !GrpcOnlyFlags(config).empty()) {
    return "grpc";
  }
  for (const std::string& target : config.targets) {
    if (!SplitHostPort(target).has_value()) return "grpc";  // a gRPC URI: dns:///, ipv4:, ...
  }
  return "h2";
}

int RunLoadtest(const LoadtestConfig& config, std::ostream& out, std::ostream& err,
                const std::atomic<bool>* interrupted) {
  Prepared prepared;
  if (absl::Status status = Prepare(config, &prepared); !status.ok()) {
    return Fail(config, status, err);
  }
  Report report;
  report.run = prepared.description;
  const absl::Status ran = prepared.sessions.has_value()
                               ? RunSessionLoad(prepared, interrupted, &report)
                               : RunScheduledLoad(prepared, config, err, interrupted, &report);
  if (!ran.ok()) return Fail(config, ran, err);
  if (interrupted != nullptr && interrupted->load()) {
    err << "interrupted: the report covers the run until then\n";
  }
  return Conclude(report, prepared.thresholds, config, out, err);
}

int RunMerge(const std::vector<std::string>& files, const LoadtestConfig& config, std::ostream& out,
             std::ostream& err) {
  absl::StatusOr<std::vector<Threshold>> thresholds = ParseThresholds(config.thresholds);
  if (!thresholds.ok()) {
    err << "error: " << thresholds.status().message() << "\n";
    return kExitSetup;
  }
  if (files.empty()) {
    err << "error: merge needs histogram log files\n";
    return kExitSetup;
  }
  Report report;
  for (const std::string& file : files) {
    std::ifstream in(file, std::ios::binary);
    std::ostringstream text;
    if (in.is_open()) text << in.rdbuf();
    absl::StatusOr<LoadStats> stats = absl::InvalidArgumentError("cannot be read");
    if (in.is_open() && !in.bad()) stats = LoadStats::FromLog(text.str());
    if (!stats.ok()) {
      err << "error: " << file << ": " << stats.status().message() << "\n";
      return kExitSetup;
    }
    report.stats.Merge(*stats);
  }
  return Conclude(report, *thresholds, config, out, err);
}

int RunHtmlReport(const std::vector<std::string>& files, const LoadtestConfig& config,
                  std::ostream& out, std::ostream& err) {
  if (config.html_file.empty()) {
    err << "error: report writes the page --html FILE names; none given\n";
    return kExitSetup;
  }
  if (files.empty()) {
    err << "error: report needs the JSON reports (--json files) of one or more runs\n";
    return kExitSetup;
  }
  std::vector<HtmlRun> runs;
  for (const std::string& file : files) {
    std::ifstream in(file, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    if (!in.is_open() || in.bad()) {
      err << "error: " << file << ": cannot be read\n";
      return kExitSetup;
    }
    runs.push_back(HtmlRun{file, text.str(), ""});
  }
  absl::StatusOr<std::string> html = FormatHtml(runs);
  absl::Status written = html.ok() ? WriteFile(config.html_file, *html) : html.status();
  if (!written.ok()) {
    err << "error: " << written.message() << "\n";
    return kExitSetup;
  }
  out << "wrote " << config.html_file << " (" << files.size()
      << (files.size() == 1 ? " run)\n" : " runs)\n");
  return kExitOk;
}

}  // namespace attention::loadtest
