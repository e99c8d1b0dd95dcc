// The causal mask's visible share of the query-key grid (analysis/visibility.hpp) and
// self-attention pooling (pooling/self_attention_pool.hpp: a bidirectional layer, then
// the mean over kept tokens), each against a plain computation written out here.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>

#include "kvattn/analysis/visibility.hpp"
#include "kvattn/attention/gqa.hpp"
#include "kvattn/core/mask.hpp"
#include "kvattn/pooling/self_attention_pool.hpp"
#include "test_util.hpp"

using namespace kvattn;

TEST_CASE("causal visible fraction is 1/2 + 1/(2N)", "[analysis]") {
  using analysis::causal_visible_cells;
  using analysis::causal_visible_fraction;
  CHECK(causal_visible_fraction(10) == 0.55);  // 55 of 100 cells
  CHECK(causal_visible_cells(10) == 55);
  CHECK(causal_visible_fraction(1) == 1.0);
  for (const Index n : {1, 2, 7, 10, 33}) {
    Index visible = 0;  // counted from the mask itself
    for (Index i = 0; i < n; ++i) {
      for (Index j = 0; j < n; ++j) visible += Mask::causal().visible(i, j) ? 1 : 0;
    }
    CHECK(causal_visible_cells(n) == visible);
    CHECK(causal_visible_fraction(n) == Approx(double(visible) / double(n * n)).epsilon(1e-15));
  }
  CHECK_THROWS_AS(causal_visible_fraction(0), config_error);
  static_assert(causal_visible_cells(10) == 55);
}

TEST_CASE("causal visible cells are exact up to the 64-bit limit and refuse beyond it",
          "[analysis][reliability]") {
  using analysis::causal_visible_cells;
  // The largest n whose n (n + 1) / 2 fits: (2^32 - 1) 2^32 / 2 = 2^63 - 2^31.
  CHECK(causal_visible_cells(4294967295LL) == 4294967295LL * 2147483648LL);
  // 2^32 gives 2^31 (2^32 + 1) = 2^63 + 2^31 cells: refused (it used to wrap to 2^31).
  CHECK_THROWS_AS(causal_visible_cells(Index{1} << 32), kvattn::overflow_error);
  CHECK_THROWS_AS(causal_visible_cells(Index{1} << 33), kvattn::overflow_error);
  CHECK_THROWS_AS(causal_visible_cells(std::numeric_limits<Index>::max()), std::overflow_error);
}

namespace {

// Bidirectional GQA attention written as loops: every query sees every key.
RowMatrix<double> plain_bidirectional(const GqaLayer<double>& layer, const RowMatrix<double>& x) {
  const GqaConfig& c = layer.config();
  const auto& w = layer.weights();
  const RowMatrix<double> q = x * w.w_q, k = x * w.w_k, v = x * w.w_v;
  const Index L = x.rows(), dh = c.head_dim;
  RowMatrix<double> heads = RowMatrix<double>::Zero(L, c.n_heads * dh);
  for (Index h = 0; h < c.n_heads; ++h) {
    const Index g = h / c.group_size();
    for (Index i = 0; i < L; ++i) {
      std::vector<double> logits(static_cast<std::size_t>(L));
      double max_logit = -std::numeric_limits<double>::infinity();
      for (Index j = 0; j < L; ++j) {
        double dot = 0;
        for (Index e = 0; e < dh; ++e) dot += q(i, h * dh + e) * k(j, g * dh + e);
        logits[std::size_t(j)] = dot / std::sqrt(double(dh));
        max_logit = std::max(max_logit, logits[std::size_t(j)]);
      }
      double sum = 0;
      for (auto& l : logits) sum += (l = std::exp(l - max_logit));
      for (Index j = 0; j < L; ++j) {
        for (Index e = 0; e < dh; ++e) {
          heads(i, h * dh + e) += logits[std::size_t(j)] / sum * v(j, g * dh + e);
        }
      }
    }
  }
  return heads * w.w_o;
}

}  // namespace

TEST_CASE("self-attention pooling is the bidirectional layer, then the mean", "[pooling]") {
  const auto layer = GqaLayer<double>::random(gqa_config(8, 4, 3, 2), 2);
  const RowMatrix<double> x = test::random_input<double>(7, 8, 3);
  const RowMatrix<double> full = plain_bidirectional(layer, x);
  // Mean over tokens 2..6 written out; tokens 0, 1 (an instruction) still shape them.
  RowVector<double> want = RowVector<double>::Zero(8);
  for (Index i = 2; i < 7; ++i) want += full.row(i) / 5.0;
  CHECK(test::relative_error(self_attention_pool(layer, x, skip_prefix(7, 2)), want) < 1e-13);
  CHECK(test::relative_error(self_attention_pool(layer, x),
                             RowVector<double>(full.colwise().mean())) < 1e-13);
  const RowMatrix<double> empty(0, 8);
  CHECK_THROWS_AS(self_attention_pool(layer, empty), pooling_error);
  CHECK_THROWS_AS(self_attention_pool(layer, x, TokenMask(7, false)), pooling_error);
  const RowMatrix<double> wide(3, 9);
  CHECK_THROWS_WITH(self_attention_pool(layer, wide),
                    Catch::Matchers::Contains("expected (any x 8)"));
}
