// Fixed pooling rules: mean pooling (BERT-style encoders) and last-token (<EOS>)
// pooling (decoder-only embedding models), seed 002, Chapter 5.
#pragma once

#include "kvattn/core/errors.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/pooling/token_mask.hpp"

namespace kvattn {

/// Weight of each token in the mean over kept tokens: 1/|M| for kept tokens, 0
/// otherwise. Returns 1 x L. The pooled vector is weights * x.
///   x     L x d, L >= 1
///   mask  L flags, or empty for every token
template <class T>
RowVector<T> mean_pool_weights(const ConstMatrixRef<T>& x, const TokenMask& mask = {}) {
  const Index count = detail::check_pool_input("mean_pool_weights", x, -1, mask);
  RowVector<T> weights = RowVector<T>::Zero(x.rows());
  for (Index i = 0; i < x.rows(); ++i) {
    if (detail::kept(mask, i)) weights(i) = T(1) / static_cast<T>(count);
  }
  return weights;
}

/// Mean of the kept rows of x (L x d). Returns 1 x d.
template <class T>
RowVector<T> mean_pool(const ConstMatrixRef<T>& x, const TokenMask& mask = {}) {
  const Index count = detail::check_pool_input("mean_pool", x, -1, mask);
  RowVector<T> sum = RowVector<T>::Zero(x.cols());
  for (Index i = 0; i < x.rows(); ++i) {
    if (detail::kept(mask, i)) sum += x.row(i);
  }
  return sum / static_cast<T>(count);
}

/// Index of the last kept token (the <EOS> position when the mask keeps it).
template <class T>
Index last_token_index(const ConstMatrixRef<T>& x, const TokenMask& mask = {}) {
  detail::check_pool_input("last_token_index", x, -1, mask);
  Index last = x.rows() - 1;
  while (!detail::kept(mask, last)) --last;  // check_pool_input guarantees one is kept
  return last;
}

/// Weight of each token in last-token pooling: 1 at the last kept token, 0 elsewhere.
template <class T>
RowVector<T> last_token_weights(const ConstMatrixRef<T>& x, const TokenMask& mask = {}) {
  RowVector<T> weights = RowVector<T>::Zero(x.rows());
  weights(last_token_index<T>(x, mask)) = T(1);
  return weights;
}

/// The row of the last kept token of x (L x d). Returns 1 x d.
template <class T>
RowVector<T> last_token_pool(const ConstMatrixRef<T>& x, const TokenMask& mask = {}) {
  return x.row(last_token_index<T>(x, mask));
}

/// Each token's share of a pooled sum whose token terms are the rows of
/// `contributions` (L x d): ||row_i|| / sum_j ||row_j||. Returns 1 x L (all zero when
/// every term is zero). For a linear rule (mean, last token) with positive weights use
/// the weights themselves; this is for the latent layer's nonlinear terms.
template <class T>
RowVector<T> contribution_shares(const ConstMatrixRef<T>& contributions) {
  RowVector<T> shares = contributions.rowwise().norm().transpose();
  const T total = shares.sum();
  if (total > T(0)) shares /= total;
  return shares;
}

}  // namespace kvattn
