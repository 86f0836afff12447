#include "tests/server/golden_request.h"

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "client/tensors.h"
#include "tests/server/test_server.h"

namespace attention::testing {

namespace {

v1::Tensor::DType WireDType(const std::string& golden_dtype) {
  if (golden_dtype == "bool") return v1::Tensor::BOOL;
  if (golden_dtype == "i64") return v1::Tensor::INT64;
  return v1::Tensor::FLOAT32;
}

v1::Tensor ToWire(const GoldenTensor& g) { return RawTensor(WireDType(g.dtype), g.shape, g.bytes); }

}  // namespace

v1::AttendRequest ToRequest(const GoldenCase& c) {
  v1::AttendRequest r;
  r.set_id(c.name);
  *r.mutable_query() = ToWire(c.query);
  if (c.key.present) *r.mutable_key() = ToWire(c.key);
  if (c.value.present) *r.mutable_value() = ToWire(c.value);
  if (c.num_heads) r.set_num_heads(static_cast<int32_t>(*c.num_heads));

  v1::Score* score = r.mutable_score();
  v1::Score::Kind kind = v1::Score::SCALED_DOT;
  EXPECT_TRUE(v1::Score::Kind_Parse(absl::AsciiStrToUpper(c.score), &kind)) << c.score;
  score->set_kind(kind);
  if (c.scale) score->set_scale(*c.scale);
  if (c.bandwidth) score->set_bandwidth(*c.bandwidth);
  if (c.w_q.present) *score->mutable_w_q() = ToWire(c.w_q);
  if (c.w_k.present) *score->mutable_w_k() = ToWire(c.w_k);
  if (c.w_v.present) *score->mutable_w_v() = ToWire(c.w_v);
  if (c.w.present) *score->mutable_w() = ToWire(c.w);

  v1::Mask* mask = r.mutable_mask();
  if (c.valid_lens.present) *mask->mutable_valid_lens() = ToWire(c.valid_lens);
  if (c.key_padding_mask.present) *mask->mutable_key_padding_mask() = ToWire(c.key_padding_mask);
  if (c.attn_mask.present) *mask->mutable_attn_mask() = ToWire(c.attn_mask);
  v1::Mask::Causal causal = v1::Mask::NONE;
  EXPECT_TRUE(v1::Mask::Causal_Parse(absl::AsciiStrToUpper(c.causal), &causal)) << c.causal;
  mask->set_causal(causal);

  r.set_need_weights(c.need_weights);
  r.set_average_weights(c.average_weights);
  return r;
}

::testing::AssertionResult WireClose(const v1::Tensor& got, const GoldenTensor& want, double atol,
                                     double rtol) {
  absl::StatusOr<std::vector<float>> values = client::ReadFloats(got);
  if (!values.ok()) return ::testing::AssertionFailure() << values.status();
  return AllClose({got.shape().begin(), got.shape().end()}, *values, want, atol, rtol);
}

}  // namespace attention::testing
