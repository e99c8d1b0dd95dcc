// [cache][analysis]: the analytic prediction equals what every real cache holds.
//
// Each case builds a mechanism's layer at a random configuration, fills its cache
// (a prefill, a few decodes, a raw append; or raw appends into a cache whose storage
// type is narrower than its compute type), and asserts that bytes(),
// elements_per_token() and capacity_bytes() - which the cache computes from its own
// buffers - equal the analysis module's numbers for that configuration exactly.
#include <catch2/catch.hpp>

#include <cstdint>
#include <random>

#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"
#include "test_util.hpp"

using namespace kvattn;
namespace an = kvattn::analysis;

namespace {

Index pick(std::mt19937_64& rng, Index lo, Index hi) {
  return std::uniform_int_distribution<Index>(lo, hi)(rng);
}

/// bytes() and capacity_bytes() against the analysis: one layer, one sequence of
/// cache.tokens() (or cache.capacity()) tokens, stored as the cache's storage type.
template <class Config, class Cache>
void check_against_analysis(const Config& config, const Cache& cache) {
  using S = typename Cache::storage_type;
  const an::CacheLayout layout = an::cache_layout(config);
  const an::CacheStorage storage = an::storage_of<S>();
  const Index predicted = an::total_bytes(layout, storage, {1}, {cache.tokens(), 1});
  const Index predicted_capacity = an::total_bytes(layout, storage, {1}, {cache.capacity(), 1});
  CAPTURE(cache.tokens(), cache.capacity(), sizeof(S));
  CHECK(cache.elements_per_token() == an::elements_per_token_per_layer(config));
  CHECK(cache.bytes() == static_cast<std::size_t>(predicted));
  CHECK(cache.bytes() ==
        static_cast<std::size_t>(an::bytes_per_token_per_layer(layout, storage) * cache.tokens()));
  CHECK(cache.capacity_bytes() == static_cast<std::size_t>(predicted_capacity));
}

/// Prefill a random prompt, decode a few tokens, check after each stage.
template <class Layer, class Config>
void fill_and_check(const Layer& layer, const Config& config, Index prompt, Index decodes,
                    std::uint64_t seed) {
  using T = typename Layer::scalar_type;
  auto cache = layer.make_cache();
  check_against_analysis(config, cache);  // empty
  layer.prefill(test::random_input<T>(prompt, config.d_model, seed), cache);
  check_against_analysis(config, cache);
  RowVector<T> out(config.d_model);
  for (Index t = 0; t < decodes; ++t) {
    const RowVector<T> x = test::random_input<T>(1, config.d_model, seed + 1 + t);
    layer.decode(x, cache, out);
  }
  REQUIRE(cache.tokens() == prompt + decodes);
  check_against_analysis(config, cache);
  cache.truncate(prompt / 2);
  check_against_analysis(config, cache);
}

GqaConfig random_gqa(std::mt19937_64& rng) {
  const Index n_kv = pick(rng, 1, 5);
  GqaConfig c;
  c.n_kv_heads = n_kv;
  c.n_heads = n_kv * pick(rng, 1, 4);
  c.head_dim = 2 * pick(rng, 1, 17);
  c.d_model = pick(rng, 1, 48);
  c.qkv_bias = pick(rng, 0, 1) == 1;
  if (pick(rng, 0, 1) == 1) c.rope.layout = RopeLayout::half_split;
  return c;
}

MlaConfig random_mla(std::mt19937_64& rng) {
  MlaConfig c;
  c.d_model = pick(rng, 1, 48);
  c.n_heads = pick(rng, 1, 5);
  c.kv_rank = pick(rng, 1, 40);
  c.q_rank = pick(rng, 0, 1) == 1 ? pick(rng, 1, 24) : 0;
  c.qk_nope_dim = pick(rng, 1, 20);
  c.rope_dim = 2 * pick(rng, 0, 8);
  c.v_dim = pick(rng, 1, 20);
  c.kv_norm = pick(rng, 0, 1) == 1;
  if (c.rope_dim > 0) c.rope.layout = RopeLayout::interleaved;
  return c;
}

LrkvConfig random_lrkv(std::mt19937_64& rng, bool allow_full) {
  LrkvConfig c;
  c.d_model = pick(rng, 1, 48);
  c.n_heads = pick(rng, 1, 6);
  c.head_dim = 2 * pick(rng, 1, 12);
  c.rank = pick(rng, 0, c.head_dim);
  c.key_norm = pick(rng, 0, 1) == 1;
  const Index mode = pick(rng, 0, allow_full ? 4 : 3);
  c.rope_mode = mode == 0   ? LrkvRopeMode::none
                : mode == 1 ? LrkvRopeMode::shared
                : mode == 2 ? LrkvRopeMode::decoupled
                : mode == 3 ? LrkvRopeMode::commuting
                            : LrkvRopeMode::full;
  if (c.rope_mode != LrkvRopeMode::none) c.rope.layout = RopeLayout::half_split;
  if (c.rope_mode == LrkvRopeMode::decoupled) c.rope_dim = 2 * pick(rng, 1, 6);
  if (c.rope_mode == LrkvRopeMode::commuting) c.rank -= c.rank % 2;
  return c;
}

}  // namespace

TEST_CASE("GQA family: analytic bytes equal the cache's bytes", "[cache][analysis][gqa]") {
  std::mt19937_64 rng(601);
  for (int i = 0; i < 60; ++i) {
    const GqaConfig c = random_gqa(rng);
    CAPTURE(i, c.d_model, c.n_heads, c.head_dim, c.n_kv_heads);
    const Index prompt = pick(rng, 1, 40);
    const Index decodes = pick(rng, 0, 4);
    if (i % 2 == 0) {
      fill_and_check(GqaLayer<float>::random(c, 7 + i), c, prompt, decodes, 100 + i);
    } else {
      fill_and_check(GqaLayer<double>::random(c, 7 + i), c, prompt, decodes, 100 + i);
    }
    // Narrow storage: a double layer's rows stored as float, filled by raw appends.
    GqaCache<double, float> narrow(c);
    const Index width = c.n_kv_heads * c.head_dim;
    for (int chunk = 0; chunk < 3; ++chunk) {
      const RowMatrix<double> rows = test::random_input<double>(prompt + chunk, width, 9 + i);
      narrow.append(rows, rows);
      check_against_analysis(c, narrow);
    }
  }
}

TEST_CASE("MLA: analytic bytes equal the cache's bytes", "[cache][analysis][mla]") {
  std::mt19937_64 rng(602);
  for (int i = 0; i < 60; ++i) {
    const MlaConfig c = random_mla(rng);
    CAPTURE(i, c.d_model, c.n_heads, c.kv_rank, c.q_rank, c.qk_nope_dim, c.rope_dim, c.v_dim);
    const Index prompt = pick(rng, 1, 40);
    const Index decodes = pick(rng, 0, 4);
    if (i % 2 == 0) {
      fill_and_check(MlaLayer<float>::random(c, 7 + i), c, prompt, decodes, 200 + i);
    } else {
      fill_and_check(MlaLayer<double>::random(c, 7 + i), c, prompt, decodes, 200 + i);
    }
    MlaCache<double, float> narrow(c);
    for (int chunk = 0; chunk < 3; ++chunk) {
      narrow.append(test::random_input<double>(prompt + chunk, c.kv_rank, 3 + i),
                    test::random_input<double>(prompt + chunk, c.rope_dim, 4 + i));
      check_against_analysis(c, narrow);
    }
  }
}

TEST_CASE("LRKV: analytic bytes equal the cache's bytes, every RoPE mode and key norm",
          "[cache][analysis][lrkv]") {
  std::mt19937_64 rng(603);
  for (int i = 0; i < 60; ++i) {
    const LrkvConfig c = random_lrkv(rng, /*allow_full=*/false);
    CAPTURE(i, c.d_model, c.n_heads, c.head_dim, c.rank, to_string(c.rope_mode), c.rope_dim,
            c.key_norm);
    const Index prompt = pick(rng, 1, 40);
    const Index decodes = pick(rng, 0, 4);
    if (i % 2 == 0) {
      fill_and_check(LrkvLayer<float>::random(c, 7 + i), c, prompt, decodes, 300 + i);
    } else {
      fill_and_check(LrkvLayer<double>::random(c, 7 + i), c, prompt, decodes, 300 + i);
    }
  }
  // Raw appends, including rope_mode full (which cannot prefill), into float and double
  // storage: the key RMS scalars are stored at >= fp32 either way.
  for (int i = 0; i < 40; ++i) {
    const LrkvConfig c = random_lrkv(rng, /*allow_full=*/true);
    CAPTURE(i, c.n_heads, c.head_dim, c.rank, to_string(c.rope_mode), c.rope_dim, c.key_norm);
    LrkvCache<double, float> narrow(c);
    LrkvCache<double, double> wide(c);
    const Index n = pick(rng, 1, 30);
    const Index hr = c.n_heads * c.rank;
    const RowMatrix<double> shared = test::random_input<double>(n, c.head_dim, 5 + i);
    const RowMatrix<double> residual = test::random_input<double>(n, hr, 6 + i);
    const RowMatrix<double> rope = test::random_input<double>(n, c.decoupled_dim(), 7 + i);
    const RowMatrix<double> rms = RowMatrix<double>::Ones(n, c.key_norm ? c.n_heads : 0);
    const typename LrkvCache<double, float>::rows_type rows{shared,   shared, residual,
                                                            residual, rope,   rms};
    narrow.append(rows);
    wide.append({shared, shared, residual, residual, rope, rms});
    check_against_analysis(c, narrow);
    check_against_analysis(c, wide);
  }
}
