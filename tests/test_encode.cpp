// Bidirectional encoding (seed 002, Chapter 6): encode(layer, x) equals the expanded
// reference run with Mask::bidirectional() for every mechanism; the causal visible
// fraction; self-attention pooling is the bidirectional forward followed by the mean.
#include <catch2/catch.hpp>
#include <random>

#include "kvattn/attention/encode.hpp"
#include "kvattn/reference/gqa.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "kvattn/reference/mla.hpp"
#include "test_lrkv_util.hpp"
#include "test_util.hpp"

using namespace kvattn;

TEST_CASE("causal visible fraction is 1/2 + 1/(2N)", "[encode]") {
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
}

TEST_CASE("GQA-family encode equals the bidirectional reference", "[encode]") {
  RopeConfig rope{RopeLayout::interleaved, 10000.0, 3};
  for (GqaConfig c :
       {mha_config(12, 3, 4), gqa_config(10, 6, 4, 2, rope), mqa_config(9, 5, 6, rope)}) {
    c.qkv_bias = c.n_kv_heads == 2;
    CAPTURE(c.d_model, c.n_heads, c.n_kv_heads, c.head_dim);
    const auto layer = GqaLayer<double>::random(c, 11);
    for (const Index length : {1, 2, 13}) {
      const RowMatrix<double> x = test::random_input<double>(length, c.d_model, 5 + length);
      const RowMatrix<double> want = reference::forward(layer, x, Mask::bidirectional());
      CHECK(test::relative_error(encode(layer, x), want) < 1e-13);
      if (length > 1) {  // not the causal forward
        CHECK(test::relative_error(reference::forward(layer, x), want) > 1e-3);
      }
    }
    const auto layer_f = GqaLayer<float>(c, layer.weights().cast<float>());
    const RowMatrix<double> x = test::random_input<double>(9, c.d_model, 1);
    const RowMatrix<float> xf = x.cast<float>();
    CHECK(test::relative_error(encode(layer_f, xf),
                               reference::forward(layer, x, Mask::bidirectional())) < 1e-5);
  }
}

TEST_CASE("MLA encode equals the bidirectional reference", "[encode]") {
  MlaConfig c;
  c.d_model = 16;
  c.n_heads = 3;
  c.kv_rank = 6;
  c.qk_nope_dim = 4;
  c.rope_dim = 4;
  c.v_dim = 5;
  c.rope = {RopeLayout::interleaved, 10000.0, 2};
  for (const Index q_rank : {0, 7}) {
    c.q_rank = q_rank;
    c.q_norm = q_rank > 0;
    CAPTURE(q_rank);
    const auto layer = MlaLayer<double>::random(c, 3);
    const RowMatrix<double> x = test::random_input<double>(11, c.d_model, 4);
    CHECK(test::relative_error(encode(layer, x),
                               reference::forward(layer, x, Mask::bidirectional())) < 1e-13);
  }
}

TEST_CASE("LRKV encode equals the bidirectional reference in every rope mode", "[encode]") {
  std::mt19937_64 rng(77);
  for (const LrkvRopeMode mode : {LrkvRopeMode::none, LrkvRopeMode::shared, LrkvRopeMode::decoupled,
                                  LrkvRopeMode::full, LrkvRopeMode::commuting}) {
    for (const bool key_norm : {false, true}) {
      const LrkvConfig c = test::random_lrkv_config(rng, mode, key_norm);
      CAPTURE(to_string(mode), key_norm, c.d_model, c.n_heads, c.head_dim, c.rank);
      const auto layer = LrkvLayer<double>::random(c, 9, 0.7);
      const RowMatrix<double> x = test::random_input<double>(10, c.d_model, 8);
      CHECK(test::relative_error(encode(layer, x),
                                 reference::forward(layer, x, Mask::bidirectional())) < 1e-12);
    }
  }
}

TEST_CASE("self-attention pooling is the bidirectional forward, then the mean",
          "[encode][pooling]") {
  const auto layer = GqaLayer<double>::random(gqa_config(8, 4, 3, 2), 2);
  const RowMatrix<double> x = test::random_input<double>(7, 8, 3);
  const RowMatrix<double> full = reference::forward(layer, x, Mask::bidirectional());
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
  CHECK_THROWS_WITH(encode(layer, wide), Catch::Matchers::Contains("expected (any x 8)"));
}
