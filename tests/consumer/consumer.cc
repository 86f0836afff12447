// Calls a server through the installed client library with one golden case
// and checks its output and weights against the case's expected values.
//
//   consumer TARGET CASE.json      exit 0 when they match

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "client/attention_client.h"
#include "client/tensors.h"
#include "nlohmann/json.hpp"

namespace {

std::vector<int64_t> Shape(const nlohmann::json& t) { return t.at("shape").get<std::vector<int64_t>>(); }
std::vector<float> Data(const nlohmann::json& t) { return t.at("data").get<std::vector<float>>(); }

// Elements of `got` within atol + rtol * |want| of `want`.
bool Matches(const char* name, const std::vector<float>& got, const std::vector<float>& want,
             double atol, double rtol) {
  if (got.size() != want.size()) {
    std::fprintf(stderr, "%s: %zu elements, want %zu\n", name, got.size(), want.size());
    return false;
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::abs(got[i] - want[i]) > atol + rtol * std::abs(want[i])) {
      std::fprintf(stderr, "%s[%zu] = %g, want %g\n", name, i, got[i], want[i]);
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: consumer TARGET CASE.json\n");
    return 2;
  }
  std::ifstream in(argv[2]);
  const nlohmann::json c = nlohmann::json::parse(in);
  const nlohmann::json& inputs = c.at("inputs");
  const nlohmann::json& options = c.at("options");

  attention::v1::AttendRequest request;
  for (const char* name : {"query", "key", "value"}) {
    absl::StatusOr<attention::v1::Tensor> t =
        attention::client::MakeFloatTensor(Shape(inputs.at(name)), Data(inputs.at(name)));
    if (!t.ok()) {
      std::fprintf(stderr, "%s: %s\n", name, t.status().ToString().c_str());
      return 1;
    }
    if (std::string(name) == "query") *request.mutable_query() = *t;
    if (std::string(name) == "key") *request.mutable_key() = *t;
    if (std::string(name) == "value") *request.mutable_value() = *t;
  }
  request.set_num_heads(options.value("num_heads", 1));
  request.set_need_weights(options.value("need_weights", false));
  request.set_average_weights(options.value("average_weights", false));

  attention::client::ClientOptions client_options;
  client_options.target = argv[1];
  absl::StatusOr<std::unique_ptr<attention::client::AttentionClient>> client =
      attention::client::AttentionClient::Create(client_options);
  if (!client.ok()) {
    std::fprintf(stderr, "client: %s\n", client.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<attention::v1::AttendResponse> answer = (*client)->Attend(request);
  if (!answer.ok()) {
    std::fprintf(stderr, "Attend: %s\n", answer.status().ToString().c_str());
    return 1;
  }
  const double atol = c.at("tolerance").at("atol"), rtol = c.at("tolerance").at("rtol");
  const nlohmann::json& expected = c.at("expected");
  const bool ok =
      Matches("output", *attention::client::ReadFloats(answer->output()),
              Data(expected.at("output")), atol, rtol) &&
      Matches("weights", *attention::client::ReadFloats(answer->weights()),
              Data(expected.at("weights")), atol, rtol);
  std::printf("%s: %s\n", c.at("name").get<std::string>().c_str(), ok ? "matches" : "DIFFERS");
  return ok ? 0 : 1;
}
