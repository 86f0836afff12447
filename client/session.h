#ifndef ATTENTION_CLIENT_SESSION_H_
#define ATTENTION_CLIENT_SESSION_H_

// One session for a decoder: keys and values kept on the server between
// requests (AttendRequest.session), so each step sends only its new rows.
// Session fills in the id and positions, and can keep the rows it sent to
// recreate a session the server lost. docs/client.md#sessions.

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"
#include "client/attention_client.h"

namespace attention::client {

struct SessionOptions {
  // The session's id: not empty, at most 128 bytes, and no other open session
  // on the server may have it.
  std::string id;
  // What every request of the session carries besides its rows: model (or
  // num_heads and score), mask.causal (BOTTOM_RIGHT is a decoder's mask),
  // layout, output_dtype, precision, need_weights, ... Its query, key, value
  // and session must be unset.
  v1::AttendRequest request;
  // How the server stores the cached rows, fixed when it creates the session:
  // FLOAT32 or BFLOAT16.
  v1::Tensor::DType cache_dtype = v1::Tensor::FLOAT32;
  // Keep a copy of every key and value row sent, so that a session the server
  // no longer has (NOT_FOUND: expired, evicted, its replica restarted) is
  // recreated from them. Costs the rows' bytes in this process.
  bool keep_rows = false;
  // Sent as "attention-affinity" on every call of the session, so that a
  // proxy hashing on it routes them all to one replica; empty: the id.
  std::string affinity;
  // Send the steps as messages on one AttendStream (AttentionClient::
  // OpenStream) instead of a unary Attend each: no HTTP/2 stream to open per
  // step, and a proxy routes the stream once. The stream opens at the first
  // step and again after one ends. A step whose stream ends UNAVAILABLE
  // without answering it (a server draining, a connection lost) is sent again
  // on a new stream, as the client's retries would a unary call: up to
  // max_attempts in all, 0.1 s to 1 s apart. Close closes the stream.
  bool stream = false;
};

// A session as its client sees it: the id, the rows the server holds
// (position), and with keep_rows every key and value row sent. The first Step
// creates the session on the server; its rows are the prefill. Errors are
// absl::Status with the server's code and message. Thread-compatible: one
// Session per decoder, any number of them on one AttentionClient.
class Session {
 public:
  // INVALID_ARGUMENT for a null client, an empty id or one over 128 bytes, a
  // request that sets query, key, value or session, or a cache_dtype other
  // than FLOAT32 and BFLOAT16. Contacts no server. `client` must outlive the
  // session.
  static absl::StatusOr<std::unique_ptr<Session>> Create(AttentionClient* client,
                                                         SessionOptions options);

  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Sends `query` and appends `key` and `value` to the session (absent: key =
  // query and value = key, the self-attention rule), with ids {id()} and
  // positions {position()}, and create on the first step. Shapes as for Attend
  // with a batch of 1: rank 3 [1, S_new, E] ([S_new, 1, E] with SEQUENCE_FIRST)
  // or rank 4 [1, H, S_new, D]. Returns the answer, which attends over every row
  // the session holds, and sets position() to its session_positions (an answer
  // without them: position() + the rows sent). A step the server refuses changes
  // nothing here (nor, by the contract, on the server). One that fails otherwise
  // (DEADLINE_EXCEEDED, UNAVAILABLE, CANCELLED, UNKNOWN, INTERNAL, DATA_LOSS, or
  // ABORTED: a step sent again whose first attempt was applied; a create sent
  // again so, which the server refuses ALREADY_EXISTS, is ABORTED here unless
  // the session it names is another's) may have been applied all the same: the
  // next step first asks the server where the session is (GetSession, waiting up
  // to the client's timeout while a request still holds it; DEADLINE_EXCEEDED if
  // one still does) and goes on from there. If the server holds one such step's
  // rows more, and names it as the last step that appended (each step carries a
  // random session.step_id; a server that names none: by the count alone), that
  // step counts as applied (position() moves past them, and with keep_rows they
  // are kept), and a step sending the same rows again is taken as its retry: it
  // is sent read-only (appending nothing), and its answer is the one the lost
  // answer was; with keep_rows, if the session is gone by then (NOT_FOUND naming
  // it), the retry recreates it from the kept rows, which hold the step's, and
  // is answered over them; a retry ABORTED (the session moved on meanwhile)
  // makes the next step ask again. If the server holds fewer rows than
  // position() (a stale copy on a replica the session has moved back to), with
  // keep_rows the copy is closed and the step recreates the session, else
  // FAILED_PRECONDITION; with keep_rows, a count no such step explains (another
  // writer) is FAILED_PRECONDITION. With keep_rows, rows whose dtype or other
  // dims differ from those kept are INVALID_ARGUMENT, unsent; a step the server
  // answers that it has no such session (NOT_FOUND naming it: not another
  // NOT_FOUND, such as a model not registered) after the first is retried once
  // as a recreation: one request with create whose key and value are every kept
  // row and then this step's, and whose query is this step's, so its answer is
  // this step's answer (recreations() counts them); one refused ALREADY_EXISTS
  // for another client's session (opened since the server lost this one) ends
  // the session: open() turns false, and Close sends nothing. FAILED_PRECONDITION
  // after Close or such an end.
  absl::StatusOr<v1::AttendResponse> Step(v1::Tensor query,
                                          std::optional<v1::Tensor> key = std::nullopt,
                                          std::optional<v1::Tensor> value = std::nullopt);

  // Closes the session's stream, if any, then the session on the server
  // (CloseSessions). OK also when the server no longer had it; a session no
  // step created sends nothing. After a first step whose outcome is unknown
  // it asks the server first (as a step would), and closes the session only
  // if it names that step: never another client's session of the same id
  // (DEADLINE_EXCEEDED while a request holds it; Close may be called again).
  // Later steps are FAILED_PRECONDITION. Dropping
  // a Session does not close it: the server keeps it until it expires or is
  // evicted.
  absl::Status Close();

  // After a Close that returned OK: the server named the session among those
  // it closed. False when it was no longer open there (it expired, was
  // evicted, lives on another replica now, or a retried close found it
  // closed by the first attempt), or nothing was sent (no call created it,
  // or another client's session took its id).
  bool found_at_close() const { return found_at_close_; }

  const std::string& id() const { return options_.id; }
  // Rows the server holds after the last answered step: the next position.
  int64_t position() const { return position_; }
  // A step created the session and Close has not been called.
  bool open() const { return created_ && !closed_; }
  // Steps answered by recreating the session.
  int64_t recreations() const { return recreations_; }
  // Bytes of the kept key and value rows (0 without keep_rows).
  int64_t kept_bytes() const;
  // The replica that answered the last step (its "attention-replica"
  // metadata; empty before the first answer or if the server sent none).
  const std::string& replica() const { return replica_; }

 private:
  // The rows of one input (keys or values) sent so far, in order.
  class RowLog;

  Session(AttentionClient* client, SessionOptions options);

  // After an OK answer to `step` sent at position `base` (0 for a create):
  // the new position, and with keep_rows the step's rows.
  void Advance(const v1::AttendRequest& step, int64_t base, const v1::AttendResponse& answer);
  // Every call's affinity, and where the answering replica's name goes.
  CallOptions Call();
  // Sends one request of the session: on the stream with options.stream,
  // else as a unary Attend.
  absl::StatusOr<v1::AttendResponse> Send(const v1::AttendRequest& request);
  // `step` (which the server answered NOT_FOUND) as a create over the kept
  // rows and then the step's; step_kept: `step` is the read-only retry of
  // the step Resync found applied, whose rows are among the kept ones.
  absl::StatusOr<v1::AttendResponse> Recreate(const v1::AttendRequest& step, bool step_kept);
  // The status of a step whose create (the first step's, or a recreation's,
  // of `rows` rows) the server refused ALREADY_EXISTS, asked of the server
  // once no request holds the session: that refusal as it is when the
  // session names another step (the id is another's), ABORTED (an outcome
  // unknown) when it names this one or is gone, DEADLINE_EXCEEDED when a
  // request still holds it past the timeout. The channel sends a step again
  // when its connection fails (so does a stream session), and a create whose
  // first attempt was applied is refused so.
  absl::Status CreateRefused(const std::string& step_id, int64_t rows, absl::Status refused);
  // GetSession, asked again every 20 ms while a request holds the session
  // (idle_ms 0), until the options' timeout.
  absl::StatusOr<v1::SessionInfo> InfoOnceIdle();
  // Where the server has the session, after steps whose outcome is unknown
  // (Step's contract).
  absl::Status Resync();
  // After an answered step (or a resync that found one applied): no step
  // before it can still be applied, nor be retried.
  void Settled();
  // After a resync that settled the unsure steps: none is unsure any more;
  // the step found applied before, if any, still takes its retry read-only
  // (a resync after that retry was ABORTED keeps it so).
  void UnsureSettled();

  AttentionClient* client_;
  SessionOptions options_;
  int64_t position_ = 0;
  bool created_ = false;
  bool closed_ = false;
  bool found_at_close_ = false;
  // A recreation found the id another client's: the session is over, and
  // never touches that one.
  bool taken_ = false;
  int64_t recreations_ = 0;
  std::string replica_;
  std::unique_ptr<RowLog> keys_;
  std::unique_ptr<RowLog> values_;
  // Steps sent at position_ whose outcome is unknown, and whether the next
  // step asks the server first (Resync).
  std::vector<v1::AttendRequest> unsure_;
  bool resync_needed_ = false;
  // The unsure step Resync found applied, until a step other than its retry
  // is sent or its retry is answered.
  std::optional<v1::AttendRequest> applied_;
  // With options.stream, the open stream (null before the first step and
  // after one ended).
  std::unique_ptr<AttendStream> stream_;
  // Draws the waits between a stream step's attempts.
  std::minstd_rand random_;
  // Draws each step's session.step_id (64 bits, seeded by the system).
  std::mt19937_64 step_ids_;
};

}  // namespace attention::client

#endif  // ATTENTION_CLIENT_SESSION_H_
