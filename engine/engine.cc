#include "engine/engine.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/internal.h"
#include "engine/reference.h"
#include "engine/status_macros.h"

namespace attention {
namespace {

absl::Status CheckTensorLimit(const TensorView& v, const char* field, int64_t limit) {
  if (limit == 0 || !v.present()) return absl::OkStatus();
  ATTN_ASSIGN_OR_RETURN(int64_t n, internal::CheckedElementCount(v.shape, field));
  if (n <= limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(field, ": ", n,
                                                   " elements exceed the limit of ", limit,
                                                   " elements per tensor"));
}

absl::Status CheckLimits(const AttentionArgs& args, const AttentionShape& s,
                         const EngineOptions& o) {
  const std::pair<const TensorView*, const char*> tensors[] = {
      {&args.query, "query"},
      {&args.key, "key"},
      {&args.value, "value"},
      {&args.mask.attn_mask, "mask.attn_mask"},
      {&args.mask.key_padding_mask, "mask.key_padding_mask"},
      {&args.mask.valid_lens, "mask.valid_lens"},
      {&args.score.w_q, "score.w_q"},
      {&args.score.w_k, "score.w_k"},
      {&args.score.w_v, "score.w_v"},
      {&args.score.w, "score.w"}};
  for (const auto& [view, field] : tensors) {
    ATTN_RETURN_IF_ERROR(CheckTensorLimit(*view, field, o.max_tensor_elements));
  }
  int64_t scores = 1;
  bool overflow = false;
  for (int64_t d : {s.batch, s.heads, s.query_len, s.key_len}) {
    overflow |= __builtin_mul_overflow(scores, d, &scores);
  }
  // The output [B, H, L, Dv] is bounded too: Dv can exceed S.
  int64_t outputs = 1;
  for (int64_t d : {s.batch, s.heads, s.query_len, s.value_dim}) {
    overflow |= __builtin_mul_overflow(outputs, d, &outputs);
  }
  if (overflow || (o.max_score_elements != 0 && scores > o.max_score_elements)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "query, key: B*H*L*S = ", s.batch, "*", s.heads, "*", s.query_len, "*", s.key_len,
        overflow ? " overflows" : absl::StrCat(" = ", scores),
        " exceeds the limit of ", o.max_score_elements, " score elements per request"));
  }
  if (o.max_tensor_elements != 0 && outputs > o.max_tensor_elements) {
    return absl::ResourceExhaustedError(absl::StrCat("output: ", outputs,
                                                     " elements exceed the limit of ",
                                                     o.max_tensor_elements,
                                                     " elements per tensor"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options) {
  if (options.max_tensor_elements < 0 || options.max_score_elements < 0) {
    return absl::InvalidArgumentError("engine limits must be >= 0 (0 means no limit)");
  }
  return std::unique_ptr<Engine>(new Engine(options));
}

Engine::~Engine() = default;

std::string Engine::backend_name() const { return "reference"; }

absl::StatusOr<AttentionResult> Engine::Attend(const AttentionArgs& args) const {
  ATTN_ASSIGN_OR_RETURN(AttentionShape shape, ResolveShape(args));
  ATTN_RETURN_IF_ERROR(CheckLimits(args, shape, options_));
  return internal::ReferenceAttend(args, shape);
}

}  // namespace attention
