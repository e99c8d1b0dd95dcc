// Vector building blocks of the decode kernels, on Eigen's packets (SSE, AVX/AVX2,
// AVX-512, NEON, or scalar: whatever the translation unit is compiled for; see
// core/simd.hpp): widening loads from a narrower storage type, masked row tails,
// lane-wise sums of a block of accumulators, a softmax exponential, prefetching.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <Eigen/Core>

#include "kvattn/core/quantized.hpp"
#include "kvattn/core/types.hpp"

// Register blocks are small arrays indexed by constant-trip loops; they must be
// fully unrolled so the arrays live in registers, not on the stack. GCC's count is a
// limit: with 16, the 24 accumulators of a 4 x 6 score block (and their 32-packet
// reduction) stayed a stack array, zeroed by a memset call per block (MLA's fp32 score,
// kernel-only, no prefetcher: 127 ns per token against 116 with 32).
#if defined(__clang__)
#define KVATTN_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define KVATTN_UNROLL _Pragma("GCC unroll 32")
#else
#define KVATTN_UNROLL
#endif
// Four iterations of a loop whose trip count is known only at run time (a row's column
// packets), so that a short body does not pay a loop branch per packet.
#if defined(__clang__)
#define KVATTN_UNROLL_4 _Pragma("unroll 4")
#elif defined(__GNUC__)
#define KVATTN_UNROLL_4 _Pragma("GCC unroll 4")
#else
#define KVATTN_UNROLL_4
#endif
// A lambda inlined where it is called (Clang 14 left score_rows4_by_token's per-token
// lambda, called from two loops, a call per token: 2.4x as slow).
#if defined(__GNUC__) || defined(__clang__)
#define KVATTN_INLINE_LAMBDA __attribute__((always_inline))
#else
#define KVATTN_INLINE_LAMBDA
#endif
// A loop kept rolled: its body stays one copy of the code (see score_rows4_by_token).
#if defined(__clang__)
#define KVATTN_NO_UNROLL _Pragma("nounroll")
#elif defined(__GNUC__)
#define KVATTN_NO_UNROLL _Pragma("GCC unroll 1")
#else
#define KVATTN_NO_UNROLL
#endif

namespace kvattn::detail {

namespace ei = Eigen::internal;

template <class T>
using Packet = typename ei::packet_traits<T>::type;

template <class T>
inline constexpr Index packet_size = ei::unpacket_traits<Packet<T>>::size;

/// Register blocks are sized so accumulators, operands and a broadcast fit in the
/// vector registers: 16 (SSE, AVX2) or 32 (AVX-512, AArch64 NEON).
inline constexpr bool many_registers = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS >= 32;

/// Whether S is a one-byte code of a block-quantized cache (core/quantized.hpp).
template <class S>
inline constexpr bool is_code = std::is_same_v<S, std::int8_t> || std::is_same_v<S, fp8_e4m3>;

/// P consecutive one-byte codes as one packet of T, unscaled: int8 as integers, e4m3 as
/// their values. The e4m3 decode is three integer operations and an exact multiply: the
/// sign-extended code shifted up by 20 puts the sign at bit 31 and the exponent and
/// mantissa under float's exponent and mantissa fields (bits 23-26, 20-22), which reads as
/// the value times 2^-120 (float's exponent bias 127 against e4m3's 7); the subnormal
/// codes land on float's subnormals, which keeps them exact.
template <class T, class S>
inline Packet<T> load_codes(const S* from) {
  constexpr bool is_int8 = std::is_same_v<S, std::int8_t>;
#if defined(EIGEN_VECTORIZE_AVX512)
  if constexpr (std::is_same_v<T, float> && packet_size<T> == 16) {
    // Zero-masking forms, for GCC bug 105593 (see load_widened).
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from));
    const __m512i wide = _mm512_maskz_cvtepi8_epi32(0xFFFF, raw);
    if constexpr (is_int8) {
      return _mm512_maskz_cvtepi32_ps(0xFFFF, wide);
    } else {
      const __m512i bits = _mm512_and_si512(_mm512_maskz_slli_epi32(0xFFFF, wide, 20),
                                            _mm512_set1_epi32(static_cast<int>(0x87F00000u)));
      return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
    }
  }
#elif defined(EIGEN_VECTORIZE_AVX2)
  if constexpr (std::is_same_v<T, float> && packet_size<T> == 8) {
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(from));
    const __m256i wide = _mm256_cvtepi8_epi32(raw);
    if constexpr (is_int8) {
      return _mm256_cvtepi32_ps(wide);
    } else {
      const __m256i bits = _mm256_and_si256(_mm256_slli_epi32(wide, 20),
                                            _mm256_set1_epi32(static_cast<int>(0x87F00000u)));
      return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
    }
  }
#endif
  (void)is_int8;
  alignas(64) T widened[packet_size<T>];
  for (Index k = 0; k < packet_size<T>; ++k) widened[k] = static_cast<T>(from[k]);
  return ei::pload<Packet<T>>(widened);
}

/// P consecutive elements of storage type S as one packet of T (codes unscaled).
template <class T, class S>
inline Packet<T> load_widened(const S* from) {
  if constexpr (std::is_same_v<S, T>) {
    return ei::ploadu<Packet<T>>(from);
  } else if constexpr (is_code<S>) {
    return load_codes<T>(from);
  } else {
#if defined(EIGEN_VECTORIZE_AVX512)
    if constexpr (std::is_same_v<T, float> && std::is_same_v<S, Eigen::bfloat16> &&
                  packet_size<T> == 16) {
      // bf16 is the top half of an fp32: zero-extend to 32 bits, shift up. The zero-
      // masking forms, because GCC 12's unmasked _mm512_cvtepu16_epi32 / _mm512_slli_epi32
      // (which Eigen's pcast uses) pass an undefined vector through and warn about it
      // (-Wmaybe-uninitialized, GCC bug 105593) in every function that inlines them.
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from));
      return _mm512_castsi512_ps(
          _mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_cvtepu16_epi32(0xFFFF, raw), 16));
    }
#elif defined(EIGEN_VECTORIZE_AVX)
    if constexpr (std::is_same_v<T, float> && std::is_same_v<S, Eigen::bfloat16> &&
                  packet_size<T> == 8) {
      return ei::pcast<ei::Packet8bf, ei::Packet8f>(ei::ploadu<ei::Packet8bf>(from));
    }
#endif
    // Portable path: widen through a small stack array.
    alignas(64) T widened[packet_size<T>];
    for (Index k = 0; k < packet_size<T>; ++k) widened[k] = static_cast<T>(from[k]);
    return ei::pload<Packet<T>>(widened);
  }
}

/// Pins a loaded packet to a register. GCC folds a load into every FMA that uses it
/// (vfmadd231ps mem, ...), so an operand shared by a register block is re-read from L1
/// once per use: 14 loads per 12 FMAs in a 2 x 6 block, and the two 256-bit load ports
/// (Zen 3) then cap the block at ~85% of the FMA rate. An empty asm that "modifies" the
/// register makes the compiler keep the one load. No instruction is emitted.
template <class P>
inline void keep_in_register(P& p) {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__)) && \
    defined(__SSE2__)
  asm("" : "+v"(p));
#else
  (void)p;
#endif
}

/// bf16 rows read in pairs: 2P elements loaded at once become two float packets, the
/// even-indexed elements (the low halves of the 32-bit lanes, shifted up by 16) and the
/// odd-indexed ones (the high halves, masked): one load and one integer op per packet,
/// where widening P elements takes a zero-extending load (a shuffle) and a shift. The
/// element order changes, so the other operand must be in the same "paired" order
/// (to_paired, blocks of kPairBlock = 2P elements): a query row for a dot product, and
/// an accumulator row, put back in order after the pass (from_paired).
///
/// AVX2 and AVX-512 read pairs in the score and the accumulate (kHavePairedBf16). On
/// AVX-512 the score took pairs first, where the widening shuffle was what bound it:
/// kernel-only, the score of 4 query rows against hot bf16 keys (d_h = 128, Zen 5) took
/// 10.2 ns per token widened and 7.7 ns in pairs (5.4 with d_h a compile-time constant).
/// The accumulate, 5.6 ns per token widened and no faster in pairs there, reads pairs
/// since a measurement of whole decode steps over cold caches (one thread, L = 65536,
/// Zen 5, the two alternating in one process): LRKV's bf16 step 1.10-1.13x as fast (the
/// shared values in pairs), GQA's (8 KV heads) 0.99-1.08x, at L = 16384 1.06x, MHA's and
/// MQA's within 1%; in `kvattn_bench`, V2 MLA's 1-3% faster, V2-Lite's within the spread.
/// Its hot time was not what limited it: beside the memory stream, a kernel's loads and
/// shuffles cost more than they do hot (docs/benchmarks.md, "loads beside the stream").
#if defined(EIGEN_VECTORIZE_AVX512)
#define KVATTN_PAIRED_BF16 1
inline constexpr bool kHavePairedBf16 = true;
using RawBf16 = __m512i;
inline RawBf16 load_bf16_raw(const Eigen::bfloat16* from) { return _mm512_loadu_si512(from); }
// The zero-masking shift (GCC bug 105593, see load_widened).
inline __m512 bf16_even(RawBf16 raw) {
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, raw, 16));
}
inline __m512 bf16_odd(RawBf16 raw) {
  return _mm512_castsi512_ps(
      _mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#elif defined(EIGEN_VECTORIZE_AVX2)
#define KVATTN_PAIRED_BF16 1
inline constexpr bool kHavePairedBf16 = true;
using RawBf16 = __m256i;
inline RawBf16 load_bf16_raw(const Eigen::bfloat16* from) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from));
}
inline __m256 bf16_even(RawBf16 raw) { return _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)); }
inline __m256 bf16_odd(RawBf16 raw) {
  return _mm256_castsi256_ps(
      _mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#else
#define KVATTN_PAIRED_BF16 0
inline constexpr bool kHavePairedBf16 = false;
#endif

/// Elements per paired block: one load of bf16 pairs (16 on AVX2, 32 on AVX-512).
inline constexpr Index kPairBlock = 2 * packet_size<float>;

/// Whether rows of `width` elements of storage S can be read in pairs by the accumulate
/// and the score (see above): bf16 into float on AVX2 and AVX-512, width a multiple of
/// kPairBlock.
template <class T, class S>
constexpr bool paired_rows(Index width) {
  return kHavePairedBf16 && std::is_same_v<T, float> && std::is_same_v<S, Eigen::bfloat16> &&
         width > 0 && width % kPairBlock == 0;
}

/// Puts each kPairBlock-element block of `row` (width a multiple of kPairBlock) in
/// paired order: its even-indexed elements, then its odd-indexed ones.
template <class T>
void to_paired(T* row, Index width) {
  constexpr Index half = kPairBlock / 2;
  for (Index j = 0; j + kPairBlock <= width; j += kPairBlock) {
    T block[kPairBlock];
    for (Index k = 0; k < kPairBlock; ++k) block[k] = row[j + k];
    for (Index k = 0; k < half; ++k) {
      row[j + k] = block[2 * k];
      row[j + half + k] = block[2 * k + 1];
    }
  }
}

/// The inverse of to_paired.
template <class T>
void from_paired(T* row, Index width) {
  constexpr Index half = kPairBlock / 2;
  for (Index j = 0; j + kPairBlock <= width; j += kPairBlock) {
    T block[kPairBlock];
    for (Index k = 0; k < kPairBlock; ++k) block[k] = row[j + k];
    for (Index k = 0; k < half; ++k) {
      row[j + 2 * k] = block[k];
      row[j + 2 * k + 1] = block[half + k];
    }
  }
}

/// x with lanes [0, skip) set to +0. A row of width w >= P ends with a packet loaded
/// at w - P, which overlaps the previous full packet by skip = P - w % P lanes; zeroing
/// them (in both operands of a product) counts every element once and reads nothing
/// outside the row, with no scalar loop. Zero bits, not a multiplication by 0, so an
/// infinite element in the overlap cannot turn into a NaN.
template <class T>
inline Packet<T> zero_first(const Packet<T>& x, Index skip) {
  const Packet<T> lanes = ei::plset<Packet<T>>(T(0));
  return ei::pandnot(x, ei::pcmp_lt(lanes, ei::pset1<Packet<T>>(static_cast<T>(skip))));
}

#if defined(EIGEN_VECTORIZE_AVX512)
// The first two levels of the lane-sum trees (sum_lanes, sum_rows): the 256-bit halves,
// then the 128-bit quarters, of a and b added pairwise, a's sums in the low part of the
// result, b's in the high part.
inline __m512 add_halves(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
inline __m512 add_quarters(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
#endif

/// One packet holding the sums of P accumulators: lane k = sum of the lanes of acc[k].
/// A dot-product kernel reduces a whole block of P dot products with this once, instead
/// of P horizontal sums (a transpose-and-add tree: log2(P) shuffle stages).
//
// (PacketBlock<Packet<T>, P> names a vector type as a template argument, which GCC
// reports with -Wignored-attributes: the vector's alignment attribute does not take
// part in template matching. It does not need to: the block is a plain local array.)
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"
#endif
template <class T>
inline Packet<T> sum_lanes(const Packet<T>* acc) {
  constexpr Index P = packet_size<T>;
#if defined(EIGEN_VECTORIZE_AVX) && !defined(EIGEN_VECTORIZE_AVX512)
  if constexpr (std::is_same_v<T, float> && P == 8) {
    // hadd pairs: [a0 a0 a1 a1 | a0 a0 a1 a1] (two-lane sums, per 128-bit half) ...
    const __m256 h0 = _mm256_hadd_ps(acc[0], acc[1]);
    const __m256 h1 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 h2 = _mm256_hadd_ps(acc[4], acc[5]);
    const __m256 h3 = _mm256_hadd_ps(acc[6], acc[7]);
    // ... then [a0 a1 a2 a3 | a0 a1 a2 a3] (four-lane sums per half) ...
    const __m256 g0 = _mm256_hadd_ps(h0, h1);
    const __m256 g1 = _mm256_hadd_ps(h2, h3);
    // ... and the two halves added: [a0 .. a3 | a4 .. a7].
    return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20),
                         _mm256_permute2f128_ps(g0, g1, 0x31));
  }
#endif
#if defined(EIGEN_VECTORIZE_AVX512)
  if constexpr (std::is_same_v<T, float> && P == 16) {
    // A halving tree, 30 shuffles and 15 adds where a full 16 x 16 transpose takes 64
    // shuffles: each level adds the two halves of pairs of packets (256-bit halves, then
    // 128-bit quarters, then pairs of lanes, then lanes), two sources per result. Fed in
    // the order 0, 4, 8, 12, 1, 5, ... (a 4 x 4 transpose of the indices), the tree
    // leaves the sum of acc[k] in lane k.
    auto lanes = [](__m512 a, __m512 b) {
      return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
    };
    __m512 level1[8];
    KVATTN_UNROLL
    for (int i = 0; i < 8; ++i) {
      // Pair i holds sources order[2i], order[2i + 1], order[k] = (k % 4) * 4 + k / 4.
      const int first = (2 * i % 4) * 4 + 2 * i / 4,
                second = ((2 * i + 1) % 4) * 4 + (2 * i + 1) / 4;
      level1[i] = add_halves(acc[first], acc[second]);
    }
    __m512 level2[4];
    KVATTN_UNROLL
    for (int i = 0; i < 4; ++i) level2[i] = add_quarters(level1[2 * i], level1[2 * i + 1]);
    return lanes(lanes(level2[0], level2[1]), lanes(level2[2], level2[3]));
  }
#endif
  if constexpr (P == 1) {
    return acc[0];
  } else if constexpr (P == 2 || P == 4 || P == 8 || P == 16) {
    // Eigen's in-register transpose: packet k then holds lane k of every accumulator.
    ei::PacketBlock<Packet<T>, static_cast<int>(P)> block;
    KVATTN_UNROLL
    for (int k = 0; k < P; ++k) block.packet[k] = acc[k];
    ei::ptranspose(block);
    for (int k = 1; k < P; ++k) block.packet[0] = ei::padd(block.packet[0], block.packet[k]);
    return block.packet[0];
  } else {
    alignas(64) T sums[P];
    for (Index k = 0; k < P; ++k) sums[k] = ei::predux(acc[k]);
    return ei::pload<Packet<T>>(sums);
  }
}
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

#if defined(EIGEN_VECTORIZE_AVX512)
/// sum_lanes' first two levels for 4 accumulators: 128-bit block m of the result holds 4
/// partial sums of acc[m] (6 shuffles, 3 adds).
inline __m512 fold_rows4(const __m512* acc) {
  return add_quarters(add_halves(acc[0], acc[1]), add_halves(acc[2], acc[3]));
}

/// The sums of four tokens' 4 accumulators, from folded[b] = fold_rows4 of token b's:
/// block m of the result holds row m's sums of tokens 0 ... 3, in order. An in-block
/// 4 x 4 transpose with the adds (4 unpacks, 2 shuffles, 3 adds for 16 sums), where
/// sum_rows finishes each token with 3 shuffles, 2 adds and its lane extracts.
inline __m512 sum_folded4(const __m512* folded) {
  // Per block: [x0 (p0 + p2), x1 (p0 + p2), x0 (p1 + p3), x1 (p1 + p3)] for tokens 0, 1.
  auto pair_sums = [](__m512 x0, __m512 x1) {
    return _mm512_add_ps(_mm512_unpacklo_ps(x0, x1), _mm512_unpackhi_ps(x0, x1));
  };
  const __m512 first = pair_sums(folded[0], folded[1]);
  const __m512 second = pair_sums(folded[2], folded[3]);
  return _mm512_add_ps(_mm512_shuffle_ps(first, second, 0x44),
                       _mm512_shuffle_ps(first, second, 0xEE));
}
#endif

/// The sums of M <= 4 accumulators into out[0, M): a by-token kernel's per-token
/// reduction (detail::kernels::score_rows_by_token, score_rows4_by_token). Four packets
/// share one tree instead of four horizontal sums: 3 hadds and an add for 8 floats
/// (AVX2), 5 shuffles, 2 permutes, 5 adds and a lane gather for 16 (AVX-512).
template <class T, int M>
inline void sum_rows(const Packet<T>* acc, T* out) {
  static_assert(M >= 1 && M <= 4);
#if defined(EIGEN_VECTORIZE_AVX) && !defined(EIGEN_VECTORIZE_AVX512)
  if constexpr (std::is_same_v<T, float> && M == 4) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    return;
  }
#endif
#if defined(EIGEN_VECTORIZE_AVX512)
  if constexpr (std::is_same_v<T, float> && M == 4) {
    // fold_rows4 leaves block m with 4 partial sums of row m; two in-block swaps add
    // those, and lane 0 of each block is row m's sum.
    __m512 blocks = fold_rows4(acc);
    blocks = _mm512_add_ps(blocks, _mm512_permute_ps(blocks, 0x4E));
    blocks = _mm512_add_ps(blocks, _mm512_permute_ps(blocks, 0xB1));
    const __m512i first_lanes = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
    _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(first_lanes, blocks)));
    return;
  }
#endif
  KVATTN_UNROLL
  for (int m = 0; m < M; ++m) out[m] = ei::predux(acc[m]);
}

/// exp(x) for the softmax weights, x = logit - running maximum (<= 0, or NaN): Eigen's
/// vectorized exp, except that x below the normal range (exp(x) < the smallest normal
/// T) gives exactly 0. Eigen's pexp clamps its argument and returns ~3e-39 for -inf;
/// the softmax of a -inf logit must be 0, and denormal weights would only slow every
/// product that uses them. NaN stays NaN.
template <class T>
inline Packet<T> softmax_exp(const Packet<T>& x) {
  // ln(e * 2^min_exponent): -85.6 (float), -707.4 (double), so exp(x) >= x's lowest
  // normal, 2^(min_exponent - 1).
  constexpr T lowest = std::numeric_limits<T>::min_exponent * T(0.6931471805599453) + T(1);
  const Packet<T> underflow = ei::pcmp_lt(x, ei::pset1<Packet<T>>(lowest));
  return ei::pandnot(ei::pexp(x), underflow);
}

/// The scalar form of softmax_exp (same results for the same x, up to exp's rounding).
template <class T>
inline T softmax_exp(T x) {
  constexpr T lowest = std::numeric_limits<T>::min_exponent * T(0.6931471805599453) + T(1);
  return x < lowest ? T(0) : std::exp(x);
}

/// One query row's online-softmax update for a tile (Milakov & Gimelshein; FlashAttention):
/// s (n_pad logits, the padding past the tile -inf) becomes the weights
/// exp(s - m_new), `sum` and the row's accumulator are rescaled by exp(m_old - m_new),
/// and the weights are added to `sum`. A NaN or +inf logit poisons the row (the sum
/// becomes NaN, as softmax_inplace gives for such a row) instead of being dropped;
/// -inf logits get weight exactly 0.
template <class T>
inline void softmax_tile_row(T* s, Index n_pad, T& max, T& sum, T* acc, Index width) {
  using Pk = Packet<T>;
  constexpr Index P = packet_size<T>;
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  Pk m0 = ei::pset1<Pk>(neg_inf), m1 = m0;
  Index t = 0;
  for (; t + 2 * P <= n_pad; t += 2 * P) {
    m0 = ei::pmax(m0, ei::ploadu<Pk>(s + t));
    m1 = ei::pmax(m1, ei::ploadu<Pk>(s + t + P));
  }
  for (; t < n_pad; t += P) m0 = ei::pmax(m0, ei::ploadu<Pk>(s + t));
  // pmax may drop a NaN; the NaN then reaches the sum through its own exp below.
  const T tile_max = ei::predux_max(ei::pmax(m0, m1));
  const T old_max = max;
  const T new_max = std::max(old_max, tile_max);
  // The shift of the tile's exponentials: 0 while every logit so far is -inf (nothing
  // visible yet: the weights stay 0 instead of exp(-inf + inf) = NaN).
  const T shift = new_max == neg_inf ? T(0) : new_max;
  if (old_max != neg_inf && new_max != old_max) {
    const T scale = softmax_exp(old_max - new_max);  // NaN (row poisoned) stays NaN
    sum *= scale;
    Eigen::Map<RowVector<T>>(acc, width) *= scale;
  }
  max = new_max;
  const Pk shift_p = ei::pset1<Pk>(shift);
  Pk s0 = ei::pset1<Pk>(T(0)), s1 = s0;
  t = 0;
  for (; t + 2 * P <= n_pad; t += 2 * P) {
    const Pk p0 = softmax_exp<T>(ei::psub(ei::ploadu<Pk>(s + t), shift_p));
    const Pk p1 = softmax_exp<T>(ei::psub(ei::ploadu<Pk>(s + t + P), shift_p));
    ei::pstoreu(s + t, p0);
    ei::pstoreu(s + t + P, p1);
    s0 = ei::padd(s0, p0);
    s1 = ei::padd(s1, p1);
  }
  for (; t < n_pad; t += P) {
    const Pk p0 = softmax_exp<T>(ei::psub(ei::ploadu<Pk>(s + t), shift_p));
    ei::pstoreu(s + t, p0);
    s0 = ei::padd(s0, p0);
  }
  sum += ei::predux(ei::padd(s0, s1));
  // A row of NaN logits has max -inf (pmax drops NaN) and would read as "no visible
  // key" in the merge, which outputs zeros: give it a finite max so the NaN sum shows.
  if (std::isnan(sum) && max == neg_inf) max = T(0);
}

/// The rows of a register block (up to Rows rows, `stride` bytes apart), addressed as x86
/// addressing modes allow: one pointer per 4 rows and the stride s and 3s in registers,
/// row b at [p], [p + s], [p + 2s] or [p + 3s] from its group's pointer. Kept as one
/// pointer per row, 8 or 16 of them, GCC spilled them and reloaded one beside each load
/// of a cached row; such loads keep a kernel's arithmetic from overlapping its memory
/// stream (docs/benchmarks.md, "Rows addressed from a stride": LRKV's bf16 score over
/// cold rows 1.22-1.33x as fast, hot 1.05x). Only rows b < `valid` may be read; the
/// pointers never leave them.
template <int Rows>
struct StridedRows {
  static constexpr int kGroups = (Rows + 3) / 4;
  const char* group[kGroups];
  Index stride;
  Index stride3;

  StridedRows(const void* first, Index stride_bytes, Index valid)
      : stride(stride_bytes), stride3(3 * stride_bytes) {
    const char* p = static_cast<const char*>(first);
    KVATTN_UNROLL
    for (int g = 0; g < kGroups; ++g) group[g] = 4 * g < valid ? p + 4 * g * stride_bytes : p;
  }
  /// Row b's current position plus `offset` bytes (b a constant once the caller's loop is
  /// unrolled).
  template <class S>
  EIGEN_ALWAYS_INLINE const S* row(int b, Index offset = 0) const {
    const Index within = b % 4 == 3 ? stride3 : (b % 4) * stride;
    return reinterpret_cast<const S*>(group[b / 4] + within + offset);
  }
  /// Moves every row's position on by `bytes`.
  EIGEN_ALWAYS_INLINE void advance(Index bytes) {
    KVATTN_UNROLL
    for (int g = 0; g < kGroups; ++g) group[g] += bytes;
  }
};

/// Asks for the cache line at p to be brought into the cache hierarchy (a hint: no
/// fault, no effect on results).
EIGEN_ALWAYS_INLINE void prefetch_line(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 3);
#else
  (void)p;
#endif
}

/// Software prefetch spread evenly over a kernel's loop: the kernel plans how many
/// steps its loop takes, then every step issues its share of the range's cache lines
/// (one line every few steps when there are fewer lines than steps).
///
/// The decode ops use it in both passes of a memory-bound step. The accumulate pass
/// reads each value row in column pieces (one register block of columns at a time), a
/// pattern the hardware prefetchers do not follow, so without help the pass waits on
/// memory and computes in turn. Prefetching the same rows 8 KiB ahead, a few lines per
/// token, keeps requests in flight while it computes (GQA, 4 heads per KV head: 0.65 ->
/// 0.77 of the read-only bandwidth in a cold-cache kernel test). The score pass reads
/// its tile front to back, but a register block of 4 query rows spends long enough on
/// each key row that the hardware prefetchers fall behind: 8 KiB ahead took GQA's score
/// pass from 0.58 to 0.98 of the read-only bandwidth (AVX-512, 37 GB/s). Issued as one
/// burst per tile or block instead, the prefetches fill the miss queues and stall the
/// loads behind them.
///
/// With `touch` set, each step also touches the range's 4 KiB pages page_lead bytes
/// (kPageLead unless set) ahead of its lines. The hardware stream prefetcher follows a
/// stream within a 4 KiB page and starts on a page only after misses there, so line
/// prefetches alone leave each page's stream to start 8 KiB (two pages) before the
/// kernel reads it. One early touch per page starts it sooner: one core's GQA fp32 step
/// 0.78-0.81 -> 0.92-1.03 of a plain read pass (L = 65536), MHA fp32 0.80-0.89 ->
/// 1.05-1.23, bf16 GQA 0.67-0.86 -> 0.92-1.09, bf16 MHA 0.75-1.00 -> 0.97-1.20, LRKV fp32
/// 0.64-0.69 -> 0.74-0.83, LRKV bf16 1.05-1.16x (cold caches on huge pages, AVX-512, steps
/// alternating with read passes; docs/benchmarks.md). Opt-in, set where that was
/// measured: not for MLA (compute-bound, no faster) nor for quantized rows (not measured).
struct Prefetcher {
  const char* next = nullptr;
  const char* end = nullptr;
  // A second range, taken up when the first is done: the rows ahead of a tile that ends
  // at a page's end of a paged cache lie on the next page, elsewhere in memory.
  const char* next_range = nullptr;
  const char* next_range_end = nullptr;
  Index lines_per_step = 0;  // lines issued by a step that issues
  Index period = 1;          // a step issues every `period` steps
  Index countdown = 1;
  std::uintptr_t page = 0;  // the next page boundary to touch (0: the one after `next`)
  bool touch = false;       // whether steps touch the pages ahead (see above)
  // Bytes past the last range's end that belong to the same block (the rows a later
  // tile reads): its pages may be touched too. Set by callers that know the layout.
  Index touch_past = 0;

  static constexpr Index kLine = 64;
  static constexpr Index kPage = 4096;
  static constexpr Index kPageLead = 8 * 1024;
  // How far ahead of the lines the pages are touched: kPageLead unless a caller measured
  // better (LRKV's short ranges, attention/lrkv.hpp).
  Index page_lead = kPageLead;

  Prefetcher() = default;
  /// The range to prefetch: `bytes` from `data` (nothing when bytes <= 0), then
  /// `bytes2` from `data2`.
  Prefetcher(const void* data, Index bytes, const void* data2 = nullptr, Index bytes2 = 0)
      : next(static_cast<const char*>(data)),
        end(data == nullptr || bytes <= 0 ? next : next + bytes),
        next_range(static_cast<const char*>(data2)),
        next_range_end(data2 == nullptr || bytes2 <= 0 ? next_range : next_range + bytes2) {
    if (next >= end) take_next_range();
  }

  /// Spreads what is left over `steps` calls of step().
  void plan(Index steps) {
    const Index lines =
        (end - next + kLine - 1) / kLine + (next_range_end - next_range + kLine - 1) / kLine;
    steps = std::max<Index>(steps, 1);
    if (lines >= steps) {
      lines_per_step = (lines + steps - 1) / steps;
      period = 1;
    } else {
      lines_per_step = 1;
      period = lines > 0 ? steps / lines : steps;
    }
    countdown = period;
  }
  // Forced inline: it sits in the kernels' inner loops, where GCC otherwise sometimes
  // leaves it a call per token (measured: MHA 0.92 -> 0.83 of the read bandwidth).
  EIGEN_ALWAYS_INLINE void step() {
    if (next >= end || --countdown > 0) return;
    countdown = period;
    for (Index k = 0; k < lines_per_step; ++k, next += kLine) {
      if (next >= end) {  // the first range ran out within this step's share
        take_next_range();
        if (next >= end) return;
      }
      prefetch_line(next);
    }
    if (next >= end) {
      take_next_range();
      if (next >= end) return;
    }
    if (touch) touch_pages();
  }
  /// Whatever step() has not reached yet.
  void finish() {
    for (; next < end; next += kLine) prefetch_line(next);
    for (; next_range < next_range_end; next_range += kLine) prefetch_line(next_range);
  }

 private:
  // Touches the page boundaries in (next, next + page_lead) within the range (and
  // touch_past bytes after the last one), as addresses: past it may lie another
  // allocation or another page of a paged cache.
  EIGEN_ALWAYS_INLINE void touch_pages() {
    const auto at = reinterpret_cast<std::uintptr_t>(next);
    const auto past = next_range == next_range_end ? touch_past : 0;
    const auto limit =
        std::min(at + page_lead, reinterpret_cast<std::uintptr_t>(end) + std::uintptr_t(past));
    if (page <= at) page = (at | (kPage - 1)) + 1;
    for (; page < limit; page += kPage) prefetch_line(reinterpret_cast<const void*>(page));
  }
  void take_next_range() {
    next = next_range;
    end = next_range_end;
    next_range = next_range_end;
    page = 0;
  }
};

/// A kernel block's own copy of the caller's Prefetcher, written back when the block
/// ends: a local the compiler keeps in registers, where through the caller's pointer
/// every step() re-loaded and stored its fields (10 instructions, a store among them,
/// beside 34 of a score block's inner loop). Used by the score blocks (kernel-only, MLA's
/// bf16 score 117 -> 106 ns per token); the accumulate blocks measured slower with it
/// (bf16, 86 -> 98) and keep the caller's.
class BlockPrefetcher {
 public:
  explicit BlockPrefetcher(Prefetcher* caller) : caller_(caller) {
    if (caller_ != nullptr) local_ = *caller_;
  }
  ~BlockPrefetcher() {
    if (caller_ != nullptr) *caller_ = local_;
  }
  BlockPrefetcher(const BlockPrefetcher&) = delete;
  BlockPrefetcher& operator=(const BlockPrefetcher&) = delete;
  /// The copy to step (nullptr when the caller passed none).
  Prefetcher* get() { return caller_ != nullptr ? &local_ : nullptr; }

 private:
  Prefetcher* caller_;
  Prefetcher local_;
};

}  // namespace kvattn::detail
