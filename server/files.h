#ifndef ATTENTION_SERVER_FILES_H_
#define ATTENTION_SERVER_FILES_H_

#include <string>

#include "absl/status/statusor.h"

namespace attention::server {

// The whole of the file at `path`. NOT_FOUND "<path>: cannot open: <reason>"
// when it cannot be opened or read.
absl::StatusOr<std::string> ReadFile(const std::string& path);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_FILES_H_
