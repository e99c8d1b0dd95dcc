// Decode kernels on the CPU's bf16 dot-product instruction (AVX512-BF16's vdpbf16ps):
// each lane of a float accumulator adds the products of one pair of bf16 elements,
// a[2i] b[2i] + a[2i+1] b[2i+1], so one instruction does 32 multiply-adds where a float
// FMA does 16, and bf16 rows need no widening. Both operands are bf16, so the float side
// is rounded to bf16 first, which is the accuracy this costs (docs/api.md, "bf16 dot
// products"): the query once per step (by the caller), the softmax weights once per tile.
// The products of two bf16 values are exact in float and sum in float; the instruction
// treats denormal inputs and results as zero.
//
//   score_rows_bf16_dot       logits = Q K^T as score_rows (decode_kernels.hpp) with seg =
//                             0: blocks of M rows x B tokens, M * B = 16 accumulators
//                             reduced together by one sum_lanes; a width that is not a
//                             multiple of 32 ends with a masked load of both operands.
//   accumulate_rows_bf16_dot  acc += W V: two tokens at a time, their value rows
//                             interleaved element by element (unpacklo/hi_epi16) against
//                             the pair of their weights, so the accumulators come out in
//                             a permuted column order (from_bf16_dot_order restores it).
//
// Measured kernel-only (Zen 5, hot rows; the instruction runs 6.8 G per second on one
// thread, the rate of float FMAs): MLA's 16 rows x 576 scored in 60-71 ns per token
// against 110-113 widened; GQA's 4 rows x 128 in 5.5 against 8.3 paired (values 3.8
// against 5.9); MQA's 32 x 128 in 78 against 48 for score_rows_outer (which MQA keeps).
// Over a cold cache, as in a decode step (GQA's 8 groups x 65536 x 128 bf16, alternating
// with the read pass, 2695 MHz Zen 5 VM): the score 0.78-1.20 of the read pass's rate
// against 0.52-0.76 paired, the values in token blocks of 16 0.94-1.12 against 0.66-1.02
// widened (whole-tile passes over half rows, as MLA takes them: 0.52-0.72). (An earlier
// VM measured a median 2 points' gain there; docs/benchmarks.md.)
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvattn/core/simd.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/detail/packet_ops.hpp"

namespace kvattn::detail {

#if KVATTN_HAVE_BF16_DOT  // core/simd.hpp: bf16_dot_available()

namespace kernels {

// Rows [0, M) of q against tokens t0 ... t0 + B - 1 (tokens past n re-read the last row
// and their sums are dropped); out is row 0's logits at token t0.
template <int M, int B>
inline void bf16_dot_block(const Eigen::bfloat16* q, Index q_stride, Index dk,
                           const Eigen::bfloat16* k, Index k_stride, Index t0, Index n, float* out,
                           Index ld, Prefetcher* prefetch) {
  static_assert(M * B == 16, "one sum_lanes per block");
  const Eigen::bfloat16* row[B];
  KVATTN_UNROLL
  for (int b = 0; b < B; ++b) row[b] = k + std::min(t0 + b, n - 1) * k_stride;
  __m512 acc[16];
  KVATTN_UNROLL
  for (int a = 0; a < 16; ++a) acc[a] = _mm512_setzero_ps();
  auto chunk = [&](Index j, __mmask32 mask) {
    if (prefetch != nullptr) prefetch->step();
    __m512bh qp[M];
    KVATTN_UNROLL
    for (int m = 0; m < M; ++m) {
      qp[m] = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, q + m * q_stride + j));
    }
    KVATTN_UNROLL
    for (int b = 0; b < B; ++b) {
      const __m512bh kp = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, row[b] + j));
      KVATTN_UNROLL
      for (int m = 0; m < M; ++m) acc[m * B + b] = _mm512_dpbf16_ps(acc[m * B + b], qp[m], kp);
    }
  };
  const Index full = dk / 32 * 32;
  for (Index j = 0; j < full; j += 32) chunk(j, ~__mmask32{0});
  if (full < dk) chunk(full, static_cast<__mmask32>((std::uint64_t{1} << (dk - full)) - 1));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum_lanes<float>(acc));
  KVATTN_UNROLL
  for (int m = 0; m < M; ++m) {
    KVATTN_UNROLL
    for (int b = 0; b < B; ++b) {
      if (t0 + b < n) out[m * ld + b] = lanes[m * B + b];
    }
  }
}

}  // namespace kernels

/// logits = Q K^T over bf16 operands by vdpbf16ps (see the header comment). `prefetch`
/// (optional) is stepped once per 32 columns of each block and finished at the end.
template <class T>
void score_rows_bf16_dot(const Eigen::bfloat16* q, Index q_stride, Index G, Index dk,
                         const Eigen::bfloat16* k, Index k_stride, Index n, T* logits, Index ld,
                         Prefetcher* prefetch = nullptr) {
  static_assert(std::is_same_v<T, float>, "the instruction sums in float");
  if (n > 0 && G > 0) {
    // Token groups of 16, front to back (the tile is read from memory once and each group's
    // rows stay in L1 while every row block takes them); within a group, blocks of 4 rows x
    // 4 tokens (kernel-only, MLA's 16 x 576: 71 ns per token, 4 x 6 with two reductions per
    // block 74), then 2 x 8 and 1 x 16 for the rows left over.
    const Index rest = G % 4;
    const Index blocks_per_group = G / 4 * 4 + (rest >= 2 ? 2 : 0) + rest % 2;
    if (prefetch != nullptr) prefetch->plan((n + 15) / 16 * blocks_per_group * ((dk + 31) / 32));
    for (Index t0 = 0; t0 < n; t0 += 16) {
      Index i0 = 0;
      for (; i0 + 4 <= G; i0 += 4) {
        for (Index b = 0; b < 16 && t0 + b < n; b += 4) {
          kernels::bf16_dot_block<4, 4>(q + i0 * q_stride, q_stride, dk, k, k_stride, t0 + b, n,
                                        logits + i0 * ld + t0 + b, ld, prefetch);
        }
      }
      if (i0 + 2 <= G) {
        for (Index b = 0; b < 16 && t0 + b < n; b += 8) {
          kernels::bf16_dot_block<2, 8>(q + i0 * q_stride, q_stride, dk, k, k_stride, t0 + b, n,
                                        logits + i0 * ld + t0 + b, ld, prefetch);
        }
        i0 += 2;
      }
      if (i0 < G) {
        kernels::bf16_dot_block<1, 16>(q + i0 * q_stride, q_stride, dk, k, k_stride, t0, n,
                                       logits + i0 * ld + t0, ld, prefetch);
      }
    }
  }
  if (prefetch != nullptr) prefetch->finish();
}

namespace kernels {

// Rows [0, M) of acc, C chunks of 32 columns from column chunk c0 on, += the tokens'
// value rows in pairs: wb holds the weights rounded to bf16 (row i at wb + i * ld, a zero
// after the last token when n is odd), so the 32 bits at token t (even) are the pair
// (w_t, w_t+1) that vdpbf16ps multiplies with (v_t, v_t+1) interleaved element by element.
template <int M, int C>
inline void bf16_dot_accumulate_block(const Eigen::bfloat16* wb, Index ld, const Eigen::bfloat16* v,
                                      Index v_stride, Index c0, Index n, float* acc,
                                      Index acc_stride, Prefetcher* prefetch) {
  __m512 lo[M][C], hi[M][C];
  KVATTN_UNROLL
  for (int m = 0; m < M; ++m) {
    KVATTN_UNROLL
    for (int c = 0; c < C; ++c) {
      lo[m][c] = _mm512_loadu_ps(acc + m * acc_stride + (c0 + c) * 32);
      hi[m][c] = _mm512_loadu_ps(acc + m * acc_stride + (c0 + c) * 32 + 16);
    }
  }
  for (Index t = 0; t < n; t += 2) {
    if (prefetch != nullptr) prefetch->step();
    const Eigen::bfloat16* first = v + t * v_stride + c0 * 32;
    const Eigen::bfloat16* second = t + 1 < n ? first + v_stride : first;  // weight 0
    __m512bh pair[M];
    KVATTN_UNROLL
    for (int m = 0; m < M; ++m) {
      std::int32_t both;
      std::memcpy(&both, wb + m * ld + t, sizeof both);
      pair[m] = reinterpret_cast<__m512bh>(_mm512_set1_epi32(both));
    }
    KVATTN_UNROLL
    for (int c = 0; c < C; ++c) {
      const __m512i a = _mm512_loadu_si512(first + c * 32), b = _mm512_loadu_si512(second + c * 32);
      const __m512bh low = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(a, b));
      const __m512bh high = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(a, b));
      KVATTN_UNROLL
      for (int m = 0; m < M; ++m) {
        lo[m][c] = _mm512_dpbf16_ps(lo[m][c], low, pair[m]);
        hi[m][c] = _mm512_dpbf16_ps(hi[m][c], high, pair[m]);
      }
    }
  }
  KVATTN_UNROLL
  for (int m = 0; m < M; ++m) {
    KVATTN_UNROLL
    for (int c = 0; c < C; ++c) {
      _mm512_storeu_ps(acc + m * acc_stride + (c0 + c) * 32, lo[m][c]);
      _mm512_storeu_ps(acc + m * acc_stride + (c0 + c) * 32 + 16, hi[m][c]);
    }
  }
}

template <int M, int C>
inline void bf16_dot_accumulate_rows(const Eigen::bfloat16* wb, Index ld, const Eigen::bfloat16* v,
                                     Index v_stride, Index chunks, Index n, float* acc,
                                     Index acc_stride, Prefetcher* prefetch) {
  Index c0 = 0;
  for (; c0 + C <= chunks; c0 += C) {
    bf16_dot_accumulate_block<M, C>(wb, ld, v, v_stride, c0, n, acc, acc_stride, prefetch);
  }
  for (; c0 < chunks; ++c0) {
    bf16_dot_accumulate_block<M, 1>(wb, ld, v, v_stride, c0, n, acc, acc_stride, prefetch);
  }
}

}  // namespace kernels

/// acc_i += sum_t w[i * ld + t] v_t for i < G, t < n, by vdpbf16ps: the weights rounded
/// to bf16 (into `scratch`, G x ld bf16; ld even and > n when n is odd), the value rows
/// v_t = v + t * v_stride (bf16, dv wide, dv a multiple of 32) taken two tokens at a
/// time and interleaved element by element. The accumulator rows (acc + i * acc_stride)
/// are in "dot order" (dot_order_index; from_bf16_dot_order restores a row): in each block of 32
/// columns, lanes 0-15 hold columns 0-3, 8-11, 16-19, 24-27 and lanes 16-31 columns
/// 4-7, 12-15, 20-23, 28-31 (the interleave works within 128-bit lanes). `prefetch`
/// (optional) is stepped once per token pair of each register block. `token_block` (0:
/// all n at once; an odd one is taken as the next even) runs every register block over
/// that many tokens before the next ones, so that rows wider than one register block are
/// read from memory once, front to back, the other blocks finding them in L1.
template <class T>
void accumulate_rows_bf16_dot(const T* w, Index ld, Index G, const Eigen::bfloat16* v,
                              Index v_stride, Index dv, Index n, T* acc, Index acc_stride,
                              Eigen::bfloat16* scratch, Prefetcher* prefetch = nullptr,
                              Index token_block = 0) {
  static_assert(std::is_same_v<T, float>, "the instruction sums in float");
  const Index chunks = dv / 32;
  if (n > 0 && G > 0) {
    for (Index i = 0; i < G; ++i) {
      Eigen::bfloat16* row = scratch + i * ld;
      Index t = 0;
      for (; t + 16 <= n; t += 16) {
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(row + t),
            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(w + i * ld + t))));
      }
      for (; t < n; ++t) row[t] = Eigen::bfloat16(w[i * ld + t]);
      if (n % 2 == 1) row[n] = Eigen::bfloat16(0.0f);
    }
    // Register blocks of 16 x 2 accumulators: 4 rows x 2 chunks (64 columns), 2 x 4, 1 x 8.
    const Index pairs = (n + 1) / 2, rest = G % 4;
    if (prefetch != nullptr) {
      // Blocks of C chunks, then one per chunk left over (bf16_dot_accumulate_rows).
      auto blocks = [chunks](Index C) { return chunks / C + chunks % C; };
      const Index all =
          G / 4 * blocks(2) + (rest >= 2 ? blocks(4) : 0) + (rest % 2 == 1 ? blocks(8) : 0);
      prefetch->plan(all * pairs);
    }
    // An odd block size would pair a block's last token with the next block's first.
    const Index step = token_block > 0 ? (token_block + 1) / 2 * 2 : n;
    for (Index t0 = 0; t0 < n; t0 += step) {
      // Tokens [t0, t0 + count); an odd count is the last block's, whose weight after the
      // last token is the zero written above.
      const Index count = std::min(step, n - t0);
      const Eigen::bfloat16* rows = v + t0 * v_stride;
      Index i0 = 0;
      for (; i0 + 4 <= G; i0 += 4) {
        kernels::bf16_dot_accumulate_rows<4, 2>(scratch + i0 * ld + t0, ld, rows, v_stride, chunks,
                                                count, acc + i0 * acc_stride, acc_stride, prefetch);
      }
      if (i0 + 2 <= G) {
        kernels::bf16_dot_accumulate_rows<2, 4>(scratch + i0 * ld + t0, ld, rows, v_stride, chunks,
                                                count, acc + i0 * acc_stride, acc_stride, prefetch);
        i0 += 2;
      }
      if (i0 < G) {
        kernels::bf16_dot_accumulate_rows<1, 8>(scratch + i0 * ld + t0, ld, rows, v_stride, chunks,
                                                count, acc + i0 * acc_stride, acc_stride, prefetch);
      }
    }
  }
  if (prefetch != nullptr) prefetch->finish();
}

#else

// Declared for callers' discarded `if constexpr (bf16_dot_available())` branches; never
// defined.
template <class T>
void score_rows_bf16_dot(const Eigen::bfloat16* q, Index q_stride, Index G, Index dk,
                         const Eigen::bfloat16* k, Index k_stride, Index n, T* logits, Index ld,
                         Prefetcher* prefetch = nullptr);
template <class T>
void accumulate_rows_bf16_dot(const T* w, Index ld, Index G, const Eigen::bfloat16* v,
                              Index v_stride, Index dv, Index n, T* acc, Index acc_stride,
                              Eigen::bfloat16* scratch, Prefetcher* prefetch = nullptr,
                              Index token_block = 0);

#endif

/// Whether a decode step in type T over cached rows of storage S can take the kernels
/// above: plain bf16 rows, float queries, a build with the instruction.
template <class T, class S>
inline constexpr bool bf16_dot_storage = (bf16_dot_available() && std::is_same_v<T, float> &&
                                          std::is_same_v<S, Eigen::bfloat16>);

/// Whether accumulate_rows_bf16_dot takes value rows of `width` elements (whole chunks of
/// 32; narrower or ragged rows are summed widened, in float).
constexpr bool bf16_dot_values(Index width) { return width % 32 == 0; }

/// Column j of a row in accumulate_rows_bf16_dot's order sits at dot_order_index(j).
constexpr Index dot_order_index(Index j) {
  const Index block = j / 32 * 32, k = j % 32;
  // k = 8 q + 4 half + e: 128-bit lane q, the unpack's low (half 0) or high (1) part.
  const Index q = k / 8, half = k % 8 / 4, e = k % 4;
  return block + 16 * half + 4 * q + e;
}

/// A row (width a multiple of 32) from accumulate_rows_bf16_dot's order back to column
/// order.
template <class T>
void from_bf16_dot_order(T* row, Index width) {
  for (Index j = 0; j + 32 <= width; j += 32) {
    T block[32];
    for (Index k = 0; k < 32; ++k) block[k] = row[j + k];
    for (Index k = 0; k < 32; ++k) row[j + k] = block[dot_order_index(k)];
  }
}

/// `count` rows of `width`, `width` apart, back to column order (from_bf16_dot_order).
template <class T>
void from_bf16_dot_order(T* rows, Index count, Index width) {
  for (Index r = 0; r < count; ++r) from_bf16_dot_order(rows + r * width, width);
}

}  // namespace kvattn::detail
