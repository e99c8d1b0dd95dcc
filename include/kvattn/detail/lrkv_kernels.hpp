// LRKV's decode score kernels (attention/lrkv.hpp, DecodeOps): every head's logits
// against a tile of cached key rows [k~_s | r~_1 ... r~_H | ...], the shared part and
// each head's residual slice in one pass over each row. lrkv_score in float (below);
// lrkv_score_bf16_dot on bf16 rows with a query rounded to bf16 (DecodeArithmetic::
// bf16_dot, AVX512-BF16 builds), the same blocks in its own layouts (see its comment).
//
// Shapes (rows are tokens): token t's key row at rows + t * stride, t < n; the shared
// part k~_s,t is its first d_h elements, head h's residual r~_h,t the r elements at
// d_h + h * r. query_t is the shared queries transposed, d_h x hp (hp: H rounded up to
// whole packets, the padding heads zero), element (j, h) = q_h[j]; query_latent is
// H x r, row h = q~_h. Output: logits[h * ld + t] = q_h . k~_s,t + q~_h . r~_h,t for
// h < H, t < n (columns up to n rounded up to a packet are written too, with garbage).
//
// Why not score_rows (decode_kernels.hpp): there every register block of 4 heads
// re-reads the shared key and reduces each (head, token) sum across lanes, which makes
// the shared part, 32 heads against one 128-wide row, the costliest part of the step
// (an MQA inside every LRKV step). Here the shared part is a small GEMM with the heads
// in the lanes: one broadcast key element times one packet of P heads' query elements
// per FMA, no lane reduction. The shared sums come out token-major (a packet of heads
// per token); a P x P transpose per block of P heads and P tokens turns them head-major,
// as the softmax reads them. Then each head's residual dot products against the block's
// P tokens: one packet of q~_h loaded once and multiplied into P accumulators (one per
// token, P independent FMA chains), and the P sums reduced across lanes into one packet
// of the head's logits row. (Per token and head instead, as this kernel did first, q~_h
// was reloaded for every token and the 4-FMA chain of one dot product ran alone: the
// residual part took 2/3 of the kernel's time on cached rows.)
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvattn/core/simd.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/detail/bf16_dot_kernels.hpp"
#include "kvattn/detail/packet_ops.hpp"

namespace kvattn::detail {

#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored \
    "-Wignored-attributes"  // PacketBlock<Packet<T>, P>: see packet_ops.hpp
#endif

/// See the header comment; requires r >= packet_size<T>. `prefetch` (optional) is stepped
/// once per shared-key element of each block of tokens and finished at the end.
template <class T, class S>
void lrkv_score(const T* query_t, Index hp, const T* query_latent, Index H, Index dh, Index r,
                const S* rows, Index stride, Index n, T* logits, Index ld,
                Prefetcher* prefetch = nullptr) {
  using Pk = Packet<T>;
  constexpr Index P = packet_size<T>;
  // Tokens per register block of the shared part: 2 x TB accumulators (two packets of
  // heads), enough independent FMA chains to cover the latency.
  constexpr int TB = P >= 8 ? 8 : static_cast<int>(P);
  const Index full = r / P * P;
  const Index skip = full < r ? P - (r - full) : 0;
  // The last packet of a slice ends at the slice's end: `back` bytes from where the
  // full packets leave the rows; its first `skip` lanes, already summed, are zeroed.
  const Index back = (r - P - full) * Index(sizeof(S));
  const Index row_bytes = stride * Index(sizeof(S));
#if defined(EIGEN_VECTORIZE_AVX512)
  constexpr bool key_pairs = std::is_same_v<S, Eigen::bfloat16> && std::is_same_v<T, float>;
#else
  constexpr bool key_pairs = false;
#endif
  if (prefetch != nullptr) {
    const Index token_blocks = (n + TB - 1) / TB;
    const Index head_pairs = (hp / P + 1) / 2;
    const Index shared_steps = key_pairs ? (dh + 1) / 2 : dh;
    // One step per shared-key element (or pair) of each block and per residual dot
    // product: the prefetches spread over the whole pass, not bunched into its shared part.
    prefetch->plan(token_blocks * head_pairs * shared_steps + (n + P - 1) / P * H * (full / P));
  }
  for (Index t0 = 0; t0 < n; t0 += P) {
    for (Index c0 = 0; c0 < hp; c0 += 2 * P) {
      const bool pair = c0 + P < hp;  // two packets of heads in this pass
      // The shared part: sums[c][b] = heads [c0 + c P, +P) against token t0 + b.
      Pk sums[2][P];
      for (Index b0 = 0; b0 < P; b0 += TB) {
        Pk acc0[TB], acc1[TB];
        KVATTN_UNROLL
        for (int b = 0; b < TB; ++b) acc0[b] = acc1[b] = ei::pset1<Pk>(T(0));
        const Index block_rows = std::min<Index>(TB, n - t0 - b0);
        // Rows past n are not read: their sums stay zero (the columns past n are garbage).
        auto shared = [&](auto all_rows) {
          StridedRows<TB> in(rows + (t0 + b0) * stride, row_bytes, block_rows);
          const T* q = query_t + c0;
          Index j = 0;
#if defined(EIGEN_VECTORIZE_AVX512)
          if constexpr (key_pairs) {
            // bf16 keys two elements at a time: one 32-bit broadcast holds k_j (low half)
            // and k_j+1 (high half) in every lane, widened by a shift and a mask (3
            // operations per 2 elements, where a scalar widen and broadcast took 4 per
            // element; kernel-only, 32 heads, 64 hot tokens: 90 -> 82 ns per token).
            for (; j + 1 < dh; j += 2, q += 2 * hp, in.advance(2 * sizeof(S))) {
              if (prefetch != nullptr) prefetch->step();
              const Pk q0 = ei::ploadu<Pk>(q);
              const Pk q1 = pair ? ei::ploadu<Pk>(q + P) : q0;
              const Pk q0_next = ei::ploadu<Pk>(q + hp);
              const Pk q1_next = pair ? ei::ploadu<Pk>(q + hp + P) : q0_next;
              KVATTN_UNROLL
              for (int b = 0; b < TB; ++b) {
                if (all_rows || b < block_rows) {
                  std::int32_t both;
                  std::memcpy(&both, in.template row<S>(b), sizeof both);
                  const RawBf16 raw = _mm512_set1_epi32(both);
                  const Pk k = bf16_even(raw), k_next = bf16_odd(raw);
                  acc0[b] = ei::pmadd(k, q0, acc0[b]);
                  acc1[b] = ei::pmadd(k, q1, acc1[b]);
                  acc0[b] = ei::pmadd(k_next, q0_next, acc0[b]);
                  acc1[b] = ei::pmadd(k_next, q1_next, acc1[b]);
                }
              }
            }
          }
#endif
          for (; j < dh; ++j, q += hp, in.advance(sizeof(S))) {
            if (prefetch != nullptr) prefetch->step();
            const Pk q0 = ei::ploadu<Pk>(q);
            const Pk q1 = pair ? ei::ploadu<Pk>(q + P) : q0;
            KVATTN_UNROLL
            for (int b = 0; b < TB; ++b) {
              if (all_rows || b < block_rows) {
                const Pk k = ei::pset1<Pk>(static_cast<T>(*in.template row<S>(b)));
                acc0[b] = ei::pmadd(k, q0, acc0[b]);
                acc1[b] = ei::pmadd(k, q1, acc1[b]);
              }
            }
          }
        };
        if (block_rows == TB) {
          shared(std::true_type{});
        } else if (block_rows > 0) {
          shared(std::false_type{});
        }
        KVATTN_UNROLL
        for (int b = 0; b < TB; ++b) {
          sums[0][b0 + b] = acc0[b];
          sums[1][b0 + b] = acc1[b];
        }
      }
      // The residual part: the transpose first (block.packet[m] = head h0 + m against
      // the P tokens), then per head one packet of q~_h at a time against the P tokens'
      // slices, P independent sums, reduced across lanes into the head's logits row.
      const Index valid = std::min(P, n - t0);
      for (int c = 0; c < (pair ? 2 : 1); ++c) {
        const Index h0 = c0 + c * P;
        const Index heads = std::min(P, H - h0);
        ei::PacketBlock<Pk, static_cast<int>(P)> block;
        for (Index b = 0; b < P; ++b) block.packet[b] = sums[c][b];
        ei::ptranspose(block);
        for (Index m = 0; m < heads; ++m) {
          const T* q = query_latent + (h0 + m) * r;
          Pk dots[P];
          KVATTN_UNROLL
          for (int b = 0; b < P; ++b) dots[b] = ei::pset1<Pk>(T(0));
          auto pass = [&](auto all_tokens) {
            StridedRows<static_cast<int>(P)> in(rows + t0 * stride + dh + (h0 + m) * r, row_bytes,
                                                valid);
            for (Index j = 0; j < full; j += P, in.advance(P * sizeof(S))) {
              if (prefetch != nullptr) prefetch->step();
              const Pk qj = ei::ploadu<Pk>(q + j);
              KVATTN_UNROLL
              for (int b = 0; b < P; ++b) {
                if (all_tokens || b < valid) {
                  dots[b] = ei::pmadd(qj, load_widened<T>(in.template row<S>(b)), dots[b]);
                }
              }
            }
            if (skip > 0) {
              const Pk qj = ei::ploadu<Pk>(q + r - P);
              KVATTN_UNROLL
              for (int b = 0; b < P; ++b) {
                if (all_tokens || b < valid) {
                  const Pk kp = zero_first<T>(load_widened<T>(in.template row<S>(b, back)), skip);
                  dots[b] = ei::pmadd(qj, kp, dots[b]);
                }
              }
            }
          };
          if (valid == P) {
            pass(std::true_type{});
          } else {
            pass(std::false_type{});
          }
          ei::pstoreu(logits + (h0 + m) * ld + t0, ei::padd(block.packet[m], sum_lanes<T>(dots)));
        }
      }
    }
  }
  if (prefetch != nullptr) prefetch->finish();
}

#if KVATTN_HAVE_BF16_DOT

/// lrkv_score on bf16 rows by vdpbf16ps (DecodeArithmetic::bf16_dot, bf16_dot_kernels.hpp):
/// the same logits, from the query rounded to bf16 by the caller. `query_pairs` is the
/// shared queries transposed in pairs, (d_h / 2) x hp x 2: element ((p * hp + h) * 2 + e)
/// = q_h[2p + e] (d_h even, the padding heads zero), so one load is a packet of 16 heads'
/// pairs and one 32-bit broadcast a key pair; `latent` is H x latent_stride, row h = q~_h
/// followed by zeros up to latent_stride (r rounded up to 32). The shared part halves
/// lrkv_score's multiply-adds and needs no widening; each residual dot product takes
/// ceil(r / 32) instructions, its last chunk of keys loaded under a mask (never past the
/// slice). Every head in one pass over each row, as lrkv_score. hp is a multiple of 16 (the
/// packets of heads).
template <class T>
void lrkv_score_bf16_dot(const Eigen::bfloat16* query_pairs, Index hp,
                         const Eigen::bfloat16* latent, Index latent_stride, Index H, Index dh,
                         Index r, const Eigen::bfloat16* rows, Index stride, Index n, T* logits,
                         Index ld, Prefetcher* prefetch = nullptr) {
  static_assert(std::is_same_v<T, float>, "the instruction sums in float");
  using Pk = Packet<float>;
  constexpr Index P = 16;
  static_assert(packet_size<float> == P, "AVX-512 packets: 16 heads per query load");
  constexpr int TB = 8;  // tokens per register block of the shared part: 2 x 8 accumulators
  const Index chunks = (r + 31) / 32;
  const __mmask32 tail_mask =
      r % 32 == 0 ? ~__mmask32{0} : static_cast<__mmask32>((std::uint64_t{1} << (r % 32)) - 1);
  const Index row_bytes = stride * Index(sizeof(Eigen::bfloat16));
  if (prefetch != nullptr) {
    const Index token_blocks = (n + TB - 1) / TB;
    const Index head_pairs = (hp / P + 1) / 2;
    prefetch->plan(token_blocks * head_pairs * (dh / 2) + (n + P - 1) / P * H * chunks);
  }
  for (Index t0 = 0; t0 < n; t0 += P) {
    for (Index c0 = 0; c0 < hp; c0 += 2 * P) {
      const bool pair = c0 + P < hp;
      Pk sums[2][P];
      for (Index b0 = 0; b0 < P; b0 += TB) {
        __m512 acc0[TB], acc1[TB];
        KVATTN_UNROLL
        for (int b = 0; b < TB; ++b) acc0[b] = acc1[b] = _mm512_setzero_ps();
        const Index block_rows = std::min<Index>(TB, n - t0 - b0);
        auto shared = [&](auto all_rows) {
          StridedRows<TB> in(rows + (t0 + b0) * stride, row_bytes, block_rows);
          const Eigen::bfloat16* q = query_pairs + c0 * 2;
          for (Index j = 0; j < dh; j += 2, q += 2 * hp, in.advance(2 * sizeof(Eigen::bfloat16))) {
            if (prefetch != nullptr) prefetch->step();
            const __m512bh q0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q));
            const __m512bh q1 =
                pair ? reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + 2 * P)) : q0;
            KVATTN_UNROLL
            for (int b = 0; b < TB; ++b) {
              if (all_rows || b < block_rows) {
                std::int32_t both;
                std::memcpy(&both, in.template row<Eigen::bfloat16>(b), sizeof both);
                const __m512bh k = reinterpret_cast<__m512bh>(_mm512_set1_epi32(both));
                acc0[b] = _mm512_dpbf16_ps(acc0[b], q0, k);
                acc1[b] = _mm512_dpbf16_ps(acc1[b], q1, k);
              }
            }
          }
        };
        if (block_rows == TB) {
          shared(std::true_type{});
        } else if (block_rows > 0) {
          shared(std::false_type{});
        }
        KVATTN_UNROLL
        for (int b = 0; b < TB; ++b) {
          sums[0][b0 + b] = acc0[b];
          sums[1][b0 + b] = acc1[b];
        }
      }
      // The residual part, as lrkv_score: per head, 16 tokens' dot products reduced into
      // one packet of its logits row beside the transposed shared sums.
      for (int c = 0; c < (pair ? 2 : 1); ++c) {
        const Index h0 = c0 + c * P;
        const Index heads = std::min(P, H - h0);
        ei::PacketBlock<Pk, static_cast<int>(P)> block;
        for (Index b = 0; b < P; ++b) block.packet[b] = sums[c][b];
        ei::ptranspose(block);
        const Index valid = std::min(P, n - t0);
        for (Index m = 0; m < heads; ++m) {
          const Eigen::bfloat16* q = latent + (h0 + m) * latent_stride;
          Pk dots[P];
          KVATTN_UNROLL
          for (int b = 0; b < P; ++b) dots[b] = _mm512_setzero_ps();
          auto pass = [&](auto all_tokens) {
            StridedRows<static_cast<int>(P)> in(rows + t0 * stride + dh + (h0 + m) * r, row_bytes,
                                                valid);
            for (Index k = 0; k < chunks; ++k) {
              if (prefetch != nullptr) prefetch->step();
              const bool last = k + 1 == chunks;
              const __mmask32 mask = last ? tail_mask : ~__mmask32{0};
              const __m512bh qk = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + k * 32));
              KVATTN_UNROLL
              for (int b = 0; b < P; ++b) {
                if (all_tokens || b < valid) {
                  const __m512bh kp = reinterpret_cast<__m512bh>(
                      _mm512_maskz_loadu_epi16(mask, in.template row<Eigen::bfloat16>(b)));
                  dots[b] = _mm512_dpbf16_ps(dots[b], qk, kp);
                }
              }
              if (!last) in.advance(32 * sizeof(Eigen::bfloat16));  // never past the slice
            }
          };
          if (valid == P) {
            pass(std::true_type{});
          } else {
            pass(std::false_type{});
          }
          ei::pstoreu(logits + (h0 + m) * ld + t0,
                      ei::padd(block.packet[m], sum_lanes<float>(dots)));
        }
      }
    }
  }
  if (prefetch != nullptr) prefetch->finish();
}

#else

// Declared for callers' discarded `if constexpr (bf16_dot_available())` branches; never
// defined.
template <class T>
void lrkv_score_bf16_dot(const Eigen::bfloat16* query_pairs, Index hp,
                         const Eigen::bfloat16* latent, Index latent_stride, Index H, Index dh,
                         Index r, const Eigen::bfloat16* rows, Index stride, Index n, T* logits,
                         Index ld, Prefetcher* prefetch = nullptr);

#endif

#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

}  // namespace kvattn::detail
