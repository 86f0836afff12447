#ifndef ATTENTION_SERVER_SAFETENSORS_H_
#define ATTENTION_SERVER_SAFETENSORS_H_

// A reader for the safetensors format: an 8-byte little-endian header
// length N, N bytes of JSON mapping each tensor name to its dtype, shape and
// [begin, end) byte offsets into the data that follows, then the data.

#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "engine/multihead.h"

namespace attention {

// Parses `bytes` (a whole file) into float tensors; F32, BF16 and F16 are
// accepted and widened. INVALID_ARGUMENT naming `source`, the key and the
// numbers for: a truncated file, a header length beyond the file, bad JSON,
// an unknown dtype, a shape that does not match its byte range, offsets out
// of range or overlapping.
absl::StatusOr<StateDict> ParseSafetensors(absl::string_view bytes, const std::string& source);

// Reads and parses the file at `path`. NOT_FOUND when it cannot be opened.
absl::StatusOr<StateDict> ReadSafetensors(const std::string& path);

}  // namespace attention

#endif  // ATTENTION_SERVER_SAFETENSORS_H_
