#include "server/safetensors.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "common/shape_string.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "server/files.h"

namespace attention {
namespace {

struct Entry {
  std::string key;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

size_t ElementSize(const std::string& dtype) {
  if (dtype == "F32") return 4;
  if (dtype == "BF16" || dtype == "F16") return 2;
  return 0;
}

float LoadElement(const char* p, const std::string& dtype) {
  if (dtype == "F32") {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return dtype == "BF16" ? BFloat16ToFloat(h) : Float16ToFloat(h);
}

absl::StatusOr<Entry> ParseEntry(const std::string& key, const nlohmann::json& j,
                                 const std::string& source) {
  auto error = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": tensor \"", key, "\": ", what));
  };
  if (!j.is_object()) return error("header entry is not an object");
  Entry e;
  e.key = key;
  auto dtype = j.find("dtype");
  auto shape = j.find("shape");
  auto offsets = j.find("data_offsets");
  if (dtype == j.end() || !dtype->is_string()) return error("missing string \"dtype\"");
  if (shape == j.end() || !shape->is_array()) return error("missing array \"shape\"");
  if (offsets == j.end() || !offsets->is_array() || offsets->size() != 2 ||
      !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned()) {
    return error("\"data_offsets\" must be two non-negative integers");
  }
  e.dtype = dtype->get<std::string>();
  if (ElementSize(e.dtype) == 0) {
    return error(absl::StrCat("dtype ", e.dtype, " is not supported; want F32, BF16 or F16"));
  }
  uint64_t elements = 1;
  for (const auto& d : *shape) {
    if (!d.is_number_unsigned()) return error("shape dims must be non-negative integers");
    uint64_t dim = d.get<uint64_t>();
    if (dim > static_cast<uint64_t>(INT64_MAX) ||
        __builtin_mul_overflow(elements, dim, &elements)) {
      return error("shape has too many elements");
    }
    e.shape.push_back(static_cast<int64_t>(dim));
  }
  e.begin = (*offsets)[0].get<uint64_t>();
  e.end = (*offsets)[1].get<uint64_t>();
  uint64_t bytes;
  if (__builtin_mul_overflow(elements, ElementSize(e.dtype), &bytes)) {
    return error("shape has too many bytes");
  }
  if (e.end < e.begin || e.end - e.begin != bytes) {
    return error(absl::StrCat("data_offsets [", e.begin, ", ", e.end, ") hold ",
                              e.end >= e.begin ? e.end - e.begin : 0, " bytes; shape ",
                              ShapeString(e.shape), " of ", e.dtype, " needs ", bytes));
  }
  return e;
}

}  // namespace

absl::StatusOr<StateDict> ParseSafetensors(absl::string_view bytes, const std::string& source) {
  if (bytes.size() < 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": file has ", bytes.size(),
                     " bytes; a safetensors file starts with an 8-byte header length"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  if (header_len > bytes.size() - 8) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": header length ", header_len,
                                                   " runs past the end of the ", bytes.size(),
                                                   "-byte file"));
  }
  const absl::string_view data = bytes.substr(8 + header_len);
  nlohmann::json header = nlohmann::json::parse(bytes.substr(8, header_len), nullptr,
                                                /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": header is not a JSON object"));
  }
  std::vector<Entry> entries;
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") continue;
    auto entry = ParseEntry(key, value, source);
    if (!entry.ok()) return entry.status();
    if (entry->end > data.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": tensor \"", key, "\": data_offsets [", entry->begin, ", ",
                       entry->end, ") run past the ", data.size(), "-byte data section"));
    }
    entries.push_back(std::move(*entry));
  }
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  // As the format requires: the tensors cover the data section exactly,
  // with no overlap, no hole and nothing after the last.
  uint64_t covered = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (i > 0 && entries[i].begin < entries[i - 1].end) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": tensors \"", entries[i - 1].key, "\" [", entries[i - 1].begin,
                       ", ", entries[i - 1].end, ") and \"", entries[i].key, "\" [",
                       entries[i].begin, ", ", entries[i].end, ") overlap"));
    }
    if (entries[i].begin > covered) {
      return absl::InvalidArgumentError(absl::StrCat(
          source, ": bytes [", covered, ", ", entries[i].begin, ") of the data section before \"",
          entries[i].key, "\" belong to no tensor"));
    }
    covered = entries[i].end;
  }
  if (covered != data.size()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": the data section has ", data.size(),
                                                   " bytes; its tensors hold ", covered));
  }
  StateDict dict;
  for (const Entry& e : entries) {
    const size_t size = ElementSize(e.dtype);
    Tensor t;
    t.shape = e.shape;
    t.data.resize((e.end - e.begin) / size);
    for (size_t i = 0; i < t.data.size(); ++i) {
      t.data[i] = LoadElement(data.data() + e.begin + i * size, e.dtype);
    }
    dict.emplace(e.key, std::move(t));
  }
  return dict;
}

absl::StatusOr<StateDict> ReadSafetensors(const std::string& path) {
  ATTN_ASSIGN_OR_RETURN(std::string contents, server::ReadFile(path));
  return ParseSafetensors(contents, path);
}

}  // namespace attention
