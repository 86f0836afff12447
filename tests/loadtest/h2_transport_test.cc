// The h2 transport's wire details; its calls are tested through the runner
// (runner_test.cc, the RunnerTransportTest cases with "h2").

#include "client/loadtest/h2_transport.h"

#include <optional>
#include <string>
#include <utility>

#include "absl/time/time.h"
#include "grpcpp/support/status.h"
#include "gtest/gtest.h"

namespace attention::loadtest::h2_internal {
namespace {

// 5% more, in milliseconds rounded up, and 1 more: the server's deadline falls
// after the caller's own, whose timer then decides.
TEST(H2TransportTest, GrpcTimeoutIsRoundedUpPastTheCallersDeadline) {
  EXPECT_EQ(GrpcTimeout(absl::Milliseconds(100)), "106m");
  EXPECT_EQ(GrpcTimeout(absl::Nanoseconds(1)), "2m");
  EXPECT_EQ(GrpcTimeout(absl::Microseconds(2500)), "4m");
  EXPECT_EQ(GrpcTimeout(absl::Seconds(10)), "10501m");
  // At most 8 digits: coarser units past 99999999 ms.
  EXPECT_EQ(GrpcTimeout(absl::Seconds(100'000)), "105001S");
  EXPECT_EQ(GrpcTimeout(absl::Hours(100)), "378001S");
  EXPECT_EQ(GrpcTimeout(absl::Hours(24 * 365 * 1000)), "9198001H");
}

TEST(H2TransportTest, GrpcMessageIsPercentDecoded) {
  EXPECT_EQ(PercentDecode("plain text"), "plain text");
  EXPECT_EQ(PercentDecode("shape %5B3%5D 100%25"), "shape [3] 100%");
  EXPECT_EQ(PercentDecode("caf%C3%A9"), "caf\xC3\xA9");
  // Not an escape: kept as it is.
  EXPECT_EQ(PercentDecode("50% off, %zz, end %4"), "50% off, %zz, end %4");
}

TEST(H2TransportTest, HttpStatusAndResetsMapToGrpcCodes) {
  EXPECT_EQ(CodeOfHttpStatus(401), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(CodeOfHttpStatus(404), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(CodeOfHttpStatus(503), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(CodeOfHttpStatus(500), grpc::StatusCode::UNKNOWN);
  EXPECT_EQ(CodeOfResetStream(0x7), grpc::StatusCode::UNAVAILABLE);  // REFUSED_STREAM
  EXPECT_EQ(CodeOfResetStream(0x8), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(CodeOfResetStream(0xb), grpc::StatusCode::RESOURCE_EXHAUSTED);  // ENHANCE_YOUR_CALM
  EXPECT_EQ(CodeOfResetStream(0x2), grpc::StatusCode::INTERNAL);
}

}  // namespace
}  // namespace attention::loadtest::h2_internal

namespace attention::loadtest {
namespace {

TEST(H2TransportTest, SplitHostPortTakesHostPortOnly) {
  using HostPort = std::pair<std::string, std::string>;
  EXPECT_EQ(SplitHostPort("127.0.0.1:50051"), HostPort("127.0.0.1", "50051"));
  EXPECT_EQ(SplitHostPort("attention:80"), HostPort("attention", "80"));
  EXPECT_EQ(SplitHostPort("[::1]:50051"), HostPort("::1", "50051"));
  for (const char* target : {"dns:///localhost:1", "ipv4:127.0.0.1:1", "unix:/tmp/socket",
                             "localhost", "::1:50051", ":50051", "localhost:"}) {
    EXPECT_EQ(SplitHostPort(target), std::nullopt) << target;
  }
}

}  // namespace
}  // namespace attention::loadtest
