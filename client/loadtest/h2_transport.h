#ifndef ATTENTION_CLIENT_LOADTEST_H2_TRANSPORT_H_
#define ATTENTION_CLIENT_LOADTEST_H2_TRANSPORT_H_

// attention_loadtest's --transport h2: unary Attend calls spoken as gRPC's
// HTTP/2 wire protocol through nghttp2, without gRPC's client stack. One
// thread owns every connection: it reads what arrived, hands each finished
// call to the runner (whose next calls queue up meanwhile), then writes all
// that is queued with one send per connection. gRPC's C++ client spends a
// call's CPU on its filters, combiner and a send of its own per call, and, for
// calls started off its polling thread, a hand-off to its executor thread.
//
// Plaintext only, HOST:PORT targets only, no retries: a call that fails is
// counted with its code.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace attention::loadtest {

// What a call carries through the transport and gets back at its end.
struct H2CallInfo {
  int64_t intended_ns = 0;
  int64_t sent_ns = 0;
  bool measured = false;
};

// How a call ended: its gRPC status code and message, and on OK the
// serialized response message. Valid during the callback only.
struct H2Answer {
  int code = 0;
  absl::string_view message;
  absl::string_view response;
};

struct H2Options {
  // HOST:PORT ("127.0.0.1:50051", "[::1]:50051", "localhost:50051"), one
  // connection each; the same target may appear more than once.
  std::vector<std::string> targets;
  std::string path;           // "/package.Service/Method"
  std::string request;        // the serialized request message, sent by every call
  std::string authorization;  // the header's value; empty sends none
  absl::Duration timeout;     // per call, sent as grpc-timeout; zero: none
  int64_t max_message_bytes = int64_t{256} << 20;      // of an answer
  absl::Duration connect_timeout = absl::Seconds(10);  // the first connection
  // After a connection is lost or refused: the first wait before the next
  // attempt, growing 1.6x up to the max; an attempt gets at least
  // attempt_timeout to finish its TCP and HTTP/2 handshakes.
  absl::Duration reconnect_backoff_initial = absl::Milliseconds(100);
  absl::Duration reconnect_backoff_max = absl::Seconds(2);
  absl::Duration attempt_timeout = absl::Seconds(1);
};

// The targets' connections and the thread that runs them. Send, Down and
// CancelAll are thread-safe.
class H2Transport {
 public:
  // Runs on the transport's thread, once per call sent, when it ends.
  using DoneFn = std::function<void(const H2CallInfo&, const H2Answer&)>;

  // Connects to every target, HTTP/2 handshake included (UNAVAILABLE naming
  // the first target not connected within connect_timeout; INVALID_ARGUMENT
  // for a target that is not HOST:PORT or does not resolve).
  static absl::StatusOr<std::unique_ptr<H2Transport>> Connect(const H2Options& options,
                                                              DoneFn done);
  ~H2Transport();  // Stop()

  H2Transport(const H2Transport&) = delete;
  H2Transport& operator=(const H2Transport&) = delete;

  // Connections, in the order of options.targets.
  size_t size() const;
  // Connection `i` is not ready for calls: reconnecting after a failure, or
  // its server said GOAWAY. A call sent to it waits for its next connection
  // attempt (as gRPC queues calls while its channel connects): sent if that
  // succeeds, UNAVAILABLE if it fails, DEADLINE_EXCEEDED if the call's
  // timeout comes first.
  bool Down(size_t i) const;
  // Sends one call on connection `i`; `done` reports its end. A call beyond
  // the server's limit on streams at once (SETTINGS_MAX_CONCURRENT_STREAMS)
  // waits in the transport, in order, for a stream to end (as gRPC's client
  // holds it): DEADLINE_EXCEEDED if its timeout comes first.
  void Send(size_t i, const H2CallInfo& info);
  // Ends every call sent and not yet answered: CANCELLED.
  void CancelAll();
  // An open loop's schedule, kept by the transport's thread so that a send
  // is no hand-off between threads: `pace(now)` sends (Send) the calls due
  // by `now` and returns when the next one is due, or -1 for none yet; both
  // in steady_clock nanoseconds since its epoch. Called at every turn of the
  // thread, and at the time it returned (to within microseconds: a timerfd).
  void SetPacer(std::function<int64_t(int64_t now)> pace);
  // Ends the calls still open (CANCELLED), closes the connections and joins
  // the thread. Idempotent.
  void Stop();

  class Impl;

 private:
  explicit H2Transport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Helpers, exposed for tests.
// The host and port of a HOST:PORT target (HOST a name, an IPv4 address or a
// bracketed IPv6 one, brackets removed); nullopt for anything else, such as
// gRPC's URIs (dns:///NAME, ipv4:A,B, unix:PATH).
std::optional<std::pair<std::string, std::string>> SplitHostPort(absl::string_view target);

namespace h2_internal {
// grpc-timeout's value for `timeout`: 5% and a millisecond longer (the caller's
// own timer decides), rounded up, at most 8 digits and a unit.
std::string GrpcTimeout(absl::Duration timeout);
// grpc-message's value, percent-decoded.
std::string PercentDecode(absl::string_view value);
// The gRPC code of an HTTP status without grpc-status, and of an HTTP/2
// RST_STREAM error code.
int CodeOfHttpStatus(int http_status);
int CodeOfResetStream(uint32_t error_code);
}  // namespace h2_internal

}  // namespace attention::loadtest

#endif  // ATTENTION_CLIENT_LOADTEST_H2_TRANSPORT_H_
