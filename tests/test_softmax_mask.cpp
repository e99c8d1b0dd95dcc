// Softmax edge cases and mask conventions ([reliability], [equivalence]).
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kvattn/core/mask.hpp"
#include "kvattn/core/softmax.hpp"
#include "kvattn/detail/causal_attention.hpp"
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

// The prefill driver (detail/causal_attention.hpp) with given logits and values: the
// sink token's tile comes first, alone. Its logit NaN must poison every row that sees
// it, as in decode (softmax_tile_row); a copy of the tile softmax dropped such a first
// tile as "nothing visible" and gave finite rows.
TEST_CASE("prefill: a NaN logit in a tile of its own poisons its row", "[reliability]") {
  constexpr Index n = 6, width = 2;
  struct Ops {
    const double* logits;  // n x n, row = query position, column = key
    void score(Index q0, Index nq, Index k0, Index nk, double* s, Index stride, double*) const {
      for (Index i = 0; i < nq; ++i)
        for (Index j = 0; j < nk; ++j) s[i * stride + j] = logits[(q0 + i) * n + k0 + j];
    }
    void accumulate(Index, Index nq, Index k0, Index nk, const double* w, Index stride, double* acc,
                    Index acc_stride, double*) const {
      for (Index i = 0; i < nq; ++i)
        for (Index j = 0; j < nk; ++j)
          for (Index d = 0; d < width; ++d)
            acc[i * acc_stride + d] += w[i * stride + j] * double(k0 + j + d);  // value rows
    }
  };
  std::vector<double> logits(n * n, 0.25);
  for (Index i = 0; i < n; ++i) logits[i * n] = std::numeric_limits<double>::quiet_NaN();
  detail::CausalShape shape;
  shape.acc_width = width;
  shape.span.window = 2;  // each row sees the sink token 0, itself and the token before
  shape.span.sink_tokens = 1;
  detail::CausalScratch<double> scratch;
  scratch.fit(shape);
  std::vector<double> out(n * width, 0.0);
  detail::causal_query_tile(shape, scratch, Ops{logits.data()}, 0, n, out.data(), width);
  for (Index i = 0; i < n * width; ++i) {
    CAPTURE(i);
    REQUIRE(std::isnan(out[i]));
  }
  // Without the NaN: equal weights over the visible keys {0, i - 1, i} (hand-derived mean).
  std::fill(logits.begin(), logits.end(), 0.25);
  detail::causal_query_tile(shape, scratch, Ops{logits.data()}, 0, n, out.data(), width);
  for (Index i = 0; i < n; ++i) {
    const double mean_key = i == 0 ? 0.0 : i == 1 ? 0.5 : (0.0 + (i - 1) + i) / 3.0;
    for (Index d = 0; d < width; ++d) {
      CAPTURE(i, d);
      REQUIRE(out[i * width + d] == Approx(mean_key + d).epsilon(1e-14));
    }
  }
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
