#include "server/session_store.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/enum_name.h"
#include "common/status_macros.h"
#include "engine/engine.h"

namespace attention::server {
namespace {

// "32.0 KiB", "1.03 MiB": enough digits that a small request's bytes show.
std::string Size(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  return b < (1 << 20) ? absl::StrFormat("%.1f KiB", b / 1024)
                       : absl::StrFormat("%.2f MiB", b / (1 << 20));
}

bool Expires(absl::Duration idle_limit) {
  return idle_limit != absl::ZeroDuration() && idle_limit != absl::InfiniteDuration();
}

}  // namespace

SessionStore::SessionStore(const Options& options, Metrics* metrics,
                           std::function<absl::Time()> now)
    : options_(options), metrics_(metrics), now_(std::move(now)) {
  if (options_.sweep_every > absl::ZeroDuration() && Expires(options_.idle_limit)) {
    sweeper_ = std::thread([this] { Sweep(); });
  }
}

SessionStore::~SessionStore() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (sweeper_.joinable()) sweeper_.join();
}

void SessionStore::Sweep() {
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stopping_), options_.sweep_every)) {
    ExpireLocked();
    PublishLocked();
  }
}

void SessionStore::ExpireIdle() {
  absl::MutexLock lock(&mu_);
  ExpireLocked();
  PublishLocked();
}

absl::Status SessionStore::NotOpen(const std::string& id) {
  return absl::NotFoundError(absl::StrCat(
      "session \"", id,
      "\" is not open (unknown, closed, expired or evicted); create it again with its rows"));
}

absl::Status SessionStore::CheckEnabled(const char* field) const {
  if (enabled()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(field, ": sessions are off on this server (--session_memory_mb=0)"));
}

absl::StatusOr<SessionRequest> SessionStore::Parse(const v1::SessionSpec& spec,
                                                   int64_t batch) const {
  ATTN_RETURN_IF_ERROR(CheckEnabled("session"));
  SessionRequest r;
  if (spec.ids_size() != batch) {
    return absl::InvalidArgumentError(absl::StrCat("session.ids: ", spec.ids_size(),
                                                   " ids do not match the batch size ", batch,
                                                   " of query (one session per batch row)"));
  }
  if (spec.positions_size() != spec.ids_size()) {
    return absl::InvalidArgumentError(absl::StrCat("session.positions: ", spec.positions_size(),
                                                   " positions for ", spec.ids_size(),
                                                   " ids (one per id)"));
  }
  absl::flat_hash_set<std::string> seen;
  for (int b = 0; b < spec.ids_size(); ++b) {
    const std::string& id = spec.ids(b);
    ATTN_RETURN_IF_ERROR(CheckId(absl::StrCat("session.ids[", b, "]"), id));
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("session.ids[", b, "]: \"", id, "\" appears twice in one request"));
    }
    const int64_t position = spec.positions(b);
    if (position < 0 || (spec.create() && position != 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("session.positions[", b, "]: ", position,
                       spec.create() ? "; a session being created holds 0 rows" : " is negative"));
    }
    r.ids.push_back(id);
    r.positions.push_back(position);
  }
  if (spec.create() && spec.read_only()) {
    return absl::InvalidArgumentError(
        "session.read_only: a new session has no rows to attend; create it with its first rows");
  }
  switch (spec.cache_dtype()) {
    case v1::Tensor::FLOAT32:
      r.cache_dtype = DType::kFloat32;
      break;
    case v1::Tensor::BFLOAT16:
      r.cache_dtype = DType::kBFloat16;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("session.cache_dtype: ", EnumName(spec.cache_dtype()),
                       " is not a cache dtype (FLOAT32, BFLOAT16)"));
  }
  r.cache_dtype_named = spec.has_cache_dtype();
  if (spec.step_id().size() > kMaxIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("session.step_id: ", spec.step_id().size(),
                                                   " bytes; at most ", kMaxIdBytes));
  }
  r.create = spec.create();
  r.close = spec.close();
  r.read_only = spec.read_only();
  r.step_id = spec.step_id();
  return r;
}

bool SessionStore::TryTakeLocked(const std::vector<std::string>& ids) {
  for (const std::string& id : ids) {
    if (held_.contains(id)) return false;
  }
  for (const std::string& id : ids) held_.insert(id);
  return true;
}

void SessionStore::Acquire(const std::vector<std::string>& ids, Start start) {
  {
    absl::MutexLock lock(&mu_);
    // Behind a waiter for any of the same ids: FIFO per session.
    bool behind = false;
    for (const std::string& id : ids) behind |= lines_.contains(id);
    if (behind || !TryTakeLocked(ids)) {
      auto waiter = std::make_shared<Waiter>(Waiter{ids, std::move(start)});
      for (const std::string& id : ids) lines_[id].push_back(waiter);
      return;
    }
  }
  start(false);
}

std::vector<SessionStore::Start> SessionStore::ReleaseLocked(
    const std::vector<std::string>& ids) {
  for (const std::string& id : ids) held_.erase(id);
  std::vector<Start> ready;
  // A waiter starts once it is first in the line of each of its ids and
  // none of them is held. Only the first in a released id's line can have
  // become so: one that starts holds its ids, so the next in those lines
  // waits on. The cost is the released ids', whatever else waits.
  for (const std::string& id : ids) {
    auto line = lines_.find(id);
    if (line == lines_.end()) continue;
    const std::shared_ptr<Waiter> first = line->second.front();
    bool free = true;
    for (const std::string& other : first->ids) {
      free &= !held_.contains(other) && lines_.find(other)->second.front() == first;
    }
    if (!free) continue;
    for (const std::string& other : first->ids) {
      auto other_line = lines_.find(other);
      other_line->second.pop_front();
      if (other_line->second.empty()) lines_.erase(other_line);
      held_.insert(other);
    }
    ready.push_back(std::move(first->start));
  }
  return ready;
}

namespace {

// The waiters this thread has freed and not started yet, while it starts
// them one after another (RunReady) or holds them back (DeferStarts); null
// otherwise.
thread_local std::deque<SessionStore::Start>* running = nullptr;

// Starts the waiters of `queue`, this thread's `running`, and those they free.
void StartAll(std::deque<SessionStore::Start>& queue) {
  while (!queue.empty()) {
    SessionStore::Start start = std::move(queue.front());
    queue.pop_front();
    start(true);
  }
}

}  // namespace

void SessionStore::RunReady(std::vector<Start> ready) {
  // A started request that fails at once ends, and starts the next waiter,
  // inside its own start: run them one after another from the outermost
  // call instead, so that a long line of waiters cannot nest that deep.
  if (running != nullptr) {
    for (Start& start : ready) running->push_back(std::move(start));
    return;
  }
  std::deque<Start> queue(std::make_move_iterator(ready.begin()),
                          std::make_move_iterator(ready.end()));
  running = &queue;
  StartAll(queue);
  running = nullptr;
}

SessionStore::DeferStarts::DeferStarts() {
  if (running == nullptr) running = &held_;
}

SessionStore::DeferStarts::~DeferStarts() {
  if (running != &held_) return;  // within an outer one, which starts them
  StartAll(held_);
  running = nullptr;
}

void SessionStore::Release(const std::vector<std::string>& ids) {
  std::vector<Start> ready;
  {
    absl::MutexLock lock(&mu_);
    ready = ReleaseLocked(ids);
  }
  RunReady(std::move(ready));
}

void SessionStore::RemoveLocked(const std::string& id, const char* reason) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  bytes_ -= it->second.cache->bytes();
  bookkeeping_ -= Bookkeeping(id);
  const bool opened = !it->second.created_by_holder;
  if (!opened) --creating_;
  sessions_.erase(it);
  if (metrics_ != nullptr && opened) metrics_->CountSessionEnded(reason);
}

void SessionStore::PublishLocked() {
  if (metrics_ != nullptr) {
    metrics_->SetSessions(OpenLocked(), HeldLocked());
  }
}

bool SessionStore::IdleTooLong(const Session& s, absl::Time now) const {
  return Expires(options_.idle_limit) && now - s.last_used > options_.idle_limit;
}

void SessionStore::ExpireLocked() {
  if (!Expires(options_.idle_limit)) return;
  const absl::Time now = now_();
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    const std::string id = it->first;
    const bool expired = !held_.contains(id) && IdleTooLong(it->second, now);
    ++it;
    if (expired) RemoveLocked(id, "expired");
  }
}

void SessionStore::ExpireBeforeUseLocked(const std::vector<std::string>& ids, bool held_by_caller) {
  if (!sweeper_.joinable()) {
    ExpireLocked();
    if (!held_by_caller) return;
  }
  if (!Expires(options_.idle_limit)) return;
  const absl::Time now = now_();
  for (const std::string& id : ids) {
    auto it = sessions_.find(id);
    if (it == sessions_.end() || !IdleTooLong(it->second, now)) continue;
    if (!held_by_caller && held_.contains(id)) continue;  // another request's, in use
    RemoveLocked(id, "expired");
  }
}

absl::StatusOr<std::vector<KvCache*>> SessionStore::Begin(SessionRequest& request,
                                                          const SessionKind& kind) {
  absl::MutexLock lock(&mu_);
  // Its own sessions expired too: a step found one idle past the limit and
  // revived it, while GetSession and CloseSessions called it gone.
  ExpireBeforeUseLocked(request.ids, /*held_by_caller=*/true);
  const size_t n = request.ids.size();
  // Checks first: on any error nothing has changed.
  int64_t growth = 0;
  for (size_t b = 0; b < n; ++b) {
    const std::string& id = request.ids[b];
    auto it = sessions_.find(id);
    if (request.create) {
      if (it != sessions_.end()) {
        return absl::AlreadyExistsError(absl::StrCat(
            "session \"", id, "\" is already open (position ", it->second.cache->length(),
            "); continue it, or close it first"));
      }
      absl::StatusOr<std::unique_ptr<KvCache>> probe =
          KvCache::Create(kind.kv_heads, kind.key_dim, kind.value_dim, request.cache_dtype);
      if (!probe.ok()) return probe.status();
      growth += (*probe)->BytesFor(request.new_rows);
      continue;
    }
    if (it == sessions_.end()) return NotOpen(id);
    const Session& s = it->second;
    if (s.cache->length() != request.positions[b]) {
      return absl::AbortedError(absl::StrCat("session \"", id, "\": the request is for position ",
                                             request.positions[b], ", the session holds ",
                                             s.cache->length(), " rows; nothing was appended"));
    }
    if (s.kind.model != kind.model) {
      return absl::InvalidArgumentError(
          absl::StrCat("model: session \"", id, "\" belongs to ", s.kind.description,
                       "; this request is for ", kind.description));
    }
    if (s.kind.heads != kind.heads) {
      return absl::InvalidArgumentError(
          absl::StrCat(kind.heads_field, ": session \"", id, "\" belongs to ", s.kind.description,
                       "; this request has ", kind.heads, " query heads"));
    }
    if (s.kind.query_dim != kind.query_dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "query: session \"", id, "\" belongs to ", s.kind.description, ", of query head dim ",
          s.kind.query_dim, "; this request's is ", kind.query_dim));
    }
    if (s.kind.score_kind != kind.score_kind || s.kind.score_scale != kind.score_scale ||
        s.kind.score_bandwidth != kind.score_bandwidth) {
      return absl::InvalidArgumentError(absl::StrCat("score: session \"", id, "\" belongs to ",
                                                     s.kind.description, "; this request's is ",
                                                     kind.score));
    }
    if (request.cache_dtype_named && request.cache_dtype != s.cache->dtype()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "session.cache_dtype: session \"", id, "\" stores ", DTypeName(s.cache->dtype()),
          "; the dtype is fixed at create"));
    }
    growth += s.cache->BytesFor(s.cache->length() + request.new_rows) - s.cache->bytes();
  }
  std::vector<KvCache*> caches;
  caches.reserve(n);
  for (size_t b = 0; b < n; ++b) {
    const std::string& id = request.ids[b];
    if (request.create) {
      Session s;
      s.cache =
          std::move(KvCache::Create(kind.kv_heads, kind.key_dim, kind.value_dim, request.cache_dtype))
              .value();
      s.kind = kind;
      s.last_used = now_();
      s.created_by_holder = true;
      sessions_.emplace(id, std::move(s));
      bookkeeping_ += Bookkeeping(id);
      ++creating_;
    }
    caches.push_back(sessions_.at(id).cache.get());
  }
  request.growth = growth;
  PublishLocked();
  return caches;
}

absl::Status SessionStore::Reserve(SessionRequest& request) {
  absl::MutexLock lock(&mu_);
  const int64_t growth = request.growth, cap = options_.memory_bytes;
  // Sessions past the idle limit the sweeper has not ended yet go first, as
  // expired rather than evicted.
  if (HeldLocked() + reserved_ + growth > cap) ExpireLocked();
  if (HeldLocked() + reserved_ + growth > cap) {
    // What holds the cap: the request's own sessions, idle ones (which can
    // be evicted, least recently used first) and those other requests hold.
    int64_t own = 0;
    for (const std::string& id : request.ids) {
      auto it = sessions_.find(id);
      if (it != sessions_.end()) own += HeldBy(id, it->second);
    }
    if (growth > cap) {
      return OverLimitError(
          "session_memory_mb",
          absl::StrCat(
              "session caches: this request's rows need ", Size(growth), ", more than the ",
              Size(cap),
              " all sessions may hold (--session_memory_mb); send fewer rows per request"));
    }
    if (own + growth > cap) {
      // Fewer rows per request would not help: the sessions are full.
      return OverLimitError(
          "session_memory_mb",
          absl::StrCat("session caches: this request's rows need ", Size(growth),
                       " more and its sessions hold ", Size(own), ", more than the ", Size(cap),
                       " all sessions may hold (--session_memory_mb): they cannot grow further "
                       "here; close them and go on in new ones, or raise the cap"));
    }
    std::vector<std::pair<absl::Time, std::string>> idle;
    int64_t idle_bytes = 0, busy = 0;
    for (const auto& [id, s] : sessions_) {
      if (!held_.contains(id)) {
        idle.emplace_back(s.last_used, id);
        idle_bytes += HeldBy(id, s);
      } else if (std::find(request.ids.begin(), request.ids.end(), id) == request.ids.end()) {
        ++busy;
      }
    }
    if (HeldLocked() - idle_bytes + reserved_ + growth > cap) {
      return absl::ResourceExhaustedError(
          absl::StrCat("session caches: this request's rows need ", Size(growth), " more, and ",
                       Size(HeldLocked() + reserved_), " of the ", Size(cap),
                       " all sessions may hold (--session_memory_mb) are held: ",
                       Size(HeldLocked() - idle_bytes - own + reserved_), " by ", busy,
                       " sessions other requests are computing, which cannot be evicted, ",
                       Size(own), " by this request's, and ", Size(idle_bytes), " by ", idle.size(),
                       " idle ones; retry once those requests end, or close sessions"));
    }
    std::sort(idle.begin(), idle.end());
    for (size_t i = 0; i < idle.size() && HeldLocked() + reserved_ + growth > cap; ++i) {
      RemoveLocked(idle[i].second, "evicted");
    }
  }
  reserved_ += growth;
  request.reserved = growth;
  PublishLocked();
  return absl::OkStatus();
}

std::vector<int64_t> SessionStore::Finish(const SessionRequest& request, bool ok) {
  std::vector<int64_t> positions;
  std::vector<Start> ready;
  {
    absl::MutexLock lock(&mu_);
    reserved_ -= request.reserved;
    int64_t rows = 0;
    const absl::Time now = now_();
    for (const std::string& id : request.ids) {
      auto it = sessions_.find(id);
      if (it == sessions_.end()) {
        positions.push_back(0);
        continue;
      }
      Session& s = it->second;
      // What bytes_ counts for it: the blocks of its rows before this request.
      const int64_t before = s.cache->BytesFor(s.cache->length());
      if (ok) {
        rows += s.cache->pending();
        s.cache->Commit();
      } else {
        s.cache->Rollback();
      }
      bytes_ += s.cache->bytes() - before;
      // A failed request leaves the session as it was, its idle time too.
      if (ok) s.last_used = now;
      if (ok && !request.read_only) s.last_step_id = request.step_id;
      positions.push_back(s.cache->length());
      if (!ok && s.created_by_holder) {
        RemoveLocked(id, nullptr);  // never opened
        continue;
      }
      if (s.created_by_holder) {
        s.created_by_holder = false;
        --creating_;
      }
      // A failed request leaves its sessions open, close or not.
      if (ok && request.close) RemoveLocked(id, "closed");
    }
    if (metrics_ != nullptr && ok) metrics_->AddSessionRows(rows);
    PublishLocked();
    ready = ReleaseLocked(request.ids);
  }
  RunReady(std::move(ready));
  return positions;
}

void SessionStore::Close(
    std::vector<std::string> ids,
    std::function<void(std::vector<std::string>, std::vector<std::string>)> done) {
  // Duplicates would never be acquired: one each.
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  auto shared = std::make_shared<std::vector<std::string>>(std::move(ids));
  Acquire(*shared, [this, shared, done = std::move(done)](bool) {
    std::vector<std::string> closed, not_found;
    std::vector<Start> ready;
    {
      absl::MutexLock lock(&mu_);
      // It holds its ids: those expired are ended here, and not found, as
      // elsewhere.
      ExpireBeforeUseLocked(*shared, /*held_by_caller=*/true);
      for (const std::string& id : *shared) {
        if (sessions_.contains(id)) {
          RemoveLocked(id, "closed");
          closed.push_back(id);
        } else {
          not_found.push_back(id);
        }
      }
      PublishLocked();
      ready = ReleaseLocked(*shared);
    }
    done(std::move(closed), std::move(not_found));
    RunReady(std::move(ready));
  });
}

absl::Status SessionStore::CheckId(absl::string_view field, absl::string_view id) {
  if (!id.empty() && id.size() <= kMaxIdBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": ", id.size(), " bytes; an id has 1 to ", kMaxIdBytes));
}

absl::StatusOr<v1::SessionInfo> SessionStore::Info(const std::string& id) {
  ATTN_RETURN_IF_ERROR(CheckEnabled("id"));
  ATTN_RETURN_IF_ERROR(CheckId("id", id));
  absl::MutexLock lock(&mu_);
  ExpireBeforeUseLocked({id}, /*held_by_caller=*/false);
  PublishLocked();
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return NotOpen(id);
  const Session& s = it->second;
  v1::SessionInfo info;
  info.set_id(id);
  info.set_model(s.kind.model);
  const bool busy = held_.contains(id);
  // A request holding the session may be appending: report what is committed.
  info.set_position(s.cache->length());
  info.set_heads(s.kind.heads);
  info.set_kv_heads(static_cast<int32_t>(s.cache->kv_heads()));
  info.set_head_dim(static_cast<int32_t>(s.cache->key_dim()));
  info.set_value_dim(static_cast<int32_t>(s.cache->value_dim()));
  info.set_cache_dtype(s.cache->dtype() == DType::kBFloat16 ? v1::Tensor::BFLOAT16
                                                            : v1::Tensor::FLOAT32);
  info.set_bytes(busy ? s.cache->BytesFor(s.cache->length()) : s.cache->bytes());
  // At least 1 when no request holds it, so that 0 means only that one does.
  info.set_idle_ms(busy ? 0
                        : std::max<int64_t>(1, absl::ToInt64Milliseconds(now_() - s.last_used)));
  info.set_last_step_id(s.last_step_id);
  return info;
}

int64_t SessionStore::open() const {
  absl::MutexLock lock(&mu_);
  return OpenLocked();
}

int64_t SessionStore::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

}  // namespace attention::server
