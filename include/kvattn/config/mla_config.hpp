// Configuration of multi-head latent attention (MLA, DeepSeek-V2).
//
// Symbols follow seed 002 (Chapters 2-3) and the DeepSeek-V2 paper; the Hugging Face
// config.json key is given where it differs.
#pragma once

#include <string>

#include "kvattn/config/rope_config.hpp"
#include "kvattn/config/rules.hpp"
#include "kvattn/config/yarn_config.hpp"
#include "kvattn/core/index.hpp"

namespace kvattn {

/// Multi-head latent attention. Per token the cache holds the (normalized) KV latent
/// c_kv (d_c) and one rope key k_R (d_R) shared by all heads: d_c + d_R elements.
/// Head h scores with [q_h^nope ; q_h^R] . [k_h^nope ; k_R], where
/// k_h^nope = c_kv . W_UK_h and v_h = c_kv . W_UV_h.
struct MlaConfig {
  Index d_model = 0;      // d, hidden size
  Index n_heads = 0;      // H (n_h), attention heads
  Index kv_rank = 0;      // d_c, KV compression width (kv_lora_rank); the cached latent
  Index q_rank = 0;       // d_c', query compression width (q_lora_rank); 0: none
  Index qk_nope_dim = 0;  // d_nope (seed: d_h), content part of each query/key head
  Index rope_dim = 0;     // d_R (seed: d_h^R), decoupled rope width; k_R is shared by all heads
  Index v_dim = 0;        // d_v, value head width (may differ from d_nope)
  RopeConfig rope{};      // layout / theta / position offset of the rope channel (width d_R)
  YarnConfig yarn{};      // YaRN on the rope channel; also multiplies the softmax scale by m^2
  bool q_norm = false;    // RMSNorm (with gain) on the query latent c_q; needs q_rank > 0
  bool kv_norm = true;    // RMSNorm (with gain) on c_kv; the cached latent is the normalized one
  double norm_epsilon = 1e-6;  // epsilon inside both RMSNorms (rms_norm_eps)
  double softmax_scale = 0.0;  // 0: 1/sqrt(d_nope + d_R) * m^2 (see scale())
  Index window = 0;            // W: a query sees its last W tokens, itself included; 0: global
  Index sink_tokens = 0;       // k: the first k tokens stay visible past the window
                               // (StreamingLLM); needs window > 0
  bool sink_logits = false;    // a learned logit per head joins each softmax denominator with
                               // no value (GPT-OSS); the values are the weights' `sinks`
  double logit_softcap = 0.0;  // c > 0: each scaled logit s becomes c tanh(s / c) (Gemma 2)

  /// Width of one query/key head, d_nope + d_R (q_head_dim).
  constexpr Index qk_head_dim() const { return qk_nope_dim + rope_dim; }
  /// Width of all query heads, H * (d_nope + d_R).
  constexpr Index query_width() const { return n_heads * qk_head_dim(); }
  /// Stored elements per cached token, d_c + d_R.
  constexpr Index cache_elements_per_token() const { return kv_rank + rope_dim; }
  /// YaRN's attention factor m (1 without YaRN); the scale carries m^2.
  double attention_factor() const { return yarn_attention_factor(yarn); }

  /// The softmax scale: softmax_scale if set, else 1/sqrt(d_nope + d_R) * m^2. It is
  /// the width of the dotted head vectors [q^nope; q^R] (seed 002, Chapter 3), never
  /// the width of the cached row (d_c + d_R) that absorbed decode dots against.
  double scale() const {
    const double m = attention_factor();
    return detail::softmax_scale_or_default(softmax_scale, qk_head_dim(), m * m);
  }

  /// Throws config_error naming the field and the rule, including dimensions whose
  /// derived sizes do not fit in a signed 64-bit integer.
  constexpr void validate() const {
    constexpr const char* where = "MlaConfig";
    detail::require(d_model >= 1, where, "d_model", d_model, "must be >= 1");
    detail::require(n_heads >= 1, where, "n_heads", n_heads, "must be >= 1");
    detail::require(kv_rank >= 1, where, "kv_rank", kv_rank, "must be >= 1");
    detail::require(q_rank >= 0, where, "q_rank", q_rank,
                    "must be >= 0 (0 means no query compression)");
    detail::require(qk_nope_dim >= 1, where, "qk_nope_dim", qk_nope_dim, "must be >= 1");
    detail::require(rope_dim >= 0, where, "rope_dim", rope_dim,
                    "must be >= 0 (0 means no decoupled rope channel)");
    detail::require(v_dim >= 1, where, "v_dim", v_dim, "must be >= 1");
    detail::require(!q_norm || q_rank > 0, where, "q_rank", q_rank,
                    "must be > 0 when q_norm is set (there is no query latent to normalize)");
    if (!(norm_epsilon > 0.0) || !detail::is_finite(norm_epsilon)) {
      detail::fail_config(where, ": norm_epsilon (", norm_epsilon, ") must be finite and > 0");
    }
    detail::check_softmax_scale(where, softmax_scale,
                                "1/sqrt(qk_nope_dim + rope_dim) times YaRN's m^2");
    detail::check_attention_span(where, window, sink_tokens, logit_softcap);
    rope.validate(where);
    yarn.validate(where);
    if (rope.enabled()) {
      detail::require(rope_dim >= 2 && rope_dim % 2 == 0, where, "rope_dim", rope_dim,
                      "must be even and >= 2 when RoPE is enabled");
    }
    if (yarn.enabled && !rope.enabled()) {
      detail::fail_config(where,
                          ": yarn.enabled (1) needs RoPE: set rope.layout to half_split or "
                          "interleaved");
    }
    const Index head =
        detail::size_sum(where, "query head width qk_nope_dim + rope_dim", qk_nope_dim, rope_dim);
    const Index query = detail::size_product(
        where, "query width n_heads x (qk_nope_dim + rope_dim)", n_heads, head);
    detail::size_sum(where, "elements per token kv_rank + rope_dim", kv_rank, rope_dim);
    const Index nope = detail::size_product(where, "n_heads x qk_nope_dim", n_heads, qk_nope_dim);
    const Index values = detail::size_product(where, "n_heads x v_dim", n_heads, v_dim);
    detail::size_product(where, "w_q elements d_model x query width", d_model, query);
    detail::size_product(where, "w_dq elements d_model x q_rank", d_model, q_rank);
    detail::size_product(where, "w_uq elements q_rank x query width", q_rank, query);
    detail::size_product(where, "w_dkv elements d_model x kv_rank", d_model, kv_rank);
    detail::size_product(where, "w_kr elements d_model x rope_dim", d_model, rope_dim);
    detail::size_product(where, "w_uk elements kv_rank x (n_heads x qk_nope_dim)", kv_rank, nope);
    detail::size_product(where, "w_uv elements kv_rank x (n_heads x v_dim)", kv_rank, values);
    detail::size_product(where, "w_o elements (n_heads x v_dim) x d_model", values, d_model);
    detail::size_product(where, "absorbed queries n_heads x (kv_rank + rope_dim)", n_heads,
                         kv_rank + rope_dim);
  }

  constexpr bool operator==(const MlaConfig&) const = default;
};

/// DeepSeek-V2's attention (236B; config.json of deepseek-ai/DeepSeek-V2): d 5120,
/// 128 heads, d_c 512, d_c' 1536, d_nope 128, d_R 64, d_v 128, interleaved RoPE with
/// theta 10000 and YaRN (factor 40 over 4096 positions, beta 32/1, mscale 0.707/0.707).
constexpr MlaConfig deepseek_v2_config() {
  MlaConfig c;
  c.d_model = 5120;
  c.n_heads = 128;
  c.kv_rank = 512;
  c.q_rank = 1536;
  c.qk_nope_dim = 128;
  c.rope_dim = 64;
  c.v_dim = 128;
  c.rope = {RopeLayout::interleaved, 10000.0, 0};
  c.yarn = {true, 40.0, 4096, 32.0, 1.0, 0.707, 0.707};
  c.q_norm = true;
  c.kv_norm = true;
  c.norm_epsilon = 1e-6;
  return c;
}

/// DeepSeek-V2-Lite's attention (16B): d 2048, 16 heads, no query compression,
/// otherwise as DeepSeek-V2.
constexpr MlaConfig deepseek_v2_lite_config() {
  MlaConfig c = deepseek_v2_config();
  c.d_model = 2048;
  c.n_heads = 16;
  c.q_rank = 0;
  c.q_norm = false;
  return c;
}

/// DeepSeek-V3's attention (671B): d 7168, 128 heads, YaRN mscale 1.0/1.0, otherwise
/// as DeepSeek-V2.
constexpr MlaConfig deepseek_v3_config() {
  MlaConfig c = deepseek_v2_config();
  c.d_model = 7168;
  c.yarn.mscale = 1.0;
  c.yarn.mscale_all_dim = 1.0;
  return c;
}

namespace detail {
/// The shape of a config in one line, for error messages and page-pool layouts.
inline std::string describe(const MlaConfig& c) {
  return "{d_model " + std::to_string(c.d_model) + ", n_heads " + std::to_string(c.n_heads) +
         ", kv_rank " + std::to_string(c.kv_rank) + ", q_rank " + std::to_string(c.q_rank) +
         ", qk_nope_dim " + std::to_string(c.qk_nope_dim) + ", rope_dim " +
         std::to_string(c.rope_dim) + ", v_dim " + std::to_string(c.v_dim) + "}";
}
}  // namespace detail

}  // namespace kvattn
