// Hostile input, through a real server: every class of malformed request the
// wire can carry (table-driven: the code and the field named in the message),
// bytes that are not a request, messages over the size limit, non-finite
// numbers (refused in parameters, propagated in data: docs/errors.md), and a
// flood of abandoned streams. After each, the server must still be serving:
// health is SERVING and a good request succeeds.

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attention/v1/service.grpc.pb.h"
#include "client/tensors.h"
#include "gmock/gmock.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/client_callback.h"
#include "gtest/gtest.h"
#include "server/metrics.h"
#include "server/response_encoder.h"
#include "tests/server/test_server.h"
#include "tests/status_matchers.h"

namespace attention::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using Change = std::function<void(v1::AttendRequest&)>;

constexpr absl::StatusCode kExhausted = absl::StatusCode::kResourceExhausted;
constexpr int64_t kMaxTensorElements = 4096;
constexpr int64_t kMaxScoreElements = 65536;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// A call of the demo model (embed_dim 64): query [1, 3, 64], self-attention.
v1::AttendRequest ModelRequest() {
  v1::AttendRequest r;
  r.set_model("demo");
  *r.mutable_query() = Ramp({1, 3, 64});
  return r;
}

v1::Tensor Bools(const std::vector<int64_t>& shape, size_t n) {
  return RawTensor(v1::Tensor::BOOL, shape, std::string(n, '\0'));
}

v1::Tensor Int64s(const std::vector<int64_t>& shape, const std::vector<int64_t>& values) {
  return *client::MakeInt64Tensor(shape, values);
}

// Sizes whose products overflow int64 (2^40 cubed) or whose byte count does
// (2^30 * 2^30 * 4 elements of 4 bytes).
constexpr int64_t k2p40 = int64_t{1} << 40;
constexpr int64_t k2p30 = int64_t{1} << 30;
constexpr int64_t k2p16 = int64_t{1} << 16;
constexpr int64_t k2p62 = int64_t{1} << 62;

struct HostileCase {
  std::string name;
  Change change;  // applied to ValidRequest()
  absl::StatusCode code;
  std::string message;  // a substring: the field, and the numbers where they matter
};

std::ostream& operator<<(std::ostream& os, const HostileCase& c) { return os << c.name; }

std::vector<HostileCase> HostileCases() {
  using R = v1::AttendRequest&;
  return {
      // --- shape arithmetic that overflows int64 --------------------------------
      {"QueryElementCountOverflows",
       [](R r) {
         *r.mutable_query() =
             RawTensor(v1::Tensor::FLOAT32, {k2p40, k2p40, k2p40}, "0123456789abcdef");
       },
       kInvalid,
       "query: shape [1099511627776, 1099511627776, 1099511627776] has too many elements"},
      {"KeyByteCountOverflows",
       [](R r) {
         *r.mutable_key() = RawTensor(v1::Tensor::FLOAT32, {k2p30, k2p30, 4}, "0123");
       },
       kInvalid, "key: shape [1073741824, 1073741824, 4] has too many elements"},
      {"ValueElementCountOverflows",
       [](R r) {
         *r.mutable_value() = RawTensor(v1::Tensor::FLOAT32, {2, k2p62, 6}, "0123");
       },
       kInvalid, "value: shape [2, 4611686018427387904, 6] has too many elements"},
      {"AttnMaskElementCountOverflows",
       [](R r) {
         *r.mutable_mask()->mutable_attn_mask() = Bools({k2p16, k2p16, k2p16, k2p16}, 8);
       },
       kInvalid, "mask.attn_mask: shape [65536, 65536, 65536, 65536] has too many elements"},
      {"ValidLensElementCountOverflows",
       [](R r) {
         *r.mutable_mask()->mutable_valid_lens() =
             RawTensor(v1::Tensor::INT64, {k2p62, 4}, "01234567");
       },
       kInvalid, "mask.valid_lens: shape [4611686018427387904, 4] has too many elements"},
      {"BilinearWeightElementCountOverflows",
       [](R r) {
         r.mutable_score()->set_kind(v1::Score::BILINEAR);
         *r.mutable_score()->mutable_w() = RawTensor(v1::Tensor::FLOAT32, {k2p62, 4}, "0123");
       },
       kInvalid, "score.w: shape [4611686018427387904, 4] has too many elements"},
      {"HugeNumHeads", [](R r) { r.set_num_heads(std::numeric_limits<int32_t>::max()); }, kInvalid,
       "num_heads: 2147483647 does not divide query's last dim 4"},
      {"NegativeNumHeads", [](R r) { r.set_num_heads(-2); }, kInvalid, "num_heads: -2 is negative"},

      // --- zero and negative dims ----------------------------------------------
      {"QueryZeroDim",
       [](R r) {
         *r.mutable_query() = RawTensor(v1::Tensor::FLOAT32, {2, 0, 4}, "");
       },
       kInvalid, "query: shape [2, 0, 4] has dim 1 = 0; every dim must be >= 1"},
      {"KeyNegativeDim",
       [](R r) {
         *r.mutable_key() = RawTensor(v1::Tensor::FLOAT32, {2, -5, 4}, "");
       },
       kInvalid, "key: shape [2, -5, 4] has dim 1 = -5"},
      {"ValueZeroBatch",
       [](R r) {
         *r.mutable_value() = RawTensor(v1::Tensor::FLOAT32, {0, 5, 6}, "");
       },
       kInvalid, "value: shape [0, 5, 6] has dim 0 = 0"},
      {"KeyPaddingMaskZeroDim",
       [](R r) {
         *r.mutable_mask()->mutable_key_padding_mask() = Bools({2, 0}, 0);
       },
       kInvalid, "mask.key_padding_mask: shape [2, 0] has dim 1 = 0"},
      {"AttnMaskNegativeDim",
       [](R r) {
         *r.mutable_mask()->mutable_attn_mask() = Bools({-3, 5}, 15);
       },
       kInvalid, "mask.attn_mask: shape [-3, 5] has dim 0 = -3"},
      {"ValidLensNegativeDim",
       [](R r) {
         *r.mutable_mask()->mutable_valid_lens() = RawTensor(v1::Tensor::INT64, {-2}, "");
       },
       kInvalid, "mask.valid_lens: shape [-2] has dim 0 = -2"},
      {"AdditiveWeightZeroDim",
       [](R r) {
         v1::Score* s = r.mutable_score();
         s->set_kind(v1::Score::ADDITIVE);
         *s->mutable_w_q() = RawTensor(v1::Tensor::FLOAT32, {0, 4}, "");
         *s->mutable_w_k() = Ramp({3, 4});
         *s->mutable_w_v() = Ramp({3});
       },
       kInvalid, "score.w_q: shape [0, 4] has dim 0 = 0"},

      // --- dims beyond the server's limits: RESOURCE_EXHAUSTED with the numbers --
      {"QueryOverTheTensorLimit",
       [](R r) {
         *r.mutable_query() = Ramp({2, 1024, 4});
       },
       kExhausted, "query: 8192 elements exceed the limit of 4096 elements per tensor"},
      {"WeightsOverTheScoreLimit",
       [](R r) {
         *r.mutable_query() = Ramp({1, 300, 4});
         *r.mutable_key() = Ramp({1, 300, 4});
         *r.mutable_value() = Ramp({1, 300, 6});
         r.set_need_weights(true);
       },
       kExhausted, "need_weights: B*H*L*S = 1*1*300*300 = 90000 exceeds the limit of 65536"},
      {"OutputOverTheTensorLimit",
       [](R r) {
         *r.mutable_query() = Ramp({1, 4, 4});
         *r.mutable_key() = Ramp({1, 1, 4});
         *r.mutable_value() = Ramp({1, 1, 4096});
       },
       kExhausted, "output: 16384 elements exceed the limit of 4096"},
      {"AttnMaskOverTheTensorLimit",
       [](R r) {
         *r.mutable_query() = Ramp({1, 64, 4});
         *r.mutable_key() = Ramp({1, 100, 4});
         *r.mutable_value() = Ramp({1, 100, 6});
         *r.mutable_mask()->mutable_attn_mask() = Bools({64, 100}, 6400);
       },
       kExhausted, "mask.attn_mask: 6400 elements exceed the limit of 4096"},

      // --- data that does not match its shape ------------------------------------
      {"QueryBytesShort", [](R r) { r.mutable_query()->mutable_data()->resize(44); }, kInvalid,
       "query: data has 44 bytes; shape [2, 3, 4] of FLOAT32 needs 96"},
      {"KeyBytesOfAnotherDType", [](R r) { r.mutable_key()->set_dtype(v1::Tensor::BFLOAT16); },
       kInvalid, "key: data has 160 bytes; shape [2, 5, 4] of BFLOAT16 needs 80"},
      {"ValueFloatDataShort",
       [](R r) {
         v1::Tensor* v = r.mutable_value();
         v->clear_data();
         for (int i = 0; i < 5; ++i) v->add_float_data(1.0f);
       },
       kInvalid, "value: data has 20 bytes; shape [2, 5, 6] of FLOAT32 needs 240"},
      {"ValidLensBytesShort",
       [](R r) {
         *r.mutable_mask()->mutable_valid_lens() =
             RawTensor(v1::Tensor::INT64, {2}, "0123456789ab");
       },
       kInvalid, "mask.valid_lens: data has 12 bytes; shape [2] of INT64 needs 16"},
      {"KeyPaddingMaskBytesShort",
       [](R r) {
         *r.mutable_mask()->mutable_key_padding_mask() = Bools({2, 5}, 9);
       },
       kInvalid, "mask.key_padding_mask: data has 9 bytes; shape [2, 5] of BOOL needs 10"},
      {"AttnMaskBytesLong",
       [](R r) {
         *r.mutable_mask()->mutable_attn_mask() =
             RawTensor(v1::Tensor::FLOAT16, {3, 5}, std::string(31, '\0'));
       },
       kInvalid, "mask.attn_mask: data has 31 bytes; shape [3, 5] of FLOAT16 needs 30"},
      {"QueryShapeWithoutData", [](R r) { r.mutable_query()->clear_data(); }, kInvalid,
       "query: data has 0 bytes; shape [2, 3, 4] of FLOAT32 needs 96"},
      {"QueryDataWithoutShape", [](R r) { r.mutable_query()->clear_shape(); }, kInvalid,
       "query: shape [] has rank 0; want rank 3 or 4"},
      {"NoQuery", [](R r) { r.clear_query(); }, kInvalid, "query: is required"},

      // --- masks of the wrong shape, rank, dtype or values ---------------------
      {"ValidLensWrongBatch",
       [](R r) {
         *r.mutable_mask()->mutable_valid_lens() = Int64s({3}, {1, 2, 3});
       },
       kInvalid, "mask.valid_lens: shape [3] dim 0 is 3; want batch size B = 2"},
      {"ValidLensWrongQueryLength",
       [](R r) {
         *r.mutable_mask()->mutable_valid_lens() = Int64s({2, 4}, std::vector<int64_t>(8, 1));
       },
       kInvalid, "mask.valid_lens: shape [2, 4] dim 1 is 4; want query length L = 3"},
      {"ValidLensWrongRank",
       [](R r) {
         *r.mutable_mask()->mutable_valid_lens() = Int64s({2, 3, 1}, std::vector<int64_t>(6, 1));
       },
       kInvalid, "mask.valid_lens: shape [2, 3, 1] has rank 3; want rank 1 or 2"},
      {"ValidLensFloat", [](R r) { *r.mutable_mask()->mutable_valid_lens() = Ramp({2}); }, kInvalid,
       "mask.valid_lens: dtype FLOAT32 is not allowed; want INT32 or INT64"},
      {"ValidLensBool", [](R r) { *r.mutable_mask()->mutable_valid_lens() = Bools({2}, 2); },
       kInvalid, "mask.valid_lens: dtype BOOL is not allowed"},
      {"ValidLensBeyondTheKeys",
       [](R r) {
         *r.mutable_mask()->mutable_valid_lens() = Int64s({2}, {5, 6});
       },
       kInvalid, "mask.valid_lens: element 1 is 6; want 0 <= len <= key length S = 5"},
      {"KeyPaddingMaskWrongKeyLength",
       [](R r) {
         *r.mutable_mask()->mutable_key_padding_mask() = Bools({2, 4}, 8);
       },
       kInvalid, "mask.key_padding_mask: shape [2, 4] dim 1 is 4; want key length S = 5"},
      {"KeyPaddingMaskWrongBatch",
       [](R r) {
         *r.mutable_mask()->mutable_key_padding_mask() = Bools({3, 5}, 15);
       },
       kInvalid, "mask.key_padding_mask: shape [3, 5] dim 0 is 3; want batch size B = 2"},
      {"KeyPaddingMaskWrongRank",
       [](R r) {
         *r.mutable_mask()->mutable_key_padding_mask() = Bools({2, 5, 1}, 10);
       },
       kInvalid, "mask.key_padding_mask: shape [2, 5, 1] has rank 3; want rank 2"},
      {"KeyPaddingMaskInt64",
       [](R r) {
         *r.mutable_mask()->mutable_key_padding_mask() =
             Int64s({2, 5}, std::vector<int64_t>(10, 0));
       },
       kInvalid, "mask.key_padding_mask: dtype INT64 is not allowed; want BOOL, FLOAT32"},
      {"AttnMaskWrongKeyLength",
       [](R r) {
         *r.mutable_mask()->mutable_attn_mask() = Ramp({3, 4});
       },
       kInvalid, "mask.attn_mask: shape [3, 4] dim 1 is 4; want key length S = 5"},
      {"AttnMaskWrongHeads",
       [](R r) {
         *r.mutable_mask()->mutable_attn_mask() = Ramp({2, 2, 3, 5});
       },
       kInvalid, "mask.attn_mask: shape [2, 2, 3, 5] dim 1 is 2; want heads H = 1"},
      {"AttnMaskWrongBatch",
       [](R r) {
         *r.mutable_mask()->mutable_attn_mask() = Ramp({4, 3, 5});
       },
       kInvalid, "mask.attn_mask: shape [4, 3, 5] dim 0 is 4; want batch size B = 2"},
      {"AttnMaskWrongRank",
       [](R r) {
         *r.mutable_mask()->mutable_attn_mask() = Ramp({1, 2, 1, 3, 5});
       },
       kInvalid, "mask.attn_mask: shape [1, 2, 1, 3, 5] has rank 5; want rank 2 or 3 or 4"},
      {"AttnMaskInt32",
       [](R r) {
         *r.mutable_mask()->mutable_attn_mask() =
             RawTensor(v1::Tensor::INT32, {3, 5}, std::string(60, '\0'));
       },
       kInvalid, "mask.attn_mask: dtype INT32 is not allowed"},
      {"AttnMaskBoolOtherThanZeroOrOne",
       [](R r) {
         *r.mutable_mask()->mutable_attn_mask() =
             RawTensor(v1::Tensor::BOOL, {3, 5}, std::string(15, '\2'));
       },
       kInvalid, "mask.attn_mask: BOOL element 0 is 2; want 0 or 1"},

      // --- enum values the wire does not define --------------------------------
      {"UnknownQueryDType",
       [](R r) { r.mutable_query()->set_dtype(static_cast<v1::Tensor::DType>(17)); }, kInvalid,
       "query.dtype: unknown value 17"},
      {"UnknownKeyDType",
       [](R r) { r.mutable_key()->set_dtype(static_cast<v1::Tensor::DType>(-1)); }, kInvalid,
       "key.dtype: unknown value -1"},
      {"UnknownMaskDType",
       [](R r) {
         *r.mutable_mask()->mutable_attn_mask() = Ramp({3, 5});
         r.mutable_mask()->mutable_attn_mask()->set_dtype(static_cast<v1::Tensor::DType>(99));
       },
       kInvalid, "mask.attn_mask.dtype: unknown value 99"},
      {"UnknownScoreKind",
       [](R r) { r.mutable_score()->set_kind(static_cast<v1::Score::Kind>(17)); }, kInvalid,
       "score.kind: unknown value 17"},
      {"UnknownCausal", [](R r) { r.mutable_mask()->set_causal(static_cast<v1::Mask::Causal>(3)); },
       kInvalid, "mask.causal: unknown value 3"},
      {"UnknownLayout", [](R r) { r.set_layout(static_cast<v1::AttendRequest::Layout>(-1)); },
       kInvalid, "layout: unknown value -1"},
      {"UnknownPrecision",
       [](R r) { r.set_precision(static_cast<v1::AttendRequest::Precision>(5)); }, kInvalid,
       "precision: unknown value 5"},
      {"UnknownOutputDType", [](R r) { r.set_output_dtype(static_cast<v1::Tensor::DType>(6)); },
       kInvalid, "output_dtype: unknown value 6"},
      {"IntegerOutputDType", [](R r) { r.set_output_dtype(v1::Tensor::INT64); }, kInvalid,
       "output_dtype: must be FLOAT32, BFLOAT16 or FLOAT16, not INT64"},

      // --- non-finite parameters: refused (data is not: see the tests below) -----
      {"NanScale", [](R r) { r.mutable_score()->set_scale(std::nan("")); }, kInvalid,
       "score.scale: nan is not a finite number"},
      {"InfiniteScale", [](R r) { r.mutable_score()->set_scale(kInf); }, kInvalid,
       "score.scale: inf is not a finite number"},
      {"NegativeInfiniteScale", [](R r) { r.mutable_score()->set_scale(-kInf); }, kInvalid,
       "score.scale: -inf is not a finite number"},
      {"NanBandwidth",
       [](R r) {
         r.mutable_score()->set_kind(v1::Score::GAUSSIAN);
         r.mutable_score()->set_bandwidth(std::nan(""));
       },
       kInvalid, "score.bandwidth: nan is not a finite number"},
      {"InfiniteBandwidth",
       [](R r) {
         r.mutable_score()->set_kind(v1::Score::GAUSSIAN);
         r.mutable_score()->set_bandwidth(kInf);
       },
       kInvalid, "score.bandwidth: inf is not a finite number"},
      {"NanDropout", [](R r) { r.set_dropout_p(std::nan("")); }, kInvalid,
       "dropout_p: nan is outside [0, 1]"},
      {"DropoutAboveOne", [](R r) { r.set_dropout_p(1.5); }, kInvalid,
       "dropout_p: 1.5 is outside [0, 1]"},

      // --- model calls --------------------------------------------------------------
      {"UnknownModel", [](R r) { r.set_model("no_such_model"); }, absl::StatusCode::kNotFound,
       "model: \"no_such_model\" is not registered"},
      {"ModelWithNumHeads",
       [](R r) {
         r = ModelRequest();
         r.set_num_heads(2);
       },
       kInvalid, "num_heads: the model has 4 heads; leave num_heads unset"},
      {"ModelWithScore",
       [](R r) {
         r = ModelRequest();
         r.mutable_score()->set_scale(2);
       },
       kInvalid, "score: the model sets the score"},
      {"ModelInputOfTheWrongWidth", [](R r) { r.set_model("demo"); }, kInvalid,
       "query: last dim 4 does not match the model's embed_dim 64"},
      {"ModelKeyPaddingMaskWrongKeyLength",
       [](R r) {
         r = ModelRequest();
         *r.mutable_mask()->mutable_key_padding_mask() = Bools({1, 7}, 7);
       },
       kInvalid, "mask.key_padding_mask: shape [1, 7] dim 1 is 7; want key length S = 3"},
      {"ModelInputOverTheTensorLimit",
       [](R r) {
         r = ModelRequest();
         *r.mutable_query() = Ramp({1, 100, 64});
       },
       kExhausted, "query: 6400 elements exceed the limit of 4096"},
      // Each input under the limit; a batch of 64 keys against a broadcast
      // query makes an output of 64 * 64 * 64.
      {"ModelOutputOverTheTensorLimit",
       [](R r) {
         r = ModelRequest();
         *r.mutable_query() = Ramp({1, 64, 64});
         *r.mutable_key() = Ramp({64, 1, 64});
       },
       kExhausted, "output: 262144 elements exceed the limit of 4096"},
  };
}

// The Prometheus gauge attention_in_flight of `server`.
double InFlight(const AttentionServer& server) {
  const std::string text = server.metrics().RenderPrometheus();
  const std::string name = "\nattention_in_flight ";
  const size_t at = text.find(name);
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + name.size()));
}

// One server per suite: small limits, 1 MiB messages, the demo model.
ServerOptions HostileServerOptions() {
  ServerOptions options;
  options.max_message_mb = 1;
  options.model_repository = ATTENTION_MODELS_DIR;
  options.engine.max_tensor_elements = kMaxTensorElements;
  options.engine.max_score_elements = kMaxScoreElements;
  return options;
}

// Health SERVING and a good request answered: what every test checks last.
void ExpectServing(client::AttentionClient& client) {
  EXPECT_THAT(client.Health(), IsOkAndHolds("SERVING"));
  EXPECT_THAT(client.Attend(ValidRequest()), IsOk());
  EXPECT_THAT(client.Attend(ModelRequest()), IsOk());
}

class HostileInputTest : public ServerSuite<::testing::TestWithParam<HostileCase>> {
 protected:
  static void SetUpTestSuite() { StartSuiteServer(HostileServerOptions()); }
};

TEST_P(HostileInputTest, IsRefusedWithTheFieldAndTheServerStaysHealthy) {
  const HostileCase& c = GetParam();
  v1::AttendRequest request = ValidRequest();
  c.change(request);
  EXPECT_THAT(client().Attend(request), StatusIs(c.code, HasSubstr(c.message)));
  ExpectServing(client());
}

INSTANTIATE_TEST_SUITE_P(Cases, HostileInputTest, ::testing::ValuesIn(HostileCases()),
                         [](const ::testing::TestParamInfo<HostileCase>& info) {
                           return info.param.name;
                         });

// --- bytes that are not an AttendRequest ----------------------------------------

// A serialized request cut short: its last field's length runs past the end.
std::string Truncated() {
  const std::string bytes = ValidRequest().SerializeAsString();
  return bytes.substr(0, bytes.size() - 10);
}

// The request's id (field 1, a string) made invalid UTF-8.
std::string InvalidUtf8Id() {
  v1::AttendRequest r = ValidRequest();
  r.set_id("ok");
  std::string bytes = r.SerializeAsString();
  bytes[3] = '\xff';  // 0x0a 0x02 'o' 'k' ...: the id's 'k'
  return bytes;
}

struct GarbageCase {
  std::string name;
  std::string bytes;
  std::string message;
};

std::ostream& operator<<(std::ostream& os, const GarbageCase& c) { return os << c.name; }

constexpr char kNotARequest[] = "the request is not a valid attention.v1.AttendRequest message";

std::vector<GarbageCase> GarbageCases() {
  return {
      {"RandomBytes", std::string("\x93\x01\xff\xfe\x07garbage\x00\x00\x11", 16), kNotARequest},
      {"TruncatedRequest", Truncated(), kNotARequest},
      // Field 3 (query), length-delimited, with a length of 2^35.
      {"LengthBeyondTheMessage", std::string("\x1a\x80\x80\x80\x80\x80\x01", 7), kNotARequest},
      {"OverlongVarint", std::string("\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 12),
       kNotARequest},
      {"InvalidUtf8InAString", InvalidUtf8Id(), kNotARequest},
      {"EndGroupTag", std::string("\x0c", 1), kNotARequest},
      // No bytes at all parse as an empty request.
      {"Empty", "", "query: is required"},
  };
}

// Raw bytes to /attention.v1.AttentionService/<method> on `channel`.
grpc::Status CallRaw(const std::shared_ptr<grpc::Channel>& channel, const std::string& bytes) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  grpc::Slice slice(bytes);
  const grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&context, "/attention.v1.AttentionService/Attend", grpc::StubOptions(), &request,
                 &response, [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  return status;
}

class GarbageBytesTest : public ServerSuite<::testing::TestWithParam<GarbageCase>> {
 protected:
  static void SetUpTestSuite() { StartSuiteServer(HostileServerOptions()); }
};

TEST_P(GarbageBytesTest, IsInvalidArgumentAndTheServerStaysHealthy) {
  const grpc::Status status = CallRaw(client().channel(), GetParam().bytes);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr(GetParam().message));
  ExpectServing(client());
}

INSTANTIATE_TEST_SUITE_P(Cases, GarbageBytesTest, ::testing::ValuesIn(GarbageCases()),
                         [](const ::testing::TestParamInfo<GarbageCase>& info) {
                           return info.param.name;
                         });

// --- oversize messages, non-finite data, floods of streams -----------------------

using Stream = grpc::ClientReaderWriter<v1::AttendRequest, v1::AttendResponse>;

class HostileServerTest : public ServerSuite<> {
 protected:
  static void SetUpTestSuite() { StartSuiteServer(HostileServerOptions()); }

  // The answer's output as floats; fails the test on an error.
  static std::vector<float> Output(const v1::AttendRequest& request) {
    absl::StatusOr<v1::AttendResponse> response = client().Attend(request);
    EXPECT_THAT(response, IsOk());
    if (!response.ok()) return {};
    absl::StatusOr<std::vector<float>> values = client::ReadFloats(response->output());
    EXPECT_THAT(values, IsOk());
    return values.ok() ? *values : std::vector<float>{};
  }

  std::unique_ptr<v1::AttentionService::Stub> stub_ =
      v1::AttentionService::NewStub(client().channel());
};

// A request of `bytes` bytes or more: a query of that much FLOAT32 data.
v1::AttendRequest RequestOfAtLeast(int64_t bytes) {
  v1::AttendRequest r;
  const int64_t rows = bytes / (4 * 64) + 1;
  *r.mutable_query() = RawTensor(v1::Tensor::FLOAT32, {1, rows, 64},
                                 std::string(static_cast<size_t>(rows * 64 * 4), '\0'));
  return r;
}

// gRPC refuses it before our code sees it; the limit is the server's
// --max_message_mb (1 here), in the message.
TEST_F(HostileServerTest, AMessageOverTheSizeLimitIsResourceExhausted) {
  EXPECT_THAT(client().Attend(RequestOfAtLeast((1 << 20) + (1 << 19))),
              StatusIs(kExhausted, HasSubstr("1048576")));
  ExpectServing(client());
}

TEST_F(HostileServerTest, AMessageOverTheSizeLimitEndsItsStreamWithResourceExhausted) {
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = stub_->AttendStream(&context);
  stream->Write(RequestOfAtLeast((1 << 20) + (1 << 19)));
  stream->WritesDone();
  v1::AttendResponse response;
  while (stream->Read(&response)) {
  }
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  ExpectServing(client());
}

TEST_F(HostileServerTest, GarbageOnAStreamIsAnsweredAndTheStreamGoesOn) {
  // The typed stub cannot send garbage; a raw stream through GenericStub can.
  class RawStream : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    RawStream(std::shared_ptr<grpc::Channel> channel, std::vector<std::string> messages)
        : stub_(std::move(channel)), messages_(std::move(messages)) {
      context_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
      stub_.PrepareBidiStreamingCall(&context_, "/attention.v1.AttentionService/AttendStream",
                                     grpc::StubOptions(), this);
      StartRead(&in_);
      WriteNext();
      StartCall();
    }
    void OnWriteDone(bool ok) override {
      if (ok) WriteNext();
    }
    void OnReadDone(bool ok) override {
      if (!ok) return;
      v1::AttendResponse response;
      EXPECT_TRUE(server::ParseMessage(in_, &response).ok());
      {
        absl::MutexLock lock(&mu_);
        answers_.push_back(std::move(response));
      }
      StartRead(&in_);
    }
    void OnDone(const grpc::Status& status) override {
      absl::MutexLock lock(&mu_);
      status_ = status;
      done_ = true;
    }
    // The stream's status and its answers, once it is over.
    std::pair<grpc::Status, std::vector<v1::AttendResponse>> Await() {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&done_));
      return {status_, answers_};
    }

   private:
    void WriteNext() {
      if (next_ == messages_.size()) {
        StartWritesDone();
        return;
      }
      grpc::Slice slice(messages_[next_++]);
      out_ = grpc::ByteBuffer(&slice, 1);
      StartWrite(&out_);
    }

    grpc::GenericStub stub_;
    grpc::ClientContext context_;
    const std::vector<std::string> messages_;
    size_t next_ = 0;
    grpc::ByteBuffer out_, in_;
    absl::Mutex mu_;
    std::vector<v1::AttendResponse> answers_ ABSL_GUARDED_BY(mu_);
    grpc::Status status_ ABSL_GUARDED_BY(mu_);
    bool done_ ABSL_GUARDED_BY(mu_) = false;
  };
  v1::AttendRequest good = ValidRequest();
  good.set_id("good");
  // Garbage; an id that is not UTF-8 (the answer must not echo it: no
  // client could decode that answer, and the stream would die with it); a
  // request cut short after its id.
  v1::AttendRequest cut = ValidRequest();
  cut.set_id("cut");
  std::string cut_bytes = cut.SerializeAsString();
  cut_bytes.resize(cut_bytes.size() - 10);
  RawStream stream(client().channel(),
                   {"\x93\x01\xff garbage", InvalidUtf8Id(), cut_bytes, good.SerializeAsString()});
  const auto [status, answers] = stream.Await();
  EXPECT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(answers.size(), 4u);  // each answer parsed (OnReadDone checks)
  for (const v1::AttendResponse& a : answers) {
    if (a.id() == "good") {
      EXPECT_EQ(a.status().code(), 0) << a.status().message();
    } else {
      EXPECT_EQ(a.id(), "");
      EXPECT_EQ(a.status().code(), grpc::StatusCode::INVALID_ARGUMENT);
      EXPECT_THAT(a.status().message(), HasSubstr(kNotARequest));
    }
  }
  ExpectServing(client());
}

// 200 streams at once, each with requests in flight, then every one
// abandoned: half cancelled before reading anything, half after reading
// their answers without closing. Nothing may stay behind: the in-flight
// gauge returns to 0 and the server serves on.
TEST_F(HostileServerTest, AFloodOfAbandonedStreamsLeavesTheServerHealthy) {
  constexpr int kStreams = 200;
  constexpr int kRequestsPerStream = 3;
  struct Open {
    grpc::ClientContext context;
    std::unique_ptr<Stream> stream;
  };
  std::vector<std::unique_ptr<Open>> open;
  for (int i = 0; i < kStreams; ++i) {
    auto o = std::make_unique<Open>();
    o->stream = stub_->AttendStream(&o->context);
    for (int j = 0; j < kRequestsPerStream; ++j) {
      v1::AttendRequest r = ValidRequest();
      r.set_id(absl::StrCat(i, "/", j));
      ASSERT_TRUE(o->stream->Write(r)) << "stream " << i;
    }
    open.push_back(std::move(o));
  }
  int answered = 0;
  for (int i = 0; i < kStreams; ++i) {
    Open& o = *open[i];
    if (i % 2 == 1) {
      v1::AttendResponse response;
      for (int j = 0; j < kRequestsPerStream && o.stream->Read(&response); ++j) {
        EXPECT_EQ(response.status().code(), 0) << response.status().message();
        ++answered;
      }
    }
    o.context.TryCancel();
  }
  EXPECT_EQ(answered, kStreams / 2 * kRequestsPerStream);
  for (auto& o : open) EXPECT_EQ(o->stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  open.clear();

  // The server learns of each cancellation on its own threads, and a read of
  // a cancelled stream may still hand it a request after the gauge first
  // reads 0 (the gauge then reads 1 until that request is dropped): wait
  // (bounded) until the gauge has read 0 for a whole second. A request left
  // behind keeps it above 0 to the deadline.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  absl::Time zero_since = absl::InfiniteFuture();
  while (absl::Now() < deadline) {
    const absl::Time now = absl::Now();
    if (InFlight(server_->server()) != 0) {
      zero_since = absl::InfiniteFuture();
    } else if (zero_since == absl::InfiniteFuture()) {
      zero_since = now;
    } else if (now - zero_since >= absl::Seconds(1)) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(InFlight(server_->server()), 0);
  ExpectServing(client());
}

// NaN and infinities in the data are not refused (finding them would cost a
// pass over every input): they propagate as in PyTorch, to the rows whose
// computation they enter, and to no other row. docs/errors.md, "Non-finite numbers".
TEST_F(HostileServerTest, ANanInAQueryRowMakesThatRowNanAndNoOther) {
  const std::vector<float> clean = Output(ValidRequest());
  for (const bool need_weights : {false, true}) {
    SCOPED_TRACE(need_weights ? "weights path" : "fused path");
    v1::AttendRequest r = ValidRequest();
    r.set_need_weights(need_weights);
    std::vector<float> q(24, 0.5f);
    q[4 * 1 + 2] = kNaN;  // batch 0, row 1
    *r.mutable_query() = *client::MakeFloatTensor({2, 3, 4}, q);
    v1::AttendRequest same = r;
    same.mutable_query()->mutable_data()->replace(4 * 6, 4, std::string("\0\0\0\x3f", 4));
    const std::vector<float> got = Output(r);
    const std::vector<float> want = Output(same);  // the NaN replaced by 0.5
    ASSERT_EQ(got.size(), 36u);
    for (size_t i = 0; i < got.size(); ++i) {
      const bool row_1_of_batch_0 = i / 6 == 1;
      if (row_1_of_batch_0) {
        EXPECT_TRUE(std::isnan(got[i])) << i;
      } else {
        EXPECT_EQ(got[i], want[i]) << i;
      }
    }
  }
  EXPECT_EQ(clean.size(), 36u);
  ExpectServing(client());
}

TEST_F(HostileServerTest, AnInfinityInAKeyMakesTheRowsThatSeeItNonFinite) {
  v1::AttendRequest r = ValidRequest();
  std::vector<float> k(40, 0.25f);
  k[4 * 2] = kInf;  // batch 0, key 2
  *r.mutable_key() = *client::MakeFloatTensor({2, 5, 4}, k);
  const std::vector<float> got = Output(r);
  ASSERT_EQ(got.size(), 36u);
  for (size_t i = 0; i < got.size(); ++i) {
    const bool batch_0 = i < 18;
    EXPECT_EQ(std::isfinite(got[i]), !batch_0) << i << ": " << got[i];
  }
  ExpectServing(client());
}

TEST_F(HostileServerTest, NegativeInfinityInAFloatMaskMasksLikeTrue) {
  v1::AttendRequest with_bool = ValidRequest();
  std::vector<bool> masked(15, false);
  std::vector<float> additive(15, 0.0f);
  for (int i = 0; i < 3; ++i) {
    masked[i * 5 + 4] = true;  // key 4 for every row
    additive[i * 5 + 4] = -kInf;
  }
  // Row 2 masks every key: a row with no key left gets zeros.
  for (int j = 0; j < 5; ++j) {
    masked[2 * 5 + j] = true;
    additive[2 * 5 + j] = -kInf;
  }
  *with_bool.mutable_mask()->mutable_attn_mask() = *client::MakeBoolTensor({3, 5}, masked);
  v1::AttendRequest with_float = ValidRequest();
  *with_float.mutable_mask()->mutable_attn_mask() = *client::MakeFloatTensor({3, 5}, additive);
  for (const bool need_weights : {false, true}) {
    SCOPED_TRACE(need_weights ? "weights path" : "fused path");
    with_bool.set_need_weights(need_weights);
    with_float.set_need_weights(need_weights);
    const std::vector<float> want = Output(with_bool);
    const std::vector<float> got = Output(with_float);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_FLOAT_EQ(got[i], want[i]) << i;
      if (i % 18 >= 12) {  // row 2 of either batch
        EXPECT_EQ(got[i], 0.0f) << i;
      }
    }
  }
  ExpectServing(client());
}

TEST_F(HostileServerTest, ANanInAFloatMaskMakesThatRowNan) {
  v1::AttendRequest r = ValidRequest();
  std::vector<float> additive(15, 0.0f);
  additive[1 * 5 + 3] = kNaN;  // row 1, key 3
  *r.mutable_mask()->mutable_attn_mask() = *client::MakeFloatTensor({3, 5}, additive);
  const std::vector<float> got = Output(r);
  ASSERT_EQ(got.size(), 36u);
  for (size_t i = 0; i < got.size(); ++i) {
    const bool row_1 = (i % 18) / 6 == 1;
    EXPECT_EQ(std::isnan(got[i]), row_1) << i << ": " << got[i];
  }
  ExpectServing(client());
}

TEST_F(HostileServerTest, ANanInAModelInputMakesThatRowNanAndNoOther) {
  v1::AttendRequest r = ModelRequest();
  std::vector<float> q(3 * 64, 0.1f);
  q[64 + 5] = kNaN;  // row 1
  *r.mutable_query() = *client::MakeFloatTensor({1, 3, 64}, q);
  // Self-attention: row 1 is also a key and value of every row, so give the
  // layer a clean key and value.
  *r.mutable_key() = *client::MakeFloatTensor({1, 3, 64}, std::vector<float>(3 * 64, 0.1f));
  const std::vector<float> got = Output(r);
  ASSERT_EQ(got.size(), 3u * 64);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(std::isnan(got[i]), i / 64 == 1) << i;
  ExpectServing(client());
}

// --- every request's cost bounded before work starts -----------------------------

// Default limits but 1 MiB messages and 1 GFLOP per request.
class CostLimitTest : public ServerSuite<> {
 protected:
  static void SetUpTestSuite() {
    ServerOptions options;
    options.max_message_mb = 1;
    options.engine.max_request_flops = 1e9;
    StartSuiteServer(options);
  }
};

TEST_F(CostLimitTest, AnAnswerOverTheMessageLimitIsRefusedBeforeCompute) {
  // L = S = 512 with D = 1: 262144 weights, 1 MiB as float32, with the output
  // over the 1 MiB the server sends; the request itself is 6 KiB.
  v1::AttendRequest request;
  *request.mutable_query() = Ramp({1, 512, 1});
  request.set_need_weights(true);
  const double computed = AttendLatencyCount(server_->server(), "compute");
  EXPECT_THAT(client().Attend(request),
              StatusIs(kExhausted, AllOf(HasSubstr("answer: 1054720 bytes (output 2048, weights "
                                                   "1048576, and 4096 kept for its other "
                                                   "fields)"),
                                         HasSubstr("1048576 bytes (--max_message_mb)"),
                                         HasSubstr("without need_weights"))));
  EXPECT_EQ(AttendLatencyCount(server_->server(), "compute"), computed)
      << "the refused call was computed";
  request.set_need_weights(false);
  EXPECT_THAT(client().Attend(request), IsOk());
}

// An additive score's work grows with its hidden size, not only with the
// shapes of q, k and v: the call that stalled a server for 11 s counted as
// small before.
TEST_F(CostLimitTest, TheComputeLimitCountsAnAdditiveScoresHiddenSize) {
  auto additive = [](int64_t hidden) {
    v1::AttendRequest r;
    *r.mutable_query() = Ramp({1, 64, 4});
    v1::Score* s = r.mutable_score();
    s->set_kind(v1::Score::ADDITIVE);
    *s->mutable_w_q() = Ramp({hidden, 4});
    *s->mutable_w_k() = Ramp({hidden, 4});
    *s->mutable_w_v() = Ramp({hidden});
    return r;
  };
  EXPECT_THAT(client().Attend(additive(64)), IsOk());
  // 64 * 64 pairs * 8192 hidden units: over 1 GFLOP.
  EXPECT_THAT(
      client().Attend(additive(8192)),
      StatusIs(kExhausted, AllOf(HasSubstr("request: needs "),
                                 HasSubstr("GFLOP of compute, over the limit of 1 GFLOP"))));
}

TEST_F(CostLimitTest, ServerInfoReportsTheLimits) {
  absl::StatusOr<v1::ServerInfo> info = client().GetServerInfo();
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->limits().max_request_bytes(), EngineOptions().max_request_bytes);
  EXPECT_EQ(info->limits().max_request_gflop(), 1);
}

// A server-wide memory budget of 2 MiB.
class MemoryBudgetServerTest : public ServerSuite<> {
 protected:
  static void SetUpTestSuite() {
    ServerOptions options;
    options.memory_budget_mb = 2;
    StartSuiteServer(options);
  }
};

TEST_F(MemoryBudgetServerTest, ACallThatWouldPassTheBudgetIsRefusedBeforeCompute) {
  // 1.5 MiB of queries: with its output and answer, over 4 MiB.
  v1::AttendRequest request;
  *request.mutable_query() = Ramp({1, 3072, 128});
  const double computed = AttendLatencyCount(server_->server(), "compute");
  EXPECT_THAT(client().Attend(request),
              StatusIs(kExhausted, AllOf(HasSubstr("memory: this call would hold "),
                                         HasSubstr("more than the server's whole memory budget "
                                                   "of 2.0 MiB (--memory_budget_mb)"))));
  EXPECT_EQ(AttendLatencyCount(server_->server(), "compute"), computed)
      << "the refused call was computed";
  EXPECT_THAT(server_->server().metrics().RenderPrometheus(),
              HasSubstr("\nattention_memory_reserved_bytes 0\n"))
      << "the refused call holds memory";
  *request.mutable_query() = Ramp({1, 8, 128});
  EXPECT_THAT(client().Attend(request), IsOk());
}

TEST_F(MemoryBudgetServerTest, ServerInfoReportsTheBudget) {
  absl::StatusOr<v1::ServerInfo> info = client().GetServerInfo();
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->limits().memory_budget_bytes(), 2 << 20);
}

// Calls started so far by the dispatcher or inline (batches, not requests).
double BatchesStarted(AttentionServer& server) {
  const std::string text = server.metrics().RenderPrometheus();
  const std::string name = "\nattention_batch_size_count ";
  const size_t at = text.find(name);
  return at == std::string::npos ? 0 : std::stod(text.substr(at + name.size()));
}

// Regression: an additive score with a wide hidden layer computed for
// seconds, and a small call sent meanwhile waited for all of it. Now small
// and medium calls are answered while the long call still computes.
TEST(FairShareTest, SmallAndMediumCallsAreAnsweredWhileALongCallComputes) {
  client::ClientOptions patient;  // an ASan build computes the long call for tens of seconds
  patient.timeout = absl::Minutes(10);
  absl::StatusOr<std::unique_ptr<TestServer>> server = TestServer::Start({}, patient);
  ASSERT_THAT(server, IsOk());
  v1::AttendRequest long_call;  // 256 x 256 pairs x 16384 hidden units: ~45 GFLOP
  *long_call.mutable_query() = Ramp({1, 256, 4});
  v1::Score* s = long_call.mutable_score();
  s->set_kind(v1::Score::ADDITIVE);
  *s->mutable_w_q() = Ramp({16384, 4});
  *s->mutable_w_k() = Ramp({16384, 4});
  *s->mutable_w_v() = Ramp({16384});
  const double started = BatchesStarted((*server)->server());
  std::atomic<bool> long_done{false};
  absl::Status long_status;
  std::thread caller([&] {
    long_status = (*server)->client().Attend(long_call).status();
    long_done = true;
  });
  // Until the long call computes (bounded: it fails the test past a minute).
  for (int i = 0; i < 6000 && BatchesStarted((*server)->server()) == started; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  v1::AttendRequest small;
  *small.mutable_query() = Ramp({1, 4, 8});
  EXPECT_THAT((*server)->client().Attend(small), IsOk());
  EXPECT_FALSE(long_done.load()) << "the small call waited for the long one";
  // Milliseconds of work, queued behind the long call before.
  v1::AttendRequest medium;
  *medium.mutable_query() = Ramp({1, 4, 512, 64});
  EXPECT_THAT((*server)->client().Attend(medium), IsOk());
  EXPECT_FALSE(long_done.load()) << "the medium call waited for the long one";
  caller.join();
  EXPECT_THAT(long_status, IsOk());
}

// With default limits, long sequences without weights are answered: the
// fused path never holds the L x S scores. Every key the same, so the scores
// of a row are equal and the answer is the mean of the values, whatever the
// query.
TEST(LongSequenceTest, ThirtyTwoThousandKeysWithoutWeightsAreAnsweredByDefault) {
  client::ClientOptions patient;  // a sanitizer build computes for longer than 30 s
  patient.timeout = absl::Minutes(10);
  absl::StatusOr<std::unique_ptr<TestServer>> server = TestServer::Start({}, patient);
  ASSERT_THAT(server, IsOk());
  constexpr int64_t kLen = 32768, kDim = 64;
  std::vector<float> query(kLen * kDim), key(kLen * kDim), value(kLen * kDim);
  std::vector<double> mean(kDim, 0.0);
  for (int64_t i = 0; i < kLen; ++i) {
    for (int64_t d = 0; d < kDim; ++d) {
      query[i * kDim + d] = static_cast<float>((i * 7 + d * 13) % 17) / 17.0f - 0.5f;
      key[i * kDim + d] = static_cast<float>(d % 5) / 5.0f;
      value[i * kDim + d] = static_cast<float>((i * 3 + d * 11) % 23) / 23.0f;
      mean[d] += value[i * kDim + d] / kLen;
    }
  }
  v1::AttendRequest request;
  *request.mutable_query() = *client::MakeFloatTensor({1, kLen, kDim}, query);
  *request.mutable_key() = *client::MakeFloatTensor({1, kLen, kDim}, key);
  *request.mutable_value() = *client::MakeFloatTensor({1, kLen, kDim}, value);
  absl::StatusOr<v1::AttendResponse> answer = (*server)->client().Attend(request);
  ASSERT_THAT(answer, IsOk());
  absl::StatusOr<std::vector<float>> output = client::ReadFloats(answer->output());
  ASSERT_THAT(output, IsOk());
  ASSERT_EQ(output->size(), query.size());
  for (int64_t i = 0; i < kLen; i += 4099) {
    for (int64_t d = 0; d < kDim; ++d) {
      ASSERT_NEAR((*output)[i * kDim + d], mean[d], 1e-4) << "row " << i << ", dim " << d;
    }
  }
  // The same call with its weights would hold 2^30 scores: refused before compute.
  request.set_need_weights(true);
  EXPECT_THAT((*server)->client().Attend(request),
              StatusIs(kExhausted, HasSubstr("need_weights: B*H*L*S = 1*1*32768*32768")));
}

// One counter of a server's metrics by its exact series name ("" if absent).
double Counter(AttentionServer& server, const std::string& series) {
  const std::string text = server.metrics().RenderPrometheus();
  const size_t at = text.find("\n" + series + " ");
  return at == std::string::npos ? -1 : std::stod(text.substr(at + series.size() + 2));
}

// A call whose deadline passes while it computes stops there: its work is
// dropped between work items and the cores are free for the next call. Its
// request is 1 MiB, so it computes well before its 2 s deadline, even in a
// sanitizer build; its work, an additive score over 65536 x 65536 pairs,
// takes two minutes on a 2-core AVX2 host, so the deadline passes while it
// computes on any CPU; and its work items, 64 query rows each, are short
// (tens of milliseconds), so it stops soon after.
TEST(LongSequenceTest, ACallPastItsDeadlineStopsComputing) {
  absl::StatusOr<std::unique_ptr<TestServer>> server = TestServer::Start();
  ASSERT_THAT(server, IsOk());
  client::ClientOptions hasty;
  hasty.target = (*server)->server().address();
  hasty.timeout = absl::Seconds(2);
  absl::StatusOr<std::unique_ptr<client::AttentionClient>> caller =
      client::AttentionClient::Create(hasty);
  ASSERT_THAT(caller, IsOk());
  v1::AttendRequest request;
  *request.mutable_query() = Ramp({1, 65536, 4});
  request.set_need_weights(false);
  v1::Score* score = request.mutable_score();
  score->set_kind(v1::Score::ADDITIVE);
  *score->mutable_w_q() = Ramp({8, 4});
  *score->mutable_w_k() = Ramp({8, 4});
  *score->mutable_w_v() = Ramp({8});
  const absl::Time start = absl::Now();
  EXPECT_THAT((*caller)->Attend(request),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("")));
  // The server stopped the work (it did not finish it and drop the answer).
  const std::string interrupted = R"(attention_interrupted_total{reason="deadline_exceeded"})";
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (Counter((*server)->server(), interrupted) < 1 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(Counter((*server)->server(), interrupted), 1)
      << (*server)->server().metrics().RenderPrometheus();
  EXPECT_EQ(Counter((*server)->server(),
                    R"(attention_requests_total{method="Attend",model="",code="OK"})"),
            -1);
  EXPECT_THAT((*server)->client().Attend(ValidRequest()), IsOk());
  std::cerr << "interrupted call and the next one answered " << absl::Now() - start
            << " after the first was sent\n";
}

// A call whose deadline passes while its 8 MiB request is still arriving:
// gRPC hands the handler what came, which does not parse. It was counted as
// INVALID_ARGUMENT, a malformed request of the caller's (27 to 35 of 40 such
// calls); it is a call over before compute, by why it ended.
TEST(UploadTest, ACallOverDuringItsUploadIsNotCountedAsTheCallersMistake) {
  absl::StatusOr<std::unique_ptr<TestServer>> server = TestServer::Start();
  ASSERT_THAT(server, IsOk());
  ASSERT_THAT((*server)->client().Attend(ValidRequest()), IsOk());  // connected
  client::ClientOptions hasty;
  hasty.target = (*server)->server().address();
  hasty.timeout = absl::Milliseconds(3);
  hasty.max_attempts = 1;
  absl::StatusOr<std::unique_ptr<client::AttentionClient>> caller =
      client::AttentionClient::Create(hasty);
  ASSERT_THAT(caller, IsOk());
  v1::AttendRequest request;
  *request.mutable_query() = Ramp({1, 1, 64});
  *request.mutable_key() = Ramp({1, 16384, 64});
  *request.mutable_value() = Ramp({1, 16384, 64});
  request.set_need_weights(false);
  for (int i = 0; i < 40; ++i) {
    EXPECT_THAT((*caller)->Attend(request),
                StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("")));
  }
  AttentionServer& s = (*server)->server();
  const auto count = [&](const std::string& series) { return std::max(0.0, Counter(s, series)); };
  // Every call the server counted as over is one it dropped or stopped. The
  // two sides are counted at two moments of a call (a dropped one is not in
  // attention_in_flight at all), and a call the client gave up on may still
  // be arriving: so they are read until they agree, for at most 30 s.
  double over = 0, dropped = 0;
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  do {
    over = count(R"(attention_requests_total{method="Attend",model="",code="DEADLINE_EXCEEDED"})") +
           count(R"(attention_requests_total{method="Attend",model="",code="CANCELLED"})");
    dropped = count(R"(attention_not_computed_total{reason="deadline_exceeded"})") +
              count(R"(attention_not_computed_total{reason="cancelled"})") +
              count(R"(attention_interrupted_total{reason="deadline_exceeded"})") +
              count(R"(attention_interrupted_total{reason="cancelled"})");
    if (over == dropped && Counter(s, "attention_in_flight") == 0) break;
    absl::SleepFor(absl::Milliseconds(10));
  } while (absl::Now() < give_up);
  EXPECT_EQ(over, dropped) << s.metrics().RenderPrometheus();
  EXPECT_EQ(Counter(s, R"(attention_requests_total{method="Attend",model="",code="INVALID_ARGUMENT"})"),
            -1)
      << s.metrics().RenderPrometheus();
}

}  // namespace
}  // namespace attention::testing
