// Where the key/value rows of a prefill come from: the cache's rows before `split`,
// the new (not yet appended) rows after it. Prefill computes everything from these
// two parts and appends the new rows last, so a call that throws leaves the cache as
// it was (the strong guarantee) without copying the cache.
#pragma once

#include <type_traits>

#include "kvattn/core/types.hpp"

namespace kvattn::detail {

/// Rows 0 ... split-1 at `cached` (stride cached_stride), rows split ... at `fresh`
/// (stride fresh_stride), all of storage type S.
template <class S>
struct RowSource {
  const S* cached = nullptr;
  Index cached_stride = 0;
  const S* fresh = nullptr;
  Index fresh_stride = 0;
  Index split = 0;

  const S* row(Index t) const {
    return t < split ? cached + t * cached_stride : fresh + (t - split) * fresh_stride;
  }
  Index stride(Index t) const { return t < split ? cached_stride : fresh_stride; }
};

template <class T>
using ConstRowsMap = Eigen::Map<const RowMatrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <class T>
using RowsMap = Eigen::Map<RowMatrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

/// Rows t0 ... t0+n-1, columns col ... col+width-1 of `source` (the rows lie in one part)
/// as a T matrix: a view of the rows themselves when S is T, else the rows widened
/// into `buffer` (n x width scalars).
template <class T, class S>
ConstRowsMap<T> rows_as(const RowSource<S>& source, Index t0, Index n, Index col, Index width,
                        T* buffer) {
  const S* rows = source.row(t0) + col;
  const Index stride = source.stride(t0);
  if constexpr (std::is_same_v<S, T>) {
    return ConstRowsMap<T>(rows, n, width, Eigen::OuterStride<>(stride));
  } else {
    for (Index t = 0; t < n; ++t) {
      for (Index j = 0; j < width; ++j)
        buffer[t * width + j] = static_cast<T>(rows[t * stride + j]);
    }
    return ConstRowsMap<T>(buffer, n, width, Eigen::OuterStride<>(width));
  }
}

}  // namespace kvattn::detail
