// LRKV at full rank reproduces MHA (seed 000, "r = d_h: expressive enough for MHA"):
// the config, weights and layer that compute an MHA layer's function exactly.
#pragma once

#include <string>

#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/lrkv_weights.hpp"
#include "kvattn/config/gqa_config.hpp"
#include "kvattn/config/lrkv_config.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn {

/// The LRKV config whose layer reproduces the MHA layer `mha` at full rank: r = d_h,
/// the same RoPE settings and softmax scale, rope_mode commuting with RoPE (exact full
/// RoPE) and none without. Throws config_error unless mha is MHA without biases.
inline LrkvConfig lrkv_config_from_mha(const GqaConfig& mha) {
  mha.validate();
  if (mha.n_kv_heads != mha.n_heads) {
    throw config_error("lrkv_config_from_mha: n_kv_heads (" + std::to_string(mha.n_kv_heads) +
                       ") must equal n_heads (" + std::to_string(mha.n_heads) +
                       "): only MHA maps onto LRKV at full rank");
  }
  if (mha.qkv_bias) {
    throw config_error("lrkv_config_from_mha: qkv_bias (1) must be false: LRKV has no biases");
  }
  LrkvConfig config;
  config.d_model = mha.d_model;
  config.n_heads = mha.n_heads;
  config.head_dim = mha.head_dim;
  config.rank = mha.head_dim;
  config.rope_mode = mha.rope.enabled() ? LrkvRopeMode::commuting : LrkvRopeMode::none;
  config.rope = mha.rope;
  config.softmax_scale = mha.softmax_scale;
  config.window = mha.window;
  config.sink_tokens = mha.sink_tokens;
  config.sink_logits = mha.sink_logits;
  config.logit_softcap = mha.logit_softcap;
  config.validate();
  return config;
}

/// The weights that make LRKV at full rank reproduce an MHA layer: W_shared = 0,
/// r = d_h, U_h = W_h, B_h = I. With RoPE the config (lrkv_config_from_mha) is rope_mode
/// commuting, and B_h^K is the permutation taking latent pair j to rotary plane j (I for
/// interleaved), with U_h^K = W_h^K B_h^K, so U_h^K (B_h^K)^T = W_h^K still. Needs
/// n_kv_heads == n_heads and no biases (config_error otherwise).
template <class T>
LrkvWeights<T> lrkv_weights_from_mha(const GqaConfig& mha, const GqaWeights<T>& weights) {
  const LrkvConfig config = lrkv_config_from_mha(mha);
  weights.check(mha);
  const Index d = config.d_model;
  const Index dh = config.head_dim;
  const Index H = config.n_heads;
  // B_h^K: latent pair j -> rotary plane j (the identity unless half-split RoPE).
  RowMatrix<T> perm = RowMatrix<T>::Identity(dh, dh);
  if (config.rope.layout == RopeLayout::half_split) {
    perm.setZero();
    for (Index j = 0; j < dh / 2; ++j) {
      perm(j, 2 * j) = T(1);
      perm(j + dh / 2, 2 * j + 1) = T(1);
    }
  }
  LrkvWeights<T> w;
  w.w_q = weights.w_q;
  w.w_k_shared = RowMatrix<T>::Zero(d, dh);
  w.w_v_shared = RowMatrix<T>::Zero(d, dh);
  w.u_k.resize(d, H * dh);
  w.u_v = weights.w_v;
  w.basis_k.resize(dh, H * dh);
  w.basis_v.resize(dh, H * dh);
  for (Index h = 0; h < H; ++h) {
    w.u_k.middleCols(h * dh, dh) =
        weights.w_k.middleCols(h * dh, dh) * perm;  // exact: a permutation
    w.basis_k.middleCols(h * dh, dh) = perm;
    w.basis_v.middleCols(h * dh, dh).setIdentity();
  }
  w.w_o = weights.w_o;
  w.sinks = weights.sinks;
  w.w_qr = RowMatrix<T>(d, 0);
  w.w_kr = RowMatrix<T>(d, 0);
  return w;
}

/// The full-rank LRKV layer that computes the same function as the MHA layer `mha`.
template <class T>
LrkvLayer<T> lrkv_from_mha(const GqaLayer<T>& mha) {
  return LrkvLayer<T>(lrkv_config_from_mha(mha.config()),
                      lrkv_weights_from_mha(mha.config(), mha.weights()));
}

}  // namespace kvattn
