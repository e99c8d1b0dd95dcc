// Block-quantized cache storage: int8 and fp8 e4m3 codes with fp32 block scales.
//
// A row of w elements (one KV head's key, say) is stored as w one-byte codes followed by
// ceil(w / B) fp32 scales, one per block of B elements along the row (the last block may
// be shorter; a block never spans two rows, as analysis::scales_per_token_per_layer
// counts). Element j of the row is code_j * scale_(j / B).
//
// Quantization (on append), per block: scale = max |x| / code_max (int8: 127, e4m3: 448)
// in fp32, code = x / scale rounded to nearest, ties to even (computed in double, so
// the tie is decided on the exact quotient), which never leaves the format's range. A
// NaN or infinity has no scale: appending one throws kvattn::value_error and changes
// nothing (nothing saturates silently). An all-zero block has scale 0 and codes 0.
// Error per element (the scale's own fp32 rounding aside): int8 <= scale / 2;
// e4m3 <= max(2^-4 |x|, 2^-10 scale) (3 mantissa bits; below 2^-6 of the scale, e4m3's
// subnormals have a fixed step of 2^-9).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "kvattn/core/dtype.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/index.hpp"

namespace kvattn {

/// int8 codes, symmetric (-127 ... 127), one fp32 scale per Block elements of a row.
template <Index Block = 128>
using Int8 = BlockQuantized<Dtype::int8, Block>;

/// fp8 e4m3 codes (e4m3fn: no infinities, largest finite 448), one fp32 scale per Block
/// elements of a row. Fp8E4M3<128> is DeepSeek's fp8 cache format.
template <Index Block = 128>
using Fp8E4M3 = BlockQuantized<Dtype::fp8_e4m3, Block>;

/// One fp8 e4m3 code: sign, 4 exponent bits (bias 7), 3 mantissa bits. The codes 0x7F
/// and 0xFF (NaN) are never stored by kvattn.
struct fp8_e4m3 {
  std::uint8_t bits = 0;
  /// The value the code stands for (exact in float). The sign, exponent and mantissa bits
  /// moved under float's fields read as the value times 2^-120 (exponent bias 127 against
  /// 7; e4m3's subnormals become float subnormals), so one exact multiply rebiases it; the
  /// decode kernels do the same in vector registers (detail::load_codes).
  explicit operator float() const {
    const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x80) << 24;
    const std::uint32_t rest = static_cast<std::uint32_t>(bits & 0x7F) << 20;
    return std::bit_cast<float>(sign | rest) * 0x1p120f;
  }
  explicit operator double() const { return static_cast<double>(static_cast<float>(*this)); }
};
static_assert(sizeof(fp8_e4m3) == 1);

namespace detail {

/// The e4m3 code of y, |y| <= 448, rounded to nearest, ties to even.
inline std::uint8_t encode_e4m3(double y) {
  const double a = std::min(std::fabs(y), 448.0);
  std::uint64_t code;
  if (a < 0x1p-6) {
    // Subnormals step by 2^-9; 2^-6 itself rounds to code 8, the smallest normal.
    code = static_cast<std::uint64_t>(std::nearbyint(a * 512.0));
  } else {
    // Round the double's 52-bit mantissa to 3 bits (ties to even); a carry moves into the
    // exponent, as it should. Then rebias the exponent from 1023 to 7.
    const auto bits = std::bit_cast<std::uint64_t>(a);
    const std::uint64_t rounded = bits + ((std::uint64_t{1} << 48) - 1) + ((bits >> 49) & 1);
    code = (rounded >> 49) - (std::uint64_t{1023 - 7} << 3);
    if (code > 0x7E) code = 0x7E;  // 448: unreachable for a <= 448, kept as a guard
  }
  return static_cast<std::uint8_t>(code | (std::signbit(y) ? 0x80u : 0u));
}

/// How a cache stores rows of storage type S: as S itself (float, double, bf16, fp16) ...
template <class S>
struct StorageTraits {
  using element = S;
  static constexpr bool quantized = false;
  /// Elements of `element` one row of w values occupies.
  static constexpr Index row_elements(Index w) { return w; }
};

/// ... or as codes and block scales (BlockQuantized).
template <Dtype Code, Index Block>
struct StorageTraits<BlockQuantized<Code, Block>> {
  using element = std::conditional_t<Code == Dtype::int8, std::int8_t, fp8_e4m3>;
  static constexpr bool quantized = true;
  static constexpr Index block = Block;
  static constexpr Index scale_bytes = 4;  // fp32
  static constexpr double code_max = Code == Dtype::int8 ? 127.0 : 448.0;

  static constexpr Index blocks(Index w) { return (w + Block - 1) / Block; }
  static constexpr Index row_elements(Index w) { return w + scale_bytes * blocks(w); }

  /// Scale of block b of a row of w values stored at `row`.
  static float scale(const element* row, Index w, Index b) {
    float s;
    std::memcpy(&s, reinterpret_cast<const unsigned char*>(row + w) + scale_bytes * b, sizeof s);
    return s;
  }
  static float code_value(element code) { return static_cast<float>(code); }
  /// Element j of the row, dequantized: code x scale, rounded once to T.
  template <class T = float>
  static T value(const element* row, Index w, Index j) {
    return static_cast<T>(code_value(row[j])) * static_cast<T>(scale(row, w, j / Block));
  }
  /// Columns [col, col + n) of the row, dequantized into out[0, n).
  template <class T>
  static void dequantize(const element* row, Index w, Index col, Index n, T* out) {
    for (Index j = 0; j < n;) {
      const Index b = (col + j) / Block;
      const Index end = std::min(n, (b + 1) * Block - col);
      const T s = static_cast<T>(scale(row, w, b));
      for (; j < end; ++j) out[j] = static_cast<T>(code_value(row[col + j])) * s;
    }
  }

  /// Quantizes the w finite values get(0) ... get(w - 1) into `row` (codes, then scales).
  template <class Get>
  static void encode(const Get& get, Index w, element* row) noexcept {
    auto* scales = reinterpret_cast<unsigned char*>(row + w);
    for (Index b = 0; b * Block < w; ++b) {
      const Index j0 = b * Block, j1 = std::min(w, j0 + Block);
      double amax = 0.0;
      for (Index j = j0; j < j1; ++j) amax = std::max(amax, std::fabs(static_cast<double>(get(j))));
      const float scale = static_cast<float>(amax / code_max);
      std::memcpy(scales + scale_bytes * b, &scale, sizeof scale);
      for (Index j = j0; j < j1; ++j) {
        const double y = scale > 0.0f ? static_cast<double>(get(j)) / scale : 0.0;
        if constexpr (Code == Dtype::int8) {
          row[j] = static_cast<std::int8_t>(std::clamp(std::nearbyint(y), -127.0, 127.0));
        } else {
          row[j] = fp8_e4m3{encode_e4m3(y)};
        }
      }
    }
  }
};

template <class S>
using storage_element_t = typename StorageTraits<S>::element;

template <class S>
inline constexpr bool is_quantized_storage = StorageTraits<S>::quantized;

/// The storage's name in messages and pool names: "fp32", "bf16", "int8/128", ...
template <class S>
std::string storage_name() {
  std::string name(kvattn::to_string(kvattn::dtype_of<S>()));
  if constexpr (is_quantized_storage<S>) {
    // Two appends, not "/" + to_string(...): GCC 12 warns (-Wrestrict, a false positive)
    // on the temporary's concatenation once inlined.
    name += '/';
    name += std::to_string(StorageTraits<S>::block);
  }
  return name;
}

/// Throws value_error unless every element of `rows` is finite (a quantized cache's rows).
template <class Matrix>
void require_finite(const char* where, const char* what, const Matrix& rows) {
  for (Index i = 0; i < rows.rows(); ++i) {
    for (Index j = 0; j < rows.cols(); ++j) {
      if (!std::isfinite(static_cast<double>(rows(i, j)))) {
        throw value_error(std::string(where) + ": " + what + "(" + std::to_string(i) + ", " +
                          std::to_string(j) + ") is " +
                          std::to_string(static_cast<double>(rows(i, j))) +
                          "; a quantized cache stores finite values only (its block scale "
                          "would be meaningless)");
      }
    }
  }
}

}  // namespace detail
}  // namespace kvattn
