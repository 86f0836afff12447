#ifndef ATTENTION_TESTS_LOADTEST_KNOWN_STATS_H_
#define ATTENTION_TESTS_LOADTEST_KNOWN_STATS_H_

// The load tester's numbers from a known run, for the report tests.

#include "client/loadtest/stats.h"

namespace attention::loadtest {

// 1000 calls over two seconds: 990 at 1 ms, 10 at 100 ms (uncorrected: the
// same); 5 of them UNAVAILABLE.
inline LoadStats KnownStats() {
  LoadStats stats;
  stats.latency.Record(1'000'000, 990);
  stats.latency.Record(100'000'000, 10);
  stats.uncorrected_latency = stats.latency;
  stats.send_lateness.Record(20'000, 1000);
  stats.server_queue.Record(300'000, 995);
  stats.server_compute.Record(50'000, 995);
  stats.calls_by_code[0] = 995;
  stats.calls_by_code[14] = 5;
  stats.RecordBatchSize(1, 900);
  stats.RecordBatchSize(4, 95);
  stats.first_error = "UNAVAILABLE: connection refused";
  stats.sent = 1000;
  stats.duration_s = 2;
  stats.send_window_s = 2;
  stats.cpu_user_s = 0.5;
  stats.cpu_system_s = 0.1;
  stats.cores = 2;
  return stats;
}

}  // namespace attention::loadtest

#endif  // ATTENTION_TESTS_LOADTEST_KNOWN_STATS_H_
