// [analysis]: every number the seeds derive, reproduced by the analytic module.
//
// Expected values are the seeds' own numbers (seed 002 = "Embeddings II: MLA &
// Architectural Choices", Chapters 1-4; seed 000 = the LRKV paper discussion), each
// re-derived by hand in a comment. Where a seed number is rounded the check says to
// what. Most checks are static_asserts: the module is constexpr.
#include <catch2/catch.hpp>

#include <algorithm>

#include "kvattn/analysis/budget.hpp"
#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/analysis/params.hpp"

using namespace kvattn;
using namespace kvattn::analysis;

namespace {

/// |x - shown| <= half a unit of the last printed digit: `shown` is x rounded to
/// `decimals` decimals (ties either way).
constexpr bool rounds_to(double x, double shown, int decimals) {
  double half = 0.5;
  for (int i = 0; i < decimals; ++i) half /= 10.0;
  const double diff = x > shown ? x - shown : shown - x;
  return diff <= half * (1.0 + 1e-12);
}

// DeepSeek-V2 (seed 002, Chapter 1): l = 60 layers, n_h = 128 heads, d_h = 128, d = 5120;
// GQA at 8 groups (the paper's ablation); MLA d_c = 512, d_h^R = 64, d_c' = 1536.
constexpr Index kLayers = 60;
constexpr GqaConfig kMha{.d_model = 5120, .n_heads = 128, .head_dim = 128, .n_kv_heads = 128};
constexpr GqaConfig kGqa8{.d_model = 5120, .n_heads = 128, .head_dim = 128, .n_kv_heads = 8};
constexpr GqaConfig kMqa{.d_model = 5120, .n_heads = 128, .head_dim = 128, .n_kv_heads = 1};
constexpr MlaConfig kMla{.d_model = 5120,
                         .n_heads = 128,
                         .kv_rank = 512,
                         .q_rank = 1536,
                         .qk_nope_dim = 128,
                         .rope_dim = 64,
                         .v_dim = 128};

constexpr MlaConfig with_ranks(MlaConfig c, Index kv_rank, Index rope_dim) {
  c.kv_rank = kv_rank;
  c.rope_dim = rope_dim;
  return c;
}

/// An LRKV layer of the paper's shape: d_h = 128, d = H * 128, no RoPE, no key norm.
constexpr LrkvConfig lrkv(Index heads, Index rank) {
  return LrkvConfig{.d_model = heads * 128, .n_heads = heads, .head_dim = 128, .rank = rank};
}

/// MLA at the LRKV paper's 128M shape (H = 6, d_h = 128), with rope_dim = 0 as the
/// paper's baseline counts its cache.
constexpr MlaConfig mla_128m(Index kv_rank) {
  return MlaConfig{.d_model = 768,
                   .n_heads = 6,
                   .kv_rank = kv_rank,
                   .q_rank = 0,
                   .qk_nope_dim = 128,
                   .rope_dim = 0,
                   .v_dim = 128};
}

// ---- Seed 002, Chapter 1: per-token elements over 60 layers ------------------------
// MHA: 2 * 128 * 128 = 32,768 per layer; * 60 = 1,966,080.
static_assert(elements_per_token_per_layer(kMha) == 32'768);
static_assert(elements_per_token(kMha, kLayers) == 1'966'080);
// GQA-8: 2 * 8 * 128 = 2,048 per layer (a sixteenth of MHA); * 60 = 122,880.
static_assert(elements_per_token_per_layer(kGqa8) == 2'048);
static_assert(elements_per_token(kGqa8, kLayers) == 122'880);
// MQA: 2 * 128 = 256 per layer; * 60 = 15,360 (128x below MHA).
static_assert(elements_per_token(kMqa, kLayers) == 15'360);
// MLA (Chapter 3): (512 + 64) * 60 = 34,560.
static_assert(elements_per_token_per_layer(kMla) == 576);
static_assert(elements_per_token(kMla, kLayers) == 34'560);
// The layer-by-layer table: each 10 layers add 32,768 * 10 = 327,680 elements.
static_assert(elements_per_token(kMha, 10) == 327'680);
static_assert(elements_per_token(kMha, 20) - elements_per_token(kMha, 10) == 327'680);

// ---- Bytes in bf16 (2 bytes per element), binary units ---------------------------
// MHA: 1,966,080 * 2 = 3,932,160 bytes = 3.75 * 1024 * 1024 = 3.75 MiB.
static_assert(bytes_per_token(cache_layout(kMha), plain_storage(Dtype::bf16), kLayers) ==
              3'932'160);
static_assert(3'932'160 == 3 * 1024 * 1024 + 3 * 1024 * 1024 / 4);
// MLA: 34,560 * 2 = 69,120 bytes = 67.5 * 1024 = 67.5 KiB.
static_assert(bytes_per_token(cache_layout(kMla), plain_storage(Dtype::bf16), kLayers) == 69'120);
static_assert(69'120 == 67 * 1024 + 512);
// The default storage is bf16, and fp32 doubles it.
static_assert(bytes_per_token(cache_layout(kMla), {}, kLayers) == 69'120);
static_assert(bytes_per_token(cache_layout(kMla), plain_storage(Dtype::fp32), kLayers) == 138'240);

// ---- Reductions ------------------------------------------------------------------
// 1,966,080 / 34,560 = 56.888..., printed as 56.9x (one decimal).
static_assert(rounds_to(1.0 / ratio_to_mha(kMla), 56.9, 1));
static_assert(!rounds_to(1.0 / ratio_to_mha(kMla), 57.0, 1));
// The latent alone: 1,966,080 / (512 * 60 = 30,720) = 64 exactly.
static_assert(elements_per_token(with_ranks(kMla, 512, 0), kLayers) == 30'720);
static_assert(1.0 / ratio_to_mha(with_ranks(kMla, 512, 0)) == 64.0);
// GQA-8 is 16x below MHA, MQA 128x (exact).
static_assert(ratio_to_mha(kGqa8) == 1.0 / 16.0);
static_assert(ratio_to_mha(kMqa) == 1.0 / 128.0);

// ---- GQA-equivalent groups (Chapter 3) ---------------------------------------------
// 2 * n_g * 128 * 60 = 34,560  ->  n_g = 34,560 / 15,360 = 2.25 exactly.
static_assert(gqa_equivalent_groups(kMla) == 2.25);
static_assert(gqa_equivalent_groups(kGqa8) == 8.0);
static_assert(gqa_equivalent_groups(kMha) == 128.0);
// Worked example (Chapter 8): d_c = 640, d_h^R = 80, l = 72:
// (640 + 80) * 72 = 51,840; n_g = 51,840 / (2 * 128 * 72 = 18,432) = 2.8125, printed 2.81.
static_assert(elements_per_token(with_ranks(kMla, 640, 80), 72) == 51'840);
static_assert(gqa_equivalent_groups(with_ranks(kMla, 640, 80)) == 2.8125);
static_assert(rounds_to(gqa_equivalent_groups(with_ranks(kMla, 640, 80)), 2.81, 2));
// Chapter 4's sweep: MLA sits between n_g = 2 (30,720) and n_g = 4 (61,440).
static_assert(
    elements_per_token(GqaConfig{.d_model = 5120, .n_heads = 128, .head_dim = 128, .n_kv_heads = 2},
                       kLayers) == 30'720);
static_assert(
    elements_per_token(GqaConfig{.d_model = 5120, .n_heads = 128, .head_dim = 128, .n_kv_heads = 4},
                       kLayers) == 61'440);

// ---- DeepSeek's fp8 MLA cache ------------------------------------------------------
// 512 fp8 latent bytes + ceil(512 / 128) = 4 fp32 scales (16 bytes) + 64 bf16 rope
// elements (128 bytes) = 656 bytes per token per layer.
static_assert(bytes_per_token_per_layer(kMla, block_scaled_storage()) == 512 + 4 * 4 + 64 * 2);
static_assert(bytes_per_token_per_layer(kMla, block_scaled_storage()) == 656);
static_assert(scales_per_token_per_layer(cache_layout(kMla), block_scaled_storage()) == 4);

// ---- K/V parameters (Chapter 2) ----------------------------------------------------
// MHA: W_K, W_V each 16,384 x 5,120: 2 * 16,384 * 5,120 = 167,772,160.
static_assert(kv_projection_params(kMha) == 167'772'160);
// MLA: W_DKV 512 x 5,120 = 2,621,440; W_UK, W_UV 16,384 x 512 each = 16,777,216 in all;
// 19,398,656 without W_KR; W_KR 5,120 x 64 = 327,680 more: 19,726,336.
static_assert(kv_projection_params(kMla, false) == 19'398'656);
static_assert(kv_projection_params(kMla, true) == 19'726'336);
// 167,772,160 / 19,398,656 = 8.6486, printed 8.65x; with W_KR 8.5050, printed 8.50x.
static_assert(rounds_to(static_cast<double>(kv_projection_params(kMha)) /
                            static_cast<double>(kv_projection_params(kMla, false)),
                        8.65, 2));
static_assert(rounds_to(static_cast<double>(kv_projection_params(kMha)) /
                            static_cast<double>(kv_projection_params(kMla, true)),
                        8.50, 2));
// GQA-8 and MQA: 2 * n_kv * d * d_h.
static_assert(kv_projection_params(kGqa8) == 2 * 8 * 5120 * 128);
static_assert(kv_projection_params(kMqa) == 2 * 5120 * 128);

// ---- Running the calculator backwards (Chapter 4) -----------------------------------
// Budget 50,000 elements per token, d_h^R = 64, l = 60: d_c <= 50,000 / 60 - 64 = 769.33,
// printed 769.3; in steps of 32 the largest is 768, and (768 + 64) * 60 = 49,920 fits.
static_assert(rounds_to(kv_rank_bound(64, 60, 50'000), 769.3, 1));
static_assert(max_kv_rank(kMla, 60, Budget{50'000, BudgetUnit::elements}) == 768);
static_assert(elements_per_token(with_ranks(kMla, 768, 64), 60) == 49'920);
static_assert(elements_per_token(with_ranks(kMla, 800, 64), 60) > 50'000);
// With step 1 the bound's floor, 769: (769 + 64) * 60 = 49,980.
static_assert(max_kv_rank(kMla, 60, Budget{50'000, BudgetUnit::elements}, {}, 1) == 769);

// ---- Seed 000: LRKV cache ratio 1/H + r/d_h at the paper's scales (Table 7) ---------
// 128M: 1/6 + 46/128 = 0.52604 -> 52.60%; 1.2B: 1/12 + 51/128 = 0.48177 -> 48.18%;
// 2.5B: 1/18 + 55/128 = 0.48524 -> 48.52%; 6.3B: 1/32 + 54/128 = 0.45313 -> 45.31%.
static_assert(rounds_to(100.0 * ratio_to_mha(lrkv(6, 46)), 52.60, 2));
static_assert(rounds_to(100.0 * ratio_to_mha(lrkv(12, 51)), 48.18, 2));
static_assert(rounds_to(100.0 * ratio_to_mha(lrkv(18, 55)), 48.52, 2));
static_assert(rounds_to(100.0 * ratio_to_mha(lrkv(32, 54)), 45.31, 2));
// 2.5B: MHA 2 * 18 * 128 = 4,608 -> LRKV 2 * (128 + 18 * 55) = 2,236 per token per layer.
static_assert(elements_per_token_per_layer(GqaConfig{
                  .d_model = 2304, .n_heads = 18, .head_dim = 128, .n_kv_heads = 18}) == 4'608);
static_assert(elements_per_token_per_layer(lrkv(18, 55)) == 2'236);
// Rank sweep (Table 8, H = 6): 1/6 + r/128 for r = 8, 16, 32, 64, 128, one decimal.
static_assert(rounds_to(100.0 * ratio_to_mha(lrkv(6, 8)), 22.9, 1));
static_assert(rounds_to(100.0 * ratio_to_mha(lrkv(6, 16)), 29.2, 1));
static_assert(rounds_to(100.0 * ratio_to_mha(lrkv(6, 32)), 41.7, 1));
static_assert(rounds_to(100.0 * ratio_to_mha(lrkv(6, 64)), 66.7, 1));
static_assert(rounds_to(100.0 * ratio_to_mha(lrkv(6, 128)), 116.7, 1));
// r = d_h: the ratio is 1 + 1/H (the cache exceeds MHA's); r = 0: MQA-style 1/H.
static_assert(ratio_to_mha(lrkv(6, 128)) == 1.0 + 1.0 / 6.0);
static_assert(elements_per_token_per_layer(lrkv(6, 0)) ==
              elements_per_token_per_layer(GqaConfig{
                  .d_model = 768, .n_heads = 6, .head_dim = 128, .n_kv_heads = 1}));
// MLA rows of Table 8 (rope_dim = 0): d_c / (2 * 6 * 128 = 1,536): 128 -> 8.3%,
// 192 -> 12.5%, 384 -> 25.0%.
static_assert(rounds_to(100.0 * ratio_to_mha(mla_128m(128)), 8.3, 1));
static_assert(100.0 * ratio_to_mha(mla_128m(192)) == 12.5);
static_assert(100.0 * ratio_to_mha(mla_128m(384)) == 25.0);
// Table 12's r = 64 rows: 1/6 + 1/2 = 66.67%, 1/18 + 1/2 = 55.56%, 1/32 + 1/2 = 53.13%.
static_assert(rounds_to(100.0 * ratio_to_mha(lrkv(6, 64)), 66.67, 2));
static_assert(rounds_to(100.0 * ratio_to_mha(lrkv(18, 64)), 55.56, 2));
static_assert(rounds_to(100.0 * ratio_to_mha(lrkv(32, 64)), 53.13, 2));
// LRKV K/V parameters (Eq. 10): 2 d d_h + 2 H r (d + d_h); MHA 2 H d d_h. At 2.5B
// (d = 2,304, H = 18, r = 55): 589,824 + 2 * 18 * 55 * 2,432 = 5,405,184.
static_assert(kv_projection_params(lrkv(18, 55)) == 2 * 2304 * 128 + 2 * 18 * 55 * (2304 + 128));
static_assert(kv_projection_params(lrkv(18, 55)) == 5'405'184);

}  // namespace

// The same numbers at run time, so a failure prints the values (and the static_asserts
// above are not the only evidence that the checks ran).
TEST_CASE("DeepSeek-V2 per-token cache as seed 002 derives it", "[analysis]") {
  CHECK(elements_per_token(kMha, kLayers) == 1'966'080);
  CHECK(elements_per_token(kGqa8, kLayers) == 122'880);
  CHECK(elements_per_token(kMqa, kLayers) == 15'360);
  CHECK(elements_per_token(kMla, kLayers) == 34'560);
  CHECK(bytes_per_token(cache_layout(kMha), plain_storage(Dtype::bf16), kLayers) ==
        3.75 * 1024 * 1024);
  CHECK(bytes_per_token(cache_layout(kMla), plain_storage(Dtype::bf16), kLayers) == 67.5 * 1024);
  CHECK(1.0 / ratio_to_mha(kMla) == Approx(1'966'080.0 / 34'560.0));
  CHECK(gqa_equivalent_groups(kMla) == 2.25);
  CHECK(bytes_per_token_per_layer(kMla, block_scaled_storage()) == 656);
  CHECK(max_kv_rank(kMla, 60, Budget{50'000, BudgetUnit::elements}) == 768);
}

TEST_CASE("LRKV cache ratio is 1/H + r/d_h for every H, r, d_h", "[analysis][lrkv]") {
  // seed 000, Eq. 9: rho = 2L(d_h + H r) / (2 L H d_h) = 1/H + r/d_h.
  for (const Index heads : {1, 2, 3, 6, 7, 12, 18, 32, 64}) {
    for (const Index head_dim : {1, 8, 59, 64, 128, 256}) {
      for (Index rank = 0; rank <= head_dim; rank += std::max<Index>(1, head_dim / 7)) {
        const LrkvConfig c{.d_model = 16, .n_heads = heads, .head_dim = head_dim, .rank = rank};
        CAPTURE(heads, head_dim, rank);
        const double expected = 1.0 / static_cast<double>(heads) +
                                static_cast<double>(rank) / static_cast<double>(head_dim);
        CHECK(ratio_to_mha(c) == Approx(expected).epsilon(1e-14));
        CHECK(elements_per_token_per_layer(c) == 2 * (head_dim + heads * rank));
      }
    }
  }
}
