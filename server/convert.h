#ifndef ATTENTION_SERVER_CONVERT_H_
#define ATTENTION_SERVER_CONVERT_H_

// The one place where wire messages become engine types and back, and where
// absl::Status becomes grpc::Status.

#include <cstdint>
#include <deque>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"
#include "attention/v1/tensor.pb.h"
#include "engine/attention.h"
#include "grpcpp/support/status.h"

namespace attention::server {

// An AttendRequest in engine terms. The views in `args` point into the wire
// request it was made from and into `storage`; both must outlive them.
// Where a request's time went, as AttendResponse reports it.
struct JobTimingFields {
  int64_t queue_us = 0;
  int64_t compute_us = 0;
  int32_t batch_size = 0;
  // Which of the two the call went through, for the latency metrics: a call
  // refused before the queue (a session's checks, its memory, a full queue)
  // has neither, one dropped in the queue (cancelled, past its deadline) no
  // compute.
  bool queued = false;
  bool computed = false;
};

struct EngineRequest {
  EngineRequest() = default;
  EngineRequest(const EngineRequest&) = delete;
  EngineRequest& operator=(const EngineRequest&) = delete;

  AttentionArgs args;
  v1::Tensor::DType output_dtype = v1::Tensor::FLOAT32;
  // Bytes of tensors sent as `int_data`; deque elements never move.
  std::deque<std::string> storage;
};

// Converts `r` without copying `data` or `float_data`; `r` must outlive the
// result. A tensor with no shape and no elements is absent. INVALID_ARGUMENT
// names the field for unknown enum values, more than one of data / float_data
// / int_data, float_data or int_data with a dtype they cannot carry, int_data
// out of its dtype's range, and a non-float output_dtype. `model` is left to
// the caller; shapes and byte counts are the engine's to check.
absl::StatusOr<std::unique_ptr<EngineRequest>> ToEngineRequest(const v1::AttendRequest& r);

// Same code (absl and gRPC share the numbers) and message, the message clipped
// to 1 KiB (it still starts with the field it names).
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_CONVERT_H_
