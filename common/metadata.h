#ifndef ATTENTION_COMMON_METADATA_H_
#define ATTENTION_COMMON_METADATA_H_

// gRPC metadata the client and the server agree on (docs/sessions.md,
// "Sessions across replicas").

#include <string>
#include <string_view>

namespace attention {

// Sent by clients on session calls: the session's id, or a group id the
// caller chooses for sessions it keeps together. A proxy hashing on it sends
// every call of a session to one replica; the server ignores it.
inline constexpr char kAffinityHeader[] = "attention-affinity";

// The header's value for `key`, which may be any bytes (a session id is): gRPC
// carries only printable ASCII in a header, and refuses anything else before
// sending (the C++ library by aborting the process). Bytes outside '!'..'~',
// and '%' itself, go as %XX (uppercase hex, as in a URL); other ids go as
// they are. The Python client encodes alike, so both route a session alike.
inline std::string AffinityHeaderValue(std::string_view key) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string value;
  value.reserve(key.size());
  for (const char c : key) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte > ' ' && byte < 0x7F && byte != '%') {
      value.push_back(c);
    } else {
      value.push_back('%');
      value.push_back(kHex[byte >> 4]);
      value.push_back(kHex[byte & 0xF]);
    }
  }
  return value;
}

// Sent by the server in the initial metadata of its answers: the name of the
// replica that served the call (--replica_name; hostname:port by default).
inline constexpr char kReplicaHeader[] = "attention-replica";

}  // namespace attention

#endif  // ATTENTION_COMMON_METADATA_H_
