#ifndef ATTENTION_TESTS_CLIENT_FAKE_SERVER_H_
#define ATTENTION_TESTS_CLIENT_FAKE_SERVER_H_

// An in-process stand-in for the attention server on 127.0.0.1:0, so client
// tests need neither the engine nor a fixed port.

#include <cstdint>
#include <memory>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attention/v1/service.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/server.h"

namespace attention::testing {

// Attend answers by request id:
//   "fail":  INVALID_ARGUMENT "mask.valid_lens: shape [3] does not match batch size 2"
//   "hang":  blocks until the call is cancelled or its deadline passes
//   other:   output = the query's elements re-encoded as output_dtype, shape
//            kept; with need_weights, weights = [1, 1] holding 0.5 as FLOAT16;
//            queue_us 3, compute_us 7, batch_size 1.
// AttendStream answers each message as Attend would, with its id and status
// (a "fail" message gets status code 3; "hang" is not special there).
// Health answers the status set with set_health(); service "missing" gets
// NOT_FOUND. Thread-safe.
class FakeAttentionServer {
 public:
  // Starts serving; fails the current test if it cannot. With
  // max_connection_age, connections older than that are sent GOAWAY (their
  // calls get 30 s more), as the real server's --max_connection_age_seconds.
  explicit FakeAttentionServer(absl::Duration max_connection_age = absl::ZeroDuration());
  ~FakeAttentionServer();

  FakeAttentionServer(const FakeAttentionServer&) = delete;
  FakeAttentionServer& operator=(const FakeAttentionServer&) = delete;

  // "127.0.0.1:<port>".
  std::string address() const { return address_; }

  void set_health(grpc::health::v1::HealthCheckResponse::ServingStatus status);
  // The "authorization" metadata of the latest call, "" when it had none.
  std::string last_authorization() const;
  // The service name of the latest health check.
  std::string last_health_service() const;
  // Attend calls and AttendStream messages received so far.
  int64_t attend_calls() const;
  // How many client addresses (TCP connections) have sent them.
  size_t distinct_peers() const;
  // The call-th of them (1-based) stalls the server for `stall`: it, and every
  // one arriving meanwhile, is answered only when the stall is over.
  void StallCall(int64_t call, absl::Duration stall);
  // The call-th of them (1-based) hangs as a "hang" call does.
  void HangCall(int64_t call);

 private:
  class AttentionImpl;
  class HealthImpl;
  struct State {
    mutable absl::Mutex mu;
    grpc::health::v1::HealthCheckResponse::ServingStatus health ABSL_GUARDED_BY(mu) =
        grpc::health::v1::HealthCheckResponse::SERVING;
    std::string authorization ABSL_GUARDED_BY(mu);
    std::string health_service ABSL_GUARDED_BY(mu);
    int64_t attend_calls ABSL_GUARDED_BY(mu) = 0;
    std::set<std::string> peers ABSL_GUARDED_BY(mu);
    int64_t stall_call ABSL_GUARDED_BY(mu) = 0;
    int64_t hang_call ABSL_GUARDED_BY(mu) = 0;
    absl::Duration stall ABSL_GUARDED_BY(mu);
    absl::Time stalled_until ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  };

  State state_;
  std::unique_ptr<AttentionImpl> attention_;
  std::unique_ptr<HealthImpl> health_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_CLIENT_FAKE_SERVER_H_
