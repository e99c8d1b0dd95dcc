// Partial softmax states and their exact merge: how attention over a union of key sets
// is put together from attention over each part (flash-decoding's split merge, cascade
// attention over a shared prefix, context parallelism across processes).
//
// For query row i over a set of keys with logits s_it and values v_t, the state is
//   max(i)      m_i = max_t s_it                    (-inf: no key, or all masked)
//   sum(i)      l_i = sum_t exp(s_it - m_i)
//   acc.row(i)  a_i = sum_t exp(s_it - m_i) v_t     (not normalized)
// and softmax(s_i) V = a_i / l_i. Two states of disjoint key sets merge exactly:
//   m = max(m', m''),  l = e' l' + e'' l'',  a = e' a' + e'' a'',  e = exp(m_part - m).
// The merge is associative and commutative up to rounding, so parts may be merged in
// any order (a tree across threads or processes).
//
// A NaN or +inf logit poisons its row: its sum is NaN (as softmax_inplace gives), and
// the merge keeps it NaN. A row whose max is -inf contributes nothing; a row that ends
// with no key at all normalizes to zeros (as softmax of an all -inf row).
#pragma once

#include <cmath>
#include <limits>
#include <string>
#include <type_traits>

#include "kvattn/core/errors.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn {

/// Partial softmax states of `rows()` query rows, each with a `width()`-wide
/// accumulator (see the header comment for what each holds).
template <class T>
struct SoftmaxStates {
  RowVector<T> max;  // 1 x rows
  RowVector<T> sum;  // 1 x rows
  RowMatrix<T> acc;  // rows x width, not normalized

  SoftmaxStates() = default;
  /// `rows` empty states (max -inf, sum 0, acc 0).
  SoftmaxStates(Index rows, Index width) { reset(rows, width); }

  Index rows() const { return max.cols(); }
  Index width() const { return acc.cols(); }

  /// rows x width empty states; allocates only when the shape changes.
  void reset(Index rows, Index width) {
    if (rows < 0 || width < 0) {
      throw shape_error("SoftmaxStates::reset: rows (" + std::to_string(rows) + ") and width (" +
                        std::to_string(width) + ") must be >= 0");
    }
    detail::reshape(max, rows);
    detail::reshape(sum, rows);
    detail::reshape(acc, rows, width);
    max.setConstant(-std::numeric_limits<T>::infinity());
    sum.setZero();
    acc.setZero();
  }
};

namespace detail {

/// Merges row state (m, l, a[width]) into (into_m, into_l, into_a): the pointer form of
/// merge_states, used by the decode drivers. Never allocates.
template <class T>
inline void merge_state_row(T m, T l, const T* a, T& into_m, T& into_l, T* into_a, Index width) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  if (m == neg_inf) return;  // nothing to add
  using Map = Eigen::Map<RowVector<T>>;
  using ConstMap = Eigen::Map<const RowVector<T>>;
  if (into_m == neg_inf) {
    into_m = m;
    into_l = l;
    Map(into_a, width) = ConstMap(a, width);
    return;
  }
  const T total = std::max(into_m, m);
  const T keep = std::exp(into_m - total);
  const T add = std::exp(m - total);
  into_l = into_l * keep + l * add;
  Map(into_a, width) = Map(into_a, width) * keep + ConstMap(a, width) * add;
  into_m = total;
}

/// shape_error unless the states' max, sum and acc have one entry (row) per query row:
/// their members are public, so a caller may have resized one of them.
template <class T>
void check_states(const char* where, const char* name, const SoftmaxStates<T>& states) {
  if (states.sum.cols() != states.rows() || states.acc.rows() != states.rows()) {
    throw shape_error(std::string(where) + ": " + name + " has max of " +
                      std::to_string(states.rows()) + ", sum of " +
                      std::to_string(states.sum.cols()) + " and acc of " +
                      std::to_string(states.acc.rows()) + " rows (max, sum and acc must agree)");
  }
}

/// out[width] = a / l, or zeros when the row saw no key (m == -inf).
template <class T>
inline void finish_state_row(T m, T l, const T* a, T* out, Index width) {
  using Map = Eigen::Map<RowVector<T>>;
  if (m == -std::numeric_limits<T>::infinity()) {
    Map(out, width).setZero();
    return;
  }
  Map(out, width) = Eigen::Map<const RowVector<T>>(a, width) / l;
}

}  // namespace detail

/// into = the exact merge of `into` and `part`, two states of the same query rows over
/// disjoint key sets (shape_error unless both have the same rows and width). Allocates
/// nothing.
template <class T>
void merge_states(const SoftmaxStates<T>& part, SoftmaxStates<T>& into) {
  detail::check_states("merge_states", "part", part);
  detail::check_states("merge_states", "into", into);
  if (part.rows() != into.rows() || part.width() != into.width()) {
    throw shape_error("merge_states: part has " + std::to_string(part.rows()) + " rows x " +
                      std::to_string(part.width()) + ", into has " + std::to_string(into.rows()) +
                      " rows x " + std::to_string(into.width()));
  }
  for (Index i = 0; i < part.rows(); ++i) {
    detail::merge_state_row(part.max(i), part.sum(i), part.acc.row(i).data(), into.max(i),
                            into.sum(i), into.acc.row(i).data(), into.width());
  }
}

/// The attention output of each row, acc / sum (zeros for a row that saw no key), into
/// `out` (rows x width); shape_error for another shape or inconsistent states.
template <class T>
void finish_states(const SoftmaxStates<T>& states, MatrixRef<std::type_identity_t<T>> out) {
  detail::check_states("finish_states", "states", states);
  if (out.rows() != states.rows() || out.cols() != states.width()) {
    throw shape_error("finish_states: out is (" + std::to_string(out.rows()) + " x " +
                      std::to_string(out.cols()) + "), expected (" + std::to_string(states.rows()) +
                      " x " + std::to_string(states.width()) + ")");
  }
  for (Index i = 0; i < states.rows(); ++i) {
    detail::finish_state_row(states.max(i), states.sum(i), states.acc.row(i).data(),
                             out.row(i).data(), states.width());
  }
}

}  // namespace kvattn
