// [reference][decode_step]: the expanded reference decode steps (reference::decode_step
// of GQA, MLA and LRKV: per-head outputs of the newest cached token, computed from the
// cache the expanded way) equal the last row of reference::forward over the same
// tokens, after W_O; and they reject wrong shapes, empty caches, foreign caches and
// unsupported LRKV rope modes.
#include <catch2/catch.hpp>

#include <algorithm>
#include <random>
#include <string>

#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"
#include "kvattn/core/rms_norm.hpp"
#include "kvattn/reference/gqa.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "kvattn/reference/mla.hpp"

using namespace kvattn;

namespace {

template <class A, class B>
double relative_error(const A& got, const B& want) {
  const double scale = std::max(1e-300, static_cast<double>(want.cwiseAbs().maxCoeff()));
  return static_cast<double>((got - want).cwiseAbs().maxCoeff()) / scale;
}

template <class T>
RowMatrix<T> random_input(Index rows, Index cols, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  return random_normal<T>(rows, cols, rng);
}

// The projected query of token i: x W_Q (+ bias_q), before RoPE.
template <class T>
RowMatrix<T> gqa_query(const GqaLayer<T>& layer, const RowMatrix<T>& x, Index i) {
  RowMatrix<T> q = x.row(i) * layer.weights().w_q;
  if (layer.config().qkv_bias) q += layer.weights().bias_q;
  return q;
}

// [q_h^nope | q_h^R] of token i, through the normalized query latent when q_rank > 0.
template <class T>
RowMatrix<T> mla_query(const MlaLayer<T>& layer, const RowMatrix<T>& x, Index i) {
  const MlaConfig& c = layer.config();
  const MlaWeights<T>& w = layer.weights();
  if (c.q_rank == 0) return x.row(i) * w.w_q;
  RowMatrix<T> c_q = x.row(i) * w.w_dq;
  if (c.q_norm) rms_norm_inplace(c_q.data(), c.q_rank, w.q_norm_gain.data(), c.norm_epsilon);
  return c_q * w.w_uq;
}

// Token i's query in attend's layout: head h's [x W_Q_h | x W_QR_h] in columns
// [h*(d_h+d_R), (h+1)*(d_h+d_R)).
template <class T>
RowMatrix<T> lrkv_query(const LrkvLayer<T>& layer, const RowMatrix<T>& x, Index i) {
  const LrkvConfig& c = layer.config();
  const Index dh = c.head_dim, dr = c.decoupled_dim();
  const RowMatrix<T> content = x.row(i) * layer.weights().w_q;
  const RowMatrix<T> rope = x.row(i) * layer.weights().w_qr;
  RowMatrix<T> q(1, c.n_heads * (dh + dr));
  for (Index h = 0; h < c.n_heads; ++h) {
    q.middleCols(h * (dh + dr), dh) = content.middleCols(h * dh, dh);
    q.middleCols(h * (dh + dr) + dh, dr) = rope.middleCols(h * dr, dr);
  }
  return q;
}

// Prefills all of x, then checks decode_step(newest) W_O against forward's last row.
template <class Layer, class Query>
double check_against_forward(const Layer& layer, const RowMatrix<double>& x, Query query) {
  auto cache = layer.make_cache();
  (void)layer.prefill(x, cache);
  const Index last = x.rows() - 1;
  const RowMatrix<double> heads = reference::decode_step(layer, cache, query(layer, x, last));
  const RowMatrix<double> want = reference::forward(layer, x).row(last);
  return relative_error(RowMatrix<double>(heads * layer.weights().w_o), want);
}

MlaConfig small_mla(bool compressed) {
  MlaConfig c;
  c.d_model = 24;
  c.n_heads = 3;
  c.kv_rank = 8;
  c.q_rank = compressed ? 6 : 0;
  c.q_norm = compressed;
  c.qk_nope_dim = 4;
  c.rope_dim = 4;
  c.v_dim = 5;
  c.rope = {RopeLayout::interleaved, 10000.0, 3};
  c.yarn = {true, 4.0, 8, 32.0, 1.0, 0.707, 0.707};
  return c;
}

LrkvConfig small_lrkv(LrkvRopeMode mode, bool key_norm) {
  LrkvConfig c;
  c.d_model = 20;
  c.n_heads = 3;
  c.head_dim = 6;
  c.rank = 3;
  c.rope_mode = mode;
  if (mode != LrkvRopeMode::none) c.rope = {RopeLayout::half_split, 10000.0, 2};
  if (mode == LrkvRopeMode::decoupled) c.rope_dim = 4;
  if (mode == LrkvRopeMode::commuting) c.rank = 2;
  c.key_norm = key_norm;
  return c;
}

}  // namespace

TEST_CASE("GQA decode_step equals the reference forward's last token", "[reference][decode_step]") {
  const RopeConfig rope{RopeLayout::half_split, 10000.0, 5};
  GqaConfig gqa = gqa_config(24, 4, 6, 2, rope);
  gqa.qkv_bias = true;
  const GqaConfig configs[] = {gqa, mha_config(16, 2, 8, {RopeLayout::interleaved, 500.0, 0}),
                               mqa_config(16, 4, 4)};
  std::uint64_t seed = 11;
  for (const GqaConfig& config : configs) {
    const auto layer = GqaLayer<double>::random(config, seed);
    for (const Index length : {1, 2, 9}) {
      const RowMatrix<double> x = random_input<double>(length, config.d_model, seed + 100);
      const double err = check_against_forward(layer, x, gqa_query<double>);
      CAPTURE(config.n_heads, config.n_kv_heads, length, err);
      CHECK(err <= 1e-12);
    }
    ++seed;
  }
}

TEST_CASE("GQA decode_step reads a bf16 cache", "[reference][decode_step]") {
  const GqaConfig config = gqa_config(16, 4, 4, 2);
  const auto layer = GqaLayer<float>::random(config, 3);
  const RowMatrix<float> x = random_input<float>(7, config.d_model, 4);
  auto cache = layer.make_cache<Eigen::bfloat16>();
  (void)layer.prefill(x, cache);
  auto exact = layer.make_cache();
  (void)layer.prefill(x, exact);
  const RowMatrix<float> q = gqa_query(layer, x, 6);
  const RowMatrix<float> got = reference::decode_step(layer, cache, q);
  const RowMatrix<float> want = reference::decode_step(layer, exact, q);
  CHECK(relative_error(got, want) <= 2e-2);  // bf16 keeps 8 bits of mantissa
}

TEST_CASE("MLA decode_step (re-projecting) equals the reference forward's last token",
          "[reference][decode_step]") {
  std::uint64_t seed = 21;
  for (const bool compressed : {false, true}) {
    const MlaConfig config = small_mla(compressed);
    const auto layer = MlaLayer<double>::random(config, seed);
    for (const Index length : {1, 2, 11}) {
      const RowMatrix<double> x = random_input<double>(length, config.d_model, seed + 100);
      const double err = check_against_forward(layer, x, mla_query<double>);
      CAPTURE(compressed, length, err);
      CHECK(err <= 1e-12);
    }
    ++seed;
  }
}

TEST_CASE("LRKV decode_step (materialized heads) equals the reference forward's last token",
          "[reference][decode_step]") {
  std::uint64_t seed = 31;
  for (const LrkvRopeMode mode :
       {LrkvRopeMode::none, LrkvRopeMode::shared, LrkvRopeMode::decoupled}) {
    for (const bool key_norm : {false, true}) {
      const LrkvConfig config = small_lrkv(mode, key_norm);
      // Large residuals, so that a wrong residual path shows.
      const auto layer = LrkvLayer<double>::random(config, seed, 0.7);
      for (const Index length : {1, 2, 10}) {
        const RowMatrix<double> x = random_input<double>(length, config.d_model, seed + 100);
        const double err = check_against_forward(layer, x, lrkv_query<double>);
        CAPTURE(to_string(mode), key_norm, length, err);
        CHECK(err <= 1e-12);
      }
      ++seed;
    }
  }
}

TEST_CASE("decode_step rejects wrong shapes, empty and foreign caches",
          "[reference][decode_step]") {
  const auto gqa = GqaLayer<double>::random(gqa_config(16, 4, 4, 2), 1);
  auto gqa_cache = gqa.make_cache();
  CHECK_THROWS_AS(reference::decode_step(gqa, gqa_cache, RowMatrix<double>::Zero(1, 16)),
                  shape_error);  // empty
  (void)gqa.prefill(random_input<double>(3, 16, 2), gqa_cache);
  CHECK_THROWS_AS(reference::decode_step(gqa, gqa_cache, RowMatrix<double>::Zero(1, 15)),
                  shape_error);
  CHECK_THROWS_AS(reference::decode_step(gqa, gqa_cache, RowMatrix<double>::Zero(2, 16)),
                  shape_error);
  const auto other = GqaLayer<double>::random(gqa_config(16, 4, 4, 1), 1);
  CHECK_THROWS_AS(reference::decode_step(other, gqa_cache, RowMatrix<double>::Zero(1, 16)),
                  config_error);

  const auto mla = MlaLayer<double>::random(small_mla(false), 1);
  auto mla_cache = mla.make_cache();
  CHECK_THROWS_AS(reference::decode_step(mla, mla_cache, RowMatrix<double>::Zero(1, 24)),
                  shape_error);  // empty
  (void)mla.prefill(random_input<double>(2, 24, 2), mla_cache);
  CHECK_THROWS_AS(reference::decode_step(mla, mla_cache, RowMatrix<double>::Zero(1, 23)),
                  shape_error);

  const auto lrkv = LrkvLayer<double>::random(small_lrkv(LrkvRopeMode::shared, false), 1);
  auto lrkv_cache = lrkv.make_cache();
  CHECK_THROWS_AS(reference::decode_step(lrkv, lrkv_cache, RowMatrix<double>::Zero(1, 18)),
                  shape_error);  // empty
  (void)lrkv.prefill(random_input<double>(2, 20, 2), lrkv_cache);
  CHECK_THROWS_AS(reference::decode_step(lrkv, lrkv_cache, RowMatrix<double>::Zero(1, 17)),
                  shape_error);
}

TEST_CASE("LRKV decode_step names the rope modes it does not compute", "[reference][decode_step]") {
  const auto layer = LrkvLayer<double>::random(small_lrkv(LrkvRopeMode::commuting, false), 1);
  auto cache = layer.make_cache();
  (void)layer.prefill(random_input<double>(2, 20, 2), cache);
  CHECK_THROWS_WITH(reference::decode_step(layer, cache, RowMatrix<double>::Zero(1, 18)),
                    Catch::Contains("rope_mode commuting"));
  CHECK_THROWS_AS(reference::decode_step(layer, cache, RowMatrix<double>::Zero(1, 18)),
                  config_error);
}
