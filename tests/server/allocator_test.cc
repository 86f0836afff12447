// The server binaries' allocator: jemalloc with server/allocator.cc's
// settings, which returns memory freed after a burst to the system.

#include "server/allocator.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

int64_t RssKiB() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::strtoll(line.c_str() + 6, nullptr, 10);
  }
  return -1;
}

TEST(AllocatorTest, IsJemallocWithTheServersSettings) {
  EXPECT_THAT(AllocatorName(), ::testing::StartsWith("jemalloc "));
  EXPECT_EQ(JemallocFlag("opt.background_thread"), true);
  EXPECT_EQ(JemallocValue("opt.dirty_decay_ms"), 1000);
  EXPECT_EQ(JemallocValue("opt.muzzy_decay_ms"), 0);
}

// What the soak saw with glibc's malloc: a burst of large calls (their
// requests arrive in gRPC's read buffers of tens of KiB) raised RSS for good,
// because memory allocated after the burst, still in use, kept the heap from
// shrinking. Here that memory goes back within seconds.
TEST(AllocatorTest, MemoryFreedAfterABurstReturnsToTheSystem) {
  constexpr size_t kBlock = 32 << 10;
  constexpr int kBlocks = 2048;  // 64 MiB
  const int64_t before = RssKiB();
  ASSERT_GT(before, 0);
  std::vector<char*> burst;
  for (int i = 0; i < kBlocks; ++i) {
    burst.push_back(static_cast<char*>(std::malloc(kBlock)));
    ASSERT_NE(burst.back(), nullptr);
    std::memset(burst.back(), i, kBlock);
  }
  // Allocated after the burst and alive throughout: on glibc's heap, above it.
  std::vector<char*> later;
  for (int i = 0; i < 64; ++i) {
    later.push_back(static_cast<char*>(std::malloc(kBlock)));
    std::memset(later.back(), i, kBlock);
  }
  const int64_t peak = RssKiB();
  ASSERT_GT(peak - before, 60 << 10);  // the burst is resident
  for (char* p : burst) std::free(p);

  const absl::Time give_up = absl::Now() + absl::Seconds(15);
  int64_t now = RssKiB();
  while (now - before > (16 << 10) && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(100));
    now = RssKiB();
  }
  EXPECT_LE(now - before, 16 << 10) << "RSS " << before << " KiB before the burst, " << peak
                                    << " KiB at its peak, " << now << " KiB 15 s after it";
  for (char* p : later) std::free(p);
}

}  // namespace
}  // namespace attention::server
