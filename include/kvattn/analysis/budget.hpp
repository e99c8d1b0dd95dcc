// Solving the cache formulas backwards: the largest d_c, LRKV rank or KV-head count
// whose cache fits a per-token budget (seed 002, Chapter 4, "Running the calculator
// backwards"). Pure constexpr functions of the configs.
#pragma once

#include <algorithm>
#include <limits>
#include <optional>
#include <type_traits>

#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/config/gqa_config.hpp"
#include "kvattn/config/lrkv_config.hpp"
#include "kvattn/config/mla_config.hpp"
#include "kvattn/core/index.hpp"

namespace kvattn::analysis {

enum class BudgetUnit { elements, bytes };

/// A cap on what one token may cost over all `layers` layers of the model, in stored
/// elements or in bytes (bytes use the storage the solver is given, scales included).
struct Budget {
  Index amount = 0;
  BudgetUnit unit = BudgetUnit::elements;
  constexpr bool operator==(const Budget&) const = default;
};

constexpr void check(const Budget& b) {
  detail::require(b.amount >= 1, "Budget", "amount", b.amount, "must be >= 1");
}

/// What one token costs over `layers` layers, in the budget's unit.
constexpr Index cost_per_token(const CacheLayout& layout, Index layers, const Budget& budget,
                               const CacheStorage& storage = {}) {
  return budget.unit == BudgetUnit::elements ? elements_per_token(layout, layers)
                                             : bytes_per_token(layout, storage, layers);
}

/// Whether a layout fits the budget over `layers` layers. A cost too large to represent
/// does not fit (it exceeds any budget).
constexpr bool fits(const CacheLayout& layout, Index layers, const Budget& budget,
                    const CacheStorage& storage = {}) {
  check(budget);
  if (!std::is_constant_evaluated()) {
    try {
      return cost_per_token(layout, layers, budget, storage) <= budget.amount;
    } catch (const kvattn::overflow_error&) {
      return false;
    }
  }
  return cost_per_token(layout, layers, budget, storage) <= budget.amount;
}

namespace detail {

/// Whether `config` validates (at run time a config_error means no; in a constant
/// expression an invalid config does not compile).
template <class Config>
constexpr bool valid(const Config& config) {
  if (!std::is_constant_evaluated()) {
    try {
      config.validate();
    } catch (const config_error&) {
      return false;
    }
    return true;
  }
  config.validate();
  return true;
}

/// The largest divisor of n (>= 1) not above `limit` (>= 1): n's prime factors by trial
/// division (fast unless n has a huge prime factor), then every divisor from them (at
/// most a few thousand for any 64-bit n).
constexpr Index largest_divisor_at_most(Index n, Index limit) {
  Index primes[64] = {};
  int powers[64] = {};
  int count = 0;
  Index rest = n;
  for (Index p = 2; p <= rest / p; ++p) {
    if (rest % p != 0) continue;
    primes[count] = p;
    while (rest % p == 0) {
      rest /= p;
      ++powers[count];
    }
    ++count;
  }
  if (rest > 1) {
    primes[count] = rest;
    powers[count] = 1;
    ++count;
  }
  // Depth-first over the exponents; every partial product divides n, so none overflows.
  Index best = 1;
  auto visit = [&](auto&& self, int index, Index divisor) -> void {
    if (index == count) {
      if (divisor <= limit && divisor > best) best = divisor;
      return;
    }
    Index value = divisor;
    for (int e = 0; e <= powers[index]; ++e) {
      if (value > limit) break;  // larger powers only grow
      self(self, index + 1, value);
      if (e < powers[index]) value *= primes[index];
    }
  };
  visit(visit, 0, 1);
  return best;
}

}  // namespace detail

/// The real-valued bound on d_c from an elements budget: B / l - d_R (seed 002:
/// 50,000 / 60 - 64 = 769.3).
constexpr double kv_rank_bound(Index rope_dim, Index layers, Index budget_elements) {
  detail::require(layers >= 1, "kv_rank_bound", "layers", layers, "must be >= 1");
  return static_cast<double>(budget_elements) / static_cast<double>(layers) -
         static_cast<double>(rope_dim);
}

/// The largest d_c, a multiple of `step`, such that MLA with the other fields of
/// `base` fits the budget over `layers` layers (seed 002: 50,000 elements, d_R 64,
/// l 60, step 32 -> 768). std::nullopt when not even d_c = step fits.
constexpr std::optional<Index> max_kv_rank(MlaConfig base, Index layers, const Budget& budget,
                                           const CacheStorage& storage = {}, Index step = 32) {
  check(budget);
  detail::require(step >= 1, "max_kv_rank", "step", step, "must be >= 1");
  detail::require(layers >= 1, "max_kv_rank", "layers", layers, "must be >= 1");
  // A d_c whose layer sizes cannot be represented (validate() refuses it) does not fit.
  auto fits_at = [&](Index k) {
    base.kv_rank = k * step;
    return detail::valid(base) && fits(cache_layout(base), layers, budget, storage);
  };
  // Each latent element costs >= 1 element and >= 1 byte per layer, so
  // d_c <= amount / layers bounds the search (amount / layers / step < INT64_MAX here).
  Index lo = 0;  // fits (vacuously: "none")
  Index hi = std::min(budget.amount / layers / step, std::numeric_limits<Index>::max() - 1) + 1;
  if (hi < 2 || !fits_at(1)) return std::nullopt;
  lo = 1;
  while (hi - lo > 1) {
    const Index mid = lo + (hi - lo) / 2;
    (fits_at(mid) ? lo : hi) = mid;
  }
  return lo * step;
}

/// The largest LRKV rank r in [0, d_h] such that LRKV with the other fields of `base`
/// fits the budget. std::nullopt when not even r = 0 fits.
constexpr std::optional<Index> max_lrkv_rank(LrkvConfig base, Index layers, const Budget& budget,
                                             const CacheStorage& storage = {}) {
  check(budget);
  auto fits_at = [&](Index r) {
    base.rank = r;
    return detail::valid(base) && fits(cache_layout(base), layers, budget, storage);
  };
  if (!fits_at(0)) return std::nullopt;
  Index lo = 0;                  // fits
  Index hi = base.head_dim + 1;  // beyond the valid range
  while (hi - lo > 1) {
    const Index mid = lo + (hi - lo) / 2;
    (fits_at(mid) ? lo : hi) = mid;
  }
  return lo;
}

/// The largest divisor n_kv of H such that GQA with the other fields of `base` fits
/// the budget. std::nullopt when not even MQA (n_kv = 1) fits. O(log H + sqrt(H)); the count
/// search never overflows: validate() bounds 2 * H * d_h.
constexpr std::optional<Index> max_kv_heads(GqaConfig base, Index layers, const Budget& budget,
                                            const CacheStorage& storage = {}) {
  check(budget);
  base.n_kv_heads = base.n_heads;
  base.validate();
  // The cost grows with n_kv, so first find the largest count n <= H that fits (any n,
  // divisor or not: 2n rows of d_h), then the largest divisor of H not above it.
  auto fits_at = [&](Index n) {
    const CacheLayout layout{{detail::mul(2, n, "2 * n_kv_heads"), base.head_dim}, {}, 0, 0};
    return fits(layout, layers, budget, storage);
  };
  if (!fits_at(1)) return std::nullopt;
  Index lo = 1;                 // fits
  Index hi = base.n_heads + 1;  // beyond the valid range
  while (hi - lo > 1) {
    const Index mid = lo + (hi - lo) / 2;
    (fits_at(mid) ? lo : hi) = mid;
  }
  if (lo == base.n_heads) return lo;
  return detail::largest_divisor_at_most(base.n_heads, lo);
}

}  // namespace kvattn::analysis
