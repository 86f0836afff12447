// fuzz::Request: bytes as a client sends them to Attend, through the
// server's own path (ParseMessage, ToEngineRequest, Engine::CostOf) and,
// when they pass, an engine call on both backends, with the demo model from
// models/demo for requests that name it. Small limits keep each call cheap.
//
// Beyond "no crash, leak or UB", it checks what the server relies on: the
// two backends accept and refuse the same requests with the same code and
// answer with the same shapes; a request computed twice in one batch gives
// bit-identical results; an accepted result encodes as an AttendResponse.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"
#include "engine/engine.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "server/convert.h"
#include "server/model_repository.h"
#include "server/response_encoder.h"
#include "tests/fuzz/fuzz_targets.h"

namespace attention::fuzz {
namespace {

// Failed invariant: print and abort, which libFuzzer reports as a crash.
#define FUZZ_CHECK(cond, ...)                                 \
  do {                                                        \
    if (!(cond)) {                                            \
      std::fprintf(stderr, "FUZZ_CHECK(%s) failed: ", #cond); \
      std::fprintf(stderr, __VA_ARGS__);                      \
      std::fprintf(stderr, "\n");                             \
      std::abort();                                           \
    }                                                         \
  } while (0)

struct Fixture {
  std::unique_ptr<Engine> onednn;
  std::unique_ptr<Engine> reference;
  Model demo;
};

EngineOptions SmallOptions(Backend backend) {
  EngineOptions options;
  options.backend = backend;
  options.threads = 1;
  options.max_tensor_elements = 4096;
  options.max_score_elements = 65536;
  // Without weights the score limit no longer bounds the work: these do,
  // so that every input stays fast under the reference backend.
  options.max_request_flops = 1e8;
  options.max_request_bytes = int64_t{64} << 20;
  return options;
}

const Fixture& GetFixture() {
  static const Fixture* fixture = [] {
    auto* f = new Fixture;
    f->onednn = *Engine::Create(SmallOptions(Backend::kOneDnn));
    f->reference = *Engine::Create(SmallOptions(Backend::kReference));
    absl::StatusOr<Model> demo = LoadModel(ATTENTION_MODELS_DIR "/demo");
    FUZZ_CHECK(demo.ok(), "%s", std::string(demo.status().message()).c_str());
    f->demo = *std::move(demo);
    return f;
  }();
  return *fixture;
}

bool SameBits(const Tensor& a, const Tensor& b) {
  return a.shape == b.shape && a.data.size() == b.data.size() &&
         (a.data.empty() ||
          std::memcmp(a.data.data(), b.data.data(), a.data.size() * sizeof(float)) == 0);
}

// Runs `call` twice in one batch on `engine`; the two must agree bit for bit.
absl::StatusOr<AttentionResult> RunTwice(const Engine& engine, const EngineCall& call) {
  const EngineCall calls[] = {call, call};
  std::vector<absl::StatusOr<AttentionResult>> results = engine.AttendBatchFromThisThread(calls);
  FUZZ_CHECK(results.size() == 2, "%zu results", results.size());
  FUZZ_CHECK(results[0].status() == results[1].status(), "batched twins differ in status");
  if (results[0].ok()) {
    FUZZ_CHECK(SameBits(results[0]->output, results[1]->output), "batched twins' outputs differ");
    FUZZ_CHECK(SameBits(results[0]->weights, results[1]->weights), "batched twins' weights differ");
  }
  return std::move(results[0]);
}

}  // namespace

void Request(const uint8_t* data, size_t size) {
  const Fixture& f = GetFixture();
  grpc::Slice slice(data, size);
  grpc::ByteBuffer bytes(&slice, 1);
  v1::AttendRequest request;
  if (!server::ParseMessage(bytes, &request).ok()) return;

  const MultiheadAttention* layer = nullptr;
  if (!request.model().empty()) {
    if (request.model() != f.demo.config.name()) return;  // NOT_FOUND
    layer = f.demo.layer.get();
  }
  absl::StatusOr<std::unique_ptr<server::EngineRequest>> converted =
      server::ToEngineRequest(request);
  if (!converted.ok()) return;
  const EngineCall call{&(*converted)->args, layer};

  absl::StatusOr<CallCost> cost = f.onednn->CostOf(call);
  absl::StatusOr<CallCost> reference_cost = f.reference->CostOf(call);
  FUZZ_CHECK(cost.status().code() == reference_cost.status().code(),
             "CostOf: onednn %s, reference %s", cost.status().ToString().c_str(),
             reference_cost.status().ToString().c_str());
  if (!cost.ok()) return;

  absl::StatusOr<AttentionResult> got = RunTwice(*f.onednn, call);
  absl::StatusOr<AttentionResult> want = RunTwice(*f.reference, call);
  FUZZ_CHECK(got.status().code() == want.status().code(), "onednn %s, reference %s",
             got.status().ToString().c_str(), want.status().ToString().c_str());
  if (!got.ok()) return;
  FUZZ_CHECK(got->output.shape == want->output.shape, "output shapes differ");
  FUZZ_CHECK(got->weights.shape == want->weights.shape, "weights shapes differ");

  v1::AttendResponse head;
  head.set_id(request.id());
  absl::StatusOr<grpc::ByteBuffer> encoded = server::EncodeResponse(
      head, *std::move(got), request.need_weights(), (*converted)->output_dtype);
  FUZZ_CHECK(encoded.ok(), "EncodeResponse: %s", encoded.status().ToString().c_str());
  v1::AttendResponse decoded;
  FUZZ_CHECK(server::ParseMessage(*encoded, &decoded).ok(), "the encoded response does not parse");
}

}  // namespace attention::fuzz
