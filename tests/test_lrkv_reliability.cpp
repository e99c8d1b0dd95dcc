// [reliability][lrkv]: every invalid config throws config_error naming its field, every
// wrong shape throws shape_error naming both shapes, no factored path computes a model
// other than the one configured, and extreme inputs stay finite.
#include <catch2/catch.hpp>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/lrkv_from_mha.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "test_util.hpp"

using namespace kvattn;
using Catch::Matchers::Contains;

namespace {

LrkvConfig valid_config() {
  LrkvConfig c{12, 3, 4, 2, LrkvRopeMode::commuting, {RopeLayout::half_split, 10000.0, 0}};
  c.key_norm = true;
  return c;
}

}  // namespace

TEST_CASE("Invalid LRKV configs throw config_error naming the field", "[reliability][lrkv]") {
  REQUIRE_NOTHROW(valid_config().validate());
  std::vector<std::pair<std::string, std::function<void(LrkvConfig&)>>> cases = {
      {"d_model", [](LrkvConfig& c) { c.d_model = 0; }},
      {"n_heads", [](LrkvConfig& c) { c.n_heads = 0; }},
      {"head_dim", [](LrkvConfig& c) { c.head_dim = 0; }},
      {"rank", [](LrkvConfig& c) { c.rank = -1; }},
      {"rank", [](LrkvConfig& c) { c.rank = 6; }},  // > head_dim
      {"rank", [](LrkvConfig& c) { c.rank = 1; }},  // odd with commuting
      {"head_dim",
       [](LrkvConfig& c) {
         c.head_dim = 3;
         c.rank = 2;
       }},  // odd with RoPE
      {"rope.layout", [](LrkvConfig& c) { c.rope.layout = RopeLayout::none; }},
      {"rope.layout", [](LrkvConfig& c) { c.rope_mode = LrkvRopeMode::none; }},
      {"rope.theta", [](LrkvConfig& c) { c.rope.theta = 0.5; }},
      {"rope.position_offset", [](LrkvConfig& c) { c.rope.position_offset = -1; }},
      {"rope_dim", [](LrkvConfig& c) { c.rope_dim = 2; }},  // only for decoupled
      {"rope_dim",
       [](LrkvConfig& c) {
         c.rope_mode = LrkvRopeMode::decoupled;
         c.rope_dim = 3;
       }},
      {"rope_dim", [](LrkvConfig& c) { c.rope_mode = LrkvRopeMode::decoupled; }},  // d_R = 0
      {"key_norm_epsilon", [](LrkvConfig& c) { c.key_norm_epsilon = 0.0; }},
      {"softmax_scale", [](LrkvConfig& c) { c.softmax_scale = -1.0; }},
  };
  for (const auto& [field, breaks] : cases) {
    LrkvConfig c = valid_config();
    breaks(c);
    CAPTURE(field);
    REQUIRE_THROWS_AS(c.validate(), config_error);
    REQUIRE_THROWS_WITH(c.validate(), Contains(field) && Contains("LrkvConfig"));
    REQUIRE_THROWS_AS(LrkvCache<float>(c), config_error);
    REQUIRE_THROWS_AS(LrkvLayer<float>::random(c, 1), config_error);
  }
  REQUIRE_THROWS_WITH(LrkvWeights<float>::random(valid_config(), 1, -0.1),
                      Contains("residual_scale"));
}

TEST_CASE("Wrong shapes to every LRKV call throw shape_error naming both shapes",
          "[reliability][lrkv]") {
  const LrkvConfig c = valid_config();
  const auto layer = LrkvLayer<double>::random(c, 1);
  auto cache = layer.make_cache();
  const RowMatrix<double> bad_x = RowMatrix<double>::Ones(3, 11);
  REQUIRE_THROWS_AS(layer.prefill(bad_x, cache), shape_error);
  REQUIRE_THROWS_WITH(layer.prefill(bad_x, cache), Contains("(3 x 11)") && Contains("(any x 12)"));
  const RowVector<double> bad_row = RowVector<double>::Ones(11),
                          good_row = RowVector<double>::Ones(12);
  REQUIRE_THROWS_WITH(layer.decode(bad_row, cache), Contains("(1 x 11)") && Contains("(1 x 12)"));
  const RowMatrix<double> two_rows = RowMatrix<double>::Ones(2, 12);
  REQUIRE_THROWS_WITH(layer.decode(two_rows, cache), Contains("(2 x 12)") && Contains("(1 x 12)"));
  RowMatrix<double> two_row_out(2, 12);
  REQUIRE_THROWS_AS(layer.decode(good_row, cache, two_row_out), shape_error);
  RowVector<double> bad_out(13);
  REQUIRE_THROWS_WITH(layer.decode(good_row, cache, bad_out),
                      Contains("out") && Contains("(1 x 13)") && Contains("(1 x 12)"));
  REQUIRE_THROWS_WITH(reference::forward(layer, bad_x), Contains("(3 x 11)"));
  CHECK(cache.tokens() == 0);

  // Raw append: every part checked.
  const RowMatrix<double> shared = RowMatrix<double>::Ones(2, 4),
                          latent = RowMatrix<double>::Ones(2, 6);
  const RowMatrix<double> none = RowMatrix<double>(2, 0), rms = RowMatrix<double>::Ones(2, 3);
  REQUIRE_NOTHROW(cache.append({shared, shared, latent, latent, none, rms}));
  REQUIRE_THROWS_WITH(cache.append({latent, shared, latent, latent, none, rms}),
                      Contains("shared_keys") && Contains("(2 x 6)") && Contains("(any x 4)"));
  REQUIRE_THROWS_WITH(cache.append({shared, shared.topRows(1), latent, latent, none, rms}),
                      Contains("shared_values") && Contains("(1 x 4)") && Contains("(2 x 4)"));
  REQUIRE_THROWS_WITH(cache.append({shared, shared, shared, latent, none, rms}),
                      Contains("residual_keys"));
  REQUIRE_THROWS_WITH(cache.append({shared, shared, latent, shared, none, rms}),
                      Contains("residual_values"));
  REQUIRE_THROWS_WITH(cache.append({shared, shared, latent, latent, shared, rms}),
                      Contains("rope_keys") && Contains("(2 x 0)"));
  REQUIRE_THROWS_WITH(cache.append({shared, shared, latent, latent, none, none}),
                      Contains("key_rms") && Contains("(2 x 3)"));
  REQUIRE_THROWS_AS(cache.truncate(3), shape_error);
  REQUIRE_THROWS_AS(cache.reserve(-1), shape_error);

  // Weights of the wrong shape.
  auto check_weights = [&](auto mutate, const char* name) {
    LrkvWeights<double> w = layer.weights();
    mutate(w);
    CAPTURE(name);
    REQUIRE_THROWS_AS(LrkvLayer<double>(c, w), shape_error);
    REQUIRE_THROWS_WITH(LrkvLayer<double>(c, w), Contains(name));
  };
  check_weights([](LrkvWeights<double>& w) { w.w_q.resize(12, 11); }, "w_q");
  check_weights([](LrkvWeights<double>& w) { w.w_k_shared.resize(12, 5); }, "w_k_shared");
  check_weights([](LrkvWeights<double>& w) { w.w_v_shared.resize(11, 4); }, "w_v_shared");
  check_weights([](LrkvWeights<double>& w) { w.u_k.resize(12, 5); }, "u_k");
  check_weights([](LrkvWeights<double>& w) { w.u_v.resize(12, 7); }, "u_v");
  check_weights([](LrkvWeights<double>& w) { w.basis_k.resize(5, 6); }, "basis_k");
  check_weights([](LrkvWeights<double>& w) { w.basis_v.resize(4, 5); }, "basis_v");
  check_weights([](LrkvWeights<double>& w) { w.w_o.resize(12, 13); }, "w_o");
  check_weights([](LrkvWeights<double>& w) { w.w_qr.resize(12, 3); }, "w_qr");
  check_weights([](LrkvWeights<double>& w) { w.w_kr.resize(12, 1); }, "w_kr");
  check_weights([](LrkvWeights<double>& w) { w.key_norm_gain.resize(5); }, "key_norm_gain");
}

TEST_CASE("A cache of another config, full RoPE, or a broken commuting B_h is refused",
          "[reliability][lrkv]") {
  const LrkvConfig c = valid_config();
  const auto layer = LrkvLayer<double>::random(c, 1);
  LrkvConfig other = c;
  other.rank = 4;
  auto wrong_cache = LrkvCache<double>(other);
  REQUIRE_THROWS_AS(layer.decode(RowVector<double>::Ones(12), wrong_cache), config_error);
  REQUIRE_THROWS_WITH(layer.prefill(RowMatrix<double>::Ones(2, 12), wrong_cache),
                      Contains("rank 4") && Contains("rank 2"));

  LrkvConfig full = c;
  full.rope_mode = LrkvRopeMode::full;
  const LrkvLayer<double> full_layer(full, layer.weights());
  auto full_cache = full_layer.make_cache();
  REQUIRE_THROWS_WITH(full_layer.decode(RowVector<double>::Ones(12), full_cache),
                      Contains("rope_mode full") && Contains("commuting"));

  // A B_h^K latent pair that is a reflection, or spans two planes, is not commuting.
  LrkvWeights<double> w = layer.weights();
  const auto [a, b] = detail::rope_plane_dims(RopeLayout::half_split, 4, 0);
  w.basis_k.col(0).setZero();
  w.basis_k.col(1).setZero();
  w.basis_k(a, 0) = 1.0;
  w.basis_k(b, 1) = -1.0;  // [[1, 0], [0, -1]]: a reflection
  REQUIRE_THROWS_AS(LrkvLayer<double>(c, w), config_error);
  REQUIRE_THROWS_WITH(LrkvLayer<double>(c, w), Contains("head 0") && Contains("scaled rotation"));
  w.basis_k(b, 1) = 1.0;  // a rotation by 0: fine
  REQUIRE_NOTHROW(LrkvLayer<double>(c, w));
  w.basis_k(1, 0) = 0.5;  // leaks into plane 1
  REQUIRE_THROWS_AS(LrkvLayer<double>(c, w), config_error);

  // Only MHA without biases maps onto LRKV.
  REQUIRE_THROWS_WITH(lrkv_from_mha(GqaLayer<double>::random(gqa_config(8, 4, 2, 2), 1)),
                      Contains("n_kv_heads"));
  GqaConfig biased = mha_config(8, 2, 4);
  biased.qkv_bias = true;
  REQUIRE_THROWS_WITH(lrkv_from_mha(GqaLayer<double>::random(biased, 1)), Contains("qkv_bias"));
}

TEST_CASE("Large LRKV logits stay finite and exact", "[reliability][lrkv]") {
  // Inputs of size 300 give logits of order 1e4 without key norm.
  for (const bool key_norm : {false, true}) {
    LrkvConfig c{6, 2, 4, 2, LrkvRopeMode::shared, {RopeLayout::interleaved, 10000.0, 0}};
    c.key_norm = key_norm;
    const auto layer = LrkvLayer<double>::random(c, 3, 0.7);
    const RowMatrix<double> x = 300.0 * test::random_input<double>(12, 6, 4);
    RowMatrix<double> got(12, 6);
    auto cache = layer.make_cache();
    got.topRows(5) = layer.prefill(x.topRows(5), cache);
    for (Index t = 5; t < 12; ++t) got.row(t) = layer.decode(x.row(t), cache);
    CAPTURE(key_norm);
    CHECK(got.allFinite());
    CHECK(test::relative_error(got, reference::forward(layer, x)) <= 1e-10);
  }
}

TEST_CASE("An empty LRKV prefill returns 0 x d and leaves the cache unchanged",
          "[reliability][lrkv]") {
  for (const LrkvRopeMode mode : {LrkvRopeMode::none, LrkvRopeMode::shared, LrkvRopeMode::decoupled,
                                  LrkvRopeMode::commuting}) {
    LrkvConfig c{6, 2, 4, 2, mode};
    if (mode != LrkvRopeMode::none) c.rope.layout = RopeLayout::half_split;
    if (mode == LrkvRopeMode::decoupled) c.rope_dim = 2;
    c.key_norm = true;
    const auto layer = LrkvLayer<double>::random(c, 1);
    auto cache = layer.make_cache();
    const RowMatrix<double> y = layer.prefill(RowMatrix<double>(0, 6), cache);
    CAPTURE(to_string(mode));
    CHECK(y.rows() == 0);
    CHECK(y.cols() == 6);
    CHECK(cache.tokens() == 0);
    CHECK(reference::forward(layer, RowMatrix<double>(0, 6)).rows() == 0);
    // Decoding into an empty cache attends to the new token alone (= a 1-token prefill).
    const RowMatrix<double> x = test::random_input<double>(1, 6, 2);
    const RowVector<double> out = layer.decode(x, cache);
    CHECK(test::relative_error(out, reference::forward(layer, x)) <= 1e-12);
  }
}
