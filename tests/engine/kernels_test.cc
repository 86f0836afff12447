// The engine's own matmul kernel for tiny shapes, against plain loops.

#include "engine/kernels.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace attention::internal {
namespace {

TEST(SmallGemm, MatchesPlainLoopsForEveryBlockAndTail) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int64_t m : {1, 3, 4, 5, 16, 17}) {
    for (int64_t n : {1, 15, 16, 17, 33}) {
      for (int64_t k : {1, 16, 19}) {
        // Leading dimensions wider than the rows, as in the backend's blocks.
        const int64_t lda = k + 3, ldb = n + 5, ldc = n + 2;
        std::vector<float> a(m * lda), b(k * ldb), c(m * ldc, 99.0f);
        for (float& x : a) x = dist(rng);
        for (float& x : b) x = dist(rng);
        SmallGemm(a.data(), lda, b.data(), ldb, c.data(), ldc, m, n, k);
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            double want = 0;
            for (int64_t kk = 0; kk < k; ++kk) want += double{a[i * lda + kk]} * b[kk * ldb + j];
            ASSERT_NEAR(c[i * ldc + j], want, 1e-5 * k)
                << "m " << m << " n " << n << " k " << k << " at (" << i << ", " << j << ")";
          }
          for (int64_t j = n; j < ldc; ++j) {
            ASSERT_EQ(c[i * ldc + j], 99.0f) << "wrote past column " << n;
          }
        }
      }
    }
  }
}

TEST(SmallGemm, EachRowIsTheSameWhateverTheRowsAroundIt) {
  // The backend relies on this for bit-identical batched results.
  const int64_t n = 24, k = 16;
  std::vector<float> a(9 * k), b(k * n);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (float& x : a) x = dist(rng);
  for (float& x : b) x = dist(rng);
  std::vector<float> all(9 * n), one(n);
  SmallGemm(a.data(), k, b.data(), n, all.data(), n, 9, n, k);
  for (int64_t i = 0; i < 9; ++i) {
    SmallGemm(a.data() + i * k, k, b.data(), n, one.data(), n, 1, n, k);
    for (int64_t j = 0; j < n; ++j) ASSERT_EQ(one[j], all[i * n + j]) << "row " << i;
  }
}

}  // namespace
}  // namespace attention::internal
