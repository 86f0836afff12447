#include "server/response_encoder.h"

#include <malloc.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/enum_name.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "google/protobuf/io/zero_copy_stream.h"
#include "grpcpp/support/slice.h"

namespace attention::server {
namespace {

// Field numbers and wire types of attention.v1 (attention.proto, tensor.proto).
constexpr uint32_t kResponseOutput = 2;
constexpr uint32_t kResponseWeights = 3;
constexpr uint32_t kTensorData = 3;
constexpr uint32_t kLengthDelimited = 2;

void AppendVarint(uint64_t value, std::string& out) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

size_t VarintSize(uint64_t value) {
  size_t size = 1;
  while (value >= 0x80) {
    value >>= 7;
    ++size;
  }
  return size;
}

void AppendTag(uint32_t field, std::string& out) {
  AppendVarint((field << 3) | kLengthDelimited, out);
}

// A heap-owned buffer that a slice frees when gRPC is done with it.
template <typename Buffer>
grpc::Slice OwningSlice(Buffer buffer) {
  auto* owned = new Buffer(std::move(buffer));
  return grpc::Slice(
      owned->data(), owned->size() * sizeof(typename Buffer::value_type),
      +[](void* p) { delete static_cast<Buffer*>(p); }, owned);
}

using HalfBuffer = std::vector<uint16_t, DefaultInitAllocator<uint16_t>>;

// `t`'s elements as `dtype`, in a slice of their own.
absl::StatusOr<grpc::Slice> DataSlice(Tensor& t, v1::Tensor::DType dtype) {
  switch (dtype) {
    case v1::Tensor::FLOAT32:
      return OwningSlice(std::move(t.data));
    case v1::Tensor::BFLOAT16:
    case v1::Tensor::FLOAT16: {
      uint16_t (*const convert)(float) =
          dtype == v1::Tensor::BFLOAT16 ? &FloatToBFloat16 : &FloatToFloat16;
      HalfBuffer half(t.data.size());
      for (size_t i = 0; i < t.data.size(); ++i) half[i] = convert(t.data[i]);
      return OwningSlice(std::move(half));
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("output_dtype: must be FLOAT32, BFLOAT16 or FLOAT16, not ",
                       EnumName(dtype)));
  }
}

// Appends response field `field`, a Tensor of `t` as `dtype`: its dtype and
// shape into `header`, which is then complete, and its data as the next slice.
absl::Status AppendTensor(uint32_t field, Tensor& t, v1::Tensor::DType dtype, std::string& header,
                          std::vector<grpc::Slice>& slices) {
  absl::StatusOr<grpc::Slice> data = DataSlice(t, dtype);
  if (!data.ok()) return data.status();
  v1::Tensor head;
  head.set_dtype(dtype);
  head.mutable_shape()->Assign(t.shape.begin(), t.shape.end());
  const std::string fields = head.SerializeAsString();
  const size_t data_bytes = data->size();
  const size_t tensor_bytes = fields.size() + VarintSize((kTensorData << 3) | kLengthDelimited) +
                              VarintSize(data_bytes) + data_bytes;
  AppendTag(field, header);
  AppendVarint(tensor_bytes, header);
  header += fields;
  AppendTag(kTensorData, header);
  AppendVarint(data_bytes, header);
  slices.emplace_back(header);
  header.clear();
  slices.push_back(*std::move(data));
  return absl::OkStatus();
}

absl::StatusOr<grpc::ByteBuffer> Encode(const v1::AttendResponse& head, AttentionResult result,
                                        bool need_weights, v1::Tensor::DType dtype) {
  // Fields may come in any order on the wire: `head`'s first, then each
  // tensor's header followed by its data.
  std::string header = head.SerializeAsString();
  std::vector<grpc::Slice> slices;
  slices.reserve(4);
  if (absl::Status s = AppendTensor(kResponseOutput, result.output, dtype, header, slices);
      !s.ok()) {
    return s;
  }
  if (need_weights) {
    if (absl::Status s = AppendTensor(kResponseWeights, result.weights, dtype, header, slices);
        !s.ok()) {
      return s;
    }
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

absl::Status InvalidMessage(const google::protobuf::MessageLite& message) {
  return absl::InvalidArgumentError(
      absl::StrCat("the request is not a valid ", message.GetTypeName(), " message"));
}

std::atomic<int64_t> parse_trims{0};

// The slices of a message, in order, each freed once the parser has moved on
// to the next (protobuf keeps no pointer into a buffer it has left: it copies
// what it still needs of one before asking for the next). gRPC's slices are
// small blocks of malloc's heap, which glibc keeps when freed, while each
// parsed tensor is one new allocation that cannot reuse them: without giving
// them back as it goes, a large request would still cost its size twice in
// RSS. So in a request of kTrimFrom bytes or more, every kTrimEvery bytes
// freed, malloc_trim returns the free pages; smaller ones, whose trims cost
// more than they give back, are not trimmed (docs/serving.md, "malloc").
class ReleasingSliceStream final : public google::protobuf::io::ZeroCopyInputStream {
 public:
  explicit ReleasingSliceStream(std::vector<grpc::Slice> slices) : slices_(std::move(slices)) {
    size_t total = 0;
    for (const grpc::Slice& slice : slices_) total += slice.size();
    trim_ = total >= kTrimFrom;
  }

  bool Next(const void** data, int* size) override {
    if (backed_up_ > 0) {  // what BackUp returned of the current slice
      const grpc::Slice& slice = slices_[current_];
      *data = slice.begin() + (slice.size() - backed_up_);
      *size = backed_up_;
      bytes_ += backed_up_;
      backed_up_ = 0;
      return true;
    }
    if (started_ && current_ < slices_.size()) {
      released_ += slices_[current_].size();
      slices_[current_++] = grpc::Slice();
      if (trim_ && released_ >= kTrimEvery) {
        malloc_trim(0);
        parse_trims.fetch_add(1, std::memory_order_relaxed);
        released_ = 0;
      }
    }
    started_ = true;
    while (current_ < slices_.size() && slices_[current_].size() == 0) ++current_;
    if (current_ >= slices_.size()) return false;
    *data = slices_[current_].begin();
    *size = static_cast<int>(slices_[current_].size());
    bytes_ += *size;
    return true;
  }

  void BackUp(int count) override {
    backed_up_ = count;
    bytes_ -= count;
  }

  bool Skip(int count) override {
    const void* data;
    int size;
    while (count > 0 && Next(&data, &size)) {
      if (size > count) {
        BackUp(size - count);
        return true;
      }
      count -= size;
    }
    return count == 0;
  }

  int64_t ByteCount() const override { return bytes_; }

 private:
  static constexpr size_t kTrimFrom = size_t{64} << 20;
  static constexpr size_t kTrimEvery = size_t{16} << 20;
  std::vector<grpc::Slice> slices_;
  bool trim_ = false;
  size_t released_ = 0;
  size_t current_ = 0;
  bool started_ = false;
  int backed_up_ = 0;
  int64_t bytes_ = 0;
};

}  // namespace

absl::StatusOr<grpc::ByteBuffer> EncodeResponse(const v1::AttendResponse& head,
                                                AttentionResult result, bool need_weights,
                                                v1::Tensor::DType dtype) {
  return OutOfMemoryAsStatus("answer encoding",
                             [&] { return Encode(head, std::move(result), need_weights, dtype); });
}

grpc::ByteBuffer SerializeMessage(const google::protobuf::MessageLite& message) {
  grpc::Slice slice(message.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

absl::Status ParseAndReleaseMessage(grpc::ByteBuffer* buffer,
                                    google::protobuf::MessageLite* message) {
  return OutOfMemoryAsStatus("request parsing", [&]() -> absl::Status {
    std::vector<grpc::Slice> slices;
    // A message that fails to parse keeps nothing of what did: a stream
    // answers it with an empty id, never with the part of an id before the
    // bad bytes (or an id that is itself not UTF-8, which no client decodes).
    if (!buffer->Dump(&slices).ok()) {
      message->Clear();
      return InvalidMessage(*message);
    }
    buffer->Clear();  // the slices now hold the only references
    ReleasingSliceStream stream(std::move(slices));
    if (!message->ParseFromZeroCopyStream(&stream)) {
      message->Clear();
      return InvalidMessage(*message);
    }
    return absl::OkStatus();
  });
}

int64_t ParseTrims() { return parse_trims.load(std::memory_order_relaxed); }

absl::Status ParseMessage(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* message) {
  grpc::ByteBuffer shared(buffer);  // shares the slices: `buffer` keeps them
  return ParseAndReleaseMessage(&shared, message);
}

}  // namespace attention::server
