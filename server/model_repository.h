#ifndef ATTENTION_SERVER_MODEL_REPOSITORY_H_
#define ATTENTION_SERVER_MODEL_REPOSITORY_H_

#include <map>
#include <memory>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "attention/v1/model.pb.h"
#include "engine/multihead.h"

namespace attention {

// A registered layer: its config (as served by GetModel) and its weights.
struct Model {
  v1::ModelConfig config;
  std::unique_ptr<MultiheadAttention> layer;
};

// Parses a config.pbtxt textproto; INVALID_ARGUMENT naming `source`, line and
// column on a syntax error.
absl::StatusOr<v1::ModelConfig> ParseModelConfig(absl::string_view text, const std::string& source);

// Builds a model from a parsed config and a state_dict. INVALID_ARGUMENT
// naming `source` (the config's file) for an inconsistent config, or
// `weights_source` for weights that do not fit it.
absl::StatusOr<Model> BuildModel(v1::ModelConfig config, StateDict weights,
                                 const std::string& source, const std::string& weights_source);

// Loads DIR/config.pbtxt and DIR/weights.safetensors. The config's name
// defaults to the folder's and must match it when given.
absl::StatusOr<Model> LoadModel(const std::string& dir);

// Every model folder under a directory, loaded at startup. Immutable, so
// thread-safe.
class ModelRepository {
 public:
  // Loads every subfolder of `dir`; any inconsistency is an error naming the
  // file, key and numbers. NOT_FOUND when `dir` is not a directory.
  static absl::StatusOr<std::unique_ptr<ModelRepository>> Load(const std::string& dir);
  // A repository holding no models.
  static std::unique_ptr<ModelRepository> Empty();

  ModelRepository(const ModelRepository&) = delete;
  ModelRepository& operator=(const ModelRepository&) = delete;

  // nullptr when no model has that name.
  const Model* Find(absl::string_view name) const;
  // Sorted by name.
  std::vector<const Model*> models() const;

 private:
  ModelRepository() = default;
  std::map<std::string, Model, std::less<>> models_;
};

}  // namespace attention

#endif  // ATTENTION_SERVER_MODEL_REPOSITORY_H_
