// Where the key/value rows of a prefill come from: the cache's rows before `split`,
// the new (not yet appended) rows after it. Prefill computes everything from these
// two parts and appends the new rows last, so a call that throws leaves the cache as
// it was (the strong guarantee) without copying the cache.
#pragma once

#include <algorithm>
#include <type_traits>

#include "kvattn/cache/paged_rows.hpp"
#include "kvattn/core/quantized.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn::detail {

/// Rows 0 ... split-1 at `cached` (stride cached_stride), rows split ... at `fresh`
/// (stride fresh_stride), all of storage type S (strides in elements of its
/// storage_element_t). With `paged` set, the cached rows are block `block` of a paged
/// cache's pages instead (stride cached_stride within a page, contiguous for `segment`
/// tokens): a tile of cached rows must then stay in one page. For a quantized S, each row
/// holds `quantized_width` codes and their block scales (core/quantized.hpp).
template <class S>
struct RowSource {
  using Element = storage_element_t<S>;
  const Element* cached = nullptr;
  Index cached_stride = 0;
  const Element* fresh = nullptr;
  Index fresh_stride = 0;
  Index split = 0;
  const PagedRows* paged = nullptr;
  Index block = 0;
  Index quantized_width = 0;

  const Element* row(Index t) const {
    if (t >= split) return fresh + (t - split) * fresh_stride;
    return paged != nullptr ? paged->template row<Element>(block, t) : cached + t * cached_stride;
  }
  Index stride(Index t) const { return t < split ? cached_stride : fresh_stride; }
  /// Tokens per page of the cached rows (0: contiguous).
  Index segment() const { return paged != nullptr ? paged->page_tokens() : 0; }
};

/// Tokens per page of a paged cache (0 for a contiguous one): decode and prefill tiles
/// never cross a multiple of it.
template <class Cache>
Index cache_segment(const Cache& cache) {
  if constexpr (requires { cache.page_tokens(); }) {
    return cache.page_tokens();
  } else {
    return 0;
  }
}

/// Whether the cache still holds token t's rows (a windowed paged cache returns the pages
/// its window has passed).
template <class Cache>
bool cache_holds(const Cache& cache, Index t) {
  if constexpr (requires { cache.holds(t); }) {
    return cache.holds(t);
  } else {
    return t >= 0 && t < cache.sequence_length();
  }
}

/// How many of the cached rows t, t+1, ... lie contiguously in memory (up to the
/// sequence's end; 0 when t is not held).
template <class Cache>
Index contiguous_rows(const Cache& cache, Index t) {
  if (!cache_holds(cache, t)) return 0;
  const Index segment = cache_segment(cache);
  const Index end = segment > 0 ? std::min(cache.sequence_length(), (t / segment + 1) * segment)
                                : cache.sequence_length();
  return std::max<Index>(0, end - t);
}

template <class T>
using ConstRowsMap = Eigen::Map<const RowMatrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <class T>
using RowsMap = Eigen::Map<RowMatrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

/// Rows t0 ... t0+n-1, columns col ... col+width-1 of `source` (the rows lie in one part)
/// as a T matrix: a view of the rows themselves when S is T, else the rows widened (or
/// dequantized) into `buffer` (n x width scalars).
template <class T, class S>
ConstRowsMap<T> rows_as(const RowSource<S>& source, Index t0, Index n, Index col, Index width,
                        T* buffer) {
  const Index stride = source.stride(t0);
  if constexpr (std::is_same_v<S, T>) {
    return ConstRowsMap<T>(source.row(t0) + col, n, width, Eigen::OuterStride<>(stride));
  } else if constexpr (is_quantized_storage<S>) {
    using Traits = StorageTraits<S>;
    const auto* rows = source.row(t0);
    for (Index t = 0; t < n; ++t) {
      Traits::dequantize(rows + t * stride, source.quantized_width, col, width, buffer + t * width);
    }
    return ConstRowsMap<T>(buffer, n, width, Eigen::OuterStride<>(width));
  } else {
    const S* rows = source.row(t0) + col;
    for (Index t = 0; t < n; ++t) {
      for (Index j = 0; j < width; ++j)
        buffer[t * width + j] = static_cast<T>(rows[t * stride + j]);
    }
    return ConstRowsMap<T>(buffer, n, width, Eigen::OuterStride<>(width));
  }
}

}  // namespace kvattn::detail
