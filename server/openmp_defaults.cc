#include "server/openmp_defaults.h"

#include <limits.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace attention::server {

// Why it matters: unless told otherwise, libgomp has each thread spin for
// milliseconds after every parallel pass, so under a steady stream of medium
// calls one core of a small machine spins rather than serving gRPC
// (docs/benchmarks.md, "Decisions").
//
// Why not earlier than main: an executable's .preinit_array runs before the
// libraries' constructors, but glibc's own initialisation, which comes after
// it, resets the environment to the one the kernel passed.
void ReexecWithOpenMpDefaults(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  setenv("OMP_WAIT_POLICY", "PASSIVE", /*overwrite=*/1);
  // The binary's own path rather than /proc/self/exe, which would rename the
  // process "exe" in ps and top.
  char path[PATH_MAX];
  const ssize_t length = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (length > 0) {
    path[length] = '\0';
    execv(path, argv);
  } else {
    execv("/proc/self/exe", argv);
  }
  std::fprintf(stderr,
               "warning: cannot execute this binary again with OMP_WAIT_POLICY=PASSIVE (%s); "
               "idle engine threads will spin. Set OMP_WAIT_POLICY in the environment.\n",
               std::strerror(errno));
}

}  // namespace attention::server
