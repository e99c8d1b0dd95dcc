// The dense attention kernel every expanded reference is built on: the spec in code.
#pragma once

#include <limits>

#include "kvattn/core/errors.hpp"
#include "kvattn/core/mask.hpp"
#include "kvattn/core/softmax.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn::reference {

/// softmax(scale * q * k^T, masked) * v for one head, materializing the score matrix.
///   q  Lq x dk   (query i at position query_offset + i)
///   k  Lk x dk   (key j at position j)
///   v  Lk x dv
///   result Lq x dv
template <class T>
RowMatrix<T> attention(const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                       const ConstMatrixRef<T>& v, T scale, const Mask& mask,
                       Index query_offset = 0) {
  mask.validate();
  detail::check_shape("reference::attention", "k", k, -1, q.cols());
  detail::check_shape("reference::attention", "v", v, k.rows(), -1);
  RowMatrix<T> scores = scale * (q * k.transpose());
  for (Index i = 0; i < scores.rows(); ++i) {
    for (Index j = 0; j < scores.cols(); ++j) {
      if (!mask.visible(query_offset + i, j)) scores(i, j) = -std::numeric_limits<T>::infinity();
    }
  }
  softmax_rows_inplace(scores);
  // Sum over visible keys only: a masked weight is 0, and 0 * (an invisible token's
  // NaN or inf) must not reach the output.
  RowMatrix<T> out = RowMatrix<T>::Zero(q.rows(), v.cols());
  for (Index i = 0; i < scores.rows(); ++i) {
    for (Index j = 0; j < scores.cols(); ++j) {
      if (mask.visible(query_offset + i, j)) out.row(i) += scores(i, j) * v.row(j);
    }
  }
  return out;
}

}  // namespace kvattn::reference
