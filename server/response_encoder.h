#ifndef ATTENTION_SERVER_RESPONSE_ENCODER_H_
#define ATTENTION_SERVER_RESPONSE_ENCODER_H_

// AttendResponse straight onto the wire, without copying its tensors: the
// engine's output buffers become slices of the gRPC message, so the tensor
// bytes are written once, by the engine, and read once, by the transport.

#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"
#include "engine/attention.h"
#include "grpcpp/support/byte_buffer.h"

namespace attention::server {

// The serialized AttendResponse made of `head` (every field but output and
// weights, which it must not have) and `result`: its output and, with
// `need_weights`, its weights, as `dtype` (FLOAT32, BFLOAT16 or FLOAT16).
// FLOAT32 tensors are not copied: `result`'s buffers are moved into the
// returned message's slices and freed with it. 16-bit tensors are converted
// straight into their slice. INVALID_ARGUMENT for any other dtype.
absl::StatusOr<grpc::ByteBuffer> EncodeResponse(const v1::AttendResponse& head,
                                                AttentionResult result, bool need_weights,
                                                v1::Tensor::DType dtype);

// `message` serialized into a ByteBuffer (for answers without tensors).
grpc::ByteBuffer SerializeMessage(const google::protobuf::MessageLite& message);

// Parses `buffer` into `message`, emptying `buffer` as it goes: each of its
// slices is freed once parsed, so a large request is not held whole twice (as
// received and as parsed) at any moment. INVALID_ARGUMENT when it is not one;
// RESOURCE_EXHAUSTED when memory runs out.
absl::Status ParseAndReleaseMessage(grpc::ByteBuffer* buffer,
                                    google::protobuf::MessageLite* message);

// How many times parsing has trimmed the heap (malloc_trim) in this
// process: only requests of 64 MiB or more do, every 16 MiB they free.
int64_t ParseTrims();

// The same parser for a buffer the caller keeps (its slices are shared, so
// nothing is freed): the server's own path, for tests and fuzz targets.
absl::Status ParseMessage(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* message);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_RESPONSE_ENCODER_H_
