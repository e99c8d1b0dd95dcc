// YaRN context extension for RoPE (Peng et al., 2023), in the form DeepSeek-V2 and
// DeepSeek-V3 apply it to MLA's decoupled rope channel (seed 002, Chapter 3: "YaRN is
// applied specifically to the decoupled shared key k_t^R"; the cached latent c_kv never
// changes with YaRN).
//
// Three effects, each a function of YarnConfig alone:
//   1. Inverse frequencies. Plane i of a width-`dim` rotary vector has the standard
//      frequency f_i = theta^(-2i/dim) ("extrapolation") and the interpolated one
//      f_i / factor. A linear ramp over the correction range [low, high] blends them:
//        ramp_i = clamp((i - low) / (high - low), 0, 1),
//        inv_freq_i = f_i * (1 - ramp_i) + (f_i / factor) * ramp_i,
//      so fast planes (i <= low) keep f_i and slow planes (i >= high) are divided by
//      `factor`. The range comes from the planes that turn beta_fast and beta_slow
//      times over the original context:
//        dim(r) = dim * ln(original / (2 pi r)) / (2 ln theta),
//        low = max(floor(dim(beta_fast)), 0), high = min(ceil(dim(beta_slow)), dim - 1).
//   2. An amplitude on cos and sin: mscale(factor, mscale) / mscale(factor, mscale_all_dim),
//      with mscale(s, a) = 0.1 * a * ln(s) + 1 for s > 1 and 1 otherwise. It is 1 for
//      both DeepSeek-V2 (0.707 / 0.707) and DeepSeek-V3 (1.0 / 1.0).
//   3. The attention factor m = mscale(factor, mscale_all_dim): the softmax scale is
//      multiplied by m^2, so the whole logit (content and rope parts) is scaled.
// These match Hugging Face's DeepseekV2YarnRotaryEmbedding (yarn_find_correction_range,
// yarn_linear_ramp_mask, yarn_get_mscale) computed in double instead of float32.
#pragma once

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>
#include <utility>
#include <vector>

#include "kvattn/config/yarn_config.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/rope.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn {

/// The (fractional) plane index whose rotary frequency turns `rotations` times over
/// `original_max_position` positions: dim * ln(original / (2 pi r)) / (2 ln theta).
inline double yarn_correction_dim(double rotations, Index dim, double theta,
                                  Index original_max_position) {
  return static_cast<double>(dim) *
         std::log(static_cast<double>(original_max_position) /
                  (rotations * 2.0 * std::numbers::pi)) /
         (2.0 * std::log(theta));
}

/// The correction range [low, high] of planes over which the ramp blends
/// extrapolated and interpolated frequencies (DeepSeek-V2 with d_R = 64: 10 ... 23).
inline std::pair<Index, Index> yarn_correction_range(Index dim, double theta,
                                                     const YarnConfig& yarn) {
  const auto low = static_cast<Index>(
      std::floor(yarn_correction_dim(yarn.beta_fast, dim, theta, yarn.original_max_position)));
  const auto high = static_cast<Index>(
      std::ceil(yarn_correction_dim(yarn.beta_slow, dim, theta, yarn.original_max_position)));
  return {std::max(low, Index{0}), std::min(high, dim - 1)};
}

/// YaRN inverse frequencies of a rotary vector of width `dim` (dim/2 planes); equal to
/// rope_inverse_frequencies(dim, theta) when YaRN is off.
inline std::vector<double> yarn_inverse_frequencies(Index dim, double theta,
                                                    const YarnConfig& yarn) {
  std::vector<double> inv_freq = rope_inverse_frequencies(dim, theta);
  if (!yarn.enabled) return inv_freq;
  const auto [low, high] = yarn_correction_range(dim, theta, yarn);
  // Hugging Face widens an empty range by 0.001 to avoid dividing by zero.
  const double lo = static_cast<double>(low);
  const double hi = high == low ? lo + 0.001 : static_cast<double>(high);
  for (std::size_t i = 0; i < inv_freq.size(); ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - lo) / (hi - lo), 0.0, 1.0);
    const double extrapolated = inv_freq[i];
    const double interpolated = inv_freq[i] / yarn.factor;
    inv_freq[i] = interpolated * ramp + extrapolated * (1.0 - ramp);
  }
  return inv_freq;
}

/// The amplitude multiplying cos and sin: mscale(s, mscale) / mscale(s, mscale_all_dim)
/// (1 when YaRN is off, and 1 for DeepSeek-V2 and V3).
inline double yarn_rope_amplitude(const YarnConfig& yarn) {
  if (!yarn.enabled) return 1.0;
  return yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim);
}

/// The rotary embedding of width `dim` for `rope` with YaRN applied when enabled;
/// config_error for an invalid rope or YaRN setting or width.
inline Rope make_rope(const RopeConfig& rope, Index dim, const YarnConfig& yarn) {
  if (!rope.enabled() || !yarn.enabled) return Rope(rope, dim);
  rope.validate("make_rope");
  yarn.validate("make_rope");
  if (dim <= 0 || dim % 2 != 0) {
    throw config_error("make_rope: rotary width (" + std::to_string(dim) +
                       ") must be even and > 0");
  }
  return Rope(rope.layout, yarn_inverse_frequencies(dim, rope.theta, yarn),
              yarn_rope_amplitude(yarn));
}

}  // namespace kvattn
