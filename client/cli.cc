#include "client/cli.h"

#include <cerrno>
#include <cstdio>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "client/attention_client.h"
#include "client/tensors.h"
#include "common/status_macros.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/util/json_util.h"

namespace attention::client {
namespace {

constexpr absl::string_view kUsage =
    R"(usage: attention_cli [flags] COMMAND

commands:
  call [FILE|-]     send an AttendRequest written in protobuf JSON (from FILE,
                    or standard input for "-" or no FILE); print the response
  health            print the server's grpc.health.v1 status; exit 0 only if SERVING
  info              print GetServerInfo
  models            print ListModels
  model NAME        print GetModel for NAME
  session ID        print GetSession for session ID: its position, heads, dims,
                    cache dtype and bytes
  close ID...       close these sessions (CloseSessions); print which were
                    closed and which were not open

flags:
  --target HOST:PORT    server address, any gRPC target (default 127.0.0.1:50051)
  --timeout DURATION    deadline of each call, e.g. 30s, 500ms (default 30s)
  --token TOKEN         send "authorization: Bearer TOKEN"
  --token_file FILE     send the token in FILE (surrounding whitespace removed):
                        unlike --token, kept out of the process list
  --tls_ca FILE         use TLS, trusting the CA certificates in FILE (PEM)
                        instead of the system's
  --tls_cert FILE       with --tls_key: use TLS and present this client
                        certificate (PEM), for servers that require one
  --tls_key FILE        the private key of --tls_cert (PEM)
  --tls_server_name N   use TLS and expect the server's certificate to name N
                        instead of the target's host
  --max_message_mb N    largest message sent or received (default 256)
  --raw                 call: keep output/weights as base64 `data` instead of
                        converting them to `float_data`
  --service NAME        health: the service to check (default: the whole server)
  --affinity KEY        call, session, close: send "attention-affinity: KEY"
                        (a proxy routes on it) instead of the first session id
  --help                print this text

exit codes: 0 ok, 1 the call failed (one line "error: CODE: message" on
stderr), health is not SERVING or the answer could not be written, 2 bad
command line
)";

struct Flag {
  absl::string_view name;
  bool takes_value;
};

constexpr Flag kFlags[] = {
    {"target", true},     {"timeout", true}, {"token", true},           {"max_message_mb", true},
    {"service", true},    {"raw", false},    {"help", false},           {"tls_ca", true},
    {"tls_cert", true},   {"tls_key", true}, {"tls_server_name", true}, {"affinity", true},
    {"token_file", true},
};

std::optional<Flag> FindFlag(absl::string_view name) {
  for (const Flag& flag : kFlags) {
    if (flag.name == name) return flag;
  }
  return std::nullopt;
}

absl::Status SetFlag(absl::string_view name, const std::string& value, CliCommand* command) {
  if (name == "target") {
    if (value.empty()) return absl::InvalidArgumentError("--target is empty");
    command->client.target = value;
  } else if (name == "timeout") {
    absl::Duration timeout;
    if (!absl::ParseDuration(value, &timeout) || timeout < absl::ZeroDuration()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--timeout: \"", value, "\" is not a non-negative duration such as 30s or 500ms"));
    }
    command->client.timeout = timeout;
  } else if (name == "token") {
    if (absl::Status token = CheckBearerToken(value); !token.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--token: ", token.message()));
    }
    command->client.bearer_token = value;
  } else if (name == "token_file") {
    command->token_file = value;
  } else if (name == "max_message_mb") {
    int64_t mb;
    if (!absl::SimpleAtoi(value, &mb) || mb < 1 || mb > kMaxMessageMb) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--max_message_mb: \"", value, "\" is not an integer from 1 to ", kMaxMessageMb));
    }
    command->client.max_message_mb = mb;
  } else if (name == "tls_ca") {
    command->client.tls_ca_file = value;
  } else if (name == "tls_cert") {
    command->client.tls_cert_file = value;
  } else if (name == "tls_key") {
    command->client.tls_key_file = value;
  } else if (name == "tls_server_name") {
    command->client.tls_server_name_override = value;
  } else if (name == "service") {
    command->service = value;
  } else if (name == "affinity") {
    command->affinity = value;
  } else if (name == "raw") {
    command->raw = true;
  } else if (name == "help") {
    command->help = true;
  }
  return absl::OkStatus();
}

absl::Status CheckPositionals(const std::vector<std::string>& positionals, CliCommand* command) {
  if (positionals.empty()) return absl::InvalidArgumentError("no command given");
  command->command = positionals[0];
  const size_t operands = positionals.size() - 1;
  auto too_many = [&](size_t allowed) {
    return absl::InvalidArgumentError(absl::StrCat(
        command->command, " takes ", allowed, allowed == 1 ? " argument" : " arguments", ", got ",
        operands, ": unexpected \"", positionals[allowed + 1], "\""));
  };
  if (command->command == "call") {
    if (operands > 1) return too_many(1);
    if (operands == 1) command->input = positionals[1];
  } else if (command->command == "model") {
    if (operands > 1) return too_many(1);
    if (operands == 0) return absl::InvalidArgumentError("model needs a NAME");
    command->model = positionals[1];
  } else if (command->command == "session") {
    if (operands > 1) return too_many(1);
    if (operands == 0) return absl::InvalidArgumentError("session needs an ID");
    command->session_ids = {positionals[1]};
  } else if (command->command == "close") {
    if (operands == 0) return absl::InvalidArgumentError("close needs one or more IDs");
    command->session_ids.assign(positionals.begin() + 1, positionals.end());
  } else if (command->command == "health" || command->command == "info" ||
             command->command == "models") {
    if (operands > 0) return too_many(0);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown command \"", command->command,
                     "\" (call, health, info, models, model, session or close)"));
  }
  return absl::OkStatus();
}

// The lines of `text`, trimmed and joined with single spaces.
std::string OneLine(absl::string_view text) {
  std::vector<absl::string_view> lines;
  for (absl::string_view line : absl::StrSplit(text, absl::ByAnyChar("\r\n"))) {
    line = absl::StripAsciiWhitespace(line);
    if (!line.empty()) lines.push_back(line);
  }
  return absl::StrJoin(lines, " ");
}

void PrintError(const absl::Status& status, std::ostream& err) {
  err << "error: " << absl::StatusCodeToString(status.code()) << ": " << OneLine(status.message())
      << "\n";
}

absl::StatusOr<std::string> ReadInput(const std::string& input, std::istream& in) {
  if (input == "-") {
    std::string text(std::istreambuf_iterator<char>(in), {});
    if (in.bad()) return absl::DataLossError("cannot read standard input");
    return text;
  }
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(input.c_str(), "rb"),
                                                       &std::fclose);
  if (file == nullptr) return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", input));
  std::string text;
  char buffer[1 << 16];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof buffer, file.get())) > 0) text.append(buffer, n);
  if (std::ferror(file.get())) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot read ", input));
  }
  return text;
}

// A JSON value as protobuf parses it, into a google.protobuf.Value, read
// through reflection only: Debian's libprotobuf is built without TSan, and
// under -fsanitize=thread protobuf's headers lay its classes out otherwise,
// so the well-known types' inline accessors read garbage in a TSan build.
class JsonValue {
 public:
  explicit JsonValue(const google::protobuf::Message& value)
      : value_(value), reflection_(*value.GetReflection()) {}

  // "null_value", "number_value", "string_value", "bool_value",
  // "struct_value" or "list_value" (Value's oneof).
  std::string Kind() const {
    const google::protobuf::FieldDescriptor* set = reflection_.GetOneofFieldDescriptor(
        value_, value_.GetDescriptor()->FindOneofByName("kind"));
    return set == nullptr ? "" : set->name();
  }

  // What it is, for errors.
  const char* Describe() const {
    const std::string kind = Kind();
    if (kind == "number_value") return "a number";
    if (kind == "string_value") return "a string";
    if (kind == "bool_value") return "true or false";
    if (kind == "struct_value") return "an object";
    if (kind == "list_value") return "a list";
    return "null";
  }

  // An object's members (key, value), or a list's elements (key empty).
  std::vector<std::pair<std::string, JsonValue>> Members() const {
    const std::string kind = Kind();
    std::vector<std::pair<std::string, JsonValue>> members;
    if (kind != "struct_value" && kind != "list_value") return members;
    const google::protobuf::Message& inner =
        reflection_.GetMessage(value_, value_.GetDescriptor()->FindFieldByName(kind));
    const google::protobuf::Reflection& reflection = *inner.GetReflection();
    const google::protobuf::FieldDescriptor* repeated =
        inner.GetDescriptor()->FindFieldByName(kind == "struct_value" ? "fields" : "values");
    for (int i = 0; i < reflection.FieldSize(inner, repeated); ++i) {
      const google::protobuf::Message& item = reflection.GetRepeatedMessage(inner, repeated, i);
      if (kind == "list_value") {
        members.emplace_back("", JsonValue(item));
        continue;
      }
      // A map's entry: key and value.
      const google::protobuf::Descriptor& entry = *item.GetDescriptor();
      members.emplace_back(
          item.GetReflection()->GetString(item, entry.FindFieldByName("key")),
          JsonValue(item.GetReflection()->GetMessage(item, entry.FindFieldByName("value"))));
    }
    return members;
  }

 private:
  const google::protobuf::Message& value_;
  const google::protobuf::Reflection& reflection_;
};

absl::Status CheckJsonTypes(const JsonValue& value, const google::protobuf::Descriptor& message,
                            const std::string& path);

// One value of `field` (an element, for a repeated one).
absl::Status CheckJsonValue(const JsonValue& value, const google::protobuf::FieldDescriptor& field,
                            const std::string& path) {
  using google::protobuf::FieldDescriptor;
  const std::string kind = value.Kind();
  if (kind == "null_value") return absl::OkStatus();  // the field's default
  const char* want = nullptr;
  switch (field.cpp_type()) {
    case FieldDescriptor::CPPTYPE_BOOL:
      if (kind != "bool_value") want = "true or false";
      break;
    case FieldDescriptor::CPPTYPE_STRING:
      if (kind != "string_value") want = "a string";
      break;
    case FieldDescriptor::CPPTYPE_ENUM:
      if (kind != "string_value" && kind != "number_value") want = "a name or number";
      break;
    case FieldDescriptor::CPPTYPE_MESSAGE:
      if (field.message_type()->file()->package() == "google.protobuf") return absl::OkStatus();
      return CheckJsonTypes(value, *field.message_type(), path);
    default:  // numbers; JSON also writes them as strings ("12", "NaN")
      if (kind != "number_value" && kind != "string_value") want = "a number";
  }
  if (want == nullptr) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": ", value.Describe(), " where the field takes ", want));
}

// protobuf's JSON parser (3.21) takes a number or any string for a bool (0
// read as true, "no" as false) and a lone value for a list: each field's
// JSON type is checked first. Unknown fields are left to the parser.
absl::Status CheckJsonTypes(const JsonValue& value, const google::protobuf::Descriptor& message,
                            const std::string& path) {
  if (value.Kind() != "struct_value") {
    return absl::InvalidArgumentError(absl::StrCat(path.empty() ? "the request" : path, ": ",
                                                   value.Describe(), " where ", message.name(),
                                                   " takes an object"));
  }
  std::map<const google::protobuf::FieldDescriptor*, std::string> named;
  for (const auto& [name, field_value] : value.Members()) {
    const google::protobuf::FieldDescriptor* field = message.FindFieldByName(name);
    if (field == nullptr) field = message.FindFieldByCamelcaseName(name);
    if (field == nullptr || field->is_map()) continue;
    const std::string field_path = path.empty() ? name : absl::StrCat(path, ".", name);
    // Its two names ("float_data", "floatData") merge as one key given twice.
    if (auto [first, fresh] = named.emplace(field, name); !fresh) {
      return absl::InvalidArgumentError(absl::StrCat(field_path, ": given twice, also as \"",
                                                     first->second, "\""));
    }
    if (!field->is_repeated()) {
      ATTN_RETURN_IF_ERROR(CheckJsonValue(field_value, *field, field_path));
      continue;
    }
    const std::string kind = field_value.Kind();
    if (kind == "null_value") continue;
    if (kind != "list_value") {
      return absl::InvalidArgumentError(
          absl::StrCat(field_path, ": ", field_value.Describe(), " where the field takes a list"));
    }
    const std::vector<std::pair<std::string, JsonValue>> elements = field_value.Members();
    for (size_t i = 0; i < elements.size(); ++i) {
      ATTN_RETURN_IF_ERROR(
          CheckJsonValue(elements[i].second, *field, absl::StrCat(field_path, "[", i, "]")));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::AttendRequest> ParseRequest(const std::string& input, const std::string& text) {
  const std::string source = input == "-" ? "standard input" : input;
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, " is empty; expected an AttendRequest in JSON"));
  }
  v1::AttendRequest request;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  // Made by libprotobuf's own factory, in its own layout (JsonValue).
  const google::protobuf::Descriptor* value_type =
      google::protobuf::DescriptorPool::generated_pool()->FindMessageTypeByName(
          "google.protobuf.Value");
  std::unique_ptr<google::protobuf::Message> json(
      google::protobuf::MessageFactory::generated_factory()->GetPrototype(value_type)->New());
  auto status = google::protobuf::util::JsonStringToMessage(text, json.get(), options);
  if (status.ok()) {
    if (absl::Status types = CheckJsonTypes(JsonValue(*json), *request.GetDescriptor(), "");
        !types.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": not an AttendRequest in JSON: ", types.message()));
    }
    status = google::protobuf::util::JsonStringToMessage(text, &request, options);
  }
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": not an AttendRequest in JSON: ", std::string(status.message())));
  }
  return request;
}

// With `all_fields`, fields at their default (a position of 0, an empty list)
// are printed too.
absl::Status PrintJson(const google::protobuf::Message& message, std::ostream& out,
                       bool all_fields = false) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = all_fields;
  std::string json;
  const auto status = google::protobuf::util::MessageToJsonString(message, &json, options);
  if (!status.ok()) {
    return absl::InternalError(
        absl::StrCat("cannot print the answer as JSON: ", std::string(status.message())));
  }
  if (json.empty() || json.back() != '\n') json.push_back('\n');
  out << json;
  return absl::OkStatus();
}

absl::Status ExpandForReading(const char* field, v1::Tensor* tensor) {
  absl::Status status = ExpandToFloatData(tensor);
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat("response ", field, ": ", status.message()));
}

// The request is read and parsed before connecting, so a bad file fails fast.
// The command's --affinity, if any, for the call's metadata.
CallOptions Routing(const CliCommand& command) {
  CallOptions call;
  call.affinity = command.affinity;
  return call;
}

absl::Status RunCall(const CliCommand& command, std::istream& in, std::ostream& out) {
  ATTN_ASSIGN_OR_RETURN(std::string text, ReadInput(command.input, in));
  ATTN_ASSIGN_OR_RETURN(v1::AttendRequest request, ParseRequest(command.input, text));
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<AttentionClient> client,
                        AttentionClient::Create(command.client));
  ATTN_ASSIGN_OR_RETURN(v1::AttendResponse response, client->Attend(request, Routing(command)));
  if (!command.raw) {
    if (response.has_output()) {
      ATTN_RETURN_IF_ERROR(ExpandForReading("output", response.mutable_output()));
    }
    if (response.has_weights()) {
      ATTN_RETURN_IF_ERROR(ExpandForReading("weights", response.mutable_weights()));
    }
  }
  return PrintJson(response, out);
}

// Runs a parsed command; OK with *serving = false for a health status other
// than SERVING.
absl::Status RunCommand(const CliCommand& command, std::istream& in, std::ostream& out,
                        bool* serving) {
  if (command.command == "call") return RunCall(command, in, out);
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<AttentionClient> client,
                        AttentionClient::Create(command.client));
  if (command.command == "health") {
    ATTN_ASSIGN_OR_RETURN(std::string status, client->Health(command.service));
    out << status << "\n";
    *serving = status == "SERVING";
    return absl::OkStatus();
  }
  if (command.command == "info") {
    ATTN_ASSIGN_OR_RETURN(v1::ServerInfo info, client->GetServerInfo());
    return PrintJson(info, out);
  }
  if (command.command == "models") {
    ATTN_ASSIGN_OR_RETURN(v1::ListModelsResponse models, client->ListModels());
    return PrintJson(models, out);
  }
  if (command.command == "session") {
    ATTN_ASSIGN_OR_RETURN(v1::SessionInfo info,
                          client->GetSession(command.session_ids[0], Routing(command)));
    return PrintJson(info, out, /*all_fields=*/true);
  }
  if (command.command == "close") {
    ATTN_ASSIGN_OR_RETURN(v1::CloseSessionsResponse closed,
                          client->CloseSessions(command.session_ids, Routing(command)));
    return PrintJson(closed, out, /*all_fields=*/true);
  }
  ATTN_ASSIGN_OR_RETURN(v1::GetModelResponse model, client->GetModel(command.model));
  return PrintJson(model, out);
}

}  // namespace

absl::StatusOr<CliCommand> ParseCliArgs(const std::vector<std::string>& args) {
  CliCommand command;
  std::vector<std::string> positionals;
  bool flags_done = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (flags_done || arg == "-" || arg.size() < 2 || arg[0] != '-') {
      positionals.push_back(arg);
      continue;
    }
    if (arg == "--") {
      flags_done = true;
      continue;
    }
    if (arg == "-h") {
      command.help = true;
      continue;
    }
    absl::string_view body(arg);
    if (!absl::ConsumePrefix(&body, "--")) body.remove_prefix(1);
    const size_t equals = body.find('=');
    const absl::string_view name = body.substr(0, equals);
    const std::optional<Flag> flag = FindFlag(name);
    if (!flag.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag \"", arg, "\""));
    }
    std::string value;
    if (equals != absl::string_view::npos) {
      if (!flag->takes_value) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " takes no value"));
      }
      value = std::string(body.substr(equals + 1));
    } else if (flag->takes_value) {
      if (i + 1 == args.size()) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
      }
      value = args[++i];
    }
    ATTN_RETURN_IF_ERROR(SetFlag(name, value, &command));
  }
  if (command.help) return command;
  ATTN_ASSIGN_OR_RETURN(command.client.bearer_token,
                        BearerTokenFromFlags(command.client.bearer_token, command.token_file));
  ATTN_RETURN_IF_ERROR(CheckPositionals(positionals, &command));
  // A flag its command does not use is a mistake in the command line, as
  // is half of a TLS key pair (found here, not when connecting: exit 2).
  if (!command.service.empty() && command.command != "health") {
    return absl::InvalidArgumentError(
        absl::StrCat("--service applies to health, not ", command.command));
  }
  if (command.raw && command.command != "call") {
    return absl::InvalidArgumentError(absl::StrCat("--raw applies to call, not ", command.command));
  }
  if (!command.affinity.empty() && command.command != "call" && command.command != "session" &&
      command.command != "close") {
    return absl::InvalidArgumentError(
        absl::StrCat("--affinity applies to call, session and close, not ", command.command));
  }
  if (command.client.tls_cert_file.empty() != command.client.tls_key_file.empty()) {
    return absl::InvalidArgumentError(command.client.tls_key_file.empty()
                                          ? "--tls_cert needs --tls_key (its private key)"
                                          : "--tls_key needs --tls_cert (its certificate)");
  }
  return command;
}

std::string CliUsage() { return std::string(kUsage); }

std::vector<std::string> CliFlagNames() {
  std::vector<std::string> names;
  for (const Flag& flag : kFlags) names.emplace_back(flag.name);
  return names;
}

int RunCli(const std::vector<std::string>& args, std::istream& in, std::ostream& out,
           std::ostream& err) {
  absl::StatusOr<CliCommand> command = ParseCliArgs(args);
  if (!command.ok()) {
    PrintError(command.status(), err);
    err << "Run 'attention_cli --help' for usage.\n";
    return kCliUsage;
  }
  if (command->help) {
    out << kUsage;
    return kCliOk;
  }
  bool serving = true;
  absl::Status status = RunCommand(*command, in, out, &serving);
  out.flush();
  if (!status.ok()) {
    PrintError(status, err);
    return kCliError;
  }
  // A full disk or a closed pipe: the answer is lost, which is not success.
  if (!out) {
    err << "error: cannot write the answer to standard output\n";
    return kCliError;
  }
  return serving ? kCliOk : kCliError;
}

}  // namespace attention::client
