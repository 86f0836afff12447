#include "client/loadtest/wire.h"

#include <charconv>
#include <cstdint>
#include <string>

#include "google/protobuf/io/coded_stream.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/slice.h"

namespace attention::loadtest {
namespace {

using google::protobuf::io::CodedInputStream;

constexpr uint32_t Tag(int field, int wire_type) {
  return static_cast<uint32_t>(field << 3 | wire_type);
}

bool SkipField(CodedInputStream& in, uint32_t tag) {
  uint64_t varint;
  uint32_t length;
  switch (tag & 7) {
    case 0:
      return in.ReadVarint64(&varint);
    case 1:
      return in.Skip(8);
    case 2:
      return in.ReadVarint32(&length) && in.Skip(static_cast<int>(length));
    case 5:
      return in.Skip(4);
    default:  // groups: not in this proto
      return false;
  }
}

bool ReadBytes(CodedInputStream& in, std::string* out) {
  uint32_t length;
  return in.ReadVarint32(&length) && in.ReadString(out, static_cast<int>(length));
}

bool ReadInt(CodedInputStream& in, int64_t* out) {
  uint64_t value;
  if (!in.ReadVarint64(&value)) return false;
  *out = static_cast<int64_t>(value);
  return true;
}

// attention.v1.Status: code and message.
bool ReadStatus(CodedInputStream& in, AnswerFields* fields) {
  uint32_t length;
  if (!in.ReadVarint32(&length)) return false;
  const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(length));
  while (const uint32_t tag = in.ReadTag()) {
    int64_t code = 0;
    bool ok;
    if (tag == Tag(1, 0)) {
      ok = ReadInt(in, &code);
      fields->code = static_cast<int>(code);
    } else if (tag == Tag(2, 2)) {
      ok = ReadBytes(in, &fields->message);
    } else {
      ok = SkipField(in, tag);
    }
    if (!ok) return false;
  }
  const bool whole = in.ConsumedEntireMessage();
  in.PopLimit(limit);
  return whole;
}

bool ReadFields(CodedInputStream& in, AnswerFields* fields) {
  while (const uint32_t tag = in.ReadTag()) {
    bool ok;
    switch (tag) {
      case Tag(1, 2):
        ok = ReadBytes(in, &fields->id);
        break;
      case Tag(4, 2):
        ok = ReadStatus(in, fields);
        break;
      case Tag(5, 0):
        ok = ReadInt(in, &fields->queue_us);
        break;
      case Tag(6, 0):
        ok = ReadInt(in, &fields->compute_us);
        break;
      case Tag(7, 0):
        ok = ReadInt(in, &fields->batch_size);
        break;
      default:
        ok = SkipField(in, tag);
    }
    if (!ok) return false;
  }
  return in.ConsumedEntireMessage();
}

}  // namespace

bool ReadAnswerFields(grpc::ByteBuffer* buffer, AnswerFields* fields) {
  grpc::ProtoBufferReader reader(buffer);
  CodedInputStream in(&reader);
  return ReadFields(in, fields);
}

bool ReadAnswerFields(absl::string_view bytes, AnswerFields* fields) {
  CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                      static_cast<int>(bytes.size()));
  return ReadFields(in, fields);
}

grpc::ByteBuffer MessageWithId(uint64_t id, const grpc::Slice& body) {
  // Tag, length (at most 20 digits: one byte), digits.
  char prefix[2 + 20];
  const std::to_chars_result digits = std::to_chars(prefix + 2, prefix + sizeof prefix, id);
  prefix[0] = static_cast<char>(Tag(1, 2));
  prefix[1] = static_cast<char>(digits.ptr - (prefix + 2));
  const grpc::Slice slices[2] = {grpc::Slice(prefix, static_cast<size_t>(digits.ptr - prefix)),
                                 body};
  return grpc::ByteBuffer(slices, 2);
}

}  // namespace attention::loadtest
