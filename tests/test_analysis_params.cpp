// [analysis]: parameter counts equal the scalars of each layer's real weights.
//
// The expected counts are plain sums of the sizes of the matrices that
// <Mechanism>Weights::random(config) allocates, over random small configurations.
#include <catch2/catch.hpp>

#include <cstdint>
#include <random>

#include "kvattn/analysis/params.hpp"
#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"

using namespace kvattn;
using namespace kvattn::analysis;

namespace {

Index pick(std::mt19937_64& rng, Index lo, Index hi) {
  return std::uniform_int_distribution<Index>(lo, hi)(rng);
}

}  // namespace

TEST_CASE("GQA family parameter counts equal the weights' sizes", "[analysis][gqa]") {
  std::mt19937_64 rng(501);
  for (int i = 0; i < 40; ++i) {
    const Index n_kv = pick(rng, 1, 6);
    GqaConfig c{.d_model = pick(rng, 1, 70),
                .n_heads = n_kv * pick(rng, 1, 4),
                .head_dim = pick(rng, 1, 33),
                .n_kv_heads = n_kv,
                .qkv_bias = i % 2 == 1};
    CAPTURE(c.d_model, c.n_heads, c.head_dim, c.n_kv_heads, c.qkv_bias);
    const auto w = GqaWeights<float>::random(c, static_cast<std::uint64_t>(i));
    CHECK(kv_projection_params(c) ==
          w.w_k.size() + w.w_v.size() + w.bias_k.size() + w.bias_v.size());
    CHECK(query_params(c) == w.w_q.size() + w.bias_q.size());
    CHECK(output_params(c) == w.w_o.size());
    CHECK(attention_params(c) == w.w_q.size() + w.w_k.size() + w.w_v.size() + w.w_o.size() +
                                     w.bias_q.size() + w.bias_k.size() + w.bias_v.size());
  }
  // MHA 2 H d d_h, MQA 2 d d_h (no biases), by hand at d 64, H 8, d_h 16.
  CHECK(kv_projection_params(GqaConfig{64, 8, 16, 8}) == 2 * 8 * 64 * 16);
  CHECK(kv_projection_params(GqaConfig{64, 8, 16, 1}) == 2 * 64 * 16);
}

TEST_CASE("MLA parameter counts equal the weights' sizes", "[analysis][mla]") {
  std::mt19937_64 rng(502);
  for (int i = 0; i < 40; ++i) {
    MlaConfig c;
    c.d_model = pick(rng, 1, 64);
    c.n_heads = pick(rng, 1, 6);
    c.kv_rank = pick(rng, 1, 40);
    c.q_rank = i % 3 == 0 ? 0 : pick(rng, 1, 40);
    c.qk_nope_dim = pick(rng, 1, 24);
    c.rope_dim = 2 * pick(rng, 0, 8);
    c.v_dim = pick(rng, 1, 24);
    c.q_norm = c.q_rank > 0 && i % 2 == 0;
    c.kv_norm = i % 4 != 1;
    if (c.rope_dim > 0) c.rope.layout = RopeLayout::half_split;
    CAPTURE(c.d_model, c.n_heads, c.kv_rank, c.q_rank, c.qk_nope_dim, c.rope_dim, c.v_dim, c.q_norm,
            c.kv_norm);
    const auto w = MlaWeights<float>::random(c, static_cast<std::uint64_t>(i));
    CHECK(kv_projection_params(c, false) == w.w_dkv.size() + w.w_uk.size() + w.w_uv.size());
    CHECK(kv_projection_params(c, true) ==
          w.w_dkv.size() + w.w_uk.size() + w.w_uv.size() + w.w_kr.size());
    CHECK(query_params(c) == w.w_dq.size() + w.q_norm_gain.size() + w.w_uq.size() + w.w_q.size());
    CHECK(attention_params(c) == w.w_dq.size() + w.q_norm_gain.size() + w.w_uq.size() +
                                     w.w_q.size() + w.w_dkv.size() + w.kv_norm_gain.size() +
                                     w.w_kr.size() + w.w_uk.size() + w.w_uv.size() + w.w_o.size());
  }
}

TEST_CASE("LRKV parameter counts equal the weights' sizes", "[analysis][lrkv]") {
  std::mt19937_64 rng(503);
  for (int i = 0; i < 40; ++i) {
    LrkvConfig c;
    c.d_model = pick(rng, 1, 64);
    c.n_heads = pick(rng, 1, 6);
    c.head_dim = 2 * pick(rng, 1, 12);
    c.rank = pick(rng, 0, c.head_dim);
    c.key_norm = i % 2 == 1;
    if (i % 3 == 1) {
      c.rope_mode = LrkvRopeMode::decoupled;
      c.rope.layout = RopeLayout::interleaved;
      c.rope_dim = 2 * pick(rng, 1, 6);
    }
    CAPTURE(c.d_model, c.n_heads, c.head_dim, c.rank, c.key_norm, c.rope_dim);
    const auto w = LrkvWeights<float>::random(c, static_cast<std::uint64_t>(i));
    // seed 000, Eq. 10: 2 d d_h + 2 H r (d + d_h), plus W_KR when decoupled.
    CHECK(kv_projection_params(c) == w.w_k_shared.size() + w.w_v_shared.size() + w.u_k.size() +
                                         w.u_v.size() + w.basis_k.size() + w.basis_v.size() +
                                         w.w_kr.size());
    CHECK(attention_params(c) == w.w_q.size() + w.w_k_shared.size() + w.w_v_shared.size() +
                                     w.u_k.size() + w.u_v.size() + w.basis_k.size() +
                                     w.basis_v.size() + w.w_o.size() + w.w_qr.size() +
                                     w.w_kr.size() + w.key_norm_gain.size());
  }
}
