// Configuration of the MHA / GQA / MQA family.
#pragma once

#include <cmath>
#include <string>

#include "kvattn/core/errors.hpp"
#include "kvattn/core/rope.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn {

/// Grouped-query attention. MHA is n_kv_heads == n_heads, MQA is n_kv_heads == 1.
/// Query head h reads KV head h / (n_heads / n_kv_heads) (the repeat-interleave
/// convention of Llama, ONNX and PyTorch).
struct GqaConfig {
  Index d_model = 0;           // d
  Index n_heads = 0;           // H, query heads
  Index head_dim = 0;          // d_h
  Index n_kv_heads = 0;        // n_kv, KV heads (groups); divides H
  bool qkv_bias = false;       // biases on the Q, K, V projections (as Qwen2 has)
  RopeConfig rope{};           // rotary embedding of queries and keys (width d_h)
  double softmax_scale = 0.0;  // 0 means 1/sqrt(d_h)

  /// Query heads per KV head, H / n_kv.
  Index group_size() const { return n_heads / n_kv_heads; }
  /// The scale applied to q.k: softmax_scale, or 1/sqrt(d_h) when it is 0.
  double scale() const {
    return softmax_scale > 0.0 ? softmax_scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
  }

  void validate() const {
    constexpr const char* where = "GqaConfig";
    detail::require(d_model >= 1, where, "d_model", d_model, "must be >= 1");
    detail::require(n_heads >= 1, where, "n_heads", n_heads, "must be >= 1");
    detail::require(head_dim >= 1, where, "head_dim", head_dim, "must be >= 1");
    detail::require(n_kv_heads >= 1, where, "n_kv_heads", n_kv_heads, "must be >= 1");
    if (n_heads % n_kv_heads != 0) {
      throw config_error(std::string(where) + ": n_heads (" + std::to_string(n_heads) +
                         ") must be divisible by n_kv_heads (" + std::to_string(n_kv_heads) + ")");
    }
    if (!(softmax_scale >= 0.0) || !std::isfinite(softmax_scale)) {
      throw config_error(std::string(where) + ": softmax_scale (" + std::to_string(softmax_scale) +
                         ") must be finite and >= 0 (0 selects 1/sqrt(head_dim))");
    }
    rope.validate(where);
    if (rope.enabled()) {
      detail::require(head_dim % 2 == 0, where, "head_dim", head_dim,
                      "must be even when RoPE is enabled");
    }
  }

  bool operator==(const GqaConfig&) const = default;
};

/// Multi-head attention: every query head has its own KV head.
inline GqaConfig mha_config(Index d_model, Index n_heads, Index head_dim, RopeConfig rope = {}) {
  return {d_model, n_heads, head_dim, n_heads, false, rope, 0.0};
}

/// Grouped-query attention with n_kv_heads KV heads.
inline GqaConfig gqa_config(Index d_model, Index n_heads, Index head_dim, Index n_kv_heads,
                            RopeConfig rope = {}) {
  return {d_model, n_heads, head_dim, n_kv_heads, false, rope, 0.0};
}

/// Multi-query attention: one KV head shared by every query head.
inline GqaConfig mqa_config(Index d_model, Index n_heads, Index head_dim, RopeConfig rope = {}) {
  return {d_model, n_heads, head_dim, 1, false, rope, 0.0};
}

}  // namespace kvattn
