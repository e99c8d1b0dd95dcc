// What the quantized-cache tests read out of a stored row, written from the spec and the
// byte layout of docs/api.md (§ Quantized storage), independently of core/quantized.hpp.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvattn/core/dtype.hpp"
#include "kvattn/core/index.hpp"

namespace kvattn::test {

/// The value of an e4m3 code from the OCP FP8 definition: (-1)^s 2^(e-7) (1 + m/8) for
/// e > 0, (-1)^s 2^-6 (m/8) for e = 0.
inline double e4m3_value(std::uint8_t code) {
  const int e = (code >> 3) & 15, m = code & 7;
  const double magnitude = e > 0 ? std::ldexp(1.0 + m / 8.0, e - 7) : std::ldexp(m / 8.0, -6);
  return (code & 0x80) != 0 ? -magnitude : magnitude;
}

/// The fp32 scale of block b of a row of w values stored at `row`: the 4 bytes at
/// w + 4 b (after the w one-byte codes).
inline float stored_scale(const void* row, Index w, Index b) {
  float s;
  std::memcpy(&s, static_cast<const unsigned char*>(row) + w + 4 * b, sizeof s);
  return s;
}

/// A stored row of w values of format S (kvattn::Int8<B> or Fp8E4M3<B>) decoded from its
/// bytes: w one-byte codes, then ceil(w / B) fp32 scales; element j is code_j x scale_(j/B).
template <class S>
std::vector<double> decode_row(const void* row, Index w) {
  const auto* bytes = static_cast<const unsigned char*>(row);
  std::vector<double> out(static_cast<std::size_t>(w));
  for (Index j = 0; j < w; ++j) {
    const double scale = stored_scale(row, w, j / S::block);
    const double code = S::code == Dtype::int8
                            ? static_cast<double>(static_cast<std::int8_t>(bytes[j]))
                            : e4m3_value(bytes[j]);
    out[static_cast<std::size_t>(j)] = code * scale;
  }
  return out;
}

/// The format's bound on |x - stored| for an element x of a block with largest magnitude
/// amax (core/quantized.hpp), with the slack of the fp32 scale's rounding.
template <class S>
double element_bound(double x, double amax) {
  const double scale = amax / (S::code == Dtype::int8 ? 127.0 : 448.0);
  const double bound = S::code == Dtype::int8
                           ? scale / 2
                           : std::max(std::ldexp(std::fabs(x), -4), std::ldexp(scale, -10));
  return bound * (1 + 1e-6) + std::ldexp(std::fabs(x), -22);
}

/// A bf16 element from its two bytes: the upper half of an fp32.
inline double bf16_value(const void* at) {
  std::uint16_t bits;
  std::memcpy(&bits, at, sizeof bits);
  return static_cast<double>(std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16));
}

/// Tolerance of a quantized cache's layer output against an fp32 cache's, from each
/// format's per-element error (core/quantized.hpp), derived as test_storage_bf16.cpp does
/// for bf16: a row's elements are N(0, 1), so amax over a block of 32-128 is about 2.5-3;
/// int8 then stores each element within scale / 2 = amax / 254 ~ 0.012 (~u = 0.012
/// relative to the rms element, u / sqrt(3) rms), e4m3 within 2^-4 relative (u = 0.0625).
/// Values and logits add in quadrature to about u in all; the tolerance is 4u. Measured
/// (AVX2 build, GQA family, max over the steps): int8 ~0.006-0.011, e4m3 ~0.03-0.044.
template <class S>
constexpr double format_tolerance() {
  return S::code == Dtype::int8 ? 4 * 3.0 / 254.0 : 4 * 0.0625;
}

}  // namespace kvattn::test
