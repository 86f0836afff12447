#include "server/logging.h"

#include <string>

#include "absl/status/status.h"
#include "attention/v1/attention.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "spdlog/spdlog.h"
#include "tests/status_matchers.h"

namespace attention::server {
namespace {

using ::attention::testing::IsOk;
using ::attention::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;

TEST(InitLoggingTest, SetsTheLevelGivenInAnyCase) {
  ASSERT_THAT(InitLogging("debug"), IsOk());
  EXPECT_EQ(spdlog::default_logger()->level(), spdlog::level::debug);
  ASSERT_THAT(InitLogging("WARN"), IsOk());
  EXPECT_EQ(spdlog::default_logger()->level(), spdlog::level::warn);
  ASSERT_THAT(InitLogging("off"), IsOk());
  EXPECT_EQ(spdlog::default_logger()->level(), spdlog::level::off);
  ASSERT_THAT(InitLogging("info"), IsOk());
}

TEST(InitLoggingTest, RejectsUnknownLevelsAndKeepsTheLogger) {
  ASSERT_THAT(InitLogging("error"), IsOk());
  EXPECT_THAT(InitLogging("verbose"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("--log_level"), HasSubstr("\"verbose\""),
                             HasSubstr("trace, debug, info, warn, error, off"))));
  EXPECT_THAT(InitLogging(""), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"\"")));
  EXPECT_EQ(spdlog::default_logger()->level(), spdlog::level::err);
  ASSERT_THAT(InitLogging("info"), IsOk());
}

TEST(InitLoggingTest, WritesOneCompactLinePerMessageToStderr) {
  ::testing::internal::CaptureStderr();
  const absl::Status status = InitLogging("info");
  spdlog::debug("below the level");
  spdlog::info("listening on {}", "127.0.0.1:50051");
  spdlog::warn("draining");
  const std::string logged = ::testing::internal::GetCapturedStderr();
  ASSERT_THAT(status, IsOk());
  EXPECT_THAT(logged, MatchesRegex("[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\."
                                   "[0-9]{3}Z info listening on 127\\.0\\.0\\.1:50051\n"
                                   "[-0-9T:.]+Z warning draining\n"));
}

// Regression: protobuf logged "String field ... contains invalid UTF-8 data"
// at ERROR for every such request, so any client could flood the log.
TEST(InitLoggingTest, ProtobufParseComplaintsGoToDebug) {
  v1::AttendRequest request;
  request.set_id("ok");
  std::string bytes = request.SerializeAsString();
  bytes.back() = '\xff';  // the id's last byte: no longer UTF-8
  ::testing::internal::CaptureStderr();
  const absl::Status status = InitLogging("debug");
  const bool parsed = v1::AttendRequest().ParseFromString(bytes);
  const std::string logged = ::testing::internal::GetCapturedStderr();
  ASSERT_THAT(InitLogging("info"), IsOk());
  ASSERT_THAT(status, IsOk());
  EXPECT_FALSE(parsed);
  EXPECT_THAT(logged, MatchesRegex("[-0-9T:.]+Z debug protobuf [^\n]*wire_format_lite.cc:[0-9]+: "
                                   "String field 'attention.v1.AttendRequest.id' contains "
                                   "invalid UTF-8[^\n]*\n"));
}

}  // namespace
}  // namespace attention::server
