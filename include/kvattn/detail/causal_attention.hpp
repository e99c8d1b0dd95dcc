// Causal attention with an online softmax over key tiles (FlashAttention), the
// prefill kernel shared by the mechanisms' fast paths.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvattn/core/types.hpp"

namespace kvattn::detail {

/// Flash-attention style causal attention with an online softmax, O(L * d + tile^2)
/// memory, never an L x L score matrix:
///   q    Lq x k_dim   queries at cache indices past ... past + Lq - 1
///   k    Lk x k_dim   keys at cache indices 0 ... Lk - 1 (Lk = past + Lq)
///   v    Lk x v_dim
///   out  Lq x v_dim   query i sees keys 0 ... past + i
template <class T>
void causal_attention(const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                      const ConstMatrixRef<T>& v, Index past, T scale,
                      Eigen::Ref<RowMatrix<T>> out) {
  constexpr Index tile = 64;
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  const Index length = q.rows();
  RowMatrix<T> scores(tile, tile);
  RowMatrix<T> acc(tile, v.cols());
  RowVector<T> running_max(tile), normalizer(tile), rescale(tile);
  for (Index q0 = 0; q0 < length; q0 += tile) {
    const Index q_rows = std::min(tile, length - q0);
    const Index key_end = past + q0 + q_rows;  // keys visible to the tile's last row
    acc.topRows(q_rows).setZero();
    running_max.head(q_rows).setConstant(neg_inf);
    normalizer.head(q_rows).setZero();
    for (Index k0 = 0; k0 < key_end; k0 += tile) {
      const Index k_rows = std::min(tile, key_end - k0);
      auto s = scores.topLeftCorner(q_rows, k_rows);
      s.noalias() = q.middleRows(q0, q_rows) * k.middleRows(k0, k_rows).transpose();
      for (Index r = 0; r < q_rows; ++r) {
        const Index visible = past + q0 + r - k0 + 1;  // keys k0 ... past+q0+r
        T row_max = neg_inf;
        for (Index c = 0; c < k_rows; ++c) {
          if (c < visible) {
            s(r, c) *= scale;
            row_max = std::max(row_max, s(r, c));
          } else {
            s(r, c) = neg_inf;
          }
        }
        const T new_max = std::max(running_max(r), row_max);
        if (new_max == neg_inf) {  // no visible key in this tile yet
          rescale(r) = T(1);
          s.row(r).setZero();
          continue;
        }
        rescale(r) = std::exp(running_max(r) - new_max);  // exp(-inf) = 0
        T row_sum = 0;
        for (Index c = 0; c < k_rows; ++c) {
          s(r, c) = std::exp(s(r, c) - new_max);
          row_sum += s(r, c);
        }
        normalizer(r) = normalizer(r) * rescale(r) + row_sum;
        running_max(r) = new_max;
      }
      acc.topRows(q_rows) = rescale.head(q_rows).asDiagonal() * acc.topRows(q_rows);
      if (k0 + k_rows <= past + q0 + 1) {  // every key of the tile is visible to every row
        acc.topRows(q_rows).noalias() += s * v.middleRows(k0, k_rows);
      } else {
        // On the diagonal, row r reads only its visible values: a masked weight is 0,
        // but 0 * (a NaN in a later token's value) would still leak into row r.
        for (Index r = 0; r < q_rows; ++r) {
          const Index visible = std::min(k_rows, past + q0 + r - k0 + 1);
          if (visible <= 0) continue;
          acc.row(r).noalias() += s.row(r).head(visible) * v.middleRows(k0, visible);
        }
      }
    }
    // Every query sees at least itself, so the normalizer is >= 1.
    out.middleRows(q0, q_rows) =
        normalizer.head(q_rows).cwiseInverse().asDiagonal() * acc.topRows(q_rows);
  }
}

}  // namespace kvattn::detail
