#include "server/model_repository.h"

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/enum_name.h"
#include "common/status_macros.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "server/files.h"
#include "server/safetensors.h"

namespace attention {
namespace {

class FirstErrorCollector : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    if (first_.empty())
      first_ = absl::StrCat("line ", line + 1, " column ", column + 1, ": ", message);
  }
  const std::string& first() const { return first_; }

 private:
  std::string first_;
};

absl::StatusOr<ScoreKind> ModelScoreKind(v1::Score::Kind kind, const std::string& source) {
  if (!v1::Score::Kind_IsValid(kind)) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": score.kind: unknown value ", kind));
  }
  switch (kind) {
    case v1::Score::SCALED_DOT:
      return ScoreKind::kScaledDot;
    case v1::Score::DOT:
      return ScoreKind::kDot;
    case v1::Score::COSINE:
      return ScoreKind::kCosine;
    case v1::Score::NEG_EUCLIDEAN:
      return ScoreKind::kNegEuclidean;
    case v1::Score::GAUSSIAN:
      return ScoreKind::kGaussian;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          source, ": score.kind ", EnumName(kind),
          " needs parameters a model cannot carry; use SCALED_DOT, DOT, COSINE, NEG_EUCLIDEAN "
          "or GAUSSIAN"));
  }
}

}  // namespace

absl::StatusOr<v1::ModelConfig> ParseModelConfig(absl::string_view text, const std::string& source) {
  v1::ModelConfig config;
  google::protobuf::TextFormat::Parser parser;
  FirstErrorCollector errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(std::string(text), &config)) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", errors.first()));
  }
  return config;
}

absl::StatusOr<Model> BuildModel(v1::ModelConfig config, StateDict weights,
                                 const std::string& source, const std::string& weights_source) {
  if (!v1::AttendRequest::Precision_IsValid(config.precision())) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": precision: unknown value ", config.precision()));
  }
  if (config.batching().max_batch_size() < 0 || config.batching().max_queue_delay_us() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": batching: max_batch_size ", config.batching().max_batch_size(),
        " and max_queue_delay_us ", config.batching().max_queue_delay_us(), " must be >= 0"));
  }
  MultiheadConfig mc;
  mc.embed_dim = config.embed_dim();
  mc.num_heads = config.num_heads();
  mc.kdim = config.kdim();
  mc.vdim = config.vdim();
  mc.bias = !config.has_bias() || config.bias();
  mc.add_bias_kv = config.add_bias_kv();
  mc.add_zero_attn = config.add_zero_attn();
  const v1::Score& score = config.score();
  if (score.has_w_q() || score.has_w_k() || score.has_w_v() || score.has_w()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": score: a model's score cannot carry weight tensors"));
  }
  ATTN_ASSIGN_OR_RETURN(mc.score.kind, ModelScoreKind(score.kind(), source));
  if (score.has_scale()) mc.score.scale = score.scale();
  if (score.has_bandwidth()) mc.score.bandwidth = score.bandwidth();
  if (absl::Status checked = MultiheadAttention::CheckConfig(mc); !checked.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", checked.message()));
  }
  config.set_kdim(mc.key_dim());
  config.set_vdim(mc.value_dim());
  config.set_bias(mc.bias);
  auto layer = MultiheadAttention::Create(mc, std::move(weights));
  if (!layer.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(weights_source, ": ", layer.status().message()));
  }
  return Model{std::move(config), std::move(layer).value()};
}

absl::StatusOr<Model> LoadModel(const std::string& dir) {
  const std::filesystem::path folder(dir);
  const std::string config_path = (folder / "config.pbtxt").string();
  const std::string weights_path = (folder / "weights.safetensors").string();
  ATTN_ASSIGN_OR_RETURN(std::string text, server::ReadFile(config_path));
  ATTN_ASSIGN_OR_RETURN(v1::ModelConfig config, ParseModelConfig(text, config_path));
  const std::string folder_name = folder.filename().string();
  if (config.name().empty()) config.set_name(folder_name);
  if (config.name() != folder_name) {
    return absl::InvalidArgumentError(absl::StrCat(config_path, ": name \"", config.name(),
                                                   "\" does not match its folder \"", folder_name,
                                                   "\""));
  }
  ATTN_ASSIGN_OR_RETURN(StateDict weights, ReadSafetensors(weights_path));
  return BuildModel(std::move(config), std::move(weights), config_path, weights_path);
}

absl::StatusOr<std::unique_ptr<ModelRepository>> ModelRepository::Load(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat("--model_repository ", dir, " is not a directory"));
  }
  std::vector<std::string> folders;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    // Hidden folders are not models: a Kubernetes ConfigMap volume, for one,
    // keeps its files in "..data" and "..<timestamp>" beside their links.
    if (entry.is_directory() && entry.path().filename().string().front() != '.') {
      folders.push_back(entry.path().string());
    }
  }
  if (ec) return absl::NotFoundError(absl::StrCat(dir, ": ", ec.message()));
  std::sort(folders.begin(), folders.end());
  std::unique_ptr<ModelRepository> repo(new ModelRepository());
  for (const std::string& folder : folders) {
    ATTN_ASSIGN_OR_RETURN(Model model, LoadModel(folder));
    std::string name = model.config.name();
    repo->models_.emplace(std::move(name), std::move(model));
  }
  return repo;
}

std::unique_ptr<ModelRepository> ModelRepository::Empty() {
  return std::unique_ptr<ModelRepository>(new ModelRepository());
}

const Model* ModelRepository::Find(absl::string_view name) const {
  auto it = models_.find(name);
  return it == models_.end() ? nullptr : &it->second;
}

std::vector<const Model*> ModelRepository::models() const {
  std::vector<const Model*> out;
  for (const auto& [name, model] : models_) out.push_back(&model);
  return out;
}

}  // namespace attention
