// Numerically stable softmax over one row of logits.
#pragma once

#include <cmath>
#include <limits>

#include "kvattn/core/types.hpp"

namespace kvattn {

/// Replaces `logits[0..n)` by softmax(logits) in place.
///
/// Stable for any finite logits (the row maximum is subtracted first, so
/// +-1e4 is fine). Masked entries are -infinity and get probability 0.
/// Edge cases, documented in docs/api.md:
///   * every entry -infinity (a query that sees no key): the row becomes all
///     zeros, so the attention output is the zero vector, never NaN;
///   * any NaN entry, or a +infinity entry: the row becomes all NaN, so bad
///     input is visible in the output instead of being silently dropped.
template <class T>
void softmax_inplace(T* logits, Index n) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  T max_logit = neg_inf;
  for (Index i = 0; i < n; ++i) {
    const T value = logits[i];
    if (std::isnan(value) || value == std::numeric_limits<T>::infinity()) {
      for (Index j = 0; j < n; ++j) logits[j] = std::numeric_limits<T>::quiet_NaN();
      return;
    }
    if (value > max_logit) max_logit = value;
  }
  if (max_logit == neg_inf) {
    for (Index i = 0; i < n; ++i) logits[i] = T(0);
    return;
  }
  T sum = 0;
  for (Index i = 0; i < n; ++i) {
    logits[i] = std::exp(logits[i] - max_logit);
    sum += logits[i];
  }
  const T inv_sum = T(1) / sum;  // sum >= 1: the maximum contributes exp(0)
  for (Index i = 0; i < n; ++i) logits[i] *= inv_sum;
}

/// Softmax of each row of `logits` in place (rows are independent queries).
template <class T>
void softmax_rows_inplace(RowMatrix<T>& logits) {
  for (Index r = 0; r < logits.rows(); ++r) softmax_inplace(logits.row(r).data(), logits.cols());
}

/// Softmax of one row, returned by value.
template <class T>
RowVector<T> softmax(const ConstRowRef<T>& logits) {
  RowVector<T> probabilities = logits;
  softmax_inplace(probabilities.data(), probabilities.cols());
  return probabilities;
}

}  // namespace kvattn
