// How much of the query-key grid a mask leaves visible (seed 002, Chapter 6: NV-Embed
// removes the causal mask for embedding; a causal mask hides almost half the grid).
#pragma once

#include <limits>
#include <string>

#include "kvattn/core/errors.hpp"
#include "kvattn/core/index.hpp"

namespace kvattn::analysis {

/// Fraction of the N x N query-key cells a causal mask leaves visible:
/// N(N+1)/2 / N^2 = 1/2 + 1/(2N) (55 of 100 cells at N = 10). A bidirectional mask
/// leaves all of them.
constexpr double causal_visible_fraction(Index n) {
  kvattn::detail::require(n >= 1, "causal_visible_fraction", "n", n, "must be >= 1 (tokens)");
  return 0.5 + 0.5 / static_cast<double>(n);
}

/// Number of visible cells of a causal mask over n tokens, n (n + 1) / 2. Throws
/// kvattn::overflow_error when it does not fit in a signed 64-bit integer.
constexpr Index causal_visible_cells(Index n) {
  kvattn::detail::require(n >= 0, "causal_visible_cells", "n", n, "must be >= 0 (tokens)");
  const auto fail = [n] {
    throw kvattn::overflow_error("causal_visible_cells: n (" + std::to_string(n) +
                                 ") gives n (n + 1) / 2 cells, which does not fit in a signed "
                                 "64-bit integer");
  };
  if (n == std::numeric_limits<Index>::max()) fail();  // n + 1 itself would overflow
  // Halve the even factor first, so the product is exact whenever it fits.
  const Index a = n % 2 == 0 ? n / 2 : n;
  const Index b = n % 2 == 0 ? n + 1 : (n + 1) / 2;
  Index cells = 0;
  if (__builtin_mul_overflow(a, b, &cells)) fail();
  return cells;
}

}  // namespace kvattn::analysis
