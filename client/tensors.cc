#include "client/tensors.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/enum_name.h"
#include "common/half.h"
#include "common/shape_string.h"
#include "common/status_macros.h"

namespace attention::client {
namespace {

// Product of the dims; INVALID_ARGUMENT for a negative dim or an overflow.
template <typename Shape>
absl::StatusOr<int64_t> ElementCount(const Shape& shape) {
  int64_t count = 1;
  int index = 0;
  for (int64_t dim : shape) {
    if (dim < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shape ", ShapeString(shape), " has negative dim ", dim, " at index ", index));
    }
    if (dim != 0 && count > std::numeric_limits<int64_t>::max() / dim) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeString(shape), " has more than ",
                       std::numeric_limits<int64_t>::max(), " elements"));
    }
    count *= dim;
    ++index;
  }
  return count;
}

bool IsFloatDType(v1::Tensor::DType dtype) {
  return dtype == v1::Tensor::FLOAT32 || dtype == v1::Tensor::BFLOAT16 ||
         dtype == v1::Tensor::FLOAT16;
}

int64_t FloatDTypeSize(v1::Tensor::DType dtype) { return dtype == v1::Tensor::FLOAT32 ? 4 : 2; }

absl::Status CheckValueCount(const std::vector<int64_t>& shape, size_t values) {
  ATTN_ASSIGN_OR_RETURN(int64_t count, ElementCount(shape));
  if (static_cast<uint64_t>(count) != values) {
    return absl::InvalidArgumentError(absl::StrCat("values has ", values, " elements, shape ",
                                                   ShapeString(shape), " needs ", count));
  }
  return absl::OkStatus();
}

void AppendLittleEndian(uint64_t bits, int bytes, std::string* out) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((bits >> (8 * i)) & 0xffu));
}

uint64_t ReadLittleEndian(const char* p, int bytes) {
  uint64_t bits = 0;
  for (int i = 0; i < bytes; ++i) {
    bits |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  }
  return bits;
}

v1::Tensor NewTensor(v1::Tensor::DType dtype, const std::vector<int64_t>& shape) {
  v1::Tensor tensor;
  tensor.set_dtype(dtype);
  tensor.mutable_shape()->Assign(shape.begin(), shape.end());
  return tensor;
}

}  // namespace

absl::StatusOr<v1::Tensor> MakeFloatTensor(const std::vector<int64_t>& shape,
                                           const std::vector<float>& values,
                                           v1::Tensor::DType dtype) {
  if (!IsFloatDType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype ", EnumName(dtype),
                     " is not a float type (FLOAT32, BFLOAT16 or FLOAT16)"));
  }
  ATTN_RETURN_IF_ERROR(CheckValueCount(shape, values.size()));
  v1::Tensor tensor = NewTensor(dtype, shape);
  std::string* data = tensor.mutable_data();
  const int bytes = static_cast<int>(FloatDTypeSize(dtype));
  data->reserve(values.size() * bytes);
  for (float value : values) {
    uint64_t bits;
    if (dtype == v1::Tensor::FLOAT32) {
      uint32_t u;
      std::memcpy(&u, &value, sizeof u);
      bits = u;
    } else if (dtype == v1::Tensor::BFLOAT16) {
      bits = FloatToBFloat16(value);
    } else {
      bits = FloatToFloat16(value);
    }
    AppendLittleEndian(bits, bytes, data);
  }
  return tensor;
}

absl::StatusOr<v1::Tensor> MakeBoolTensor(const std::vector<int64_t>& shape,
                                          const std::vector<bool>& values) {
  ATTN_RETURN_IF_ERROR(CheckValueCount(shape, values.size()));
  v1::Tensor tensor = NewTensor(v1::Tensor::BOOL, shape);
  std::string* data = tensor.mutable_data();
  data->reserve(values.size());
  for (bool value : values) data->push_back(value ? 1 : 0);
  return tensor;
}

absl::StatusOr<v1::Tensor> MakeInt64Tensor(const std::vector<int64_t>& shape,
                                           const std::vector<int64_t>& values) {
  ATTN_RETURN_IF_ERROR(CheckValueCount(shape, values.size()));
  v1::Tensor tensor = NewTensor(v1::Tensor::INT64, shape);
  std::string* data = tensor.mutable_data();
  data->reserve(values.size() * 8);
  for (int64_t value : values) AppendLittleEndian(static_cast<uint64_t>(value), 8, data);
  return tensor;
}

absl::StatusOr<std::vector<float>> ReadFloats(const v1::Tensor& tensor) {
  const v1::Tensor::DType dtype = tensor.dtype();
  if (!IsFloatDType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype ", EnumName(dtype),
                     " is not a float type (FLOAT32, BFLOAT16 or FLOAT16)"));
  }
  const int sources = (tensor.data().empty() ? 0 : 1) + (tensor.float_data_size() > 0 ? 1 : 0) +
                      (tensor.int_data_size() > 0 ? 1 : 0);
  if (sources > 1) {
    return absl::InvalidArgumentError("at most one of data, float_data and int_data may be set");
  }
  if (tensor.int_data_size() > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("int_data is set on a ", EnumName(dtype),
                     " tensor; int_data holds INT64, INT32 or BOOL elements"));
  }
  ATTN_ASSIGN_OR_RETURN(int64_t count, ElementCount(tensor.shape()));
  if (tensor.float_data_size() > 0) {
    if (dtype != v1::Tensor::FLOAT32) {
      return absl::InvalidArgumentError(absl::StrCat(
          "float_data is set on a ", EnumName(dtype), " tensor; it needs FLOAT32"));
    }
    if (tensor.float_data_size() != count) {
      return absl::InvalidArgumentError(
          absl::StrCat("float_data has ", tensor.float_data_size(), " elements, shape ",
                       ShapeString(tensor.shape()), " needs ", count));
    }
    return std::vector<float>(tensor.float_data().begin(), tensor.float_data().end());
  }
  const int64_t element_size = FloatDTypeSize(dtype);
  const std::string& data = tensor.data();
  if (count > std::numeric_limits<int64_t>::max() / element_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape ", ShapeString(tensor.shape()), " of ", EnumName(dtype),
                     " needs more than ", std::numeric_limits<int64_t>::max(), " bytes"));
  }
  if (static_cast<uint64_t>(count * element_size) != data.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("data has ", data.size(), " bytes, shape ", ShapeString(tensor.shape()),
                     " of ", EnumName(dtype), " needs ", count * element_size, " (",
                     element_size, " bytes per element)"));
  }
  std::vector<float> values;
  values.reserve(count);
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t bits = ReadLittleEndian(data.data() + i * element_size, element_size);
    if (dtype == v1::Tensor::FLOAT32) {
      const uint32_t u = static_cast<uint32_t>(bits);
      float value;
      std::memcpy(&value, &u, sizeof value);
      values.push_back(value);
    } else if (dtype == v1::Tensor::BFLOAT16) {
      values.push_back(BFloat16ToFloat(static_cast<uint16_t>(bits)));
    } else {
      values.push_back(Float16ToFloat(static_cast<uint16_t>(bits)));
    }
  }
  return values;
}

absl::Status ExpandToFloatData(v1::Tensor* tensor) {
  if (!IsFloatDType(tensor->dtype())) return absl::OkStatus();
  ATTN_ASSIGN_OR_RETURN(std::vector<float> values, ReadFloats(*tensor));
  tensor->set_dtype(v1::Tensor::FLOAT32);
  tensor->clear_data();
  tensor->mutable_float_data()->Assign(values.begin(), values.end());
  return absl::OkStatus();
}

}  // namespace attention::client
