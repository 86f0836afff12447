#ifndef ATTENTION_TESTS_GOLDEN_CASE_H_
#define ATTENTION_TESTS_GOLDEN_CASE_H_

// Loads the PyTorch-computed cases in tests/golden/ (format: tests/golden/README.md).

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/types/span.h"
#include "engine/attention.h"
#include "engine/multihead.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace attention::testing {

// One tensor of a case: "f32", "bool" or "i64", with its elements encoded as
// on the wire (little-endian f32 / one byte per bool / i64) in `bytes`.
struct GoldenTensor {
  bool present = false;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<double> values;
  std::string bytes;

  DType engine_dtype() const;
  // A view of `bytes`, or an absent view when !present.
  TensorView View() const;
};

struct GoldenCase {
  std::string name;
  std::string kind;  // "attention" or "multihead"
  GoldenTensor query, key, value;

  std::string score = "scaled_dot";
  std::optional<double> scale;
  std::optional<int64_t> num_heads;
  GoldenTensor w_q, w_k, w_v, w;
  std::optional<double> bandwidth;

  GoldenTensor valid_lens, key_padding_mask, attn_mask;
  std::string causal = "none";
  bool need_weights = false;
  bool average_weights = false;

  nlohmann::json multihead;  // kind == "multihead" only

  GoldenTensor expected_output, expected_weights;
  double atol = 0, rtol = 0;
};

// Names (file stems) of every case of `kind`, sorted.
std::vector<std::string> GoldenCaseNames(std::string_view kind);
// Loads tests/golden/<name>.json; fails the current test on a malformed file.
GoldenCase LoadGoldenCase(const std::string& name);
// Engine arguments whose views point into `c`; `c` must outlive them.
AttentionArgs ToEngineArgs(const GoldenCase& c);

// The layer config of a "multihead" case.
MultiheadConfig MultiheadConfigOf(const GoldenCase& c);
// Its state_dict as float tensors.
StateDict StateDictOf(const GoldenCase& c);

// |got - want| <= atol + rtol * |want| element-wise, and equal shapes.
::testing::AssertionResult AllClose(const std::vector<int64_t>& got_shape,
                                    absl::Span<const float> got, const GoldenTensor& want,
                                    double atol, double rtol);

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_GOLDEN_CASE_H_
