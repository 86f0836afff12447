#ifndef ATTENTION_CLIENT_ATTENTION_CLIENT_H_
#define ATTENTION_CLIENT_ATTENTION_CLIENT_H_

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "attention/v1/service.grpc.pb.h"

namespace grpc {
class Channel;
}

namespace attention::client {

// The largest max_message_mb: gRPC takes a message limit in an int of bytes.
inline constexpr int64_t kMaxMessageMb = std::numeric_limits<int>::max() / (int64_t{1} << 20);

struct ClientOptions {
  // gRPC target: "127.0.0.1:50051", "dns:///name:50051", ...
  std::string target = "127.0.0.1:50051";
  int64_t max_message_mb = 256;  // 1 to kMaxMessageMb
  // Sent as "authorization: Bearer <token>" when not empty: printable ASCII
  // (CheckBearerToken).
  std::string bearer_token;
  // TLS, used when any of these four is set (PEM file paths). tls_ca_file:
  // the CAs that may sign the server's certificate; empty trusts the system's
  // roots. tls_cert_file and tls_key_file, both or neither: the client's own
  // certificate, for servers that require one (mTLS).
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  // The name the server's certificate must carry, instead of the target's host.
  std::string tls_server_name_override;
  // Applied to each call unless the call passes its own. Zero, negative or
  // infinite: no deadline.
  absl::Duration timeout = absl::Seconds(30);
  // Reconnecting after a connection fails or is refused: the first wait, and
  // the most it grows to (x1.6 per failure, +-20% jitter). gRPC's own 1 s up
  // to 120 s leaves a channel failing every call fast with UNAVAILABLE for
  // minutes after its server came back; these reconnect within ~2 s.
  absl::Duration reconnect_backoff_initial = absl::Milliseconds(100);
  absl::Duration reconnect_backoff_max = absl::Seconds(2);
  // gRPC's GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, which is not a backoff: the
  // least time a connection attempt (TCP, TLS, HTTP/2) gets before it is
  // given up, 20 s by default. Shorter notices a silent peer sooner; not much
  // shorter, or a slow TLS handshake would never complete.
  absl::Duration reconnect_backoff_min = absl::Seconds(1);
  // Unary calls failing UNAVAILABLE (no connection, a server going away) are
  // retried by gRPC, this many attempts in all, 0.1 s to 1 s apart (the
  // channel's service config); 1 turns retries off, at most 5. Streams are
  // never retried. Calls still fail fast when every address is down: the
  // service config does not set waitForReady.
  int max_attempts = 4;
  // Give the channel TCP connections of its own. By default, channels with the
  // same target and options share them; a load tester opening several
  // connections to one server sets this.
  bool own_connection = false;

  // Any of the four TLS options is set: the channel uses TLS.
  bool UsesTls() const {
    return !tls_ca_file.empty() || !tls_cert_file.empty() || !tls_key_file.empty() ||
           !tls_server_name_override.empty();
  }
};

// OK, or INVALID_ARGUMENT naming the first byte of `token` that a header value
// cannot carry (gRPC aborts the process on such metadata): a bearer token is
// printable ASCII, 0x20 to 0x7e. AttentionClient::Create checks its options'
// ("bearer_token: " and this message).
absl::Status CheckBearerToken(absl::string_view token);

// The token in the file at `path`, read as the server reads its
// --auth_token_file: surrounding whitespace (a trailing newline) removed. A
// token in a file stays out of the process's command line, which other users
// can read. INVALID_ARGUMENT naming `option` and the file when it cannot be
// read, holds no token, or holds what CheckBearerToken refuses.
absl::StatusOr<std::string> ReadBearerTokenFile(absl::string_view option, const std::string& path);

// A command line's token: `token` (--token), or the one in `token_file`
// (--token_file, ReadBearerTokenFile); INVALID_ARGUMENT when both are given.
absl::StatusOr<std::string> BearerTokenFromFlags(const std::string& token,
                                                 const std::string& token_file);

// One call's routing: what a proxy hashes on, and which replica answered
// (docs/sessions.md, "Sessions across replicas").
struct CallOptions {
  // Sent as "attention-affinity" metadata. Empty: a session request's first
  // id, GetSession's id, CloseSessions' ids (a call per id); nothing for
  // other calls.
  // A request carrying several sessions should pass a group id of the
  // caller's, and the same one on every later call of those sessions.
  // Any bytes: those gRPC cannot carry in a header go %-encoded
  // (AffinityHeaderValue, common/metadata.h).
  std::string affinity;
  // When not null, set to the name of the replica that answered (its
  // "attention-replica" metadata; empty if it sent none).
  std::string* replica = nullptr;
};

// One AttendStream call: requests sent one at a time on a single HTTP/2
// stream, each answered before the next is sent, so that a caller making
// many small calls (a decoder's steps) neither opens a stream per call nor
// is routed again per call by a proxy. Opened by AttentionClient::OpenStream;
// thread-compatible.
class AttendStream {
 public:
  ~AttendStream();  // Cancels the stream if it is still open.
  AttendStream(const AttendStream&) = delete;
  AttendStream& operator=(const AttendStream&) = delete;

  // Sends `request` and waits for its answer, at most the client's timeout
  // (a deadline per message; the stream itself has none). An answer with an
  // error status comes back as that status (code and message), and the
  // stream goes on. When the stream ends instead (the server ended it, the
  // connection failed, or the timeout passed, which cancels it), the error is
  // the stream's (DEADLINE_EXCEEDED for the timeout; UNAVAILABLE when the
  // server ended it OK without answering) and open() turns false; after
  // that, FAILED_PRECONDITION.
  absl::StatusOr<v1::AttendResponse> Call(const v1::AttendRequest& request);
  // Half-closes the stream and returns how the server ended it; OK when the
  // stream had already ended.
  absl::Status Close();
  bool open() const;
  // The replica that answered (its "attention-replica" metadata; empty
  // before the first answer or if the server sent none).
  const std::string& replica() const;

 private:
  friend class AttentionClient;
  struct Impl;
  explicit AttendStream(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A connection to one attention service target. Thread-safe.
class AttentionClient {
 public:
  // INVALID_ARGUMENT for an empty target, a max_message_mb outside
  // [1, 2047], a max_attempts outside [1, 5], reconnect backoffs that are not
  // positive and finite (or initial > max), a bearer_token a header cannot
  // carry, only one of tls_cert_file and tls_key_file, or a TLS file that
  // cannot be read, is empty or is not PEM, a tls_ca_file or tls_cert_file
  // holding no certificate, a tls_key_file that is encrypted or not the
  // certificate's, or an expired certificate (naming it). Connects
  // lazily: an unreachable target or a failed TLS handshake fails the first
  // call with UNAVAILABLE.
  static absl::StatusOr<std::unique_ptr<AttentionClient>> Create(const ClientOptions& options);

  AttentionClient(const AttentionClient&) = delete;
  AttentionClient& operator=(const AttentionClient&) = delete;

  // The server's error comes back as the status (same code and message);
  // DEADLINE_EXCEEDED after options.timeout, UNAVAILABLE when unreachable.
  absl::StatusOr<v1::AttendResponse> Attend(const v1::AttendRequest& request,
                                            const CallOptions& call = {});
  // Opens an AttendStream carrying call.affinity (when not empty) and the
  // token; call.replica is not used (see AttendStream::replica). Streams are
  // never retried. Sends nothing until the first Call.
  std::unique_ptr<AttendStream> OpenStream(const CallOptions& call = {});
  absl::StatusOr<v1::ServerInfo> GetServerInfo();
  absl::StatusOr<v1::ListModelsResponse> ListModels();
  absl::StatusOr<v1::GetModelResponse> GetModel(const std::string& name);
  // Closes the sessions `ids` and frees their caches. OK even when some were
  // not open: the answer lists them in not_found. Without call.affinity,
  // several ids go one call per distinct id, each with its own id as
  // affinity (so a proxy routes each to its replica); the first failed
  // call's error is returned. client/session.h keeps a session's ids and positions for a
  // caller.
  absl::StatusOr<v1::CloseSessionsResponse> CloseSessions(const std::vector<std::string>& ids,
                                                          const CallOptions& call = {});
  // One open session's position, heads, dims, dtype and bytes; NOT_FOUND
  // naming the id when it is not open (unknown, closed, expired or evicted).
  absl::StatusOr<v1::SessionInfo> GetSession(const std::string& id,
                                             const CallOptions& call = {});
  // grpc.health.v1 Check for `service` ("" = the whole server); returns the
  // status name: "SERVING", "NOT_SERVING", ...
  absl::StatusOr<std::string> Health(const std::string& service = "");

  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  const ClientOptions& options() const { return options_; }

 private:
  AttentionClient(const ClientOptions& options, std::shared_ptr<grpc::Channel> channel);
  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

}  // namespace attention::client

#endif  // ATTENTION_CLIENT_ATTENTION_CLIENT_H_
