// The shared-key score with the query rows in the lanes: logits[i * ld + t] = q_i . k_t
// for G query rows that all read the same cached rows (MLA's heads against the latent
// rows [c_t | k_R,t]), float queries against fp32 or bf16 rows, on AVX-512.
//
// Shapes (rows are tokens): token t's key at rows + t * stride, dk elements, t < n. The
// queries come transposed: element (j, i) = q_i[j] at query_t[j * qt_stride + i]
// (qt_stride >= G), G a multiple of 16. Output: logits[i * ld + t] for i < G, t < n;
// the columns up to n rounded up to 16 are written too (with garbage), so ld >= that.
//
// Why: score_rows (decode_kernels.hpp) takes the rows 4 at a time against 6 tokens and
// ends every (row, token) sum with a reduction across lanes; each block of 4 rows reads
// the whole tile again. Here each key element, broadcast (a memory operand of the FMA
// for fp32 rows; one 32-bit broadcast widened into two elements for bf16), multiplies a
// packet of 16 rows' query elements, two packets per broadcast when G >= 32, and no sum
// is reduced: the sums come out token-major, a packet of rows per token, and a 16 x 16
// transpose per 16 rows and 16 tokens writes them row-major as the softmax reads them.
// The same scheme as lrkv_score's shared part (lrkv_kernels.hpp). Kernel-only, 64-token
// tiles in L2 or L3, against score_rows as MLA called it (Zen 5): 16 rows x 576
// (DeepSeek-V2-Lite) 1.15-1.26x faster in fp32 and 1.19-1.23x in bf16, 128 x 576 (V2)
// 1.19-1.22x. Stepping a prefetch range once per pair of key elements, as a first
// version did, cost the whole gain (the step's bookkeeping in the inner loop): it steps
// once per kStepPairs pairs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvattn/core/types.hpp"
#include "kvattn/detail/packet_ops.hpp"

namespace kvattn::detail {

#if defined(EIGEN_VECTORIZE_AVX512)
inline constexpr bool kHaveTransposedScore = true;
#else
inline constexpr bool kHaveTransposedScore = false;
#endif

/// Whether this build has score_transposed for T queries against S rows (AVX-512, float
/// queries, fp32 or bf16 rows): callers test it with `if constexpr`, since elsewhere the
/// kernel is declared but not defined.
template <class T, class S>
constexpr bool transposed_score_for() {
  if (!kHaveTransposedScore || !std::is_same_v<T, float>) return false;
  return std::is_same_v<S, float> || std::is_same_v<S, Eigen::bfloat16>;
}
template <class T, class S>
inline constexpr bool transposed_score_types = transposed_score_for<T, S>();

/// Whether score_transposed takes G rows: transposed_score_types and G a positive
/// multiple of 16 (whole packets of rows, no lanes of padding).
template <class T, class S>
constexpr bool transposed_score(Index G) {
  return transposed_score_types<T, S> && G > 0 && G % 16 == 0;
}

/// query_t[j * qt_stride + i] = q_i[j] for i < G, j < dk (q_i at q + i * q_stride).
template <class T>
void transpose_queries(const T* q, Index q_stride, Index G, Index dk, T* query_t, Index qt_stride) {
  for (Index i = 0; i < G; ++i) {
    for (Index j = 0; j < dk; ++j) query_t[j * qt_stride + i] = q[i * q_stride + j];
  }
}

#if defined(EIGEN_VECTORIZE_AVX512)

#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored \
    "-Wignored-attributes"  // PacketBlock<Packet<T>, P>: see packet_ops.hpp
#endif

namespace transposed {

// Key elements j and j + 1 of a row, each broadcast to a whole packet.
EIGEN_ALWAYS_INLINE void key_pair(const float* row, Index j, Packet<float>& k0, Packet<float>& k1) {
  k0 = ei::pset1<Packet<float>>(row[j]);
  k1 = ei::pset1<Packet<float>>(row[j + 1]);
}
// bf16: one 32-bit broadcast holds both (low half j, high half j + 1), widened by a
// shift and a mask.
EIGEN_ALWAYS_INLINE void key_pair(const Eigen::bfloat16* row, Index j, Packet<float>& k0,
                                  Packet<float>& k1) {
  std::int32_t both;
  std::memcpy(&both, row + j, sizeof both);
  const RawBf16 raw = _mm512_set1_epi32(both);
  k0 = bf16_even(raw);
  k1 = bf16_odd(raw);
}

}  // namespace transposed

/// See the header comment; requires transposed_score<T, S>(G). `prefetch` (optional) is
/// stepped once per kStepPairs pairs of key elements of each register block and finished
/// at the end.
template <class T, class S>
void score_transposed(const T* query_t, Index qt_stride, Index G, Index dk, const S* rows,
                      Index stride, Index n, T* logits, Index ld, Prefetcher* prefetch = nullptr) {
  static_assert(std::is_same_v<T, float>, "float queries (transposed_score)");
  using Pk = Packet<float>;
  constexpr Index P = 16;
  static_assert(packet_size<float> == P, "AVX-512 packets");
  // Tokens per register block: 2 x 8 accumulators (two packets of rows, or the even and
  // the odd key elements of one packet), 4 query packets, 2 keys: 22 of 32 registers.
  constexpr int TB = 8;
  const Index pairs = dk / 2;
  // Prefetch steps: one per kStepPairs pairs of key elements (a step per pair cost the
  // kernel 18% in the kernel-only benchmark with a prefetch range, score_rows 9%).
  constexpr Index kStepPairs = 8;
  if (prefetch != nullptr) {
    const Index blocks = (n + TB - 1) / TB;
    const Index passes = (G / P + 1) / 2;
    prefetch->plan(blocks * passes * ((pairs + kStepPairs - 1) / kStepPairs));
  }
  for (Index t0 = 0; t0 < n; t0 += P) {
    for (Index c0 = 0; c0 < G; c0 += 2 * P) {
      const bool two = c0 + P < G;  // two packets of rows in this pass
      Pk sums[2][P];
      for (Index b0 = 0; b0 < P; b0 += TB) {
        Pk acc0[TB], acc1[TB];
        KVATTN_UNROLL
        for (int b = 0; b < TB; ++b) acc0[b] = acc1[b] = ei::pset1<Pk>(0.0f);
        if (t0 + b0 < n) {
          // Tokens past n re-read the last one (never memory past the tile); their sums
          // land in the columns past n.
          const S* row[TB];
          KVATTN_UNROLL
          for (int b = 0; b < TB; ++b) row[b] = rows + std::min(t0 + b0 + b, n - 1) * stride;
          BlockPrefetcher block_prefetch(prefetch);
          Prefetcher* pf = block_prefetch.get();
          const T* q = query_t + c0;
          if (two) {
            for (Index p = 0; p < pairs; ++p, q += 2 * qt_stride) {
              if (pf != nullptr && p % kStepPairs == 0) pf->step();
              const Pk q0 = ei::ploadu<Pk>(q), q1 = ei::ploadu<Pk>(q + P);
              const Pk q0_next = ei::ploadu<Pk>(q + qt_stride);
              const Pk q1_next = ei::ploadu<Pk>(q + qt_stride + P);
              KVATTN_UNROLL
              for (int b = 0; b < TB; ++b) {
                Pk k, k_next;
                transposed::key_pair(row[b], 2 * p, k, k_next);
                acc0[b] = ei::pmadd(k, q0, acc0[b]);
                acc1[b] = ei::pmadd(k, q1, acc1[b]);
                acc0[b] = ei::pmadd(k_next, q0_next, acc0[b]);
                acc1[b] = ei::pmadd(k_next, q1_next, acc1[b]);
              }
            }
          } else {
            // One packet of rows: the even elements into acc0, the odd into acc1 (two
            // independent chains per token), added at the end.
            for (Index p = 0; p < pairs; ++p, q += 2 * qt_stride) {
              if (pf != nullptr && p % kStepPairs == 0) pf->step();
              const Pk q0 = ei::ploadu<Pk>(q), q0_next = ei::ploadu<Pk>(q + qt_stride);
              KVATTN_UNROLL
              for (int b = 0; b < TB; ++b) {
                Pk k, k_next;
                transposed::key_pair(row[b], 2 * p, k, k_next);
                acc0[b] = ei::pmadd(k, q0, acc0[b]);
                acc1[b] = ei::pmadd(k_next, q0_next, acc1[b]);
              }
            }
          }
          if (dk % 2 != 0) {  // the last key element alone
            const Index j = dk - 1;
            const Pk q0 = ei::ploadu<Pk>(q);
            const Pk q1 = two ? ei::ploadu<Pk>(q + P) : q0;
            KVATTN_UNROLL
            for (int b = 0; b < TB; ++b) {
              const Pk k = ei::pset1<Pk>(static_cast<float>(row[b][j]));
              acc0[b] = ei::pmadd(k, q0, acc0[b]);
              if (two) acc1[b] = ei::pmadd(k, q1, acc1[b]);
            }
          }
          if (!two) {
            KVATTN_UNROLL
            for (int b = 0; b < TB; ++b) acc0[b] = ei::padd(acc0[b], acc1[b]);
          }
        }
        KVATTN_UNROLL
        for (int b = 0; b < TB; ++b) {
          sums[0][b0 + b] = acc0[b];
          sums[1][b0 + b] = acc1[b];
        }
      }
      for (int c = 0; c < (two ? 2 : 1); ++c) {
        ei::PacketBlock<Pk, static_cast<int>(P)> block;
        KVATTN_UNROLL
        for (Index b = 0; b < P; ++b) block.packet[b] = sums[c][b];
        ei::ptranspose(block);
        T* out = logits + (c0 + c * P) * ld + t0;
        KVATTN_UNROLL
        for (Index m = 0; m < P; ++m) ei::pstoreu(out + m * ld, block.packet[m]);
      }
    }
  }
  if (prefetch != nullptr) prefetch->finish();
}

#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

#else

// Declared for callers' discarded `if constexpr (transposed_score_types<T, S>)` branches
// (false in this build); never defined.
template <class T, class S>
void score_transposed(const T* query_t, Index qt_stride, Index G, Index dk, const S* rows,
                      Index stride, Index n, T* logits, Index ld, Prefetcher* prefetch = nullptr);

#endif

}  // namespace kvattn::detail
