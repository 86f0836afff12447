// How much a long call grows a real attention_server's peak RSS beyond its
// request and answer bytes (issue 18's target: under 64 MiB), for the shapes
// that must be answered with default flags. Starts the server binary given,
// one call per shape on a fresh server (peak RSS only ever grows), after a
// small call and an idle second (the server trims its heap once idle).
// Informational: exits 1 only when the server cannot start or a call fails.
//
//   server_memory_check PATH/TO/attention_server

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/attention_client.h"
#include "client/tensors.h"

namespace attention {
namespace {

// VmRSS and VmHWM of process `pid`, in MiB.
bool ReadRss(pid_t pid, double* rss, double* peak) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  int found = 0;
  while (std::getline(status, line)) {
    std::istringstream in(line);
    std::string key;
    double kib = 0;
    in >> key >> kib;
    if (key == "VmRSS:") *rss = kib / 1024, ++found;
    if (key == "VmHWM:") *peak = kib / 1024, ++found;
  }
  return found == 2;
}

v1::Tensor Random(const std::vector<int64_t>& shape, uint32_t seed) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  std::vector<float> values(static_cast<size_t>(n));
  for (float& x : values) x = dist(rng);
  return *client::MakeFloatTensor(shape, values);
}

// One shape on a fresh server: false when it cannot be measured.
bool Measure(const std::string& server_binary, const std::vector<int64_t>& shape) {
  const std::string port_file = "/tmp/server_memory_check." + std::to_string(getpid());
  std::remove(port_file.c_str());
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string port_flag = "--port_file=" + port_file;
    execl(server_binary.c_str(), server_binary.c_str(), "--listen=127.0.0.1:0", port_flag.c_str(),
          "--log_level=warn", static_cast<char*>(nullptr));
    _exit(127);
  }
  std::string port;
  for (int i = 0; i < 600 && port.empty(); ++i) {  // at most a minute
    absl::SleepFor(absl::Milliseconds(100));
    std::ifstream in(port_file);
    in >> port;
  }
  bool ok = !port.empty();
  if (ok) {
    client::ClientOptions options;
    options.target = "127.0.0.1:" + port;
    options.max_message_mb = 1024;
    options.timeout = absl::Minutes(10);
    std::unique_ptr<client::AttentionClient> client =
        std::move(client::AttentionClient::Create(options)).value();
    v1::AttendRequest small;
    *small.mutable_query() = Random({1, 2, 4, 8}, 0);
    ok = client->Attend(small).ok();
    v1::AttendRequest request;
    *request.mutable_query() = Random(shape, 1);
    *request.mutable_key() = Random(shape, 2);
    *request.mutable_value() = Random(shape, 3);
    absl::SleepFor(absl::Milliseconds(1500));  // the idle heap trim
    double rss_before = 0, peak = 0, rss_after = 0;
    ok = ok && ReadRss(pid, &rss_before, &peak);
    const absl::Time start = absl::Now();
    absl::StatusOr<v1::AttendResponse> answer = client->Attend(request);
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    ok = ok && answer.ok() && ReadRss(pid, &rss_after, &peak);
    if (ok) {
      const double request_mib = request.ByteSizeLong() / 1048576.0;
      const double answer_mib = answer->ByteSizeLong() / 1048576.0;
      const double grew = peak - rss_before;
      std::printf(
          "B%lld H%lld L=S=%lld D%lld: %5.2f s; request %6.1f MiB, answer %5.1f MiB; "
          "peak RSS grew %6.1f MiB, %5.1f MiB beyond request + answer (target < 64)\n",
          static_cast<long long>(shape[0]), static_cast<long long>(shape[1]),
          static_cast<long long>(shape[2]), static_cast<long long>(shape[3]), seconds, request_mib,
          answer_mib, grew, grew - request_mib - answer_mib);
    } else {
      std::fprintf(stderr, "shape failed: %s\n",
                   answer.ok() ? "cannot read /proc" : answer.status().ToString().c_str());
    }
  } else {
    std::fprintf(stderr, "%s did not start\n", server_binary.c_str());
  }
  kill(pid, SIGTERM);
  waitpid(pid, nullptr, 0);
  std::remove(port_file.c_str());
  return ok;
}

}  // namespace
}  // namespace attention

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s PATH/TO/attention_server\n", argv[0]);
    return 2;
  }
  bool ok = true;
  for (const std::vector<int64_t>& shape :
       {std::vector<int64_t>{1, 1, 32768, 64}, std::vector<int64_t>{1, 8, 16384, 64}}) {
    ok = attention::Measure(argv[1], shape) && ok;
  }
  return ok ? 0 : 1;
}
