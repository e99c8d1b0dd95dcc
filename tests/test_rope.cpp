// [rope]: rotary position embedding laws, both layouts.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "kvattn/attention/gqa.hpp"
#include "kvattn/core/rope.hpp"
#include "test_util.hpp"

using namespace kvattn;

TEST_CASE("RoPE matches the textbook rotation at a hand-checked point", "[rope]") {
  // dim 4, theta 100: inverse frequencies 1 and 100^(-1/2) = 0.1; position 3.
  const double c0 = std::cos(3.0), s0 = std::sin(3.0);
  const double c1 = std::cos(0.3), s1 = std::sin(0.3);
  RowVector<double> v(4);
  v << 1, 2, 3, 4;
  RowVector<double> half = v;
  Rope(RopeConfig{RopeLayout::half_split, 100.0, 0}, 4).rotate(half, 3.0);
  // half-split planes: (0, 2) at frequency 1, (1, 3) at frequency 0.1
  CHECK(half(0) == Approx(1 * c0 - 3 * s0).epsilon(1e-14));
  CHECK(half(2) == Approx(1 * s0 + 3 * c0).epsilon(1e-14));
  CHECK(half(1) == Approx(2 * c1 - 4 * s1).epsilon(1e-14));
  CHECK(half(3) == Approx(2 * s1 + 4 * c1).epsilon(1e-14));
  RowVector<double> inter = v;
  Rope(RopeConfig{RopeLayout::interleaved, 100.0, 0}, 4).rotate(inter, 3.0);
  // interleaved planes: (0, 1) at frequency 1, (2, 3) at frequency 0.1
  CHECK(inter(0) == Approx(1 * c0 - 2 * s0).epsilon(1e-14));
  CHECK(inter(1) == Approx(1 * s0 + 2 * c0).epsilon(1e-14));
  CHECK(inter(2) == Approx(3 * c1 - 4 * s1).epsilon(1e-14));
  CHECK(inter(3) == Approx(3 * s1 + 4 * c1).epsilon(1e-14));
}

TEST_CASE("RoPE preserves norms and q.k depends only on the position difference", "[rope]") {
  for (const auto layout : {RopeLayout::half_split, RopeLayout::interleaved}) {
    for (const Index dim : {2, 8, 64, 128}) {
      const Rope rope(RopeConfig{layout, 10000.0, 0}, dim);
      const RowMatrix<double> pair = kvattn::test::random_input<double>(2, dim, dim);
      CAPTURE(static_cast<int>(layout), dim);
      for (const double m : {0.0, 1.0, 17.0, 4095.0}) {
        RowVector<double> q = pair.row(0);
        rope.rotate(q, m);
        CHECK(q.norm() == Approx(pair.row(0).norm()).epsilon(1e-13));
        for (const double n : {0.0, 5.0, 300.0}) {
          RowVector<double> k = pair.row(1);
          rope.rotate(k, n);
          RowVector<double> q_shift = pair.row(0), k_shift = pair.row(1);
          rope.rotate(q_shift, m + 1000.0);
          rope.rotate(k_shift, n + 1000.0);
          CHECK(q.dot(k) == Approx(q_shift.dot(k_shift)).margin(1e-10));
        }
      }
    }
  }
}

TEST_CASE("Half-split and interleaved layouts give the same outputs after permuting weights",
          "[rope]") {
  auto config = gqa_config(48, 4, 16, 2, {RopeLayout::half_split, 10000.0, 11});
  config.qkv_bias = true;
  const auto half_layer = GqaLayer<double>::random(config, 21);
  // An interleaved vector u equals the half-split vector v when u[perm[j]] = v[j].
  const auto perm = interleaved_to_half_split(config.head_dim);
  auto weights = half_layer.weights();
  auto permute = [&](RowMatrix<double>& w, RowVector<double>& b, Index heads) {
    const RowMatrix<double> w_half = w;
    const RowVector<double> b_half = b;
    for (Index h = 0; h < heads; ++h) {
      for (Index j = 0; j < config.head_dim; ++j) {
        const Index to = h * config.head_dim + perm[static_cast<std::size_t>(j)];
        w.col(to) = w_half.col(h * config.head_dim + j);
        b(to) = b_half(h * config.head_dim + j);
      }
    }
  };
  permute(weights.w_q, weights.bias_q, config.n_heads);
  permute(weights.w_k, weights.bias_k, config.n_kv_heads);
  auto inter_config = config;
  inter_config.rope.layout = RopeLayout::interleaved;
  const GqaLayer<double> inter_layer(inter_config, weights);
  const RowMatrix<double> x = kvattn::test::random_input<double>(25, 48, 22);
  auto half_cache = half_layer.make_cache();
  auto inter_cache = inter_layer.make_cache();
  const RowMatrix<double> y_half = half_layer.prefill(x, half_cache);
  const RowMatrix<double> y_inter = inter_layer.prefill(x, inter_cache);
  CHECK(kvattn::test::relative_error(y_inter, y_half) <= 1e-13);
  // Without the permutation the two layouts are different models.
  const GqaLayer<double> unpermuted(inter_config, half_layer.weights());
  auto cache = unpermuted.make_cache();
  CHECK(kvattn::test::relative_error(unpermuted.prefill(x, cache), y_half) > 1e-3);
}
