#include "server/convert.h"

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

namespace attention::server {
namespace {

// Longest status message sent. gRPC carries it percent-encoded in a header,
// and peers reject headers over 8 KiB with an unrelated RESOURCE_EXHAUSTED.
constexpr size_t kMaxStatusMessage = 1024;

// `data` and `float_data` are handed to the engine as they arrived.
static_assert(std::endian::native == std::endian::little);

// The engine's enums number their values as the wire does.
static_assert(static_cast<int>(DType::kFloat32) == v1::Tensor::FLOAT32);
static_assert(static_cast<int>(DType::kBFloat16) == v1::Tensor::BFLOAT16);
static_assert(static_cast<int>(DType::kFloat16) == v1::Tensor::FLOAT16);
static_assert(static_cast<int>(DType::kBool) == v1::Tensor::BOOL);
static_assert(static_cast<int>(DType::kInt32) == v1::Tensor::INT32);
static_assert(static_cast<int>(DType::kInt64) == v1::Tensor::INT64);
static_assert(static_cast<int>(ScoreKind::kScaledDot) == v1::Score::SCALED_DOT);
static_assert(static_cast<int>(ScoreKind::kDot) == v1::Score::DOT);
static_assert(static_cast<int>(ScoreKind::kAdditive) == v1::Score::ADDITIVE);
static_assert(static_cast<int>(ScoreKind::kBilinear) == v1::Score::BILINEAR);
static_assert(static_cast<int>(ScoreKind::kCosine) == v1::Score::COSINE);
static_assert(static_cast<int>(ScoreKind::kNegEuclidean) == v1::Score::NEG_EUCLIDEAN);
static_assert(static_cast<int>(ScoreKind::kGaussian) == v1::Score::GAUSSIAN);
static_assert(static_cast<int>(Causal::kNone) == v1::Mask::NONE);
static_assert(static_cast<int>(Causal::kTopLeft) == v1::Mask::TOP_LEFT);
static_assert(static_cast<int>(Causal::kBottomRight) == v1::Mask::BOTTOM_RIGHT);
static_assert(static_cast<int>(Layout::kBatchFirst) == v1::AttendRequest::BATCH_FIRST);
static_assert(static_cast<int>(Layout::kSequenceFirst) == v1::AttendRequest::SEQUENCE_FIRST);

// The engine enum for a wire enum value, or INVALID_ARGUMENT naming
// `field``subfield`.
template <typename EngineEnum>
absl::StatusOr<EngineEnum> ToEngineEnum(int value, bool (*is_valid)(int), absl::string_view field,
                                        absl::string_view subfield = "") {
  if (!is_valid(value)) {
    return absl::InvalidArgumentError(absl::StrCat(field, subfield, ": unknown value ", value));
  }
  return static_cast<EngineEnum>(value);
}

// `values` as little-endian T in `bytes`; each must lie in [lo, hi].
template <typename T>
absl::Status PackInts(const google::protobuf::RepeatedField<int64_t>& values, int64_t lo,
                      int64_t hi, absl::string_view field, DType dtype, std::string& bytes) {
  bytes.resize(static_cast<size_t>(values.size()) * sizeof(T));
  for (int i = 0; i < values.size(); ++i) {
    const int64_t v = values[i];
    if (v < lo || v > hi) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".int_data[", i, "]: ", v, " is not a ", DTypeName(dtype), " value"));
    }
    const T narrow = static_cast<T>(v);
    std::memcpy(bytes.data() + static_cast<size_t>(i) * sizeof(T), &narrow, sizeof(T));
  }
  return absl::OkStatus();
}

absl::Status PackIntData(const v1::Tensor& t, DType dtype, absl::string_view field,
                         std::string& bytes) {
  switch (dtype) {
    case DType::kInt64:
      return PackInts<int64_t>(t.int_data(), std::numeric_limits<int64_t>::min(),
                               std::numeric_limits<int64_t>::max(), field, dtype, bytes);
    case DType::kInt32:
      return PackInts<int32_t>(t.int_data(), std::numeric_limits<int32_t>::min(),
                               std::numeric_limits<int32_t>::max(), field, dtype, bytes);
    case DType::kBool:
      return PackInts<uint8_t>(t.int_data(), 0, 1, field, dtype, bytes);
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": int_data needs dtype INT64, INT32 or BOOL, not ", DTypeName(dtype)));
  }
}

// A view of `t` (named `field` on the wire), or an absent view when `t` has no
// shape and no elements. int_data is materialised into `storage`.
absl::StatusOr<TensorView> ToView(const v1::Tensor& t, absl::string_view field,
                                  std::deque<std::string>& storage) {
  const bool has_data = !t.data().empty();
  const bool has_float_data = t.float_data_size() > 0;
  const bool has_int_data = t.int_data_size() > 0;
  if (t.shape_size() == 0 && !has_data && !has_float_data && !has_int_data) return TensorView{};
  if (has_data + has_float_data + has_int_data > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": set only one of data, float_data and int_data"));
  }
  TensorView view;
  ATTN_ASSIGN_OR_RETURN(view.dtype,
                        ToEngineEnum<DType>(t.dtype(), v1::Tensor::DType_IsValid, field, ".dtype"));
  view.shape.assign(t.shape().begin(), t.shape().end());
  if (has_float_data) {
    if (view.dtype != DType::kFloat32) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": float_data needs dtype FLOAT32, not ", DTypeName(view.dtype)));
    }
    view.data = t.float_data().data();
    view.size_bytes = static_cast<size_t>(t.float_data_size()) * sizeof(float);
  } else if (has_int_data) {
    std::string& bytes = storage.emplace_back();
    ATTN_RETURN_IF_ERROR(PackIntData(t, view.dtype, field, bytes));
    view.data = bytes.data();
    view.size_bytes = bytes.size();
  } else {
    view.data = t.data().data();
    view.size_bytes = t.data().size();
  }
  return view;
}

absl::Status CheckOutputDType(int value) {
  ATTN_ASSIGN_OR_RETURN(DType dtype,
                        ToEngineEnum<DType>(value, v1::Tensor::DType_IsValid, "output_dtype"));
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16 && dtype != DType::kFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat("output_dtype: must be FLOAT32, BFLOAT16 or FLOAT16, not ", DTypeName(dtype)));
  }
  return absl::OkStatus();
}

absl::Status CheckPrecision(int value) {
  if (!v1::AttendRequest::Precision_IsValid(value)) {
    return absl::InvalidArgumentError(absl::StrCat("precision: unknown value ", value));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<EngineRequest>> ToEngineRequest(const v1::AttendRequest& r) {
  ATTN_RETURN_IF_ERROR(CheckPrecision(r.precision()));
  ATTN_RETURN_IF_ERROR(CheckOutputDType(r.output_dtype()));

  auto req = std::make_unique<EngineRequest>();
  req->output_dtype = r.output_dtype();
  AttentionArgs& a = req->args;
  std::deque<std::string>& storage = req->storage;
  ATTN_ASSIGN_OR_RETURN(a.query, ToView(r.query(), "query", storage));
  ATTN_ASSIGN_OR_RETURN(a.key, ToView(r.key(), "key", storage));
  ATTN_ASSIGN_OR_RETURN(a.value, ToView(r.value(), "value", storage));
  ATTN_ASSIGN_OR_RETURN(
      a.layout, ToEngineEnum<Layout>(r.layout(), v1::AttendRequest::Layout_IsValid, "layout"));
  a.num_heads = r.num_heads();

  const v1::Score& score = r.score();
  ATTN_ASSIGN_OR_RETURN(
      a.score.kind, ToEngineEnum<ScoreKind>(score.kind(), v1::Score::Kind_IsValid, "score.kind"));
  if (score.has_scale()) a.score.scale = score.scale();
  if (score.has_bandwidth()) a.score.bandwidth = score.bandwidth();
  ATTN_ASSIGN_OR_RETURN(a.score.w_q, ToView(score.w_q(), "score.w_q", storage));
  ATTN_ASSIGN_OR_RETURN(a.score.w_k, ToView(score.w_k(), "score.w_k", storage));
  ATTN_ASSIGN_OR_RETURN(a.score.w_v, ToView(score.w_v(), "score.w_v", storage));
  ATTN_ASSIGN_OR_RETURN(a.score.w, ToView(score.w(), "score.w", storage));

  const v1::Mask& mask = r.mask();
  ATTN_ASSIGN_OR_RETURN(a.mask.valid_lens, ToView(mask.valid_lens(), "mask.valid_lens", storage));
  ATTN_ASSIGN_OR_RETURN(a.mask.key_padding_mask,
                        ToView(mask.key_padding_mask(), "mask.key_padding_mask", storage));
  ATTN_ASSIGN_OR_RETURN(a.mask.attn_mask, ToView(mask.attn_mask(), "mask.attn_mask", storage));
  ATTN_ASSIGN_OR_RETURN(
      a.mask.causal, ToEngineEnum<Causal>(mask.causal(), v1::Mask::Causal_IsValid, "mask.causal"));

  a.need_weights = r.need_weights();
  a.average_weights = r.average_weights();
  a.dropout_p = r.dropout_p();
  a.seed = r.seed();
  a.fast = r.precision() == v1::AttendRequest::FAST;
  return req;
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  std::string message(status.message().substr(0, kMaxStatusMessage));
  if (message.size() < status.message().size()) message += "...";
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::move(message));
}

}  // namespace attention::server
