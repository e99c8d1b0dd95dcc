// Parameter counts of each mechanism's projections, from its configuration alone.
//
//   K/V projections   MHA 2*H*d*d_h     GQA 2*n_kv*d*d_h     MQA 2*d*d_h
//                     MLA d_c*d + H*d_c*(d_nope + d_v) (= d_c*d + 2*H*d_h*d_c when
//                         d_nope = d_v = d_h), plus d*d_R for W_KR
//                     LRKV 2*d*d_h + 2*H*r*(d + d_h) (seed 000, Eq. 10), plus d*d_R for
//                         W_KR when decoupled
//   attention layer   the K/V count plus the query path (W_Q; MLA's W_DQ, W_UQ and
//                     RMSNorm gain with query compression; LRKV's decoupled W_QR), W_O,
//                     the biases (GQA qkv_bias) and RMSNorm gains (MLA kv_norm / q_norm,
//                     LRKV key_norm): exactly the scalars of the layer's weights struct.
// Counts are numbers of scalars, not bytes.
#pragma once

#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/config/gqa_config.hpp"
#include "kvattn/config/lrkv_config.hpp"
#include "kvattn/config/mla_config.hpp"
#include "kvattn/core/index.hpp"

namespace kvattn::analysis {

namespace detail {
/// a * b * c with overflow checks.
constexpr Index mul3(Index a, Index b, Index c, const char* what) {
  return mul(mul(a, b, what), c, what);
}
}  // namespace detail

/// W_K and W_V (d x n_kv*d_h each), and their biases with qkv_bias.
constexpr Index kv_projection_params(const GqaConfig& c) {
  c.validate();
  using detail::mul;
  using detail::mul3;
  const Index weights = mul3(2, c.d_model, mul(c.n_kv_heads, c.head_dim, "KV width"), "K/V params");
  const Index biases = c.qkv_bias ? mul3(2, c.n_kv_heads, c.head_dim, "K/V biases") : 0;
  return detail::add(weights, biases, "K/V params");
}

/// W_DKV (d x d_c), W_UK (d_c x H*d_nope), W_UV (d_c x H*d_v), and W_KR (d x d_R) unless
/// `with_rope_key` is false (seed 002 counts 8.65x against MHA without it, 8.50x with).
/// RMSNorm gains are not projections (attention_params counts them).
constexpr Index kv_projection_params(const MlaConfig& c, bool with_rope_key = true) {
  c.validate();
  using detail::add;
  using detail::mul3;
  Index n = detail::mul(c.kv_rank, c.d_model, "MLA W_DKV");
  n = add(n, mul3(c.kv_rank, c.n_heads, add(c.qk_nope_dim, c.v_dim, "MLA widths"), "MLA W_UK/W_UV"),
          "MLA K/V params");
  if (with_rope_key) n = add(n, detail::mul(c.d_model, c.rope_dim, "MLA W_KR"), "MLA K/V params");
  return n;
}

/// W_shared^K, W_shared^V (d x d_h each), U_h^{K,V} (d x r per head), B_h^{K,V}
/// (d_h x r per head): 2*d*d_h + 2*H*r*(d + d_h); plus W_KR (d x d_R) when decoupled.
constexpr Index kv_projection_params(const LrkvConfig& c) {
  c.validate();
  using detail::add;
  using detail::mul;
  using detail::mul3;
  Index n = mul3(2, c.d_model, c.head_dim, "LRKV shared");
  n = add(n,
          mul3(mul(2, c.n_heads, "2H"), c.rank, add(c.d_model, c.head_dim, "d + d_h"),
               "LRKV residuals"),
          "LRKV K/V params");
  if (c.rope_mode == LrkvRopeMode::decoupled) {
    n = add(n, detail::mul(c.d_model, c.rope_dim, "LRKV W_KR"), "LRKV K/V params");
  }
  return n;
}

/// The query path: W_Q (d x H*d_h) and b_Q with qkv_bias.
constexpr Index query_params(const GqaConfig& c) {
  c.validate();
  const Index width = detail::mul(c.n_heads, c.head_dim, "query width");
  return detail::add(detail::mul(c.d_model, width, "W_Q"), c.qkv_bias ? width : 0, "Q params");
}

/// The query path: W_DQ (d x d_c'), its RMSNorm gain (q_norm) and W_UQ
/// (d_c' x H*(d_nope + d_R)) with query compression; W_Q (d x H*(d_nope + d_R)) without.
constexpr Index query_params(const MlaConfig& c) {
  c.validate();
  using detail::add;
  using detail::mul;
  const Index width = mul(c.n_heads, add(c.qk_nope_dim, c.rope_dim, "q head"), "query width");
  if (c.q_rank == 0) return mul(c.d_model, width, "W_Q");
  Index n = mul(c.d_model, c.q_rank, "W_DQ");
  if (c.q_norm) n = add(n, c.q_rank, "Q params");
  return add(n, mul(c.q_rank, width, "W_UQ"), "Q params");
}

/// The query path: W_h^Q for all heads (d x H*d_h) and W_QR (d x H*d_R) when decoupled.
constexpr Index query_params(const LrkvConfig& c) {
  c.validate();
  using detail::mul;
  Index n = mul(c.d_model, mul(c.n_heads, c.head_dim, "query width"), "W_Q");
  if (c.rope_mode == LrkvRopeMode::decoupled) {
    n = detail::add(n, detail::mul3(c.d_model, c.n_heads, c.rope_dim, "W_QR"), "Q params");
  }
  return n;
}

/// W_O: (H*d_h) x d; MLA (H*d_v) x d.
constexpr Index output_params(const GqaConfig& c) {
  c.validate();
  return detail::mul3(c.n_heads, c.head_dim, c.d_model, "W_O");
}
constexpr Index output_params(const MlaConfig& c) {
  c.validate();
  return detail::mul3(c.n_heads, c.v_dim, c.d_model, "W_O");
}
constexpr Index output_params(const LrkvConfig& c) {
  c.validate();
  return detail::mul3(c.n_heads, c.head_dim, c.d_model, "W_O");
}

/// Every scalar of one attention layer: query path, K/V path, W_O, biases and gains.
constexpr Index attention_params(const GqaConfig& c) {
  using detail::add;
  return add(add(query_params(c), kv_projection_params(c), "params"), output_params(c), "params");
}

constexpr Index attention_params(const MlaConfig& c) {
  using detail::add;
  const Index gains = c.kv_norm ? c.kv_rank : 0;
  return add(add(add(query_params(c), kv_projection_params(c, true), "params"), gains, "params"),
             output_params(c), "params");
}

constexpr Index attention_params(const LrkvConfig& c) {
  using detail::add;
  const Index gains = c.key_norm ? c.head_dim : 0;
  return add(add(add(query_params(c), kv_projection_params(c), "params"), gains, "params"),
             output_params(c), "params");
}

}  // namespace kvattn::analysis
