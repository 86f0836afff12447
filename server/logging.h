#ifndef ATTENTION_SERVER_LOGGING_H_
#define ATTENTION_SERVER_LOGGING_H_

// The server's log: spdlog's default logger (log with spdlog::info(...),
// SPDLOG_WARN(...), ...), set up once by InitLogging.

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace attention::server {

// Points spdlog's default logger at standard error, one line per message:
//   2024-05-01T12:00:00.123Z info listening on 127.0.0.1:50051
// (UTC time, level name, message), keeping messages at `level` and above:
// "trace", "debug", "info", "warn", "error" or "off", in any case.
// INVALID_ARGUMENT naming --log_level and the choices for anything else,
// leaving the current logger in place. Also routes protobuf's own log
// messages there, those about a malformed message at debug (each is a
// client's bad request). Call at startup before other threads log; a later
// call replaces the logger.
absl::Status InitLogging(absl::string_view level);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_LOGGING_H_
