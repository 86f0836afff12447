#include "tests/client/fake_server.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/tensors.h"
#include "grpc/grpc.h"
#include "grpcpp/ext/health_check_service_server_builder_option.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/server_context.h"
#include "gtest/gtest.h"

namespace attention::testing {
namespace {

// The one model the fake serves.
v1::ModelConfig DemoModel() {
  v1::ModelConfig model;
  model.set_name("demo");
  model.set_embed_dim(8);
  model.set_num_heads(2);
  return model;
}

// The call's metadata `key`, "" when it had none.
std::string Metadata(const grpc::ServerContext& context, const char* key) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(key);
  if (it == metadata.end()) return "";
  return std::string(it->second.data(), it->second.size());
}

}  // namespace

class FakeAttentionServer::AttentionImpl final : public v1::AttentionService::Service {
 public:
  explicit AttentionImpl(State* state) : state_(state) {}

  grpc::Status Attend(grpc::ServerContext* context, const v1::AttendRequest* request,
                      v1::AttendResponse* response) override {
    Record(*context);
    SendReplica(context);
    const Fate fate = CountAndStall(*context);
    if (!fate.failure.ok()) return fate.failure;
    if (fate.hang || request->id() == "hang") return HangUntilCancelled(*context);
    const grpc::Status status = Answer(*request, response);
    return status.ok() && !fate.lost_answer.ok() ? fate.lost_answer : status;
  }

  grpc::Status AttendStream(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::AttendResponse, v1::AttendRequest>* stream) override {
    Record(*context);
    SendReplica(context);
    {
      absl::MutexLock lock(&state_->mu);
      ++state_->attend_streams;
    }
    v1::AttendRequest request;
    while (stream->Read(&request)) {
      const Fate fate = CountAndStall(*context);
      if (fate.hang) return HangUntilCancelled(*context);
      if (!fate.end_stream.ok()) return fate.end_stream;
      v1::AttendResponse response;
      const grpc::Status status = fate.failure.ok() ? Answer(request, &response) : fate.failure;
      if (status.ok() && !fate.lost_answer.ok()) return fate.lost_answer;
      if (!status.ok()) {
        response.Clear();
        response.set_id(request.id());
        response.mutable_status()->set_message(status.error_message());
      }
      response.mutable_status()->set_code(status.error_code());
      if (!stream->Write(response)) break;
    }
    return grpc::Status::OK;
  }

  grpc::Status GetServerInfo(grpc::ServerContext* context, const v1::GetServerInfoRequest*,
                             v1::ServerInfo* info) override {
    Record(*context);
    info->set_version("fake-1.0");
    info->set_engine_backend("reference");
    info->add_supported_scores(v1::Score::SCALED_DOT);
    return grpc::Status::OK;
  }

  grpc::Status ListModels(grpc::ServerContext* context, const v1::ListModelsRequest*,
                          v1::ListModelsResponse* response) override {
    Record(*context);
    *response->add_models() = DemoModel();
    return grpc::Status::OK;
  }

  grpc::Status GetModel(grpc::ServerContext* context, const v1::GetModelRequest* request,
                        v1::GetModelResponse* response) override {
    Record(*context);
    if (request->name() != "demo") {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          absl::StrCat("model \"", request->name(), "\" is not registered"));
    }
    *response->mutable_config() = DemoModel();
    return grpc::Status::OK;
  }

  grpc::Status CloseSessions(grpc::ServerContext* context, const v1::CloseSessionsRequest* request,
                             v1::CloseSessionsResponse* response) override {
    Record(*context);
    absl::MutexLock lock(&state_->mu);
    state_->close_affinities.push_back(state_->affinity);
    if (state_->drop_at_close) {
      state_->drop_at_close = false;
      state_->sessions.clear();
    }
    if (state_->fail_closes > 0) {
      --state_->fail_closes;
      return grpc::Status(state_->fail_closes_code, "injected failure of CloseSessions");
    }
    for (const std::string& id : request->ids()) {
      if (state_->sessions.erase(id) > 0) {
        response->add_closed(id);
        ++state_->closed_sessions;
      } else {
        response->add_not_found(id);
      }
    }
    return grpc::Status::OK;
  }

  grpc::Status GetSession(grpc::ServerContext* context, const v1::GetSessionRequest* request,
                          v1::SessionInfo* info) override {
    Record(*context);
    absl::MutexLock lock(&state_->mu);
    auto it = state_->sessions.find(request->id());
    if (it == state_->sessions.end()) return NotOpen(request->id());
    const FakeSession& session = it->second;
    info->set_id(request->id());
    info->set_model(session.model);
    info->set_position(session.position);
    info->set_heads(session.heads);
    info->set_kv_heads(session.kv_heads);
    info->set_head_dim(session.head_dim);
    info->set_value_dim(session.value_dim);
    info->set_cache_dtype(session.cache_dtype);
    // No request holds it (each applies at once), unless told otherwise.
    info->set_idle_ms(state_->report_held > 0 ? 0 : 1);
    if (state_->report_held > 0) --state_->report_held;
    if (state_->report_step_ids) info->set_last_step_id(session.last_step_id);  // even ""

    const int64_t element_bytes = session.cache_dtype == v1::Tensor::BFLOAT16 ? 2 : 4;
    info->set_bytes(session.position * session.kv_heads * (session.head_dim + session.value_dim) *
                    element_bytes);
    return grpc::Status::OK;
  }

 private:
  void Record(const grpc::ServerContext& context) {
    absl::MutexLock lock(&state_->mu);
    state_->authorization = Metadata(context, "authorization");
    state_->affinity = Metadata(context, "attention-affinity");
  }

  void SendReplica(grpc::ServerContext* context) {
    absl::MutexLock lock(&state_->mu);
    if (!state_->replica.empty()) context->AddInitialMetadata("attention-replica", state_->replica);
  }

  // What HangCall, FailCall and EndStreamAtCall chose for a call.
  struct Fate {
    bool hang = false;
    grpc::Status failure;
    grpc::Status end_stream;
    grpc::Status lost_answer;
  };

  // Blocks until the call is cancelled (or 30 s have passed).
  static grpc::Status HangUntilCancelled(const grpc::ServerContext& context) {
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    while (!context.IsCancelled() && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
    return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
  }

  // Counts an Attend call or stream message, drops the sessions at the call
  // DropSessionsAtCall chose, and waits out a stall.
  Fate CountAndStall(const grpc::ServerContext& context) {
    absl::Time until;
    Fate fate;
    {
      absl::MutexLock lock(&state_->mu);
      state_->peers.insert(context.peer());
      if (++state_->attend_calls == state_->stall_call) {
        state_->stalled_until = absl::Now() + state_->stall;
      }
      fate.hang = state_->attend_calls == state_->hang_call;
      if (state_->attend_calls == state_->fail_call) {
        fate.failure = grpc::Status(state_->fail_code,
                                    absl::StrCat("injected failure of call ", state_->fail_call));
      }
      if (state_->attend_calls == state_->lose_call) {
        fate.lost_answer = grpc::Status(
            state_->lose_code, absl::StrCat("injected loss of the answer to call ", state_->lose_call));
      }
      if (state_->attend_calls >= state_->end_stream_call &&
          state_->attend_calls < state_->end_stream_call + state_->end_stream_count) {
        fate.end_stream =
            grpc::Status(state_->end_stream_code,
                         absl::StrCat("injected end of the stream at call ", state_->attend_calls));
      }
      if (state_->attend_calls == state_->drop_call) state_->sessions.clear();
      if (state_->attend_calls == state_->take_call) {
        FakeSession& taken = state_->sessions[state_->take_id];
        taken = FakeSession();
        taken.position = state_->take_rows;
        taken.last_step_id = "another client's";
      }
      if (state_->attend_calls == state_->rewind_call) {
        for (auto& [id, session] : state_->sessions) {
          if (session.position <= state_->rewind_rows) continue;
          session.keys.resize(session.keys.size() / static_cast<size_t>(session.position) *
                              static_cast<size_t>(state_->rewind_rows));
          session.position = state_->rewind_rows;
        }
      }
      until = state_->stalled_until;
    }
    absl::SleepFor(until - absl::Now());
    return fate;
  }

  grpc::Status Answer(const v1::AttendRequest& request, v1::AttendResponse* response) {
    if (request.id() == "fail") {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "mask.valid_lens: shape [3] does not match batch size 2");
    }
    absl::StatusOr<std::vector<float>> query = client::ReadFloats(request.query());
    if (!query.ok()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("query: ", query.status().message()));
    }
    const std::vector<int64_t> shape(request.query().shape().begin(),
                                     request.query().shape().end());
    absl::StatusOr<v1::Tensor> output =
        client::MakeFloatTensor(shape, *query, request.output_dtype());
    if (!output.ok()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("output_dtype: ", output.status().message()));
    }
    if (request.has_session()) {
      const grpc::Status applied = ApplySession(request, response);
      if (!applied.ok()) return applied;
    }
    response->set_id(request.id());
    *response->mutable_output() = *std::move(output);
    if (request.need_weights()) {
      *response->mutable_weights() = *client::MakeFloatTensor({1, 1}, {0.5f}, v1::Tensor::FLOAT16);
    }
    response->set_queue_us(3);
    response->set_compute_us(7);
    response->set_batch_size(1);
    return grpc::Status::OK;
  }

  static grpc::Status Invalid(absl::string_view message) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(message));
  }
  static grpc::Status NotOpen(const std::string& id) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("session \"", id, "\" is not open"));
  }

  // A new session's head shape, as the real server takes it from the request
  // (the "demo" model of ListModels: 2 heads of 4).
  static FakeSession NewSession(const v1::AttendRequest& request, const v1::Tensor& keys) {
    const v1::Tensor& values = request.has_value() ? request.value() : keys;
    FakeSession session;
    session.model = request.model();
    session.cache_dtype = request.session().cache_dtype();
    if (!request.model().empty()) {
      session.heads = session.kv_heads = 2;
      session.head_dim = session.value_dim = 4;
    } else if (keys.shape_size() == 4) {
      session.heads = static_cast<int32_t>(request.query().shape(1));
      session.kv_heads = static_cast<int32_t>(keys.shape(1));
      session.head_dim = static_cast<int32_t>(keys.shape(3));
      session.value_dim = static_cast<int32_t>(values.shape(3));
    } else {
      session.heads = session.kv_heads = std::max(1, request.num_heads());
      session.head_dim = static_cast<int32_t>(keys.shape(2)) / session.heads;
      session.value_dim = static_cast<int32_t>(values.shape(2)) / session.heads;
    }
    return session;
  }

  // Checks the request's session spec against the open sessions and applies
  // it when all of it holds; an error changes nothing.
  grpc::Status ApplySession(const v1::AttendRequest& request, v1::AttendResponse* response) {
    const v1::SessionSpec& spec = request.session();
    const v1::Tensor& query = request.query();
    if (spec.ids().empty()) return Invalid("session.ids is empty");
    if (spec.positions_size() != spec.ids_size()) {
      return Invalid(absl::StrCat("session: ", spec.ids_size(), " ids but ", spec.positions_size(),
                                  " positions"));
    }
    if (query.shape_size() != 3 && query.shape_size() != 4) {
      return Invalid("session: query must be rank 3 or 4");
    }
    const bool sequence_first =
        query.shape_size() == 3 && request.layout() == v1::AttendRequest::SEQUENCE_FIRST;
    const int64_t batch = query.shape(sequence_first ? 1 : 0);
    if (batch != spec.ids_size()) {
      return Invalid(absl::StrCat("session: ", spec.ids_size(), " ids for a batch of ", batch));
    }
    if (spec.read_only() && (request.has_key() || request.has_value())) {
      return Invalid("session.read_only: key and value must be absent");
    }
    const v1::Tensor& keys = request.has_key() ? request.key() : query;
    if (keys.shape_size() != query.shape_size()) return Invalid("session: key rank");
    const int axis = query.shape_size() == 4 ? 2 : (sequence_first ? 0 : 1);
    const int64_t rows = spec.read_only() ? 0 : keys.shape(axis);
    std::vector<float> key_values;
    if (batch == 1 && rows > 0) {
      absl::StatusOr<std::vector<float>> read = client::ReadFloats(keys);
      if (!read.ok()) return Invalid(absl::StrCat("key: ", read.status().message()));
      key_values = *std::move(read);
    }

    absl::MutexLock lock(&state_->mu);
    std::map<std::string, FakeSession>& sessions = state_->sessions;
    for (int i = 0; i < spec.ids_size(); ++i) {
      const std::string& id = spec.ids(i);
      auto it = sessions.find(id);
      if (spec.create()) {
        if (it != sessions.end()) {
          return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                              absl::StrCat("session ", id, " already exists"));
        }
        if (spec.positions(i) != 0) return Invalid("session.create: positions must be 0");
      } else if (it == sessions.end()) {
        return NotOpen(id);
      } else if (it->second.position != spec.positions(i)) {
        return grpc::Status(grpc::StatusCode::ABORTED,
                            absl::StrCat("session ", id, ": position ", spec.positions(i),
                                         " was expected, the session holds ", it->second.position));
      }
    }
    for (const std::string& id : spec.ids()) {
      if (spec.create()) sessions[id] = NewSession(request, keys);
      FakeSession& session = sessions[id];
      session.position += rows;
      session.keys.insert(session.keys.end(), key_values.begin(), key_values.end());
      if (!spec.read_only()) session.last_step_id = spec.step_id();
      response->add_session_positions(session.position);
    }
    if (spec.close()) {
      for (const std::string& id : spec.ids()) sessions.erase(id);
      state_->closed_sessions += spec.ids_size();
    }
    return grpc::Status::OK;
  }

  State* state_;
};

class FakeAttentionServer::HealthImpl final : public grpc::health::v1::Health::Service {
 public:
  explicit HealthImpl(State* state) : state_(state) {}

  grpc::Status Check(grpc::ServerContext*, const grpc::health::v1::HealthCheckRequest* request,
                     grpc::health::v1::HealthCheckResponse* response) override {
    absl::MutexLock lock(&state_->mu);
    state_->health_service = request->service();
    if (request->service() == "missing") {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service");
    }
    response->set_status(state_->health);
    return grpc::Status::OK;
  }

 private:
  State* state_;
};

FakeAttentionServer::FakeAttentionServer(absl::Duration max_connection_age,
                                         int max_concurrent_streams)
    : attention_(std::make_unique<AttentionImpl>(&state_)),
      health_(std::make_unique<HealthImpl>(&state_)) {
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  if (max_connection_age > absl::ZeroDuration()) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS,
                               static_cast<int>(absl::ToInt64Milliseconds(max_connection_age)));
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, 30'000);
  }
  if (max_concurrent_streams > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, max_concurrent_streams);
  }
  builder.RegisterService(attention_.get());
  // Its own health service, not gRPC's default one as well: in a process
  // that also ran the real server (which enables the default process-wide),
  // gRPC would register both and log a duplicate registration per start.
  builder.SetOption(std::make_unique<grpc::HealthCheckServiceServerBuilderOption>(nullptr));
  builder.RegisterService(health_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port == 0) {
    ADD_FAILURE() << "the fake server could not start on 127.0.0.1:0";
    return;
  }
  address_ = absl::StrCat("127.0.0.1:", port);
}

FakeAttentionServer::~FakeAttentionServer() {
  if (server_ != nullptr) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
}

void FakeAttentionServer::set_health(grpc::health::v1::HealthCheckResponse::ServingStatus status) {
  absl::MutexLock lock(&state_.mu);
  state_.health = status;
}

std::string FakeAttentionServer::last_affinity() const {
  absl::MutexLock lock(&state_.mu);
  return state_.affinity;
}

std::string FakeAttentionServer::last_authorization() const {
  absl::MutexLock lock(&state_.mu);
  return state_.authorization;
}

std::string FakeAttentionServer::last_health_service() const {
  absl::MutexLock lock(&state_.mu);
  return state_.health_service;
}

int64_t FakeAttentionServer::attend_calls() const {
  absl::MutexLock lock(&state_.mu);
  return state_.attend_calls;
}

void FakeAttentionServer::set_report_step_ids(bool report) {
  absl::MutexLock lock(&state_.mu);
  state_.report_step_ids = report;
}

void FakeAttentionServer::ReportHeld(int64_t count) {
  absl::MutexLock lock(&state_.mu);
  state_.report_held = count;
}

void FakeAttentionServer::set_replica(std::string name) {
  absl::MutexLock lock(&state_.mu);
  state_.replica = std::move(name);
}

int64_t FakeAttentionServer::attend_streams() const {
  absl::MutexLock lock(&state_.mu);
  return state_.attend_streams;
}

size_t FakeAttentionServer::distinct_peers() const {
  absl::MutexLock lock(&state_.mu);
  return state_.peers.size();
}

void FakeAttentionServer::HangCall(int64_t call) {
  absl::MutexLock lock(&state_.mu);
  state_.hang_call = call;
}

int64_t FakeAttentionServer::open_sessions() const {
  absl::MutexLock lock(&state_.mu);
  return static_cast<int64_t>(state_.sessions.size());
}

void FakeAttentionServer::FailCloses(int64_t count, grpc::StatusCode code) {
  absl::MutexLock lock(&state_.mu);
  state_.fail_closes = count;
  state_.fail_closes_code = code;
}

void FakeAttentionServer::DropSessionsAtNextClose() {
  absl::MutexLock lock(&state_.mu);
  state_.drop_at_close = true;
}

int64_t FakeAttentionServer::closed_sessions() const {
  absl::MutexLock lock(&state_.mu);
  return state_.closed_sessions;
}

std::vector<std::string> FakeAttentionServer::close_affinities() const {
  absl::MutexLock lock(&state_.mu);
  return state_.close_affinities;
}

std::vector<float> FakeAttentionServer::session_keys(const std::string& id) const {
  absl::MutexLock lock(&state_.mu);
  auto it = state_.sessions.find(id);
  return it == state_.sessions.end() ? std::vector<float>() : it->second.keys;
}

void FakeAttentionServer::DropSessions() {
  absl::MutexLock lock(&state_.mu);
  state_.sessions.clear();
}

void FakeAttentionServer::DropSessionsAtCall(int64_t call) {
  absl::MutexLock lock(&state_.mu);
  state_.drop_call = call;
}

void FakeAttentionServer::RewindSessionsAtCall(int64_t call, int64_t rows) {
  absl::MutexLock lock(&state_.mu);
  state_.rewind_call = call;
  state_.rewind_rows = rows;
}

void FakeAttentionServer::TakeSessionAtCall(int64_t call, std::string id, int64_t rows) {
  absl::MutexLock lock(&state_.mu);
  state_.take_call = call;
  state_.take_id = std::move(id);
  state_.take_rows = rows;
}

void FakeAttentionServer::FailCall(int64_t call, grpc::StatusCode code) {
  absl::MutexLock lock(&state_.mu);
  state_.fail_call = call;
  state_.fail_code = code;
}

void FakeAttentionServer::LoseAnswerOfCall(int64_t call, grpc::StatusCode code) {
  absl::MutexLock lock(&state_.mu);
  state_.lose_call = call;
  state_.lose_code = code;
}

void FakeAttentionServer::EndStreamAtCall(int64_t call, grpc::StatusCode code, int64_t count) {
  absl::MutexLock lock(&state_.mu);
  state_.end_stream_call = call;
  state_.end_stream_code = code;
  state_.end_stream_count = count;
}

void FakeAttentionServer::StallCall(int64_t call, absl::Duration stall) {
  absl::MutexLock lock(&state_.mu);
  state_.stall_call = call;
  state_.stall = stall;
}

}  // namespace attention::testing
