#include "server/allocator.h"

#include <sys/types.h>

#include <cstddef>

// jemalloc's own declaration; weak, so a build without jemalloc (sanitizers)
// sees a null function.
extern "C" int mallctl(const char* name, void* oldp, size_t* oldlenp, void* newp,
                       size_t newlen) __attribute__((weak));

// Read by jemalloc as it starts (the MALLOC_CONF environment variable still
// overrides it):
// - background_thread: a thread of jemalloc's purges freed pages, so an idle
//   server returns them too (otherwise only allocating threads purge);
// - dirty_decay_ms 1000: pages freed for a second go back to the system
//   (default 10 s, which let RSS swing by 30 MiB under the soak's mix);
// - muzzy_decay_ms 0: returned at once with MADV_DONTNEED, not kept lazily;
// - narenas 2: one arena per core rather than four, as few heaps as threads
//   that compute.
extern "C" {
const char* malloc_conf = "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0,narenas:2";
}

namespace attention::server {

std::string AllocatorName() {
  if (mallctl == nullptr) return "malloc of the C library or a sanitizer (no jemalloc)";
  const char* version = nullptr;
  size_t size = sizeof(version);
  if (mallctl("version", &version, &size, nullptr, 0) != 0 || version == nullptr) {
    return "jemalloc";
  }
  return std::string("jemalloc ") + version;
}

std::optional<int64_t> JemallocValue(const char* name) {
  if (mallctl == nullptr) return std::nullopt;
  ssize_t value = 0;  // jemalloc's *_ms settings are ssize_t
  size_t size = sizeof(value);
  if (mallctl(name, &value, &size, nullptr, 0) != 0 || size != sizeof(value)) return std::nullopt;
  return static_cast<int64_t>(value);
}

std::optional<bool> JemallocFlag(const char* name) {
  if (mallctl == nullptr) return std::nullopt;
  bool value = false;
  size_t size = sizeof(value);
  if (mallctl(name, &value, &size, nullptr, 0) != 0) return std::nullopt;
  return value;
}

}  // namespace attention::server
