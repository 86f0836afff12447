// How every message of the project writes a tensor shape: "[2, 3, 4]".
#ifndef ATTENTION_COMMON_SHAPE_STRING_H_
#define ATTENTION_COMMON_SHAPE_STRING_H_

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attention {

// `shape` is any range of integers (std::vector<int64_t>, a protobuf
// RepeatedField, ...).
template <typename Shape>
std::string ShapeString(const Shape& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace attention

#endif  // ATTENTION_COMMON_SHAPE_STRING_H_
