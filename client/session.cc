#include "client/session.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/tensors.h"
#include "common/enum_name.h"
#include "common/shape_string.h"
#include "common/status_macros.h"

namespace attention::client {
namespace {

// The server's limit on a session id.
constexpr size_t kMaxIdBytes = 128;

// A stream session's waits before sending a step again: the channel's retry
// policy's (attention_client.cc, ServiceConfig).
constexpr absl::Duration kFirstBackoff = absl::Milliseconds(100);
constexpr absl::Duration kMaxBackoff = absl::Seconds(1);

// The dim of `rows` that counts rows: rank 3 [B, S, E] (SEQUENCE_FIRST
// [S, B, E]) or rank 4 [B, H, S, D].
absl::StatusOr<int> SequenceAxis(const v1::AttendRequest& request, absl::string_view name,
                                 const v1::Tensor& rows) {
  if (rows.shape_size() == 3) return request.layout() == v1::AttendRequest::SEQUENCE_FIRST ? 0 : 1;
  if (rows.shape_size() == 4) return 2;
  return absl::InvalidArgumentError(absl::StrCat(name, ": shape ", ShapeString(rows.shape()),
                                                 " is not rank 3 or 4, as a session's rows are"));
}

// The elements of a float tensor as the little-endian bytes of its dtype,
// from `data` or `float_data`.
absl::StatusOr<std::string> ElementBytes(absl::string_view name, const v1::Tensor& tensor) {
  const std::vector<int64_t> shape(tensor.shape().begin(), tensor.shape().end());
  absl::StatusOr<std::vector<float>> values = ReadFloats(tensor);
  if (!values.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", values.status().message()));
  }
  if (!tensor.data().empty()) return tensor.data();
  ATTN_ASSIGN_OR_RETURN(v1::Tensor encoded, MakeFloatTensor(shape, *values, tensor.dtype()));
  return std::move(*encoded.mutable_data());
}

// The keys (or values) the self-attention rule makes of an absent one.
const v1::Tensor& Keys(const v1::AttendRequest& request) {
  return request.has_key() ? request.key() : request.query();
}
const v1::Tensor& Values(const v1::AttendRequest& request) {
  return request.has_value() ? request.value() : Keys(request);
}
// The fields those come from, for errors.
const char* KeysField(const v1::AttendRequest& request) {
  return request.has_key() ? "key" : "query";
}
const char* ValuesField(const v1::AttendRequest& request) {
  return request.has_value() ? "value" : KeysField(request);
}

// Whether a failed call may have been applied all the same: its answer was
// lost (a deadline, a connection that failed, a cancelled call), or it is
// ABORTED (a step sent again whose first attempt was applied).
bool OutcomeUnknown(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kDataLoss:
      return true;
    default:
      return false;
  }
}

// Whether `status` says that the server has no session `id` (every such
// NOT_FOUND of the server's starts so, docs/errors.md), rather than another
// NOT_FOUND (a model that is not registered).
bool SessionNotFound(const absl::Status& status, absl::string_view id) {
  return status.code() == absl::StatusCode::kNotFound &&
         absl::StartsWith(status.message(), absl::StrCat("session \"", id, "\""));
}

// Whether steps a and b send the same key and value rows.
bool SameRows(const v1::AttendRequest& a, const v1::AttendRequest& b) {
  return Keys(a).SerializeAsString() == Keys(b).SerializeAsString() &&
         Values(a).SerializeAsString() == Values(b).SerializeAsString();
}

// How often Resync asks while a request holds the session.
constexpr absl::Duration kResyncPoll = absl::Milliseconds(20);

}  // namespace

// The bytes of each index of the dims before the sequence axis are kept in a
// string of their own, so a step appends its rows to each and nothing kept
// is copied until a recreation puts it all in one tensor.
class Session::RowLog {
 public:
  explicit RowLog(std::string name) : name_(std::move(name)) {}

  // OK when `rows`, with its sequence at `axis`, can follow the rows kept: a
  // float tensor whose dtype, rank and other dims are theirs. `field` names
  // the request's tensor they come from.
  absl::Status Check(const v1::Tensor& rows, int axis, absl::string_view field) const {
    if (!dims_.has_value()) return absl::OkStatus();
    bool same = rows.dtype() == dtype_ && axis == axis_ &&
                rows.shape_size() == static_cast<int>(dims_->size());
    for (int d = 0; same && d < rows.shape_size(); ++d) {
      same = d == axis || rows.shape(d) == (*dims_)[d];
    }
    if (same) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", EnumName(rows.dtype()), " ", ShapeString(rows.shape()),
        " cannot follow the session's kept ", EnumName(dtype_), " ", name_, " rows ",
        ShapeString(*dims_), " (keep_rows needs one dtype, and one shape but for the rows)"));
  }

  absl::Status Append(const v1::Tensor& rows, int axis) {
    ATTN_RETURN_IF_ERROR(Check(rows, axis, name_));
    ATTN_ASSIGN_OR_RETURN(const std::string bytes, ElementBytes(name_, rows));
    if (!dims_.has_value()) {
      dims_.emplace(rows.shape().begin(), rows.shape().end());
      (*dims_)[axis] = 0;
      dtype_ = rows.dtype();
      axis_ = axis;
      chunks_.resize(Outer());
    }
    const size_t chunk = chunks_.empty() ? 0 : bytes.size() / chunks_.size();
    for (size_t i = 0; i < chunks_.size(); ++i) chunks_[i].append(bytes, i * chunk, chunk);
    (*dims_)[axis] += rows.shape(axis);
    return absl::OkStatus();
  }

  // A tensor of every kept row followed by those of `rows`.
  absl::StatusOr<v1::Tensor> With(const v1::Tensor& rows, int axis) const {
    if (!dims_.has_value() || chunks_.empty()) return rows;
    ATTN_RETURN_IF_ERROR(Check(rows, axis, name_));
    ATTN_ASSIGN_OR_RETURN(const std::string bytes, ElementBytes(name_, rows));
    return Joined(bytes, rows.shape(axis));
  }

  // A tensor of every kept row (empty before the first is kept).
  v1::Tensor All() const { return dims_.has_value() ? Joined("", 0) : v1::Tensor(); }

  int64_t bytes() const {
    int64_t total = 0;
    for (const std::string& chunk : chunks_) total += static_cast<int64_t>(chunk.size());
    return total;
  }

 private:
  // The kept rows followed by `count` more, whose bytes (the elements of
  // a tensor of this log's layout) are `bytes`.
  v1::Tensor Joined(const std::string& bytes, int64_t count) const {
    const size_t chunk = chunks_.empty() ? 0 : bytes.size() / chunks_.size();
    v1::Tensor all;
    all.set_dtype(dtype_);
    all.mutable_shape()->Assign(dims_->begin(), dims_->end());
    all.set_shape(axis_, (*dims_)[axis_] + count);
    std::string* data = all.mutable_data();
    data->reserve(static_cast<size_t>(this->bytes()) + bytes.size());
    for (size_t i = 0; i < chunks_.size(); ++i) {
      data->append(chunks_[i]);
      data->append(bytes, i * chunk, chunk);
    }
    return all;
  }

  // Product of the dims before the sequence axis.
  size_t Outer() const {
    size_t outer = 1;
    for (int d = 0; d < axis_; ++d) outer *= static_cast<size_t>((*dims_)[d]);
    return outer;
  }

  const std::string name_;
  // Of everything kept, the rows at axis_; unset until the first append.
  std::optional<std::vector<int64_t>> dims_;
  v1::Tensor::DType dtype_ = v1::Tensor::FLOAT32;
  int axis_ = 0;
  std::vector<std::string> chunks_;
};

absl::StatusOr<std::unique_ptr<Session>> Session::Create(AttentionClient* client,
                                                         SessionOptions options) {
  if (client == nullptr) return absl::InvalidArgumentError("session: client is null");
  if (options.id.empty() || options.id.size() > kMaxIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("session id \"", options.id, "\" has ",
                                                   options.id.size(), " bytes; want 1 to ",
                                                   kMaxIdBytes));
  }
  const v1::AttendRequest& request = options.request;
  if (request.has_query() || request.has_key() || request.has_value() || request.has_session()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session ", options.id,
        ": options.request must leave query, key, value and session unset; Step sets them"));
  }
  if (options.cache_dtype != v1::Tensor::FLOAT32 && options.cache_dtype != v1::Tensor::BFLOAT16) {
    return absl::InvalidArgumentError(absl::StrCat("session ", options.id, ": cache_dtype ",
                                                   EnumName(options.cache_dtype),
                                                   " is not FLOAT32 or BFLOAT16"));
  }
  return std::unique_ptr<Session>(new Session(client, std::move(options)));
}

Session::Session(AttentionClient* client, SessionOptions options)
    : client_(client),
      options_(std::move(options)),
      random_(static_cast<std::minstd_rand::result_type>(
          std::hash<std::string>()(options_.id) ^
          static_cast<size_t>(absl::ToUnixNanos(absl::Now())))),
      step_ids_([] {
        std::random_device device;
        return (uint64_t{device()} << 32) ^ device();
      }()) {
  if (options_.keep_rows) {
    keys_ = std::make_unique<RowLog>("key");
    values_ = std::make_unique<RowLog>("value");
  }
}

Session::~Session() = default;

int64_t Session::kept_bytes() const {
  return keys_ == nullptr ? 0 : keys_->bytes() + values_->bytes();
}

absl::StatusOr<v1::AttendResponse> Session::Step(v1::Tensor query, std::optional<v1::Tensor> key,
                                                 std::optional<v1::Tensor> value) {
  if (closed_) {
    return absl::FailedPreconditionError(absl::StrCat("session ", id(), " is closed"));
  }
  if (taken_) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", id(),
                     " is over: the server lost it, and another client has opened the id since; "
                     "open a session of another id"));
  }
  v1::AttendRequest request = options_.request;
  *request.mutable_query() = std::move(query);
  if (key.has_value()) *request.mutable_key() = *std::move(key);
  if (value.has_value()) *request.mutable_value() = *std::move(value);
  if (keys_ != nullptr) {
    ATTN_ASSIGN_OR_RETURN(const int key_axis,
                          SequenceAxis(request, KeysField(request), Keys(request)));
    ATTN_ASSIGN_OR_RETURN(const int value_axis,
                          SequenceAxis(request, ValuesField(request), Values(request)));
    ATTN_RETURN_IF_ERROR(keys_->Check(Keys(request), key_axis, KeysField(request)));
    ATTN_RETURN_IF_ERROR(values_->Check(Values(request), value_axis, ValuesField(request)));
  }
  if (resync_needed_) ATTN_RETURN_IF_ERROR(Resync());
  // The step that failed, sent again (its rows the same), after the server
  // turned out to have applied it: asked read-only, for the answer it had.
  // Kept until such a retry is answered, so that a retry of a failed retry
  // is one too; another step ends it.
  const bool again = applied_.has_value() && SameRows(request, *applied_);
  if (!again) applied_.reset();
  if (again) {
    request.clear_key();
    request.clear_value();
    request.mutable_session()->set_read_only(true);
  }
  v1::SessionSpec* spec = request.mutable_session();
  spec->add_ids(id());
  spec->add_positions(position_);
  // The server remembers it for Resync.
  spec->set_step_id(absl::StrCat(absl::Hex(step_ids_(), absl::kZeroPad16)));
  if (!created_) {
    spec->set_create(true);
    spec->set_cache_dtype(options_.cache_dtype);
  }
  absl::StatusOr<v1::AttendResponse> answer = Send(request);
  if (answer.ok()) {
    if (!again) Advance(request, position_, *answer);
    Settled();
    return answer;
  }
  if (again) {
    // The session lost since its step was applied: the kept rows, which
    // hold the step's, make it again, and its query is answered over them.
    if (SessionNotFound(answer.status(), id()) && keys_ != nullptr) {
      answer = Recreate(request, /*step_kept=*/true);
      if (answer.ok()) Settled();
      // A recreation sent again after its first attempt was applied: the
      // kept rows, position_ of them, hold the step's.
      if (answer.status().code() == absl::StatusCode::kAlreadyExists) {
        answer = CreateRefused(request.session().step_id(), position_, answer.status());
      }
    }
    // Otherwise the retry appended nothing, so nothing is unsure; applied_
    // stays, so that the same rows sent again are a retry again (after a
    // recreation whose outcome is unknown too: read-only if it was applied,
    // else NOT_FOUND and recreated). ABORTED: the session is no longer
    // where the step left it (another writer's rows, or a stale copy on a
    // replica it moved back to; or, above, this recreation's own), so the
    // next step asks first.
    if (answer.status().code() == absl::StatusCode::kAborted) resync_needed_ = true;
    return answer;
  }
  if (SessionNotFound(answer.status(), id()) && created_ && keys_ != nullptr) {
    answer = Recreate(request, /*step_kept=*/false);
    if (answer.ok()) {
      Settled();
      return answer;
    }
  }
  if (answer.status().code() == absl::StatusCode::kAlreadyExists) {
    // Only a create is refused so: the first step, or a recreation, which
    // carries the kept rows (position_ of them) before the step's.
    const absl::StatusOr<int> axis = SequenceAxis(request, "key", Keys(request));
    const int64_t rows = (created_ ? position_ : 0) + (axis.ok() ? Keys(request).shape(*axis) : 0);
    answer = CreateRefused(request.session().step_id(), rows, answer.status());
  }
  if (OutcomeUnknown(answer.status())) {
    unsure_.push_back(std::move(request));
    resync_needed_ = true;
  }
  return answer.status();
}

absl::StatusOr<v1::AttendResponse> Session::Recreate(const v1::AttendRequest& step,
                                                     bool step_kept) {
  v1::AttendRequest request = step;
  v1::SessionSpec* spec = request.mutable_session();
  spec->set_read_only(false);
  spec->set_positions(0, 0);
  spec->set_create(true);
  spec->set_cache_dtype(options_.cache_dtype);
  if (step_kept) {
    *request.mutable_key() = keys_->All();
    *request.mutable_value() = values_->All();
    ATTN_ASSIGN_OR_RETURN(v1::AttendResponse answer, Send(request));
    ++recreations_;
    return answer;
  }
  ATTN_ASSIGN_OR_RETURN(const int key_axis, SequenceAxis(step, "key", Keys(step)));
  ATTN_ASSIGN_OR_RETURN(const int value_axis, SequenceAxis(step, "value", Values(step)));
  ATTN_ASSIGN_OR_RETURN(*request.mutable_key(), keys_->With(Keys(step), key_axis));
  ATTN_ASSIGN_OR_RETURN(*request.mutable_value(), values_->With(Values(step), value_axis));
  ATTN_ASSIGN_OR_RETURN(v1::AttendResponse answer, Send(request));
  ++recreations_;
  Advance(step, /*base=*/request.key().shape(key_axis) - Keys(step).shape(key_axis), answer);
  return answer;
}

absl::StatusOr<v1::SessionInfo> Session::InfoOnceIdle() {
  const ClientOptions& options = client_->options();
  const absl::Time deadline = options.timeout > absl::ZeroDuration() ? absl::Now() + options.timeout
                                                                     : absl::InfiniteFuture();
  for (;;) {
    absl::StatusOr<v1::SessionInfo> info = client_->GetSession(id(), Call());
    if (!info.ok() || info->idle_ms() != 0 || absl::Now() >= deadline) return info;
    absl::SleepFor(kResyncPoll);
  }
}

absl::Status Session::CreateRefused(const std::string& step_id, int64_t rows,
                                    absl::Status refused) {
  // Asked once no request holds it: while another client's does, its
  // last step may be this one's count of rows, or the request may be this
  // step's own first attempt.
  const absl::StatusOr<v1::SessionInfo> info = InfoOnceIdle();
  if (info.ok() && info->idle_ms() != 0) {
    // Ours only if it names this step as the last that appended (a server
    // that names none: by the count alone).
    const bool ours =
        info->has_last_step_id() ? info->last_step_id() == step_id : info->position() == rows;
    if (!ours) {
      // Another's session: the id is taken. A recreation's (this client's
      // session lost since) ends this one.
      if (!created_) return refused;
      created_ = false;
      taken_ = true;
      return absl::Status(refused.code(),
                          absl::StrCat(refused.message(),
                                       "; the server had lost this client's session, and another "
                                       "client has opened the id since: this session is over"));
    }
    return absl::AbortedError(absl::StrCat(
        refused.message(), "; it holds this step's ", rows,
        " rows: an earlier attempt of the step, whose answer was lost, created it; send the "
        "step again for its answer"));
  }
  if (info.ok()) {
    // Held past the timeout, by this step's first attempt or by another's
    // request: asked again by the next step.
    return absl::DeadlineExceededError(absl::StrCat(
        refused.message(),
        "; a request still holds it, so whether it is this step's own (an "
        "earlier attempt of the step may have created it) is not known yet; send the step "
        "again"));
  }
  // Gone again (that attempt failed after all), or the server could not
  // say: settled by the next step, which takes over no session that does not
  // name one of this client's steps (Resync).
  return absl::AbortedError(
      absl::StrCat(refused.message(),
                   "; it may be this step's own (an earlier attempt of the step, whose "
                   "answer was lost, may have created it): send the step again"));
}

void Session::Settled() {
  UnsureSettled();
  applied_.reset();
}

void Session::UnsureSettled() {
  unsure_.clear();
  resync_needed_ = false;
}

absl::Status Session::Resync() {
  const absl::StatusOr<v1::SessionInfo> info = InfoOnceIdle();
  if (!info.ok() && !SessionNotFound(info.status(), id())) return info.status();
  if (!info.ok()) {
    // Never created, or lost (the step is then NOT_FOUND and, with kept
    // rows, recreated): the server holds none of the unsure steps.
    UnsureSettled();
    return absl::OkStatus();
  }
  if (info->idle_ms() == 0) {
    return absl::DeadlineExceededError(absl::StrCat(
        "session ", id(), ": a request still holds it, so whether the step that failed before "
        "was applied is not known yet; try the step again"));
  }
  const int64_t held = info->position();
  if (created_ && held == position_) {
    // None of them applied (nor can one be later: no request holds the
    // session). They stay listed should a later step be ABORTED.
    resync_needed_ = false;
    return absl::OkStatus();
  }
  if (created_ && held < position_) {
    // Fewer rows than answered steps put there: a stale copy, left on a
    // replica the session has moved back to (it was recreated elsewhere
    // meanwhile). With kept rows: close it, and the step, NOT_FOUND,
    // recreates the session from them.
    if (keys_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "session ", id(), ": the server holds ", held, " rows, fewer than the ", position_,
          " answered steps put there: a stale copy (its replica left and came back while the "
          "session lived elsewhere); close the session and create it again"));
    }
    ATTN_RETURN_IF_ERROR(client_->CloseSessions({id()}, Call()).status());
    UnsureSettled();
    return absl::OkStatus();
  }
  const v1::AttendRequest* applied = nullptr;
  bool ambiguous = false;
  // The step the server last applied, where it names it: one of ours only
  // if it has that id (another writer's may have none); a server from
  // before step ids: by the count alone.
  const bool named = info->has_last_step_id();
  const std::string& last = info->last_step_id();
  for (const v1::AttendRequest& step : unsure_) {
    const absl::StatusOr<int> axis = SequenceAxis(step, "key", Keys(step));
    if (!axis.ok() || position_ + Keys(step).shape(*axis) != held) continue;
    if (named && step.session().step_id() != last) continue;
    if (applied == nullptr) {
      applied = &step;
    } else if (!SameRows(step, *applied)) {
      ambiguous = true;
    }
  }
  if (applied != nullptr && !ambiguous) {
    Advance(*applied, position_, v1::AttendResponse());
    v1::AttendRequest found = *applied;  // Settled() clears unsure_
    Settled();
    applied_ = std::move(found);
    return absl::OkStatus();
  }
  if (!created_) {
    // No first step of this client's made it: the session is another's,
    // never taken over (the step's create is refused ALREADY_EXISTS), nor
    // closed by Close().
    UnsureSettled();
    return absl::OkStatus();
  }
  if (keys_ == nullptr) {
    // Nothing kept to match: go on at the server's position.
    created_ = true;
    position_ = held;
    UnsureSettled();
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "session ", id(), ": the server holds ", held, " rows, this client ", position_, " and ",
      unsure_.size(), " step(s) whose outcome is unknown, none of which makes ", held,
      named ? absl::StrCat(" as its last step (step_id \"", last, "\") did") : "",
      ": the kept rows no longer match the server's (another writer?); close the session and "
      "open another"));
}

CallOptions Session::Call() {
  CallOptions call;
  call.affinity = options_.affinity.empty() ? options_.id : options_.affinity;
  call.replica = &replica_;
  return call;
}

absl::StatusOr<v1::AttendResponse> Session::Send(const v1::AttendRequest& request) {
  if (!options_.stream) return client_->Attend(request, Call());
  // Attempts as the channel's retry policy makes them for a unary call
  // (attention_client.cc, ServiceConfig): a wait of up to 0.1 s before the
  // second, doubling up to 1 s, each drawn at random below it.
  const int attempts = client_->options().max_attempts;
  absl::Duration backoff = kFirstBackoff;
  for (int attempt = 1;; ++attempt) {
    if (stream_ == nullptr) stream_ = client_->OpenStream(Call());
    absl::StatusOr<v1::AttendResponse> answer = stream_->Call(request);
    replica_ = stream_->replica();
    if (stream_->open()) return answer;
    // The stream ended instead of answering; the next attempt or step opens
    // another. UNAVAILABLE without an answer: a draining server had not
    // taken the request (it answers what it took), or the connection
    // failed; UNKNOWN ("No status received"), CANCELLED (a reset stream) or
    // INTERNAL: the server or a proxy between went away. The step is sent
    // again on a new stream (which a proxy routes afresh) for these; if the
    // server had applied it, that attempt is ABORTED, and the next step asks
    // the server where the session is (Resync).
    stream_.reset();
    const absl::StatusCode code = answer.status().code();
    const bool resend = code == absl::StatusCode::kUnavailable ||
                        code == absl::StatusCode::kUnknown ||
                        code == absl::StatusCode::kCancelled || code == absl::StatusCode::kInternal;
    if (attempt >= attempts || !resend) return answer;
    absl::SleepFor(backoff * std::uniform_real_distribution<double>(0, 1)(random_));
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

void Session::Advance(const v1::AttendRequest& step, int64_t base,
                      const v1::AttendResponse& answer) {
  created_ = true;
  const absl::StatusOr<int> axis = SequenceAxis(step, "key", Keys(step));
  if (answer.session_positions_size() == 1) {
    position_ = answer.session_positions(0);
  } else if (axis.ok()) {
    position_ = base + Keys(step).shape(*axis);
  }
  if (keys_ == nullptr) return;
  // Step checked both before sending, so these cannot fail.
  keys_->Append(Keys(step), *axis).IgnoreError();
  values_->Append(Values(step), *SequenceAxis(step, "value", Values(step))).IgnoreError();
}

absl::Status Session::Close() {
  if (closed_) return absl::OkStatus();
  if (stream_ != nullptr) {
    // How the stream ended does not matter to the session: its rows are
    // closed below either way.
    stream_->Close().IgnoreError();
    stream_.reset();
  }
  if (taken_) {
    closed_ = true;
    return absl::OkStatus();
  }
  // A first step whose outcome is unknown may have created it: closed only
  // if the server names that step, never another client's session of the id.
  if (!created_ && !unsure_.empty()) ATTN_RETURN_IF_ERROR(Resync());
  if (created_) {
    absl::StatusOr<v1::CloseSessionsResponse> closed = client_->CloseSessions({id()}, Call());
    if (!closed.ok()) return closed.status();
    found_at_close_ = !closed->closed().empty();
  }
  closed_ = true;
  Settled();
  return absl::OkStatus();
}

}  // namespace attention::client
