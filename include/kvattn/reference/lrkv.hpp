// Expanded reference of LRKV: every head's full key and value are materialized for
// every token, K_h = K_s + R_h^K (B_h^K)^T and V_h = V_s + R_h^V (B_h^V)^T (seed 000,
// Eqs. 4-5), normalized and rotated exactly as the config's model says, then dense
// attention. It computes every rope_mode, `full` included. Used by tests and
// benchmarks; the fast paths never include this header.
#pragma once

#include <cmath>
#include <optional>
#include <string>
#include <type_traits>

#include "kvattn/attention/lrkv.hpp"
#include "kvattn/cache/lrkv_cache.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/mask.hpp"
#include "kvattn/core/rope.hpp"
#include "kvattn/reference/dense_attention.hpp"

namespace kvattn::reference {

/// The layer's output for a whole sequence x (L x d), token i at position
/// rope.position_offset + i, under `mask` (by default the layer's own: causal, or its sliding
/// window with its sink tokens), with the layer's soft-cap and sink logits. Returns L x d.
///
/// Per head h (rows are tokens; P rotates each row at its own position):
///   none       scores Q_h K_h^T
///   full,      scores (P Q_h)(P K_h)^T          (commuting is full RoPE, computed
///   commuting                                    here on the materialized K_h)
///   shared     scores [P Q_h, Q_h] [P K^s_h, K^r_h]^T, where K_h = K^s_h + K^r_h is split
///              into its shared part and its residual part (after key norm)
///   decoupled  scores [Q_h, P Q^R_h] [K_h, P K_R]^T
/// with key norm K_h <- g (.) K_h / rho (row-wise RMS of K_s + R_h^K (B_h^K)^T) first.
template <class T>
RowMatrix<T> forward(const LrkvLayer<T>& layer, const ConstMatrixRef<std::type_identity_t<T>>& x,
                     const std::optional<Mask>& mask = std::nullopt) {
  const LrkvConfig& c = layer.config();
  const LrkvWeights<T>& w = layer.weights();
  detail::check_shape("reference::forward", "x", x, -1, c.d_model);
  const Index L = x.rows();
  // Column blocks of an empty (null) matrix would offset a null pointer.
  if (L == 0) return RowMatrix<T>(0, c.d_model);
  const Index dh = c.head_dim;
  const Index r = c.rank;
  const Index dr = c.decoupled_dim();
  const T scale = static_cast<T>(c.scale());
  const Rope rope_head = c.rotates_shared() ? Rope(c.rope, dh) : Rope();
  const Rope rope_decoupled = dr > 0 ? Rope(c.rope, dr) : Rope();
  auto position = [&](Index i) { return static_cast<double>(c.rope.position_offset + i); };
  auto rotate_rows = [&](RowMatrix<T>& m, const Rope& rope) {
    for (Index i = 0; i < m.rows(); ++i) rope.rotate(m.row(i).data(), position(i));
  };

  const RowMatrix<T> k_shared_raw = x * w.w_k_shared;  // K_s
  const RowMatrix<T> v_shared = x * w.w_v_shared;      // V_s
  RowMatrix<T> k_rope;                                 // P K_R (decoupled)
  if (dr > 0) {
    k_rope = x * w.w_kr;
    rotate_rows(k_rope, rope_decoupled);
  }
  RowMatrix<T> heads(L, c.n_heads * dh);
  for (Index h = 0; h < c.n_heads; ++h) {
    RowMatrix<T> q = x * w.w_q.middleCols(h * dh, dh);
    // The head's full key and value, materialized for every token.
    RowMatrix<T> k_shared = k_shared_raw;
    RowMatrix<T> k_residual =
        (x * w.u_k.middleCols(h * r, r)) * w.basis_k.middleCols(h * r, r).transpose();
    const RowMatrix<T> v =
        v_shared + (x * w.u_v.middleCols(h * r, r)) * w.basis_v.middleCols(h * r, r).transpose();
    if (c.key_norm) {
      for (Index t = 0; t < L; ++t) {
        const RowVector<T> full = k_shared.row(t) + k_residual.row(t);
        const T rho =
            std::sqrt(full.squaredNorm() / static_cast<T>(dh) + static_cast<T>(c.key_norm_epsilon));
        k_shared.row(t) = k_shared.row(t).cwiseProduct(w.key_norm_gain) / rho;
        k_residual.row(t) = k_residual.row(t).cwiseProduct(w.key_norm_gain) / rho;
      }
    }
    RowMatrix<T> q_model, k_model;
    switch (c.rope_mode) {
      case LrkvRopeMode::none:
        q_model = q;
        k_model = k_shared + k_residual;
        break;
      case LrkvRopeMode::full:
      case LrkvRopeMode::commuting:
        q_model = q;
        k_model = k_shared + k_residual;
        rotate_rows(q_model, rope_head);
        rotate_rows(k_model, rope_head);
        break;
      case LrkvRopeMode::shared: {
        RowMatrix<T> q_rotated = q;
        rotate_rows(q_rotated, rope_head);
        rotate_rows(k_shared, rope_head);
        q_model.resize(L, 2 * dh);
        k_model.resize(L, 2 * dh);
        q_model.leftCols(dh) = q_rotated;
        q_model.rightCols(dh) = q;
        k_model.leftCols(dh) = k_shared;
        k_model.rightCols(dh) = k_residual;
        break;
      }
      case LrkvRopeMode::decoupled: {
        RowMatrix<T> q_rope = x * w.w_qr.middleCols(h * dr, dr);
        rotate_rows(q_rope, rope_decoupled);
        q_model.resize(L, dh + dr);
        k_model.resize(L, dh + dr);
        q_model.leftCols(dh) = q;
        q_model.rightCols(dr) = q_rope;
        k_model.leftCols(dh) = k_shared + k_residual;
        k_model.rightCols(dr) = k_rope;
        break;
      }
    }
    heads.middleCols(h * dh, dh) =
        attention<T>(q_model, k_model, v, scale, mask.value_or(mask_of(c)), 0, shaping_of(c, w, h));
  }
  return heads * w.w_o;
}

/// The attention step of the newest cached token (index cache.tokens() - 1), the
/// expanded way: the per-head outputs, 1 x H*d_h, before W_O. `query` is that token's
/// projected query, head h's [x W_Q_h | x W_QR_h] in columns [h*(d_h+d_R), (h+1)*(d_h+d_R)),
/// 1 x H*(d_h + d_R) (d_R only for rope_mode
/// decoupled), before RoPE and scale. Every head's full key and value of every cached
/// token are materialized from the cached shared rows and latents,
///   k_h,t = k~_s,t + R_h,t^K (B_h^K)^T,   v_h,t = v_s,t + R_h,t^V (B_h^V)^T,
/// with key norm (g (.) . / rho_h,t, the gain already in the stored k~_s,t), then
/// dense attention with the model's logits at position i = rope.position_offset +
/// tokens() - 1 (P_i rotates):
///   none       q_h . k_h,t
///   shared     (P_i q_h) . k~_s,t + q_h . (residual part of k_h,t)   (k~_s,t stored rotated)
///   decoupled  q_h . k_h,t + (P_i q^R_h) . k~_R,t
/// Rope modes commuting and full throw config_error (commuting's stored latents are
/// rotated per plane; full cannot be computed from the cache at all: use forward).
/// Throws config_error if the cache was made for another config, shape_error for a
/// wrongly shaped query or an empty cache.
template <class T, class S>
RowMatrix<T> decode_step(const LrkvLayer<T>& layer, const LrkvCache<T, S>& cache,
                         const ConstMatrixRef<std::type_identity_t<T>>& query) {
  constexpr const char* where = "reference::decode_step";
  const LrkvConfig& c = layer.config();
  const LrkvWeights<T>& w = layer.weights();
  if (!(cache.config() == c)) {
    throw config_error(std::string(where) + ": the cache was made for config " +
                       detail::describe(cache.config()) + ", the layer has " + detail::describe(c));
  }
  if (c.rope_mode != LrkvRopeMode::none && c.rope_mode != LrkvRopeMode::shared &&
      c.rope_mode != LrkvRopeMode::decoupled) {
    throw config_error(std::string(where) + ": rope_mode " + to_string(c.rope_mode) +
                       " is not supported by the LRKV reference decode step (none, shared and "
                       "decoupled are); use reference::forward on the whole sequence");
  }
  const Index dh = c.head_dim;
  const Index r = c.rank;
  const Index dr = c.decoupled_dim();
  const Index H = c.n_heads;
  detail::check_shape(where, "query", query, 1, H * (dh + dr));
  if (cache.tokens() < 1) {
    throw shape_error(std::string(where) +
                      ": the cache is empty (the newest cached token is the one that attends)");
  }
  const Index L = cache.tokens();
  const Index newest = L - 1;
  const double position = static_cast<double>(c.rope.position_offset + newest);
  const RowMatrix<T> shared_keys = cache.shared_keys().template cast<T>();      // k~_s, L x d_h
  const RowMatrix<T> shared_values = cache.shared_values().template cast<T>();  // v_s,  L x d_h
  const RowMatrix<T> rope_keys = cache.rope_keys().template cast<T>();          // k~_R, L x d_R
  const RowMatrix<T> key_rms = cache.key_rms().template cast<T>();              // rho,  L x H
  RowMatrix<T> heads(1, H * dh);
  for (Index h = 0; h < H; ++h) {
    RowMatrix<T> q = query.middleCols(h * (dh + dr), dh);
    RowMatrix<T> q_rope = query.middleCols(h * (dh + dr) + dh, dr);
    // Head h's shared and residual key parts and its full value, every cached token.
    RowMatrix<T> k_shared = shared_keys;
    RowMatrix<T> k_residual =
        cache.residual_keys(h).template cast<T>() * w.basis_k.middleCols(h * r, r).transpose();
    const RowMatrix<T> v = shared_values + cache.residual_values(h).template cast<T>() *
                                               w.basis_v.middleCols(h * r, r).transpose();
    if (c.key_norm) {
      for (Index t = 0; t < L; ++t) {
        k_shared.row(t) /= key_rms(t, h);  // the gain is in the stored shared key already
        k_residual.row(t) = k_residual.row(t).cwiseProduct(w.key_norm_gain) / key_rms(t, h);
      }
    }
    RowMatrix<T> q_model, k_model;
    switch (c.rope_mode) {
      case LrkvRopeMode::none:
        q_model = q;
        k_model = k_shared + k_residual;
        break;
      case LrkvRopeMode::shared: {
        q_model.resize(1, 2 * dh);
        k_model.resize(L, 2 * dh);
        RowMatrix<T> q_rotated = q;
        layer.rope().rotate(q_rotated.data(), position);
        q_model.leftCols(dh) = q_rotated;
        q_model.rightCols(dh) = q;
        k_model.leftCols(dh) = k_shared;  // stored rotated at each token's own position
        k_model.rightCols(dh) = k_residual;
        break;
      }
      default: {  // decoupled
        layer.rope().rotate(q_rope.data(), position);
        q_model.resize(1, dh + dr);
        k_model.resize(L, dh + dr);
        q_model.leftCols(dh) = q;
        q_model.rightCols(dr) = q_rope;
        k_model.leftCols(dh) = k_shared + k_residual;
        k_model.rightCols(dr) = rope_keys;  // stored rotated
        break;
      }
    }
    heads.middleCols(h * dh, dh) =
        attention<T>(q_model, k_model, v, layer.softmax_scale(), mask_of(c), newest,
                     shaping_of(c, layer.weights(), h));
  }
  return heads;
}

}  // namespace kvattn::reference
