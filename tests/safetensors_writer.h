#ifndef ATTENTION_TESTS_SAFETENSORS_WRITER_H_
#define ATTENTION_TESTS_SAFETENSORS_WRITER_H_

// Writes safetensors files for tests, so they can build model repositories.

#include <string>

#include "engine/multihead.h"

namespace attention::testing {

// The bytes of a safetensors file holding `dict` as F32.
std::string SafetensorsBytes(const StateDict& dict);
// Writes `contents` to `path`; fails the current test on error.
void WriteFile(const std::string& path, const std::string& contents);
// A fresh empty directory under the test's temp dir, unique to this call,
// removed with what it holds when the process exits.
std::string MakeTempDir(const std::string& name);

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_SAFETENSORS_WRITER_H_
