// libFuzzer's entry points for the target named by ATTENTION_FUZZ_TARGET
// (tests/fuzz/CMakeLists.txt builds one binary per target).

#include <cstddef>
#include <cstdint>

#include "google/protobuf/stubs/logging.h"
#include "tests/fuzz/fuzz_targets.h"

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  // protobuf logs an error for every message whose strings are not UTF-8,
  // which is most of what a fuzzer sends; the server logs those at debug
  // (server/logging.cc). Here they would only slow the run and bury reports.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attention::fuzz::ATTENTION_FUZZ_TARGET(data, size);
  return 0;
}
