// Scalar and matrix types shared by every mechanism.
//
// Conventions (see docs/api.md):
//   * A sequence is a row-major matrix, one row per token: L x d.
//   * Weights are stored `in x out`, so a projection is Y = X * W
//     (PyTorch's nn.Linear stores `out x in`; converting is a transpose).
#pragma once

#include <type_traits>

#include <Eigen/Core>

#include "kvattn/core/index.hpp"

namespace kvattn {

static_assert(std::is_same_v<Index, Eigen::Index>,
              "kvattn::Index (core/index.hpp) must be Eigen::Index");

/// Row-major dynamic matrix: rows are tokens, columns are features.
template <class T>
using RowMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// A single token: a 1 x d row.
template <class T>
using RowVector = Eigen::Matrix<T, 1, Eigen::Dynamic>;

/// Read-only view of a row-major matrix; accepts blocks with an outer stride
/// (e.g. a column slice of a wider matrix) without copying.
template <class T>
using ConstMatrixRef = Eigen::Ref<const RowMatrix<T>>;

/// Writable view of a row-major matrix (e.g. a caller-provided output row).
template <class T>
using MatrixRef = Eigen::Ref<RowMatrix<T>>;

/// Read-only view of one token row.
template <class T>
using ConstRowRef = Eigen::Ref<const RowVector<T>>;

/// Writable view of one token row (the caller-provided decode output).
template <class T>
using RowRef = Eigen::Ref<RowVector<T>>;

namespace detail {

/// Gives m the shape rows x cols (contents unspecified) with the strong guarantee:
/// Eigen's resize frees the old buffer before allocating the new one, so a failed
/// allocation there would leave m dangling; here the new buffer is made first.
template <class Matrix>
void reshape(Matrix& m, Index rows, Index cols) {
  if (m.rows() == rows && m.cols() == cols) return;
  Matrix next(rows, cols);
  m.swap(next);
}

/// reshape for a row vector: 1 x n.
template <class Vector>
void reshape(Vector& v, Index n) {
  reshape(v, 1, n);
}

}  // namespace detail
}  // namespace kvattn
