#include "server/heap_trimmer.h"

#include <cstdlib>
#include <functional>
#include <fstream>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

// Waits up to 10 s for `done`; false if it never held.
template <typename Predicate>
bool Eventually(Predicate done) {
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (!done()) {
    if (absl::Now() > give_up) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

// A server's activity, set by the test.
class FakeActivity {
 public:
  std::function<ServerActivity()> Probe() {
    return [this] {
      absl::MutexLock lock(&mu_);
      return now_;
    };
  }
  void Start() {
    absl::MutexLock lock(&mu_);
    ++now_.in_flight;
    ++now_.started;
  }
  void Finish() {
    absl::MutexLock lock(&mu_);
    --now_.in_flight;
  }

 private:
  absl::Mutex mu_;
  ServerActivity now_;
};

TEST(HeapTrimmerTest, TrimsOnceEachTimeTheServerGoesIdle) {
  FakeActivity activity;
  const int64_t before = HeapTrimStatsNow().trims;
  HeapTrimmer trimmer(absl::Milliseconds(20), activity.Probe());
  // Never busy since it started: nothing to give back.
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(HeapTrimStatsNow().trims, before);

  // Busy for longer than the idle time: no trim while a call is in flight.
  activity.Start();
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(HeapTrimStatsNow().trims, before);
  activity.Finish();
  EXPECT_TRUE(Eventually([&] { return HeapTrimStatsNow().trims == before + 1; }));
  // Idle on: one trim per idle period.
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(HeapTrimStatsNow().trims, before + 1);

  // A call that starts and ends between two polls counts too.
  activity.Start();
  activity.Finish();
  EXPECT_TRUE(Eventually([&] { return HeapTrimStatsNow().trims == before + 2; }));
  EXPECT_GT(HeapTrimStatsNow().seconds, 0.0);
}

TEST(HeapTrimmerTest, DestroyedWhileWaitingForIdle) {
  FakeActivity activity;
  const int64_t before = HeapTrimStatsNow().trims;
  {
    HeapTrimmer trimmer(absl::Hours(1), activity.Probe());
    activity.Start();
    activity.Finish();
  }
  EXPECT_EQ(HeapTrimStatsNow().trims, before);
}

// glibc's allocator only: the sanitizers bring their own.
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
int64_t RssKiB() {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "VmRSS:") {
      int64_t kib = 0;
      status >> kib;
      return kib;
    }
    status.ignore(1 << 20, '\n');
  }
  return -1;
}

// What the soak saw: a burst of requests read in small pieces grows a heap,
// memory allocated meanwhile and still in use keeps it from shrinking, and
// RSS stays up after the pieces are freed. The trimmer gives those pages back.
TEST(HeapTrimmerTest, GivesBackTheFreedPagesBelowMemoryInUse) {
  constexpr size_t kPiece = 32 << 10;  // under glibc's mmap threshold
  constexpr size_t kPieces = 2048;     // 64 MiB
  std::vector<char*> burst, kept;
  burst.reserve(kPieces);
  kept.reserve(kPieces);
  for (size_t i = 0; i < kPieces; ++i) {
    burst.push_back(static_cast<char*>(std::malloc(kPiece)));
    for (size_t b = 0; b < kPiece; b += 4096) burst.back()[b] = 1;
    kept.push_back(static_cast<char*>(std::malloc(5000)));  // in use between the pieces
    kept.back()[0] = 1;
  }
  const int64_t peak = RssKiB();
  for (char* p : burst) std::free(p);
  const int64_t freed = RssKiB();
  // Without a trim, glibc keeps most of it.
  EXPECT_GT(freed, peak - 32 * 1024)
      << "RSS " << peak << " KiB at the burst's peak, " << freed << " KiB once it was freed";

  FakeActivity activity;
  HeapTrimmer trimmer(absl::Milliseconds(5), activity.Probe());
  activity.Start();
  activity.Finish();
  EXPECT_TRUE(Eventually([&] { return RssKiB() < freed - 32 * 1024; }))
      << "RSS " << freed << " KiB once the burst was freed, " << RssKiB() << " KiB after trims";
  for (char* p : kept) std::free(p);
}
#endif

}  // namespace
}  // namespace attention::server
