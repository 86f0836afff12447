#include "client/loadtest/h2_transport.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <nghttp2/nghttp2.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/status.h"

namespace attention::loadtest {

std::optional<std::pair<std::string, std::string>> SplitHostPort(absl::string_view target) {
  const size_t colon = target.rfind(':');
  if (colon == absl::string_view::npos || colon == 0 || colon + 1 == target.size() ||
      absl::StrContains(target, '/')) {
    return std::nullopt;
  }
  absl::string_view host = target.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  } else if (absl::StrContains(host, ':')) {
    return std::nullopt;
  }
  return std::make_pair(std::string(host), std::string(target.substr(colon + 1)));
}

namespace h2_internal {

std::string GrpcTimeout(absl::Duration timeout) {
  // 5% longer, in whole units rounded up, plus one: the caller's own timer
  // must decide. A server's timer fires up to a millisecond early (gRPC's
  // timers keep milliseconds), and this side's loop may run late on a busy
  // machine; a server that answered DEADLINE_EXCEEDED first would make the
  // call look shorter than its timeout, and gRPC closes a connection going
  // away as soon as such a call ends, cutting off the calls beside it. When
  // the caller's deadline passes, its reset cancels the server's work
  // anyway. At most 8 digits (gRPC's limit).
  timeout += timeout / 20;
  constexpr int64_t kMaxCount = 99'999'999;
  const std::pair<absl::Duration, char> units[] = {{absl::Milliseconds(1), 'm'},
                                                   {absl::Seconds(1), 'S'},
                                                   {absl::Minutes(1), 'M'},
                                                   {absl::Hours(1), 'H'}};
  for (const auto& [unit, letter] : units) {
    absl::Duration remainder;
    const int64_t count = absl::IDivDuration(absl::Ceil(timeout, unit), unit, &remainder) + 1;
    if (count <= kMaxCount) return absl::StrCat(count, std::string(1, letter));
  }
  return absl::StrCat(kMaxCount, "H");
}

std::string PercentDecode(absl::string_view value) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  out.reserve(value.size());
  for (size_t i = 0; i < value.size(); ++i) {
    if (value[i] == '%' && i + 2 < value.size()) {
      const int high = hex(value[i + 1]), low = hex(value[i + 2]);
      if (high >= 0 && low >= 0) {
        out.push_back(static_cast<char>(high * 16 + low));
        i += 2;
        continue;
      }
    }
    out.push_back(value[i]);
  }
  return out;
}

// gRPC's doc/http-grpc-status-mapping.md.
int CodeOfHttpStatus(int http_status) {
  switch (http_status) {
    case 400:
      return grpc::StatusCode::INTERNAL;
    case 401:
      return grpc::StatusCode::UNAUTHENTICATED;
    case 403:
      return grpc::StatusCode::PERMISSION_DENIED;
    case 404:
      return grpc::StatusCode::UNIMPLEMENTED;
    case 429:
    case 502:
    case 503:
    case 504:
      return grpc::StatusCode::UNAVAILABLE;
    default:
      return grpc::StatusCode::UNKNOWN;
  }
}

// gRPC's doc/PROTOCOL-HTTP2.md, "Errors".
int CodeOfResetStream(uint32_t error_code) {
  switch (error_code) {
    case NGHTTP2_REFUSED_STREAM:
      return grpc::StatusCode::UNAVAILABLE;
    case NGHTTP2_CANCEL:
      return grpc::StatusCode::CANCELLED;
    case NGHTTP2_ENHANCE_YOUR_CALM:
      return grpc::StatusCode::RESOURCE_EXHAUSTED;
    case NGHTTP2_INADEQUATE_SECURITY:
      return grpc::StatusCode::PERMISSION_DENIED;
    default:
      return grpc::StatusCode::INTERNAL;
  }
}

}  // namespace h2_internal

namespace {

using h2_internal::CodeOfHttpStatus;
using h2_internal::CodeOfResetStream;

constexpr size_t kGrpcPrefix = 5;          // compressed flag, 4-byte length
constexpr size_t kReadChunk = 256 << 10;   // bytes read per recv
constexpr size_t kWriteBatch = 256 << 10;  // bytes gathered per send
// Receive windows: large answers (tens of MiB) stream without waiting on
// WINDOW_UPDATEs, while a server never has more than this much queued
// toward a tester that reads slowly (gRPC's client grows its window to a
// few MiB by probing).
constexpr int32_t kStreamWindow = 8 << 20;    // per stream
constexpr int32_t kSessionWindow = 64 << 20;  // the connection's
constexpr int kMaxEvents = 64;
constexpr int32_t kLastStreamId = 0x7fffffff - 2048;  // client stream ids are odd, below 2^31

int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Address {
  std::string target;  // HOST:PORT, also the :authority
  sockaddr_storage addr{};
  socklen_t addr_len = 0;
};

absl::StatusOr<Address> Resolve(const std::string& target) {
  const std::optional<std::pair<std::string, std::string>> host_port = SplitHostPort(target);
  if (!host_port.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("target \"", target, "\": --transport h2 takes HOST:PORT"));
  }
  const auto& [host, port] = *host_port;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
  if (rc != 0 || found == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("target \"", target, "\" does not resolve: ", gai_strerror(rc)));
  }
  Address address;
  address.target = target;
  std::memcpy(&address.addr, found->ai_addr, found->ai_addrlen);
  address.addr_len = found->ai_addrlen;
  freeaddrinfo(found);
  return address;
}

// One call from its send to its end.
struct Call {
  H2CallInfo info;
  size_t body_offset = 0;
  int http_status = 0;
  int grpc_status = -1;  // -1 until the trailers say
  std::string grpc_message;
  std::string data;    // the DATA frames' bytes: prefix and message
  int local_code = 0;  // set when this side ends the call
  std::string local_message;
  int32_t stream_id = 0;
  // Reported with local_code when this side ended it (EndNow), before its
  // stream closed: a reset goes out only as fast as the socket takes it, and
  // a server that stops reading would otherwise hold the call past its
  // deadline, and the run with it.
  bool reported = false;
};

}  // namespace

class H2Transport::Impl {
 public:
  Impl(const H2Options& options, DoneFn done);
  ~Impl();

  absl::Status Start(std::vector<Address> addresses);
  size_t size() const { return conns_.size(); }
  bool Down(size_t i) const { return !conns_[i]->ready.load(std::memory_order_relaxed); }
  void Send(size_t i, const H2CallInfo& info);
  void CancelAll() {
    cancel_.store(true);
    Wake();
  }
  void SetPacer(std::function<int64_t(int64_t)> pace) {
    {
      absl::MutexLock lock(&mu_);
      new_pacer_ = std::move(pace);
    }
    Wake();
  }
  void Stop();

 private:
  enum class State { kDown, kConnecting, kHandshaking, kUp, kClosing };

  struct Conn {
    Impl* owner = nullptr;
    Address address;
    std::vector<nghttp2_nv> headers;
    State state = State::kDown;
    int fd = -1;
    nghttp2_session* session = nullptr;
    std::string out;  // gathered frames not yet sent
    size_t out_sent = 0;
    bool want_out = false;  // EPOLLOUT registered
    int64_t attempt_deadline_ns = 0;
    int64_t retry_at_ns = 0;
    int64_t backoff_ns = 0;
    std::atomic<bool> ready{false};
    // By stream id: nghttp2 knows a stream only once its HEADERS are out.
    absl::flat_hash_map<int32_t, Call*> calls;
    // (deadline, stream id) in send order; the calls' timeouts are all alike.
    std::deque<std::pair<int64_t, int32_t>> deadlines;
    // Calls sent while the connection was not up, or while it had as many
    // calls open as the server allows at once (its
    // SETTINGS_MAX_CONCURRENT_STREAMS), in order: they wait here, as gRPC's
    // client holds them, not in nghttp2's queue, where a call's reset before
    // its HEADERS went out walks every call queued ahead of it (a tester
    // far over the server's capacity queues hundreds of thousands).
    struct Waiting {
      int64_t deadline;  // 0: none
      H2CallInfo info;
    };
    std::deque<Waiting> waiting;
  };

  struct Pending {
    size_t conn;
    H2CallInfo info;
  };

  void Loop();
  void Pace();
  void Wake();
  // How long the loop may sleep: until the next deadline, reconnect or
  // connection-attempt timeout (0: not at all).
  int64_t WaitNs() const;
  // epoll_wait for up to WaitNs(), to the nanosecond where the kernel has
  // epoll_pwait2 (5.11), else rounded up to the millisecond.
  int Wait(epoll_event* events);
  void Connect(Conn& conn, int64_t now);
  void OnConnected(Conn& conn);
  void OnEvents(Conn& conn, uint32_t events);
  void Read(Conn& conn);
  void Flush(Conn& conn);
  void SetWantOut(Conn& conn, bool want);
  // Closes the connection, ends its open calls UNAVAILABLE with `why` (and
  // the calls waiting for it, when it was an attempt that failed), and
  // schedules the next attempt.
  void Fail(Conn& conn, const std::string& why);
  // A closing connection (GOAWAY, or stream ids run out) with calls still
  // open: moves them, its socket and its session to a connection of its own
  // in retiring_, where they end, and leaves `conn` down with its next
  // attempt due now, so that new calls need not wait for the old ones.
  void Retire(Conn& conn, int64_t now);
  // f(conn) for every connection: the targets' and the retiring ones.
  template <typename F>
  void ForEachConn(F f) {
    for (const std::unique_ptr<Conn>& conn : conns_) f(*conn);
    for (const std::unique_ptr<Conn>& conn : retiring_) f(*conn);
  }
  // How many more calls the connection may open now: 0 unless it is up.
  static size_t FreeStreams(const Conn& conn);
  // Opens the call on a stream when the connection is up, nothing waits
  // before it and a stream is free, else queues it in conn.waiting.
  // `deadline`: steady ns, 0 for now + the timeout.
  void Submit(Conn& conn, const H2CallInfo& info, int64_t deadline = 0);
  // Opens the calls waiting at the front of conn.waiting while streams are free.
  void StartWaiting(Conn& conn);
  void StartCall(Conn& conn, const H2CallInfo& info, int64_t deadline);
  void Expire(Conn& conn, int64_t now);
  void CancelCalls(Conn& conn, const char* why);
  // Reports a call this side ends (with its local_code when one is set
  // already, else `code`) at once, before its stream closes; Finish then
  // only frees it.
  void EndNow(Call* call, int code, absl::string_view message);
  // Ends `call` (already off its stream) and reports it.
  void Finish(Conn& conn, Call* call, uint32_t reset_code);
  void Report(const H2CallInfo& info, int code, absl::string_view message,
              absl::string_view response = {});

  static nghttp2_session_callbacks* Callbacks();
  static int OnHeader(nghttp2_session* session, const nghttp2_frame* frame, const uint8_t* name,
                      size_t namelen, const uint8_t* value, size_t valuelen, uint8_t flags,
                      void* user_data);
  static int OnData(nghttp2_session* session, uint8_t flags, int32_t stream_id, const uint8_t* data,
                    size_t len, void* user_data);
  static int OnFrame(nghttp2_session* session, const nghttp2_frame* frame, void* user_data);
  static int OnStreamClose(nghttp2_session* session, int32_t stream_id, uint32_t error_code,
                           void* user_data);
  static ssize_t ReadBody(nghttp2_session* session, int32_t stream_id, uint8_t* buf, size_t length,
                          uint32_t* data_flags, nghttp2_data_source* source, void* user_data);

  const H2Options options_;
  const DoneFn done_;
  std::string body_;  // the gRPC-framed request
  std::string timeout_value_;
  const int64_t timeout_ns_;
  std::vector<std::unique_ptr<Conn>> conns_;
  // The loop's: closing connections whose calls are still ending (Retire).
  std::vector<std::unique_ptr<Conn>> retiring_;
  int epoll_fd_ = -1;
  int event_fd_ = -1;
  int timer_fd_ = -1;
  int timer_tag_ = 0;  // its epoll data: the address
  // The loop's: the pacer and the time its timer is set for (-1: unset).
  std::function<int64_t(int64_t)> pacer_;
  int64_t timer_at_ns_ = -1;
  bool millisecond_waits_ = false;  // no epoll_pwait2
  std::thread thread_;
  std::thread::id loop_id_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> cancel_{false};
  std::atomic<bool> stopped_{false};

  absl::Mutex mu_;
  std::vector<Pending> pending_ ABSL_GUARDED_BY(mu_);
  std::function<int64_t(int64_t)> new_pacer_ ABSL_GUARDED_BY(mu_);
  bool woken_ ABSL_GUARDED_BY(mu_) = false;
  // The loop's own sends (from inside done_), taken at the next turn.
  std::vector<Pending> local_pending_;
};

H2Transport::Impl::Impl(const H2Options& options, DoneFn done)
    : options_(options),
      done_(std::move(done)),
      timeout_ns_(options.timeout > absl::ZeroDuration() &&
                          options.timeout != absl::InfiniteDuration()
                      ? absl::ToInt64Nanoseconds(options.timeout)
                      : 0) {
  const uint32_t length = static_cast<uint32_t>(options_.request.size());
  body_.reserve(kGrpcPrefix + options_.request.size());
  body_.push_back('\0');
  for (int shift = 24; shift >= 0; shift -= 8) body_.push_back(static_cast<char>(length >> shift));
  body_ += options_.request;
  if (timeout_ns_ > 0) timeout_value_ = h2_internal::GrpcTimeout(options_.timeout);
}

H2Transport::Impl::~Impl() {
  Stop();
  ForEachConn([](Conn& conn) {
    if (conn.session != nullptr) nghttp2_session_del(conn.session);
    if (conn.fd >= 0) close(conn.fd);
  });
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (event_fd_ >= 0) close(event_fd_);
  if (timer_fd_ >= 0) close(timer_fd_);
}

nghttp2_session_callbacks* H2Transport::Impl::Callbacks() {
  static nghttp2_session_callbacks* const callbacks = [] {
    nghttp2_session_callbacks* c;
    nghttp2_session_callbacks_new(&c);
    nghttp2_session_callbacks_set_on_header_callback(c, OnHeader);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(c, OnData);
    nghttp2_session_callbacks_set_on_frame_recv_callback(c, OnFrame);
    nghttp2_session_callbacks_set_on_stream_close_callback(c, OnStreamClose);
    return c;
  }();
  return callbacks;
}

absl::Status H2Transport::Impl::Start(std::vector<Address> addresses) {
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  // steady_clock is CLOCK_MONOTONIC.
  timer_fd_ = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  if (epoll_fd_ < 0 || event_fd_ < 0 || timer_fd_ < 0) {
    return absl::InternalError(absl::StrCat("epoll, eventfd or timerfd: ", std::strerror(errno)));
  }
  epoll_event wake{};
  wake.events = EPOLLIN;
  wake.data.ptr = nullptr;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, event_fd_, &wake);
  epoll_event timer{};
  timer.events = EPOLLIN;
  timer.data.ptr = &timer_tag_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, timer_fd_, &timer);

  auto nv = [](const std::string& name, const std::string& value) {
    return nghttp2_nv{reinterpret_cast<uint8_t*>(const_cast<char*>(name.data())),
                      reinterpret_cast<uint8_t*>(const_cast<char*>(value.data())), name.size(),
                      value.size(), NGHTTP2_NV_FLAG_NO_COPY_NAME | NGHTTP2_NV_FLAG_NO_COPY_VALUE};
  };
  static const std::string kMethod = ":method", kPost = "POST", kScheme = ":scheme", kHttp = "http",
                           kPath = ":path", kAuthority = ":authority",
                           kContentType = "content-type", kGrpc = "application/grpc", kTe = "te",
                           kTrailers = "trailers", kUserAgent = "user-agent",
                           kAgent = "attention-loadtest nghttp2", kTimeout = "grpc-timeout",
                           kAuthorization = "authorization";
  for (Address& address : addresses) {
    auto conn = std::make_unique<Conn>();
    conn->owner = this;
    conn->address = std::move(address);
    conn->backoff_ns = absl::ToInt64Nanoseconds(options_.reconnect_backoff_initial);
    conn->headers = {nv(kMethod, kPost),       nv(kScheme, kHttp),
                     nv(kPath, options_.path), nv(kAuthority, conn->address.target),
                     nv(kContentType, kGrpc),  nv(kTe, kTrailers),
                     nv(kUserAgent, kAgent)};
    if (!timeout_value_.empty()) conn->headers.push_back(nv(kTimeout, timeout_value_));
    if (!options_.authorization.empty()) {
      conn->headers.push_back(nv(kAuthorization, options_.authorization));
    }
    conns_.push_back(std::move(conn));
  }
  const int64_t now = SteadyNs();
  const int64_t connect_by = now + absl::ToInt64Nanoseconds(options_.connect_timeout);
  for (const std::unique_ptr<Conn>& conn : conns_) {
    Connect(*conn, now);
    conn->attempt_deadline_ns = connect_by;
  }
  // The first connections are made by the loop, which owns the sockets; this
  // thread waits for them.
  thread_ = std::thread([this] { Loop(); });
  loop_id_ = thread_.get_id();  // read by Send, which runs after Connect returns
  for (;;) {
    size_t ready = 0;
    for (const std::unique_ptr<Conn>& conn : conns_) ready += conn->ready.load() ? 1 : 0;
    if (ready == conns_.size()) return absl::OkStatus();
    if (SteadyNs() >= connect_by) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  for (const std::unique_ptr<Conn>& conn : conns_) {
    if (!conn->ready.load()) {
      return absl::UnavailableError(absl::StrCat("cannot connect to ", conn->address.target,
                                                 " within ",
                                                 absl::FormatDuration(options_.connect_timeout)));
    }
  }
  return absl::OkStatus();
}

void H2Transport::Impl::Wake() {
  const uint64_t one = 1;
  ssize_t ignored = write(event_fd_, &one, sizeof one);
  (void)ignored;
}

void H2Transport::Impl::Send(size_t i, const H2CallInfo& info) {
  if (std::this_thread::get_id() == loop_id_) {
    local_pending_.push_back({i, info});
    return;
  }
  bool wake = false;
  {
    absl::MutexLock lock(&mu_);
    pending_.push_back({i, info});
    if (!woken_) woken_ = wake = true;
  }
  if (wake) Wake();
}

void H2Transport::Impl::Stop() {
  if (stopped_.exchange(true)) return;
  stop_.store(true);
  if (thread_.joinable()) {
    Wake();
    thread_.join();
  }
}

void H2Transport::Impl::Pace() {
  const int64_t next = pacer_(SteadyNs());
  if (next < 0 || next == timer_at_ns_) return;
  itimerspec at{};
  at.it_value.tv_sec = next / 1'000'000'000;
  at.it_value.tv_nsec = next % 1'000'000'000;
  timerfd_settime(timer_fd_, TFD_TIMER_ABSTIME, &at, nullptr);
  timer_at_ns_ = next;
}

int64_t H2Transport::Impl::WaitNs() const {
  if (!local_pending_.empty()) return 0;
  const int64_t now = SteadyNs();
  int64_t next = now + 100'000'000;  // a 100 ms ceiling keeps the checks below honest
  for (const std::unique_ptr<Conn>& conn : retiring_) {
    if (!conn->deadlines.empty()) next = std::min(next, conn->deadlines.front().first);
  }
  for (const std::unique_ptr<Conn>& conn : conns_) {
    if (!conn->deadlines.empty()) next = std::min(next, conn->deadlines.front().first);
    if (!conn->waiting.empty() && FreeStreams(*conn) > 0) return 0;  // streams freed meanwhile
    if (!conn->waiting.empty() && conn->waiting.front().deadline > 0) {
      next = std::min(next, conn->waiting.front().deadline);
    }
    if (conn->state == State::kDown) next = std::min(next, conn->retry_at_ns);
    if (conn->state == State::kConnecting || conn->state == State::kHandshaking) {
      next = std::min(next, conn->attempt_deadline_ns);
    }
  }
  return std::max<int64_t>(next - now, 0);
}

int H2Transport::Impl::Wait(epoll_event* events) {
  const int64_t ns = WaitNs();
  if (!millisecond_waits_) {
    const timespec wait{ns / 1'000'000'000, ns % 1'000'000'000};
    const int n = epoll_pwait2(epoll_fd_, events, kMaxEvents, &wait, nullptr);
    if (n >= 0 || errno != ENOSYS) return n;
    millisecond_waits_ = true;
  }
  return epoll_wait(epoll_fd_, events, kMaxEvents, static_cast<int>((ns + 999'999) / 1'000'000));
}

void H2Transport::Impl::Loop() {
  // The pacer's sends are due to the microsecond; the kernel may otherwise
  // wake this thread up to 50 us late.
  prctl(PR_SET_TIMERSLACK, 1000UL);
  epoll_event events[kMaxEvents];
  std::vector<Pending> batch;
  for (;;) {
    const int n = Wait(events);
    for (int e = 0; e < n; ++e) {
      if (events[e].data.ptr == nullptr || events[e].data.ptr == &timer_tag_) {
        uint64_t count;
        ssize_t ignored =
            read(events[e].data.ptr == nullptr ? event_fd_ : timer_fd_, &count, sizeof count);
        (void)ignored;
        if (events[e].data.ptr == &timer_tag_) timer_at_ns_ = -1;
        continue;
      }
      OnEvents(*static_cast<Conn*>(events[e].data.ptr), events[e].events);
    }
    if (stop_.load()) break;
    if (cancel_.exchange(false))
      ForEachConn([this](Conn& conn) { CancelCalls(conn, "cancelled"); });
    batch.clear();
    {
      absl::MutexLock lock(&mu_);
      batch.swap(pending_);
      woken_ = false;
      if (new_pacer_) pacer_ = std::move(new_pacer_);
      new_pacer_ = nullptr;
    }
    if (pacer_) Pace();
    batch.insert(batch.end(), local_pending_.begin(), local_pending_.end());
    local_pending_.clear();
    for (const Pending& p : batch) Submit(*conns_[p.conn], p.info);
    const int64_t now = SteadyNs();
    for (const std::unique_ptr<Conn>& conn : retiring_) {
      Expire(*conn, now);
      if (conn->session != nullptr) Flush(*conn);  // fails it once its calls have ended
    }
    std::erase_if(retiring_, [](const std::unique_ptr<Conn>& c) { return c->session == nullptr; });
    for (const std::unique_ptr<Conn>& conn : conns_) {
      Conn& c = *conn;
      if (c.state == State::kClosing && c.session != nullptr && !c.calls.empty()) Retire(c, now);
      Expire(c, now);
      StartWaiting(c);
      if (c.state == State::kDown && now >= c.retry_at_ns) Connect(c, now);
      if ((c.state == State::kConnecting || c.state == State::kHandshaking) &&
          now >= c.attempt_deadline_ns) {
        Fail(c, "the connection attempt timed out");
      }
      if (c.session != nullptr) Flush(c);
    }
  }
  // Whatever is still open ends CANCELLED; queued sends too.
  ForEachConn([this](Conn& conn) { CancelCalls(conn, "the load test stopped"); });
  {
    absl::MutexLock lock(&mu_);
    batch.swap(pending_);
  }
  batch.insert(batch.end(), local_pending_.begin(), local_pending_.end());
  local_pending_.clear();
  for (const Pending& p : batch) {
    Report(p.info, grpc::StatusCode::CANCELLED, "the load test stopped");
  }
  ForEachConn([this](Conn& conn) {
    for (const auto& [id, call] : std::exchange(conn.calls, {})) {
      if (!call->reported) Report(call->info, grpc::StatusCode::CANCELLED, "the load test stopped");
      delete call;
    }
  });
}

void H2Transport::Impl::Retire(Conn& conn, int64_t now) {
  auto old = std::make_unique<Conn>();
  old->owner = this;
  old->address = conn.address;  // for Fail's messages; it sends no more requests
  old->state = State::kClosing;
  old->fd = std::exchange(conn.fd, -1);
  old->session = std::exchange(conn.session, nullptr);
  old->out = std::exchange(conn.out, {});
  old->out_sent = std::exchange(conn.out_sent, 0);
  old->want_out = std::exchange(conn.want_out, false);
  old->calls = std::exchange(conn.calls, {});
  old->deadlines = std::exchange(conn.deadlines, {});
  nghttp2_session_set_user_data(old->session, old.get());
  epoll_event event{};
  event.events = old->want_out ? uint32_t{EPOLLIN | EPOLLOUT} : uint32_t{EPOLLIN};
  event.data.ptr = old.get();
  epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, old->fd, &event);
  retiring_.push_back(std::move(old));
  Flush(*retiring_.back());  // what the read that saw the GOAWAY queued
  conn.state = State::kDown;
  conn.backoff_ns = absl::ToInt64Nanoseconds(options_.reconnect_backoff_initial);
  conn.retry_at_ns = now;
}

void H2Transport::Impl::Connect(Conn& conn, int64_t now) {
  conn.attempt_deadline_ns = now + absl::ToInt64Nanoseconds(options_.attempt_timeout);
  conn.fd = socket(conn.address.addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (conn.fd < 0) {
    Fail(conn, absl::StrCat("socket: ", std::strerror(errno)));
    return;
  }
  const int one = 1;
  setsockopt(conn.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  epoll_event event{};
  event.events = EPOLLIN | EPOLLOUT;
  event.data.ptr = &conn;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, conn.fd, &event);
  conn.want_out = true;
  conn.state = State::kConnecting;
  if (connect(conn.fd, reinterpret_cast<const sockaddr*>(&conn.address.addr),
              conn.address.addr_len) != 0 &&
      errno != EINPROGRESS) {
    Fail(conn, absl::StrCat("connect: ", std::strerror(errno)));
  }
  // Connected or not, EPOLLOUT says when the outcome is known.
}

void H2Transport::Impl::OnConnected(Conn& conn) {
  nghttp2_option* option;
  nghttp2_option_new(&option);
  // Until the server's SETTINGS come, as gRPC's own client assumes.
  nghttp2_option_set_peer_max_concurrent_streams(option, 100);
  nghttp2_session_client_new2(&conn.session, Callbacks(), &conn, option);
  nghttp2_option_del(option);
  const nghttp2_settings_entry settings[] = {
      {NGHTTP2_SETTINGS_ENABLE_PUSH, 0},
      {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, static_cast<uint32_t>(kStreamWindow)},
  };
  nghttp2_submit_settings(conn.session, NGHTTP2_FLAG_NONE, settings, std::size(settings));
  nghttp2_session_set_local_window_size(conn.session, NGHTTP2_FLAG_NONE, 0, kSessionWindow);
  conn.state = State::kHandshaking;
}

void H2Transport::Impl::OnEvents(Conn& conn, uint32_t events) {
  if (conn.state == State::kConnecting) {
    if ((events & (EPOLLOUT | EPOLLERR | EPOLLHUP)) == 0) return;
    int error = 0;
    socklen_t length = sizeof error;
    getsockopt(conn.fd, SOL_SOCKET, SO_ERROR, &error, &length);
    if (error != 0) {
      Fail(conn, absl::StrCat("connect: ", std::strerror(error)));
      return;
    }
    OnConnected(conn);
    Flush(conn);
    return;
  }
  if (conn.session == nullptr) return;
  if (events & (EPOLLIN | EPOLLERR | EPOLLHUP)) Read(conn);
  if (conn.session != nullptr && (events & EPOLLOUT)) Flush(conn);
}

void H2Transport::Impl::Read(Conn& conn) {
  static thread_local std::vector<uint8_t> buffer(kReadChunk);
  for (;;) {
    const ssize_t got = recv(conn.fd, buffer.data(), buffer.size(), 0);
    if (got == 0) {
      Fail(conn, "the server closed the connection");
      return;
    }
    if (got < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EINTR) continue;
      Fail(conn, absl::StrCat("recv: ", std::strerror(errno)));
      return;
    }
    const ssize_t used =
        nghttp2_session_mem_recv(conn.session, buffer.data(), static_cast<size_t>(got));
    if (used < 0) {
      Fail(conn, absl::StrCat("HTTP/2: ", nghttp2_strerror(static_cast<int>(used))));
      return;
    }
    if (static_cast<size_t>(got) < buffer.size()) return;
  }
}

void H2Transport::Impl::SetWantOut(Conn& conn, bool want) {
  if (conn.want_out == want) return;
  conn.want_out = want;
  epoll_event event{};
  event.events = want ? uint32_t{EPOLLIN | EPOLLOUT} : uint32_t{EPOLLIN};
  event.data.ptr = &conn;
  epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, conn.fd, &event);
}

void H2Transport::Impl::Flush(Conn& conn) {
  for (;;) {
    // Gather frames, then send them together.
    while (conn.out.size() - conn.out_sent < kWriteBatch) {
      const uint8_t* data;
      const ssize_t length = nghttp2_session_mem_send(conn.session, &data);
      if (length < 0) {
        Fail(conn, absl::StrCat("HTTP/2: ", nghttp2_strerror(static_cast<int>(length))));
        return;
      }
      if (length == 0) break;
      conn.out.append(reinterpret_cast<const char*>(data), static_cast<size_t>(length));
    }
    if (conn.out_sent == conn.out.size()) break;
    const ssize_t sent = send(conn.fd, conn.out.data() + conn.out_sent,
                              conn.out.size() - conn.out_sent, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        SetWantOut(conn, true);
        return;
      }
      Fail(conn, absl::StrCat("send: ", std::strerror(errno)));
      return;
    }
    conn.out_sent += static_cast<size_t>(sent);
    if (conn.out_sent == conn.out.size()) {
      conn.out.clear();
      conn.out_sent = 0;
    }
  }
  conn.out.clear();
  conn.out_sent = 0;
  SetWantOut(conn, false);
  if (conn.state == State::kClosing && conn.calls.empty()) {
    Fail(conn, "the connection was closing (GOAWAY, or its stream ids ran out)");
  } else if (!nghttp2_session_want_read(conn.session) &&
             !nghttp2_session_want_write(conn.session)) {
    Fail(conn, "the HTTP/2 session ended");
  }
}

void H2Transport::Impl::Fail(Conn& conn, const std::string& why) {
  conn.ready.store(false);
  if (conn.fd >= 0) {
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, conn.fd, nullptr);
    close(conn.fd);
    conn.fd = -1;
  }
  if (conn.session != nullptr) {
    nghttp2_session_del(conn.session);  // calls no callbacks
    conn.session = nullptr;
  }
  conn.out.clear();
  conn.out_sent = 0;
  conn.want_out = false;
  conn.deadlines.clear();
  const bool was_up = conn.state == State::kUp;
  const bool was_closing = conn.state == State::kClosing;
  conn.state = State::kDown;
  const int64_t now = SteadyNs();
  if (was_up || was_closing) {
    // A connection that worked retries at once, then backs off.
    conn.backoff_ns = absl::ToInt64Nanoseconds(options_.reconnect_backoff_initial);
    conn.retry_at_ns = now;
  } else {
    conn.retry_at_ns = now + conn.backoff_ns;
    conn.backoff_ns = std::min<int64_t>(conn.backoff_ns * 8 / 5,
                                        absl::ToInt64Nanoseconds(options_.reconnect_backoff_max));
  }
  const std::string message = absl::StrCat(conn.address.target, ": ", why);
  for (const auto& [id, call] : std::exchange(conn.calls, {})) {
    if (!call->reported) Report(call->info, grpc::StatusCode::UNAVAILABLE, message);
    delete call;
  }
  // The calls waiting for this attempt fail with it; when a connection that
  // was up (or closing after GOAWAY) ends, they wait for the next attempt,
  // which starts at once.
  if (!was_up && !was_closing) {
    std::deque<Conn::Waiting> waiting;
    waiting.swap(conn.waiting);
    for (const Conn::Waiting& w : waiting) Report(w.info, grpc::StatusCode::UNAVAILABLE, message);
  }
}

size_t H2Transport::Impl::FreeStreams(const Conn& conn) {
  if (conn.state != State::kUp || conn.session == nullptr) return 0;
  // The server's SETTINGS came before the connection was up; without a
  // limit in them, nghttp2 says 2^32 - 1.
  const uint32_t limit =
      nghttp2_session_get_remote_settings(conn.session, NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS);
  return limit > conn.calls.size() ? limit - conn.calls.size() : 0;
}

void H2Transport::Impl::Submit(Conn& conn, const H2CallInfo& info, int64_t deadline) {
  if (deadline == 0 && timeout_ns_ > 0) deadline = SteadyNs() + timeout_ns_;
  if (!conn.waiting.empty() || FreeStreams(conn) == 0) {
    // As gRPC's channel queues a call while it connects: the call waits for
    // the next connection attempt, and fails UNAVAILABLE if that fails. A
    // closed loop then fails once per attempt, instead of as fast as it can.
    // On a connection that is up, the call waits for a stream.
    conn.waiting.push_back({deadline, info});
    return;
  }
  StartCall(conn, info, deadline);
}

void H2Transport::Impl::StartWaiting(Conn& conn) {
  for (size_t free = FreeStreams(conn); free > 0 && !conn.waiting.empty(); --free) {
    const Conn::Waiting w = conn.waiting.front();
    conn.waiting.pop_front();
    StartCall(conn, w.info, w.deadline);
    if (conn.state != State::kUp) break;  // its stream ids ran out
  }
}

void H2Transport::Impl::StartCall(Conn& conn, const H2CallInfo& info, int64_t deadline) {
  auto* call = new Call;
  call->info = info;
  nghttp2_data_provider provider{};
  provider.source.ptr = call;
  provider.read_callback = ReadBody;
  const int32_t id = nghttp2_submit_request(conn.session, nullptr, conn.headers.data(),
                                            conn.headers.size(), &provider, call);
  if (id < 0) {
    delete call;
    Report(info, grpc::StatusCode::UNAVAILABLE,
           absl::StrCat(conn.address.target, ": ", nghttp2_strerror(id)));
    return;
  }
  call->stream_id = id;
  conn.calls.emplace(id, call);
  if (id >= kLastStreamId) {
    // Stream ids run out: this connection takes no more calls; the loop
    // replaces it (Retire) while its calls end.
    conn.ready.store(false);
    conn.state = State::kClosing;
  }
  if (deadline > 0) conn.deadlines.emplace_back(deadline, id);
}

void H2Transport::Impl::Expire(Conn& conn, int64_t now) {
  if (!conn.waiting.empty() && conn.waiting.front().deadline > 0 &&
      conn.waiting.front().deadline <= now) {
    // On a connection that is up, the calls waited for a stream: every one
    // the server allows was taken.
    const std::string message =
        conn.state == State::kUp
            ? absl::StrCat(conn.address.target,
                           ": no free stream within --timeout (the server allows ",
                           nghttp2_session_get_remote_settings(
                               conn.session, NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS),
                           " at once)")
            : absl::StrCat(conn.address.target, ": not connected within --timeout");
    while (!conn.waiting.empty() && conn.waiting.front().deadline > 0 &&
           conn.waiting.front().deadline <= now) {
      const H2CallInfo info = conn.waiting.front().info;
      conn.waiting.pop_front();
      Report(info, grpc::StatusCode::DEADLINE_EXCEEDED, message);
    }
  }
  if (conn.session == nullptr) return;
  while (!conn.deadlines.empty()) {
    const auto [deadline, id] = conn.deadlines.front();
    // Not nghttp2_session_get_stream_user_data: a call whose HEADERS are
    // not out yet (just submitted, or held back by a stream limit the
    // server lowered) has no stream there. A reset cancels such a call before it is
    // sent, and nghttp2 closes it all the same.
    const auto it = conn.calls.find(id);
    Call* call = it == conn.calls.end() ? nullptr : it->second;
    if (call != nullptr && deadline > now) break;
    conn.deadlines.pop_front();  // ended, or now past its deadline
    if (call == nullptr) continue;
    // Reset already when it ended otherwise (an answer over the size limit).
    if (call->local_code == 0) {
      nghttp2_submit_rst_stream(conn.session, NGHTTP2_FLAG_NONE, id, NGHTTP2_CANCEL);
    }
    EndNow(call, grpc::StatusCode::DEADLINE_EXCEEDED, "no answer within --timeout");
  }
}

void H2Transport::Impl::EndNow(Call* call, int code, absl::string_view message) {
  if (call->reported) return;
  if (call->local_code == 0) {
    call->local_code = code;
    call->local_message = std::string(message);
  }
  call->reported = true;
  Report(call->info, call->local_code, call->local_message);
}

void H2Transport::Impl::CancelCalls(Conn& conn, const char* why) {
  std::deque<Conn::Waiting> waiting;
  waiting.swap(conn.waiting);
  for (const Conn::Waiting& w : waiting) Report(w.info, grpc::StatusCode::CANCELLED, why);
  if (conn.session == nullptr) return;
  // Reporting changes nothing in conn.calls (a send from done_ waits in
  // local_pending_).
  for (const auto& [id, call] : conn.calls) EndNow(call, grpc::StatusCode::CANCELLED, why);
  // Resets only queue frames: no call ends while this iterates.
  for (const auto& [id, call] : conn.calls) {
    nghttp2_submit_rst_stream(conn.session, NGHTTP2_FLAG_NONE, id, NGHTTP2_CANCEL);
  }
}

void H2Transport::Impl::Report(const H2CallInfo& info, int code, absl::string_view message,
                               absl::string_view response) {
  done_(info, H2Answer{code, message, response});
}

void H2Transport::Impl::Finish(Conn& conn, Call* call, uint32_t reset_code) {
  conn.calls.erase(call->stream_id);
  if (call->reported) {
    delete call;
    return;
  }
  int code;
  std::string message;
  absl::string_view response;
  if (call->local_code != 0) {
    code = call->local_code;
    message = call->local_message;
  } else if (call->grpc_status >= 0) {
    code = call->grpc_status;
    message = std::move(call->grpc_message);
  } else if (call->http_status != 0 && call->http_status != 200) {
    code = CodeOfHttpStatus(call->http_status);
    message = absl::StrCat("HTTP status ", call->http_status, " without grpc-status");
  } else if (reset_code != NGHTTP2_NO_ERROR) {
    code = CodeOfResetStream(reset_code);
    message = absl::StrCat("the stream was reset: ", nghttp2_http2_strerror(reset_code));
  } else {
    code = grpc::StatusCode::UNKNOWN;
    message = "the answer ended without grpc-status";
  }
  if (code == grpc::StatusCode::OK) {
    const std::string& data = call->data;
    uint32_t length = 0;
    if (data.size() >= kGrpcPrefix) {
      for (size_t i = 1; i < kGrpcPrefix; ++i) {
        length = length << 8 | static_cast<uint8_t>(data[i]);
      }
    }
    if (data.size() < kGrpcPrefix || data.size() - kGrpcPrefix != length) {
      code = grpc::StatusCode::INTERNAL;
      message = "the answer is not one gRPC message";
    } else if (data[0] != 0) {
      code = grpc::StatusCode::INTERNAL;
      message = "the answer is compressed, which this client did not ask for";
    } else {
      response = absl::string_view(data).substr(kGrpcPrefix);
    }
  }
  Report(call->info, code, message, response);
  delete call;
}

int H2Transport::Impl::OnHeader(nghttp2_session* session, const nghttp2_frame* frame,
                                const uint8_t* name, size_t namelen, const uint8_t* value,
                                size_t valuelen, uint8_t /*flags*/, void* /*user_data*/) {
  if (frame->hd.type != NGHTTP2_HEADERS) return 0;
  auto* call =
      static_cast<Call*>(nghttp2_session_get_stream_user_data(session, frame->hd.stream_id));
  if (call == nullptr) return 0;
  const absl::string_view key(reinterpret_cast<const char*>(name), namelen);
  const absl::string_view text(reinterpret_cast<const char*>(value), valuelen);
  if (key == ":status") {
    int status;
    if (absl::SimpleAtoi(text, &status)) call->http_status = status;
  } else if (key == "grpc-status") {
    int status;
    call->grpc_status = absl::SimpleAtoi(text, &status) && status >= 0 && status <= 16
                            ? status
                            : static_cast<int>(grpc::StatusCode::UNKNOWN);
  } else if (key == "grpc-message") {
    call->grpc_message = h2_internal::PercentDecode(text);
  }
  return 0;
}

int H2Transport::Impl::OnData(nghttp2_session* session, uint8_t /*flags*/, int32_t stream_id,
                              const uint8_t* data, size_t len, void* user_data) {
  auto* call = static_cast<Call*>(nghttp2_session_get_stream_user_data(session, stream_id));
  if (call == nullptr || call->local_code != 0) return 0;
  const Impl& impl = *static_cast<Conn*>(user_data)->owner;
  if (call->data.size() + len >
      kGrpcPrefix + static_cast<size_t>(impl.options_.max_message_bytes)) {
    call->local_code = grpc::StatusCode::RESOURCE_EXHAUSTED;
    call->local_message = absl::StrCat("the answer is larger than the ",
                                       impl.options_.max_message_bytes, "-byte limit");
    call->data.clear();
    nghttp2_submit_rst_stream(session, NGHTTP2_FLAG_NONE, stream_id, NGHTTP2_CANCEL);
    return 0;
  }
  call->data.append(reinterpret_cast<const char*>(data), len);
  return 0;
}

int H2Transport::Impl::OnFrame(nghttp2_session* /*session*/, const nghttp2_frame* frame,
                               void* user_data) {
  Conn& conn = *static_cast<Conn*>(user_data);
  if (frame->hd.type == NGHTTP2_SETTINGS && (frame->hd.flags & NGHTTP2_FLAG_ACK) == 0 &&
      conn.state == State::kHandshaking) {
    conn.state = State::kUp;
    conn.backoff_ns = absl::ToInt64Nanoseconds(conn.owner->options_.reconnect_backoff_initial);
    conn.ready.store(true);
  } else if (frame->hd.type == NGHTTP2_GOAWAY) {
    // No new calls here; the calls the server took still end, on this
    // connection, while the loop makes the next one (Retire).
    // (Nothing moves here, inside nghttp2's read of this session.)
    conn.ready.store(false);
    conn.state = State::kClosing;
  }
  return 0;
}

int H2Transport::Impl::OnStreamClose(nghttp2_session* session, int32_t stream_id,
                                     uint32_t error_code, void* user_data) {
  auto* call = static_cast<Call*>(nghttp2_session_get_stream_user_data(session, stream_id));
  if (call == nullptr) return 0;
  nghttp2_session_set_stream_user_data(session, stream_id, nullptr);
  Conn& conn = *static_cast<Conn*>(user_data);
  conn.owner->Finish(conn, call, error_code);
  return 0;
}

ssize_t H2Transport::Impl::ReadBody(nghttp2_session* /*session*/, int32_t /*stream_id*/,
                                    uint8_t* buf, size_t length, uint32_t* data_flags,
                                    nghttp2_data_source* source, void* user_data) {
  auto* call = static_cast<Call*>(source->ptr);
  const std::string& body = static_cast<Conn*>(user_data)->owner->body_;
  const size_t n = std::min(length, body.size() - call->body_offset);
  std::memcpy(buf, body.data() + call->body_offset, n);
  call->body_offset += n;
  if (call->body_offset == body.size()) *data_flags |= NGHTTP2_DATA_FLAG_EOF;
  return static_cast<ssize_t>(n);
}

// --- H2Transport ------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<H2Transport>> H2Transport::Connect(const H2Options& options,
                                                                  DoneFn done) {
  if (options.targets.empty()) return absl::InvalidArgumentError("no target given");
  std::vector<Address> addresses;
  for (const std::string& target : options.targets) {
    absl::StatusOr<Address> address = Resolve(target);
    if (!address.ok()) return address.status();
    addresses.push_back(*std::move(address));
  }
  auto impl = std::make_unique<Impl>(options, std::move(done));
  const absl::Status started = impl->Start(std::move(addresses));
  if (!started.ok()) return started;
  return std::unique_ptr<H2Transport>(new H2Transport(std::move(impl)));
}

H2Transport::H2Transport(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
H2Transport::~H2Transport() { Stop(); }
size_t H2Transport::size() const { return impl_->size(); }
bool H2Transport::Down(size_t i) const { return impl_->Down(i); }
void H2Transport::Send(size_t i, const H2CallInfo& info) { impl_->Send(i, info); }
void H2Transport::CancelAll() { impl_->CancelAll(); }
void H2Transport::SetPacer(std::function<int64_t(int64_t)> pace) {
  impl_->SetPacer(std::move(pace));
}
void H2Transport::Stop() { impl_->Stop(); }

}  // namespace attention::loadtest
