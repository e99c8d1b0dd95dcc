// Expanded reference of the GQA family: every query head gets its own K and V
// (groups repeated explicitly), then dense attention. Used by tests and benchmarks;
// the fast paths never include this header.
#pragma once

#include <optional>
#include <string>
#include <type_traits>

#include "kvattn/attention/gqa.hpp"
#include "kvattn/cache/gqa_cache.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/mask.hpp"
#include "kvattn/core/rope.hpp"
#include "kvattn/reference/dense_attention.hpp"

namespace kvattn::reference {

/// The layer's output for a whole sequence x (L x d), token i at position
/// rope.position_offset + i, under `mask` (by default the layer's own: causal, or its sliding
/// window with its sink tokens), with the layer's soft-cap and sink logits. Returns L x d.
template <class T>
RowMatrix<T> forward(const GqaLayer<T>& layer, const ConstMatrixRef<std::type_identity_t<T>>& x,
                     const std::optional<Mask>& mask = std::nullopt) {
  const GqaConfig& c = layer.config();
  const GqaWeights<T>& w = layer.weights();
  detail::check_shape("reference::forward", "x", x, -1, c.d_model);
  RowMatrix<T> q = x * w.w_q;
  RowMatrix<T> k = x * w.w_k;
  RowMatrix<T> v = x * w.w_v;
  if (c.qkv_bias) {
    q.rowwise() += w.bias_q;
    k.rowwise() += w.bias_k;
    v.rowwise() += w.bias_v;
  }
  const Rope rope(c.rope, c.head_dim);
  for (Index i = 0; i < x.rows(); ++i) {
    const double position = static_cast<double>(c.rope.position_offset + i);
    for (Index h = 0; h < c.n_heads; ++h) rope.rotate(q.row(i).data() + h * c.head_dim, position);
    for (Index g = 0; g < c.n_kv_heads; ++g) {
      rope.rotate(k.row(i).data() + g * c.head_dim, position);
    }
  }
  RowMatrix<T> heads(x.rows(), c.n_heads * c.head_dim);
  for (Index h = 0; h < c.n_heads; ++h) {
    const Index g = h / (c.n_heads / c.n_kv_heads);  // repeat-interleave
    const RowMatrix<T> k_h = k.middleCols(g * c.head_dim, c.head_dim);
    const RowMatrix<T> v_h = v.middleCols(g * c.head_dim, c.head_dim);
    heads.middleCols(h * c.head_dim, c.head_dim) =
        attention<T>(q.middleCols(h * c.head_dim, c.head_dim), k_h, v_h, static_cast<T>(c.scale()),
                     mask.value_or(mask_of(c)), 0, shaping_of(c, w, h));
  }
  return heads * w.w_o;
}

/// The attention step of the newest cached token (index cache.tokens() - 1), the
/// expanded way: the per-head outputs, 1 x H*d_h, before W_O. `query` is that token's
/// projected query x W_Q (+ bias_q), 1 x H*d_h, before RoPE. Every query head gets its own
/// K and V, materialized from its KV group (cast to T); the query is rotated at
/// position rope.position_offset + tokens() - 1; then dense attention per head.
/// Throws config_error if the cache was made for another config, shape_error for a
/// wrongly shaped query or an empty cache.
template <class T, class S>
RowMatrix<T> decode_step(const GqaLayer<T>& layer, const GqaCache<T, S>& cache,
                         const ConstMatrixRef<std::type_identity_t<T>>& query) {
  constexpr const char* where = "reference::decode_step";
  const GqaConfig& c = layer.config();
  if (!(cache.config() == c)) {
    throw config_error(std::string(where) + ": the cache was made for config " +
                       detail::describe(cache.config()) + ", the layer has " + detail::describe(c));
  }
  detail::check_shape(where, "query", query, 1, c.n_heads * c.head_dim);
  if (cache.tokens() < 1) {
    throw shape_error(std::string(where) +
                      ": the cache is empty (the newest cached token is the one that attends)");
  }
  const Index newest = cache.tokens() - 1;
  const Index dh = c.head_dim;
  RowMatrix<T> q = query;
  const double position = static_cast<double>(c.rope.position_offset + newest);
  for (Index h = 0; h < c.n_heads; ++h) layer.rope().rotate(q.data() + h * dh, position);
  RowMatrix<T> heads(1, c.n_heads * dh);
  for (Index h = 0; h < c.n_heads; ++h) {
    const Index g = h / c.group_size();  // repeat-interleave
    const RowMatrix<T> k_h = cache.keys(g).template cast<T>();
    const RowMatrix<T> v_h = cache.values(g).template cast<T>();
    heads.middleCols(h * dh, dh) =
        attention<T>(q.middleCols(h * dh, dh), k_h, v_h, layer.softmax_scale(), mask_of(c), newest,
                     shaping_of(c, layer.weights(), h));
  }
  return heads;
}

}  // namespace kvattn::reference
