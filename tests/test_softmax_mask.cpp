// Softmax edge cases and mask conventions ([reliability], [equivalence]).
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <random>

#include "kvattn/core/mask.hpp"
#include "kvattn/core/softmax.hpp"
#include "kvattn/reference/dense_attention.hpp"
#include "test_util.hpp"

using namespace kvattn;

TEST_CASE("softmax of logits of +-1e4 is finite, sums to 1 and matches double", "[reliability]") {
  std::mt19937_64 rng(1);
  std::uniform_real_distribution<double> uniform(-1e4, 1e4);
  for (const Index n : {1, 2, 7, 100, 4096}) {
    RowVector<float> logits(n);
    for (Index i = 0; i < n; ++i) logits(i) = static_cast<float>(uniform(rng));
    logits(0) = 1e4f;
    if (n > 1) logits(1) = -1e4f;
    RowVector<float> p = logits;
    softmax_inplace(p.data(), n);
    // Independent double computation.
    double max_logit = -1e300, sum = 0;
    for (Index i = 0; i < n; ++i) max_logit = std::max(max_logit, double(logits(i)));
    RowVector<double> expected(n);
    for (Index i = 0; i < n; ++i) sum += expected(i) = std::exp(double(logits(i)) - max_logit);
    expected /= sum;
    CAPTURE(n);
    CHECK(p.allFinite());
    CHECK(std::abs(double(p.sum()) - 1.0) <= double(n) * std::numeric_limits<float>::epsilon());
    CHECK((p.cast<double>() - expected).cwiseAbs().maxCoeff() <= 4e-7);
  }
}

TEST_CASE("softmax edge cases: fully masked row gives zeros, NaN propagates", "[reliability]") {
  const double inf = std::numeric_limits<double>::infinity();
  RowVector<double> masked(3);
  masked << -inf, -inf, -inf;
  softmax_inplace(masked.data(), 3);
  CHECK(masked.isZero(0.0));
  RowVector<double> partly(3);
  partly << -inf, 0.0, -inf;
  softmax_inplace(partly.data(), 3);
  CHECK(partly(1) == 1.0);
  CHECK(partly(0) == 0.0);
  RowVector<double> with_nan(3);
  with_nan << 0.0, std::nan(""), 1.0;
  softmax_inplace(with_nan.data(), 3);
  CHECK(with_nan.array().isNaN().all());
  RowVector<double> empty(0);
  softmax_inplace(empty.data(), 0);  // no-op, no crash
}

TEST_CASE("masks: causal, bidirectional and a sliding window of W tokens", "[reliability]") {
  const Mask causal = Mask::causal();
  CHECK(causal.visible(5, 5));
  CHECK(causal.visible(5, 0));
  CHECK_FALSE(causal.visible(5, 6));
  CHECK(Mask::bidirectional().visible(0, 9));
  const Mask window = Mask::sliding_window(3);  // token t sees t-2, t-1, t
  CHECK(window.visible(10, 10));
  CHECK(window.visible(10, 8));
  CHECK_FALSE(window.visible(10, 7));
  CHECK_FALSE(window.visible(10, 11));
  CHECK_THROWS_AS(Mask::sliding_window(0), config_error);
  // A window as long as the sequence is the causal mask.
  const RowMatrix<double> q = kvattn::test::random_input<double>(9, 4, 1);
  const RowMatrix<double> k = kvattn::test::random_input<double>(9, 4, 2);
  const RowMatrix<double> v = kvattn::test::random_input<double>(9, 3, 3);
  const auto a = reference::attention<double>(q, k, v, 0.5, Mask::sliding_window(9));
  const auto b = reference::attention<double>(q, k, v, 0.5, Mask::causal());
  CHECK((a - b).norm() == 0.0);
  // A window of 1 returns each token's own value.
  const auto own = reference::attention<double>(q, k, v, 0.5, Mask::sliding_window(1));
  CHECK((own - v).norm() == 0.0);
}
