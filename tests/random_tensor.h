#ifndef ATTENTION_TESTS_RANDOM_TENSOR_H_
#define ATTENTION_TESTS_RANDOM_TENSOR_H_

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "engine/attention.h"

namespace attention::testing {

// A FLOAT32 tensor that owns its values.
struct FloatTensor {
  std::vector<int64_t> shape;
  std::vector<float> values;

  TensorView view() const {
    return TensorView{DType::kFloat32, shape, values.data(), values.size() * sizeof(float)};
  }
};

// Standard normal values, the same for the same shape and seed.
inline FloatTensor RandomFloats(std::vector<int64_t> shape, uint32_t seed) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  FloatTensor t{std::move(shape), std::vector<float>(static_cast<size_t>(n))};
  for (float& x : t.values) x = dist(rng);
  return t;
}

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_RANDOM_TENSOR_H_
