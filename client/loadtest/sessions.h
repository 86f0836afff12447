#ifndef ATTENTION_CLIENT_LOADTEST_SESSIONS_H_
#define ATTENTION_CLIENT_LOADTEST_SESSIONS_H_

// attention_loadtest --sessions: decoders, each on a thread of its own, that
// open a session with a prefill, step it one row at a time and close it,
// through the client library's Session (client/session.h).

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attention/v1/attention.pb.h"
#include "client/attention_client.h"
#include "client/loadtest/runner.h"
#include "client/loadtest/stats.h"
#include "client/loadtest/workload.h"

namespace attention::loadtest {

// Most decoders a run may have: one thread each.
inline constexpr int64_t kMaxSessions = 4096;

// --stream: most decoders' streams one connection carries. HAProxy's default
// limit of concurrent streams on a connection (tune.h2.max-concurrent-streams)
// is 100, below the server's --max_concurrent_streams (256); a decoder past a
// connection's limit would wait for a stream until its timeout.
inline constexpr int64_t kStreamsPerConnection = 100;

struct SessionLoadOptions {
  // Decoders go round-robin over the targets, and over `connections`
  // channels (TCP connections) to each.
  std::vector<std::string> targets;
  int connections = 1;
  // Credentials, token, message size, retries and the per-call timeout; its
  // target is ignored.
  client::ClientOptions client;
  absl::Duration connect_timeout = absl::Seconds(10);

  // N decoders; each sends `prefill` (its query, key and value are the
  // session's first rows, with create), then `steps` times `step` (one row
  // each), then closes its session. Both requests' other fields (model or
  // num_heads, mask, output_dtype, ...) are every call's.
  int64_t sessions = 1;
  int64_t prefill_rows = 0;  // for the report
  int64_t steps = 0;
  v1::AttendRequest prefill;
  v1::AttendRequest step;
  v1::Tensor::DType cache_dtype = v1::Tensor::FLOAT32;
  // SessionStats::cache_row_bytes.
  int64_t cache_row_bytes = 0;
  // Keep every row sent, and recreate a session the server lost from them
  // (Session's keep_rows); without, a lost session ends its decoder.
  bool keep_rows = true;
  // Each decoder sends its calls on an AttendStream of its own (Session's
  // stream) instead of unary Attends.
  bool stream = false;
  // Session ids are this and the decoder's number; unique per run by default.
  std::string id_prefix;
  // Checks every OK step answer when set.
  const Verifier* verifier = nullptr;
  // When it turns true, each decoder stops after its current call and closes
  // its session.
  const std::atomic<bool>* interrupted = nullptr;
};

struct SessionRunResult {
  // The steps: latency (send to answer), the server's times and batch sizes,
  // calls by code (failed prefills and closes counted with them), the
  // window from the first step sent to the last one answered, CPU.
  LoadStats stats;
  SessionStats sessions;
  // The steps second by second, from the decoders' start (their prefills
  // included): sent by send time, answered, failed and their latencies by
  // answer time; target is 0.
  std::vector<TimelinePoint> timeline;
};

// Cache bytes one row of a session holds: kv_heads x (key_dim + value_dim) x
// the size of `cache_dtype` (4 for FLOAT32, 2 for BFLOAT16).
int64_t CacheRowBytes(int64_t kv_heads, int64_t key_dim, int64_t value_dim,
                      v1::Tensor::DType cache_dtype);

// Connects every channel (UNAVAILABLE naming the target when one does not
// within connect_timeout), runs the decoders until each has made its steps,
// failed, or been interrupted, and returns what they measured. A decoder
// stops at its first failed call (a failed step is counted, then its session
// is closed). INVALID_ARGUMENT for options out of range. Failed calls are
// counted, not returned as errors.
absl::StatusOr<SessionRunResult> RunSessions(const SessionLoadOptions& options);

}  // namespace attention::loadtest

#endif  // ATTENTION_CLIENT_LOADTEST_SESSIONS_H_
