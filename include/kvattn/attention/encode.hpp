// Bidirectional encoding: a whole sequence through one attention layer with every
// token seeing every other token, and no cache (seed 002, Chapter 6: NV-Embed removes
// the causal mask for embedding). This is an encoder's full-sequence forward, so it
// materializes each head's L x L scores; the cached causal paths are prefill/decode.
//
// Works for GqaLayer (MHA / GQA / MQA), MlaLayer and LrkvLayer (every rope_mode),
// token i at position rope.position_offset + i.
#pragma once

#include <cmath>
#include <type_traits>
#include <vector>

#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/rms_norm.hpp"
#include "kvattn/core/rope.hpp"
#include "kvattn/core/softmax.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/core/yarn.hpp"
#include "kvattn/pooling/simple_pooling.hpp"
#include "kvattn/pooling/token_mask.hpp"

namespace kvattn {

/// Fraction of the N x N query-key cells a causal mask leaves visible:
/// N(N+1)/2 / N^2 = 1/2 + 1/(2N) (55 of 100 cells at N = 10). A bidirectional mask
/// leaves all of them.
inline double causal_visible_fraction(Index n) {
  detail::require(n >= 1, "causal_visible_fraction", "n", n, "must be >= 1 (tokens)");
  return 0.5 + 0.5 / static_cast<double>(n);
}

/// Number of visible cells of a causal mask over n tokens, n (n + 1) / 2.
inline Index causal_visible_cells(Index n) {
  detail::require(n >= 0, "causal_visible_cells", "n", n, "must be >= 0 (tokens)");
  return n * (n + 1) / 2;
}

namespace detail {

/// softmax(scale q k^T) v over every key (no mask): q L x k, k L x k, v L x dv.
template <class T>
RowMatrix<T> bidirectional_head(const RowMatrix<T>& q, const RowMatrix<T>& k, const RowMatrix<T>& v,
                                T scale) {
  RowMatrix<T> p = scale * (q * k.transpose());
  softmax_rows_inplace(p);
  return p * v;
}

template <class T>
void rotate_rows(RowMatrix<T>& m, const Rope& rope, Index position_offset) {
  for (Index i = 0; i < m.rows(); ++i) {
    rope.rotate(m.row(i).data(), static_cast<double>(position_offset + i));
  }
}

}  // namespace detail

/// Bidirectional forward of a GQA-family layer. x: L x d (L >= 1). Returns L x d.
template <class T>
RowMatrix<T> encode(const GqaLayer<T>& layer, const ConstMatrixRef<std::type_identity_t<T>>& x) {
  const GqaConfig& c = layer.config();
  const GqaWeights<T>& w = layer.weights();
  detail::check_shape("encode", "x", x, -1, c.d_model);
  const Index dh = c.head_dim;
  RowMatrix<T> q = x * w.w_q, k = x * w.w_k, v = x * w.w_v;
  if (c.qkv_bias) {
    q.rowwise() += w.b_q;
    k.rowwise() += w.b_k;
    v.rowwise() += w.b_v;
  }
  RowMatrix<T> heads(x.rows(), c.n_heads * dh);
  std::vector<RowMatrix<T>> keys(static_cast<std::size_t>(c.n_kv_heads));
  for (Index g = 0; g < c.n_kv_heads; ++g) {
    keys[g] = k.middleCols(g * dh, dh);
    detail::rotate_rows(keys[g], layer.rope(), c.rope.position_offset);
  }
  for (Index h = 0; h < c.n_heads; ++h) {
    const Index g = h / c.group_size();
    RowMatrix<T> q_h = q.middleCols(h * dh, dh);
    detail::rotate_rows(q_h, layer.rope(), c.rope.position_offset);
    heads.middleCols(h * dh, dh) = detail::bidirectional_head<T>(
        q_h, keys[g], v.middleCols(g * dh, dh), layer.softmax_scale());
  }
  return heads * w.w_o;
}

/// Bidirectional forward of an MLA layer (keys and values expanded from the latent).
template <class T>
RowMatrix<T> encode(const MlaLayer<T>& layer, const ConstMatrixRef<std::type_identity_t<T>>& x) {
  const MlaConfig& c = layer.config();
  const MlaWeights<T>& w = layer.weights();
  detail::check_shape("encode", "x", x, -1, c.d_model);
  const Index length = x.rows(), dn = c.qk_nope_dim, dr = c.rope_dim, qd = c.qk_head_dim();
  RowMatrix<T> q;
  if (c.q_rank > 0) {
    RowMatrix<T> c_q = x * w.w_dq;
    if (c.q_norm) {
      for (Index i = 0; i < length; ++i) {
        rms_norm_inplace(c_q.row(i).data(), c.q_rank, w.q_norm_gain.data(), c.norm_epsilon);
      }
    }
    q = c_q * w.w_uq;
  } else {
    q = x * w.w_q;
  }
  RowMatrix<T> latent = x * w.w_dkv;
  if (c.kv_norm) {
    for (Index i = 0; i < length; ++i) {
      rms_norm_inplace(latent.row(i).data(), c.kv_rank, w.kv_norm_gain.data(), c.norm_epsilon);
    }
  }
  RowMatrix<T> k_rope = x * w.w_kr;
  detail::rotate_rows(k_rope, layer.rope(), c.rope.position_offset);
  RowMatrix<T> heads(length, c.n_heads * c.v_dim);
  for (Index h = 0; h < c.n_heads; ++h) {
    RowMatrix<T> q_h = q.middleCols(h * qd, qd);
    RowMatrix<T> q_rope = q_h.rightCols(dr);
    detail::rotate_rows(q_rope, layer.rope(), c.rope.position_offset);
    q_h.rightCols(dr) = q_rope;
    RowMatrix<T> k_h(length, qd);
    k_h.leftCols(dn) = latent * w.w_uk.middleCols(h * dn, dn);
    k_h.rightCols(dr) = k_rope;
    heads.middleCols(h * c.v_dim, c.v_dim) = detail::bidirectional_head<T>(
        q_h, k_h, latent * w.w_uv.middleCols(h * c.v_dim, c.v_dim), layer.softmax_scale());
  }
  return heads * w.w_o;
}

/// Bidirectional forward of an LRKV layer: K_h = K_s + (X U_h^K) B_h^K^T and
/// V_h = V_s + (X U_h^V) B_h^V^T per head, key-normed and rotated as rope_mode says.
template <class T>
RowMatrix<T> encode(const LrkvLayer<T>& layer, const ConstMatrixRef<std::type_identity_t<T>>& x) {
  const LrkvConfig& c = layer.config();
  const LrkvWeights<T>& w = layer.weights();
  detail::check_shape("encode", "x", x, -1, c.d_model);
  const Index length = x.rows(), dh = c.head_dim, r = c.rank, dr = c.decoupled_dim();
  const Index offset = c.rope.position_offset;
  const Rope head_rope = c.rotates_shared() ? Rope(c.rope, dh) : Rope();
  const Rope decoupled_rope = dr > 0 ? Rope(c.rope, dr) : Rope();
  const RowMatrix<T> k_s = x * w.w_k_shared;
  const RowMatrix<T> v_s = x * w.w_v_shared;
  RowMatrix<T> k_rope;
  if (dr > 0) {
    k_rope = x * w.w_kr;
    detail::rotate_rows(k_rope, decoupled_rope, offset);
  }
  RowMatrix<T> heads(length, c.n_heads * dh);
  for (Index h = 0; h < c.n_heads; ++h) {
    const RowMatrix<T> q = x * w.w_q.middleCols(h * dh, dh);
    RowMatrix<T> shared = k_s;
    RowMatrix<T> residual =
        (x * w.u_k.middleCols(h * r, r)) * w.b_k.middleCols(h * r, r).transpose();
    const RowMatrix<T> v =
        v_s + (x * w.u_v.middleCols(h * r, r)) * w.b_v.middleCols(h * r, r).transpose();
    if (c.key_norm) {  // g (.) k / rms(k) over the full key k = shared + residual
      for (Index t = 0; t < length; ++t) {
        const T inv_rho =
            T(1) / std::sqrt((shared.row(t) + residual.row(t)).squaredNorm() / static_cast<T>(dh) +
                             static_cast<T>(c.key_norm_epsilon));
        shared.row(t) = shared.row(t).cwiseProduct(w.key_norm_gain) * inv_rho;
        residual.row(t) = residual.row(t).cwiseProduct(w.key_norm_gain) * inv_rho;
      }
    }
    RowMatrix<T> q_m, k_m;
    if (c.rope_mode == LrkvRopeMode::shared) {  // rotate the shared part only
      q_m.resize(length, 2 * dh);
      k_m.resize(length, 2 * dh);
      q_m.leftCols(dh) = q;
      q_m.rightCols(dh) = q;
      RowMatrix<T> rotated = q;
      detail::rotate_rows(rotated, head_rope, offset);
      q_m.leftCols(dh) = rotated;
      detail::rotate_rows(shared, head_rope, offset);
      k_m.leftCols(dh) = shared;
      k_m.rightCols(dh) = residual;
    } else if (c.rope_mode == LrkvRopeMode::decoupled) {
      RowMatrix<T> q_rope = x * w.w_qr.middleCols(h * dr, dr);
      detail::rotate_rows(q_rope, decoupled_rope, offset);
      q_m.resize(length, dh + dr);
      k_m.resize(length, dh + dr);
      q_m.leftCols(dh) = q;
      q_m.rightCols(dr) = q_rope;
      k_m.leftCols(dh) = shared + residual;
      k_m.rightCols(dr) = k_rope;
    } else {  // none, or RoPE on the whole key (full, commuting)
      q_m = q;
      k_m = shared + residual;
      if (c.rope_mode != LrkvRopeMode::none) {
        detail::rotate_rows(q_m, head_rope, offset);
        detail::rotate_rows(k_m, head_rope, offset);
      }
    }
    heads.middleCols(h * dh, dh) =
        detail::bidirectional_head<T>(q_m, k_m, v, layer.softmax_scale());
  }
  return heads * w.w_o;
}

/// Self-attention pooling: one bidirectional self-attention layer over the sequence,
/// then the mean over the kept tokens (masked tokens still shape the others through
/// attention; they are only left out of the mean). Returns 1 x d.
template <class Layer>
RowVector<typename Layer::scalar_type> self_attention_pool(
    const Layer& layer, const ConstMatrixRef<typename Layer::scalar_type>& x,
    const TokenMask& mask = {}) {
  using T = typename Layer::scalar_type;
  detail::check_pool_input("self_attention_pool", x, layer.config().d_model, mask);
  const RowMatrix<T> encoded = encode(layer, x);
  return mean_pool<T>(encoded, mask);
}

}  // namespace kvattn
