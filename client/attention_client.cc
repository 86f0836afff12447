#include "client/attention_client.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
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
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/metadata.h"
#include "common/status_macros.h"
#include "common/tls_files.h"
#include "grpc/grpc.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/status.h"

namespace attention::client {
namespace {

// gRPC moves a connection attempt on (TCP, the HTTP/2 handshake) only while
// something polls it: a call waiting for the channel, or its backup poller,
// every 5 s by default. Calls here fail fast while the channel is failing
// (no waitForReady), so none waits, and through a proxy that accepts TCP at
// once and then waits for the client's preface (HAProxy), every attempt timed
// out before its SETTINGS arrived: after the proxy restarted, a client that
// was connected failed every call for as long as it ran. Polling every
// 100 ms, as often as the first reconnect, lets the attempt complete. Set
// before main, before anything starts gRPC (which reads it once, at start);
// a value the process was given is kept.
const bool kBackupPolling = [] {
  setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "100", /*overwrite=*/0);
  return true;
}();

// OK, or INVALID_ARGUMENT naming `field` and the first byte that is not
// part of UTF-8 text, which a proto string field must hold: protobuf sends
// it anyway (logging an error), and the server, which cannot parse it,
// answers with a bare status naming nothing.
absl::Status CheckUtf8(absl::string_view field, absl::string_view text) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  for (size_t i = 0; i < text.size();) {
    const unsigned char lead = byte(i);
    size_t length = 1;
    uint32_t low = 0, code = lead;
    if (lead >= 0xc2 && lead <= 0xdf) {
      length = 2, low = 0x80, code = lead & 0x1f;
    } else if (lead >= 0xe0 && lead <= 0xef) {
      length = 3, low = 0x800, code = lead & 0x0f;
    } else if (lead >= 0xf0 && lead <= 0xf4) {
      length = 4, low = 0x10000, code = lead & 0x07;
    } else if (lead >= 0x80) {
      length = 0;
    }
    for (size_t k = 1; length > 0 && k < length; ++k) {
      if (i + k >= text.size() || (byte(i + k) & 0xc0) != 0x80) {
        length = 0;
      } else {
        code = (code << 6) | (byte(i + k) & 0x3f);
      }
    }
    // Overlong forms, UTF-16 surrogates and code points past U+10FFFF.
    if (length == 0 || code < low || (code >= 0xd800 && code <= 0xdfff) || code > 0x10ffff) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: byte %d of %d is 0x%02x; not UTF-8 text, which the field must be",
                          field, i, text.size(), lead));
    }
    i += length;
  }
  return absl::OkStatus();
}

// The string fields of an AttendRequest the caller sets: CheckUtf8.
absl::Status CheckRequestText(const v1::AttendRequest& request) {
  ATTN_RETURN_IF_ERROR(CheckUtf8("id", request.id()));
  ATTN_RETURN_IF_ERROR(CheckUtf8("model", request.model()));
  for (int i = 0; i < request.session().ids_size(); ++i) {
    ATTN_RETURN_IF_ERROR(CheckUtf8(absl::StrCat("session.ids[", i, "]"), request.session().ids(i)));
  }
  return absl::OkStatus();
}

// gRPC caps a retry policy's maxAttempts at 5.
constexpr int kMaxAttempts = 5;

// The whole of the file at `path`, named by `option`; INVALID_ARGUMENT
// "<option>: cannot read <path>: <why>".
absl::StatusOr<std::string> ReadWholeFile(absl::string_view option, const std::string& path) {
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) {
    return absl::InvalidArgumentError(
        absl::StrCat(option, ": cannot read ", path, ": it is a directory"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(option, ": cannot read ", path, ": ", std::strerror(errno)));
  }
  std::string contents{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (in.bad()) {
    return absl::InvalidArgumentError(
        absl::StrCat(option, ": cannot read ", path, ": ", std::strerror(errno)));
  }
  return contents;
}

// The whole of `path`, a PEM file; INVALID_ARGUMENT naming `option` and the
// file when it cannot be read, is empty (gRPC would take an empty CA list for
// the system's roots, and an empty key for no client certificate) or is not
// PEM.
absl::StatusOr<std::string> ReadOptionFile(absl::string_view option, const std::string& path) {
  ATTN_ASSIGN_OR_RETURN(std::string contents, ReadWholeFile(option, path));
  if (contents.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(option, ": ", path, " is empty"));
  }
  // gRPC reports a file that is not PEM only as a failed connection
  // ("empty address list"), naming no file.
  if (contents.find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(option, ": ", path, " is not PEM (it has no -----BEGIN line)"));
  }
  return contents;
}

// Plaintext credentials, or TLS ones when any TLS option is set.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ClientOptions& options) {
  if (!options.UsesTls()) return grpc::InsecureChannelCredentials();
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError(options.tls_cert_file.empty()
                                          ? "tls_key_file is set but tls_cert_file is not"
                                          : "tls_cert_file is set but tls_key_file is not");
  }
  grpc::SslCredentialsOptions ssl;
  if (!options.tls_ca_file.empty()) {
    ATTN_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadOptionFile("tls_ca_file", options.tls_ca_file));
    ATTN_RETURN_IF_ERROR(
        CheckHoldsCertificate({"tls_ca_file", options.tls_ca_file, ssl.pem_root_certs}));
  }
  if (!options.tls_cert_file.empty()) {
    ATTN_ASSIGN_OR_RETURN(ssl.pem_cert_chain,
                          ReadOptionFile("tls_cert_file", options.tls_cert_file));
    ATTN_ASSIGN_OR_RETURN(ssl.pem_private_key,
                          ReadOptionFile("tls_key_file", options.tls_key_file));
    // A key of another certificate, or an encrypted one, failed every call
    // "UNAVAILABLE: empty address list"; an expired certificate, every
    // handshake, the server closing the connection.
    ATTN_RETURN_IF_ERROR(
        CheckKeyPair({"tls_cert_file", options.tls_cert_file, ssl.pem_cert_chain},
                     {"tls_key_file", options.tls_key_file, ssl.pem_private_key}));
  }
  return grpc::SslCredentials(ssl);
}

// The channel's service config: a retry policy for UNAVAILABLE on the unary
// methods. They are idempotent, or safe to repeat: a stateless Attend computes
// and keeps nothing; a session's Attend names the positions it expects, so a
// repeat of one that was applied fails ABORTED instead of appending twice;
// closing a closed session only lists it in not_found. Streams
// stay out: a retried stream would resend every message written so far. The
// throttle stops retrying on the channel after a run of failures (5 more than
// a tenth of its successes), so a server that is going away or overloaded is
// not sent several times its load.
std::string ServiceConfig(int max_attempts) {
  if (max_attempts == 1) return "{}";
  return absl::StrCat(R"json({"methodConfig": [{"name": [
    {"service": "attention.v1.AttentionService", "method": "Attend"},
    {"service": "attention.v1.AttentionService", "method": "GetServerInfo"},
    {"service": "attention.v1.AttentionService", "method": "ListModels"},
    {"service": "attention.v1.AttentionService", "method": "GetModel"},
    {"service": "attention.v1.AttentionService", "method": "CloseSessions"},
    {"service": "attention.v1.AttentionService", "method": "GetSession"},
    {"service": "grpc.health.v1.Health", "method": "Check"}],
  "retryPolicy": {"maxAttempts": )json",
                      max_attempts, R"json(, "initialBackoff": "0.1s", "maxBackoff": "1s",
    "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}],
"retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}})json");
}

// Whole milliseconds of `d`, for channel arguments; 0 when not positive or
// too long for an int.
int PositiveMillis(absl::Duration d) {
  if (d <= absl::ZeroDuration() || d > absl::Milliseconds(std::numeric_limits<int>::max())) {
    return 0;
  }
  return static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(d)));
}

// A failed call's status. gRPC's only word when a server refuses the TLS
// handshake (a client certificate missing or not trusted) or a plaintext
// connection to its TLS port is "Socket closed": there the message also
// says which of the client's settings could be why.
absl::Status ToAbslStatus(const grpc::Status& status, const ClientOptions& options) {
  if (status.ok()) return absl::OkStatus();
  const auto code = static_cast<absl::StatusCode>(status.error_code());
  if (code != absl::StatusCode::kUnavailable ||
      !absl::StrContains(status.error_message(), "Socket closed")) {
    return absl::Status(code, status.error_message());
  }
  const char* hint =
      !options.UsesTls()
          ? "a server that serves TLS closes plaintext connections: if this one does, set "
            "tls_ca_file (attention_cli: --tls_ca)"
      : options.tls_cert_file.empty()
          ? "a server that requires client certificates (mTLS) closes the connection of a "
            "client without one: if this one does, set tls_cert_file and tls_key_file "
            "(attention_cli: --tls_cert, --tls_key)"
          : "a server that requires client certificates (mTLS) closes the connection of a "
            "client whose certificate its --tls_client_ca did not sign: check tls_cert_file";
  return absl::Status(code, absl::StrCat(status.error_message(), " (", hint, ")"));
}

// The options' timeout is a deadline: positive and finite.
bool HasDeadline(const ClientOptions& options) {
  return options.timeout > absl::ZeroDuration() && options.timeout != absl::InfiniteDuration();
}

void AddToken(const ClientOptions& options, grpc::ClientContext* context) {
  if (!options.bearer_token.empty()) {
    context->AddMetadata("authorization", absl::StrCat("Bearer ", options.bearer_token));
  }
}

void PrepareContext(const ClientOptions& options, grpc::ClientContext* context) {
  if (HasDeadline(options)) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + options.timeout));
  }
  AddToken(options, context);
}

// The replica that answered a call (its "attention-replica" initial
// metadata, or, once the call is over, trailing metadata: a call it refused
// before taking it names it there), empty if it named none. Only once the
// initial metadata has arrived: after an answer, or once the call is over.
std::string ReplicaOf(const grpc::ClientContext& context, bool call_over = true) {
  const auto named = [](const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) {
    auto it = metadata.find(kReplicaHeader);
    return it == metadata.end() ? std::string() : std::string(it->second.data(), it->second.size());
  };
  std::string replica = named(context.GetServerInitialMetadata());
  if (replica.empty() && call_over) replica = named(context.GetServerTrailingMetadata());
  return replica;
}

// Runs one unary call of `method` on `stub` with the options' deadline and
// token, sending `affinity` (when not empty) and reporting the replica.
template <typename Response, typename Stub, typename Method, typename Request>
absl::StatusOr<Response> Call(const ClientOptions& options, Stub& stub, Method method,
                              const Request& request, const CallOptions& call = {},
                              const std::string& affinity = "") {
  grpc::ClientContext context;
  PrepareContext(options, &context);
  if (!affinity.empty()) context.AddMetadata(kAffinityHeader, AffinityHeaderValue(affinity));
  Response response;
  grpc::Status status = (stub.*method)(&context, request, &response);
  if (call.replica != nullptr) *call.replica = ReplicaOf(context);
  if (!status.ok()) return ToAbslStatus(status, options);
  return response;
}

// `call.affinity`, or `fallback` when it is empty.
std::string AffinityOf(const CallOptions& call, absl::string_view fallback) {
  return call.affinity.empty() ? std::string(fallback) : call.affinity;
}

// The completion-queue tags of an AttendStream's operations.
enum StreamOp : int { kStart, kWrite, kRead, kWritesDone, kFinish, kStreamOps };

}  // namespace

// An asynchronous stream driven one message at a time, so that each wait has
// a deadline of its own (a synchronous stream's deadline is the whole call's).
struct AttendStream::Impl {
  Impl(const ClientOptions& options, v1::AttentionService::Stub& stub, absl::string_view affinity)
      : options(options) {
    AddToken(options, &context);
    if (!affinity.empty()) context.AddMetadata(kAffinityHeader, AffinityHeaderValue({affinity.data(), affinity.size()}));
    stream = stub.PrepareAsyncAttendStream(&context, &queue);
    Begin(kStart);
    stream->StartCall(Tag(kStart));
  }

  ~Impl() {
    if (open) {
      End(/*cancel=*/true, absl::CancelledError("the AttendStream was dropped")).IgnoreError();
    }
    queue.Shutdown();
    void* tag;
    bool ok;
    while (queue.Next(&tag, &ok)) {
    }
  }

  static void* Tag(StreamOp op) { return reinterpret_cast<void*>(static_cast<intptr_t>(op) + 1); }

  void Begin(StreamOp op) {
    done[op] = false;
    ++pending;
  }

  // Waits for the next operation to complete and records it; false when
  // `deadline` (if any) passed first.
  bool WaitOne(std::optional<std::chrono::system_clock::time_point> deadline) {
    void* tag;
    bool ok;
    const bool got = deadline.has_value()
                         ? queue.AsyncNext(&tag, &ok, *deadline) == grpc::CompletionQueue::GOT_EVENT
                         : queue.Next(&tag, &ok);
    if (!got) return false;
    const int op = static_cast<int>(reinterpret_cast<intptr_t>(tag) - 1);
    done[op] = true;
    succeeded[op] = ok;
    --pending;
    return true;
  }

  // Waits until every op of `ops` has completed; false when `deadline`
  // (if any) passed first.
  bool Await(std::initializer_list<StreamOp> ops,
             std::optional<std::chrono::system_clock::time_point> deadline) {
    for (StreamOp op : ops) {
      while (!done[op]) {
        if (!WaitOne(deadline)) return false;
      }
    }
    return true;
  }

  // Waits out every operation started; after a cancel they all complete.
  void Drain() {
    while (pending > 0 && WaitOne(std::nullopt)) {
    }
  }

  // The deadline of one message's wait, none without a timeout.
  std::optional<std::chrono::system_clock::time_point> Deadline() const {
    if (!HasDeadline(options)) return std::nullopt;
    return absl::ToChronoTime(absl::Now() + options.timeout);
  }

  // Ends the stream: cancels it if `cancel`, waits for its operations and its
  // status, and records why it ended: `why` when set, else the status (an OK
  // one as `unanswered`). Returns that.
  absl::Status End(bool cancel, std::optional<absl::Status> why,
                   absl::string_view unanswered = "") {
    if (cancel) context.TryCancel();
    Drain();
    grpc::Status status;
    Begin(kFinish);
    stream->Finish(&status, Tag(kFinish));
    if (!Await({kFinish}, Deadline())) {
      context.TryCancel();
      Drain();
    }
    replica = ReplicaOf(context);
    open = false;
    if (why.has_value()) {
      ended = *std::move(why);
    } else if (!status.ok()) {
      ended = ToAbslStatus(status, options);
    } else if (!unanswered.empty()) {
      ended = absl::UnavailableError(unanswered);
    }
    return ended;
  }

  const ClientOptions options;
  grpc::ClientContext context;
  grpc::CompletionQueue queue;
  std::unique_ptr<grpc::ClientAsyncReaderWriter<v1::AttendRequest, v1::AttendResponse>> stream;
  bool done[kStreamOps] = {};
  bool succeeded[kStreamOps] = {};
  int pending = 0;
  bool open = true;
  // Why the stream ended, once it has.
  absl::Status ended;
  std::string replica;
};

AttendStream::AttendStream(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

AttendStream::~AttendStream() = default;

bool AttendStream::open() const { return impl_->open; }

const std::string& AttendStream::replica() const { return impl_->replica; }

absl::StatusOr<v1::AttendResponse> AttendStream::Call(const v1::AttendRequest& request) {
  Impl& s = *impl_;
  if (!s.open) {
    return absl::FailedPreconditionError(
        absl::StrCat("the AttendStream has ended: ", s.ended.ToString()));
  }
  ATTN_RETURN_IF_ERROR(CheckRequestText(request));
  const std::optional<std::chrono::system_clock::time_point> deadline = s.Deadline();
  const auto timed_out = [&s](absl::string_view what, absl::string_view why = "") {
    return s.End(/*cancel=*/true,
                 absl::DeadlineExceededError(
                     absl::StrCat(what, " within ", absl::FormatDuration(s.options.timeout), why)));
  };
  if (!s.done[kStart] && !s.Await({kStart}, deadline)) {
    // Held back by the connection's limit on open streams, or connecting.
    return timed_out("the AttendStream did not start",
                     " (its connection may have no stream to spare: the server's "
                     "--max_concurrent_streams, a proxy's limit)");
  }
  if (!s.succeeded[kStart]) {
    return s.End(/*cancel=*/false, std::nullopt, "the AttendStream did not start");
  }
  v1::AttendResponse response;
  s.Begin(kWrite);
  s.stream->Write(request, Impl::Tag(kWrite));
  s.Begin(kRead);
  s.stream->Read(&response, Impl::Tag(kRead));
  if (!s.Await({kWrite, kRead}, deadline)) return timed_out("no answer on the AttendStream");
  if (!s.succeeded[kWrite] || !s.succeeded[kRead]) {
    // A failed read means the call is over: cancelling it then would turn the
    // server's status into CANCELLED.
    return s.End(/*cancel=*/s.succeeded[kRead], std::nullopt,
                 "the server ended the AttendStream without answering");
  }
  s.replica = ReplicaOf(s.context, /*call_over=*/false);
  if (response.status().code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(response.status().code()),
                        response.status().message());
  }
  return response;
}

absl::Status AttendStream::Close() {
  Impl& s = *impl_;
  if (!s.open) return absl::OkStatus();
  const std::optional<std::chrono::system_clock::time_point> deadline = s.Deadline();
  bool half_closed = s.Await({kStart}, deadline) && s.succeeded[kStart];
  if (half_closed) {
    s.Begin(kWritesDone);
    s.stream->WritesDone(Impl::Tag(kWritesDone));
    half_closed = s.Await({kWritesDone}, deadline);
  }
  return s.End(/*cancel=*/!half_closed, std::nullopt);
}

absl::Status CheckBearerToken(absl::string_view token) {
  for (size_t i = 0; i < token.size(); ++i) {
    const auto c = static_cast<unsigned char>(token[i]);
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "byte %d of %d is 0x%02x; a token goes in a header, so it must be "
          "printable ASCII (a newline read from a file with it, too, must be removed)",
          i, token.size(), c));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadBearerTokenFile(absl::string_view option, const std::string& path) {
  ATTN_ASSIGN_OR_RETURN(const std::string contents, ReadWholeFile(option, path));
  const absl::string_view token = absl::StripAsciiWhitespace(contents);
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(option, ": ", path, " holds no token"));
  }
  if (absl::Status valid = CheckBearerToken(token); !valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(option, ": ", path, ": ", valid.message()));
  }
  return std::string(token);
}

absl::StatusOr<std::string> BearerTokenFromFlags(const std::string& token,
                                                 const std::string& token_file) {
  if (token_file.empty()) return token;
  if (!token.empty()) return absl::InvalidArgumentError("give --token or --token_file, not both");
  return ReadBearerTokenFile("--token_file", token_file);
}

absl::StatusOr<std::unique_ptr<AttentionClient>> AttentionClient::Create(
    const ClientOptions& options) {
  if (options.target.empty()) return absl::InvalidArgumentError("target is empty");
  if (absl::Status token = CheckBearerToken(options.bearer_token); !token.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("bearer_token: ", token.message()));
  }
  if (options.max_message_mb < 1 || options.max_message_mb > kMaxMessageMb) {
    return absl::InvalidArgumentError(absl::StrCat("max_message_mb is ", options.max_message_mb,
                                                   ", must be in [1, ", kMaxMessageMb, "]"));
  }
  if (options.max_attempts < 1 || options.max_attempts > kMaxAttempts) {
    return absl::InvalidArgumentError(absl::StrCat("max_attempts is ", options.max_attempts,
                                                   ", must be in [1, ", kMaxAttempts, "]"));
  }
  const int backoff_initial_ms = PositiveMillis(options.reconnect_backoff_initial);
  const int backoff_max_ms = PositiveMillis(options.reconnect_backoff_max);
  const int backoff_min_ms = PositiveMillis(options.reconnect_backoff_min);
  if (backoff_initial_ms == 0 || backoff_max_ms == 0 || backoff_min_ms == 0 ||
      backoff_initial_ms > backoff_max_ms) {
    return absl::InvalidArgumentError(absl::StrCat(
        "reconnect backoffs must be positive and finite with initial <= max; got initial ",
        absl::FormatDuration(options.reconnect_backoff_initial), ", max ",
        absl::FormatDuration(options.reconnect_backoff_max), ", min ",
        absl::FormatDuration(options.reconnect_backoff_min)));
  }
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, backoff_initial_ms);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, backoff_max_ms);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, backoff_min_ms);
  args.SetServiceConfigJSON(ServiceConfig(options.max_attempts));
  const int max_bytes = static_cast<int>(options.max_message_mb << 20);
  args.SetMaxSendMessageSize(max_bytes);
  args.SetMaxReceiveMessageSize(max_bytes);
  args.SetLoadBalancingPolicyName("round_robin");
  if (options.own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (!options.tls_server_name_override.empty()) {
    args.SetSslTargetNameOverride(options.tls_server_name_override);
  }
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                        MakeChannelCredentials(options));
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(options.target, credentials, args);
  if (channel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot create a channel to ", options.target));
  }
  return std::unique_ptr<AttentionClient>(new AttentionClient(options, std::move(channel)));
}

AttentionClient::AttentionClient(const ClientOptions& options,
                                 std::shared_ptr<grpc::Channel> channel)
    : options_(options),
      channel_(std::move(channel)),
      stub_(v1::AttentionService::NewStub(channel_)) {}

absl::StatusOr<v1::AttendResponse> AttentionClient::Attend(const v1::AttendRequest& request,
                                                           const CallOptions& call) {
  ATTN_RETURN_IF_ERROR(CheckRequestText(request));
  const absl::string_view first =
      request.session().ids().empty() ? absl::string_view() : request.session().ids(0);
  return Call<v1::AttendResponse>(options_, *stub_, &v1::AttentionService::Stub::Attend, request,
                                  call, AffinityOf(call, first));
}

std::unique_ptr<AttendStream> AttentionClient::OpenStream(const CallOptions& call) {
  return std::unique_ptr<AttendStream>(
      new AttendStream(std::make_unique<AttendStream::Impl>(options_, *stub_, call.affinity)));
}

absl::StatusOr<v1::ServerInfo> AttentionClient::GetServerInfo() {
  return Call<v1::ServerInfo>(options_, *stub_, &v1::AttentionService::Stub::GetServerInfo,
                              v1::GetServerInfoRequest());
}

absl::StatusOr<v1::ListModelsResponse> AttentionClient::ListModels() {
  return Call<v1::ListModelsResponse>(options_, *stub_, &v1::AttentionService::Stub::ListModels,
                                      v1::ListModelsRequest());
}

absl::StatusOr<v1::GetModelResponse> AttentionClient::GetModel(const std::string& name) {
  ATTN_RETURN_IF_ERROR(CheckUtf8("name", name));
  v1::GetModelRequest request;
  request.set_name(name);
  return Call<v1::GetModelResponse>(options_, *stub_, &v1::AttentionService::Stub::GetModel,
                                    request);
}

absl::StatusOr<v1::CloseSessionsResponse> AttentionClient::CloseSessions(
    const std::vector<std::string>& ids, const CallOptions& call) {
  for (size_t i = 0; i < ids.size(); ++i) {
    ATTN_RETURN_IF_ERROR(CheckUtf8(absl::StrCat("ids[", i, "]"), ids[i]));
  }
  if (!call.affinity.empty() || ids.size() <= 1) {
    v1::CloseSessionsRequest request;
    request.mutable_ids()->Assign(ids.begin(), ids.end());
    return Call<v1::CloseSessionsResponse>(
        options_, *stub_, &v1::AttentionService::Stub::CloseSessions, request, call,
        AffinityOf(call, ids.empty() ? absl::string_view() : absl::string_view(ids.front())));
  }
  // Each id with its own affinity, so that a proxy sends each to the
  // replica that holds it: one call for all would reach the first id's
  // replica only, and the others would stay open there until they expire.
  // Each distinct id once, in order, as one call for them all would list it.
  v1::CloseSessionsResponse all;
  std::set<absl::string_view> sent;
  for (const std::string& id : ids) {
    if (!sent.insert(id).second) continue;
    absl::StatusOr<v1::CloseSessionsResponse> one = CloseSessions({id}, call);
    if (!one.ok()) return one.status();
    all.mutable_closed()->MergeFrom(one->closed());
    all.mutable_not_found()->MergeFrom(one->not_found());
  }
  return all;
}

absl::StatusOr<v1::SessionInfo> AttentionClient::GetSession(const std::string& id,
                                                            const CallOptions& call) {
  ATTN_RETURN_IF_ERROR(CheckUtf8("id", id));
  v1::GetSessionRequest request;
  request.set_id(id);
  return Call<v1::SessionInfo>(options_, *stub_, &v1::AttentionService::Stub::GetSession, request,
                               call, AffinityOf(call, id));
}

absl::StatusOr<std::string> AttentionClient::Health(const std::string& service) {
  using grpc::health::v1::HealthCheckResponse;
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  std::unique_ptr<grpc::health::v1::Health::Stub> health =
      grpc::health::v1::Health::NewStub(channel_);
  absl::StatusOr<HealthCheckResponse> response =
      Call<HealthCheckResponse>(options_, *health, &grpc::health::v1::Health::Stub::Check, request);
  if (!response.ok()) return response.status();
  const std::string& name = HealthCheckResponse::ServingStatus_Name(response->status());
  if (name.empty()) return absl::StrCat("UNKNOWN_STATUS_", response->status());
  return name;
}

}  // namespace attention::client
