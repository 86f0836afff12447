#ifndef ATTENTION_CLIENT_LOADTEST_WIRE_H_
#define ATTENTION_CLIENT_LOADTEST_WIRE_H_

// The load tester's shortcuts through the wire format: requests are
// serialized once and only their id changes; answers are read for their
// timings and status without their tensors being parsed or copied.

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace attention::loadtest {

// The fields of an AttendResponse a load test reports.
struct AnswerFields {
  std::string id;
  int code = 0;         // status.code (set on stream answers)
  std::string message;  // status.message
  int64_t queue_us = 0;
  int64_t compute_us = 0;
  int64_t batch_size = 0;
};

// Reads them from the serialized AttendResponse in `buffer` (which it
// consumes), skipping over the tensors' bytes: at tens of thousands of answers
// a second a full parse would copy every output. False when the bytes are not
// a well-formed message.
bool ReadAnswerFields(grpc::ByteBuffer* buffer, AnswerFields* fields);
bool ReadAnswerFields(absl::string_view bytes, AnswerFields* fields);

// A serialized AttendRequest with id `id` (its decimal digits): the id field,
// then `body`, a serialized AttendRequest without an id, which is shared, not
// copied. Parsing reads the fields in order, so the id is the message's.
grpc::ByteBuffer MessageWithId(uint64_t id, const grpc::Slice& body);

}  // namespace attention::loadtest

#endif  // ATTENTION_CLIENT_LOADTEST_WIRE_H_
