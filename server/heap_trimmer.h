// Gives the memory glibc's malloc keeps after it is freed back to the system
// once the server goes idle.
#ifndef ATTENTION_SERVER_HEAP_TRIMMER_H_
#define ATTENTION_SERVER_HEAP_TRIMMER_H_

#include <cstdint>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attention::server {

// What every HeapTrimmer of this process has done so far.
struct HeapTrimStats {
  int64_t trims = 0;
  double seconds = 0;  // spent in malloc_trim, in all
};
HeapTrimStats HeapTrimStatsNow();

// What a HeapTrimmer watches: calls being handled now, and a count that only
// grows, of the calls that arrived and the sessions that ended so far (each
// may have left memory free).
struct ServerActivity {
  int64_t in_flight = 0;
  uint64_t started = 0;
};

// Calls malloc_trim(0) once the server has had no call in flight and no new
// activity for `idle` (and has had some since the last trim), on a thread of
// its own, until destroyed.
//
// Why: glibc returns to the system only the free top of each heap. A burst
// of large requests (which gRPC reads in slices of tens of KiB) grows a heap,
// memory allocated meanwhile and still in use keeps it from shrinking, and
// RSS stays at the burst's level for good. malloc_trim gives back every whole
// free page of every arena (madvise).
//
// Why only when idle: under load the heap's free pages are reused within
// milliseconds, so a trim then only moves page faults around, and it costs
// tens of milliseconds of CPU with each arena locked in turn (one walk of its
// free lists, one madvise per free chunk).
class HeapTrimmer {
 public:
  // `activity` is polled every min(idle / 4, 100 ms) on the trimmer's thread.
  HeapTrimmer(absl::Duration idle, std::function<ServerActivity()> activity);
  ~HeapTrimmer();
  HeapTrimmer(const HeapTrimmer&) = delete;
  HeapTrimmer& operator=(const HeapTrimmer&) = delete;

 private:
  // `started`: the calls started when the trimmer was made.
  void Loop(absl::Duration idle, uint64_t started);

  const std::function<ServerActivity()> activity_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_HEAP_TRIMMER_H_
