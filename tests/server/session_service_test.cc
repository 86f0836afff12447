// Sessions through a real server (docs/sessions.md): answers equal the
// stateless call over every row sent so far; every error names the session
// and leaves every session as it was; limits, eviction, expiry, concurrency.

#include <atomic>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/session.h"
#include "client/tensors.h"
#include "gmock/gmock.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "server/metrics.h"
#include "tests/golden_case.h"
#include "tests/random_tensor.h"
#include "tests/safetensors_writer.h"
#include "tests/server/test_server.h"
#include "tests/status_matchers.h"

namespace attention::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<float> RandomValues(int64_t n, uint32_t seed) { return RandomFloats({n}, seed).values; }

// Rows of one sequence, [1, S, E] batch-first, grown as a decoder sends them.
struct Rows {
  int64_t dim = 0;
  std::vector<float> values;
  int64_t length() const { return static_cast<int64_t>(values.size()) / dim; }
  v1::Tensor Tensor() const { return *client::MakeFloatTensor({1, length(), dim}, values); }
};

v1::Tensor Floats(const std::vector<int64_t>& shape, const std::vector<float>& values) {
  return *client::MakeFloatTensor(shape, values);
}

std::vector<float> Output(const v1::AttendResponse& r) { return *client::ReadFloats(r.output()); }

void ExpectNear(const std::vector<float>& got, const std::vector<float>& want, float tolerance) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], tolerance * (1 + std::abs(want[i]))) << i;
  }
}

class SessionServiceTest : public ServerSuite<> {
 protected:
  static void SetUpTestSuite() {
    ServerOptions options;
    // A layer with bias_kv and zero attention (torch appends their keys
    // after every cached row), served as "layer".
    const GoldenCase c = LoadGoldenCase("mha_bias_kv_zero_attn");
    const MultiheadConfig m = MultiheadConfigOf(c);
    const std::string repo = MakeTempDir("session_models");
    std::filesystem::create_directories(repo + "/layer");
    WriteFile(repo + "/layer/config.pbtxt",
              absl::StrCat("name: \"layer\"\nembed_dim: ", m.embed_dim,
                           "\nnum_heads: ", m.num_heads, "\nadd_bias_kv: true\nadd_zero_attn: true\n"));
    WriteFile(repo + "/layer/weights.safetensors", SafetensorsBytes(StateDictOf(c)));
    options.model_repository = repo;
    StartSuiteServer(std::move(options));
  }

  static std::unique_ptr<v1::AttentionService::Stub> Stub() {
    return v1::AttentionService::NewStub(client().channel());
  }

  static absl::StatusOr<v1::SessionInfo> Info(const std::string& id) {
    grpc::ClientContext context;
    v1::GetSessionRequest request;
    request.set_id(id);
    v1::SessionInfo info;
    const grpc::Status status = Stub()->GetSession(&context, request, &info);
    if (!status.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
    }
    return info;
  }

  static v1::CloseSessionsResponse Close(const std::vector<std::string>& ids) {
    grpc::ClientContext context;
    v1::CloseSessionsRequest request;
    for (const std::string& id : ids) request.add_ids(id);
    v1::CloseSessionsResponse response;
    EXPECT_TRUE(Stub()->CloseSessions(&context, request, &response).ok());
    return response;
  }

  // A raw request of `rows` new rows (query = key = value rows) for session
  // `id` at `position`, with 2 heads of 8.
  static v1::AttendRequest Step(const std::string& id, int64_t position,
                                const std::vector<float>& rows, bool create = false) {
    v1::AttendRequest r;
    r.set_num_heads(2);
    *r.mutable_query() = Floats({1, static_cast<int64_t>(rows.size()) / 16, 16}, rows);
    r.mutable_mask()->set_causal(v1::Mask::BOTTOM_RIGHT);
    r.mutable_session()->add_ids(id);
    r.mutable_session()->add_positions(position);
    r.mutable_session()->set_create(create);
    return r;
  }
};

TEST_F(SessionServiceTest, PrefillThenStepsEqualTheStatelessCall) {
  for (v1::Tensor::DType dtype : {v1::Tensor::FLOAT32, v1::Tensor::BFLOAT16}) {
    const std::string id = absl::StrCat("decoder-", v1::Tensor::DType_Name(dtype));
    const float tolerance = dtype == v1::Tensor::FLOAT32 ? 1e-5f : 2e-2f;
    Rows keys{16, {}}, values{16, {}};
    uint32_t seed = 1;
    for (int64_t rows : {70, 1, 1, 2}) {
      const std::vector<float> q = RandomValues(rows * 16, seed++),
                               k = RandomValues(rows * 16, seed++),
                               v = RandomValues(rows * 16, seed++);
      v1::AttendRequest r = Step(id, keys.length(), q, keys.length() == 0);
      *r.mutable_key() = Floats({1, rows, 16}, k);
      *r.mutable_value() = Floats({1, rows, 16}, v);
      r.mutable_session()->set_cache_dtype(dtype);
      absl::StatusOr<v1::AttendResponse> got = client().Attend(r);
      ASSERT_THAT(got, IsOk());
      keys.values.insert(keys.values.end(), k.begin(), k.end());
      values.values.insert(values.values.end(), v.begin(), v.end());
      EXPECT_THAT(got->session_positions(), ElementsAre(keys.length()));
      v1::AttendRequest whole = r;
      whole.clear_session();
      *whole.mutable_key() = keys.Tensor();
      *whole.mutable_value() = values.Tensor();
      absl::StatusOr<v1::AttendResponse> want = client().Attend(whole);
      ASSERT_THAT(want, IsOk());
      ExpectNear(Output(*got), Output(*want), tolerance);
    }
    absl::StatusOr<v1::SessionInfo> info = Info(id);
    ASSERT_THAT(info, IsOk());
    EXPECT_EQ(info->position(), 74);
    EXPECT_EQ(info->heads(), 2);
    EXPECT_EQ(info->head_dim(), 8);
    EXPECT_EQ(info->cache_dtype(), dtype);
    // Two blocks of 64 rows, 2 heads of 8 + 8 elements each.
    EXPECT_EQ(info->bytes(), 2 * 64 * 2 * 16 * (dtype == v1::Tensor::FLOAT32 ? 4 : 2));
    EXPECT_THAT(Close({id}).closed(), ElementsAre(id));
  }
}

// Two sessions of different lengths in one request, each its own call.
TEST_F(SessionServiceTest, RaggedPositionsInOneRequest) {
  const std::vector<float> a = RandomValues(3 * 16, 10), b = RandomValues(9 * 16, 11);
  ASSERT_THAT(client().Attend(Step("ragged-a", 0, a, true)), IsOk());
  ASSERT_THAT(client().Attend(Step("ragged-b", 0, b, true)), IsOk());
  const std::vector<float> q = RandomValues(2 * 16, 12);
  v1::AttendRequest r;
  r.set_num_heads(2);
  *r.mutable_query() = Floats({2, 1, 16}, q);
  for (auto [id, position] : {std::pair<const char*, int>{"ragged-a", 3}, {"ragged-b", 9}}) {
    r.mutable_session()->add_ids(id);
    r.mutable_session()->add_positions(position);
  }
  absl::StatusOr<v1::AttendResponse> got = client().Attend(r);
  ASSERT_THAT(got, IsOk());
  EXPECT_THAT(got->session_positions(), ElementsAre(4, 10));
  const std::vector<float> out = Output(*got);
  for (int row = 0; row < 2; ++row) {
    std::vector<float> keys = row == 0 ? a : b;
    keys.insert(keys.end(), q.begin() + row * 16, q.begin() + (row + 1) * 16);
    v1::AttendRequest whole;
    whole.set_num_heads(2);
    *whole.mutable_query() = Floats({1, 1, 16}, {q.begin() + row * 16, q.begin() + (row + 1) * 16});
    *whole.mutable_key() = Floats({1, static_cast<int64_t>(keys.size()) / 16, 16}, keys);
    absl::StatusOr<v1::AttendResponse> want = client().Attend(whole);
    ASSERT_THAT(want, IsOk());
    ExpectNear({out.begin() + row * 16, out.begin() + (row + 1) * 16}, Output(*want), 1e-5f);
  }
  Close({"ragged-a", "ragged-b"});
}

// Rank 4, 4 query heads over 2 key/value heads.
TEST_F(SessionServiceTest, GroupedQueryHeads) {
  const std::vector<float> k0 = RandomValues(2 * 5 * 8, 20), q0 = RandomValues(4 * 5 * 8, 21);
  v1::AttendRequest r;
  *r.mutable_query() = Floats({1, 4, 5, 8}, q0);
  *r.mutable_key() = Floats({1, 2, 5, 8}, k0);
  r.mutable_session()->add_ids("gqa");
  r.mutable_session()->add_positions(0);
  r.mutable_session()->set_create(true);
  ASSERT_THAT(client().Attend(r), IsOk());
  const std::vector<float> q = RandomValues(4 * 8, 22), k = RandomValues(2 * 8, 23);
  v1::AttendRequest step;
  *step.mutable_query() = Floats({1, 4, 1, 8}, q);
  *step.mutable_key() = Floats({1, 2, 1, 8}, k);
  step.mutable_session()->add_ids("gqa");
  step.mutable_session()->add_positions(5);
  absl::StatusOr<v1::AttendResponse> got = client().Attend(step);
  ASSERT_THAT(got, IsOk());
  std::vector<float> keys;
  for (int h = 0; h < 2; ++h) {
    keys.insert(keys.end(), k0.begin() + h * 40, k0.begin() + (h + 1) * 40);
    keys.insert(keys.end(), k.begin() + h * 8, k.begin() + (h + 1) * 8);
  }
  v1::AttendRequest whole = step;
  whole.clear_session();
  *whole.mutable_key() = Floats({1, 2, 6, 8}, keys);
  absl::StatusOr<v1::AttendResponse> want = client().Attend(whole);
  ASSERT_THAT(want, IsOk());
  ExpectNear(Output(*got), Output(*want), 1e-5f);
  absl::StatusOr<v1::SessionInfo> info = Info("gqa");
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->heads(), 4);
  EXPECT_EQ(info->kv_heads(), 2);
  Close({"gqa"});
}

// A model layer caches its projections; bias_k / bias_v and the zero key
// come after every cached row, as in torch.
TEST_F(SessionServiceTest, ModelLayerStepsEqualTheLayerOverEveryRow) {
  Rows inputs{8, {}};
  uint32_t seed = 30;
  for (int64_t rows : {6, 1, 1}) {
    const std::vector<float> x = RandomValues(rows * 8, seed++);
    v1::AttendRequest r;
    r.set_model("layer");
    *r.mutable_query() = Floats({1, rows, 8}, x);
    r.mutable_mask()->set_causal(v1::Mask::BOTTOM_RIGHT);
    r.mutable_session()->add_ids("layer-session");
    r.mutable_session()->add_positions(inputs.length());
    r.mutable_session()->set_create(inputs.length() == 0);
    absl::StatusOr<v1::AttendResponse> got = client().Attend(r);
    ASSERT_THAT(got, IsOk());
    inputs.values.insert(inputs.values.end(), x.begin(), x.end());
    v1::AttendRequest whole = r;
    whole.clear_session();
    *whole.mutable_key() = inputs.Tensor();
    absl::StatusOr<v1::AttendResponse> want = client().Attend(whole);
    ASSERT_THAT(want, IsOk());
    ExpectNear(Output(*got), Output(*want), 1e-5f);
  }
  // Another kind of request on it is refused, naming what it belongs to.
  v1::AttendRequest raw = Step("layer-session", 8, RandomValues(16, 39));
  EXPECT_THAT(client().Attend(raw), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr("belongs to model \"layer\"")));
  Close({"layer-session"});
}

TEST_F(SessionServiceTest, EveryErrorNamesTheSessionAndChangesNothing) {
  const std::vector<float> rows = RandomValues(5 * 16, 40);
  ASSERT_THAT(client().Attend(Step("errors", 0, rows, true)), IsOk());
  absl::StatusOr<v1::SessionInfo> before = Info("errors");
  ASSERT_THAT(before, IsOk());
  const std::vector<float> one = RandomValues(16, 41);
  struct Case {
    const char* name;
    v1::AttendRequest request;
    absl::StatusCode code;
    const char* message;
  };
  std::vector<Case> cases = {
      {"unknown", Step("nobody", 0, one), absl::StatusCode::kNotFound,
       "session \"nobody\" is not open"},
      {"exists", Step("errors", 0, one, true), absl::StatusCode::kAlreadyExists,
       "session \"errors\" is already open (position 5)"},
      {"position", Step("errors", 4, one), absl::StatusCode::kAborted,
       "the request is for position 4, the session holds 5 rows"},
      {"heads", Step("errors", 5, one), absl::StatusCode::kInvalidArgument,
       "num_heads: session \"errors\" belongs to raw attention with 2 query heads, score "
       "SCALED_DOT scale 0.35355338; this request has 4 query heads"},
      {"mask", Step("errors", 5, one), absl::StatusCode::kInvalidArgument, "mask.causal: TOP_LEFT"},
      {"ids", Step("errors", 5, one), absl::StatusCode::kInvalidArgument,
       "session.ids: 2 ids do not match the batch size 1"},
      {"dtype", Step("errors", 5, one), absl::StatusCode::kInvalidArgument,
       "session.cache_dtype: session \"errors\" stores FLOAT32"},
      {"value dim", Step("errors", 5, one), absl::StatusCode::kInvalidArgument,
       "value: session.ids[0]'s session holds 2 key/value heads of 8 (keys) and 8 (values); "
       "this request has 2 of 8 and 3"},
  };
  cases[3].request.set_num_heads(4);
  cases[4].request.mutable_mask()->set_causal(v1::Mask::TOP_LEFT);
  cases[5].request.mutable_session()->add_ids("other");
  cases[5].request.mutable_session()->add_positions(0);
  cases[6].request.mutable_session()->set_cache_dtype(v1::Tensor::BFLOAT16);
  *cases[7].request.mutable_key() = Floats({1, 1, 16}, one);
  *cases[7].request.mutable_value() = Floats({1, 1, 6}, RandomValues(6, 44));
  for (const Case& c : cases) {
    const double total = AttendLatencyCount(server_->server(), "total");
    const double queued = AttendLatencyCount(server_->server(), "queue");
    const double computed = AttendLatencyCount(server_->server(), "compute");
    EXPECT_THAT(client().Attend(c.request), StatusIs(c.code, HasSubstr(c.message))) << c.name;
    // Counted as a call, neither queued nor computed.
    EXPECT_EQ(AttendLatencyCount(server_->server(), "total"), total + 1) << c.name;
    EXPECT_EQ(AttendLatencyCount(server_->server(), "queue"), queued) << c.name;
    EXPECT_EQ(AttendLatencyCount(server_->server(), "compute"), computed) << c.name;
    absl::StatusOr<v1::SessionInfo> after = Info("errors");
    ASSERT_THAT(after, IsOk()) << c.name;
    EXPECT_EQ(after->position(), before->position()) << c.name;
    EXPECT_EQ(after->bytes(), before->bytes()) << c.name;
  }
  // The score named with its default scale is the session's; another is not.
  v1::AttendRequest scaled = Step("errors", 5, one);
  scaled.mutable_session()->set_read_only(true);
  scaled.mutable_score()->set_kind(v1::Score::SCALED_DOT);
  scaled.mutable_score()->set_scale(1 / std::sqrt(8.0f));
  EXPECT_THAT(client().Attend(scaled), IsOk());
  scaled.mutable_score()->set_scale(0.5f);
  EXPECT_THAT(client().Attend(scaled),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("score: session \"errors\" belongs to raw attention with 2 query "
                                 "heads, score SCALED_DOT scale 0.35355338; this request's is "
                                 "SCALED_DOT scale 0.5")));
  // Compared by value in float32, as computed: not as six digits of text,
  // which took 1.0000004 for 1 and a named default bandwidth for another.
  v1::AttendRequest gauss = Step("gauss", 0, one, true);
  gauss.mutable_score()->set_kind(v1::Score::GAUSSIAN);
  ASSERT_THAT(client().Attend(gauss), IsOk());
  gauss = Step("gauss", 1, one);
  gauss.mutable_session()->set_read_only(true);
  gauss.mutable_score()->set_kind(v1::Score::GAUSSIAN);
  gauss.mutable_score()->set_bandwidth(1.0);
  gauss.mutable_score()->set_scale(1.0);
  EXPECT_THAT(client().Attend(gauss), IsOk());
  gauss.mutable_score()->set_bandwidth(1.000004);
  EXPECT_THAT(client().Attend(gauss),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("score GAUSSIAN scale 1 bandwidth 1; this request's is GAUSSIAN "
                                 "scale 1 bandwidth 1.000004")));
  gauss.mutable_score()->set_bandwidth(1.0);
  gauss.mutable_score()->set_scale(1.0000004);
  EXPECT_THAT(client().Attend(gauss),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("this request's is GAUSSIAN scale 1.0000004 bandwidth 1")));
  // A failed create leaves no session behind.
  v1::AttendRequest bad_create = Step("never", 0, one, true);
  bad_create.mutable_mask()->set_causal(v1::Mask::TOP_LEFT);
  EXPECT_THAT(client().Attend(bad_create), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("TOP_LEFT")));
  EXPECT_THAT(Info("never"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"never\"")));
  EXPECT_THAT(Info(""), StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("id: 0 bytes; an id has 1 to 128")));
  // A failed request asking to close leaves the session open.
  v1::AttendRequest failed_close = Step("errors", 5, one);
  failed_close.mutable_mask()->set_causal(v1::Mask::TOP_LEFT);
  failed_close.mutable_session()->set_close(true);
  EXPECT_THAT(client().Attend(failed_close), StatusIs(absl::StatusCode::kInvalidArgument,
                                                      HasSubstr("TOP_LEFT")));
  ASSERT_THAT(Info("errors"), IsOk());
  // close: answered, then gone.
  v1::AttendRequest last = Step("errors", 5, one);
  last.mutable_session()->set_close(true);
  ASSERT_THAT(client().Attend(last), IsOk());
  EXPECT_THAT(Info("errors"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"errors\"")));
  const v1::CloseSessionsResponse closed = Close({"errors", "nobody"});
  EXPECT_THAT(closed.not_found(), ElementsAre("errors", "nobody"));
  // An id no session could have fails CloseSessions as it fails GetSession,
  // and the valid ids beside it stay open.
  ASSERT_THAT(client().Attend(Step("open", 0, RandomValues(3 * 16, 44), true)), IsOk());
  for (const std::string& bad : {std::string(), std::string(129, 'x')}) {
    grpc::ClientContext context;
    v1::CloseSessionsRequest request;
    request.add_ids("open");
    request.add_ids(bad);
    v1::CloseSessionsResponse response;
    const grpc::Status status = Stub()->CloseSessions(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(),
                HasSubstr(absl::StrCat("ids[1]: ", bad.size(), " bytes; an id has 1 to 128")));
    EXPECT_THAT(Info("open"), IsOk());
  }
}

// A step that names a cache dtype must name the session's; FLOAT32 counts
// though it is the field's default value (the field has presence).
TEST_F(SessionServiceTest, AStepNamingACacheDtypeMustNameTheSessions) {
  const std::vector<float> one = RandomValues(16, 42);
  v1::AttendRequest create = Step("bf16", 0, RandomValues(3 * 16, 43), true);
  create.mutable_session()->set_cache_dtype(v1::Tensor::BFLOAT16);
  ASSERT_THAT(client().Attend(create), IsOk());
  v1::AttendRequest float32 = Step("bf16", 3, one);
  float32.mutable_session()->set_cache_dtype(v1::Tensor::FLOAT32);
  EXPECT_THAT(client().Attend(float32),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("session.cache_dtype: session \"bf16\" stores BFLOAT16")));
  absl::StatusOr<v1::SessionInfo> info = Info("bf16");
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->position(), 3);
  v1::AttendRequest named = Step("bf16", 3, one);
  named.mutable_session()->set_cache_dtype(v1::Tensor::BFLOAT16);
  EXPECT_THAT(client().Attend(named), IsOk());
  EXPECT_THAT(client().Attend(Step("bf16", 4, one)), IsOk());  // left out
  EXPECT_THAT(Close({"bf16"}).closed(), ElementsAre("bf16"));
}

// A read-only step has no rows of its own: its keys are the session's, of
// their own dim (6 here, against the query's 4, through a bilinear score).
TEST_F(SessionServiceTest, ReadOnlyStepsTakeTheSessionsKeyDim) {
  v1::AttendRequest create;
  *create.mutable_query() = Floats({1, 3, 4}, RandomValues(12, 80));
  const std::vector<float> k = RandomValues(18, 81), v = RandomValues(18, 82);
  *create.mutable_key() = Floats({1, 3, 6}, k);
  *create.mutable_value() = Floats({1, 3, 6}, v);
  create.mutable_score()->set_kind(v1::Score::BILINEAR);
  *create.mutable_score()->mutable_w() = Floats({4, 6}, RandomValues(24, 83));
  create.mutable_session()->add_ids("bilinear");
  create.mutable_session()->add_positions(0);
  create.mutable_session()->set_create(true);
  ASSERT_THAT(client().Attend(create), IsOk());
  v1::AttendRequest read = create;
  read.clear_key();
  read.clear_value();
  *read.mutable_query() = Floats({1, 1, 4}, RandomValues(4, 84));
  read.mutable_session()->set_create(false);
  read.mutable_session()->set_positions(0, 3);
  read.mutable_session()->set_read_only(true);
  absl::StatusOr<v1::AttendResponse> got = client().Attend(read);
  ASSERT_THAT(got, IsOk());
  v1::AttendRequest whole = read;
  whole.clear_session();
  *whole.mutable_key() = Floats({1, 3, 6}, k);
  *whole.mutable_value() = Floats({1, 3, 6}, v);
  absl::StatusOr<v1::AttendResponse> want = client().Attend(whole);
  ASSERT_THAT(want, IsOk());
  ExpectNear(Output(*got), Output(*want), 1e-5f);
  // A read-only request with a key is refused before its shapes are read
  // (a 0-d key here, which has none of the query's dims).
  v1::AttendRequest keyed = read;
  *keyed.mutable_key() = Floats({}, {1.0f});
  EXPECT_THAT(client().Attend(keyed),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("key: must be absent with session.read_only")));
  ASSERT_THAT(client().Attend(read), IsOk());  // and the server still serves
  // A read-only query of another rank is refused before it waits for its session.
  *read.mutable_query() = Floats({4}, RandomValues(4, 85));
  EXPECT_THAT(client().Attend(read),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("query: rank 1")));
  Close({"bilinear"});
}

// Several threads step one session, each retrying on ABORTED with the
// position the session reached: every step is applied once, one at a time.
// session.step_id travels to GetSession's last_step_id, over Attend and
// over a stream; a read-only request leaves it, and an over-long one is
// INVALID_ARGUMENT naming the field.
TEST_F(SessionServiceTest, GetSessionNamesTheLastStepThatAppended) {
  const std::vector<float> rows = RandomValues(2 * 16, 90);
  v1::AttendRequest create = Step("stepped", 0, rows, /*create=*/true);
  create.mutable_session()->set_step_id("first");
  ASSERT_THAT(client().Attend(create), IsOk());
  EXPECT_EQ(Info("stepped")->last_step_id(), "first");

  v1::AttendRequest read = Step("stepped", 2, rows);
  read.clear_key();
  read.mutable_session()->set_read_only(true);
  read.mutable_session()->set_step_id("reading");
  ASSERT_THAT(client().Attend(read), IsOk());
  EXPECT_EQ(Info("stepped")->last_step_id(), "first");

  v1::AttendRequest step = Step("stepped", 2, rows);
  step.mutable_session()->set_step_id(std::string(129, 's'));
  EXPECT_THAT(client().Attend(step), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr("session.step_id: 129 bytes")));
  step.mutable_session()->set_step_id("second");
  grpc::ClientContext context;
  auto stream = Stub()->AttendStream(&context);
  v1::AttendResponse answer;
  ASSERT_TRUE(stream->Write(step) && stream->Read(&answer));
  EXPECT_EQ(answer.status().code(), 0) << answer.status().message();
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  absl::StatusOr<v1::SessionInfo> info = Info("stepped");
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->position(), 4);
  EXPECT_EQ(info->last_step_id(), "second");
  Close({"stepped"});
}

TEST_F(SessionServiceTest, ConcurrentStepsOnOneSessionApplyOneAtATime) {
  ASSERT_THAT(client().Attend(Step("shared", 0, RandomValues(4 * 16, 50), true)), IsOk());
  constexpr int kThreads = 4, kSteps = 8;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int s = 0; s < kSteps; ++s) {
        const std::vector<float> row = RandomValues(16, 100 * t + s);
        for (int attempt = 0;; ++attempt) {
          absl::StatusOr<v1::SessionInfo> info = Info("shared");
          if (!info.ok() || attempt > 200) {
            ++failures;
            return;
          }
          absl::StatusOr<v1::AttendResponse> r = client().Attend(Step("shared", info->position(), row));
          if (r.ok()) break;
          if (r.status().code() != absl::StatusCode::kAborted) {
            ++failures;
            return;
          }
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  absl::StatusOr<v1::SessionInfo> info = Info("shared");
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->position(), 4 + kThreads * kSteps);
  Close({"shared"});
}

// The client library's Session keeps the rows it sent: a session the server
// lost (closed behind its back here) is recreated from them, and the step's
// answer is the same as if nothing had happened.
TEST_F(SessionServiceTest, ClientSessionRecreatesALostSession) {
  client::SessionOptions options;
  options.id = "kept";
  options.request.set_num_heads(2);
  options.request.mutable_mask()->set_causal(v1::Mask::BOTTOM_RIGHT);
  options.keep_rows = true;
  absl::StatusOr<std::unique_ptr<client::Session>> session =
      client::Session::Create(&client(), options);
  ASSERT_THAT(session, IsOk());
  Rows keys{16, {}};
  uint32_t seed = 80;
  for (int64_t rows : {9, 1, 1, 1}) {
    if (rows == 1 && keys.length() == 11) {
      EXPECT_THAT(Close({"kept"}).closed(), ElementsAre("kept"));  // lost
    }
    const std::vector<float> x = RandomValues(rows * 16, seed++);
    absl::StatusOr<v1::AttendResponse> got = (*session)->Step(Floats({1, rows, 16}, x));
    ASSERT_THAT(got, IsOk());
    keys.values.insert(keys.values.end(), x.begin(), x.end());
    EXPECT_EQ((*session)->position(), keys.length());
    v1::AttendRequest whole = options.request;
    *whole.mutable_query() = Floats({1, rows, 16}, x);
    *whole.mutable_key() = keys.Tensor();
    absl::StatusOr<v1::AttendResponse> want = client().Attend(whole);
    ASSERT_THAT(want, IsOk());
    ExpectNear(Output(*got), Output(*want), 1e-5f);
  }
  EXPECT_EQ((*session)->recreations(), 1);
  absl::StatusOr<v1::SessionInfo> info = Info("kept");
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->position(), 12);
  EXPECT_THAT((*session)->Close(), IsOk());
  EXPECT_THAT(Info("kept"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"kept\"")));
}

TEST_F(SessionServiceTest, StreamsCarrySessions) {
  grpc::ClientContext context;
  auto stream = Stub()->AttendStream(&context);
  v1::AttendRequest r = Step("streamed", 0, RandomValues(3 * 16, 60), true);
  r.set_id("first");
  ASSERT_TRUE(stream->Write(r));
  v1::AttendResponse answer;
  ASSERT_TRUE(stream->Read(&answer));
  EXPECT_EQ(answer.status().code(), 0) << answer.status().message();
  EXPECT_THAT(answer.session_positions(), ElementsAre(3));
  r = Step("streamed", 2, RandomValues(16, 61));
  r.set_id("stale");
  ASSERT_TRUE(stream->Write(r));
  ASSERT_TRUE(stream->Read(&answer));
  EXPECT_EQ(answer.status().code(), static_cast<int>(grpc::StatusCode::ABORTED));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  Close({"streamed"});
}

// Steps of one session sent back to back on a stream are answered in their
// order: a large step's answer comes before the small step that waited for
// it, which computes much faster (its answer used to overtake the large
// one's, so positions went backwards in the order they arrived).
TEST_F(SessionServiceTest, AStreamAnswersASessionsStepsInTheirOrder) {
  // Rows of 8 heads of 64 for session `id` at `position`.
  const auto step = [](const std::string& id, int64_t position, int64_t rows, bool create,
                       const std::string& name) {
    v1::AttendRequest r;
    r.set_id(name);
    *r.mutable_query() = Floats({1, 8, rows, 64}, RandomValues(8 * rows * 64, position + 80));
    if (rows > 1 && !create) r.mutable_mask()->set_causal(v1::Mask::BOTTOM_RIGHT);
    r.mutable_session()->add_ids(id);
    r.mutable_session()->add_positions(position);
    r.mutable_session()->set_create(create);
    return r;
  };
  for (int round = 0; round < 5; ++round) {
    SCOPED_TRACE(round);
    const std::string id = absl::StrCat("ordered", round);
    grpc::ClientContext context;
    auto stream = Stub()->AttendStream(&context);
    ASSERT_TRUE(stream->Write(step(id, 0, 16, true, "create")));
    ASSERT_TRUE(stream->Write(step(id, 16, 1024, false, "large")));
    ASSERT_TRUE(stream->Write(step(id, 1040, 1, false, "small0")));
    ASSERT_TRUE(stream->Write(step(id, 1041, 1, false, "small1")));
    stream->WritesDone();
    std::vector<std::string> ids;
    std::vector<int64_t> positions;
    v1::AttendResponse answer;
    while (stream->Read(&answer)) {
      EXPECT_EQ(answer.status().code(), 0) << answer.id() << ": " << answer.status().message();
      ids.push_back(answer.id());
      positions.push_back(answer.session_positions_size() > 0 ? answer.session_positions(0) : -1);
    }
    EXPECT_TRUE(stream->Finish().ok());
    EXPECT_THAT(ids, ElementsAre("create", "large", "small0", "small1"));
    EXPECT_THAT(positions, ElementsAre(16, 1040, 1041, 1042));
    Close({id});
  }
}

// A small cap: idle sessions are evicted, least recently used first; a
// request needing more than the cap is refused with the numbers; idle ones
// expire; closing gives the bytes back.
TEST(SessionLimitsTest, EvictionExpiryAndMemory) {
  ServerOptions options;
  options.session_memory_mb = 1;
  // Long enough that none expires while the first five are created, even
  // on a slow, loaded machine.
  options.session_idle_seconds = 5;
  absl::StatusOr<std::unique_ptr<TestServer>> server = TestServer::Start(options);
  ASSERT_THAT(server, IsOk());
  client::AttentionClient& c = (*server)->client();
  auto request = [](const std::string& id, int64_t rows, int64_t dim) {
    v1::AttendRequest r;
    *r.mutable_query() = Floats({1, rows, dim}, RandomValues(rows * dim, 70));
    r.mutable_session()->add_ids(id);
    r.mutable_session()->add_positions(0);
    r.mutable_session()->set_create(true);
    return r;
  };
  // 248 KiB each (64 rows x (124 + 124) floats x 4 bytes x 4 blocks), and
  // 1 KiB and its id of bookkeeping: four fit in the MiB, five do not.
  for (int i = 0; i < 4; ++i) {
    ASSERT_THAT(c.Attend(request(absl::StrCat("s", i), 256, 124)), IsOk());
  }
  ASSERT_THAT(c.Attend(request("s4", 256, 124)), IsOk());
  auto stub = v1::AttentionService::NewStub(c.channel());
  auto info = [&](const std::string& id) {
    grpc::ClientContext context;
    v1::GetSessionRequest r;
    r.set_id(id);
    v1::SessionInfo out;
    return stub->GetSession(&context, r, &out).error_code();
  };
  EXPECT_EQ(info("s0"), grpc::StatusCode::NOT_FOUND);  // the least recently used
  EXPECT_EQ(info("s4"), grpc::StatusCode::OK);
  // The cache is full: a step on s4 (one more block) would evict s1, but
  // this one, whose mask the engine refuses for sessions, is refused first
  // and evicts nothing.
  v1::AttendRequest top_left = request("s4", 1, 124);
  top_left.mutable_session()->set_create(false);
  top_left.mutable_session()->set_positions(0, 256);
  top_left.mutable_mask()->set_causal(v1::Mask::TOP_LEFT);
  EXPECT_THAT(c.Attend(top_left),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("mask.causal: TOP_LEFT")));
  EXPECT_EQ(info("s1"), grpc::StatusCode::OK);
  EXPECT_THAT(c.Attend(request("huge", 2048, 128)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("all sessions may hold (--session_memory_mb)")));
  EXPECT_EQ(info("s4"), grpc::StatusCode::OK);  // a refused request evicts nothing it cannot use
  absl::SleepFor(absl::Seconds(5.5));
  EXPECT_EQ(info("s4"), grpc::StatusCode::NOT_FOUND);  // expired
  // The others, idle about as long, are the sweeper's, once a second; their
  // caches' bytes go with them.
  std::string metrics = (*server)->server().metrics().RenderPrometheus();
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (!absl::StrContains(metrics, "\nattention_sessions_open 0\n") && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(20));
    metrics = (*server)->server().metrics().RenderPrometheus();
  }
  EXPECT_THAT(metrics, HasSubstr("\nattention_session_cache_bytes 0\n"));
  EXPECT_THAT(metrics, HasSubstr("\nattention_sessions_open 0\n"));
  EXPECT_THAT(metrics, HasSubstr("attention_sessions_ended_total{reason=\"evicted\"} 1\n"));
  EXPECT_THAT(metrics, HasSubstr("attention_sessions_ended_total{reason=\"expired\"} 4\n"));
}

// With sessions off every session call says so, rather than NOT_FOUND
// (which tells a caller to recreate the session).
TEST(SessionLimitsTest, SessionsOffAreAFailedPrecondition) {
  ServerOptions options;
  options.session_memory_mb = 0;
  absl::StatusOr<std::unique_ptr<TestServer>> server = TestServer::Start(options);
  ASSERT_THAT(server, IsOk());
  client::AttentionClient& c = (*server)->client();
  v1::AttendRequest r;
  *r.mutable_query() = Floats({1, 1, 4}, RandomValues(4, 95));
  r.mutable_session()->add_ids("s");
  r.mutable_session()->add_positions(0);
  r.mutable_session()->set_create(true);
  EXPECT_THAT(c.Attend(r), StatusIs(absl::StatusCode::kFailedPrecondition,
                                    HasSubstr("session: sessions are off on this server")));
  auto stub = v1::AttentionService::NewStub(c.channel());
  grpc::ClientContext info_context;
  v1::GetSessionRequest info_request;
  info_request.set_id("s");
  v1::SessionInfo info;
  const grpc::Status got = stub->GetSession(&info_context, info_request, &info);
  EXPECT_EQ(got.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(got.error_message(), HasSubstr("id: sessions are off on this server"));
  grpc::ClientContext close_context;
  v1::CloseSessionsRequest close_request;
  close_request.add_ids("s");
  v1::CloseSessionsResponse closed;
  EXPECT_EQ(stub->CloseSessions(&close_context, close_request, &closed).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
}

// A session request's memory is its cost over the session's rows: weights
// over 20,000 cached keys pass a 4 MiB budget, as the stateless call's do.
TEST(SessionLimitsTest, SessionRequestsKeepToTheMemoryBudget) {
  ServerOptions options;
  options.memory_budget_mb = 4;
  absl::StatusOr<std::unique_ptr<TestServer>> server = TestServer::Start(options);
  ASSERT_THAT(server, IsOk());
  client::AttentionClient& c = (*server)->client();
  // One query row over the 20,000 appended keys: a self-attention create
  // would compute 20,000 x 20,000 scores, which takes TSan's single-threaded
  // build longer than the client's deadline, and the check is not about it.
  v1::AttendRequest create;
  *create.mutable_query() = Floats({1, 1, 4}, RandomValues(4, 92));
  *create.mutable_key() = Floats({1, 20000, 4}, RandomValues(80000, 90));
  *create.mutable_value() = Floats({1, 20000, 4}, RandomValues(80000, 93));
  create.mutable_session()->add_ids("long");
  create.mutable_session()->add_positions(0);
  create.mutable_session()->set_create(true);
  ASSERT_THAT(c.Attend(create), IsOk());
  v1::AttendRequest read;
  *read.mutable_query() = Floats({1, 64, 4}, RandomValues(256, 91));
  read.set_need_weights(true);
  read.mutable_session()->add_ids("long");
  read.mutable_session()->add_positions(20000);
  read.mutable_session()->set_read_only(true);
  EXPECT_THAT(c.Attend(read), StatusIs(absl::StatusCode::kResourceExhausted,
                                       HasSubstr("more than the server's whole memory budget")));
  read.set_need_weights(false);
  EXPECT_THAT(c.Attend(read), IsOk());
}

}  // namespace
}  // namespace attention::testing
