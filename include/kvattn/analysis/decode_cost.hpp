// What one decode step costs and how long it takes at a machine's limits (the roofline):
// the bytes it must read, the arithmetic it must do, and the larger of bytes / bandwidth
// and FLOPs / FLOP rate. Pure constexpr functions of a config, the cached length L and
// the cache's storage; kvattn_bench counts its steps with them, and kvcalc predicts a
// decode step per mechanism from a bandwidth (--bandwidth) and a FLOP rate (--flops).
//
// The attention step (layer.attend: projected query in, per-head outputs before W_O out)
// over L cached tokens:
//   bytes   the cache, L x bytes_per_token_per_layer, plus the weights the step reads:
//           MLA's W_UK and W_UV (the run-time absorption), LRKV's B^K and B^V
//   FLOPs   2 per multiply-add; exponentials, norms and RoPE are not counted:
//           GQA family  4 H L d_h                      (q.k and a v per head and token)
//           MLA         2 H d_nope d_c + 2 H d_c d_v   (absorb q through W_UK, out through W_UV)
//                       + L H (2 (d_c + d_R) + 2 d_c)  (score the row, accumulate the latent)
//           LRKV        L H (4 d_h + 4 r + 2 d_R)      (shared and latent scores and values,
//                                                        decoupled rope scores)
//                       + 4 H d_h r                    (q~ = q B^K and (a R^V) B^V^T)
// The whole layer step (layer.decode) adds every weight of the layer to the bytes and
// 2 FLOPs per weight (one multiply-add each), over L + 1 tokens.
#pragma once

#include <algorithm>
#include <limits>

#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/analysis/params.hpp"
#include "kvattn/config/gqa_config.hpp"
#include "kvattn/config/lrkv_config.hpp"
#include "kvattn/config/mla_config.hpp"
#include "kvattn/core/index.hpp"

namespace kvattn::analysis {

/// The work of one step: bytes read and floating-point operations.
struct StepCost {
  double bytes = 0.0;
  double flops = 0.0;
  constexpr bool operator==(const StepCost&) const = default;
};

/// A machine's limits: read bandwidth (bytes/s) and arithmetic rate (FLOP/s).
struct Machine {
  double bytes_per_second = 0.0;
  double flops_per_second = 0.0;
  constexpr bool operator==(const Machine&) const = default;
};

namespace detail {

constexpr void check(const Machine& m) {
  if (!(m.bytes_per_second > 0.0) || !(m.flops_per_second > 0.0) ||
      !kvattn::detail::is_finite(m.bytes_per_second) ||
      !kvattn::detail::is_finite(m.flops_per_second)) {
    kvattn::detail::fail_config("Machine: bytes_per_second (", m.bytes_per_second,
                                ") and flops_per_second (", m.flops_per_second,
                                ") must be finite and > 0");
  }
}

constexpr double cache_bytes(const CacheLayout& layout, const CacheStorage& storage, Index length) {
  kvattn::detail::require(length >= 0, "decode cost", "length", length, "must be >= 0");
  return static_cast<double>(bytes_per_token_per_layer(layout, storage)) *
         static_cast<double>(length);
}

constexpr double d(Index value) { return static_cast<double>(value); }

constexpr void check_weight_bytes(Index weight_bytes) {
  kvattn::detail::require(weight_bytes >= 1, "decode cost", "weight_bytes", weight_bytes,
                          "must be >= 1");
}

}  // namespace detail

/// The attention step over `length` cached tokens. `weight_bytes` is the size of one
/// weight element (the layer's compute type: 4 for float).
constexpr StepCost attend_cost(const GqaConfig& c, Index length, const CacheStorage& storage = {},
                               Index weight_bytes = 4) {
  detail::check_weight_bytes(weight_bytes);  // checked, though the GQA step reads no weight
  using detail::d;
  return {detail::cache_bytes(cache_layout(c), storage, length),
          4.0 * d(c.n_heads) * d(length) * d(c.head_dim)};
}

constexpr StepCost attend_cost(const MlaConfig& c, Index length, const CacheStorage& storage = {},
                               Index weight_bytes = 4) {
  detail::check_weight_bytes(weight_bytes);
  using detail::d;
  const double absorb = d(c.kv_rank) * d(c.n_heads) * d(c.qk_nope_dim + c.v_dim);  // W_UK, W_UV
  const double per_token = d(c.n_heads) * (2.0 * d(c.kv_rank + c.rope_dim) + 2.0 * d(c.kv_rank));
  return {detail::cache_bytes(cache_layout(c), storage, length) + absorb * d(weight_bytes),
          2.0 * absorb + d(length) * per_token};
}

constexpr StepCost attend_cost(const LrkvConfig& c, Index length, const CacheStorage& storage = {},
                               Index weight_bytes = 4) {
  detail::check_weight_bytes(weight_bytes);
  using detail::d;
  const double bases = 2.0 * d(c.head_dim) * d(c.n_heads) * d(c.rank);  // B^K, B^V
  const double per_token =
      d(c.n_heads) * (4.0 * d(c.head_dim) + 4.0 * d(c.rank) + 2.0 * d(c.decoupled_dim()));
  return {detail::cache_bytes(cache_layout(c), storage, length) + bases * d(weight_bytes),
          d(length) * per_token + 2.0 * bases};
}

/// The whole layer step (projections, append, attention over length + 1 tokens, W_O):
/// the attention step plus every weight read once and used in one multiply-add.
template <class Config>
constexpr StepCost decode_cost(const Config& c, Index length, const CacheStorage& storage = {},
                               Index weight_bytes = 4) {
  kvattn::detail::require(length >= 0 && length < std::numeric_limits<Index>::max(), "decode cost",
                          "length", length, "must be >= 0 and < 2^63 - 1 (the step adds a token)");
  const StepCost attention = attend_cost(c, length + 1, storage, weight_bytes);
  const double weights = static_cast<double>(attention_params(c));
  // attend_cost already counts the absorbed weights (MLA) and bases (LRKV) once.
  const StepCost absorbed = attend_cost(c, 0, storage, weight_bytes);
  return {attention.bytes - absorbed.bytes + weights * static_cast<double>(weight_bytes),
          attention.flops - absorbed.flops + 2.0 * weights};
}

/// The roofline time of a step: max(bytes / bandwidth, FLOPs / FLOP rate), in seconds.
constexpr double roofline_seconds(const StepCost& cost, const Machine& machine) {
  detail::check(machine);
  return std::max(cost.bytes / machine.bytes_per_second, cost.flops / machine.flops_per_second);
}

/// Whether the step is bound by memory (true) or arithmetic at this machine's limits.
constexpr bool memory_bound(const StepCost& cost, const Machine& machine) {
  detail::check(machine);
  return cost.bytes / machine.bytes_per_second >= cost.flops / machine.flops_per_second;
}

}  // namespace kvattn::analysis
