#ifndef ATTENTION_CLIENT_LOADTEST_WORKLOAD_H_
#define ATTENTION_CLIENT_LOADTEST_WORKLOAD_H_

// The request a load test sends, and the checks --verify makes on answers.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attention/v1/attention.pb.h"
#include "attention/v1/model.pb.h"

namespace google::protobuf {
class Message;
}

namespace attention::loadtest {

enum class MaskKind {
  kNone,
  kCausal,             // mask.causal TOP_LEFT
  kCausalBottomRight,  // mask.causal BOTTOM_RIGHT
  kValidLens,          // mask.valid_lens INT64 [B], each in [1, S]
  kKeyPadding,         // mask.key_padding_mask BOOL [B, S], a padded tail per row
  kAttnMask,           // mask.attn_mask BOOL [L, S], about 1 in 10 masked
};

// "none", "causal", "causal_bottom_right", "valid_lens", "key_padding",
// "attn_mask"; INVALID_ARGUMENT otherwise.
absl::StatusOr<MaskKind> ParseMaskKind(absl::string_view name);
// "float32", "bfloat16", "float16"; INVALID_ARGUMENT otherwise.
absl::StatusOr<v1::Tensor::DType> ParseFloatDType(absl::string_view name);

// The server's default --max_tensor_elements: the most elements a built
// tensor may have, and so the most any one dim may be (a larger tensor would
// only be refused).
inline constexpr int64_t kMaxTensorElements = int64_t{1} << 28;

struct ShapeOptions {
  // A registered model's name, or "" for raw attention.
  std::string model;
  int64_t batch = 1;       // B
  int64_t query_len = 16;  // L
  int64_t key_len = 0;     // S; 0 means L
  // E; 0 means the model's embed_dim, or 64 for raw attention.
  int64_t embed_dim = 0;
  int64_t heads = 1;  // raw attention: num_heads
  // Raw attention: 0 sends rank 3, [B, L, E] split into `heads`; above 0,
  // rank 4: query [B, heads, L, E / heads], key and value [B, kv_heads, S,
  // E / heads] (grouped-query when fewer than heads, which it must divide).
  int64_t kv_heads = 0;
  MaskKind mask = MaskKind::kNone;
  // Inputs and outputs.
  v1::Tensor::DType dtype = v1::Tensor::FLOAT32;
  bool need_weights = false;
  // Seeds the inputs and the masks: the same options give the same bytes.
  uint64_t seed = 1;
};

// A request with random inputs in [-1, 1): query [B, L, E], key [B, S, Ek] and
// value [B, S, Ev]. With options.model, `model` is its config (from GetModel)
// and Ek and Ev are its kdim and vdim; without, `model` is ignored, Ek = Ev = E
// and num_heads = heads, or with kv_heads the rank-4 tensors above.
// INVALID_ARGUMENT for a non-positive size, heads not dividing E, kv_heads not
// dividing heads or given with a model, an embed_dim other than the model's, or
// more than 2^28 elements in a tensor.
absl::StatusOr<v1::AttendRequest> BuildRequest(const ShapeOptions& options,
                                               const v1::ModelConfig* model);

// The message in protobuf's JSON mapping in the file at `path` (as
// attention_cli reads it). INVALID_ARGUMENT naming the file when it cannot be
// read or parsed.
absl::Status ReadJsonFile(const std::string& path, google::protobuf::Message* message);

// The shapes an answer to `request` must have. `model` is the config of
// request.model() (nullptr for raw attention). INVALID_ARGUMENT when the
// request's shapes are not ones the service accepts.
struct AnswerShapes {
  std::vector<int64_t> output;
  std::optional<std::vector<int64_t>> weights;  // set when need_weights
};
absl::StatusOr<AnswerShapes> ExpectedShapes(const v1::AttendRequest& request,
                                            const v1::ModelConfig* model);

// Checks answers for --verify: the output (and weights when asked for) have
// the expected shapes and byte counts and hold only finite numbers, and with
// an expected response, match its values within atol + rtol * |expected|.
// Thread-safe (Check is const).
class Verifier {
 public:
  // INVALID_ARGUMENT when the expected response's tensors do not have
  // `shapes` or cannot be read.
  static absl::StatusOr<Verifier> Create(AnswerShapes shapes,
                                         std::optional<v1::AttendResponse> expected, double atol,
                                         double rtol);

  // OK, or FAILED_PRECONDITION saying the first thing wrong with `answer`.
  absl::Status Check(const v1::AttendResponse& answer) const;

 private:
  Verifier(AnswerShapes shapes, std::optional<std::vector<float>> output,
           std::optional<std::vector<float>> weights, double atol, double rtol);

  AnswerShapes shapes_;
  // The expected response's values, when one was given (weights: and has them).
  std::optional<std::vector<float>> output_;
  std::optional<std::vector<float>> weights_;
  double atol_;
  double rtol_;
};

}  // namespace attention::loadtest

#endif  // ATTENTION_CLIENT_LOADTEST_WORKLOAD_H_
