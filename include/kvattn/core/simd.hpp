// The instruction-set level kvattn's decode kernels are compiled for.
//
// kvattn is header-only: its kernels are compiled with the consumer's flags, and the
// level is fixed at compile time by them (docs/building.md, "Vector instructions"):
//   "avx512"    -mavx512f (e.g. -march=x86-64-v4, -march=native on an AVX-512 CPU):
//               16-float packets, 32 vector registers
//   "avx2+fma"  -mavx2 -mfma (e.g. -march=x86-64-v3, -march=haswell, znver3)
//   "avx"       -mavx without FMA
//   "sse2"      x86-64 without -m flags (SSE2 up to SSE4.2): 4-float packets
//   "neon"      ARM NEON (AArch64 always)
//   "scalar"    no vector unit Eigen knows (or EIGEN_DONT_VECTORIZE)
// There is no run-time dispatch: a binary built for "avx512" needs an AVX-512 CPU.
#pragma once

#include <Eigen/Core>

namespace kvattn {

/// The name of the vector instruction set the kernels use in this translation unit
/// (see the list above), e.g. for a benchmark report.
constexpr const char* simd_level() {
#if defined(EIGEN_VECTORIZE_AVX512)
  return "avx512";
#elif defined(EIGEN_VECTORIZE_AVX2) && defined(EIGEN_VECTORIZE_FMA)
  return "avx2+fma";
#elif defined(EIGEN_VECTORIZE_AVX)
  return "avx";
#elif defined(EIGEN_VECTORIZE_SSE2)
  return "sse2";
#elif defined(EIGEN_VECTORIZE_NEON)
  return "neon";
#else
  return "scalar";
#endif
}

/// How a decode step multiplies with bf16 cached rows (docs/api.md, "bf16 dot products").
/// `fp32`: the rows are widened and every product and sum is a float one, so a bf16
/// cache's decode equals float arithmetic on its stored rows. `bf16_dot`: where the build
/// has AVX512-BF16 (bf16_dot_available()), MLA, the GQA family (groups of two or more
/// query rows: GQA, MQA) and LRKV (d_h a multiple of 32) round the query (MLA's absorbed
/// one, LRKV's q_h and q~_h; once per step) and the softmax weights (once per tile) to
/// bf16 and multiply by the CPU's bf16 dot-product instruction (float sums); elsewhere,
/// and for other caches and mechanisms, the same as `fp32`.
enum class DecodeArithmetic { fp32, bf16_dot };

/// Whether this translation unit's kernels have the bf16 dot-product instruction
/// (-mavx512bf16 with AVX-512, e.g. -march=native on Zen 4/5, Cooper Lake, Sapphire
/// Rapids), which DecodeArithmetic::bf16_dot uses.
#if defined(__AVX512BF16__) && defined(EIGEN_VECTORIZE_AVX512)
#define KVATTN_HAVE_BF16_DOT 1
#else
#define KVATTN_HAVE_BF16_DOT 0
#endif
constexpr bool bf16_dot_available() { return KVATTN_HAVE_BF16_DOT != 0; }

}  // namespace kvattn
