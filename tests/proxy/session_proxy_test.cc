// Sessions across replicas through a real proxy: three attention_server
// processes on 127.0.0.1 behind Debian's HAProxy with deploy/haproxy/haproxy.cfg
// (HTTP/2 end to end, balance hdr(attention-affinity), hash-type consistent).
// 64 decoders, each with its session (client::Session keeping its rows),
// step in rounds; each step's output is recorded.
//   1. Affinity: every step of a session is answered by the replica that
//      created it (the answers' attention-replica metadata), and each
//      replica's own metrics count exactly the sessions and rows routed to
//      it, with no NOT_FOUND; the sessions spread over the three within 25%.
//   2. The load tester through the proxy reports per-replica counts that
//      match the servers' metrics.
//   3. A replica killed (SIGKILL) mid-run, calls in flight: its sessions
//      answer NOT_FOUND where they land next, are recreated there from the
//      kept rows, and every step's output equals the run without the
//      failure; sessions on the other replicas are never recreated or moved.
//   4. A replica stopped with SIGTERM (scale-in) mid-run: the same, and the
//      replica exits 0 after its drain; again with each decoder's steps on
//      an AttendStream of its own. (A step that reaches it as gRPC shuts
//      down is CANCELLED, rarely: sent again, as UNAVAILABLE is.) With
//      --shutdown_delay_seconds, no step is refused at all.
//   5. A replica that misses one health check (stopped until HAProxy logs
//      the failure) stays in the ring: none of its sessions moves.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attention/v1/attention.pb.h"
#include "client/attention_client.h"
#include "client/session.h"
#include "client/tensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "nlohmann/json.hpp"

#if !defined(ATTENTION_SERVER_BIN) || !defined(ATTENTION_LOADTEST_BIN) || \
    !defined(ATTENTION_HAPROXY_BIN) || !defined(ATTENTION_SOURCE_DIR)
#error "the build defines the binaries' and the source's paths"
#endif

extern char** environ;

namespace attention {
namespace {

constexpr int kReplicas = 3;
constexpr int kSessions = 64;
constexpr int kPrefill = 16;
constexpr int kSteps = 12;
constexpr int kHeads = 2;
constexpr int kEmbed = 16;
constexpr int kThreads = 8;

// A child process, its output in a log file; killed when dropped.
class Process {
 public:
  Process() = default;
  Process(Process&& other) noexcept : pid_(other.pid_), log_(std::move(other.log_)) {
    other.pid_ = -1;
  }
  Process& operator=(Process&& other) noexcept {
    Kill();
    pid_ = other.pid_;
    log_ = std::move(other.log_);
    other.pid_ = -1;
    return *this;
  }
  ~Process() { Kill(); }

  // `argv` with the environment plus `env` ("NAME=value").
  static absl::StatusOr<Process> Start(const std::vector<std::string>& argv,
                                       const std::vector<std::string>& env,
                                       const std::string& log) {
    std::vector<std::string> environment(env);
    for (char** e = environ; *e != nullptr; ++e) environment.emplace_back(*e);
    std::vector<char*> args, envp;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    for (const std::string& e : environment) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);
    Process p;
    p.log_ = log;
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) {
      return absl::InternalError(absl::StrCat("cannot start ", argv[0], ": errno ", errno));
    }
    if (pid == 0) {
      // Only async-signal-safe calls until exec: the test has threads. The
      // child dies with the test's main thread (every Start is called from
      // it), also when the test is killed (a CTest timeout, a closed pipe),
      // so no server or proxy outlives it.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);
      const int fd = open(p.log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd < 0 || dup2(fd, 1) < 0 || dup2(fd, 2) < 0) _exit(127);
      execve(args[0], args.data(), envp.data());
      _exit(127);  // the log is empty and Running() turns false
    }
    p.pid_ = pid;
    return p;
  }

  bool Running() {
    if (pid_ <= 0) return false;
    int status;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return false;
    }
    return true;
  }

  void Signal(int signal) {
    if (pid_ > 0) kill(pid_, signal);
  }

  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  // SIGTERM, then its exit code; DEADLINE_EXCEEDED (and killed) if it still
  // runs after `timeout`.
  absl::StatusOr<int> Terminate(absl::Duration timeout) {
    if (pid_ <= 0) return absl::FailedPreconditionError("not running");
    kill(pid_, SIGTERM);
    const absl::Time end = absl::Now() + timeout;
    while (absl::Now() < end) {
      int status;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    Kill();
    return absl::DeadlineExceededError("still running after SIGTERM");
  }

  std::string Log() const {
    std::ifstream in(log_);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

 private:
  pid_t pid_ = -1;
  std::string log_;
};

// A port of 127.0.0.1 nothing listens on now.
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

bool Accepts(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  close(fd);
  return ok;
}

struct Replica {
  std::string name;
  Process process;
  int port = 0;
  int metrics_port = 0;
};

// A sample's value in the replica's /metrics (0 when absent).
double Metric(const Replica& replica, const std::string& sample) {
  httplib::Client http("127.0.0.1", replica.metrics_port);
  httplib::Result result = http.Get("/metrics");
  if (!result || result->status != 200) {
    ADD_FAILURE() << replica.name << ": no metrics";
    return -1;
  }
  std::istringstream lines(result->body);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind(sample + " ", 0) == 0) return std::stod(line.substr(sample.size() + 1));
  }
  return 0;
}

// The rows of session `s`: `rows` rows of [1, rows, kEmbed] from a seed of
// (s, first row, salt), the same in every run.
v1::Tensor Rows(int s, int first, int rows, int salt) {
  std::vector<float> values(static_cast<size_t>(rows) * kEmbed);
  for (size_t i = 0; i < values.size(); ++i) {
    const double x = 0.37 * s + 0.11 * first + 0.013 * static_cast<double>(i) + 0.7 * salt;
    values[i] = static_cast<float>(std::sin(x * 12.9898) * 0.9);
  }
  return *client::MakeFloatTensor({1, rows, kEmbed}, values);
}

// One decoder's record of a run: its outputs by step (the prefill first) and
// the replica that answered each.
struct Decoder {
  std::unique_ptr<client::Session> session;
  std::vector<std::vector<float>> outputs;
  std::vector<std::string> replicas;
  int unavailable_retries = 0;
  int cancelled_retries = 0;
};

class SessionProxyTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(absl::StrCat(::testing::TempDir(), "session_proxy_", getpid()));
    mkdir(dir_->c_str(), 0755);
  }
  static void TearDownTestSuite() {
    std::system(absl::StrCat("rm -rf '", *dir_, "'").c_str());
    delete dir_;
  }

  void SetUp() override {
    for (int i = 0; i < kReplicas; ++i) ASSERT_NO_FATAL_FAILURE(StartReplica(i));
    ASSERT_NO_FATAL_FAILURE(StartProxy());
  }

  void StartReplica(int i) {
    Replica r;
    r.name = absl::StrCat("replica", i + 1);
    const std::string port_file = absl::StrCat(*dir_, "/", r.name, ".port");
    std::remove(port_file.c_str());
    absl::StatusOr<Process> p = Process::Start(
        {ATTENTION_SERVER_BIN, "--listen=127.0.0.1:0", "--port_file=" + port_file,
         "--metrics_port=0", "--replica_name=" + r.name, "--engine_threads=1",
         "--model_repository=", "--drain_seconds=10",
         absl::StrCat("--shutdown_delay_seconds=", shutdown_delay_seconds_)},
        {}, absl::StrCat(*dir_, "/", r.name, ".log"));
    ASSERT_TRUE(p.ok()) << p.status();
    r.process = *std::move(p);
    const absl::Time end = absl::Now() + absl::Seconds(30);
    while (absl::Now() < end && (r.port == 0 || r.metrics_port == 0)) {
      ASSERT_TRUE(r.process.Running()) << r.name << " exited:\n" << r.process.Log();
      std::ifstream in(port_file);
      if (int port = 0; in >> port) r.port = port;
      // The log's "metrics on http://127.0.0.1:<port>/metrics". (Not
      // std::regex: GCC 12 warns inside its <regex> in the ASan build.)
      const std::string log = r.process.Log();
      constexpr absl::string_view kMetrics = "metrics on http://127.0.0.1:";
      const absl::string_view all(log);
      if (const size_t at = all.find(kMetrics); at != absl::string_view::npos) {
        // Up to "/metrics": a line still being written has no port yet.
        const absl::string_view rest = all.substr(at + kMetrics.size());
        const size_t end = rest.find("/metrics");
        if (int port = 0; end != absl::string_view::npos &&
                          absl::SimpleAtoi(rest.substr(0, end), &port) && port > 0) {
          r.metrics_port = port;
        }
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    ASSERT_GT(r.port, 0) << r.name << ": no port after 30 s:\n" << r.process.Log();
    ASSERT_GT(r.metrics_port, 0) << r.name << ": no metrics port:\n" << r.process.Log();
    replicas_[i] = std::move(r);
  }

  // HAProxy on a free port; tried again on another port if the one picked
  // was taken meanwhile.
  void StartProxy() {
    for (int attempt = 0; attempt < 5; ++attempt) {
      proxy_port_ = FreePort();
      ASSERT_NO_FATAL_FAILURE(LaunchProxy());
      if (proxy_.Running() && Accepts(proxy_port_)) break;
    }
    ASSERT_TRUE(proxy_.Running()) << "haproxy did not start:\n" << proxy_.Log();
    client::ClientOptions options;
    options.target = absl::StrCat("127.0.0.1:", proxy_port_);
    options.timeout = absl::Seconds(20);
    client_ = *client::AttentionClient::Create(options);
    // Every replica serving and in HAProxy's pool: a stateless call (round
    // robin: no affinity) reaches each of them within a few tries.
    std::set<std::string> seen;
    const absl::Time end = absl::Now() + absl::Seconds(30);
    while (absl::Now() < end && seen.size() < kReplicas) {
      std::string replica;
      client::CallOptions call;
      call.replica = &replica;
      v1::AttendRequest request;
      *request.mutable_query() = Rows(0, 0, 1, 9);
      if (client_->Attend(request, call).ok()) seen.insert(replica);
      absl::SleepFor(absl::Milliseconds(20));
    }
    ASSERT_EQ(seen.size(), static_cast<size_t>(kReplicas)) << proxy_.Log();
  }

  // HAProxy on proxy_port_, once it accepts connections (up to 10 s).
  void LaunchProxy() {
    std::vector<std::string> env = {absl::StrCat("ATTENTION_PROXY_BIND=127.0.0.1:", proxy_port_)};
    for (int i = 0; i < kReplicas; ++i) {
      env.push_back(absl::StrCat("ATTENTION_REPLICA_", i + 1, "=127.0.0.1:", replicas_[i].port));
      env.push_back(
          absl::StrCat("ATTENTION_REPLICA_", i + 1, "_CHECK_PORT=", replicas_[i].metrics_port));
    }
    absl::StatusOr<Process> p = Process::Start(
        {ATTENTION_HAPROXY_BIN, "-db", "-f", ATTENTION_SOURCE_DIR "/deploy/haproxy/haproxy.cfg"},
        env, absl::StrCat(*dir_, "/haproxy.log"));
    ASSERT_TRUE(p.ok()) << p.status();
    proxy_ = *std::move(p);
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (absl::Now() < end && proxy_.Running() && !Accepts(proxy_port_)) {
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  // The sessions' ids: the same in every run, so they hash alike.
  static std::string Id(int s) { return absl::StrCat("decoder-", s); }

  // Runs kSessions decoders through the proxy: a prefill, then kSteps
  // one-row steps in rounds (with `stream`, each decoder's on an AttendStream
  // of its own); `during` runs once half of the steps are answered, while
  // the others are in flight. Closes the sessions.
  std::vector<Decoder> Run(const std::function<void()>& during = nullptr, bool stream = false) {
    std::vector<Decoder> decoders(kSessions);
    for (int s = 0; s < kSessions; ++s) {
      client::SessionOptions options;
      options.id = Id(s);
      options.request.set_num_heads(kHeads);
      options.request.mutable_mask()->set_causal(v1::Mask::BOTTOM_RIGHT);
      options.keep_rows = true;
      options.stream = stream;
      decoders[s].session = *client::Session::Create(client_.get(), std::move(options));
    }
    std::atomic<int> answered{0};
    std::atomic<bool> fired{false};
    const int half = kSessions * kSteps / 2;
    auto step = [&](int s, int i) {
      Decoder& d = decoders[s];
      const int first = i == 0 ? 0 : kPrefill + i - 1;
      const int rows = i == 0 ? kPrefill : 1;
      // A step the proxy could not deliver (the replica died under it, and
      // HAProxy has not noticed yet) is UNAVAILABLE and changed nothing: a
      // decoder sends it again. Once a replica is stopping, so is a step
      // that reached it as gRPC shut down, before the service took it:
      // CANCELLED (docs/sessions.md). Had either changed anything, the step
      // sent again would be ABORTED, or its output differ from the clean run's.
      if (fired.load()) absl::SleepFor(pause_after_stop_);
      for (int attempt = 0;; ++attempt) {
        absl::StatusOr<v1::AttendResponse> answer =
            d.session->Step(Rows(s, first, rows, 0), Rows(s, first, rows, 1), Rows(s, first, rows, 2));
        if (answer.ok()) {
          d.outputs.push_back(*client::ReadFloats(answer->output()));
          d.replicas.push_back(d.session->replica());
          break;
        }
        const absl::StatusCode code = answer.status().code();
        const bool retry = code == absl::StatusCode::kUnavailable ||
                           (code == absl::StatusCode::kCancelled && fired.load());
        if (!retry || attempt == 20) {
          ADD_FAILURE() << Id(s) << " step " << i << ": " << answer.status();
          d.outputs.emplace_back();
          d.replicas.emplace_back();
          break;
        }
        ++(code == absl::StatusCode::kCancelled ? d.cancelled_retries : d.unavailable_retries);
        absl::SleepFor(absl::Milliseconds(250));
      }
      if (++answered == half && during && !fired.exchange(true)) during();
    };
    for (int i = 0; i <= kSteps; ++i) {
      std::vector<std::thread> threads;
      for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
          for (int s = t; s < kSessions; s += kThreads) step(s, i);
        });
      }
      for (std::thread& thread : threads) thread.join();
    }
    for (Decoder& d : decoders) EXPECT_TRUE(d.session->Close().ok()) << d.session->id();
    return decoders;
  }

  static int ReplicaIndex(const std::string& name) {
    for (int i = 0; i < kReplicas; ++i) {
      if (name == absl::StrCat("replica", i + 1)) return i;
    }
    return -1;
  }

  // The replica that created each session, and how many each created.
  static std::vector<int> Homes(const std::vector<Decoder>& run) {
    std::vector<int> homes;
    for (const Decoder& d : run) homes.push_back(ReplicaIndex(d.replicas.front()));
    return homes;
  }

  // Every step's output of `run` equals the clean run's.
  static void ExpectSameOutputs(const std::vector<Decoder>& run,
                                const std::vector<Decoder>& clean) {
    float worst = 0;
    for (int s = 0; s < kSessions; ++s) {
      ASSERT_EQ(run[s].outputs.size(), clean[s].outputs.size()) << Id(s);
      for (size_t i = 0; i < run[s].outputs.size(); ++i) {
        ASSERT_EQ(run[s].outputs[i].size(), clean[s].outputs[i].size()) << Id(s) << " step " << i;
        for (size_t e = 0; e < run[s].outputs[i].size(); ++e) {
          worst = std::max(worst, std::abs(run[s].outputs[i][e] - clean[s].outputs[i][e]));
        }
      }
    }
    EXPECT_LE(worst, 1e-5f) << "largest difference from the run without the failure";
    std::printf("outputs: largest difference from the run without the failure: %g\n", worst);
  }

  // The replica that created the most sessions in `run`.
  static int Busiest(const std::vector<Decoder>& run) {
    std::vector<int> created(kReplicas);
    for (int home : Homes(run)) ++created[home];
    return static_cast<int>(std::max_element(created.begin(), created.end()) - created.begin());
  }

  // A run with `stop` applied to the replica holding the most sessions
  // mid-run: its sessions move and are recreated once each, the others never
  // notice, and the outputs equal `clean`'s.
  // Returns the steps the decoders sent again (UNAVAILABLE or CANCELLED).
  int ExpectRecovery(const std::vector<Decoder>& clean, const std::function<void(Replica&)>& stop,
                     bool stream = false) {
    std::vector<int> created(kReplicas);
    for (int home : Homes(clean)) ++created[home];
    const int victim = Busiest(clean);
    const std::vector<Decoder> run = Run([&] { stop(replicas_[victim]); }, stream);
    if (HasFailure()) return -1;
    int recreated = 0, retries = 0, cancelled = 0;
    for (int s = 0; s < kSessions; ++s) {
      const Decoder& d = run[s];
      const int home = ReplicaIndex(d.replicas.front());
      EXPECT_EQ(home, Homes(clean)[s]) << Id(s) << ": created elsewhere than in the clean run";
      retries += d.unavailable_retries;
      cancelled += d.cancelled_retries;
      if (home != victim) {
        EXPECT_EQ(d.session->recreations(), 0) << Id(s);
        for (const std::string& r : d.replicas) EXPECT_EQ(ReplicaIndex(r), home) << Id(s);
        continue;
      }
      EXPECT_EQ(d.session->recreations(), 1) << Id(s) << " on " << replicas_[victim].name;
      recreated += static_cast<int>(d.session->recreations());
      // Once moved, it stays on its new replica.
      const std::string& last = d.replicas.back();
      EXPECT_NE(ReplicaIndex(last), victim) << Id(s);
      const auto moved = std::find(d.replicas.begin(), d.replicas.end(), last);
      for (auto it = moved; it != d.replicas.end(); ++it) EXPECT_EQ(*it, last) << Id(s);
    }
    std::printf("%s stopped mid-run: %d of its %d sessions recreated on the others; "
                "%d step retries after UNAVAILABLE, %d after CANCELLED\n",
                replicas_[victim].name.c_str(), recreated, created[victim], retries, cancelled);
    ExpectSameOutputs(run, clean);
    return retries + cancelled;
  }

  // A clean run, then one with the replica holding the most sessions
  // stopped with SIGTERM mid-run (ExpectRecovery); it exits 0 after its drain.
  // Returns the steps the decoders sent again (UNAVAILABLE or CANCELLED).
  int ExpectScaleIn(bool stream) {
    const std::vector<Decoder> clean = Run(nullptr, stream);
    if (HasFailure()) return -1;
    std::optional<absl::StatusOr<int>> exit_code;
    std::thread stopper;
    const int retried = ExpectRecovery(
        clean,
        [&](Replica& r) {
          // SIGTERM while calls are in flight; the drain runs meanwhile.
          stopper = std::thread([&] { exit_code = r.process.Terminate(absl::Seconds(30)); });
        },
        stream);
    if (stopper.joinable()) stopper.join();
    EXPECT_TRUE(exit_code.has_value() && exit_code->ok() && **exit_code == 0)
        << (exit_code.has_value() ? exit_code->status().ToString() : "not stopped");
    return retried;
  }

  static std::string* dir_;
  // --shutdown_delay_seconds of the replicas, and how long each decoder
  // waits before each step once `during` has run.
  int shutdown_delay_seconds_ = 0;
  absl::Duration pause_after_stop_ = absl::ZeroDuration();
  Replica replicas_[kReplicas];
  Process proxy_;
  int proxy_port_ = 0;
  std::unique_ptr<client::AttentionClient> client_;
};

std::string* SessionProxyTest::dir_ = nullptr;

constexpr char kAttendOk[] = R"(attention_requests_total{method="Attend",model="",code="OK"})";
constexpr char kAttendNotFound[] =
    R"(attention_requests_total{method="Attend",model="",code="NOT_FOUND"})";

TEST_F(SessionProxyTest, EveryStepReachesTheReplicaThatCreatedItsSession) {
  std::vector<double> ok_before(kReplicas);
  for (int i = 0; i < kReplicas; ++i) ok_before[i] = Metric(replicas_[i], kAttendOk);
  const std::vector<Decoder> run = Run();
  ASSERT_FALSE(HasFailure());
  std::vector<int> created(kReplicas), steps(kReplicas);
  for (int s = 0; s < kSessions; ++s) {
    const Decoder& d = run[s];
    EXPECT_EQ(d.session->recreations(), 0) << Id(s);
    const int home = ReplicaIndex(d.replicas.front());
    ASSERT_GE(home, 0) << Id(s) << " answered by \"" << d.replicas.front() << "\"";
    ++created[home];
    for (const std::string& r : d.replicas) EXPECT_EQ(r, d.replicas.front()) << Id(s);
    steps[home] += static_cast<int>(d.replicas.size());
  }
  // By the servers' own counts: each created exactly the sessions routed to
  // it and appended exactly their rows, and none was asked for a session it
  // did not have.
  for (int i = 0; i < kReplicas; ++i) {
    const Replica& r = replicas_[i];
    EXPECT_EQ(Metric(r, "attention_session_rows_appended_total"),
              created[i] * (kPrefill + kSteps))
        << r.name;
    EXPECT_EQ(Metric(r, kAttendOk) - ok_before[i], steps[i]) << r.name;
    EXPECT_EQ(Metric(r, kAttendNotFound), 0) << r.name;
    EXPECT_EQ(Metric(r, R"(attention_sessions_ended_total{reason="closed"})"), created[i]) << r.name;
    EXPECT_EQ(Metric(r, "attention_sessions_open"), 0) << r.name;
  }
  const double mean = static_cast<double>(kSessions) / kReplicas;
  for (int i = 0; i < kReplicas; ++i) {
    std::printf("%s: created %d of %d sessions, answered %d steps\n", replicas_[i].name.c_str(),
                created[i], kSessions, steps[i]);
    EXPECT_NEAR(created[i], mean, 0.25 * mean) << replicas_[i].name;
  }
}

TEST_F(SessionProxyTest, TheLoadTesterCountsWhatEachReplicaServed) {
  std::vector<double> rows_before(kReplicas);
  for (int i = 0; i < kReplicas; ++i) {
    rows_before[i] = Metric(replicas_[i], "attention_session_rows_appended_total");
  }
  const std::string report = absl::StrCat(*dir_, "/loadtest.json");
  const std::string command = absl::StrCat(
      ATTENTION_LOADTEST_BIN, " --target 127.0.0.1:", proxy_port_,
      " --sessions 24 --prefill 8 --steps 6 --heads 2 --embed_dim 16 --json ", report, " > ", *dir_,
      "/loadtest.log 2>&1");
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  std::ifstream in(report);
  const nlohmann::json json = nlohmann::json::parse(in);
  const nlohmann::json& replicas = json.at("sessions").at("replicas");
  ASSERT_EQ(replicas.size(), static_cast<size_t>(kReplicas)) << replicas.dump();
  int64_t created = 0, steps = 0;
  for (int i = 0; i < kReplicas; ++i) {
    const Replica& r = replicas_[i];
    ASSERT_TRUE(replicas.contains(r.name)) << replicas.dump();
    const nlohmann::json& counts = replicas.at(r.name);
    created += counts.at("created").get<int64_t>();
    steps += counts.at("steps").get<int64_t>();
    // The server appended the prefills of the sessions created there and
    // the steps it answered.
    EXPECT_EQ(Metric(r, "attention_session_rows_appended_total") - rows_before[i],
              counts.at("created").get<int64_t>() * 8 + counts.at("steps").get<int64_t>())
        << r.name;
    std::printf("load tester: %s created %lld sessions, answered %lld steps\n", r.name.c_str(),
                static_cast<long long>(counts.at("created").get<int64_t>()),
                static_cast<long long>(counts.at("steps").get<int64_t>()));
  }
  EXPECT_EQ(created, 24);
  EXPECT_EQ(steps, 24 * 6);
  EXPECT_EQ(json.at("sessions").at("sessions_recreated").get<int64_t>(), 0);
}

TEST_F(SessionProxyTest, SessionsOfAKilledReplicaAreRecreatedAndAnswerAsBefore) {
  const std::vector<Decoder> clean = Run();
  ASSERT_FALSE(HasFailure());
  ExpectRecovery(clean, [](Replica& r) { r.process.Kill(); });
  // A session call is not retried by HAProxy on its dead replica: it held
  // each such call 3 s (three retries a second apart) before answering 503,
  // past the callers' retries and, with a 2 s timeout, past their deadline.
  // A log line's timers and its "actconn/feconn/beconn/srv_conn/retries"
  // both have five fields; the retries are the last of the latter.
  for (absl::string_view line : absl::StrSplit(proxy_.Log(), '\n')) {
    // A call's line, not a check's.
    if (!absl::StrContains(line, " attention_sessions/") || !absl::StrContains(line, "\"POST ")) {
      continue;
    }
    std::vector<absl::string_view> counts;
    for (absl::string_view field : absl::StrSplit(line, ' ')) {
      std::vector<absl::string_view> parts = absl::StrSplit(field, '/');
      if (parts.size() == 5 && absl::c_all_of(field, [](char c) {
            return absl::ascii_isdigit(c) || c == '/' || c == '-' || c == '+';
          })) {
        counts = std::move(parts);
      }
    }
    ASSERT_EQ(counts.size(), 5u) << line;
    EXPECT_EQ(counts[4], "0") << "retried by HAProxy: " << line;
  }
}

TEST_F(SessionProxyTest, ScaleInDrainsAReplicaAndItsSessionsMoveOn) { ExpectScaleIn(false); }

// HAProxy takes a replica out after two failed checks (haproxy.cfg): one
// slow answer must not move its sessions away and back. The busiest replica
// is stopped (SIGSTOP) mid-run until HAProxy logs one failed check of it,
// then continued; its calls meanwhile wait, and every session stays where
// it was created.
TEST_F(SessionProxyTest, AReplicaThatMissesOneCheckKeepsItsSessions) {
  const std::vector<Decoder> clean = Run();
  ASSERT_FALSE(HasFailure());
  const int victim = Busiest(clean);
  const std::string server = absl::StrCat("attention_sessions/", replicas_[victim].name);
  const std::string failed = absl::StrCat("Health check for server ", server, " failed");
  bool missed = false;
  const std::vector<Decoder> run = Run([&] {
    replicas_[victim].process.Signal(SIGSTOP);
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (!missed && absl::Now() < end) {
      missed = proxy_.Log().find(failed) != std::string::npos;
      if (!missed) absl::SleepFor(absl::Milliseconds(10));
    }
    replicas_[victim].process.Signal(SIGCONT);
  });
  ASSERT_FALSE(HasFailure());
  const std::string log = proxy_.Log();
  EXPECT_TRUE(missed) << "no failed check of " << server << " in 10 s:\n" << log;
  EXPECT_EQ(log.find(server + " is DOWN"), std::string::npos) << log;
  for (int s = 0; s < kSessions; ++s) {
    const Decoder& d = run[s];
    EXPECT_EQ(d.session->recreations(), 0) << Id(s);
    EXPECT_EQ(d.unavailable_retries + d.cancelled_retries, 0) << Id(s);
    for (const std::string& r : d.replicas) EXPECT_EQ(r, clean[s].replicas.front()) << Id(s);
  }
  ExpectSameOutputs(run, clean);
}

// A client connected through HAProxy when it restarts: its calls fail
// UNAVAILABLE while the proxy is away, and succeed again soon after it is
// back. (They failed for as long as the client ran: no call waits while a
// channel fails, so nothing polled its reconnection, and HAProxy, which
// waits for the client's preface, timed each attempt out.)
TEST_F(SessionProxyTest, AClientConnectedBeforeTheProxyRestartedReconnects) {
  v1::AttendRequest request;
  *request.mutable_query() = Rows(0, 0, 1, 9);
  ASSERT_TRUE(client_->Attend(request).ok());
  proxy_.Kill();
  EXPECT_EQ(client_->Attend(request).status().code(), absl::StatusCode::kUnavailable);
  absl::SleepFor(absl::Seconds(1));  // a few failed reconnects
  ASSERT_NO_FATAL_FAILURE(LaunchProxy());
  ASSERT_TRUE(proxy_.Running() && Accepts(proxy_port_)) << "haproxy did not restart:\n"
                                                        << proxy_.Log();
  absl::Status last;
  const absl::Time end = absl::Now() + absl::Seconds(15);
  while (absl::Now() < end && !(last = client_->Attend(request).status()).ok()) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(last.ok()) << "still failing 15 s after HAProxy came back: " << last;
}

// Replicas that serve on for a while after SIGTERM, NOT_SERVING, before they
// drain (--shutdown_delay_seconds): HAProxy's check (every 500 ms) takes the
// stopping one out meanwhile, so no step is refused, and its sessions move
// on as before. The steps after the SIGTERM are spread over about 2 s, past
// HAProxy's noticing (without the delay, steps in that window are refused).
class DelayedShutdownProxyTest : public SessionProxyTest {
 protected:
  DelayedShutdownProxyTest() {
    shutdown_delay_seconds_ = 5;
    pause_after_stop_ = absl::Milliseconds(40);
  }
};

TEST_F(DelayedShutdownProxyTest, ScaleInRefusesNoStep) { EXPECT_EQ(ExpectScaleIn(false), 0); }

// The same with each decoder's steps on a stream of its own, which the
// draining replica ends UNAVAILABLE once it has answered what it took: the
// client sends the unanswered step again on a new stream.
TEST_F(SessionProxyTest, ScaleInEndsTheStreamsOfADrainingReplicaAndTheirSessionsMoveOn) {
  ExpectScaleIn(true);
}

}  // namespace
}  // namespace attention
