// SessionStore on its own: the order requests get their sessions in, that a
// long line of waiters does not nest, expiry by a fake clock and by the
// sweeper, eviction order, the numbers when nothing can be evicted, and that
// a failed request changes nothing: no eviction, no use.

#include "server/session_store.h"

#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/metrics.h"
#include "tests/status_matchers.h"

namespace attention::server {
namespace {

using ::testing::_;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::IsOk;
using ::testing::Not;
using testing::StatusIs;

SessionRequest Request(const std::string& id, int64_t position, bool create, int64_t rows) {
  SessionRequest r;
  r.ids = {id};
  r.positions = {position};
  r.create = create;
  r.new_rows = rows;
  return r;
}

SessionKind Kind() {
  SessionKind kind;
  kind.description = "raw attention with 1 query heads, score SCALED_DOT";
  kind.heads = 1;
  kind.kv_heads = 1;
  kind.key_dim = kind.value_dim = 4;
  return kind;
}

// Appends `rows` rows of zeros to every cache of a begun request.
void Append(const std::vector<KvCache*>& caches, int64_t rows) {
  const std::vector<float> zeros(static_cast<size_t>(rows * 4), 0.0f);
  for (KvCache* c : caches) ASSERT_THAT(c->Append(rows, zeros.data(), 4, 4, zeros.data(), 4, 4), IsOk());
}

// GetSession reports the step_id of the last request that appended: not a
// failed one's, nor a read-only one's; "" after one that gave none.
TEST(SessionStoreTest, TheLastAppendingStepIdIsReported) {
  SessionStore store({int64_t{1} << 20, absl::InfiniteDuration()}, nullptr);
  auto run = [&](SessionRequest r, bool ok) {
    absl::StatusOr<std::vector<KvCache*>> begun = store.Begin(r, Kind());
    ASSERT_THAT(begun, IsOk());
    Append(*begun, r.new_rows);
    store.Finish(r, ok);
  };
  auto last = [&] {
    absl::StatusOr<v1::SessionInfo> info = store.Info("s");
    if (!info.ok()) return info.status().ToString();
    return info->has_last_step_id() ? info->last_step_id() : std::string("(absent)");
  };
  SessionRequest create = Request("s", 0, true, 2);
  create.step_id = "one";
  run(create, true);
  EXPECT_EQ(last(), "one");
  SessionRequest step = Request("s", 2, false, 1);
  step.step_id = "two";
  run(step, false);
  EXPECT_EQ(last(), "one");
  SessionRequest read = Request("s", 2, false, 0);
  read.read_only = true;
  read.step_id = "read";
  run(read, true);
  EXPECT_EQ(last(), "one");
  run(step, true);
  EXPECT_EQ(last(), "two");
  run(Request("s", 3, false, 1), true);
  EXPECT_EQ(last(), "");

  v1::SessionSpec spec;
  spec.add_ids("s");
  spec.add_positions(4);
  spec.set_step_id(std::string(SessionStore::kMaxIdBytes + 1, 'x'));
  EXPECT_THAT(store.Parse(spec, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("session.step_id: 129 bytes")));
}

TEST(SessionStoreTest, WaitersStartInArrivalOrderWithoutNesting) {
  SessionStore store({int64_t{1} << 20, absl::InfiniteDuration()}, nullptr);
  std::vector<int> order;
  int depth = 0, deepest = 0;
  store.Acquire({"a"}, [&](bool waited) { EXPECT_FALSE(waited); });
  // Each waiter, once started, ends at once (as a request whose checks fail
  // does), which frees the id for the next one.
  constexpr int kWaiters = 5000;
  for (int i = 0; i < kWaiters; ++i) {
    store.Acquire({"a"}, [&, i](bool waited) {
      EXPECT_TRUE(waited);
      deepest = std::max(deepest, ++depth);
      order.push_back(i);
      store.Release({"a"});
      --depth;
    });
  }
  EXPECT_TRUE(order.empty());
  store.Release({"a"});
  ASSERT_EQ(order.size(), size_t{kWaiters});
  for (int i = 0; i < kWaiters; ++i) EXPECT_EQ(order[i], i);
  EXPECT_EQ(deepest, 1);
}

TEST(SessionStoreTest, RequestsOnOtherSessionsDoNotWait) {
  SessionStore store({int64_t{1} << 20, absl::InfiniteDuration()}, nullptr);
  std::vector<std::string> started;
  store.Acquire({"a", "b"}, [&](bool) { started.push_back("ab"); });
  store.Acquire({"b"}, [&](bool) { started.push_back("b"); });
  store.Acquire({"c"}, [&](bool) { started.push_back("c"); });
  store.Acquire({"c", "a"}, [&](bool) { started.push_back("ca"); });
  EXPECT_THAT(started, ElementsAre("ab", "c"));
  store.Release({"a", "b"});
  EXPECT_THAT(started, ElementsAre("ab", "c", "b"));
  store.Release({"c"});
  EXPECT_THAT(started, ElementsAre("ab", "c", "b", "ca"));
}

// A request for several ids waits in each of their lines: it starts when it
// is first in all of them, and a later request for any of its ids waits
// behind it even while that id is free.
TEST(SessionStoreTest, AWaiterForSeveralIdsKeepsItsPlaceInEachLine) {
  SessionStore store({int64_t{1} << 20, absl::InfiniteDuration()}, nullptr);
  std::vector<std::string> started;
  store.Acquire({"a"}, [&](bool) { started.push_back("a"); });
  store.Acquire({"b"}, [&](bool) { started.push_back("b"); });
  store.Acquire({"b"}, [&](bool) { started.push_back("b2"); });
  store.Acquire({"a", "b"}, [&](bool) { started.push_back("ab"); });
  store.Acquire({"a"}, [&](bool) { started.push_back("a2"); });
  store.Acquire({"c"}, [&](bool) { started.push_back("c"); });
  EXPECT_THAT(started, ElementsAre("a", "b", "c"));
  store.Release({"a"});  // "ab" is first for a, but b is held
  EXPECT_THAT(started, ElementsAre("a", "b", "c"));
  store.Release({"b"});  // "b2" was first in b's line
  EXPECT_THAT(started, ElementsAre("a", "b", "c", "b2"));
  store.Release({"b"});
  EXPECT_THAT(started, ElementsAre("a", "b", "c", "b2", "ab"));
  store.Release({"a", "b"});
  EXPECT_THAT(started, ElementsAre("a", "b", "c", "b2", "ab", "a2"));
  // Every line is empty again: a new request starts at once.
  store.Release({"a"});
  store.Acquire({"a", "b"}, [&](bool waited) {
    EXPECT_FALSE(waited);
    started.push_back("ab2");
  });
  EXPECT_EQ(started.back(), "ab2");
}

TEST(SessionStoreTest, FailedRequestsChangeNothingAndIdleSessionsExpire) {
  absl::Time now = absl::FromUnixSeconds(1000);
  SessionStore store({int64_t{1} << 20, absl::Seconds(10)}, nullptr, [&] { return now; });
  SessionRequest create = Request("s", 0, true, 3);
  ASSERT_THAT(store.Begin(create, Kind()), IsOk());
  absl::StatusOr<std::vector<KvCache*>> caches = store.Begin(create, Kind());
  EXPECT_THAT(caches, StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("\"s\"")));
  absl::StatusOr<v1::SessionInfo> info = store.Info("s");
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->position(), 0);
  store.Finish(create, true);  // nothing appended: position 0
  SessionRequest step = Request("s", 0, false, 2);
  absl::StatusOr<std::vector<KvCache*>> begun = store.Begin(step, Kind());
  ASSERT_THAT(begun, IsOk());
  Append(*begun, 2);
  EXPECT_THAT(store.Finish(step, false), ElementsAre(0));  // failed: dropped
  EXPECT_EQ(store.bytes(), 0);
  begun = store.Begin(step, Kind());
  ASSERT_THAT(begun, IsOk());
  Append(*begun, 2);
  EXPECT_THAT(store.Finish(step, true), ElementsAre(2));
  EXPECT_EQ(store.bytes(), KvCache::kBlockRows * 8 * 4);
  EXPECT_THAT(store.Begin(step, Kind()),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("position 0, the session holds 2")));
  now += absl::Seconds(11);
  EXPECT_THAT(store.Info("s"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"s\"")));
  EXPECT_EQ(store.open(), 0);
  EXPECT_EQ(store.bytes(), 0);
}

// Creates idle sessions `ids` of one row each, a second apart; with
// `close`, each request closes its session too.
void CreateIdle(SessionStore& store, absl::Time& now, const std::vector<std::string>& ids,
                bool close = false) {
  for (const std::string& id : ids) {
    SessionRequest r = Request(id, 0, true, 1);
    r.close = close;
    store.Acquire(r.ids, [](bool) {});
    absl::StatusOr<std::vector<KvCache*>> caches = store.Begin(r, Kind());
    ASSERT_THAT(caches, IsOk());
    ASSERT_THAT(store.Reserve(r), IsOk());
    Append(*caches, 1);
    store.Finish(r, true);
    now += absl::Seconds(1);
  }
}

TEST(SessionStoreTest, EvictsTheLeastRecentlyUsedIdleSessionOnly) {
  absl::Time now = absl::FromUnixSeconds(1000);
  const int64_t block = KvCache::kBlockRows * 8 * 4;  // 2 KiB: a block of 4 + 4 floats a row
  SessionStore store({2 * block, absl::InfiniteDuration()}, nullptr, [&] { return now; });
  CreateIdle(store, now, {"old", "new"});
  // "new" is in use: only "old" may go, and only once "third" reserves.
  store.Acquire({"new"}, [](bool) {});
  SessionRequest third = Request("third", 0, true, 1);
  store.Acquire({"third"}, [](bool) {});
  ASSERT_THAT(store.Begin(third, Kind()), IsOk());
  EXPECT_THAT(store.Info("old"), IsOk());
  ASSERT_THAT(store.Reserve(third), IsOk());
  EXPECT_THAT(store.Info("old"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("old")));
  EXPECT_THAT(store.Info("new"), IsOk());
  // Nothing idle is left to evict for a fourth: refused with the numbers,
  // and its new session goes again.
  SessionRequest fourth = Request("fourth", 0, true, 1);
  store.Acquire({"fourth"}, [](bool) {});
  ASSERT_THAT(store.Begin(fourth, Kind()), IsOk());
  const absl::Status full = store.Reserve(fourth);
  EXPECT_EQ(RequestOverLimit(full), "");  // the load of the moment, not the request
  EXPECT_THAT(full,
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("this request's rows need 2.0 KiB more, and 4.0 KiB of the "
                                 "4.0 KiB all sessions may hold (--session_memory_mb) are held: "
                                 "4.0 KiB by 2 sessions other requests are computing, which "
                                 "cannot be evicted, 0.0 KiB by this request's, and 0.0 KiB by 0 "
                                 "idle ones; retry once those requests end")));
  store.Finish(fourth, false);
  EXPECT_THAT(store.Info("fourth"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("not open")));
  EXPECT_EQ(store.open(), 1);  // "new": "third" opens when its request succeeds
}

TEST(SessionStoreTest, ARequestRefusedBeforeItReservesEvictsNothingAndUsesNothing) {
  absl::Time now = absl::FromUnixSeconds(1000);
  const int64_t block = KvCache::kBlockRows * 8 * 4;
  SessionStore store({2 * block, absl::InfiniteDuration()}, nullptr, [&] { return now; });
  CreateIdle(store, now, {"a", "b"});
  // A new session's request that fails after Begin (the engine refused its
  // shapes, say): the cache is full, yet nothing was evicted.
  SessionRequest create = Request("c", 0, true, 1);
  store.Acquire(create.ids, [](bool) {});
  ASSERT_THAT(store.Begin(create, Kind()), IsOk());
  store.Finish(create, false);
  EXPECT_THAT(store.Info("a"), IsOk());
  EXPECT_THAT(store.Info("b"), IsOk());
  EXPECT_THAT(store.Info("c"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("not open")));
  // A failed step on "a", the older, leaves it the least recently used.
  absl::StatusOr<v1::SessionInfo> before = store.Info("a");
  SessionRequest step = Request("a", 1, false, 1);
  store.Acquire(step.ids, [](bool) {});
  ASSERT_THAT(store.Begin(step, Kind()), IsOk());
  store.Finish(step, false);
  EXPECT_EQ(store.Info("a")->idle_ms(), before->idle_ms());
  CreateIdle(store, now, {"d"});
  EXPECT_THAT(store.Info("a"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("not open")));
  EXPECT_THAT(store.Info("b"), IsOk());
}

// A session opens when the request creating it succeeds: while it computes
// it is not counted open, and a create refused by the cap or failing later
// never opened, so it ends as nothing (it used to count as "failed", and
// flickered attention_sessions_open).
TEST(SessionStoreTest, ASessionOpensWhenItsCreateSucceeds) {
  absl::Time now = absl::FromUnixSeconds(1000);
  const int64_t block = KvCache::kBlockRows * 8 * 4;
  Metrics metrics;
  SessionStore store({3 * block, absl::InfiniteDuration()}, &metrics, [&] { return now; });
  CreateIdle(store, now, {"a"});
  EXPECT_THAT(metrics.RenderPrometheus(), HasSubstr("\nattention_sessions_open 1\n"));

  SessionRequest refused = Request("big", 0, true, 4 * KvCache::kBlockRows);
  store.Acquire(refused.ids, [](bool) {});
  ASSERT_THAT(store.Begin(refused, Kind()), IsOk());
  EXPECT_EQ(store.open(), 1);
  EXPECT_THAT(metrics.RenderPrometheus(), HasSubstr("\nattention_sessions_open 1\n"));
  EXPECT_THAT(store.Reserve(refused), StatusIs(absl::StatusCode::kResourceExhausted, _));
  store.Finish(refused, false);

  SessionRequest failing = Request("b", 0, true, 1);
  store.Acquire(failing.ids, [](bool) {});
  ASSERT_THAT(store.Begin(failing, Kind()), IsOk());
  ASSERT_THAT(store.Reserve(failing), IsOk());
  EXPECT_THAT(metrics.RenderPrometheus(), HasSubstr("\nattention_sessions_open 1\n"));
  store.Finish(failing, false);  // the compute failed, say
  EXPECT_EQ(store.open(), 1);
  EXPECT_THAT(metrics.RenderPrometheus(), HasSubstr("\nattention_sessions_open 1\n"));

  CreateIdle(store, now, {"c"});
  EXPECT_EQ(store.open(), 2);
  EXPECT_THAT(metrics.RenderPrometheus(), HasSubstr("\nattention_sessions_open 2\n"));

  // Created and closed by one request: opened, then closed (no eviction
  // needed: three blocks hold "a", "c" and it).
  CreateIdle(store, now, {"once"}, /*close=*/true);
  EXPECT_EQ(store.open(), 2);

  const std::string text = metrics.RenderPrometheus();
  EXPECT_THAT(text, HasSubstr("attention_sessions_ended_total{reason=\"closed\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("attention_sessions_ended_total{reason=\"evicted\"} 0\n"));
  EXPECT_THAT(text, Not(HasSubstr("reason=\"failed\"")));
}

TEST(SessionStoreTest, ARequestLargerThanTheLimitIsToldSo) {
  absl::Time now = absl::FromUnixSeconds(1000);
  const int64_t block = KvCache::kBlockRows * 8 * 4;
  SessionStore store({2 * block, absl::InfiniteDuration()}, nullptr, [&] { return now; });
  CreateIdle(store, now, {"a"});
  SessionRequest big = Request("big", 0, true, 3 * KvCache::kBlockRows);
  store.Acquire(big.ids, [](bool) {});
  ASSERT_THAT(store.Begin(big, Kind()), IsOk());
  const absl::Status too_big = store.Reserve(big);
  EXPECT_EQ(RequestOverLimit(too_big), "session_memory_mb");
  EXPECT_THAT(too_big,
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("this request's rows need 6.0 KiB, more than the 4.0 KiB all "
                                 "sessions may hold (--session_memory_mb); send fewer rows")));
  store.Finish(big, false);
  EXPECT_THAT(store.Info("a"), IsOk());  // not evicted for nothing
}

// A session that holds all but a block of the cap: a step needing another
// block is told the sessions are full, not to send fewer rows.
TEST(SessionStoreTest, ASessionThatCannotGrowIsToldSo) {
  absl::Time now = absl::FromUnixSeconds(1000);
  const int64_t block = KvCache::kBlockRows * 8 * 4;
  SessionStore store({2 * block, absl::InfiniteDuration()}, nullptr, [&] { return now; });
  SessionRequest create = Request("full", 0, true, 2 * KvCache::kBlockRows);
  store.Acquire(create.ids, [](bool) {});
  absl::StatusOr<std::vector<KvCache*>> caches = store.Begin(create, Kind());
  ASSERT_THAT(caches, IsOk());
  ASSERT_THAT(store.Reserve(create), IsOk());
  Append(*caches, 2 * KvCache::kBlockRows);
  store.Finish(create, true);
  SessionRequest step = Request("full", 2 * KvCache::kBlockRows, false, 1);
  store.Acquire(step.ids, [](bool) {});
  ASSERT_THAT(store.Begin(step, Kind()), IsOk());
  const absl::Status refused = store.Reserve(step);
  EXPECT_EQ(RequestOverLimit(refused), "session_memory_mb");
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kResourceExhausted,
                                AllOf(HasSubstr("need 2.0 KiB more and its sessions hold 4.0 KiB"),
                                      HasSubstr("they cannot grow further here"),
                                      Not(HasSubstr("fewer rows")))));
  store.Finish(step, false);
  EXPECT_EQ(store.Info("full")->position(), 2 * KvCache::kBlockRows);
}

// Many tiny sessions: each one's entry, cache object and id count against
// the cap too, or 131072 one-block sessions held 2.7 times the cap.
TEST(SessionStoreTest, EachSessionsBookkeepingCountsAgainstTheCap) {
  absl::Time now = absl::FromUnixSeconds(1000);
  const int64_t block = KvCache::kBlockRows * 8 * 4;  // 2 KiB
  SessionStore::Options options{4 * block, absl::InfiniteDuration()};
  options.bookkeeping_bytes = 512;
  Metrics metrics;
  SessionStore store(options, &metrics, [&] { return now; });
  // Blocks only, four would fit; with 512 + 1 bytes each, three do.
  CreateIdle(store, now, {"a", "b", "c"});
  EXPECT_EQ(store.bytes(), 3 * block);  // blocks: GetSession's and the engine's view
  EXPECT_THAT(metrics.RenderPrometheus(),
              HasSubstr(absl::StrCat("\nattention_session_cache_bytes ", 3 * (block + 513), "\n")));
  CreateIdle(store, now, {"d"});
  EXPECT_THAT(store.Info("a"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("not open")));  // evicted for "d"
  EXPECT_THAT(store.Info("b"), IsOk());
  EXPECT_EQ(store.open(), 3);
  std::vector<std::string> closed;
  store.Close({"b", "c", "d"},
              [&](std::vector<std::string> c, std::vector<std::string>) { closed = std::move(c); });
  EXPECT_THAT(closed, ElementsAre("b", "c", "d"));
  EXPECT_THAT(metrics.RenderPrometheus(), HasSubstr("\nattention_session_cache_bytes 0\n"));
}

TEST(SessionStoreTest, ClosingAnExpiredSessionFindsNothing) {
  absl::Time now = absl::FromUnixSeconds(1000);
  SessionStore store({int64_t{1} << 20, absl::Seconds(10)}, nullptr, [&] { return now; });
  CreateIdle(store, now, {"e"});
  now += absl::Seconds(11);
  std::vector<std::string> closed, not_found;
  store.Close({"e"}, [&](std::vector<std::string> c, std::vector<std::string> n) {
    closed = std::move(c);
    not_found = std::move(n);
  });
  EXPECT_TRUE(closed.empty());
  EXPECT_THAT(not_found, ElementsAre("e"));
}

// A request holds its sessions before it begins, and so a session past the
// idle limit that the sweeper had not ended yet was revived by the request
// that named it (its twin, as idle, was NOT_FOUND to GetSession).
TEST(SessionStoreTest, AStepOnASessionPastTheIdleLimitIsNotFound) {
  for (const absl::Duration sweep_every : {absl::ZeroDuration(), absl::Hours(1)}) {
    SCOPED_TRACE(absl::StrCat("sweep every ", absl::FormatDuration(sweep_every)));
    absl::Time now = absl::FromUnixSeconds(1000);
    SessionStore store({int64_t{1} << 20, absl::Seconds(10), sweep_every}, nullptr,
                       [&] { return now; });
    CreateIdle(store, now, {"x", "y"});
    now += absl::Seconds(12);
    SessionRequest step = Request("x", 1, false, 1);
    store.Acquire(step.ids, [](bool) {});
    EXPECT_THAT(store.Begin(step, Kind()),
                StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"x\"")));
    store.Release(step.ids);
    EXPECT_THAT(store.Info("y"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"y\"")));
    EXPECT_EQ(store.open(), 0);
    EXPECT_EQ(store.bytes(), 0);
  }
}

TEST(SessionStoreTest, TheSweeperEndsExpiredSessionsWithoutARequest) {
  // The store's clock is the test's, read by the sweeper's thread too: the
  // session expires when the test moves it on, not when a slow machine has
  // taken longer than the idle limit to get to the first check.
  std::atomic<int64_t> clock_ns{absl::ToUnixNanos(absl::FromUnixSeconds(1000))};
  SessionStore store({int64_t{1} << 20, absl::Milliseconds(50), absl::Milliseconds(10)}, nullptr,
                     [&] { return absl::FromUnixNanos(clock_ns.load()); });
  absl::Time now = absl::FromUnixNanos(clock_ns.load());
  CreateIdle(store, now, {"s"});
  ASSERT_GT(store.bytes(), 0);
  absl::SleepFor(absl::Milliseconds(30));  // three sweeps, before the limit
  ASSERT_EQ(store.open(), 1);
  clock_ns += absl::ToInt64Nanoseconds(absl::Milliseconds(51));
  // Bounded wait: no request touches the store meanwhile.
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (store.open() > 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(store.open(), 0);
  EXPECT_EQ(store.bytes(), 0);
}

}  // namespace
}  // namespace attention::server
