// [reliability][mla]: wrong shapes and invalid configurations throw, with messages
// that name what was wrong, as for the GQA family.
#include <catch2/catch.hpp>

#include <functional>
#include <limits>
#include <string>

#include "kvattn/attention/mla.hpp"
#include "kvattn/reference/mla.hpp"
#include "test_util.hpp"

using namespace kvattn;
using Catch::Matchers::Contains;

namespace {

MlaConfig valid_config() {
  MlaConfig c;
  c.d_model = 20;
  c.n_heads = 3;
  c.kv_rank = 10;
  c.q_rank = 12;
  c.q_norm = true;
  c.qk_nope_dim = 8;
  c.rope_dim = 6;
  c.v_dim = 5;
  c.rope = {RopeLayout::half_split, 10000.0, 0};
  c.yarn = {true, 8.0, 256, 32.0, 1.0, 1.0, 1.0};
  return c;
}

}  // namespace

TEST_CASE("MLA: every invalid config throws config_error naming the field", "[reliability][mla]") {
  CHECK_NOTHROW(valid_config().validate());
  struct Broken {
    const char* field;
    std::function<void(MlaConfig&)> edit;
  };
  const Broken broken[] = {
      {"d_model", [](MlaConfig& c) { c.d_model = 0; }},
      {"n_heads", [](MlaConfig& c) { c.n_heads = 0; }},
      {"kv_rank", [](MlaConfig& c) { c.kv_rank = 0; }},
      {"q_rank", [](MlaConfig& c) { c.q_rank = -1; }},
      {"q_rank", [](MlaConfig& c) { c.q_rank = 0; }},  // q_norm without a query latent
      {"qk_nope_dim", [](MlaConfig& c) { c.qk_nope_dim = 0; }},
      {"rope_dim", [](MlaConfig& c) { c.rope_dim = -2; }},
      {"rope_dim", [](MlaConfig& c) { c.rope_dim = 5; }},  // odd with RoPE on
      {"rope_dim", [](MlaConfig& c) { c.rope_dim = 0; }},  // RoPE on, no channel
      {"v_dim", [](MlaConfig& c) { c.v_dim = 0; }},
      {"norm_epsilon", [](MlaConfig& c) { c.norm_epsilon = 0.0; }},
      {"norm_epsilon",
       [](MlaConfig& c) { c.norm_epsilon = std::numeric_limits<double>::quiet_NaN(); }},
      {"softmax_scale", [](MlaConfig& c) { c.softmax_scale = -1.0; }},
      {"softmax_scale",
       [](MlaConfig& c) { c.softmax_scale = std::numeric_limits<double>::infinity(); }},
      {"rope.theta", [](MlaConfig& c) { c.rope.theta = 1.0; }},
      {"rope.position_offset", [](MlaConfig& c) { c.rope.position_offset = -1; }},
      {"yarn.factor", [](MlaConfig& c) { c.yarn.factor = 0.5; }},
      {"yarn.original_max_position", [](MlaConfig& c) { c.yarn.original_max_position = 0; }},
      {"yarn.beta_fast", [](MlaConfig& c) { c.yarn.beta_fast = 0.0; }},
      {"yarn.beta_slow", [](MlaConfig& c) { c.yarn.beta_slow = 40.0; }},  // >= beta_fast
      {"yarn.mscale", [](MlaConfig& c) { c.yarn.mscale = -0.1; }},
      {"yarn.mscale_all_dim", [](MlaConfig& c) { c.yarn.mscale_all_dim = -1.0; }},
      {"yarn.enabled", [](MlaConfig& c) { c.rope.layout = RopeLayout::none; }},  // YaRN, no RoPE
  };
  for (const auto& b : broken) {
    MlaConfig c = valid_config();
    b.edit(c);
    CAPTURE(b.field);
    CHECK_THROWS_AS(c.validate(), config_error);
    CHECK_THROWS_WITH(c.validate(), Contains("MlaConfig") && Contains(b.field));
    // Every constructor validates too.
    CHECK_THROWS_AS(MlaCache<float>(c), config_error);
    CHECK_THROWS_AS(MlaWeights<float>::random(c, 1), config_error);
  }
  // Config errors are std::invalid_argument.
  MlaConfig c = valid_config();
  c.n_heads = 0;
  CHECK_THROWS_AS(c.validate(), std::invalid_argument);
  // Legal corner cases: no rope channel at all, an un-rotated rope channel, no norms.
  MlaConfig no_rope = valid_config();
  no_rope.rope.layout = RopeLayout::none;
  no_rope.yarn.enabled = false;
  no_rope.rope_dim = 0;
  CHECK_NOTHROW(no_rope.validate());
  no_rope.rope_dim = 3;
  CHECK_NOTHROW(no_rope.validate());
  no_rope.q_norm = false;
  no_rope.kv_norm = false;
  no_rope.q_rank = 0;
  CHECK_NOTHROW(no_rope.validate());
}

TEST_CASE("MLA: wrong weight shapes throw shape_error naming both shapes", "[reliability][mla]") {
  const MlaConfig c = valid_config();
  const auto good = MlaWeights<double>::random(c, 1);
  CHECK_NOTHROW(MlaLayer<double>(c, good));
  auto expect_bad = [&c](const MlaWeights<double>& w, const char* name, const char* actual,
                         const char* expected) {
    CAPTURE(name);
    CHECK_THROWS_AS(MlaLayer<double>(c, w), shape_error);
    CHECK_THROWS_WITH(MlaLayer<double>(c, w),
                      Contains(name) && Contains(actual) && Contains(expected));
  };
  auto w = good;
  w.w_dq.resize(20, 11);
  expect_bad(w, "w_dq", "(20 x 11)", "(20 x 12)");
  w = good;
  w.q_norm_gain.resize(0);
  expect_bad(w, "q_norm_gain", "(1 x 0)", "(1 x 12)");
  w = good;
  w.w_uq.resize(12, 3 * 14 - 1);
  expect_bad(w, "w_uq", "(12 x 41)", "(12 x 42)");
  w = good;
  w.w_q.resize(20, 42);  // must stay empty with query compression
  expect_bad(w, "w_q", "(20 x 42)", "(0 x 0)");
  w = good;
  w.w_dkv.resize(19, 10);
  expect_bad(w, "w_dkv", "(19 x 10)", "(20 x 10)");
  w = good;
  w.kv_norm_gain.resize(9);
  expect_bad(w, "kv_norm_gain", "(1 x 9)", "(1 x 10)");
  w = good;
  w.w_kr.resize(20, 4);
  expect_bad(w, "w_kr", "(20 x 4)", "(20 x 6)");
  w = good;
  w.w_uk.resize(10, 23);
  expect_bad(w, "w_uk", "(10 x 23)", "(10 x 24)");
  w = good;
  w.w_uv.resize(10, 16);
  expect_bad(w, "w_uv", "(10 x 16)", "(10 x 15)");
  w = good;
  w.w_o.resize(15, 21);
  expect_bad(w, "w_o", "(15 x 21)", "(15 x 20)");
}

TEST_CASE("MLA: wrong input shapes to every call throw shape_error naming both shapes",
          "[reliability][mla]") {
  const MlaConfig c = valid_config();
  const auto layer = MlaLayer<double>::random(c, 2);
  auto cache = layer.make_cache();
  const RowMatrix<double> x = kvattn::test::random_input<double>(4, 20, 3);
  layer.prefill(x, cache);
  const RowMatrix<double> cache_before = cache.rows();

  const RowMatrix<double> wide(5, 21);
  CHECK_THROWS_AS(layer.prefill(wide, cache), shape_error);
  CHECK_THROWS_WITH(layer.prefill(wide, cache),
                    Contains("prefill") && Contains("(5 x 21)") && Contains("(any x 20)"));
  const RowVector<double> row21 = RowVector<double>::Zero(21);
  RowVector<double> out(20), out_wrong(19);
  CHECK_THROWS_WITH(layer.decode(row21, cache, out),
                    Contains("decode") && Contains("(1 x 21)") && Contains("(1 x 20)"));
  CHECK_THROWS_AS(layer.decode(row21, cache), shape_error);
  CHECK_THROWS_WITH(layer.decode(x.row(0), cache, out_wrong),
                    Contains("out") && Contains("(1 x 19)") && Contains("(1 x 20)"));
  CHECK_THROWS_WITH(reference::forward(layer, wide),
                    Contains("(5 x 21)") && Contains("(any x 20)"));
  CHECK_THROWS_WITH(cache.append(RowMatrix<double>::Zero(2, 9), RowMatrix<double>::Zero(2, 6)),
                    Contains("latent") && Contains("(2 x 9)") && Contains("(any x 10)"));
  CHECK_THROWS_WITH(cache.append(RowMatrix<double>::Zero(2, 10), RowMatrix<double>::Zero(1, 6)),
                    Contains("rope_keys") && Contains("(1 x 6)") && Contains("(2 x 6)"));
  CHECK_THROWS_AS(cache.reserve(-1), shape_error);
  CHECK_THROWS_AS(cache.truncate(5), shape_error);
  CHECK_THROWS_AS(cache.truncate(-1), shape_error);
  // Nothing above changed the cache.
  CHECK(cache.tokens() == 4);
  CHECK(RowMatrix<double>(cache.rows()) == cache_before);
}

TEST_CASE("MLA: a cache made for another config is refused", "[reliability][mla]") {
  const MlaConfig c = valid_config();
  const auto layer = MlaLayer<double>::random(c, 4);
  MlaConfig other = c;
  other.yarn.factor = 4.0;  // same shapes, other rope: still a different cache
  MlaCache<double> foreign(other);
  const RowMatrix<double> x = kvattn::test::random_input<double>(2, 20, 5);
  CHECK_THROWS_AS(layer.prefill(x, foreign), config_error);
  CHECK_THROWS_AS(layer.decode(x.row(0), foreign), config_error);
  MlaConfig narrower = c;
  narrower.kv_rank = 9;
  MlaCache<double> small(narrower);
  CHECK_THROWS_WITH(layer.decode(x.row(0), small), Contains("kv_rank 9") && Contains("kv_rank 10"));
  CHECK(foreign.tokens() == 0);
  CHECK(small.tokens() == 0);
}

TEST_CASE("MLA: non-finite inputs give NaN outputs, large finite inputs stay finite",
          "[reliability][mla]") {
  MlaConfig c = valid_config();
  const auto layer = MlaLayer<double>::random(c, 6);
  RowMatrix<double> x = kvattn::test::random_input<double>(30, 20, 7);
  // Large but finite inputs: RMSNorm bounds the latents, logits grow but the
  // online softmax stays finite and matches the reference.
  const RowMatrix<double> big = x * 1e3;
  auto cache = layer.make_cache();
  RowMatrix<double> y(30, 20);
  y.topRows(10) = layer.prefill(big.topRows(10), cache);
  for (Index t = 10; t < 30; ++t) y.row(t) = layer.decode(big.row(t), cache);
  CHECK(y.allFinite());
  CHECK(kvattn::test::relative_error(y, reference::forward(layer, big)) <= 1e-10);
  // A NaN input makes the outputs that see it NaN (bad input is not silently dropped).
  x(5, 3) = std::numeric_limits<double>::quiet_NaN();
  for (const MlaPrefill mode : {MlaPrefill::expanded, MlaPrefill::absorbed}) {
    CAPTURE(static_cast<int>(mode));
    auto nan_cache = layer.make_cache();
    const RowMatrix<double> nan_y = layer.prefill(x.topRows(10), nan_cache, {}, mode);
    CHECK(nan_y.topRows(5).allFinite());  // causal: earlier tokens never see it
    CHECK(nan_y.row(5).hasNaN());
    CHECK(layer.decode(x.row(10), nan_cache).hasNaN());
  }
}
