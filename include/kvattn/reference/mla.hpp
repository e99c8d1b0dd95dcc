// Expanded reference of MLA, seed 002's "reconstruct, then attend": every head gets
// its own full keys K_h = [C W_UK_h | K_R] and values V_h = C W_UV_h for every token,
// then dense attention. Used by tests and as the benchmark baseline; the fast paths
// never include this header.
#pragma once

#include <optional>
#include <string>
#include <type_traits>

#include "kvattn/attention/mla.hpp"
#include "kvattn/cache/mla_cache.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/mask.hpp"
#include "kvattn/core/rms_norm.hpp"
#include "kvattn/core/rope.hpp"
#include "kvattn/core/yarn.hpp"
#include "kvattn/reference/dense_attention.hpp"

namespace kvattn::reference {

/// The layer's output for a whole sequence x (L x d), token i at position
/// rope.position_offset + i, under `mask` (by default the layer's own: causal, or its sliding
/// window with its sink tokens), with the layer's soft-cap and sink logits. Returns L x d.
template <class T>
RowMatrix<T> forward(const MlaLayer<T>& layer, const ConstMatrixRef<std::type_identity_t<T>>& x,
                     const std::optional<Mask>& mask = std::nullopt) {
  const MlaConfig& c = layer.config();
  const MlaWeights<T>& w = layer.weights();
  detail::check_shape("reference::forward", "x", x, -1, c.d_model);
  const Index length = x.rows();
  const Index dn = c.qk_nope_dim;
  const Index dr = c.rope_dim;
  const Index qd = c.qk_head_dim();

  // Queries: [q_h^nope | q_h^R] per head.
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
  // Latents C (normalized) and the shared rope keys K_R.
  RowMatrix<T> latent = x * w.w_dkv;
  if (c.kv_norm) {
    for (Index i = 0; i < length; ++i) {
      rms_norm_inplace(latent.row(i).data(), c.kv_rank, w.kv_norm_gain.data(), c.norm_epsilon);
    }
  }
  RowMatrix<T> rope_keys = x * w.w_kr;
  const Rope rope = make_rope(c.rope, dr, c.yarn);
  for (Index i = 0; i < length; ++i) {
    const double position = static_cast<double>(c.rope.position_offset + i);
    for (Index h = 0; h < c.n_heads; ++h) rope.rotate(q.row(i).data() + h * qd + dn, position);
    rope.rotate(rope_keys.row(i).data(), position);
  }

  // Per head: reconstruct full K_h and V_h, then dense attention.
  RowMatrix<T> heads(length, c.n_heads * c.v_dim);
  for (Index h = 0; h < c.n_heads; ++h) {
    RowMatrix<T> k_h(length, qd);
    k_h.leftCols(dn) = latent * w.w_uk.middleCols(h * dn, dn);
    k_h.rightCols(dr) = rope_keys;
    const RowMatrix<T> v_h = latent * w.w_uv.middleCols(h * c.v_dim, c.v_dim);
    heads.middleCols(h * c.v_dim, c.v_dim) =
        attention<T>(q.middleCols(h * qd, qd), k_h, v_h, static_cast<T>(c.scale()),
                     mask.value_or(mask_of(c)), 0, shaping_of(c, w, h));
  }
  return heads * w.w_o;
}

/// The attention step of the newest cached token (index cache.tokens() - 1), the
/// expanded (re-projecting) way: the per-head outputs, 1 x H*d_v, before W_O. `query` is
/// that token's projected query [q_h^nope | q_h^R] per head, 1 x H*(d_nope + d_R), before
/// RoPE. Every step re-projects each head's keys K_h = [C W_UK_h | K_R] and values
/// V_h = C W_UV_h from the latent cache, rotates q_h^R at position
/// rope.position_offset + tokens() - 1 (with YaRN when enabled), then dense attention.
/// Throws config_error if the cache was made for another config, shape_error for a
/// wrongly shaped query or an empty cache.
template <class T, class S>
RowMatrix<T> decode_step(const MlaLayer<T>& layer, const MlaCache<T, S>& cache,
                         const ConstMatrixRef<std::type_identity_t<T>>& query) {
  constexpr const char* where = "reference::decode_step";
  const MlaConfig& c = layer.config();
  const MlaWeights<T>& w = layer.weights();
  if (!(cache.config() == c)) {
    throw config_error(std::string(where) + ": the cache was made for config " +
                       detail::describe(cache.config()) + ", the layer has " + detail::describe(c));
  }
  detail::check_shape(where, "query", query, 1, c.query_width());
  if (cache.tokens() < 1) {
    throw shape_error(std::string(where) +
                      ": the cache is empty (the newest cached token is the one that attends)");
  }
  const Index newest = cache.tokens() - 1;
  const Index dn = c.qk_nope_dim;
  const Index dr = c.rope_dim;
  const Index qd = c.qk_head_dim();
  RowMatrix<T> q = query;
  const double position = static_cast<double>(c.rope.position_offset + newest);
  for (Index h = 0; h < c.n_heads; ++h) layer.rope().rotate(q.data() + h * qd + dn, position);
  const RowMatrix<T> latent = cache.latent().template cast<T>();        // C,   L x d_c
  const RowMatrix<T> rope_keys = cache.rope_keys().template cast<T>();  // K_R, L x d_R
  RowMatrix<T> heads(1, c.n_heads * c.v_dim);
  for (Index h = 0; h < c.n_heads; ++h) {
    RowMatrix<T> k_h(latent.rows(), qd);
    k_h.leftCols(dn) = latent * w.w_uk.middleCols(h * dn, dn);
    k_h.rightCols(dr) = rope_keys;
    const RowMatrix<T> v_h = latent * w.w_uv.middleCols(h * c.v_dim, c.v_dim);
    heads.middleCols(h * c.v_dim, c.v_dim) =
        attention<T>(q.middleCols(h * qd, qd), k_h, v_h, layer.softmax_scale(), mask_of(c), newest,
                     shaping_of(c, w, h));
  }
  return heads;
}

}  // namespace kvattn::reference
