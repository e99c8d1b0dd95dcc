// out = x W for a few rows of x (a decode_batch's B new tokens, B <= kBatchProductRows),
// W row-major d x n: the projections of a batched decode step.
//
// Why not Eigen's product: for more than one row it is a GEMM, which first packs all of
// W into panels (a copy of the weights, read 48 columns at a time: 192-byte runs one W
// row apart) and then multiplies the copy. With a handful of rows the copy costs more
// than the arithmetic: perf of decode_shared/gqa/B:16/T:1 put 33% of the step's samples
// in Eigen's packing and 24% in its multiply (AVX-512). Here W is read once, in place:
// a register block of M rows of x times C packets of W's columns runs down kc rows of W
// (one W packet feeds M FMAs, one broadcast of x feeds C), and out, B x (a panel of
// columns), stays in the L1/L2 cache between the chunks of kc rows.
#pragma once

#include <algorithm>
#include <type_traits>

#include "kvattn/core/types.hpp"
#include "kvattn/detail/packet_ops.hpp"

namespace kvattn::detail {

/// The most rows of x the batch product takes; beyond, Eigen's GEMM (its packing is then
/// paid for by enough arithmetic).
inline constexpr Index kBatchProductRows = 64;

namespace kernels {

// Rows of W per chunk: out's block is loaded and stored once per chunk. Few rows of x
// leave the product bound by reading W, which a shallow chunk keeps close to row order
// (measured, 4096 x 4096 fp32, AVX-512: B = 2 at 23 -> 26 GB/s with 8 rows instead of
// 64); more rows of x make it bound by arithmetic, where a deep chunk saves loads and
// stores of out.
inline constexpr Index kBatchProductDepth = 64;
inline constexpr Index kBatchProductShallowDepth = 8;
inline constexpr Index kBatchProductShallowRows = 8;
// Bytes of out one column panel keeps in cache across the chunks.
inline constexpr Index kBatchProductPanelBytes = 32 * 1024;
// A register block: M rows of x x C packets of W's columns in accumulators, C packets
// of W and a broadcast beside them. With 32 registers 8 x 3 (24 accumulators; one W
// packet feeds 8 FMAs) measured faster than 4 x 4 from 16 rows on (4096 x 4096 fp32,
// AVX-512: 110 -> 120 GFLOP/s at 16 rows, 152 -> 175-181 at 64; equal below); with 16
// registers 4 x 2.
inline constexpr int kBatchProductBlockRows = many_registers ? 8 : 4;
inline constexpr int kBatchProductPackets = many_registers ? 3 : 2;

// out rows [0, M) x C packets of columns (+)= x rows [0, M) (kc wide) times kc rows of w.
// Along the way, packets [pf0, pf1) of each of the kc rows at `ahead` are prefetched:
// the W block the loop reads next, so that its first rows of x do not wait on memory.
template <class T, int M, int C>
inline void batch_product_block(const T* x, Index ldx, Index kc, const T* w, Index ldw, T* out,
                                Index ldo, bool first, const T* ahead, int pf0, int pf1) {
  using Pk = Packet<T>;
  constexpr Index P = packet_size<T>;
  Pk acc[M][C];
  KVATTN_UNROLL
  for (int m = 0; m < M; ++m) {
    KVATTN_UNROLL
    for (int c = 0; c < C; ++c)
      acc[m][c] = first ? ei::pset1<Pk>(T(0)) : ei::ploadu<Pk>(out + m * ldo + c * P);
  }
  for (Index k = 0; k < kc; ++k) {
    Pk wp[C];
    KVATTN_UNROLL
    for (int c = 0; c < C; ++c) wp[c] = ei::ploadu<Pk>(w + k * ldw + c * P);
    for (int c = pf0; c < pf1; ++c) ei::prefetch(ahead + k * ldw + c * P);
    KVATTN_UNROLL
    for (int m = 0; m < M; ++m) {
      const Pk xb = ei::pset1<Pk>(x[m * ldx + k]);
      KVATTN_UNROLL
      for (int c = 0; c < C; ++c) acc[m][c] = ei::pmadd(xb, wp[c], acc[m][c]);
    }
  }
  KVATTN_UNROLL
  for (int m = 0; m < M; ++m) {
    KVATTN_UNROLL
    for (int c = 0; c < C; ++c) ei::pstoreu(out + m * ldo + c * P, acc[m][c]);
  }
}

// batch_product_block with a run-time number of rows m in [1, Mmax].
template <class T, int C, int Mmax = kBatchProductBlockRows>
inline void batch_product_rows(int m, const T* x, Index ldx, Index kc, const T* w, Index ldw,
                               T* out, Index ldo, bool first, const T* ahead = nullptr, int pf0 = 0,
                               int pf1 = 0) {
  if constexpr (Mmax >= 1) {
    if (m == Mmax) {
      batch_product_block<T, Mmax, C>(x, ldx, kc, w, ldw, out, ldo, first, ahead, pf0, pf1);
    } else {
      batch_product_rows<T, C, Mmax - 1>(m, x, ldx, kc, w, ldw, out, ldo, first, ahead, pf0, pf1);
    }
  }
}

}  // namespace kernels

/// out (B x n, row stride ldo) = x (B x d, row stride ldx) times w (d x n, row stride
/// ldw), all row-major. Columns past the last whole packet take a plain loop.
template <class T>
void batch_product(const T* x, Index ldx, Index B, Index d, const T* w, Index ldw, Index n, T* out,
                   Index ldo) {
  using namespace kernels;
  constexpr Index P = packet_size<T>;
  constexpr int C = kBatchProductPackets;
  constexpr int M = kBatchProductBlockRows;
  if (d == 0) {  // an empty sum (the chunk loop below would write nothing)
    for (Index b = 0; b < B; ++b) std::fill(out + b * ldo, out + b * ldo + n, T(0));
    return;
  }
  const Index vector_cols = n / P * P;
  const Index depth =
      B <= kBatchProductShallowRows ? kBatchProductShallowDepth : kBatchProductDepth;
  // Columns per panel: B x panel_cols of out stay in cache while all of W's rows pass.
  const Index panel_cols =
      std::max<Index>(C * P, kBatchProductPanelBytes / (Index{sizeof(T)} * std::max<Index>(B, 1)) /
                                 (C * P) * (C * P));
  const int row_blocks = static_cast<int>((B + M - 1) / M);
  for (Index p0 = 0; p0 < vector_cols; p0 += panel_cols) {
    const Index p1 = std::min(vector_cols, p0 + panel_cols);
    for (Index k0 = 0; k0 < d; k0 += depth) {
      const Index kc = std::min(depth, d - k0);
      const bool first = k0 == 0;
      for (Index c0 = p0; c0 < p1;) {
        const Index packets = std::min<Index>(C, (p1 - c0) / P);
        // The block after this one (the next packets of these rows, the panel's next rows,
        // or the next panel's first rows) is prefetched, a share of its packets per row
        // block, where it has as many rows as this one (all but at the end of W).
        const Index next = c0 + packets * P;
        Index ahead_col = next, ahead_end = p1, ahead_rows = kc;
        const T* ahead = w + k0 * ldw + next;
        if (next >= p1) {
          ahead_col = k0 + depth < d ? p0 : p1;
          ahead_end = k0 + depth < d ? p1 : std::min(vector_cols, p1 + panel_cols);
          ahead_rows = k0 + depth < d ? std::min(depth, d - k0 - depth) : std::min(depth, d);
          ahead = w + (k0 + depth < d ? (k0 + depth) * ldw : 0) + ahead_col;
        }
        const int ahead_packets =
            ahead_rows >= kc ? static_cast<int>(std::min<Index>(C, (ahead_end - ahead_col) / P))
                             : 0;
        for (Index b0 = 0; b0 < B; b0 += M) {
          const int m = static_cast<int>(std::min<Index>(M, B - b0));
          const int block = static_cast<int>(b0 / M);
          const T* xb = x + b0 * ldx + k0;
          const T* wb = w + k0 * ldw + c0;
          T* ob = out + b0 * ldo + c0;
          if (packets == C) {
            batch_product_rows<T, C>(m, xb, ldx, kc, wb, ldw, ob, ldo, first, ahead,
                                     block * ahead_packets / row_blocks,
                                     (block + 1) * ahead_packets / row_blocks);
          } else {  // the panel's last packets, fewer than C
            for (Index c = 0; c < packets; ++c)
              batch_product_rows<T, 1>(m, xb, ldx, kc, wb + c * P, ldw, ob + c * P, ldo, first);
          }
        }
        c0 = next;
      }
    }
  }
  for (Index b = 0; b < B; ++b) {
    for (Index j = vector_cols; j < n; ++j) {
      T s(0);
      for (Index k = 0; k < d; ++k) s += x[b * ldx + k] * w[k * ldw + j];
      out[b * ldo + j] = s;
    }
  }
}

/// Whether an Eigen expression is a row-major block of memory with contiguous rows.
template <class X>
inline constexpr bool contiguous_rows_v =
    (X::Flags & Eigen::RowMajorBit) != 0 &&
    (X::Flags & Eigen::DirectAccessBit) != 0 && X::InnerStrideAtCompileTime == 1;

/// out = a * w: batch_product where it applies (float or double, every operand row-major
/// in memory, 2 to kBatchProductRows rows of a), Eigen's product otherwise (one row: its
/// GEMV streams W well; many rows: its GEMM). out must not alias a or w.
template <class A, class W, class Out>
void product(const A& a, const W& w, Out&& out) {
  using T = typename W::Scalar;
  using O = std::remove_reference_t<Out>;
  constexpr bool real = std::is_same_v<T, float> || std::is_same_v<T, double>;
  constexpr bool same =
      std::is_same_v<typename A::Scalar, T> && std::is_same_v<typename O::Scalar, T>;
  if constexpr (real && same && contiguous_rows_v<A> && contiguous_rows_v<W> &&
                contiguous_rows_v<O>) {
    if (a.rows() >= 2 && a.rows() <= kBatchProductRows) {
      batch_product(a.data(), a.outerStride(), a.rows(), a.cols(), w.data(), w.outerStride(),
                    w.cols(), out.data(), out.outerStride());
      return;
    }
  }
  out.noalias() = a * w;
}

}  // namespace kvattn::detail
