// Configuration of the MHA / GQA / MQA family.
#pragma once

#include <string>

#include "kvattn/config/rope_config.hpp"
#include "kvattn/config/rules.hpp"
#include "kvattn/core/index.hpp"

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
  Index window = 0;            // W: a query sees its last W tokens, itself included; 0: global
  Index sink_tokens = 0;       // k: the first k tokens stay visible past the window
                               // (StreamingLLM); needs window > 0
  bool sink_logits = false;    // a learned logit per head joins each softmax denominator with
                               // no value (GPT-OSS); the values are the weights' `sinks`
  double logit_softcap = 0.0;  // c > 0: each scaled logit s becomes c tanh(s / c) (Gemma 2)

  /// Query heads per KV head, H / n_kv.
  constexpr Index group_size() const { return n_heads / n_kv_heads; }
  /// Width of all query heads, H * d_h.
  constexpr Index query_width() const { return n_heads * head_dim; }
  /// Width of all KV heads' keys (or values), n_kv * d_h.
  constexpr Index kv_width() const { return n_kv_heads * head_dim; }
  /// Stored elements per cached token, 2 * n_kv * d_h.
  constexpr Index cache_elements_per_token() const { return 2 * kv_width(); }
  /// The scale applied to q.k: softmax_scale, or 1/sqrt(d_h) when it is 0.
  double scale() const { return detail::softmax_scale_or_default(softmax_scale, head_dim); }

  /// Throws config_error naming the field and the rule. Also refuses dimensions whose
  /// derived sizes (widths, weight elements, elements per token, in bytes of an
  /// 8-byte scalar) do not fit in a signed 64-bit integer.
  constexpr void validate() const {
    constexpr const char* where = "GqaConfig";
    detail::require(d_model >= 1, where, "d_model", d_model, "must be >= 1");
    detail::require(n_heads >= 1, where, "n_heads", n_heads, "must be >= 1");
    detail::require(head_dim >= 1, where, "head_dim", head_dim, "must be >= 1");
    detail::require(n_kv_heads >= 1, where, "n_kv_heads", n_kv_heads, "must be >= 1");
    if (n_heads % n_kv_heads != 0) {
      detail::fail_config(where, ": n_heads (", n_heads, ") must be divisible by n_kv_heads (",
                          n_kv_heads, ")");
    }
    detail::check_softmax_scale(where, softmax_scale, "1/sqrt(head_dim)");
    detail::check_attention_span(where, window, sink_tokens, logit_softcap);
    rope.validate(where);
    if (rope.enabled()) {
      detail::require(head_dim % 2 == 0, where, "head_dim", head_dim,
                      "must be even when RoPE is enabled");
    }
    const Index q =
        detail::size_product(where, "query width n_heads x head_dim", n_heads, head_dim);
    const Index kv =
        detail::size_product(where, "KV width n_kv_heads x head_dim", n_kv_heads, head_dim);
    detail::size_product(where, "w_q elements d_model x (n_heads x head_dim)", d_model, q);
    detail::size_product(where, "w_k elements d_model x (n_kv_heads x head_dim)", d_model, kv);
    detail::size_product(where, "elements per token 2 x (n_kv_heads x head_dim)", 2, kv);
  }

  constexpr bool operator==(const GqaConfig&) const = default;
};

/// Multi-head attention: every query head has its own KV head.
constexpr GqaConfig mha_config(Index d_model, Index n_heads, Index head_dim, RopeConfig rope = {}) {
  return {d_model, n_heads, head_dim, n_heads, false, rope, 0.0};
}

/// Grouped-query attention with n_kv_heads KV heads.
constexpr GqaConfig gqa_config(Index d_model, Index n_heads, Index head_dim, Index n_kv_heads,
                               RopeConfig rope = {}) {
  return {d_model, n_heads, head_dim, n_kv_heads, false, rope, 0.0};
}

/// Multi-query attention: one KV head shared by every query head.
constexpr GqaConfig mqa_config(Index d_model, Index n_heads, Index head_dim, RopeConfig rope = {}) {
  return {d_model, n_heads, head_dim, 1, false, rope, 0.0};
}

namespace detail {
/// The shape of a config in one line, for error messages and page-pool layouts.
inline std::string describe(const GqaConfig& c) {
  return "{d_model " + std::to_string(c.d_model) + ", n_heads " + std::to_string(c.n_heads) +
         ", head_dim " + std::to_string(c.head_dim) + ", n_kv_heads " +
         std::to_string(c.n_kv_heads) + "}";
}
}  // namespace detail

}  // namespace kvattn
