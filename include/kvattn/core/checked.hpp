// Overflow-checked size arithmetic for configs, caches and the analytic module.
//
// Every derived size (a width, a weight's element count, elements or bytes per token,
// capacity x width) goes through these, so a configuration whose sizes cannot be
// represented is refused with an error instead of wrapping around into undefined
// behaviour. constexpr: a config checked in a constant expression stays constant.
#pragma once

#include <optional>

#include "kvattn/core/index.hpp"

namespace kvattn::detail {

/// a * b, or std::nullopt when it does not fit in Index.
constexpr std::optional<Index> checked_mul(Index a, Index b) {
  Index product = 0;
  if (__builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

/// a + b, or std::nullopt when it does not fit in Index.
constexpr std::optional<Index> checked_add(Index a, Index b) {
  Index sum = 0;
  if (__builtin_add_overflow(a, b, &sum)) return std::nullopt;
  return sum;
}

/// The largest scalar a cache or weight can hold (double): a size in elements is valid
/// only when it is also representable in bytes of this scalar.
inline constexpr Index kMaxScalarBytes = 8;

}  // namespace kvattn::detail
