#include "client/loadtest/workload.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "client/tensors.h"
#include "common/shape_string.h"
#include "common/status_macros.h"
#include "google/protobuf/message.h"
#include "google/protobuf/util/json_util.h"

namespace attention::loadtest {
namespace {

// Uniform in [-1, 1) from the top 24 bits of one draw: the same numbers on
// every platform, which std::uniform_real_distribution does not promise.
float UniformFloat(std::mt19937_64& rng) {
  return static_cast<float>(rng() >> 40) * 0x1p-23f - 1.0f;
}

// `name`: "query", "key" or "value", for the error.
absl::StatusOr<v1::Tensor> RandomTensor(absl::string_view name, const std::vector<int64_t>& shape,
                                        v1::Tensor::DType dtype, std::mt19937_64& rng) {
  // In double: the dims' product may overflow int64_t before it is refused.
  double elements = 1;
  for (int64_t dim : shape) elements *= static_cast<double>(dim);
  if (elements > static_cast<double>(kMaxTensorElements)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " ", ShapeString(shape), " has more than ", kMaxTensorElements,
                     " elements (the server's --max_tensor_elements)"));
  }
  std::vector<float> values(static_cast<size_t>(elements));
  for (float& value : values) value = UniformFloat(rng);
  return client::MakeFloatTensor(shape, values, dtype);
}

absl::Status AddMask(MaskKind kind, int64_t batch, int64_t query_len, int64_t key_len,
                     std::mt19937_64& rng, v1::Mask* mask) {
  // A length in [1, key_len]: every row keeps at least one key.
  auto random_length = [&] { return static_cast<int64_t>(rng() % key_len) + 1; };
  switch (kind) {
    case MaskKind::kNone:
      return absl::OkStatus();
    case MaskKind::kCausal:
      mask->set_causal(v1::Mask::TOP_LEFT);
      return absl::OkStatus();
    case MaskKind::kCausalBottomRight:
      mask->set_causal(v1::Mask::BOTTOM_RIGHT);
      return absl::OkStatus();
    case MaskKind::kValidLens: {
      std::vector<int64_t> lens(batch);
      for (int64_t& len : lens) len = random_length();
      ATTN_ASSIGN_OR_RETURN(*mask->mutable_valid_lens(), client::MakeInt64Tensor({batch}, lens));
      return absl::OkStatus();
    }
    case MaskKind::kKeyPadding: {
      std::vector<bool> padded(batch * key_len);
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t len = random_length();
        for (int64_t s = len; s < key_len; ++s) padded[b * key_len + s] = true;
      }
      ATTN_ASSIGN_OR_RETURN(*mask->mutable_key_padding_mask(),
                            client::MakeBoolTensor({batch, key_len}, padded));
      return absl::OkStatus();
    }
    case MaskKind::kAttnMask: {
      std::vector<bool> masked(query_len * key_len);
      for (size_t i = 0; i < masked.size(); ++i) masked[i] = rng() % 10 == 0;
      ATTN_ASSIGN_OR_RETURN(*mask->mutable_attn_mask(),
                            client::MakeBoolTensor({query_len, key_len}, masked));
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError("unknown mask kind");
}

// `flag`: the command line's name for the dim.
absl::Status CheckDim(absl::string_view flag, int64_t value) {
  if (value < 1 || value > kMaxTensorElements) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " is ", value, "; want 1 to ", kMaxTensorElements));
  }
  return absl::OkStatus();
}

// The dims of one answer tensor against what it should be, then its values.
absl::Status CheckTensor(absl::string_view name, bool present, const v1::Tensor& tensor,
                         const std::vector<int64_t>& shape,
                         const std::optional<std::vector<float>>& expected, double atol,
                         double rtol) {
  if (!present) return absl::FailedPreconditionError(absl::StrCat("the answer has no ", name));
  const std::vector<int64_t> got(tensor.shape().begin(), tensor.shape().end());
  if (got != shape) {
    return absl::FailedPreconditionError(
        absl::StrCat(name, ": shape ", ShapeString(got), ", want ", ShapeString(shape)));
  }
  absl::StatusOr<std::vector<float>> values = client::ReadFloats(tensor);
  if (!values.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(name, ": ", values.status().message()));
  }
  for (size_t i = 0; i < values->size(); ++i) {
    const float value = (*values)[i];
    if (!std::isfinite(value)) {
      return absl::FailedPreconditionError(absl::StrCat(name, ": element ", i, " is ", value));
    }
    if (expected.has_value()) {
      const double want = (*expected)[i];
      if (std::abs(value - want) > atol + rtol * std::abs(want)) {
        return absl::FailedPreconditionError(absl::StrCat(name, ": element ", i, " is ", value,
                                                          ", expected ", want, " (atol ", atol,
                                                          ", rtol ", rtol, ")"));
      }
    }
  }
  return absl::OkStatus();
}

// The values of an expected response's tensor, which must have `shape`.
absl::StatusOr<std::vector<float>> ExpectedValues(absl::string_view name, const v1::Tensor& tensor,
                                                  const std::vector<int64_t>& shape) {
  const std::vector<int64_t> got(tensor.shape().begin(), tensor.shape().end());
  if (got != shape) {
    return absl::InvalidArgumentError(absl::StrCat("expected response: ", name, " has shape ",
                                                   ShapeString(got), "; the request's answer has ",
                                                   ShapeString(shape)));
  }
  absl::StatusOr<std::vector<float>> values = client::ReadFloats(tensor);
  if (!values.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected response: ", name, ": ", values.status().message()));
  }
  return values;
}

}  // namespace

absl::StatusOr<MaskKind> ParseMaskKind(absl::string_view name) {
  constexpr std::pair<absl::string_view, MaskKind> kNames[] = {
      {"none", MaskKind::kNone},
      {"causal", MaskKind::kCausal},
      {"causal_bottom_right", MaskKind::kCausalBottomRight},
      {"valid_lens", MaskKind::kValidLens},
      {"key_padding", MaskKind::kKeyPadding},
      {"attn_mask", MaskKind::kAttnMask},
  };
  for (const auto& [text, kind] : kNames) {
    if (name == text) return kind;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "mask \"", name,
      "\" is not none, causal, causal_bottom_right, valid_lens, key_padding or attn_mask"));
}

absl::StatusOr<v1::Tensor::DType> ParseFloatDType(absl::string_view name) {
  if (name == "float32") return v1::Tensor::FLOAT32;
  if (name == "bfloat16") return v1::Tensor::BFLOAT16;
  if (name == "float16") return v1::Tensor::FLOAT16;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype \"", name, "\" is not float32, bfloat16 or float16"));
}

absl::StatusOr<v1::AttendRequest> BuildRequest(const ShapeOptions& options,
                                               const v1::ModelConfig* model) {
  const int64_t key_len = options.key_len == 0 ? options.query_len : options.key_len;
  int64_t embed_dim = options.embed_dim;
  int64_t key_dim = 0;
  int64_t value_dim = 0;
  v1::AttendRequest request;
  request.set_id("loadtest");
  if (!options.model.empty()) {
    if (options.kv_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat("--kv_heads ", options.kv_heads,
                                                     " is for raw attention; model ", options.model,
                                                     " has its own heads"));
    }
    if (embed_dim != 0 && embed_dim != model->embed_dim()) {
      return absl::InvalidArgumentError(absl::StrCat("--embed_dim ", embed_dim, " is not model ",
                                                     options.model, "'s embed_dim ",
                                                     model->embed_dim()));
    }
    embed_dim = model->embed_dim();
    key_dim = model->kdim() == 0 ? embed_dim : model->kdim();
    value_dim = model->vdim() == 0 ? embed_dim : model->vdim();
    request.set_model(options.model);
  } else {
    if (embed_dim == 0) embed_dim = 64;
    ATTN_RETURN_IF_ERROR(CheckDim("--heads", options.heads));
    if (embed_dim % options.heads != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--heads ", options.heads, " does not divide --embed_dim ", embed_dim));
    }
    key_dim = value_dim = embed_dim;
    if (options.kv_heads == 0) {
      request.set_num_heads(static_cast<int32_t>(options.heads));
    } else {
      ATTN_RETURN_IF_ERROR(CheckDim("--kv_heads", options.kv_heads));
      if (options.heads % options.kv_heads != 0) {
        return absl::InvalidArgumentError(absl::StrCat("--kv_heads ", options.kv_heads,
                                                       " does not divide --heads ", options.heads));
      }
    }
  }
  ATTN_RETURN_IF_ERROR(CheckDim("--batch", options.batch));
  ATTN_RETURN_IF_ERROR(CheckDim("--seq_len", options.query_len));
  ATTN_RETURN_IF_ERROR(CheckDim("--kv_len", key_len));
  ATTN_RETURN_IF_ERROR(CheckDim("--embed_dim", embed_dim));

  std::mt19937_64 rng(options.seed);
  const int64_t batch = options.batch;
  std::vector<int64_t> query_shape = {batch, options.query_len, embed_dim};
  std::vector<int64_t> key_shape = {batch, key_len, key_dim};
  std::vector<int64_t> value_shape = {batch, key_len, value_dim};
  if (options.kv_heads != 0) {  // raw attention only (refused above with a model)
    const int64_t head_dim = embed_dim / options.heads;
    query_shape = {batch, options.heads, options.query_len, head_dim};
    key_shape = value_shape = {batch, options.kv_heads, key_len, head_dim};
  }
  ATTN_ASSIGN_OR_RETURN(*request.mutable_query(),
                        RandomTensor("query", query_shape, options.dtype, rng));
  ATTN_ASSIGN_OR_RETURN(*request.mutable_key(), RandomTensor("key", key_shape, options.dtype, rng));
  ATTN_ASSIGN_OR_RETURN(*request.mutable_value(),
                        RandomTensor("value", value_shape, options.dtype, rng));
  ATTN_RETURN_IF_ERROR(
      AddMask(options.mask, batch, options.query_len, key_len, rng, request.mutable_mask()));
  request.set_need_weights(options.need_weights);
  request.set_output_dtype(options.dtype);
  return request;
}

absl::Status ReadJsonFile(const std::string& path, google::protobuf::Message* message) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  if (in) text << in.rdbuf();
  if (!in || in.bad()) return absl::InvalidArgumentError(absl::StrCat("cannot read ", path));
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  const auto status = google::protobuf::util::JsonStringToMessage(text.str(), message, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not an ", message->GetTypeName(),
                                                   " in JSON: ", std::string(status.message())));
  }
  return absl::OkStatus();
}

absl::StatusOr<AnswerShapes> ExpectedShapes(const v1::AttendRequest& request,
                                            const v1::ModelConfig* model) {
  const v1::Tensor& query = request.query();
  const v1::Tensor& key = request.has_key() ? request.key() : query;
  const v1::Tensor& value = request.has_value() ? request.value() : key;
  const int rank = query.shape_size();
  if ((rank != 3 && rank != 4) || key.shape_size() != rank || value.shape_size() != rank) {
    return absl::InvalidArgumentError(absl::StrCat("query, key and value have ranks ", rank, ", ",
                                                   key.shape_size(), " and ", value.shape_size(),
                                                   "; want all 3 or all 4"));
  }
  const bool average = request.average_weights();
  AnswerShapes shapes;
  if (rank == 4) {
    const int64_t batch = std::max({query.shape(0), key.shape(0), value.shape(0)});
    const int64_t heads = query.shape(1);
    shapes.output = {batch, heads, query.shape(2), value.shape(3)};
    if (request.need_weights()) {
      shapes.weights = average ? std::vector<int64_t>{batch, query.shape(2), key.shape(2)}
                               : std::vector<int64_t>{batch, heads, query.shape(2), key.shape(2)};
    }
    return shapes;
  }
  const bool sequence_first = request.layout() == v1::AttendRequest::SEQUENCE_FIRST;
  const int batch_dim = sequence_first ? 1 : 0;
  const int length_dim = 1 - batch_dim;
  const int64_t batch =
      std::max({query.shape(batch_dim), key.shape(batch_dim), value.shape(batch_dim)});
  const int64_t query_len = query.shape(length_dim);
  int64_t key_len = key.shape(length_dim);
  int64_t heads = std::max(1, request.num_heads());
  int64_t output_dim = value.shape(2);
  if (!request.model().empty()) {
    heads = model->num_heads();
    output_dim = model->embed_dim();
    key_len += (model->add_bias_kv() ? 1 : 0) + (model->add_zero_attn() ? 1 : 0);
  }
  shapes.output = sequence_first ? std::vector<int64_t>{query_len, batch, output_dim}
                                 : std::vector<int64_t>{batch, query_len, output_dim};
  if (request.need_weights()) {
    shapes.weights = average ? std::vector<int64_t>{batch, query_len, key_len}
                             : std::vector<int64_t>{batch, heads, query_len, key_len};
  }
  return shapes;
}

absl::StatusOr<Verifier> Verifier::Create(AnswerShapes shapes,
                                          std::optional<v1::AttendResponse> expected, double atol,
                                          double rtol) {
  std::optional<std::vector<float>> output;
  std::optional<std::vector<float>> weights;
  if (expected.has_value()) {
    ATTN_ASSIGN_OR_RETURN(output, ExpectedValues("output", expected->output(), shapes.output));
    // Every value the answers carry is compared, or the run refuses to start:
    // weights on one side only would pass unchecked.
    if (shapes.weights.has_value() != expected->has_weights()) {
      return absl::InvalidArgumentError(
          shapes.weights.has_value()
              ? "expected response: has no weights, but the request asks for them "
                "(need_weights), so the answers' weights could not be compared"
              : "expected response: has weights, but the request does not ask for them "
                "(need_weights false), so the answers carry none to compare");
    }
    if (shapes.weights.has_value()) {
      ATTN_ASSIGN_OR_RETURN(weights,
                            ExpectedValues("weights", expected->weights(), *shapes.weights));
    }
  }
  return Verifier(std::move(shapes), std::move(output), std::move(weights), atol, rtol);
}

Verifier::Verifier(AnswerShapes shapes, std::optional<std::vector<float>> output,
                   std::optional<std::vector<float>> weights, double atol, double rtol)
    : shapes_(std::move(shapes)),
      output_(std::move(output)),
      weights_(std::move(weights)),
      atol_(atol),
      rtol_(rtol) {}

absl::Status Verifier::Check(const v1::AttendResponse& answer) const {
  ATTN_RETURN_IF_ERROR(CheckTensor("output", answer.has_output(), answer.output(), shapes_.output,
                                   output_, atol_, rtol_));
  if (!shapes_.weights.has_value()) return absl::OkStatus();
  return CheckTensor("weights", answer.has_weights(), answer.weights(), *shapes_.weights, weights_,
                     atol_, rtol_);
}

}  // namespace attention::loadtest
