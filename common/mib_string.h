// How messages write byte counts in MiB, the unit of the limits' flags.
#ifndef ATTENTION_COMMON_MIB_STRING_H_
#define ATTENTION_COMMON_MIB_STRING_H_

#include <cmath>
#include <string>

#include "absl/strings/str_format.h"

namespace attention {

// `bytes` in MiB, without the unit: one decimal, or three significant digits
// below 0.1 MiB, so that 16 KB does not read as 0.0.
inline std::string MiBString(double bytes) {
  if (bytes == 0) return "0";
  const double mib = bytes / 1048576.0;
  return std::abs(mib) >= 0.1 ? absl::StrFormat("%.1f", mib) : absl::StrFormat("%.3g", mib);
}

// `bytes` and the `limit` they are over, each "X MiB"; both with their exact
// bytes too when in MiB they would read the same ("8.0 over 8.0").
struct MiBPair {
  std::string bytes;
  std::string limit;
};
inline MiBPair MiBOverLimit(double bytes, double limit) {
  MiBPair pair{MiBString(bytes) + " MiB", MiBString(limit) + " MiB"};
  if (pair.bytes == pair.limit) {
    pair.bytes += absl::StrFormat(" (%.0f bytes)", bytes);
    pair.limit += absl::StrFormat(" (%.0f bytes)", limit);
  }
  return pair;
}

}  // namespace attention

#endif  // ATTENTION_COMMON_MIB_STRING_H_
