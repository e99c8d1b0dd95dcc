// [analysis]: storage types, block scales, paging, sliding windows, tensor parallelism,
// budget solvers and bad input, each against a hand derivation written next to it.
#include <catch2/catch.hpp>

#include <limits>
#include <stdexcept>

#include "kvattn/analysis/budget.hpp"
#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/analysis/dtype.hpp"

using namespace kvattn;
using namespace kvattn::analysis;

namespace {

constexpr GqaConfig gqa(Index heads, Index kv_heads, Index head_dim = 128) {
  return GqaConfig{
      .d_model = heads * head_dim, .n_heads = heads, .head_dim = head_dim, .n_kv_heads = kv_heads};
}

constexpr LrkvConfig lrkv(Index heads, Index rank, Index head_dim = 128) {
  return LrkvConfig{
      .d_model = heads * head_dim, .n_heads = heads, .head_dim = head_dim, .rank = rank};
}

constexpr MlaConfig mla(Index heads, Index kv_rank, Index rope_dim) {
  return MlaConfig{.d_model = 1024,
                   .n_heads = heads,
                   .kv_rank = kv_rank,
                   .q_rank = 0,
                   .qk_nope_dim = 128,
                   .rope_dim = rope_dim,
                   .v_dim = 128};
}

// Element sizes.
static_assert(bytes_per_element(Dtype::fp64) == 8);
static_assert(bytes_per_element(Dtype::fp32) == 4);
static_assert(bytes_per_element(Dtype::bf16) == 2);
static_assert(bytes_per_element(Dtype::fp16) == 2);
static_assert(bytes_per_element(Dtype::fp8_e4m3) == 1);
static_assert(bytes_per_element(Dtype::fp8_e5m2) == 1);
static_assert(bytes_per_element(Dtype::int8) == 1);
static_assert(parse_dtype("bfloat16") == Dtype::bf16);
static_assert(parse_dtype("float16") == Dtype::fp16);
static_assert(parse_dtype("float32") == Dtype::fp32);
static_assert(parse_dtype("fp8") == Dtype::fp8_e4m3);
static_assert(!parse_dtype("bf17").has_value());
static_assert(!parse_dtype("BF16").has_value());
static_assert(dtype_of<float>() == Dtype::fp32);
static_assert(dtype_of<double>() == Dtype::fp64);

}  // namespace

TEST_CASE("dtype names round-trip", "[analysis]") {
  for (const Dtype d : {Dtype::fp64, Dtype::fp32, Dtype::bf16, Dtype::fp16, Dtype::fp8_e4m3,
                        Dtype::fp8_e5m2, Dtype::int8}) {
    CHECK(parse_dtype(to_string(d)) == d);
  }
}

TEST_CASE("bytes per token: element sizes, norms at >= fp32, block scales", "[analysis]") {
  // GQA-4, d_h 128: 2 * 4 * 128 = 1,024 elements per token per layer.
  const CacheLayout g = cache_layout(gqa(16, 4));
  CHECK(bytes_per_token_per_layer(g, plain_storage(Dtype::fp32)) == 4096);
  CHECK(bytes_per_token_per_layer(g, plain_storage(Dtype::fp16)) == 2048);
  CHECK(bytes_per_token_per_layer(g, plain_storage(Dtype::int8)) == 1024);
  // fp8 with a scale per 64 elements: each of the 8 rows of 128 has 2 blocks -> 16 fp32
  // scales = 64 bytes, on top of 1,024 fp8 bytes.
  CHECK(bytes_per_token_per_layer(g, block_scaled_storage(Dtype::fp8_e4m3, 64)) == 1024 + 64);
  // A block of 100 does not divide 128: ceil(128 / 100) = 2 scales per row, still 16.
  CHECK(scales_per_token_per_layer(g, block_scaled_storage(Dtype::fp8_e4m3, 100)) == 16);
  // A block wider than a row: one scale per row (a scale never spans two heads): 8.
  CHECK(scales_per_token_per_layer(g, block_scaled_storage(Dtype::fp8_e4m3, 1000)) == 8);
  // fp16 scales instead of fp32: 16 * 2 bytes.
  CHECK(bytes_per_token_per_layer(
            g, block_scaled_storage(Dtype::int8, 64, Dtype::bf16, Dtype::fp16)) == 1024 + 32);

  // LRKV H 6, r 46, key norm, decoupled d_R 32:
  //   main 2 x 128, residual 12 x 46 = 552, rope 32, norms 6.
  LrkvConfig c = lrkv(6, 46);
  c.key_norm = true;
  c.rope_mode = LrkvRopeMode::decoupled;
  c.rope = RopeConfig{RopeLayout::half_split, 10000.0, 0};
  c.rope_dim = 32;
  const CacheLayout l = cache_layout(c);
  CHECK(l.elements() == 256 + 552 + 32 + 6);
  // bf16: (256 + 552 + 32) * 2 + 6 * 4 (norms at fp32).
  CHECK(bytes_per_token_per_layer(l, plain_storage(Dtype::bf16)) == 840 * 2 + 24);
  // fp64: everything 8 bytes, norms too.
  CHECK(bytes_per_token_per_layer(l, plain_storage(Dtype::fp64)) == 846 * 8);
  // fp8 with blocks of 32, rope in bf16: scales 2 * ceil(128/32) + 12 * ceil(46/32) = 8 + 24.
  CHECK(bytes_per_token_per_layer(l, block_scaled_storage(Dtype::fp8_e4m3, 32)) ==
        (256 + 552) * 1 + 32 * 2 + 6 * 4 + 32 * 4);

  // LRKV with r = 0 has no residual rows and no residual scales.
  CHECK(scales_per_token_per_layer(cache_layout(lrkv(4, 0)), block_scaled_storage()) == 2);
}

TEST_CASE("totals: layers x sequence x batch, sliding windows, pages", "[analysis]") {
  const CacheLayout g = cache_layout(gqa(8, 2, 64));  // 2 * 2 * 64 = 256 elements
  REQUIRE(g.elements() == 256);
  // 10 full layers, 1,000 tokens, batch 3: 3 * 256 * 10 * 1,000 elements; bf16 doubles.
  CHECK(total_elements(g, {10}, {1000, 3}) == 3 * 256 * 10 * 1000);
  CHECK(total_bytes(g, plain_storage(Dtype::bf16), {10}, {1000, 3}) == 2 * 3 * 256 * 10 * 1000);
  // Layers alternating full attention and a window of 100: 5 keep 1,000, 5 keep 100.
  CHECK(total_elements(g, {10, 5, 100}, {1000, 3}) == 3 * 256 * (5 * 1000 + 5 * 100));
  // A sequence shorter than the window: every layer keeps all 50 tokens.
  CHECK(total_elements(g, {10, 5, 100}, {50, 1}) == 256 * 10 * 50);
  // Pages of 16 tokens: full layers ceil(1000/16) = 63 pages = 1,008 slots, window layers
  // ceil(100/16) = 7 pages = 112 slots.
  CHECK(total_elements(g, {10, 5, 100}, {1000, 3, 16}) == 3 * 256 * (5 * 1008 + 5 * 112));
  // A page-aligned length wastes nothing; one more token costs a whole page.
  CHECK(cached_tokens(1024, 0, 16) == 1024);
  CHECK(cached_tokens(1025, 0, 16) == 1040);
  CHECK(cached_tokens(0, 0, 16) == 0);
  CHECK(cached_tokens(5000, 4096, 0) == 4096);
  // Every layer a window layer.
  CHECK(total_elements(g, {4, 4, 8}, {100, 1}) == 256 * 4 * 8);
  // Window layers with 4 sink tokens and 6 tokens kept for rollback: 4 + 100 + 6 = 110.
  CHECK(LayerStack{10, 5, 100, 4, 6}.window_keeps() == 110);
  CHECK(total_elements(g, {10, 5, 100, 4, 6}, {1000, 3}) == 3 * 256 * (5 * 1000 + 5 * 110));
  CHECK(total_elements(g, {10, 5, 100, 4, 6}, {105, 1}) == 256 * 10 * 105);  // all kept
  // In pages of 16: ceil(110 / 16) = 7 pages, 112 slots.
  CHECK(total_elements(g, {10, 5, 100, 4, 6}, {1000, 1, 16}) == 256 * (5 * 1008 + 5 * 112));
  // Block scales are counted per token slot too.
  CHECK(total_bytes(g, block_scaled_storage(Dtype::fp8_e4m3, 64), {2}, {10, 1}) ==
        (256 + 4 * 4) * 2 * 10);
}

TEST_CASE("tensor parallelism: sharded, replicated and impossible KV heads", "[analysis]") {
  // GQA H 32, n_kv 8, d_h 128 (model: 2 * 8 * 128 = 2,048 per token per layer).
  const GqaConfig c = gqa(32, 8);
  // t = 2: 4 KV heads per device, nothing replicated; the devices sum to the model.
  CHECK(elements_per_token_per_layer(c, 2) == 2 * 4 * 128);
  CHECK(kv_replication(c, 2) == 1);
  // t = 8: one KV head each, still sharded.
  CHECK(elements_per_token_per_layer(c, 8) == 256);
  CHECK(kv_replication(c, 8) == 1);
  // t = 16 > n_kv: one KV head each, every head on 2 devices: 16 * 256 = 2 * 2,048 in all.
  CHECK(elements_per_token_per_layer(c, 16) == 256);
  CHECK(kv_replication(c, 16) == 2);
  // t = 32: replicated 4 times.
  CHECK(kv_replication(c, 32) == 4);
  // MHA shards every head; MQA's single head sits on every device.
  CHECK(elements_per_token_per_layer(gqa(32, 32), 8) == 2 * 4 * 128);
  CHECK(elements_per_token_per_layer(gqa(32, 1), 8) == 256);
  CHECK(kv_replication(gqa(32, 1), 8) == 8);
  // MLA: the latent and rope key on every device.
  CHECK(elements_per_token_per_layer(mla(16, 512, 64), 8) == 576);
  // LRKV H 18, r 55: shared 2 * 128 on every device, residuals 2 * 18 * 55 split 6 ways.
  CHECK(elements_per_token_per_layer(lrkv(18, 55), 6) == 256 + 2 * 3 * 55);
  CHECK(6 * elements_per_token_per_layer(lrkv(18, 55), 6) == 6 * 256 + 2 * 18 * 55);
  LrkvConfig normed = lrkv(18, 55);
  normed.key_norm = true;
  CHECK(elements_per_token_per_layer(normed, 6) == 256 + 2 * 3 * 55 + 3);

  // Impossible splits: H not divisible by t; n_kv neither a multiple nor a divisor of t.
  CHECK_THROWS_MATCHES(cache_layout(c, 3), config_error,
                       Catch::Message("tensor parallelism: tp (3) must divide n_heads (query "
                                      "heads are split across devices)"));
  CHECK_THROWS_WITH(cache_layout(gqa(24, 6), 4),
                    Catch::Contains("tp (4) must divide n_kv_heads (KV heads shard) or be a "
                                    "multiple of it"));
  CHECK_THROWS_WITH(cache_layout(gqa(8, 8), 0), Catch::Contains("tp (0) must be >= 1"));
  CHECK_THROWS_AS(cache_layout(mla(16, 512, 64), 3), config_error);
  CHECK_THROWS_AS(cache_layout(lrkv(18, 55), 4), config_error);
}

TEST_CASE("budget solvers find the largest fitting d_c, rank and n_kv", "[analysis]") {
  // LRKV H 6, d_h 128, 12 layers: r fits iff 12 * 2 * (128 + 6 r) <= B.
  // B = 12 * 2 * (128 + 6 * 20) = 5,952 -> r = 20; one element less -> 19.
  const LrkvConfig l = lrkv(6, 0);
  CHECK(max_lrkv_rank(l, 12, {5952}) == 20);
  CHECK(max_lrkv_rank(l, 12, {5951}) == 19);
  CHECK(max_lrkv_rank(l, 12, {5952 * 2, BudgetUnit::bytes}, plain_storage(Dtype::bf16)) == 20);
  CHECK(max_lrkv_rank(l, 12, {1'000'000'000}) == 128);            // capped at d_h
  CHECK_FALSE(max_lrkv_rank(l, 12, {12 * 256 - 1}).has_value());  // not even r = 0
  CHECK(max_lrkv_rank(l, 12, {12 * 256}) == 0);

  // GQA H 32, d_h 128, 10 layers: n_kv fits iff 10 * 2 * 128 * n_kv <= B.
  // B for 5 heads: the largest divisor of 32 that is <= 5 is 4.
  const GqaConfig g = gqa(32, 32);
  CHECK(max_kv_heads(g, 10, {10 * 256 * 5}) == 4);
  CHECK(max_kv_heads(g, 10, {10 * 256 * 32}) == 32);
  CHECK(max_kv_heads(g, 10, {10 * 256 * 32 * 4, BudgetUnit::bytes}, plain_storage(Dtype::fp32)) ==
        32);
  CHECK(max_kv_heads(g, 10, {10 * 256 * 31 * 4, BudgetUnit::bytes}, plain_storage(Dtype::fp32)) ==
        16);
  CHECK_FALSE(max_kv_heads(g, 10, {10 * 256 - 1}).has_value());

  // MLA in bytes with DeepSeek's fp8 storage, 60 layers, d_R 64, steps of 32:
  // d_c = 512 costs 656 per layer; 544 costs 544 + 5 * 4 + 128 = 692.
  const MlaConfig m = mla(128, 512, 64);
  CHECK(max_kv_rank(m, 60, {60 * 656, BudgetUnit::bytes}, block_scaled_storage()) == 512);
  // One byte less per layer: 480 + 4 * 4 + 128 = 624 fits, 512 does not.
  CHECK(max_kv_rank(m, 60, {60 * 655, BudgetUnit::bytes}, block_scaled_storage()) == 480);
  // Nothing fits: d_c = 32 needs (32 + 64) * 60 = 5,760 elements.
  CHECK_FALSE(max_kv_rank(m, 60, {5759}).has_value());
  CHECK(max_kv_rank(m, 60, {5760}) == 32);
  CHECK_THROWS_WITH(max_kv_rank(m, 60, {0}), "Budget: amount (0) must be >= 1");
  CHECK_THROWS_WITH(max_kv_rank(m, 60, {100}, {}, 0), "max_kv_rank: step (0) must be >= 1");
}

TEST_CASE("bad input throws with a message naming the field", "[analysis][reliability]") {
  CHECK_THROWS_MATCHES(cache_layout(gqa(12, 5)), config_error,
                       Catch::Message("GqaConfig: n_heads (12) must be divisible by "
                                      "n_kv_heads (5)"));
  CHECK_THROWS_WITH(cache_layout(lrkv(4, 200)), Catch::Contains("rank (200) must be <= head_dim"));
  CHECK_THROWS_WITH(cache_layout(mla(4, 0, 64)), Catch::Contains("kv_rank (0) must be >= 1"));
  const CacheLayout g = cache_layout(gqa(8, 8));
  CHECK_THROWS_WITH(total_elements(g, {0}, {}), "LayerStack: layers (0) must be >= 1");
  CHECK_THROWS_WITH(total_elements(g, {4, 5, 10}, {}),
                    "LayerStack: window_layers (5) must be in [0, layers]");
  CHECK_THROWS_WITH(total_elements(g, {4, 2, 0}, {}),
                    "LayerStack: window (0) must be >= 1 when there are sliding-window layers");
  CHECK_THROWS_WITH(total_elements(g, {4, 2, 8, -1}, {}),
                    "LayerStack: sink_tokens (-1) must be >= 0");
  CHECK_THROWS_WITH(total_elements(g, {4, 2, 8, 0, -2}, {}),
                    "LayerStack: max_rollback (-2) must be >= 0");
  CHECK_THROWS_WITH(total_elements(g, {4, 0, 0, 3}, {}),
                    Catch::Contains("sink_tokens / max_rollback (3) need sliding-window layers"));
  CHECK_THROWS_WITH(total_elements(g, {4}, {10, 0}), "Workload: batch (0) must be >= 1");
  CHECK_THROWS_WITH(total_elements(g, {4}, {-1, 1}), "Workload: seq_len (-1) must be >= 0");
  CHECK_THROWS_WITH(total_elements(g, {4}, {10, 1, -16}),
                    "Workload: page_tokens (-16) must be >= 0 (0 means not paged)");
  CHECK_THROWS_WITH(bytes_per_token_per_layer(g, CacheStorage{Dtype::bf16, Dtype::bf16, -1}),
                    "CacheStorage: scale_block (-1) must be >= 0 (0 means no block scales)");
  // Totals beyond 2^63 - 1 throw instead of wrapping around.
  constexpr Index big = std::numeric_limits<Index>::max() / 4;
  CHECK_THROWS_MATCHES(total_bytes(g, {}, {1}, {big, 1}), std::overflow_error,
                       Catch::Message("kvattn::analysis: total bytes does not fit in a signed "
                                      "64-bit integer"));
  CHECK_THROWS_WITH(total_elements(g, {1000}, {big, 1}),
                    "kvattn::analysis: token slots does not fit in a signed 64-bit integer");
  // A valid layer can still overflow a total (kvattn::overflow_error, which is also a
  // std::overflow_error); a layer whose own sizes overflow is a config_error.
  CHECK_THROWS_AS(elements_per_token(cache_layout(gqa(1 << 10, 1 << 10, 1 << 10)), big),
                  kvattn::overflow_error);
  CHECK_THROWS_AS(elements_per_token(cache_layout(gqa(1 << 10, 1 << 10, 1 << 10)), big),
                  std::overflow_error);
  CHECK_THROWS_AS(cache_layout(gqa(1 << 20, 1 << 20, 1 << 20)), config_error);
}
