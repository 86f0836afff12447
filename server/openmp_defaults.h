#ifndef ATTENTION_SERVER_OPENMP_DEFAULTS_H_
#define ATTENTION_SERVER_OPENMP_DEFAULTS_H_

namespace attention::server {

// Starts libgomp with OMP_WAIT_POLICY=PASSIVE unless the environment chose a
// policy: idle engine threads then sleep instead of spinning on the cores
// gRPC's threads need.
//
// libgomp reads the variable once, in a constructor that runs before main, so
// setting it in main comes too late. Call this first thing in main: when the
// variable is unset, it sets it and executes the same binary again (the path
// /proc/self/exe links to) with the same `argv`, in the same process. It
// returns when the variable was already set, or, with a warning on stderr,
// when the exec fails.
void ReexecWithOpenMpDefaults(char** argv);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_OPENMP_DEFAULTS_H_
