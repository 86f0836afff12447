// Thresholds, the report's formats, and the workload and --verify checks.

#include "client/loadtest/report.h"

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_split.h"
#include "client/loadtest/stats.h"
#include "client/loadtest/thresholds.h"
#include "client/loadtest/workload.h"
#include "client/tensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/loadtest/known_stats.h"
#include "tests/status_matchers.h"

namespace attention::loadtest {
namespace {

using ::attention::testing::IsOk;
using ::attention::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Optional;

std::vector<ThresholdResult> Evaluate(const std::vector<std::string>& texts) {
  std::vector<Threshold> thresholds;
  for (const std::string& text : texts) {
    absl::StatusOr<Threshold> threshold = ParseThreshold(text);
    EXPECT_THAT(threshold, IsOk()) << text;
    if (threshold.ok()) thresholds.push_back(*threshold);
  }
  return EvaluateThresholds(thresholds, KnownStats());
}

TEST(ThresholdTest, ParsesLatencyErrorAndThroughputGates) {
  absl::StatusOr<Threshold> p99 = ParseThreshold("p99<20ms");
  ASSERT_TRUE(p99.ok()) << p99.status();
  EXPECT_EQ(p99->metric, Threshold::Metric::kLatencyQuantile);
  EXPECT_DOUBLE_EQ(p99->quantile, 0.99);
  EXPECT_DOUBLE_EQ(p99->bound, 20e6);
  EXPECT_DOUBLE_EQ(ParseThreshold("p99.99 <= 1.5s")->quantile, 0.9999);
  EXPECT_EQ(ParseThreshold("p99.99 <= 1.5s")->op, Threshold::Op::kLessOrEqual);
  EXPECT_DOUBLE_EQ(ParseThreshold("max<250us")->bound, 250e3);
  EXPECT_EQ(ParseThreshold("mean<5ns")->metric, Threshold::Metric::kLatencyMean);
  EXPECT_EQ(ParseThreshold("errors<0.1%")->metric, Threshold::Metric::kErrorFraction);
  EXPECT_DOUBLE_EQ(ParseThreshold("errors<0.1%")->bound, 0.001);
  EXPECT_EQ(ParseThreshold("errors<5")->metric, Threshold::Metric::kErrorCount);
  EXPECT_EQ(ParseThreshold("rps>=1000")->op, Threshold::Op::kGreaterOrEqual);
}

// A bad text and what the error must say about it.
using BadInput = std::pair<std::string, std::string>;

class ThresholdRejectsTest : public ::testing::TestWithParam<BadInput> {};

TEST_P(ThresholdRejectsTest, SaysWhy) {
  EXPECT_THAT(ParseThreshold(GetParam().first),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(GetParam().second)));
}

INSTANTIATE_TEST_SUITE_P(BadThresholds, ThresholdRejectsTest,
                         ::testing::Values(BadInput{"p99", "want METRIC<VALUE"},
                                           BadInput{"p99<20", "not a latency with a unit"},
                                           BadInput{"p99<fast", "not a latency with a unit"},
                                           BadInput{"p100<1s", "unknown metric"},
                                           BadInput{"latency<1s", "unknown metric"},
                                           BadInput{"errors<some", "errors takes a count"},
                                           BadInput{"rps>many", "rps takes a number"}));

TEST(ThresholdTest, BrokenThresholdsSayWhichAndExitWithTwo) {
  const std::vector<ThresholdResult> results = Evaluate(
      {"p99<20ms", "p99.9<20ms", "errors<1%", "errors<5", "rps>400", "max<=100ms", "rps>=498"});
  ASSERT_EQ(results.size(), 7u);
  EXPECT_TRUE(results[0].passed) << results[0].Describe();  // p99 is 1 ms
  EXPECT_FALSE(results[1].passed);                          // p99.9 is 100 ms
  EXPECT_NEAR(results[1].value, 100e6, 1e6);
  EXPECT_THAT(results[1].Describe(), HasSubstr("p99.9<20ms: p99.9 is 99.88ms"));
  EXPECT_TRUE(results[2].passed);   // 0.5%
  EXPECT_FALSE(results[3].passed);  // 5 errors, not fewer than 5
  EXPECT_THAT(results[3].Describe(), HasSubstr("errors are 5"));
  EXPECT_TRUE(results[4].passed) << results[4].Describe();  // 500/s
  EXPECT_TRUE(results[5].passed) << results[5].Describe();
  // 500 answers/s, but 5 of the 1000 failed: 497.5 OK.
  EXPECT_FALSE(results[6].passed);
  EXPECT_THAT(results[6].Describe(), HasSubstr("rps>=498: rps is 497.5 (answered OK)"));
  EXPECT_EQ(ThresholdExitCode(results), kExitThreshold);
  EXPECT_EQ(ThresholdExitCode(Evaluate({"p50<2ms", "errors<=5"})), kExitOk);
  EXPECT_EQ(ThresholdExitCode({}), kExitOk);
}

// A run that measured no call (every session's prefill failed) has an empty
// histogram, whose 0 would pass any `<` gate, and an error fraction of 0 of 0:
// a latency or error-fraction gate breaks instead.
TEST(ThresholdTest, LatencyAndErrorFractionGatesBreakWhenNoCallWasMeasured) {
  std::vector<Threshold> thresholds;
  for (const char* text :
       {"p99<20ms", "max<1ms", "mean<=1s", "p50>=0ns", "errors<0.1%", "errors<5"}) {
    thresholds.push_back(*ParseThreshold(text));
  }
  const std::vector<ThresholdResult> results = EvaluateThresholds(thresholds, LoadStats());
  ASSERT_EQ(results.size(), 6u);
  for (int i = 0; i < 5; ++i) {
    EXPECT_FALSE(results[i].passed) << results[i].Describe();
    EXPECT_FALSE(results[i].measured) << results[i].Describe();
  }
  EXPECT_EQ(results[0].Describe(), "p99<20ms: no measured call");
  EXPECT_EQ(results[1].Describe(), "max<1ms: no measured call");
  EXPECT_EQ(results[4].Describe(), "errors<0.1%: no measured call");
  EXPECT_TRUE(results[5].passed) << results[5].Describe();  // no call failed either
  EXPECT_EQ(ThresholdExitCode(results), kExitThreshold);
  Report report;
  report.thresholds = results;
  EXPECT_THAT(FormatSummary(report), HasSubstr("BROKEN: p99<20ms: no measured call"));
}

TEST(ReportTest, JsonHasTheKeysCiScriptsRead) {
  Report report;
  report.stats = KnownStats();
  report.thresholds = Evaluate({"p99<20ms"});
  const nlohmann::json json = nlohmann::json::parse(FormatJson(report));
  EXPECT_DOUBLE_EQ(json["throughput_rps"].get<double>(), 500);
  EXPECT_EQ(json["requests"], 1000);
  EXPECT_EQ(json["errors"]["UNAVAILABLE"], 5);
  EXPECT_EQ(json["error_count"], 5);
  for (const char* histogram : {"latency_us", "uncorrected_latency_us"}) {
    for (const char* key : {"p50", "p90", "p99", "p99.9", "p99.99", "max"}) {
      EXPECT_TRUE(json[histogram].contains(key)) << histogram << "." << key;
    }
  }
  EXPECT_NEAR(json["latency_us"]["p99"].get<double>(), 1000, 10);
  EXPECT_DOUBLE_EQ(json["latency_us"]["max"].get<double>(), 100'000);
  EXPECT_EQ(json["batch_sizes"]["4"], 95);
  EXPECT_DOUBLE_EQ(json["cpu"]["percent_of_machine"].get<double>(), 15);
  EXPECT_EQ(json["passed"], true);
}

TEST(ReportTest, SummaryNamesErrorsBatchesAndThresholds) {
  Report report;
  report.stats = KnownStats();
  report.thresholds = Evaluate({"p99.9<20ms"});
  const std::string summary = FormatSummary(report);
  EXPECT_THAT(summary, HasSubstr("UNAVAILABLE 5"));
  EXPECT_THAT(summary, HasSubstr("first error    UNAVAILABLE: connection refused"));
  EXPECT_THAT(summary, HasSubstr("4: 95 (9.5%)"));
  EXPECT_THAT(summary, HasSubstr("BROKEN: p99.9<20ms: p99.9 is 99.88ms"));
  EXPECT_THAT(summary, HasSubstr("15.0% of 2 cores"));
}

TEST(ReportTest, CsvRowMatchesTheHeader) {
  Report report;
  report.stats = KnownStats();
  report.run.emplace();
  report.run->open_loop = true;
  report.run->schedule = "rate:500@2s";
  report.run->target_rps = 500;
  const std::vector<std::string> header = absl::StrSplit(CsvHeader(), ',');
  const std::vector<std::string> row = absl::StrSplit(CsvRow(report), ',');
  ASSERT_EQ(row.size(), header.size());
  EXPECT_EQ(header[0], "schedule");
  EXPECT_EQ(row[0], "\"rate:500@2s\"");
  EXPECT_EQ(header[6], "throughput_rps");
  EXPECT_EQ(row[6], "500.00");
}

TEST(FormatLatencyTest, PicksAReadableUnit) {
  EXPECT_EQ(FormatLatency(512), "512ns");
  EXPECT_EQ(FormatLatency(1'500), "1.50us");
  EXPECT_EQ(FormatLatency(512'000), "512us");
  EXPECT_EQ(FormatLatency(1'234'000), "1.23ms");
  EXPECT_EQ(FormatLatency(2'500'000'000), "2.50s");
}

// --- workload -------------------------------------------------------------------

std::vector<int64_t> Shape(const v1::Tensor& tensor) {
  return {tensor.shape().begin(), tensor.shape().end()};
}

TEST(WorkloadTest, BuildsASeededRawRequest) {
  ShapeOptions options;
  options.batch = 2;
  options.query_len = 3;
  options.key_len = 5;
  options.embed_dim = 8;
  options.heads = 2;
  options.mask = MaskKind::kKeyPadding;
  options.dtype = v1::Tensor::BFLOAT16;
  options.need_weights = true;
  absl::StatusOr<v1::AttendRequest> request = BuildRequest(options, nullptr);
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_THAT(Shape(request->query()), ElementsAre(2, 3, 8));
  EXPECT_THAT(Shape(request->key()), ElementsAre(2, 5, 8));
  EXPECT_THAT(Shape(request->mask().key_padding_mask()), ElementsAre(2, 5));
  EXPECT_EQ(request->num_heads(), 2);
  EXPECT_EQ(request->query().dtype(), v1::Tensor::BFLOAT16);
  EXPECT_EQ(request->output_dtype(), v1::Tensor::BFLOAT16);

  EXPECT_EQ(BuildRequest(options, nullptr)->SerializeAsString(), request->SerializeAsString())
      << "the same options must give the same bytes";
  options.seed = 2;
  EXPECT_NE(BuildRequest(options, nullptr)->SerializeAsString(), request->SerializeAsString());
}

TEST(WorkloadTest, KvHeadsSendRank4WithGroupedQueryHeads) {
  ShapeOptions options;
  options.query_len = 3;
  options.key_len = 5;
  options.embed_dim = 32;
  options.heads = 8;
  options.kv_heads = 2;
  options.need_weights = true;
  absl::StatusOr<v1::AttendRequest> request = BuildRequest(options, nullptr);
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_THAT(Shape(request->query()), ElementsAre(1, 8, 3, 4));
  EXPECT_THAT(Shape(request->key()), ElementsAre(1, 2, 5, 4));
  EXPECT_THAT(Shape(request->value()), ElementsAre(1, 2, 5, 4));
  EXPECT_EQ(request->num_heads(), 0) << "rank 4 carries its heads in its shape";
  absl::StatusOr<AnswerShapes> shapes = ExpectedShapes(*request, nullptr);
  ASSERT_TRUE(shapes.ok()) << shapes.status();
  EXPECT_THAT(shapes->output, ElementsAre(1, 8, 3, 4));
  EXPECT_THAT(shapes->weights, Optional(ElementsAre(1, 8, 3, 5)));

  options.kv_heads = 3;
  EXPECT_THAT(BuildRequest(options, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--kv_heads 3 does not divide --heads 8")));
  options.kv_heads = -1;
  EXPECT_THAT(BuildRequest(options, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("kv_heads")));
  v1::ModelConfig model;
  model.set_embed_dim(32);
  model.set_num_heads(8);
  options.model = "m";
  options.embed_dim = 0;
  options.kv_heads = 2;
  EXPECT_THAT(BuildRequest(options, &model),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("kv_heads 2 is for raw attention; model m")));
}

TEST(WorkloadTest, ModelRequestsTakeTheModelsDims) {
  v1::ModelConfig model;
  model.set_embed_dim(64);
  model.set_num_heads(4);
  model.set_kdim(32);
  model.set_add_bias_kv(true);
  ShapeOptions options;
  options.model = "m";
  options.key_len = 7;
  options.need_weights = true;
  absl::StatusOr<v1::AttendRequest> request = BuildRequest(options, &model);
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_EQ(request->model(), "m");
  EXPECT_THAT(Shape(request->key()), ElementsAre(1, 7, 32));
  EXPECT_THAT(Shape(request->value()), ElementsAre(1, 7, 64));
  absl::StatusOr<AnswerShapes> shapes = ExpectedShapes(*request, &model);
  ASSERT_TRUE(shapes.ok()) << shapes.status();
  EXPECT_THAT(shapes->output, ElementsAre(1, 16, 64));
  EXPECT_THAT(shapes->weights, Optional(ElementsAre(1, 4, 16, 8)));  // S + bias_kv

  options.embed_dim = 32;
  EXPECT_THAT(BuildRequest(options, &model),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("embed_dim 64")));
}

TEST(WorkloadTest, ExpectedShapesFollowLayoutRankAndBroadcast) {
  v1::AttendRequest request;
  *request.mutable_query() = *client::MakeFloatTensor({1, 4, 6, 8}, std::vector<float>(192));
  *request.mutable_key() = *client::MakeFloatTensor({3, 2, 5, 8}, std::vector<float>(240));
  request.set_need_weights(true);
  absl::StatusOr<AnswerShapes> shapes = ExpectedShapes(request, nullptr);
  ASSERT_TRUE(shapes.ok()) << shapes.status();
  EXPECT_THAT(shapes->output, ElementsAre(3, 4, 6, 8));
  EXPECT_THAT(shapes->weights, Optional(ElementsAre(3, 4, 6, 5)));

  v1::AttendRequest sequence_first;
  sequence_first.set_layout(v1::AttendRequest::SEQUENCE_FIRST);
  sequence_first.set_num_heads(2);
  sequence_first.set_need_weights(true);
  sequence_first.set_average_weights(true);
  *sequence_first.mutable_query() = *client::MakeFloatTensor({6, 2, 4}, std::vector<float>(48));
  shapes = ExpectedShapes(sequence_first, nullptr);
  ASSERT_TRUE(shapes.ok()) << shapes.status();
  EXPECT_THAT(shapes->output, ElementsAre(6, 2, 4));
  EXPECT_THAT(shapes->weights, Optional(ElementsAre(2, 6, 6)));
}

TEST(VerifierTest, CatchesWrongShapesNonFiniteValuesAndWrongValues) {
  AnswerShapes shapes{.output = {1, 2}, .weights = std::nullopt};
  v1::AttendResponse expected;
  *expected.mutable_output() = *client::MakeFloatTensor({1, 2}, {1.0f, 2.0f});
  absl::StatusOr<Verifier> verifier = Verifier::Create(shapes, expected, 1e-3, 0);
  ASSERT_TRUE(verifier.ok()) << verifier.status();

  v1::AttendResponse answer = expected;
  EXPECT_THAT(verifier->Check(answer), IsOk());
  *answer.mutable_output() = *client::MakeFloatTensor({2, 1}, {1.0f, 2.0f});
  EXPECT_THAT(verifier->Check(answer), StatusIs(absl::StatusCode::kFailedPrecondition,
                                                HasSubstr("output: shape [2, 1], want [1, 2]")));
  *answer.mutable_output() =
      *client::MakeFloatTensor({1, 2}, {1.0f, std::numeric_limits<float>::quiet_NaN()});
  EXPECT_THAT(verifier->Check(answer),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("element 1 is nan")));
  *answer.mutable_output() = *client::MakeFloatTensor({1, 2}, {1.0f, 2.1f});
  EXPECT_THAT(verifier->Check(answer),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("expected 2")));
  answer.clear_output();
  EXPECT_THAT(verifier->Check(answer),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no output")));

  EXPECT_THAT(Verifier::Create({.output = {2, 2}, .weights = std::nullopt}, expected, 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected response")));
}

// Weights on one side only would leave them unchecked: the run refuses.
TEST(VerifierTest, RefusesAnExpectedResponseWhoseWeightsDoNotMatchTheRequest) {
  v1::AttendResponse expected;
  *expected.mutable_output() = *client::MakeFloatTensor({1, 2}, {1.0f, 2.0f});
  EXPECT_THAT(Verifier::Create({.output = {1, 2}, .weights = std::vector<int64_t>{1, 1, 1}},
                               expected, 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("expected response: has no weights, but the request asks for "
                                 "them (need_weights)")));

  *expected.mutable_weights() = *client::MakeFloatTensor({1, 1, 1}, {1.0f});
  EXPECT_THAT(Verifier::Create({.output = {1, 2}, .weights = std::nullopt}, expected, 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("expected response: has weights, but the request does not ask "
                                 "for them")));

  absl::StatusOr<Verifier> verifier = Verifier::Create(
      {.output = {1, 2}, .weights = std::vector<int64_t>{1, 1, 1}}, expected, 0, 0);
  ASSERT_TRUE(verifier.ok()) << verifier.status();
  v1::AttendResponse answer = expected;
  EXPECT_THAT(verifier->Check(answer), IsOk());
  *answer.mutable_weights() = *client::MakeFloatTensor({1, 1, 1}, {0.5f});
  EXPECT_THAT(verifier->Check(answer),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("weights")));
}

}  // namespace
}  // namespace attention::loadtest
