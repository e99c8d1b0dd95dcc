// What the quantized-cache tests read out of a stored row, written from the spec and the
// byte layout of docs/api.md (§ Quantized storage), independently of core/quantized.hpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

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

}  // namespace kvattn::test
