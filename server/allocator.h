#ifndef ATTENTION_SERVER_ALLOCATOR_H_
#define ATTENTION_SERVER_ALLOCATOR_H_

#include <cstdint>
#include <optional>
#include <string>

namespace attention::server {

// The server binaries link jemalloc (not under sanitizers, which bring their
// own allocator), configured by server/allocator.cc: a background thread
// returns pages freed for a second to the system. With glibc's malloc a burst
// of large calls raised RSS for good (the freed memory stayed in its heaps),
// so RSS told an operator nothing about what the server was using.

// "jemalloc <version>", or what a build without jemalloc uses.
std::string AllocatorName();

// A numeric jemalloc setting or statistic (mallctl name, e.g.
// "opt.dirty_decay_ms"); nullopt without jemalloc or for an unknown name.
std::optional<int64_t> JemallocValue(const char* name);
std::optional<bool> JemallocFlag(const char* name);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_ALLOCATOR_H_
