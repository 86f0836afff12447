// SessionStore on its own: the order requests get their sessions in, that a
// long line of waiters does not nest, expiry by a fake clock, eviction order
// and that a failed request changes nothing.

#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/session_store.h"
#include "tests/status_matchers.h"

namespace attention::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::IsOk;
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

TEST(SessionStoreTest, EvictsTheLeastRecentlyUsedIdleSessionOnly) {
  absl::Time now = absl::FromUnixSeconds(1000);
  const int64_t block = KvCache::kBlockRows * 8 * 4;  // one block of 4 + 4 floats a row
  SessionStore store({2 * block, absl::InfiniteDuration()}, nullptr, [&] { return now; });
  for (const char* id : {"old", "new"}) {
    SessionRequest r = Request(id, 0, true, 1);
    absl::StatusOr<std::vector<KvCache*>> caches = store.Begin(r, Kind());
    ASSERT_THAT(caches, IsOk());
    Append(*caches, 1);
    store.Finish(r, true);
    now += absl::Seconds(1);
  }
  // "new" is in use: only "old" may go.
  store.Acquire({"new"}, [](bool) {});
  SessionRequest third = Request("third", 0, true, 1);
  store.Acquire({"third"}, [](bool) {});
  ASSERT_THAT(store.Begin(third, Kind()), IsOk());
  EXPECT_THAT(store.Info("old"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("old")));
  EXPECT_THAT(store.Info("new"), IsOk());
  // Nothing idle is left to evict for a fourth.
  SessionRequest fourth = Request("fourth", 0, true, 1);
  EXPECT_THAT(store.Begin(fourth, Kind()),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("--session_memory_mb")));
}

}  // namespace
}  // namespace attention::server
