// [cache][lrkv]: what the LRKV cache holds per token, its byte count against counts made
// here and the seed's cache ratios, and how it grows, forks, rolls back and imports.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <random>

#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/cache/kv_cache.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "test_lrkv_util.hpp"
#include "test_util.hpp"

using namespace kvattn;

static_assert(KVCache<LrkvCache<float>>);
static_assert(KVCache<LrkvCache<double>>);
static_assert(KVCache<LrkvCache<double, float>>);

namespace {

// Appends n tokens of zeros (every part shaped as the config says).
template <class T, class S>
void append_zeros(LrkvCache<T, S>& cache, Index n) {
  const LrkvConfig& c = cache.config();
  const RowMatrix<T> shared = RowMatrix<T>::Zero(n, c.head_dim);
  const RowMatrix<T> latent = RowMatrix<T>::Zero(n, c.n_heads * c.rank);
  const RowMatrix<T> rope = RowMatrix<T>::Zero(n, c.decoupled_dim());
  const RowMatrix<T> rms = RowMatrix<T>::Ones(n, c.key_norm ? c.n_heads : 0);
  cache.append({shared, shared, latent, latent, rope, rms});
}

}  // namespace

TEST_CASE("LRKV cache: 2 (d_h + H r) elements per token plus each mode's extras", "[cache][lrkv]") {
  for (const LrkvRopeMode mode : {LrkvRopeMode::none, LrkvRopeMode::shared, LrkvRopeMode::decoupled,
                                  LrkvRopeMode::commuting}) {
    for (const bool key_norm : {false, true}) {
      LrkvConfig c{40, 5, 12, 4, mode};
      if (mode != LrkvRopeMode::none) c.rope.layout = RopeLayout::half_split;
      if (mode == LrkvRopeMode::decoupled) c.rope_dim = 6;
      c.key_norm = key_norm;
      // Counted here: K_s, V_s (12 each), R^K, R^V (5 * 4 each), k_R (6, decoupled),
      // one RMS per head (5, key norm).
      const Index base = 2 * (12 + 5 * 4);
      const Index rope_extra = mode == LrkvRopeMode::decoupled ? 6 : 0;
      const Index norm_extra = key_norm ? 5 : 0;
      CAPTURE(to_string(mode), key_norm);
      LrkvCache<float> f(c);
      LrkvCache<double> d(c);
      LrkvCache<double, float> narrow(c);
      CHECK(f.elements_per_token() == base + rope_extra + norm_extra);
      CHECK(c.cache_elements_per_token() == base + rope_extra + norm_extra);
      const Index length = 37;
      append_zeros(f, length);
      append_zeros(d, length);
      append_zeros(narrow, length);
      const std::size_t L = 37, stored = static_cast<std::size_t>(base + rope_extra);
      const std::size_t norms = static_cast<std::size_t>(norm_extra);
      CHECK(f.bytes() == L * (stored * sizeof(float) + norms * sizeof(float)));
      CHECK(d.bytes() == L * (stored * sizeof(double) + norms * sizeof(double)));
      CHECK(narrow.bytes() == L * (stored * sizeof(float) + norms * sizeof(float)));
      CHECK(f.capacity_bytes() ==
            static_cast<std::size_t>(f.capacity()) * (stored + norms) * sizeof(float));
    }
  }
}

TEST_CASE("LRKV cache / MHA cache = 1/H + r/d_h, the seed's Table 7 and rank sweep",
          "[cache][lrkv]") {
  struct Row {
    Index heads, rank;
    double percent;  // seed 000, "rank sets the budget" slide and backup rank sweep
    double scale;    // 100: printed with 2 decimals, 10: with 1
  };
  for (const Row row : {Row{6, 46, 52.60, 100}, Row{12, 51, 48.18, 100}, Row{18, 55, 48.52, 100},
                        Row{32, 54, 45.31, 100}, Row{6, 8, 22.9, 10}, Row{6, 16, 29.2, 10},
                        Row{6, 32, 41.7, 10}, Row{6, 64, 66.7, 10}, Row{6, 128, 116.7, 10}}) {
    const Index dh = 128;
    const Index d = row.heads * dh;
    LrkvCache<float> lrkv(LrkvConfig{d, row.heads, dh, row.rank});
    GqaCache<float> mha(mha_config(d, row.heads, dh));
    append_zeros(lrkv, 3);
    const RowMatrix<float> kv = RowMatrix<float>::Zero(3, row.heads * dh);
    mha.append(kv, kv);
    const double ratio = static_cast<double>(lrkv.bytes()) / static_cast<double>(mha.bytes());
    const double formula = 1.0 / static_cast<double>(row.heads) +
                           static_cast<double>(row.rank) / static_cast<double>(dh);
    CAPTURE(row.heads, row.rank, ratio, formula);
    CHECK(std::abs(ratio - formula) <= 1e-15);
    CHECK(std::round(100.0 * ratio * row.scale) / row.scale == Approx(row.percent).margin(1e-9));
  }
  // At the 2.5B shape: 4,608 -> 2,236 elements per token per layer.
  CHECK(LrkvCache<float>(LrkvConfig{18 * 128, 18, 128, 55}).elements_per_token() == 2236);
  CHECK(GqaCache<float>(mha_config(18 * 128, 18, 128)).elements_per_token() == 4608);
  // r = d_h: 1 + 1/H.
  LrkvCache<float> full_rank(LrkvConfig{6 * 128, 6, 128, 128});
  CHECK(full_rank.elements_per_token() * 6 == 7 * (2 * 6 * 128));
}

TEST_CASE("LRKV cache grows geometrically and never reallocates within capacity", "[cache][lrkv]") {
  LrkvConfig c{8, 2, 4, 2, LrkvRopeMode::none};
  c.key_norm = true;
  LrkvCache<double> cache(c);
  CHECK(cache.capacity() == 0);
  CHECK(cache.capacity_bytes() == 0);
  Index reallocations = 0;
  Index previous = 0;
  for (int t = 0; t < 1000; ++t) {
    append_zeros(cache, 1);
    if (cache.capacity() != previous) {
      ++reallocations;
      CHECK(cache.capacity() >= 2 * previous);
      previous = cache.capacity();
    }
  }
  CHECK(reallocations <= 8);
  cache.reserve(4000);
  const double* before = cache.key_row(0);
  for (int t = 0; t < 2000; ++t) append_zeros(cache, 1);
  CHECK(cache.key_row(0) == before);
  CHECK(cache.capacity() == 4000);
  cache.truncate(3);
  CHECK(cache.tokens() == 3);
  cache.clear();
  CHECK(cache.tokens() == 0);
  CHECK(cache.bytes() == 0);
  CHECK(cache.capacity() == 4000);
}

TEST_CASE("Copying an LRKV cache forks the sequence; truncate rolls back", "[cache][lrkv]") {
  std::mt19937_64 rng(2);
  for (const LrkvRopeMode mode : {LrkvRopeMode::shared, LrkvRopeMode::decoupled,
                                  LrkvRopeMode::commuting, LrkvRopeMode::none}) {
    const LrkvConfig c = test::random_lrkv_config(rng, mode, true);
    const auto layer = LrkvLayer<double>::random(c, 3, 0.7);
    const RowMatrix<double> x = test::random_input<double>(30, c.d_model, 4);
    auto cache = layer.make_cache();
    layer.prefill(x.topRows(20), cache);
    auto fork = cache;
    const RowVector<double> a = layer.decode(x.row(20), cache);
    const RowVector<double> b = layer.decode(x.row(21), fork);
    RowMatrix<double> seq_b = x.topRows(21);
    seq_b.row(20) = x.row(21);
    INFO(test::describe_case(c));
    CHECK(test::relative_error(a, reference::forward(layer, x.topRows(21)).row(20)) <= 1e-10);
    CHECK(test::relative_error(b, reference::forward(layer, seq_b).row(20)) <= 1e-10);
    // Roll back to 12 tokens, then continue with another token.
    for (Index t = 21; t < 25; ++t) layer.decode(x.row(t), cache);
    cache.truncate(12);
    RowMatrix<double> seq_c = x.topRows(13);
    seq_c.row(12) = x.row(29);
    const RowVector<double> c_out = layer.decode(x.row(29), cache);
    CHECK(test::relative_error(c_out, reference::forward(layer, seq_c).row(12)) <= 1e-10);
  }
}

TEST_CASE("Unused LRKV cache capacity filled with NaN never leaks into an output",
          "[cache][lrkv]") {
  std::mt19937_64 rng(5);
  for (const LrkvRopeMode mode : {LrkvRopeMode::decoupled, LrkvRopeMode::commuting}) {
    const LrkvConfig c = test::random_lrkv_config(rng, mode, true);
    const auto layer = LrkvLayer<double>::random(c, 6, 0.7);
    const RowMatrix<double> x = test::random_input<double>(20, c.d_model, 7);
    auto cache = layer.make_cache(64);
    layer.prefill(x.topRows(19), cache);
    const double nan = std::numeric_limits<double>::quiet_NaN();
    auto nan_rows = [&](Index cols) { return RowMatrix<double>::Constant(40, cols, nan); };
    // Every stored value NaN; the key RMS must be finite and > 0 (append refuses others).
    const RowMatrix<double> shared = nan_rows(c.head_dim), latent = nan_rows(c.n_heads * c.rank),
                            rope = nan_rows(c.decoupled_dim());
    const RowMatrix<double> rms = RowMatrix<double>::Constant(40, c.n_heads, 1.0);
    cache.append({shared, shared, latent, latent, rope, rms});
    cache.truncate(19);
    const RowVector<double> y = layer.decode(x.row(19), cache);
    INFO(test::describe_case(c));
    CHECK(y.allFinite());
    CHECK(test::relative_error(y, reference::forward(layer, x).row(19)) <= 1e-10);
    cache.append({shared, shared, latent, latent, rope, rms});
    cache.truncate(10);
    const RowMatrix<double> tail = layer.prefill(x.middleRows(10, 10), cache);
    CHECK(tail.allFinite());
    CHECK(test::relative_error(tail, reference::forward(layer, x).bottomRows(10)) <= 1e-10);
  }
}

TEST_CASE("A NaN in a later prompt token never reaches earlier rows of a prefill",
          "[cache][lrkv]") {
  std::mt19937_64 rng(13);
  for (const LrkvRopeMode mode :
       {LrkvRopeMode::none, LrkvRopeMode::decoupled, LrkvRopeMode::commuting}) {
    const LrkvConfig c = test::random_lrkv_config(rng, mode, true);
    const auto layer = LrkvLayer<double>::random(c, 14, 0.7);
    RowMatrix<double> x = test::random_input<double>(40, c.d_model, 15);
    const RowMatrix<double> expected = reference::forward(layer, x.topRows(30));
    x.row(30).setConstant(std::numeric_limits<double>::quiet_NaN());
    auto cache = layer.make_cache();
    layer.prefill(x.topRows(5), cache);  // a past, so the diagonal tile is offset
    const RowMatrix<double> y = layer.prefill(x.bottomRows(35), cache);
    INFO(test::describe_case(c));
    CHECK(y.topRows(25).allFinite());
    CHECK(test::relative_error(y.topRows(25), expected.bottomRows(25)) <= 1e-10);
    CHECK_FALSE(y.row(25).allFinite());  // the NaN token itself, and what follows, is NaN
  }
}

TEST_CASE("A raw append of rows projected by hand, then decode, equals the reference",
          "[cache][lrkv]") {
  // Shared RoPE with key norm: the rows a user importing a cache would compute.
  LrkvConfig c{10, 3, 6, 2, LrkvRopeMode::shared, {RopeLayout::half_split, 10000.0, 4}};
  c.key_norm = true;
  const auto layer = LrkvLayer<double>::random(c, 8, 0.7);
  const auto& w = layer.weights();
  const RowMatrix<double> x = test::random_input<double>(16, c.d_model, 9);
  const Index n = 15;
  RowMatrix<double> shared_keys = x.topRows(n) * w.w_k_shared;
  const RowMatrix<double> residual_keys = x.topRows(n) * w.u_k;
  RowMatrix<double> rms(n, c.n_heads);
  for (Index t = 0; t < n; ++t) {
    for (Index h = 0; h < c.n_heads; ++h) {
      const RowVector<double> full =
          shared_keys.row(t) + residual_keys.row(t).segment(h * c.rank, c.rank) *
                                   w.basis_k.middleCols(h * c.rank, c.rank).transpose();
      rms(t, h) = std::sqrt(full.squaredNorm() / c.head_dim + c.key_norm_epsilon);
    }
  }
  const Rope rope(c.rope, c.head_dim);
  for (Index t = 0; t < n; ++t) {
    shared_keys.row(t) = shared_keys.row(t).cwiseProduct(w.key_norm_gain);  // gain, then RoPE
    rope.rotate(shared_keys.row(t).data(), static_cast<double>(c.rope.position_offset + t));
  }
  auto cache = layer.make_cache();
  cache.append({shared_keys, x.topRows(n) * w.w_v_shared, residual_keys, x.topRows(n) * w.u_v,
                RowMatrix<double>(n, 0), rms});
  CHECK(cache.tokens() == n);
  const RowVector<double> y = layer.decode(x.row(n), cache);
  CHECK(test::relative_error(y, reference::forward(layer, x).row(n)) <= 1e-10);
  // A cache imported from another cache's stored rows continues identically.
  LrkvCache<double> imported(c);
  imported.append({cache.shared_keys(), cache.shared_values(), cache.residual_keys(),
                   cache.residual_values(), cache.rope_keys(), cache.key_rms()});
  CHECK(imported.tokens() == n + 1);
  const RowVector<double> next = test::random_input<double>(1, c.d_model, 10);
  CHECK(layer.decode(next, imported) == layer.decode(next, cache));
}

TEST_CASE("A failed LRKV append or decode leaves the cache exactly as it was", "[cache][lrkv]") {
  LrkvConfig c{9, 2, 4, 2, LrkvRopeMode::decoupled, {RopeLayout::interleaved, 10000.0, 0}, 2};
  c.key_norm = true;
  const auto layer = LrkvLayer<double>::random(c, 1);
  const RowMatrix<double> x = test::random_input<double>(6, 9, 2);
  auto cache = layer.make_cache();
  layer.prefill(x, cache);
  const RowMatrix<double> keys_before = cache.shared_keys();
  const RowMatrix<double> rms_before = cache.key_rms();
  const Index tokens = cache.tokens(), capacity = cache.capacity();
  const RowMatrix<double> shared = RowMatrix<double>::Ones(3, 4),
                          latent = RowMatrix<double>::Ones(3, 4);
  const RowMatrix<double> rope = RowMatrix<double>::Ones(3, 2),
                          bad_latent = RowMatrix<double>::Ones(3, 5);
  const RowMatrix<double> rms = RowMatrix<double>::Ones(3, 2),
                          bad_rms = RowMatrix<double>::Ones(3, 1);
  CHECK_THROWS_AS(cache.append({shared, shared, bad_latent, latent, rope, rms}), shape_error);
  CHECK_THROWS_AS(cache.append({shared, shared, latent, latent, rope, bad_rms}), shape_error);
  CHECK_THROWS_AS(layer.decode(RowVector<double>::Ones(8), cache), shape_error);
  CHECK_THROWS_AS(layer.prefill(RowMatrix<double>::Ones(3, 10), cache), shape_error);
  CHECK(cache.tokens() == tokens);
  CHECK(cache.capacity() == capacity);
  CHECK(RowMatrix<double>(cache.shared_keys()) == keys_before);
  CHECK(RowMatrix<double>(cache.key_rms()) == rms_before);
}
