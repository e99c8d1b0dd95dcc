// Configuration of LRKV, low-rank key-value attention (seed 000, Eqs. 2-10).
//
// Each head's key/value projection is a shared dense base plus a low-rank residual,
//   W_h^{K,V} = W_shared^{K,V} + U_h^{K,V} (B_h^{K,V})^T        (seed 000, Eq. 2)
// and the cache holds the shared features K_s, V_s (d_h per token) and each head's
// latents R_h^K, R_h^V (r per token), 2 * (d_h + H * r) elements per token.
#pragma once

#include <cmath>
#include <string>

#include "kvattn/core/errors.hpp"
#include "kvattn/core/rope.hpp"
#include "kvattn/core/types.hpp"

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
inline const char* to_string(LrkvRopeMode mode) {
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

  /// The scale applied to the logits before the softmax.
  double scale() const {
    if (softmax_scale > 0.0) return softmax_scale;
    const Index width = head_dim + (rope_mode == LrkvRopeMode::decoupled ? rope_dim : 0);
    return 1.0 / std::sqrt(static_cast<double>(width));
  }
  /// Whether the shared key K_s (and the matching query) is rotated by P_t.
  bool rotates_shared() const {
    return rope_mode == LrkvRopeMode::shared || rope_mode == LrkvRopeMode::full ||
           rope_mode == LrkvRopeMode::commuting;
  }
  /// Whether the residual key B_h^K r_h,t is rotated by P_t.
  bool rotates_residual() const {
    return rope_mode == LrkvRopeMode::full || rope_mode == LrkvRopeMode::commuting;
  }
  /// d_R if the mode is decoupled, else 0.
  Index decoupled_dim() const { return rope_mode == LrkvRopeMode::decoupled ? rope_dim : 0; }
  /// Whether the factored (cached) path computes this model exactly; false only for full.
  bool factored_exact() const { return rope_mode != LrkvRopeMode::full; }

  /// Cache elements per token: 2 * (d_h + H * r), plus d_R (decoupled key k_R) and
  /// H key RMS scalars (key_norm; stored as fp32 or wider, see LrkvCache).
  Index cache_elements_per_token() const {
    return 2 * (head_dim + n_heads * rank) + decoupled_dim() + (key_norm ? n_heads : 0);
  }

  void validate() const {
    constexpr const char* where = "LrkvConfig";
    detail::require(d_model >= 1, where, "d_model", d_model, "must be >= 1");
    detail::require(n_heads >= 1, where, "n_heads", n_heads, "must be >= 1");
    detail::require(head_dim >= 1, where, "head_dim", head_dim, "must be >= 1");
    detail::require(rank >= 0, where, "rank", rank, "must be >= 0 (0 is MQA)");
    detail::require(rank <= head_dim, where, "rank", rank,
                    "must be <= head_dim (" + std::to_string(head_dim) +
                        "): rank(U_h B_h^T) <= d_h, so a larger rank only adds cache");
    const std::string mode = std::string("rope_mode ") + to_string(rope_mode);
    if (rope_mode == LrkvRopeMode::none && rope.enabled()) {
      throw config_error(std::string(where) +
                         ": rope.layout must be none when rope_mode is none (choose a rope_mode "
                         "to say where RoPE applies: shared, decoupled, commuting or full)");
    }
    if (rope_mode != LrkvRopeMode::none && !rope.enabled()) {
      throw config_error(std::string(where) +
                         ": rope.layout must be half_split or interleaved "
                         "when " +
                         mode + " is set");
    }
    rope.validate(where);
    if (rotates_shared()) {
      detail::require(head_dim % 2 == 0, where, "head_dim", head_dim,
                      "must be even when " + mode + " rotates keys of width head_dim");
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
    if (!(key_norm_epsilon > 0.0) || !std::isfinite(key_norm_epsilon)) {
      throw config_error(std::string(where) + ": key_norm_epsilon (" +
                         std::to_string(key_norm_epsilon) + ") must be finite and > 0");
    }
    if (!(softmax_scale >= 0.0) || !std::isfinite(softmax_scale)) {
      throw config_error(std::string(where) + ": softmax_scale (" + std::to_string(softmax_scale) +
                         ") must be finite and >= 0 (0 selects the default 1/sqrt(width))");
    }
  }

  bool operator==(const LrkvConfig&) const = default;
};

}  // namespace kvattn
