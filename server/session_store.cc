#include "server/session_store.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attention::server {
namespace {

std::string MiB(int64_t bytes) {
  return absl::StrCat(static_cast<double>(bytes * 10 / (1 << 20)) / 10, " MiB");
}

}  // namespace

SessionStore::SessionStore(const Options& options, Metrics* metrics,
                           std::function<absl::Time()> now)
    : options_(options), metrics_(metrics), now_(std::move(now)) {}

absl::Status SessionStore::NotOpen(const std::string& id) {
  return absl::NotFoundError(absl::StrCat(
      "session \"", id,
      "\" is not open (unknown, closed, expired or evicted); create it again with its rows"));
}

absl::StatusOr<SessionRequest> SessionStore::Parse(const v1::SessionSpec& spec,
                                                   int64_t batch) const {
  if (!enabled()) {
    return absl::FailedPreconditionError(
        "session: sessions are off on this server (--session_memory_mb=0)");
  }
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
    if (id.empty() || id.size() > kMaxIdBytes) {
      return absl::InvalidArgumentError(absl::StrCat("session.ids[", b, "]: ", id.size(),
                                                     " bytes; an id has 1 to ", kMaxIdBytes));
    }
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
          absl::StrCat("session.cache_dtype: ", v1::Tensor::DType_Name(spec.cache_dtype()),
                       " is not a cache dtype (FLOAT32, BFLOAT16)"));
  }
  r.create = spec.create();
  r.close = spec.close();
  r.read_only = spec.read_only();
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
    for (const Waiter& w : waiters_) {
      for (const std::string& id : ids) {
        behind |= std::find(w.ids.begin(), w.ids.end(), id) != w.ids.end();
      }
    }
    if (behind || !TryTakeLocked(ids)) {
      waiters_.push_back({ids, std::move(start)});
      return;
    }
  }
  start(false);
}

std::vector<SessionStore::Start> SessionStore::ReleaseLocked(
    const std::vector<std::string>& ids) {
  for (const std::string& id : ids) held_.erase(id);
  std::vector<Start> ready;
  // In arrival order; a waiter blocked on an id keeps later waiters for
  // that id behind it.
  absl::flat_hash_set<std::string> blocked;
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    bool free = true;
    for (const std::string& id : it->ids) free &= !held_.contains(id) && !blocked.contains(id);
    if (free) {
      for (const std::string& id : it->ids) held_.insert(id);
      ready.push_back(std::move(it->start));
      it = waiters_.erase(it);
    } else {
      for (const std::string& id : it->ids) blocked.insert(id);
      ++it;
    }
  }
  return ready;
}

void SessionStore::RunReady(std::vector<Start> ready) {
  // A started request that fails at once ends, and starts the next waiter,
  // inside its own start: run them one after another from the outermost
  // call instead, so that a long line of waiters cannot nest that deep.
  thread_local std::deque<Start>* running = nullptr;
  if (running != nullptr) {
    for (Start& start : ready) running->push_back(std::move(start));
    return;
  }
  std::deque<Start> queue(std::make_move_iterator(ready.begin()),
                          std::make_move_iterator(ready.end()));
  running = &queue;
  while (!queue.empty()) {
    Start start = std::move(queue.front());
    queue.pop_front();
    start(true);
  }
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
  sessions_.erase(it);
  if (metrics_ != nullptr) metrics_->CountSessionEnded(reason);
}

void SessionStore::PublishLocked() {
  if (metrics_ != nullptr) metrics_->SetSessions(static_cast<int64_t>(sessions_.size()), bytes_);
}

void SessionStore::ExpireLocked() {
  if (options_.idle_limit == absl::ZeroDuration() ||
      options_.idle_limit == absl::InfiniteDuration()) {
    return;
  }
  const absl::Time now = now_();
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    const std::string id = it->first;
    const bool expired = !held_.contains(id) && now - it->second.last_used > options_.idle_limit;
    ++it;
    if (expired) RemoveLocked(id, "expired");
  }
}

absl::StatusOr<std::vector<KvCache*>> SessionStore::Begin(SessionRequest& request,
                                                          const SessionKind& kind) {
  absl::MutexLock lock(&mu_);
  ExpireLocked();
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
    if (s.kind.model != kind.model || s.kind.heads != kind.heads ||
        s.kind.description != kind.description) {
      return absl::InvalidArgumentError(absl::StrCat("session \"", id, "\" belongs to ",
                                                     s.kind.description, "; this request is for ",
                                                     kind.description));
    }
    if (request.cache_dtype != DType::kFloat32 && request.cache_dtype != s.cache->dtype()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "session.cache_dtype: session \"", id, "\" stores ", DTypeName(s.cache->dtype()),
          "; the dtype is fixed at create"));
    }
    growth += s.cache->BytesFor(s.cache->length() + request.new_rows) - s.cache->bytes();
  }
  // Room for the growth: evict idle sessions, least recently used first.
  if (bytes_ + reserved_ + growth > options_.memory_bytes) {
    std::vector<std::pair<absl::Time, std::string>> idle;
    for (const auto& [id, s] : sessions_) {
      if (!held_.contains(id)) idle.emplace_back(s.last_used, id);
    }
    std::sort(idle.begin(), idle.end());
    int64_t freeable = 0;
    size_t needed = 0;
    while (needed < idle.size() && bytes_ - freeable + reserved_ + growth > options_.memory_bytes) {
      freeable += sessions_.at(idle[needed].second).cache->bytes();
      ++needed;
    }
    if (bytes_ - freeable + reserved_ + growth > options_.memory_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "session caches: this request needs ", MiB(growth), " more; ", MiB(bytes_ + reserved_),
          " of the ", MiB(options_.memory_bytes),
          " all sessions may hold (--session_memory_mb) are held by ", held_.size(),
          " sessions in use and ", idle.size(),
          " idle ones, too few to evict; close sessions or retry"));
    }
    for (size_t i = 0; i < needed; ++i) RemoveLocked(idle[i].second, "evicted");
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
    }
    caches.push_back(sessions_.at(id).cache.get());
  }
  reserved_ += growth;
  request.reserved = growth;
  PublishLocked();
  return caches;
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
      s.last_used = now;
      positions.push_back(s.cache->length());
      if (!ok && s.created_by_holder) {
        RemoveLocked(id, "failed");
        continue;
      }
      s.created_by_holder = false;
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

absl::StatusOr<v1::SessionInfo> SessionStore::Info(const std::string& id) {
  absl::MutexLock lock(&mu_);
  ExpireLocked();
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
  info.set_idle_ms(busy ? 0 : absl::ToInt64Milliseconds(now_() - s.last_used));
  return info;
}

int64_t SessionStore::open() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(sessions_.size());
}

int64_t SessionStore::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

}  // namespace attention::server
