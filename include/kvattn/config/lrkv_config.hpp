// Configuration of LRKV, low-rank key-value attention (seed 000, Eqs. 2-10).
//
// Each head's key/value projection is a shared dense base plus a low-rank residual,
//   W_h^{K,V} = W_shared^{K,V} + U_h^{K,V} (B_h^{K,V})^T        (seed 000, Eq. 2)
// and the cache holds the shared features K_s, V_s (d_h per token) and each head's
// latents R_h^K, R_h^V (r per token), 2 * (d_h + H * r) elements per token.
#pragma once

#include <string>

#include "kvattn/config/rope_config.hpp"
#include "kvattn/config/rules.hpp"
#include "kvattn/core/index.hpp"

namespace kvattn {

/// Where LRKV applies rotary position embedding (values are never rotated).
/// P_t is the RoPE rotation at position t; q_h the query of head h at position i.
enum class LrkvRopeMode {
  /// No rotation: logit_h,t = q_h . k_h,t.
  none,
  /// RoPE on the shared channel only:
  ///   logit_h,t = (P_i q_h) . (P_t k_s,t) + q_h . (B_h^K r_h,t).
  /// Exact in factored form (the cache holds P_t k_s,t).
  shared,
  /// MLA-style decoupled RoPE: an extra rotated query W_QR (d x H*d_R) and a rotated
  /// key W_KR (d x d_R) shared by all heads;
  ///   logit_h,t = (q_h . k_h,t + (P_i q_h^R) . (P_t k_R,t)) / sqrt(d_h + d_R).
  /// Exact in factored form; adds d_R elements per token to the cache.
  decoupled,
  /// RoPE on the whole key, logit_h,t = (P_i q_h) . (P_t k_h,t), as the paper claims is
  /// compatible. It is not, for a general B_h^K: P_t B_h != B_h P~_t (seed 000, backup
  /// slide). Accepted by validate() and computed by reference::forward, but the
  /// factored prefill/decode refuse it with a config_error.
  full,
  /// Full RoPE with B_h^K constrained so that each latent pair (2j, 2j+1) maps into one
  /// rotary plane by a scaled rotation; then P_t B_h^K = B_h^K P~_t exactly, P~_t
  /// rotating latent pair j by its plane's angle, and the cache holds P~_t r_h,t.
  /// Needs an even rank (and, with key_norm, a gain equal on both dims of each plane).
  commuting,
};

/// The mode's name as written in the enum ("none", "shared", ...).
constexpr const char* to_string(LrkvRopeMode mode) {
  switch (mode) {
    case LrkvRopeMode::none:
      return "none";
    case LrkvRopeMode::shared:
      return "shared";
    case LrkvRopeMode::decoupled:
      return "decoupled";
    case LrkvRopeMode::full:
      return "full";
    case LrkvRopeMode::commuting:
      return "commuting";
  }
  return "unknown";
}

/// Low-rank key-value attention. Every field carries its symbol from seed 000.
struct LrkvConfig {
  Index d_model = 0;   // d
  Index n_heads = 0;   // H, query heads (each with its own W_h^Q)
  Index head_dim = 0;  // d_h
  Index rank = 0;      // r, rank of each head's residual U_h B_h^T; 0 <= r <= d_h
  LrkvRopeMode rope_mode = LrkvRopeMode::none;  // where RoPE applies (see LrkvRopeMode)
  RopeConfig rope{};      // P_t: layout (half_split / interleaved), theta, position offset;
                          // layout is none exactly when rope_mode is none
  Index rope_dim = 0;     // d_R, width of the decoupled rotated query/key (decoupled only)
  bool key_norm = false;  // RMSNorm of each head's full key k_h,t, gain g (d_h)
                          // shared by all heads; order norm -> gain -> RoPE
  double key_norm_epsilon = 1e-6;  // epsilon inside the root of the key RMS
  double softmax_scale = 0.0;      // 0: 1/sqrt(d_h), or 1/sqrt(d_h + d_R) when decoupled
  Index window = 0;                // W: a query sees its last W tokens, itself included; 0: global
  Index sink_tokens = 0;           // k: the first k tokens stay visible past the window
                                   // (StreamingLLM); needs window > 0
  bool sink_logits = false;        // a learned logit per head joins each softmax denominator with
                                   // no value (GPT-OSS); the values are the weights' `sinks`
  double logit_softcap = 0.0;      // c > 0: each scaled logit s becomes c tanh(s / c) (Gemma 2)

  /// The scale applied to the logits before the softmax.
  double scale() const {
    return detail::softmax_scale_or_default(softmax_scale, head_dim + decoupled_dim());
  }
  /// Whether the shared key K_s (and the matching query) is rotated by P_t.
  constexpr bool rotates_shared() const {
    return rope_mode == LrkvRopeMode::shared || rope_mode == LrkvRopeMode::full ||
           rope_mode == LrkvRopeMode::commuting;
  }
  /// Whether the residual key B_h^K r_h,t is rotated by P_t.
  constexpr bool rotates_residual() const {
    return rope_mode == LrkvRopeMode::full || rope_mode == LrkvRopeMode::commuting;
  }
  /// d_R if the mode is decoupled, else 0.
  constexpr Index decoupled_dim() const {
    return rope_mode == LrkvRopeMode::decoupled ? rope_dim : 0;
  }
  /// Whether the factored (cached) path computes this model exactly; false only for full.
  constexpr bool factored_exact() const { return rope_mode != LrkvRopeMode::full; }
  /// Width of one head's query in attend's layout: d_h, plus d_R when decoupled.
  constexpr Index query_head_dim() const { return head_dim + decoupled_dim(); }
  /// Width of all query heads, H * (d_h + d_R).
  constexpr Index query_width() const { return n_heads * query_head_dim(); }
  /// Width of every head's key (or value) latents, H * r.
  constexpr Index residual_width() const { return n_heads * rank; }

  /// Cache elements per token: 2 * (d_h + H * r), plus d_R (decoupled key k_R) and
  /// H key RMS scalars (key_norm; stored as fp32 or wider, see LrkvCache).
  constexpr Index cache_elements_per_token() const {
    return 2 * (head_dim + n_heads * rank) + decoupled_dim() + (key_norm ? n_heads : 0);
  }

  /// Throws config_error naming the field and the rule, including dimensions whose
  /// derived sizes do not fit in a signed 64-bit integer.
  constexpr void validate() const {
    constexpr const char* where = "LrkvConfig";
    detail::require(d_model >= 1, where, "d_model", d_model, "must be >= 1");
    detail::require(n_heads >= 1, where, "n_heads", n_heads, "must be >= 1");
    detail::require(head_dim >= 1, where, "head_dim", head_dim, "must be >= 1");
    detail::require(rank >= 0, where, "rank", rank, "must be >= 0 (0 is MQA)");
    if (rank > head_dim) {
      detail::fail_config(where, ": rank (", rank, ") must be <= head_dim (", head_dim,
                          "): rank(U_h B_h^T) <= d_h, so a larger rank only adds cache");
    }
    const Index mode = static_cast<Index>(rope_mode);
    if (mode < 0 || mode > static_cast<Index>(LrkvRopeMode::commuting)) {
      detail::fail_config(where, ": rope_mode (", mode,
                          ") is not an LrkvRopeMode (none, shared, decoupled, full, commuting)");
    }
    if (rope_mode == LrkvRopeMode::none && rope.enabled()) {
      detail::fail_config(where,
                          ": rope.layout must be none when rope_mode is none (choose a rope_mode "
                          "to say where RoPE applies: shared, decoupled, commuting or full)");
    }
    if (rope_mode != LrkvRopeMode::none && !rope.enabled()) {
      detail::fail_config(where, ": rope.layout must be half_split or interleaved when rope_mode ",
                          to_string(rope_mode), " is set");
    }
    rope.validate(where);
    if (rotates_shared() && head_dim % 2 != 0) {
      detail::fail_config(where, ": head_dim (", head_dim, ") must be even when rope_mode ",
                          to_string(rope_mode), " rotates keys of width head_dim");
    }
    if (rope_mode == LrkvRopeMode::decoupled) {
      detail::require(rope_dim >= 2 && rope_dim % 2 == 0, where, "rope_dim", rope_dim,
                      "must be even and >= 2 when rope_mode is decoupled (d_R)");
    } else {
      detail::require(rope_dim == 0, where, "rope_dim", rope_dim,
                      "must be 0 unless rope_mode is decoupled (it is d_R of decoupled RoPE)");
    }
    if (rope_mode == LrkvRopeMode::commuting) {
      detail::require(rank % 2 == 0, where, "rank", rank,
                      "must be even when rope_mode is commuting (latents rotate in pairs)");
    }
    if (!(key_norm_epsilon > 0.0) || !detail::is_finite(key_norm_epsilon)) {
      detail::fail_config(where, ": key_norm_epsilon (", key_norm_epsilon,
                          ") must be finite and > 0");
    }
    detail::check_softmax_scale(where, softmax_scale, "the default 1/sqrt(width)");
    detail::check_attention_span(where, window, sink_tokens, logit_softcap);
    const Index heads = detail::size_product(where, "n_heads x head_dim", n_heads, head_dim);
    const Index residual =
        detail::size_product(where, "residual width n_heads x rank", n_heads, rank);
    const Index rope_queries =
        detail::size_product(where, "n_heads x rope_dim", n_heads, decoupled_dim());
    detail::size_sum(where, "query width n_heads x (head_dim + rope_dim)", heads, rope_queries);
    const Index key_row = detail::size_sum(
        where, "key row head_dim + n_heads x rank + rope_dim",
        detail::size_sum(where, "head_dim + n_heads x rank", head_dim, residual), decoupled_dim());
    const Index rows = detail::size_sum(where, "key and value rows", key_row, head_dim + residual);
    detail::size_sum(where, "elements per token", rows, key_norm ? n_heads : 0);
    detail::size_product(where, "w_q elements d_model x (n_heads x head_dim)", d_model, heads);
    detail::size_product(where, "w_o elements (n_heads x head_dim) x d_model", heads, d_model);
    detail::size_product(where, "u_k elements d_model x (n_heads x rank)", d_model, residual);
    detail::size_product(where, "basis_k elements head_dim x (n_heads x rank)", head_dim, residual);
    detail::size_product(where, "w_qr elements d_model x (n_heads x rope_dim)", d_model,
                         rope_queries);
  }

  constexpr bool operator==(const LrkvConfig&) const = default;
};

namespace detail {
/// The shape of a config in one line, for error messages and page-pool layouts.
inline std::string describe(const LrkvConfig& c) {
  return "{d_model " + std::to_string(c.d_model) + ", n_heads " + std::to_string(c.n_heads) +
         ", head_dim " + std::to_string(c.head_dim) + ", rank " + std::to_string(c.rank) +
         ", rope_mode " + to_string(c.rope_mode) + ", rope_dim " + std::to_string(c.rope_dim) +
         ", key_norm " + (c.key_norm ? "on" : "off") + "}";
}
}  // namespace detail

}  // namespace kvattn
