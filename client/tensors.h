#ifndef ATTENTION_CLIENT_TENSORS_H_
#define ATTENTION_CLIENT_TENSORS_H_

// Building wire tensors from plain C++ containers and reading them back.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/v1/tensor.pb.h"

namespace attention::client {

// `values` encoded as FLOAT32 (default), BFLOAT16 or FLOAT16 in `data`.
// INVALID_ARGUMENT when values.size() != product(shape) or dtype is not a float type.
absl::StatusOr<v1::Tensor> MakeFloatTensor(
    const std::vector<int64_t>& shape, const std::vector<float>& values,
    v1::Tensor::DType dtype = v1::Tensor::FLOAT32);
// BOOL tensor, one byte per element.
absl::StatusOr<v1::Tensor> MakeBoolTensor(const std::vector<int64_t>& shape,
                                          const std::vector<bool>& values);
// INT64 tensor.
absl::StatusOr<v1::Tensor> MakeInt64Tensor(const std::vector<int64_t>& shape,
                                           const std::vector<int64_t>& values);

// Elements of a FLOAT32 / BFLOAT16 / FLOAT16 tensor (from `data` or
// `float_data`) as floats. INVALID_ARGUMENT on a byte count that does not
// match the shape, or a non-float dtype.
absl::StatusOr<std::vector<float>> ReadFloats(const v1::Tensor& tensor);

// Replaces `data` of a float tensor by `float_data` (dtype FLOAT32), for
// human-readable JSON. A non-float tensor is left as it is.
absl::Status ExpandToFloatData(v1::Tensor* tensor);

}  // namespace attention::client

#endif  // ATTENTION_CLIENT_TENSORS_H_
