#ifndef ATTENTION_TESTS_STATUS_MATCHERS_H_
#define ATTENTION_TESTS_STATUS_MATCHERS_H_

#include <string>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"

namespace attention::testing {

inline const absl::Status& GetStatus(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

// Matches an absl::Status or absl::StatusOr<T> whose code is `code` and whose
// message matches `message_matcher`.
MATCHER_P2(StatusIs, code, message_matcher,
           "has code " + absl::StatusCodeToString(code) + " and a message that " +
               ::testing::DescribeMatcher<std::string>(message_matcher)) {
  const absl::Status& status = GetStatus(arg);
  *result_listener << "whose status is " << status;
  return status.code() == code &&
         ::testing::Matches(message_matcher)(std::string(status.message()));
}

MATCHER(IsOk, "is OK") {
  const absl::Status& status = GetStatus(arg);
  *result_listener << "whose status is " << status;
  return status.ok();
}

// Matches an OK absl::StatusOr<T> whose value matches `value_matcher`.
MATCHER_P(IsOkAndHolds, value_matcher,
          "is OK and holds a value that " +
              ::testing::DescribeMatcher<typename std::remove_cvref_t<arg_type>::value_type>(
                  value_matcher)) {
  if (!arg.ok()) {
    *result_listener << "whose status is " << arg.status();
    return false;
  }
  return ::testing::ExplainMatchResult(value_matcher, *arg, result_listener);
}

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_STATUS_MATCHERS_H_
