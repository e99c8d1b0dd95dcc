// Vectorized tile kernels of the decode step (Eigen packets, see packet_ops.hpp).
// Cached rows are read in storage type S and widened to the compute type T in
// registers; everything accumulates in T.
//
// Shapes (rows are tokens): a tile holds n cached tokens, token t's row at
// `rows + t * row_stride`. Logits and softmax weights are query-major, w[i * ld + t]
// for query row i < G and token t < n, so the online softmax between the two kernels
// runs along tokens, vectorized whatever G is (one query row per group for MHA).
// Query row i reads the columns at i * seg of every cached row: seg = 0 when all rows
// share the keys (a KV group, MLA's latent, LRKV's shared key), seg = r for LRKV's
// per-head residual slices.
//
//   score_rows       logits = Q K_tile^T: blocks of M query rows x B adjacent tokens,
//                    one accumulator packet per (row, token) in flight (12 on
//                    16-register ISAs, 16 on 32-register ones, 24 for 4 rows there:
//                    enough independent FMA chains to cover the FMA latency), so a query
//                    packet serves B tokens and a key packet M rows; a block's dot
//                    products are reduced
//                    together, P at a time, by one transpose-and-add (sum_lanes), never
//                    one horizontal sum per token. The tile is read front to back, one
//                    sequential stream, which the caller's Prefetcher runs ahead of.
//                    Many rows against narrow shared keys take outer products over a
//                    transposed chunk instead (score_rows_outer, AVX-512); up to 4 rows
//                    may read one token at a time, their sums reduced per token
//                    (score_rows_by_token, see score_by_token for where; on AVX-512 4
//                    fp32 rows with their queries held, score_rows4_by_token).
//   accumulate_rows  acc (G x d_v) += W V_tile: M rows x D packets of columns held in
//                    registers while the tokens stream by (one broadcast weight per row
//                    and D value packets per token); on AVX-512 4 fp32 rows take one
//                    token's whole row at a time (accumulate_rows4_by_token).
// Widths that are not a multiple of P (LRKV's r = 54) end with one overlapping packet
// whose repeated lanes are zeroed (packet_ops.hpp: zero_first), not a scalar loop.
// Widths below P take a plain scalar loop. bf16 rows may be read 2P elements at a time
// as an even- and an odd-indexed packet (the "paired" layout, packet_ops.hpp).
#pragma once

#include <algorithm>
#include <type_traits>

#include "kvattn/core/types.hpp"
#include "kvattn/detail/packet_ops.hpp"

namespace kvattn::detail {

/// Accumulator packets one register block keeps in flight: 12 of 16 registers (AVX2,
/// SSE) leaves room for the operands; 16 of 32 (AVX-512, AArch64 NEON).
inline constexpr int kBlockAccumulators = many_registers ? 16 : 12;

/// Query rows per register block (as many as are left, up to 4 with 32 registers, 2
/// with 16). With 16 registers, 2 rows x 6 tokens (or columns) load 2 + 6 packets per
/// 12 FMAs and keep every operand in a register; 4 x 3 would not fit, and the compiler
/// then reloads the shared packet for every row (16 loads per 12 FMAs: load-bound).
constexpr int block_rows(Index left) {
  constexpr Index most = many_registers ? 4 : 2;
  return static_cast<int>(std::min(left, most) >= 4 ? 4 : (std::min(left, most) >= 2 ? 2 : 1));
}

/// A second dot product added into the same logits by score_rows: query row i's
/// q + i * q_stride (dk wide) against the columns offset + i * seg of every cached row
/// (LRKV's residual q~_h . r~_h,t beside the shared q_h . k~_s,t). One register block
/// then carries both parts and is reduced once, and each row's residual slice is read
/// right after its shared part, keeping the tile's reading order front to back.
template <class T>
struct SecondDot {
  const T* q = nullptr;
  Index q_stride = 0;
  Index dk = 0;
  Index offset = 0;
  Index seg = 0;
};

namespace kernels {

// How query row i finds its columns in a cached row: all at the same offset (kShared),
// at i * seg (kSegmented), or at the same offset with bf16 elements read 2P at a time
// as an even and an odd packet (kPaired, packet_ops.hpp: bf16_even / bf16_odd).
inline constexpr int kShared = 0;
inline constexpr int kSegmented = 1;
inline constexpr int kPaired = 2;

// Tokens of a score block read together, column packet by column packet, before the
// next ones: all B, except for a single query row against shared keys (MHA), where
// every FMA needs a key load of its own and B = 16 rows read side by side spread the
// loads over 16 rows of the tile; 4 at a time keep the reading nearly sequential.
constexpr int score_sub_block(int M, int B, int Layout) {
  return M == 1 && Layout == kShared && B % 4 == 0 ? 4 : B;
}

// One score block: rows [0, M) of q (row stride q_stride, dk wide, dk >= P) against the
// B adjacent tokens t0 ... t0 + B - 1 of k (tokens past n re-read the last row, never
// memory past the tile, and their sums are dropped). Row m reads k + m * seg when
// Segmented. out (row stride ld) is the logits of row 0 at token t0.
template <class T, class S, int M, int B, int Layout>
inline void score_block(const T* q, Index q_stride, Index dk, const S* k, Index k_stride, Index seg,
                        Index t0, Index n, T* out, Index ld, bool add, Prefetcher* prefetch,
                        const SecondDot<T>* second) {
  constexpr bool Segmented = Layout == kSegmented;
  constexpr bool Paired = Layout == kPaired;
  (void)Segmented, (void)Paired;
  constexpr Index P = packet_size<T>;
  constexpr int A = M * B;
  // Stepped through a register copy (see BlockPrefetcher), written back when the block ends.
  BlockPrefetcher blockwise(prefetch);
  prefetch = blockwise.get();
  constexpr int R = static_cast<int>((A + P - 1) / P);  // packets of sums
  const S* row[B];
  KVATTN_UNROLL
  for (int b = 0; b < B; ++b) row[b] = k + std::min(t0 + b, n - 1) * k_stride;
  Packet<T> acc[R * P];
  KVATTN_UNROLL
  for (int a = 0; a < R * P; ++a) acc[a] = ei::pset1<Packet<T>>(T(0));
  // Tokens [b0, b0 + Sub) of the block against columns [j, j + P).
  constexpr int Sub = score_sub_block(M, B, Layout);
  auto step = [&](Index j, Index skip, int b0) {
    if (prefetch != nullptr) prefetch->step();
    Packet<T> qp[M];
    KVATTN_UNROLL
    for (int m = 0; m < M; ++m) {
      qp[m] = ei::ploadu<Packet<T>>(q + m * q_stride + j);
      if (skip > 0) qp[m] = zero_first<T>(qp[m], skip);
    }
    // A constant trip count (Clang unrolls only those, and -Werror reports the rest).
    KVATTN_UNROLL
    for (int s = 0; s < Sub; ++s) {
      const int b = b0 + s;
      if constexpr (Segmented) {
        KVATTN_UNROLL
        for (int m = 0; m < M; ++m) {
          Packet<T> kp = load_widened<T>(row[b] + m * seg + j);
          if (skip > 0) kp = zero_first<T>(kp, skip);
          acc[m * B + b] = ei::pmadd(qp[m], kp, acc[m * B + b]);
        }
      } else {
        Packet<T> kp = load_widened<T>(row[b] + j);
        if (skip > 0) kp = zero_first<T>(kp, skip);
        if constexpr (M > 1) keep_in_register(kp);
        KVATTN_UNROLL
        for (int m = 0; m < M; ++m) acc[m * B + b] = ei::pmadd(qp[m], kp, acc[m * B + b]);
      }
    }
  };
  if constexpr (Paired) {
#if KVATTN_PAIRED_BF16  // the intrinsics below exist only in AVX2 and AVX-512 builds
    if constexpr (kHavePairedBf16 && std::is_same_v<S, Eigen::bfloat16> && P == 8) {
      // 16 registers: 16 bf16 elements per load, the even-indexed ones in one pass over
      // the block's rows, the odd-indexed in a second (the reload hits L1), so that one
      // key packet at a time is live (12 accumulators + M queries + 1).
      for (Index j = 0; j < dk; j += 2 * P) {
        KVATTN_UNROLL
        for (int half = 0; half < 2; ++half) {
          if (prefetch != nullptr) prefetch->step();
          Packet<T> qp[M];
          KVATTN_UNROLL
          for (int m = 0; m < M; ++m)
            qp[m] = ei::ploadu<Packet<T>>(q + m * q_stride + j + half * P);
          KVATTN_UNROLL
          for (int b = 0; b < B; ++b) {
            const RawBf16 raw = load_bf16_raw(row[b] + j);
            Packet<T> kp = half == 0 ? bf16_even(raw) : bf16_odd(raw);
            if constexpr (M > 1) keep_in_register(kp);
            KVATTN_UNROLL
            for (int m = 0; m < M; ++m) acc[m * B + b] = ei::pmadd(qp[m], kp, acc[m * B + b]);
          }
        }
      }
    } else if constexpr (kHavePairedBf16 && std::is_same_v<S, Eigen::bfloat16>) {
      // 32 registers: 32 bf16 elements per load, both halves live (M * B accumulators,
      // 2M query packets, 2 key packets: B = 4 for 4 rows, see kPairedLanes4).
      for (Index j = 0; j < dk; j += 2 * P) {
        if (prefetch != nullptr) {  // the plan counts a step per P columns
          prefetch->step();
          prefetch->step();
        }
        Packet<T> q_even[M], q_odd[M];
        KVATTN_UNROLL
        for (int m = 0; m < M; ++m) {
          q_even[m] = ei::ploadu<Packet<T>>(q + m * q_stride + j);
          q_odd[m] = ei::ploadu<Packet<T>>(q + m * q_stride + j + P);
          // Held in registers: GCC otherwise folds each into every FMA that uses it,
          // a load per FMA, and the block ran at 14.9 ns per token instead of 7.7.
          keep_in_register(q_even[m]);
          keep_in_register(q_odd[m]);
        }
        KVATTN_UNROLL
        for (int b = 0; b < B; ++b) {
          const RawBf16 raw = load_bf16_raw(row[b] + j);
          const Packet<T> even = bf16_even(raw), odd = bf16_odd(raw);
          KVATTN_UNROLL
          for (int m = 0; m < M; ++m) {
            acc[m * B + b] = ei::pmadd(q_even[m], even, acc[m * B + b]);
            acc[m * B + b] = ei::pmadd(q_odd[m], odd, acc[m * B + b]);
          }
        }
      }
    }
#endif
  } else {
    const Index full = dk / P * P;
    KVATTN_UNROLL
    for (int b0 = 0; b0 < B; b0 += Sub) {
      for (Index j = 0; j < full; j += P) step(j, 0, b0);
      // The overlapping last packet, its repeated lanes zeroed in both operands.
      if (full < dk) step(dk - P, P - (dk - full), b0);
    }
  }
  if (second != nullptr && second->dk >= P) {
    // Row m's own slice of each cached row, into the same accumulators.
    auto step2 = [&](Index j, Index skip) {
      if (prefetch != nullptr) prefetch->step();
      Packet<T> qp[M];
      KVATTN_UNROLL
      for (int m = 0; m < M; ++m) {
        qp[m] = ei::ploadu<Packet<T>>(second->q + m * second->q_stride + j);
        if (skip > 0) qp[m] = zero_first<T>(qp[m], skip);
      }
      KVATTN_UNROLL
      for (int b = 0; b < B; ++b) {
        KVATTN_UNROLL
        for (int m = 0; m < M; ++m) {
          Packet<T> kp = load_widened<T>(row[b] + second->offset + m * second->seg + j);
          if (skip > 0) kp = zero_first<T>(kp, skip);
          acc[m * B + b] = ei::pmadd(qp[m], kp, acc[m * B + b]);
        }
      }
    };
    const Index dk2 = second->dk, full2 = dk2 / P * P;
    for (Index j = 0; j < full2; j += P) step2(j, 0);
    if (full2 < dk2) step2(dk2 - P, P - (dk2 - full2));
  }
  alignas(64) T lanes[R * P];
  KVATTN_UNROLL
  for (int r = 0; r < R; ++r) ei::pstore(lanes + r * P, sum_lanes<T>(acc + r * P));
  // Constant-trip loops: a runtime bound here becomes a memcpy call per row.
  KVATTN_UNROLL
  for (int m = 0; m < M; ++m) {
    KVATTN_UNROLL
    for (int b = 0; b < B; ++b) {
      if (t0 + b < n) {
        T& o = out[m * ld + b];
        o = add ? o + lanes[m * B + b] : lanes[m * B + b];
      }
    }
  }
}

// Tokens per score block of 4 query rows: 6 on 32-register ISAs, 24 accumulators + 4
// query packets + 1 key packet, so a block loads 10 packets per 24 FMAs instead of 8 per
// 16, and each query row is read once per 6 tokens instead of 4 (MQA's 32 rows x 128 and
// MLA's 16 x 576 are read from L2 by every block).
inline constexpr int kScoreLanes4 = many_registers ? 6 : kBlockAccumulators / 4;

// Tokens per paired score block of 4 query rows on 32-register ISAs: both halves of a
// pair column live take 8 query packets and 2 key packets beside the accumulators, so 4
// tokens (16 + 10 registers; 6 tokens spilled: 9.5 ns per token against 5.4,
// kernel-only).
inline constexpr int kPairedLanes4 = 4;

// Lanes per score block for a call over G rows: every block of the call uses the same
// B (the first block's), so all share one lane layout.
constexpr int score_lanes(Index G) {
  return block_rows(G) == 4 ? kScoreLanes4 : kBlockAccumulators / block_rows(G);
}

// One block of rows [i0, i0 + M) against tokens t0 ... t0 + B - 1.
template <class T, class S, int Layout, int B>
inline void score_step(int M, const T* q, Index q_stride, Index dk, const S* k, Index k_stride,
                       Index seg, Index i0, Index t0, Index n, T* logits, Index ld, bool add,
                       Prefetcher* prefetch, const SecondDot<T>* second) {
  constexpr bool Segmented = Layout == kSegmented;
  constexpr bool Paired = Layout == kPaired;
  (void)Segmented, (void)Paired;
  const T* qi = q + i0 * q_stride;
  const S* ki = Segmented ? k + i0 * seg : k;
  T* out = logits + i0 * ld + t0;
  SecondDot<T> chunk;  // the second dot's rows [i0, i0 + M)
  if (second != nullptr) {
    chunk = *second;
    chunk.q += i0 * chunk.q_stride;
    chunk.offset += i0 * chunk.seg;
  }
  const SecondDot<T>* sd = second != nullptr ? &chunk : nullptr;
  if (M == 4) {
    if constexpr (B <= kScoreLanes4)
      score_block<T, S, 4, B, Layout>(qi, q_stride, dk, ki, k_stride, seg, t0, n, out, ld, add,
                                      prefetch, sd);
  } else if (M == 2) {
    if constexpr (2 * B <= kBlockAccumulators)
      score_block<T, S, 2, B, Layout>(qi, q_stride, dk, ki, k_stride, seg, t0, n, out, ld, add,
                                      prefetch, sd);
  } else {
    score_block<T, S, 1, B, Layout>(qi, q_stride, dk, ki, k_stride, seg, t0, n, out, ld, add,
                                    prefetch, sd);
  }
}

// Blocks of B adjacent tokens, front to back: the tile is one sequential stream. Within
// a block the rows [i0, i0 + M) of every register block take the same B key rows, which
// the first has brought into L1. (Per FMA a block loads 64 / M bytes of keys and 64 / B
// of queries on AVX-512: the keys must be the operand in L1; the queries, up to
// MLA-V2's 128 x 576, may stream from L2.)
template <class T, class S, int Layout, int B>
void score_rows_lanes(const T* q, Index q_stride, Index G, Index dk, const S* k, Index k_stride,
                      Index seg, Index n, T* logits, Index ld, bool add, Prefetcher* prefetch,
                      const SecondDot<T>* second) {
  constexpr bool Segmented = Layout == kSegmented;
  constexpr bool Paired = Layout == kPaired;
  (void)Segmented, (void)Paired;
  constexpr Index P = packet_size<T>;
  const Index blocks = (n + B - 1) / B;
  Index chunks = 0;      // prefetch steps per token block and column packet of q
  Index row_blocks = 0;  // ... and per column packet of the second dot (one pass per row
                         // block and token block)
  for (Index i0 = 0; i0 < G; i0 += block_rows(G - i0)) {
    chunks += B / kernels::score_sub_block(block_rows(G - i0), B, Layout);
    ++row_blocks;
  }
  // score_block takes the second dot only when it fills a packet (narrower ones are
  // scored apart by detail::score_rows).
  const Index dk2 = second != nullptr && second->dk >= P ? second->dk : 0;
  if (prefetch != nullptr) {
    prefetch->plan(blocks * (chunks * ((dk + P - 1) / P) + row_blocks * ((dk2 + P - 1) / P)));
  }
  for (Index t0 = 0; t0 < n; t0 += B) {
    for (Index i0 = 0; i0 < G;) {
      const int M = block_rows(G - i0);
      score_step<T, S, Layout, B>(M, q, q_stride, dk, k, k_stride, seg, i0, t0, n, logits, ld, add,
                                  prefetch, second);
      i0 += M;
    }
  }
}

template <class T, class S, int Layout>
void score_rows(const T* q, Index q_stride, Index G, Index dk, const S* k, Index k_stride,
                Index seg, Index n, T* logits, Index ld, bool add, Prefetcher* prefetch,
                const SecondDot<T>* second) {
  constexpr bool Segmented = Layout == kSegmented;
  constexpr bool Paired = Layout == kPaired;
  (void)Segmented, (void)Paired;
  constexpr int B4 = kScoreLanes4, B2 = kBlockAccumulators / 2, B1 = kBlockAccumulators;
  if constexpr (Paired && many_registers) {
    if (block_rows(G) == 4) {
      score_rows_lanes<T, S, Layout, kPairedLanes4>(q, q_stride, G, dk, k, k_stride, seg, n, logits,
                                                    ld, add, prefetch, second);
      return;
    }
  }
  switch (score_lanes(G)) {
    case B4:
      score_rows_lanes<T, S, Layout, B4>(q, q_stride, G, dk, k, k_stride, seg, n, logits, ld, add,
                                         prefetch, second);
      break;
    case B2:
      score_rows_lanes<T, S, Layout, B2>(q, q_stride, G, dk, k, k_stride, seg, n, logits, ld, add,
                                         prefetch, second);
      break;
    default:
      score_rows_lanes<T, S, Layout, B1>(q, q_stride, G, dk, k, k_stride, seg, n, logits, ld, add,
                                         prefetch, second);
      break;
  }
}

// The score of at most 4 query rows against shared keys, one token at a time: the row's
// column packets front to back, one accumulator per query row, the sums reduced
// (sum_rows) and stored before the next token, the prefetcher stepped once per token.
// The register blocks above keep several tokens in flight instead (6 for 4 rows on
// AVX-512, 6 for 2 rows on AVX2; 16 for one row, read 4 at a time, or 12 side by side in
// AVX2's paired form), reading a line of each in turn, which streamed worse from a cold
// cache where score_by_token takes this kernel (it says what was measured).
template <class T, class S, int M, int Layout>
void score_rows_by_token(const T* q, Index q_stride, Index dk, const S* k, Index k_stride, Index n,
                         T* logits, Index ld, bool add, Prefetcher* prefetch) {
  constexpr Index P = packet_size<T>;
  const Index full = dk / P * P;
  if (prefetch != nullptr) prefetch->plan(n);  // a step per token
  BlockPrefetcher blockwise(prefetch);
  prefetch = blockwise.get();
  for (Index t = 0; t < n; ++t) {
    const S* row = k + t * k_stride;
    if (prefetch != nullptr) prefetch->step();
    Packet<T> acc[M];
    KVATTN_UNROLL
    for (int m = 0; m < M; ++m) acc[m] = ei::pset1<Packet<T>>(T(0));
    if constexpr (Layout == kPaired) {
#if KVATTN_PAIRED_BF16
      // dk is whole pairs of packets (paired_rows), the query in paired order.
      KVATTN_UNROLL_4
      for (Index j = 0; j < dk; j += 2 * P) {
        const RawBf16 raw = load_bf16_raw(row + j);
        const Packet<T> even = bf16_even(raw), odd = bf16_odd(raw);
        KVATTN_UNROLL
        for (int m = 0; m < M; ++m) {
          acc[m] = ei::pmadd(ei::ploadu<Packet<T>>(q + m * q_stride + j), even, acc[m]);
          acc[m] = ei::pmadd(ei::ploadu<Packet<T>>(q + m * q_stride + j + P), odd, acc[m]);
        }
      }
#endif
    } else {
      KVATTN_UNROLL_4
      for (Index j = 0; j < full; j += P) {
        const Packet<T> kp = load_widened<T>(row + j);
        KVATTN_UNROLL
        for (int m = 0; m < M; ++m)
          acc[m] = ei::pmadd(ei::ploadu<Packet<T>>(q + m * q_stride + j), kp, acc[m]);
      }
      if (full < dk) {  // the overlapping last packet, its repeated lanes zeroed in both
        const Index skip = P - (dk - full);
        const Packet<T> kp = zero_first<T>(load_widened<T>(row + dk - P), skip);
        KVATTN_UNROLL
        for (int m = 0; m < M; ++m) {
          const Packet<T> qp =
              zero_first<T>(ei::ploadu<Packet<T>>(q + m * q_stride + dk - P), skip);
          acc[m] = ei::pmadd(qp, kp, acc[m]);
        }
      }
    }
    T sums[M];
    sum_rows<T, M>(acc, sums);
    KVATTN_UNROLL
    for (int m = 0; m < M; ++m) {
      T& o = logits[m * ld + t];
      o = add ? o + sums[m] : sums[m];
    }
  }
}

// Whether G query rows against shared keys in storage S take score_rows_by_token: float
// queries against bf16 or fp32 keys only (quantized codes and double were not measured).
// Measured on decode steps of the real driver over cold caches (both kernels on the same
// cache, alternating, Zen 5, L = 65536, d_h 128, rates against a plain read pass):
//   16 registers (AVX2): GQA fp32 (4 rows) 0.70-0.73 by token against 0.57-0.63 in
//     blocks, GQA bf16 (4 rows, widened) 0.47-0.48 against 0.44-0.45, MHA bf16 (paired)
//     0.94-0.97 against 0.88-0.98;
//   32 registers (AVX-512): MHA bf16 0.89-0.96 against 0.85-0.96, but GQA bf16 0.58-0.71
//     against 0.62-0.94 for the paired 4-row blocks and GQA fp32 the same or slower;
//   one fp32 row (MHA), either ISA: the same or slower (its 16-token blocks already read
//     nearly in order, score_sub_block).
// Other 16-register ISAs (SSE2) follow AVX2, other 32-register ones (NEON) AVX-512,
// unmeasured.
template <class T, class S>
constexpr bool score_by_token(Index G) {
  constexpr bool bf16 = std::is_same_v<T, float> && std::is_same_v<S, Eigen::bfloat16>;
  constexpr bool fp32 = std::is_same_v<T, float> && std::is_same_v<S, float>;
  if (G < 1 || G > 4) return false;
  if constexpr (many_registers) {
    return bf16 && G == 1;
  } else {
    return bf16 || (fp32 && G >= 2);
  }
}

// Whether any number of rows takes score_rows_by_token for these types on this ISA (1
// row covers bf16 with 32 registers, 4 rows every case with 16), so that the shared-key
// scores of other types (fp32 on AVX-512, double, quantized codes) never instantiate it.
template <class T, class S>
constexpr bool any_score_by_token = score_by_token<T, S>(1) || score_by_token<T, S>(4);

template <class T, class S, int Layout>
void score_rows_by_token(Index G, const T* q, Index q_stride, Index dk, const S* k, Index k_stride,
                         Index n, T* logits, Index ld, bool add, Prefetcher* prefetch) {
  switch (G) {
    case 1:
      score_rows_by_token<T, S, 1, Layout>(q, q_stride, dk, k, k_stride, n, logits, ld, add,
                                           prefetch);
      break;
    case 2:
      score_rows_by_token<T, S, 2, Layout>(q, q_stride, dk, k, k_stride, n, logits, ld, add,
                                           prefetch);
      break;
    case 3:
      score_rows_by_token<T, S, 3, Layout>(q, q_stride, dk, k, k_stride, n, logits, ld, add,
                                           prefetch);
      break;
    default:  // 4 (score_by_token)
      eigen_assert(G == 4);
      score_rows_by_token<T, S, 4, Layout>(q, q_stride, dk, k, k_stride, n, logits, ld, add,
                                           prefetch);
      break;
  }
}

#if defined(EIGEN_VECTORIZE_AVX512)
// The outer-product score for many query rows against shared keys (MQA's 32 heads,
// a shared prefix's stacked rows). The dot-product blocks above end every block of
// (row, token) sums with a horizontal reduction, about 3 shuffle-or-add operations per
// sum whatever dk: with dk = 128 that is a third again on top of the 8 FMAs of each sum
// (perf of decode/mqa: the score pass took 37% of the step's samples, the
// accumulate, with as many FMAs and no reduction, 20%). Here each chunk of 2P tokens
// is first transposed into a dk x 2P block (16 x 16 register transposes, a quarter of a
// shuffle per key element, shared by all G rows), and then every query element,
// broadcast, multiplies two packets of 16 tokens: the sums come out in lanes, already
// token-major as the logits are, with no reduction.
inline constexpr Index kOuterMaxDk = 256;  // the transposed chunk lives on the stack

// Should G rows of dk columns take the outer-product score? When the reductions it
// saves (about 3 operations per row and token) outweigh the transposes it adds (about
// dk / 4 per token, and the reloads of the transposed chunk): G >= dk / 8.
template <class T>
constexpr bool outer_score(Index G, Index dk) {
  return std::is_same_v<T, float> && dk % packet_size<T> == 0 && dk <= kOuterMaxDk && 8 * G >= dk &&
         G >= 8;
}

// Rows [0, M) of q against a transposed chunk (packed[j * 2P + c] = key of token c,
// column j); the sums go to out rows (stride ld), the first `count` tokens of the chunk.
template <class T, int M>
inline void outer_block(const T* q, Index q_stride, Index dk, const T* packed, Index count, T* out,
                        Index ld, bool add) {
  constexpr Index P = packet_size<T>;
  Packet<T> acc[M][2];
  KVATTN_UNROLL
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = ei::pset1<Packet<T>>(T(0));
  for (Index j = 0; j < dk; ++j) {
    const Packet<T> k0 = ei::pload<Packet<T>>(packed + j * 2 * P);
    const Packet<T> k1 = ei::pload<Packet<T>>(packed + j * 2 * P + P);
    KVATTN_UNROLL
    for (int m = 0; m < M; ++m) {
      const Packet<T> qm = ei::pset1<Packet<T>>(q[m * q_stride + j]);
      acc[m][0] = ei::pmadd(qm, k0, acc[m][0]);
      acc[m][1] = ei::pmadd(qm, k1, acc[m][1]);
    }
  }
  KVATTN_UNROLL
  for (int m = 0; m < M; ++m) {
    T* o = out + m * ld;
    if (count == 2 * P && !add) {
      ei::pstoreu(o, acc[m][0]);
      ei::pstoreu(o + P, acc[m][1]);
    } else {
      alignas(64) T sums[2 * P];
      ei::pstore(sums, acc[m][0]);
      ei::pstore(sums + P, acc[m][1]);
      for (Index c = 0; c < count; ++c) o[c] = add ? o[c] + sums[c] : sums[c];
    }
  }
}

// outer_block with a run-time M in [1, Mmax].
template <class T, int Mmax>
inline void outer_block_n(int M, const T* q, Index q_stride, Index dk, const T* packed, Index count,
                          T* out, Index ld, bool add) {
  if constexpr (Mmax >= 1) {
    if (M == Mmax) {
      outer_block<T, Mmax>(q, q_stride, dk, packed, count, out, ld, add);
    } else {
      outer_block_n<T, Mmax - 1>(M, q, q_stride, dk, packed, count, out, ld, add);
    }
  }
}

// (PacketBlock<Packet<T>, P>: see sum_lanes in packet_ops.hpp for the warning.)
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"
#endif
template <class T, class S>
void score_rows_outer(const T* q, Index q_stride, Index G, Index dk, const S* k, Index k_stride,
                      Index n, T* logits, Index ld, bool add, Prefetcher* prefetch) {
  constexpr Index P = packet_size<T>;
  constexpr int Rows = 8;  // 16 accumulators, 2 key packets and a broadcast in registers
  alignas(64) T packed[kOuterMaxDk * 2 * P];
  const Index chunks = (n + 2 * P - 1) / (2 * P);
  if (prefetch != nullptr) prefetch->plan(chunks * 2 * (dk / P));
  for (Index t0 = 0; t0 < n; t0 += 2 * P) {
    // Tokens past n re-read the last one (never memory past the tile); dropped at the end.
    KVATTN_UNROLL
    for (int half = 0; half < 2; ++half) {
      for (Index j0 = 0; j0 < dk; j0 += P) {
        if (prefetch != nullptr) prefetch->step();
        ei::PacketBlock<Packet<T>, P> block;
        KVATTN_UNROLL
        for (int c = 0; c < P; ++c) {
          const Index t = std::min(t0 + half * P + c, n - 1);
          block.packet[c] = load_widened<T>(k + t * k_stride + j0);
        }
        ei::ptranspose(block);
        KVATTN_UNROLL
        for (int i = 0; i < P; ++i) {
          ei::pstore(packed + (j0 + i) * 2 * P + half * P, block.packet[i]);
        }
      }
    }
    const Index count = std::min(2 * P, n - t0);
    for (Index i0 = 0; i0 < G; i0 += Rows) {
      const int M = static_cast<int>(std::min<Index>(Rows, G - i0));
      outer_block_n<T, Rows>(M, q + i0 * q_stride, q_stride, dk, packed, count,
                             logits + i0 * ld + t0, ld, add);
    }
  }
}
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
#endif

#if defined(EIGEN_VECTORIZE_AVX512)
// Four query rows against shared fp32 rows one token at a time, each token's row read
// front to back: the score (its query packets held in registers, the 4 sums reduced
// together by sum_rows) and the weighted sum of values (accumulators held in registers,
// up to 6 packets per row, the rest in the caller's accumulator rows, which stay in L1).
// The register blocks (score_rows_lanes: 6 tokens side by side, a line of each in turn;
// accumulate_span: 16-token blocks in two column halves of 4 packets) read the same
// bytes in an order that streams worse from memory. Measured on the real driver (GQA, 4
// rows x 128, L = 65536, one thread, the variants alternating step by step in one
// process against a read pass of the same bytes, Zen 5): the score pass 0.82-0.87 of
// the read pass against 0.68-0.76, the value pass 0.81-0.86 against 0.65-0.76; alone,
// over a cold block, the values 0.91-1.16 against 0.77-0.86, a plain loop reading one row
// after the other as fast as the read pass where rows side by side took 1.3x as long.
// Hot, both are slower than the blocks (score 10.4 against 9.0 ns per token, values 8.2-
// 9.2 against 6.3), so they are for a decode step that streams its cache.
//
// The score takes the sums of four tokens together (fold_rows4 per token, then
// sum_folded4: 16 sums from one in-block transpose instead of four lane reductions and
// sixteen scalar stores). bf16 rows in pairs, 4 rows x 128, AVX-512 (Zen 5), one thread:
// kernel-only, 64 tokens in L1, 6.3-6.6 ns per token against 7.6-8.0; the score pass of
// 8 KV groups as gqa.hpp runs it (its prefetches, 1024-token tiles), 2 MiB of keys in
// cache, 67.6-68.0 ns per token against 73-75, L = 16384 over cold caches 74-83 against
// 79-99 (faster in 8 of 8 alternating pairs). The loop over the four tokens stays
// rolled (KVATTN_NO_UNROLL): unrolled, GCC's kernel ran 6.0 ns per token hot, but its
// cold score pass took 91-134 ns per token where the old kernel took 76-97; a loop of
// two copies measured as the rolled one. Whole steps: docs/benchmarks.md, "GQA's 4-row
// score".
inline constexpr int kTokenRowsHeld = 24;  // packets of queries or accumulators held

// Whether G rows of width `width` (dk or dv) against shared S rows take the two kernels
// below: 4 fp32 rows of 1 to 8 whole packets (the measured case, d_h 128; other row
// counts were not measured and keep the blocks). bf16 keys read in pairs take the score
// (paired_rows4_by_token); bf16 values by token measured 0.88-1.12x the 2-row blocks of
// the whole row (slower with two threads) and keep those.
template <class T, class S>
constexpr bool rows4_by_token(Index G, Index width) {
  constexpr Index P = packet_size<T>;
  return std::is_same_v<T, float> && std::is_same_v<S, float> && G == 4 && width >= P &&
         width % P == 0 && width <= 8 * P;
}

// Whether 4 rows of bf16 keys read in pairs, the query in paired order (GQA's bf16
// groups of 4 on AVX-512, DecodeOps::paired_score), take score_rows4_by_token: widths of
// whole pair blocks up to 8 packets. Measured like the fp32 kernels (bf16 GQA, L = 16384
// and 65536, one thread): the score pass 0.72-0.89 of its half of a read pass against
// 0.66-0.79 for the paired 4-token blocks, faster in 9 of 10 runs.
template <class T, class S>
constexpr bool paired_rows4_by_token(Index G, Index width) {
  constexpr Index P = packet_size<T>;
  return paired_rows<T, S>(width) && G == 4 && width <= 8 * P;
}

// logits of rows [0, 4) of q against tokens [0, n) of k, D packets wide (Paired: bf16
// rows read in pairs, D even).
template <class T, class S, int D, bool Paired = false>
void score_rows4_by_token(const T* q, Index q_stride, const S* k, Index k_stride, Index n,
                          T* logits, Index ld, bool add, Prefetcher* prefetch) {
  static_assert(!Paired || D % 2 == 0, "whole pair blocks");
  constexpr Index P = packet_size<T>;
  constexpr int Held = std::min(4, kTokenRowsHeld / D);  // rows past these read q from L1
  Packet<T> held[Held][D];
  KVATTN_UNROLL
  for (int m = 0; m < Held; ++m) {
    KVATTN_UNROLL
    for (int d = 0; d < D; ++d) held[m][d] = ei::ploadu<Packet<T>>(q + m * q_stride + d * P);
  }
  if (prefetch != nullptr) prefetch->plan(n);  // a step per token
  BlockPrefetcher blockwise(prefetch);
  prefetch = blockwise.get();
  // Token t's four dot products, each still spread over a packet's lanes.
  auto products = [&](Index t, Packet<T>* acc) KVATTN_INLINE_LAMBDA {
    if (prefetch != nullptr) prefetch->step();
    const S* row = k + t * k_stride;
    KVATTN_UNROLL
    for (int m = 0; m < 4; ++m) acc[m] = ei::pset1<Packet<T>>(T(0));
    if constexpr (Paired) {
      // bf16 rows in pairs (packet_ops.hpp), the query in paired order: packet d of a
      // pair block multiplies the even-indexed elements, packet d + 1 the odd ones.
      KVATTN_UNROLL
      for (int d = 0; d < D; d += 2) {
        const RawBf16 raw = load_bf16_raw(row + d * P);
        const Packet<T> even = bf16_even(raw), odd = bf16_odd(raw);
        KVATTN_UNROLL
        for (int m = 0; m < Held; ++m) {
          acc[m] = ei::pmadd(held[m][d], even, acc[m]);
          acc[m] = ei::pmadd(held[m][d + 1], odd, acc[m]);
        }
        KVATTN_UNROLL
        for (int m = Held; m < 4; ++m) {
          const T* qm = q + m * q_stride + d * P;
          acc[m] = ei::pmadd(ei::ploadu<Packet<T>>(qm), even, acc[m]);
          acc[m] = ei::pmadd(ei::ploadu<Packet<T>>(qm + P), odd, acc[m]);
        }
      }
    } else {
      KVATTN_UNROLL
      for (int d = 0; d < D; ++d) {
        const Packet<T> kp = load_widened<T>(row + d * P);
        KVATTN_UNROLL
        for (int m = 0; m < Held; ++m) acc[m] = ei::pmadd(held[m][d], kp, acc[m]);
        KVATTN_UNROLL
        for (int m = Held; m < 4; ++m) {
          acc[m] = ei::pmadd(ei::ploadu<Packet<T>>(q + m * q_stride + d * P), kp, acc[m]);
        }
      }
    }
  };
  Index t = 0;
  if constexpr (std::is_same_v<T, float>) {
    // Four tokens' sums taken together (sum_folded4), one 4-token piece of each logits
    // row stored; the loop over the four stays rolled (see the comment above).
    for (; t + 4 <= n; t += 4) {
      __m512 folded[4];
      KVATTN_NO_UNROLL
      for (int b = 0; b < 4; ++b) {
        Packet<T> acc[4];
        products(t + b, acc);
        folded[b] = fold_rows4(acc);
      }
      const __m512 sums = sum_folded4(folded);
      const __m128 pieces[4] = {_mm512_castps512_ps128(sums), _mm512_extractf32x4_ps(sums, 1),
                                _mm512_extractf32x4_ps(sums, 2), _mm512_extractf32x4_ps(sums, 3)};
      KVATTN_UNROLL
      for (int m = 0; m < 4; ++m) {
        T* out = logits + m * ld + t;
        _mm_storeu_ps(out, add ? _mm_add_ps(_mm_loadu_ps(out), pieces[m]) : pieces[m]);
      }
    }
  }
  for (; t < n; ++t) {
    Packet<T> acc[4];
    products(t, acc);
    T sums[4];
    sum_rows<T, 4>(acc, sums);
    KVATTN_UNROLL
    for (int m = 0; m < 4; ++m) {
      T& o = logits[m * ld + t];
      o = add ? o + sums[m] : sums[m];
    }
  }
}

// acc rows [0, 4) (stride acc_stride) += w (stride ld) times tokens [0, n) of v, D
// packets wide.
template <class T, class S, int D>
void accumulate_rows4_by_token(const T* w, Index ld, const S* v, Index v_stride, Index n, T* acc,
                               Index acc_stride, Prefetcher* prefetch) {
  constexpr Index P = packet_size<T>;
  constexpr int Held = std::min(D, kTokenRowsHeld / 4);  // packets per row in registers
  Packet<T> a[4][Held];
  KVATTN_UNROLL
  for (int m = 0; m < 4; ++m) {
    KVATTN_UNROLL
    for (int d = 0; d < Held; ++d) a[m][d] = ei::ploadu<Packet<T>>(acc + m * acc_stride + d * P);
  }
  if (prefetch != nullptr) prefetch->plan(n);  // a step per token
  for (Index t = 0; t < n; ++t) {
    if (prefetch != nullptr) prefetch->step();
    const S* row = v + t * v_stride;
    KVATTN_UNROLL
    for (int d = 0; d < Held; ++d) {
      const Packet<T> vp = load_widened<T>(row + d * P);
      KVATTN_UNROLL
      for (int m = 0; m < 4; ++m) {
        a[m][d] = ei::pmadd(ei::pset1<Packet<T>>(w[m * ld + t]), vp, a[m][d]);
      }
    }
    KVATTN_UNROLL
    for (int d = Held; d < D; ++d) {
      const Packet<T> vp = load_widened<T>(row + d * P);
      KVATTN_UNROLL
      for (int m = 0; m < 4; ++m) {
        T* to = acc + m * acc_stride + d * P;
        ei::pstoreu(to,
                    ei::pmadd(ei::pset1<Packet<T>>(w[m * ld + t]), vp, ei::ploadu<Packet<T>>(to)));
      }
    }
  }
  KVATTN_UNROLL
  for (int m = 0; m < 4; ++m) {
    KVATTN_UNROLL
    for (int d = 0; d < Held; ++d) ei::pstoreu(acc + m * acc_stride + d * P, a[m][d]);
  }
}

// The two kernels with a run-time packet count D in [1, Dmax] (rows4_by_token; Paired:
// the even D of paired_rows4_by_token).
template <class T, class S, bool Paired = false, int Dmax = 8>
void score_rows4_by_token_n(Index D, const T* q, Index q_stride, const S* k, Index k_stride,
                            Index n, T* logits, Index ld, bool add, Prefetcher* prefetch) {
  if constexpr (Dmax >= 1) {
    if (D == Dmax) {
      if constexpr (!Paired || Dmax % 2 == 0) {
        score_rows4_by_token<T, S, Dmax, Paired>(q, q_stride, k, k_stride, n, logits, ld, add,
                                                 prefetch);
      }
    } else {
      score_rows4_by_token_n<T, S, Paired, Dmax - 1>(D, q, q_stride, k, k_stride, n, logits, ld,
                                                     add, prefetch);
    }
  }
}
template <class T, class S, int Dmax = 8>
void accumulate_rows4_by_token_n(Index D, const T* w, Index ld, const S* v, Index v_stride, Index n,
                                 T* acc, Index acc_stride, Prefetcher* prefetch) {
  if constexpr (Dmax >= 1) {
    if (D == Dmax) {
      accumulate_rows4_by_token<T, S, Dmax>(w, ld, v, v_stride, n, acc, acc_stride, prefetch);
    } else {
      accumulate_rows4_by_token_n<T, S, Dmax - 1>(D, w, ld, v, v_stride, n, acc, acc_stride,
                                                  prefetch);
    }
  }
}
#endif

// One accumulate block: acc rows [0, M) x D packets of columns (acc row stride
// acc_stride, w row stride ld, both already offset to the block) over tokens
// [t_begin, t_end) of v (already offset to the block's first column); row m reads
// v + m * seg when Segmented. Packet d sits at column d * P, except the last one, at
// column `last`: the overlapping tail packet of a row when skip > 0 (its first `skip`
// lanes zeroed), so a tail shares a block with full packets instead of running alone
// with too few independent accumulators (LRKV's r = 54: 6 packets + the tail).
template <class T, class S, int M, int D, int Layout, bool Tail>
inline void accumulate_block(const T* w, Index ld, const S* v, Index v_stride, Index seg,
                             Index t_begin, Index t_end, T* acc, Index acc_stride, Index last,
                             Index skip, Prefetcher* prefetch) {
  constexpr bool Segmented = Layout == kSegmented;
  constexpr bool Paired = Layout == kPaired;
  (void)Segmented, (void)Paired;
  constexpr Index P = packet_size<T>;
  // Column of packet d (a compile-time offset but for a tail packet).
  auto column = [last](int d) { return Tail && d == D - 1 ? last : d * P; };
  // The tail's repeated lanes, cleared with one and-not per token.
  Packet<T> repeated = ei::pset1<Packet<T>>(T(0));
  if constexpr (Tail) {
    repeated = ei::pcmp_lt(ei::plset<Packet<T>>(T(0)), ei::pset1<Packet<T>>(static_cast<T>(skip)));
  }
  Packet<T> a[M][D];
  KVATTN_UNROLL
  for (int m = 0; m < M; ++m) {
    KVATTN_UNROLL
    for (int d = 0; d < D; ++d) a[m][d] = ei::ploadu<Packet<T>>(acc + m * acc_stride + column(d));
  }
  for (Index t = t_begin; t < t_end; ++t) {
    if (prefetch != nullptr) prefetch->step();
    const S* vt = v + t * v_stride;
    if constexpr (Segmented) {
      KVATTN_UNROLL
      for (int m = 0; m < M; ++m) {
        const Packet<T> weight = ei::pset1<Packet<T>>(w[m * ld + t]);
        KVATTN_UNROLL
        for (int d = 0; d < D; ++d) {
          Packet<T> vp = load_widened<T>(vt + m * seg + column(d));
          if constexpr (Tail) {
            if (d == D - 1) vp = ei::pandnot(vp, repeated);
          }
          a[m][d] = ei::pmadd(weight, vp, a[m][d]);
        }
      }
    } else if constexpr (Paired) {
      // 16 bf16 columns per load: the even-indexed into packet d, the odd into d + 1
      // (the accumulator row is in paired order; D is even).
#if KVATTN_PAIRED_BF16  // the intrinsics below exist only in AVX2 and AVX-512 builds
      if constexpr (kHavePairedBf16 && std::is_same_v<S, Eigen::bfloat16> && 2 * P == kPairBlock &&
                    D % 2 == 0) {
        Packet<T> weight[M];
        KVATTN_UNROLL
        for (int m = 0; m < M; ++m) weight[m] = ei::pset1<Packet<T>>(w[m * ld + t]);
        KVATTN_UNROLL
        for (int d = 0; d < D; d += 2) {
          const RawBf16 raw = load_bf16_raw(vt + d * P);
          Packet<T> even = bf16_even(raw);
          if constexpr (M > 1) keep_in_register(even);
          KVATTN_UNROLL
          for (int m = 0; m < M; ++m) a[m][d] = ei::pmadd(weight[m], even, a[m][d]);
          Packet<T> odd = bf16_odd(raw);
          if constexpr (M > 1) keep_in_register(odd);
          KVATTN_UNROLL
          for (int m = 0; m < M; ++m) a[m][d + 1] = ei::pmadd(weight[m], odd, a[m][d + 1]);
        }
      }
#endif
    } else {
      Packet<T> weight[M];
      KVATTN_UNROLL
      for (int m = 0; m < M; ++m) weight[m] = ei::pset1<Packet<T>>(w[m * ld + t]);
      // One value packet live at a time, used by every row (M + 1 + M * D registers).
      KVATTN_UNROLL
      for (int d = 0; d < D; ++d) {
        Packet<T> vp = load_widened<T>(vt + column(d));
        if constexpr (Tail) {
          if (d == D - 1) vp = ei::pandnot(vp, repeated);
        }
        if constexpr (M > 1) keep_in_register(vp);
        KVATTN_UNROLL
        for (int m = 0; m < M; ++m) a[m][d] = ei::pmadd(weight[m], vp, a[m][d]);
      }
    }
  }
  // The last packet first: when it is an overlapping tail, its repeated lanes hold the
  // accumulators as loaded, and the previous packet's store must win there.
  KVATTN_UNROLL
  for (int m = 0; m < M; ++m) {
    ei::pstoreu(acc + m * acc_stride + column(D - 1), a[m][D - 1]);
    KVATTN_UNROLL
    for (int d = 0; d < D - 1; ++d) ei::pstoreu(acc + m * acc_stride + column(d), a[m][d]);
  }
}

// accumulate_block with a run-time D in [1, Dmax] (the compile-time widths it dispatches
// to); skip > 0 makes packet D - 1 an overlapping tail at column `last`.
template <class T, class S, int M, int Layout, int Dmax>
inline void accumulate_block_n(int D, const T* w, Index ld, const S* v, Index v_stride, Index seg,
                               Index t_begin, Index t_end, T* acc, Index acc_stride, Index last,
                               Index skip, Prefetcher* prefetch) {
  constexpr bool Segmented = Layout == kSegmented;
  constexpr bool Paired = Layout == kPaired;
  (void)Segmented, (void)Paired;
  if constexpr (Dmax >= 1) {
    if (D == Dmax) {
      if (skip > 0) {
        accumulate_block<T, S, M, Dmax, Layout, true>(w, ld, v, v_stride, seg, t_begin, t_end, acc,
                                                      acc_stride, last, skip, prefetch);
      } else {
        accumulate_block<T, S, M, Dmax, Layout, false>(w, ld, v, v_stride, seg, t_begin, t_end, acc,
                                                       acc_stride, last, 0, prefetch);
      }
    } else {
      accumulate_block_n<T, S, M, Layout, Dmax - 1>(D, w, ld, v, v_stride, seg, t_begin, t_end, acc,
                                                    acc_stride, last, skip, prefetch);
    }
  }
}

// Column blocks accumulate_span cuts dv (>= P) into: the packets of a row (the
// overlapping tail one included) in blocks of equal width, at most
// kBlockAccumulators / M, so no block is left with too few independent accumulators to
// cover the FMA latency.
template <class T>
inline Index accumulate_column_blocks(int M, Index dv) {
  constexpr Index P = packet_size<T>;
  const Index packets = (dv + P - 1) / P;
  const Index Dmax = kBlockAccumulators / M;
  return (packets + Dmax - 1) / Dmax;
}

// Every column of rows [0, M) over tokens [t_begin, t_end).
template <class T, class S, int M, int Layout>
inline void accumulate_span(const T* w, Index ld, const S* v, Index v_stride, Index seg, Index dv,
                            Index t_begin, Index t_end, T* acc, Index acc_stride,
                            Prefetcher* prefetch) {
  constexpr bool Segmented = Layout == kSegmented;
  constexpr bool Paired = Layout == kPaired;
  (void)Segmented, (void)Paired;
  constexpr Index P = packet_size<T>;
  constexpr int Dmax = kBlockAccumulators / M;
  const Index packets = (dv + P - 1) / P;  // the last one overlaps when P does not divide dv
  const Index blocks = accumulate_column_blocks<T>(M, dv);
  Index width = (packets + blocks - 1) / blocks;
  if constexpr (Paired) width += width % 2;  // whole pairs (packets is even)
  Index d0 = 0;
  for (Index left = packets; left > 0;) {
    const int D = static_cast<int>(std::min(width, left));
    left -= D;
    // The block's last packet: the row's overlapping tail in the final block.
    const bool tail = left == 0 && dv % P != 0;
    const Index last = tail ? dv - P - d0 : (D - 1) * P;
    const Index skip = tail ? P - dv % P : 0;
    accumulate_block_n<T, S, M, Layout, Dmax>(D, w, ld, v + d0, v_stride, seg, t_begin, t_end,
                                              acc + d0, acc_stride, last, skip, prefetch);
    d0 += D * P;
  }
}

// Query rows per accumulate block: block_rows, or 8 (`eight`) on AVX-512 for float value
// rows at least kEightRowsWidth wide that every row shares (MLA's latent): 8 rows x 2
// packets (16 accumulators, 8 broadcast weights and a value packet live) load each value
// packet once per 8 FMAs instead of 4, and re-read the value tile, which does not stay in
// L1 beside everything else, from L2 half as often. Kernel-only, hot, Zen 5: MLA's 16 rows
// x 512 fp32 104 ns per token against 122 for 4 x 4; where the tile is narrow or bf16 the
// extra broadcasts cost more than the loads saved (MQA's 32 x 128 fp32 54.6 against 52,
// MLA's bf16 92.5 against 88), so those keep 4 rows. The width threshold lies between those
// two measured widths (128 slower, 512 faster); 256 itself was not measured, nor any other
// 32-register ISA (AArch64 keeps 4 rows).
#if defined(EIGEN_VECTORIZE_AVX512)
inline constexpr bool kEightRowBlocks = true;
#else
inline constexpr bool kEightRowBlocks = false;
#endif
inline constexpr Index kEightRowsWidth = 256;
//
// Or 2 (`whole`, decided by accumulate_rows): for 4 rows of bf16 values on 32-register
// ISAs whose row is too wide for one 4-row block but fits a 2-row one (5 to 8 packets,
// d_h 65-128 on AVX-512). A 4-row block then reads each token block's rows in two column
// halves, a line of each row in turn; 2-row blocks of the whole width read them front to
// back in the first block and from L1 (small token blocks) in the second. Measured on
// the real driver over cold caches (AVX-512, Zen 5, GQA, 4 rows x 128, both kernels on
// the same cache, alternating, L = 65536): the value pass alone 0.93-1.02 of a read pass
// against 0.75-0.86, the decode step 0.65-0.85 against 0.65-0.81, faster in 14 of 15
// pairs (median +3%); fp32 values, alone 0.92-0.96 against 0.84-0.87, made the step 1-6%
// slower, and keep 4-row blocks. (2 and 3 rows take 2-row blocks anyway.)
// bf16 rows of whole pair blocks (d_h 64, 96, 128 on AVX-512) are read in pairs instead
// (kPaired, 4-row blocks): in pairs, whole 2-row blocks measured no faster (GQA, L = 16384
// and 65536, one thread: 0.98-1.02x).
constexpr int accumulate_block_rows(Index left, bool eight, bool whole = false) {
  if (whole) return left >= 2 ? 2 : 1;
  return kEightRowBlocks && eight && left >= 8 ? 8 : block_rows(left);
}

template <class T, class S, int Layout>
void accumulate_rows(const T* w, Index ld, Index G, const S* v, Index v_stride, Index seg, Index dv,
                     Index n, T* acc, Index acc_stride, Index token_block, Prefetcher* prefetch) {
  constexpr bool Segmented = Layout == kSegmented;
  constexpr bool Paired = Layout == kPaired;
  (void)Segmented, (void)Paired;
  const Index block = token_block > 0 ? token_block : n;
  // 8-row blocks: instantiated only where they may be taken, taken for wide rows.
  constexpr bool EightRows = kEightRowBlocks && !Segmented && std::is_same_v<S, T>;
  const bool eight = EightRows && dv >= kEightRowsWidth;
  constexpr bool WholeRows = many_registers && Layout == kShared && std::is_same_v<T, float> &&
                             std::is_same_v<S, Eigen::bfloat16>;
  const Index packets = (dv + packet_size<T> - 1) / packet_size<T>;
  const bool whole =
      WholeRows && G == 4 && packets > kBlockAccumulators / 4 && packets <= kBlockAccumulators / 2;
  if (prefetch != nullptr) {
    Index column_blocks = 0;
    for (Index i0 = 0; i0 < G; i0 += accumulate_block_rows(G - i0, eight, whole)) {
      column_blocks += accumulate_column_blocks<T>(accumulate_block_rows(G - i0, eight, whole), dv);
    }
    prefetch->plan(column_blocks * n);  // one step per token of every block
  }
  for (Index t0 = 0; t0 < n; t0 += block) {
    const Index t_end = std::min(n, t0 + block);
    for (Index i0 = 0; i0 < G;) {
      const int M = accumulate_block_rows(G - i0, eight, whole);
      const T* wi = w + i0 * ld;
      const S* vi = Segmented ? v + i0 * seg : v;
      T* ai = acc + i0 * acc_stride;
      if constexpr (EightRows) {
        if (M == 8) {
          accumulate_span<T, S, 8, Layout>(wi, ld, vi, v_stride, seg, dv, t0, t_end, ai, acc_stride,
                                           prefetch);
          i0 += M;
          continue;
        }
      }
      if (M == 4) {
        accumulate_span<T, S, 4, Layout>(wi, ld, vi, v_stride, seg, dv, t0, t_end, ai, acc_stride,
                                         prefetch);
      } else if (M == 2) {
        accumulate_span<T, S, 2, Layout>(wi, ld, vi, v_stride, seg, dv, t0, t_end, ai, acc_stride,
                                         prefetch);
      } else {
        accumulate_span<T, S, 1, Layout>(wi, ld, vi, v_stride, seg, dv, t0, t_end, ai, acc_stride,
                                         prefetch);
      }
      i0 += M;
    }
  }
}

}  // namespace kernels

/// logits[i * ld + t] (+)= q_i . k_t,i for i < G, t < n: q_i = q + i * q_stride (dk
/// wide), k_t,i = k + t * k_stride + i * seg (storage S; seg = 0: every row reads the
/// same keys). With `add` the logits are added to. `prefetch` (optional) is stepped
/// along the way (see Prefetcher) and finished at the end. `second` (optional) adds a
/// second, per-row dot product into the same logits (see SecondDot). `paired`: the rows
/// are read in pairs (packet_ops.hpp), and q is in paired order; only where
/// paired_rows<T, S>(dk) and seg == 0.
template <class T, class S>
void score_rows(const T* q, Index q_stride, Index G, Index dk, const S* k, Index k_stride,
                Index seg, Index n, T* logits, Index ld, bool add, Prefetcher* prefetch = nullptr,
                const std::type_identity_t<SecondDot<T>>* second = nullptr, bool paired = false) {
  constexpr Index P = packet_size<T>;
  if constexpr (kHavePairedBf16 && std::is_same_v<T, float> && std::is_same_v<S, Eigen::bfloat16>) {
    if (paired && paired_rows<T, S>(dk) && seg == 0) {
      const bool narrow = second != nullptr && second->dk < P;
      if (n > 0 && G > 0) {
#if defined(EIGEN_VECTORIZE_AVX512)
        if (second == nullptr && kernels::paired_rows4_by_token<T, S>(G, dk)) {
          kernels::score_rows4_by_token_n<T, S, true>(dk / P, q, q_stride, k, k_stride, n, logits,
                                                      ld, add, prefetch);
          if (prefetch != nullptr) prefetch->finish();
          return;
        }
#endif
        if (second == nullptr && kernels::score_by_token<T, S>(G)) {
          kernels::score_rows_by_token<T, S, kernels::kPaired>(G, q, q_stride, dk, k, k_stride, n,
                                                               logits, ld, add, prefetch);
        } else {
          kernels::score_rows<T, S, kernels::kPaired>(q, q_stride, G, dk, k, k_stride, 0, n, logits,
                                                      ld, add, prefetch, narrow ? nullptr : second);
        }
      }
      if (prefetch != nullptr) prefetch->finish();
      if (narrow) {
        score_rows(second->q, second->q_stride, G, second->dk, k + second->offset, k_stride,
                   second->seg, n, logits, ld, true);
      }
      return;
    }
  }
  (void)paired;
  if (second != nullptr && (dk < P || second->dk < P || seg != 0)) {
    // Narrow parts: the two dot products one after the other.
    score_rows(q, q_stride, G, dk, k, k_stride, seg, n, logits, ld, add, prefetch);
    score_rows(second->q, second->q_stride, G, second->dk, k + second->offset, k_stride,
               second->seg, n, logits, ld, true);
    return;
  }
  if (n > 0 && G > 0) {
    if (dk < P) {  // too narrow for a packet: plain dot products
      for (Index i = 0; i < G; ++i) {
        for (Index t = 0; t < n; ++t) {
          const S* kt = k + t * k_stride + i * seg;
          T s(0);
          for (Index j = 0; j < dk; ++j) s += q[i * q_stride + j] * static_cast<T>(kt[j]);
          T& o = logits[i * ld + t];
          o = add ? o + s : s;
        }
      }
    } else if (seg != 0) {
      kernels::score_rows<T, S, kernels::kSegmented>(q, q_stride, G, dk, k, k_stride, seg, n,
                                                     logits, ld, add, prefetch, nullptr);
    } else {
#if defined(EIGEN_VECTORIZE_AVX512)
      if (second == nullptr && kernels::rows4_by_token<T, S>(G, dk)) {
        kernels::score_rows4_by_token_n<T, S>(dk / P, q, q_stride, k, k_stride, n, logits, ld, add,
                                              prefetch);
        if (prefetch != nullptr) prefetch->finish();
        return;
      }
      if (second == nullptr && kernels::outer_score<T>(G, dk)) {
        kernels::score_rows_outer<T, S>(q, q_stride, G, dk, k, k_stride, n, logits, ld, add,
                                        prefetch);
        if (prefetch != nullptr) prefetch->finish();
        return;
      }
#endif
      if constexpr (kernels::any_score_by_token<T, S>) {
        if (second == nullptr && kernels::score_by_token<T, S>(G)) {
          kernels::score_rows_by_token<T, S, kernels::kShared>(G, q, q_stride, dk, k, k_stride, n,
                                                               logits, ld, add, prefetch);
          if (prefetch != nullptr) prefetch->finish();
          return;
        }
      }
      kernels::score_rows<T, S, kernels::kShared>(q, q_stride, G, dk, k, k_stride, 0, n, logits, ld,
                                                  add, prefetch, second);
    }
  }
  if (prefetch != nullptr) prefetch->finish();
}

/// acc_i += sum_t w[i * ld + t] v_t,i for i < G, t < n: v_t,i = v + t * v_stride +
/// i * seg (dv wide, storage S), acc row i at acc + i * acc_stride. The tokens are taken
/// `token_block` at a time (0: all n at once): inside a block every row's accumulators
/// stay in registers while the block's value rows stream by, so a small block (16)
/// keeps the tile's reading order front to back for a memory-bound step, and the whole
/// tile (0) loads and stores each accumulator once per tile for a compute-bound one.
///
/// `paired`: the rows are read in pairs (packet_ops.hpp) and the accumulator rows are in
/// paired order (from_paired restores it); only where paired_rows<T, S>(dv), seg == 0.
template <class T, class S>
void accumulate_rows(const T* w, Index ld, Index G, const S* v, Index v_stride, Index seg, Index dv,
                     Index n, T* acc, Index acc_stride, Index token_block = 0,
                     Prefetcher* prefetch = nullptr, bool paired = false) {
  if constexpr (kHavePairedBf16 && std::is_same_v<T, float> && std::is_same_v<S, Eigen::bfloat16>) {
    if (paired && paired_rows<T, S>(dv) && seg == 0) {
      if (n > 0 && G > 0) {
        kernels::accumulate_rows<T, S, kernels::kPaired>(w, ld, G, v, v_stride, 0, dv, n, acc,
                                                         acc_stride, token_block, prefetch);
      }
      if (prefetch != nullptr) prefetch->finish();
      return;
    }
  }
  (void)paired;
  if (n > 0 && G > 0) {
    if (dv < packet_size<T>) {
      for (Index i = 0; i < G; ++i) {
        for (Index t = 0; t < n; ++t) {
          const T weight = w[i * ld + t];
          const S* vt = v + t * v_stride + i * seg;
          for (Index j = 0; j < dv; ++j) acc[i * acc_stride + j] += weight * static_cast<T>(vt[j]);
        }
      }
    } else if (seg != 0) {
      kernels::accumulate_rows<T, S, kernels::kSegmented>(w, ld, G, v, v_stride, seg, dv, n, acc,
                                                          acc_stride, token_block, prefetch);
    } else {
#if defined(EIGEN_VECTORIZE_AVX512)
      if (kernels::rows4_by_token<T, S>(G, dv)) {  // (the whole tile by token: no token_block)
        kernels::accumulate_rows4_by_token_n<T, S>(dv / packet_size<T>, w, ld, v, v_stride, n, acc,
                                                   acc_stride, prefetch);
        if (prefetch != nullptr) prefetch->finish();
        return;
      }
#endif
      kernels::accumulate_rows<T, S, kernels::kShared>(w, ld, G, v, v_stride, 0, dv, n, acc,
                                                       acc_stride, token_block, prefetch);
    }
  }
  if (prefetch != nullptr) prefetch->finish();
}

}  // namespace kvattn::detail
