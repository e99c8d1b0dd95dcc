// [reliability][gqa]: bad input gets a clear error and loses nothing.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <stdexcept>

#include "kvattn/attention/gqa.hpp"
#include "kvattn/reference/gqa.hpp"
#include "test_util.hpp"

using namespace kvattn;
using Catch::Matchers::Contains;

namespace {

// The layer under test: d_model 12, H 4, d_h 6, n_kv 2.
GqaConfig small_config() {
  auto c = gqa_config(12, 4, 6, 2, {RopeLayout::half_split, 10000.0, 0});
  c.qkv_bias = true;
  return c;
}

// Every scalar of the cache's cached tokens, for before/after comparisons.
RowMatrix<double> snapshot(const GqaCache<double>& cache) {
  const Index dh = cache.config().head_dim, n_kv = cache.config().n_kv_heads;
  RowMatrix<double> all(cache.tokens(), 2 * n_kv * dh);
  for (Index g = 0; g < n_kv; ++g) {
    all.middleCols(g * dh, dh) = cache.keys(g);
    all.middleCols((n_kv + g) * dh, dh) = cache.values(g);
  }
  return all;
}

}  // namespace

TEST_CASE("every wrong shape to a public call throws shape_error naming both shapes",
          "[reliability][gqa]") {
  const auto config = small_config();
  const auto layer = GqaLayer<double>::random(config, 1);
  auto cache = layer.make_cache();
  const RowMatrix<double> bad_x = RowMatrix<double>::Ones(3, 10);
  REQUIRE_THROWS_AS(layer.prefill(bad_x, cache), shape_error);
  REQUIRE_THROWS_WITH(layer.prefill(bad_x, cache),
                      Contains("x") && Contains("(3 x 10)") && Contains("(any x 12)"));
  const RowVector<double> bad_row = RowVector<double>::Ones(11);
  REQUIRE_THROWS_WITH(layer.decode(bad_row, cache), Contains("(1 x 11)") && Contains("(1 x 12)"));
  const RowMatrix<double> two_rows = RowMatrix<double>::Ones(2, 12);
  REQUIRE_THROWS_WITH(layer.decode(two_rows, cache), Contains("(2 x 12)") && Contains("(1 x 12)"));
  RowMatrix<double> out_two_rows(2, 12);
  REQUIRE_THROWS_WITH(layer.decode(two_rows.row(0), cache, out_two_rows),
                      Contains("out") && Contains("(2 x 12)") && Contains("(1 x 12)"));
  const RowVector<double> good_row = RowVector<double>::Ones(12);
  RowVector<double> bad_out(13);
  REQUIRE_THROWS_AS(layer.decode(good_row, cache, bad_out), shape_error);
  REQUIRE_THROWS_WITH(layer.decode(good_row, cache, bad_out),
                      Contains("out") && Contains("(1 x 13)") && Contains("(1 x 12)"));
  CHECK(cache.tokens() == 0);  // nothing was appended by the failed calls

  // Raw append: keys and values are n x (n_kv * d_h) = n x 12.
  const RowMatrix<double> keys = RowMatrix<double>::Ones(2, 12);
  const RowMatrix<double> narrow = RowMatrix<double>::Ones(2, 7);
  const RowMatrix<double> short_values = RowMatrix<double>::Ones(1, 12);
  REQUIRE_THROWS_WITH(cache.append(narrow, keys),
                      Contains("keys") && Contains("(2 x 7)") && Contains("(any x 12)"));
  REQUIRE_THROWS_WITH(cache.append(keys, short_values),
                      Contains("values") && Contains("(1 x 12)") && Contains("(2 x 12)"));
  REQUIRE_THROWS_AS(reference::forward(layer, bad_x), shape_error);

  // Weights that do not fit the config.
  auto weights = layer.weights();
  weights.w_k = RowMatrix<double>::Ones(12, 6);
  REQUIRE_THROWS_WITH(GqaLayer<double>(config, weights),
                      Contains("w_k") && Contains("(12 x 6)") && Contains("(12 x 12)"));
  weights = layer.weights();
  weights.w_o = RowMatrix<double>::Ones(24, 11);
  REQUIRE_THROWS_WITH(GqaLayer<double>(config, weights),
                      Contains("w_o") && Contains("(24 x 11)") && Contains("(24 x 12)"));
  weights = layer.weights();
  weights.bias_q = RowVector<double>::Ones(5);
  REQUIRE_THROWS_WITH(GqaLayer<double>(config, weights),
                      Contains("bias_q") && Contains("(1 x 5)") && Contains("(1 x 24)"));
  weights = layer.weights();
  weights.w_q = RowMatrix<double>::Ones(11, 24);
  REQUIRE_THROWS_AS(GqaLayer<double>(config, weights), shape_error);
  weights = layer.weights();
  weights.w_v = RowMatrix<double>::Ones(12, 13);
  REQUIRE_THROWS_AS(GqaLayer<double>(config, weights), shape_error);
  auto no_bias = config;
  no_bias.qkv_bias = false;
  REQUIRE_THROWS_WITH(GqaLayer<double>(no_bias, layer.weights()),
                      Contains("bias_q") && Contains("(1 x 24)") && Contains("(any x 0)"));

  REQUIRE_THROWS_AS(cache.truncate(1), shape_error);
  REQUIRE_THROWS_AS(cache.reserve(-1), shape_error);
}

TEST_CASE("every invalid config throws config_error naming the field", "[reliability][gqa]") {
  auto expect_error = [](GqaConfig c, const char* field) {
    CAPTURE(field);
    REQUIRE_THROWS_AS(c.validate(), config_error);
    REQUIRE_THROWS_WITH(c.validate(), Contains(field));
    REQUIRE_THROWS_AS(GqaLayer<float>::random(c, 1), config_error);
    REQUIRE_THROWS_AS(GqaCache<float>(c), config_error);
  };
  const auto good = small_config();
  REQUIRE_NOTHROW(good.validate());
  auto c = good;
  c.d_model = 0;
  expect_error(c, "d_model");
  c = good;
  c.n_heads = -2;
  expect_error(c, "n_heads");
  c = good;
  c.head_dim = 0;
  expect_error(c, "head_dim");
  c = good;
  c.n_kv_heads = 0;
  expect_error(c, "n_kv_heads");
  c = good;
  c.n_kv_heads = 3;  // 4 heads are not divisible by 3
  expect_error(c, "n_heads (4) must be divisible by n_kv_heads (3)");
  c = good;
  c.n_kv_heads = 8;  // more KV heads than query heads
  expect_error(c, "n_kv_heads");
  c = good;
  c.head_dim = 5;  // RoPE needs pairs
  expect_error(c, "head_dim (5) must be even");
  c = good;
  c.rope.theta = 1.0;
  expect_error(c, "rope.theta");
  c = good;
  c.rope.theta = std::numeric_limits<double>::infinity();
  expect_error(c, "rope.theta");
  c = good;
  c.rope.position_offset = -1;
  expect_error(c, "rope.position_offset");
  c = good;
  c.softmax_scale = -0.5;
  expect_error(c, "softmax_scale");
  c = good;
  c.softmax_scale = std::nan("");
  expect_error(c, "softmax_scale");
}

TEST_CASE("decoding into a cache made for another config throws", "[reliability][gqa]") {
  const auto layer = GqaLayer<double>::random(small_config(), 1);
  auto other = small_config();
  other.n_kv_heads = 4;
  GqaCache<double> foreign(other);
  const RowVector<double> x = RowVector<double>::Ones(12);
  REQUIRE_THROWS_AS(layer.decode(x, foreign), config_error);
  REQUIRE_THROWS_WITH(layer.decode(x, foreign),
                      Contains("n_kv_heads 4") && Contains("n_kv_heads 2"));
  REQUIRE_THROWS_AS(layer.prefill(RowMatrix<double>::Ones(2, 12), foreign), config_error);
  auto rotated = small_config();
  rotated.rope.position_offset = 5;  // same shapes, keys rotated differently
  GqaCache<double> shifted(rotated);
  REQUIRE_THROWS_AS(layer.decode(x, shifted), config_error);
  CHECK(foreign.tokens() == 0);
  CHECK(shifted.tokens() == 0);
}

TEST_CASE("a failed append or reserve leaves the cache exactly as it was", "[reliability][gqa]") {
  const auto layer = GqaLayer<double>::random(small_config(), 2);
  auto cache = layer.make_cache();
  layer.prefill(kvattn::test::random_input<double>(5, 12, 3), cache);
  const RowMatrix<double> before = snapshot(cache);
  const Index capacity = cache.capacity();
  const std::size_t bytes = cache.bytes();

  CHECK_THROWS_AS(cache.append(RowMatrix<double>::Ones(2, 12), RowMatrix<double>::Ones(3, 12)),
                  shape_error);
  // An allocation that cannot succeed: kvattn::length_error (a std::length_error) before
  // any memory is touched.
  CHECK_THROWS_AS(cache.reserve(std::numeric_limits<Index>::max() / 4), kvattn::length_error);
  CHECK_THROWS_AS(layer.prefill(RowMatrix<double>::Ones(2, 13), cache), shape_error);

  CHECK(cache.tokens() == 5);
  CHECK(cache.capacity() == capacity);
  CHECK(cache.bytes() == bytes);
  CHECK((snapshot(cache) - before).norm() == 0.0);
  // And it still decodes exactly.
  const RowMatrix<double> x = kvattn::test::random_input<double>(6, 12, 3);
  const RowVector<double> y = layer.decode(x.row(5), cache);
  CHECK(kvattn::test::relative_error(y, reference::forward(layer, x).row(5)) <= 1e-12);
}

TEST_CASE("an empty prefill is a no-op and a fully masked query gives zeros",
          "[reliability][gqa]") {
  const auto layer = GqaLayer<double>::random(small_config(), 4);
  auto cache = layer.make_cache();
  const RowMatrix<double> empty(0, 12);
  CHECK(layer.prefill(empty, cache).rows() == 0);
  CHECK(cache.tokens() == 0);
  // reference::attention with a query that sees no key (bidirectional over an empty
  // key set) returns zeros, the documented result of a fully masked row.
  const RowMatrix<double> q = RowMatrix<double>::Ones(2, 4);
  const RowMatrix<double> k(0, 4), v(0, 3);
  const RowMatrix<double> out = reference::attention<double>(q, k, v, 1.0, Mask::causal());
  CHECK(out.rows() == 2);
  CHECK(out.cols() == 3);
  CHECK(out.isZero(0.0));
}

TEST_CASE("a later token's NaN never reaches an earlier output", "[reliability][gqa]") {
  const auto layer = GqaLayer<double>::random(small_config(), 5);
  RowMatrix<double> x = kvattn::test::random_input<double>(70, 12, 6);
  x(69, 3) = std::numeric_limits<double>::quiet_NaN();
  x(40, 0) = std::numeric_limits<double>::infinity();
  auto cache = layer.make_cache();
  const RowMatrix<double> y = layer.prefill(x, cache);
  CHECK(y.topRows(40).allFinite());
  const RowMatrix<double> expected = reference::forward(layer, x.topRows(40));
  CHECK(kvattn::test::relative_error(y.topRows(40), expected) <= 1e-12);
  CHECK(reference::forward(layer, x).topRows(40).allFinite());
  CHECK(y.row(69).hasNaN());  // and NaN stays visible where it belongs
}
