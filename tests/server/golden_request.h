#ifndef ATTENTION_TESTS_SERVER_GOLDEN_REQUEST_H_
#define ATTENTION_TESTS_SERVER_GOLDEN_REQUEST_H_

// Golden cases as wire requests, and wire tensors compared with golden ones.

#include "attention/v1/attention.pb.h"
#include "gtest/gtest.h"
#include "tests/golden_case.h"

namespace attention::testing {

// The AttendRequest of an "attention" case (id = the case's name).
v1::AttendRequest ToRequest(const GoldenCase& c);

// `got` decoded to floats and compared with `want` element-wise.
::testing::AssertionResult WireClose(const v1::Tensor& got, const GoldenTensor& want, double atol,
                                     double rtol);

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_SERVER_GOLDEN_REQUEST_H_
