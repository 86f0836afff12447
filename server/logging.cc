#include "server/logging.h"

#include <algorithm>
#include <iterator>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/stubs/logging.h"
#include "spdlog/common.h"
#include "spdlog/logger.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace attention::server {
namespace {

constexpr std::pair<absl::string_view, spdlog::level::level_enum> kLevels[] = {
    {"trace", spdlog::level::trace}, {"debug", spdlog::level::debug}, {"info", spdlog::level::info},
    {"warn", spdlog::level::warn},   {"error", spdlog::level::err},   {"off", spdlog::level::off},
};

// protobuf's own messages, into the same log. Its parser's complaints about a
// message (e.g. a string field that is not UTF-8) are a client's error, which
// the client gets as INVALID_ARGUMENT: logged as errors, one line per bad
// request would let any client flood the log, so they go to debug.
void ProtobufLog(google::protobuf::LogLevel level, const char* filename, int line,
                 const std::string& message) {
  spdlog::level::level_enum to = level == google::protobuf::LOGLEVEL_INFO      ? spdlog::level::info
                                 : level == google::protobuf::LOGLEVEL_WARNING ? spdlog::level::warn
                                                                               : spdlog::level::err;
  if (absl::EndsWith(filename, "wire_format_lite.cc")) to = spdlog::level::debug;
  spdlog::log(to, "protobuf {}:{}: {}", filename, line, message);
}

}  // namespace

absl::Status InitLogging(absl::string_view level) {
  const auto* found = std::find_if(std::begin(kLevels), std::end(kLevels), [&](const auto& entry) {
    return absl::EqualsIgnoreCase(entry.first, level);
  });
  if (found == std::end(kLevels)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--log_level: \"", level, "\" is not one of trace, debug, info, warn, error, off"));
  }
  try {
    auto logger = std::make_shared<spdlog::logger>(
        "attention", std::make_shared<spdlog::sinks::stderr_sink_mt>());
    logger->set_pattern("%Y-%m-%dT%H:%M:%S.%eZ %l %v", spdlog::pattern_time_type::utc);
    logger->set_level(found->second);
    spdlog::set_default_logger(std::move(logger));
    google::protobuf::SetLogHandler(&ProtobufLog);
  } catch (const spdlog::spdlog_ex& error) {
    return absl::InternalError(absl::StrCat("cannot set up logging: ", error.what()));
  }
  return absl::OkStatus();
}

}  // namespace attention::server
