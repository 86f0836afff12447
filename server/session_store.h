#ifndef ATTENTION_SERVER_SESSION_STORE_H_
#define ATTENTION_SERVER_SESSION_STORE_H_

// The sessions of one server (docs/sessions.md): keys and values kept
// between requests, one engine KvCache each, in this process's memory only.

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attention/v1/service.pb.h"
#include "engine/kv_cache.h"
#include "server/metrics.h"

namespace attention::server {

// What a session is fixed to at create, besides its cache's heads, dims and
// dtype (which the engine checks): the model, or for raw attention the
// query heads and the score.
struct SessionKind {
  std::string model;        // empty: raw attention
  std::string description;  // for errors: "model \"m\"", "raw attention with 8 query heads, ..."
  // Raw attention: the field that gives the query heads ("num_heads", or
  // "query.shape[1]" at rank 4), and the score: its kind and the scale and
  // bandwidth in effect, compared by value in float32, as the engine computes
  // with them (a step naming the default is the same score), and as text for
  // errors ("SCALED_DOT scale 0.125").
  std::string heads_field;
  int64_t query_dim = 0;  // per head
  int score_kind = 0;     // v1::Score::Kind
  float score_scale = 0;
  float score_bandwidth = 0;  // GAUSSIAN's; 0 for the others
  std::string score;
  // The cache a new session gets.
  int64_t kv_heads = 0, key_dim = 0, value_dim = 0;
  int32_t heads = 0;
};

// Every id of a session request, in batch-row order, and what it asks.
struct SessionRequest {
  std::vector<std::string> ids;
  std::vector<int64_t> positions;
  bool create = false;
  bool close = false;
  bool read_only = false;
  DType cache_dtype = DType::kFloat32;
  bool cache_dtype_named = false;  // the request set it (a step must name the session's)
  std::string step_id;
  // Rows this request appends to each session.
  int64_t new_rows = 0;
  // Bytes the caches grow by (Begin), and those Reserve reserved for it,
  // until Finish.
  int64_t growth = 0;
  int64_t reserved = 0;
};

// Thread-safe. Requests on one session are applied one at a time: a
// request first acquires all its ids (Acquire), then checks and prepares
// them (Begin), reserves room for its rows (Reserve, which may evict idle
// sessions: the last step before compute, so that a request refused for
// its content evicts nothing), computes, and ends (Finish), which hands the
// ids to the next request waiting for them.
class SessionStore {
 public:
  struct Options {
    // Bytes all caches may hold; 0: sessions are off.
    int64_t memory_bytes = 0;
    // How long an idle session is kept; zero or infinite: for good.
    absl::Duration idle_limit = absl::InfiniteDuration();
    // Above zero, with an idle limit: a thread of the store's own ends
    // expired sessions this often, so that their memory and the gauges do
    // not wait for the next session request.
    absl::Duration sweep_every = absl::ZeroDuration();
    // What a session costs beyond its cache's blocks, counted against
    // memory_bytes with its id's bytes: its entry, its cache's object and
    // block table. The server uses kSessionBookkeepingBytes; 0 counts blocks
    // only (tests of the blocks' arithmetic).
    int64_t bookkeeping_bytes = 0;
  };
  // Measured: 131072 one-block sessions with 128-byte ids took ~860 bytes
  // each beyond their blocks. Without it, many tiny sessions held 2.7x the
  // cap.
  static constexpr int64_t kSessionBookkeepingBytes = 1024;
  // `metrics` may be null; `now` is for tests.
  SessionStore(const Options& options, Metrics* metrics,
               std::function<absl::Time()> now = absl::Now);
  SessionStore(const SessionStore&) = delete;
  SessionStore& operator=(const SessionStore&) = delete;
  ~SessionStore();

  bool enabled() const { return options_.memory_bytes > 0; }
  // FAILED_PRECONDITION naming `field` when sessions are off.
  absl::Status CheckEnabled(const char* field) const;
  const Options& options() const { return options_; }

  // Checks a request's session fields against its batch size: ids and
  // positions (one per batch row), ids non-empty, at most kMaxIdBytes, no two
  // equal, positions >= 0 (0 on create), cache_dtype FLOAT32 or BFLOAT16,
  // read_only not with create, step_id at most kMaxIdBytes;
  // FAILED_PRECONDITION when sessions are off.
  absl::StatusOr<SessionRequest> Parse(const v1::SessionSpec& spec, int64_t batch) const;

  // Runs `start` once no other request holds any of `ids`: now, on this
  // thread (start(false)), or later on the thread whose Finish / Release /
  // Close frees the last of them (start(true)). Never blocks.
  using Start = std::function<void(bool waited)>;
  void Acquire(const std::vector<std::string>& ids, Start start);
  // While one lives, the waiters that Finish, Release and Close free on this
  // thread are held back; its end starts them, on this thread. A stream
  // queues a request's answer before the next request on its sessions can
  // answer, so that answers keep their sessions' order.
  class DeferStarts {
   public:
    DeferStarts();
    DeferStarts(const DeferStarts&) = delete;
    DeferStarts& operator=(const DeferStarts&) = delete;
    ~DeferStarts();

   private:
    std::deque<Start> held_;
  };
  // Lets go of ids acquired but never begun (or whose Begin failed).
  void Release(const std::vector<std::string>& ids);

  // For a request holding its ids: NOT_FOUND for a session that is not open,
  // ALREADY_EXISTS for create on an open one, ABORTED for a position that
  // does not match, INVALID_ARGUMENT for a request of another kind or cache
  // dtype than the session's. On success the sessions (the new ones
  // created, which Finish removes again if the request fails) and their
  // caches in batch-row order, and the request's growth; on error nothing
  // changed.
  absl::StatusOr<std::vector<KvCache*>> Begin(SessionRequest& request, const SessionKind& kind);
  // For a begun request: reserves its growth, evicting idle sessions, least
  // recently used first, where the caches would pass the memory limit;
  // RESOURCE_EXHAUSTED with the numbers, and nothing evicted, when that
  // cannot make room.
  absl::Status Reserve(SessionRequest& request);
  // Commits (ok) or drops the request's rows in every session, removes the
  // sessions it created if it failed, closes them if it asked and succeeded,
  // and releases its ids. Only a request that succeeded counts as its
  // sessions' use (their idle time and order of eviction). Returns each
  // session's position after it.
  std::vector<int64_t> Finish(const SessionRequest& request, bool ok);

  // CloseSessions: closes the open ones among `ids` once no request holds
  // them; `done` gets those closed and those not open.
  void Close(std::vector<std::string> ids,
             std::function<void(std::vector<std::string> closed,
                                std::vector<std::string> not_found)>
                 done);
  // GetSession; NOT_FOUND naming the id, FAILED_PRECONDITION when sessions
  // are off.
  absl::StatusOr<v1::SessionInfo> Info(const std::string& id);

  // Sessions open (created by a request that succeeded: one still being
  // created is not yet, and one whose create fails never was) and the
  // bytes of their caches.
  int64_t open() const;
  int64_t bytes() const;
  // Ends the sessions idle past the limit now (what the sweeper does).
  void ExpireIdle();

  static constexpr size_t kMaxIdBytes = 128;
  // INVALID_ARGUMENT naming `field` unless `id` has 1 to kMaxIdBytes bytes:
  // no session could have it.
  static absl::Status CheckId(absl::string_view field, absl::string_view id);

 private:
  struct Session {
    std::unique_ptr<KvCache> cache;
    SessionKind kind;
    absl::Time last_used;
    bool created_by_holder = false;  // removed again if that request fails
    std::string last_step_id;        // of the last request that appended
  };
  struct Waiter {
    std::vector<std::string> ids;
    Start start;
  };

  // Ids free of holders and of waiters ahead: takes them.
  bool TryTakeLocked(const std::vector<std::string>& ids) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Releases ids and collects the waiters that can start now.
  std::vector<Start> ReleaseLocked(const std::vector<std::string>& ids)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts waiters freed by a release, on this thread, one after another.
  static void RunReady(std::vector<Start> ready);
  // Whether `s`, not in use, would have expired by `now`.
  bool IdleTooLong(const Session& s, absl::Time now) const;
  // Removes idle sessions past the idle limit.
  void ExpireLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What a request or GetSession does before it looks at sessions: ends
  // those of `ids` idle past the limit (not held by another request), and,
  // without a sweeper, every other one too. With a sweeper, the others are
  // its work: a walk over every session per call cost milliseconds under
  // the one lock at 50,000 sessions.
  void ExpireBeforeUseLocked(const std::vector<std::string>& ids, bool held_by_caller)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The sweeper's loop, until the store is destroyed.
  void Sweep();
  // Removes a session; one that had opened counts as ended for `reason`,
  // one whose creating request failed (created_by_holder) as nothing.
  void RemoveLocked(const std::string& id, const char* reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sessions open: those whose creating request has succeeded.
  int64_t OpenLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return static_cast<int64_t>(sessions_.size()) - creating_;
  }
  void PublishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A session's cost beyond its blocks (Options::bookkeeping_bytes).
  int64_t Bookkeeping(const std::string& id) const {
    return options_.bookkeeping_bytes == 0
               ? 0
               : options_.bookkeeping_bytes + static_cast<int64_t>(id.size());
  }
  // What one session counts against memory_bytes: its blocks and its
  // bookkeeping.
  int64_t HeldBy(const std::string& id, const Session& s) const {
    return s.cache->bytes() + Bookkeeping(id);
  }
  // What all count against memory_bytes.
  int64_t HeldLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return bytes_ + bookkeeping_; }
  static absl::Status NotOpen(const std::string& id);

  const Options options_;
  Metrics* const metrics_;
  const std::function<absl::Time()> now_;
  mutable absl::Mutex mu_;
  std::map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> held_ ABSL_GUARDED_BY(mu_);
  // Per id, the requests waiting for it, in arrival order (a request for
  // several ids waits in each of their lines); no empty lines.
  absl::flat_hash_map<std::string, std::deque<std::shared_ptr<Waiter>>> lines_ ABSL_GUARDED_BY(mu_);
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;     // caches' blocks
  int64_t bookkeeping_ ABSL_GUARDED_BY(mu_) = 0;  // Bookkeeping() of every session
  int64_t reserved_ ABSL_GUARDED_BY(mu_) = 0;  // growth of requests computing
  int64_t creating_ ABSL_GUARDED_BY(mu_) = 0;  // sessions whose create is in flight
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread sweeper_;  // last: it starts once the rest is built
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_SESSION_STORE_H_
