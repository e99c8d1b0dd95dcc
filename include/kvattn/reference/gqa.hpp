// Expanded reference of the GQA family: every query head gets its own K and V
// (groups repeated explicitly), then dense attention. Used by tests and benchmarks;
// the fast paths never include this header.
#pragma once

#include <type_traits>

#include "kvattn/attention/gqa.hpp"
#include "kvattn/core/mask.hpp"
#include "kvattn/core/rope.hpp"
#include "kvattn/reference/dense_attention.hpp"

namespace kvattn::reference {

/// The layer's output for a whole sequence x (L x d), token i at position
/// rope.position_offset + i, under `mask` (causal by default). Returns L x d.
template <class T>
RowMatrix<T> forward(const GqaLayer<T>& layer, const ConstMatrixRef<std::type_identity_t<T>>& x,
                     const Mask& mask = Mask::causal()) {
  const GqaConfig& c = layer.config();
  const GqaWeights<T>& w = layer.weights();
  detail::check_shape("reference::forward", "x", x, -1, c.d_model);
  RowMatrix<T> q = x * w.w_q;
  RowMatrix<T> k = x * w.w_k;
  RowMatrix<T> v = x * w.w_v;
  if (c.qkv_bias) {
    q.rowwise() += w.b_q;
    k.rowwise() += w.b_k;
    v.rowwise() += w.b_v;
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
    heads.middleCols(h * c.head_dim, c.head_dim) = attention<T>(
        q.middleCols(h * c.head_dim, c.head_dim), k_h, v_h, static_cast<T>(c.scale()), mask);
  }
  return heads * w.w_o;
}

}  // namespace kvattn::reference
