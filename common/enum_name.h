// How every message names a value of a proto enum: "BFLOAT16", or the number
// itself for a value the enum does not define (sent by a newer peer, or
// garbage), where the generated *_Name() gives an empty string.
#ifndef ATTENTION_COMMON_ENUM_NAME_H_
#define ATTENTION_COMMON_ENUM_NAME_H_

#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/generated_enum_reflection.h"

namespace attention {

template <typename Enum>
std::string EnumName(Enum value) {
  const google::protobuf::EnumValueDescriptor* named =
      google::protobuf::GetEnumDescriptor<Enum>()->FindValueByNumber(static_cast<int>(value));
  return named != nullptr ? named->name() : absl::StrCat(static_cast<int>(value));
}

}  // namespace attention

#endif  // ATTENTION_COMMON_ENUM_NAME_H_
