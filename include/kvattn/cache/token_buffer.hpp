// A growable per-token buffer laid out block-major, the building block of caches
// (internal: kvattn::detail; the caches expose read-only views of it).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "kvattn/cache/aligned_buffer.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/quantized.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn::detail {

/// Stores, for each cached token, `blocks` rows of `width` values of storage type S (for
/// example one block per KV head). Block b's tokens are contiguous: row (b, t) starts at
/// data[(b * capacity + t) * row_stride], so a decode step streams each block as one dense
/// `tokens x width` matrix. A row is `width` elements of S (row_stride = width), or, for a
/// block-quantized S, `width` codes and their block scales (core/quantized.hpp).
///
/// Growth is two-phase so a cache made of several buffers can grow all of them
/// and then commit with non-throwing swaps: `grown(n)` allocates and copies (may
/// throw, leaves *this untouched), `swap` commits.
template <class S>
class TokenBuffer {
 public:
  using Traits = StorageTraits<S>;
  using Element = typename Traits::element;
  using Block = Eigen::Map<RowMatrix<Element>, Eigen::Unaligned, Eigen::OuterStride<>>;
  using ConstBlock = Eigen::Map<const RowMatrix<Element>, Eigen::Unaligned, Eigen::OuterStride<>>;

  TokenBuffer() = default;
  TokenBuffer(Index blocks, Index width)
      : blocks_(blocks), width_(width), stride_(Traits::row_elements(width)) {}

  Index blocks() const { return blocks_; }
  Index width() const { return width_; }
  /// Elements of Element from one row to the next (width, plus the scales when quantized).
  Index row_stride() const { return stride_; }
  Index tokens() const { return tokens_; }
  Index capacity() const { return capacity_; }
  /// Values stored per token: blocks * width (block scales not counted).
  Index elements_per_token() const { return blocks_ * width_; }
  /// Bytes of the cached tokens' entries (block scales included).
  std::size_t bytes() const {
    return static_cast<std::size_t>(tokens_) * static_cast<std::size_t>(blocks_ * stride_) *
           sizeof(Element);
  }
  /// Bytes of the allocation.
  std::size_t capacity_bytes() const { return data_.size() * sizeof(Element); }

  /// A copy with room for `capacity` tokens (>= tokens()). May throw std::bad_alloc,
  /// or kvattn::length_error when capacity x elements per token cannot be represented;
  /// *this is untouched either way.
  TokenBuffer grown(Index capacity) const {
    const Index per_token = std::max(Index{1}, blocks_ * stride_);  // validated configs fit
    constexpr auto max_elements =
        static_cast<Index>(PTRDIFF_MAX / static_cast<std::ptrdiff_t>(sizeof(Element)));
    if (capacity < 0 || capacity > max_elements / per_token) {
      throw kvattn::length_error("TokenBuffer: a capacity of " + std::to_string(capacity) +
                                 " tokens of " + std::to_string(per_token) +
                                 " elements does not fit in memory");
    }
    TokenBuffer next(blocks_, width_);
    next.data_ = AlignedBuffer<Element>(static_cast<std::size_t>(capacity * blocks_ * stride_));
    next.capacity_ = capacity;
    next.tokens_ = tokens_;
    for (Index b = 0; b < blocks_; ++b) {
      std::copy_n(data_.data() + b * capacity_ * stride_, tokens_ * stride_,
                  next.data_.data() + b * capacity * stride_);
    }
    return next;
  }

  void swap(TokenBuffer& other) noexcept {
    std::swap(blocks_, other.blocks_);
    std::swap(width_, other.width_);
    std::swap(stride_, other.stride_);
    std::swap(tokens_, other.tokens_);
    std::swap(capacity_, other.capacity_);
    data_.swap(other.data_);
  }

  /// Pointer to token t of block b (t may be tokens() .. capacity()-1 for writes).
  Element* row(Index block, Index token) {
    return data_.data() + (block * capacity_ + token) * stride_;
  }
  const Element* row(Index block, Index token) const {
    return data_.data() + (block * capacity_ + token) * stride_;
  }

  /// Block b's cached tokens as a `tokens() x width` matrix (S stored as itself).
  ConstBlock block(Index b) const requires(!Traits::quantized) {
    return ConstBlock(row(b, 0), tokens_, width_, Eigen::OuterStride<>(stride_));
  }

  /// Block b's cached tokens dequantized, a `tokens() x width` matrix of T.
  template <class T>
  RowMatrix<T> dequantized(Index b) const {
    RowMatrix<T> out(tokens_, width_);
    for (Index t = 0; t < tokens_; ++t) {
      const Element* r = row(b, t);
      if constexpr (Traits::quantized) {
        Traits::dequantize(r, width_, 0, width_, out.data() + t * width_);
      } else {
        for (Index j = 0; j < width_; ++j) out(t, j) = static_cast<T>(r[j]);
      }
    }
    return out;
  }

  /// Writes `values` (n x blocks*width, block b in columns [b*width, (b+1)*width))
  /// as tokens tokens() ... tokens()+n-1. Requires capacity; never throws.
  /// A quantized S takes finite values only (detail::require_finite, before this).
  template <class Derived>
  void write_rows(const Eigen::MatrixBase<Derived>& values) noexcept {
    for (Index t = 0; t < values.rows(); ++t) {
      for (Index b = 0; b < blocks_; ++b) {
        Element* dst = row(b, tokens_ + t);
        if constexpr (Traits::quantized) {
          Traits::encode([&](Index j) { return values(t, b * width_ + j); }, width_, dst);
        } else {
          for (Index j = 0; j < width_; ++j) dst[j] = static_cast<S>(values(t, b * width_ + j));
        }
      }
    }
  }

  /// Counts `n` written rows as cached.
  void commit(Index n) noexcept { tokens_ += n; }
  void set_tokens(Index n) noexcept { tokens_ = n; }

 private:
  Index blocks_ = 0;
  Index width_ = 0;
  Index stride_ = 0;
  Index tokens_ = 0;
  Index capacity_ = 0;
  AlignedBuffer<Element> data_;  // 64-byte aligned; huge-page advised when large
};

/// Capacity after geometric growth to hold at least `needed` tokens.
inline Index grown_capacity(Index current, Index needed) {
  const Index doubled = current > PTRDIFF_MAX / 2 ? Index{PTRDIFF_MAX} : current * 2;
  return std::max({needed, doubled, Index{16}});
}

/// The shared range check of truncate(n).
inline void check_truncate(const char* where, Index n, Index tokens) {
  if (n < 0 || n > tokens) {
    throw shape_error(std::string(where) + ": truncate(" + std::to_string(n) +
                      ") needs 0 <= n <= tokens() (" + std::to_string(tokens) + ")");
  }
}

}  // namespace kvattn::detail
