#ifndef ATTENTION_TESTS_FUZZ_FUZZ_TARGETS_H_
#define ATTENTION_TESTS_FUZZ_FUZZ_TARGETS_H_

// The fuzz targets as plain functions: fuzz_main.cc makes each a libFuzzer
// binary (ATTENTION_FUZZ=ON), and replay_test.cc runs them in the normal test
// suite on every seed in corpus/ and every input in regressions/. Each
// returns when the input was handled as it should be (accepted, or refused
// with the documented code) and aborts with a message on a broken invariant;
// the sanitizers catch the rest. Not thread-safe: one call at a time.

#include <cstddef>
#include <cstdint>

namespace attention::fuzz {

// Bytes sent to Attend: ParseMessage, ToEngineRequest, Engine::CostOf and,
// when they pass, both backends (and the demo model for "model": "demo").
void Request(const uint8_t* data, size_t size);

// Bytes of a weights.safetensors file: ParseSafetensors, then
// MultiheadAttention::Create on what it accepts.
void Safetensors(const uint8_t* data, size_t size);

// A config.pbtxt, optionally followed by "\n#weights\n" and a
// weights.safetensors: the model loader, then a forward call on what loads.
void ModelConfig(const uint8_t* data, size_t size);

}  // namespace attention::fuzz

#endif  // ATTENTION_TESTS_FUZZ_FUZZ_TARGETS_H_
