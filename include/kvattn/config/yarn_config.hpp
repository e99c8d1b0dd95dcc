// YaRN settings (Peng et al., 2023) for MLA's decoupled rope channel, and the two
// scalars the softmax scale needs from them. The frequencies are core/yarn.hpp.
#pragma once

#include <cmath>

#include "kvattn/config/rules.hpp"
#include "kvattn/core/index.hpp"

namespace kvattn {

/// YaRN settings (the `rope_scaling` block of a DeepSeek config.json with type "yarn").
struct YarnConfig {
  bool enabled = false;                // rope_scaling.type == "yarn"
  double factor = 1.0;                 // s, context extension factor (DeepSeek-V2: 40)
  Index original_max_position = 4096;  // L_orig, original_max_position_embeddings
  double beta_fast = 32.0;             // beta_fast, rotations at the fast end of the ramp
  double beta_slow = 1.0;              // beta_slow, rotations at the slow end of the ramp
  double mscale = 1.0;                 // mscale, numerator of the cos/sin amplitude
  double mscale_all_dim = 0.0;         // mscale_all_dim, gives m; 0 leaves the scale alone

  constexpr void validate(const char* where) const {
    if (!enabled) return;
    auto fail = [where](const char* field, double value, const char* rule) {
      detail::fail_config(where, ": yarn.", field, " (", value, ") ", rule);
    };
    if (!(factor >= 1.0) || !detail::is_finite(factor)) {
      fail("factor", factor, "must be finite and >= 1");
    }
    detail::require(original_max_position >= 1, where, "yarn.original_max_position",
                    original_max_position, "must be >= 1");
    if (!(beta_fast > 0.0) || !detail::is_finite(beta_fast)) {
      fail("beta_fast", beta_fast, "must be finite and > 0");
    }
    if (!(beta_slow > 0.0) || !(beta_slow < beta_fast)) {
      fail("beta_slow", beta_slow, "must be > 0 and < beta_fast");
    }
    if (!(mscale >= 0.0) || !detail::is_finite(mscale)) {
      fail("mscale", mscale, "must be finite and >= 0");
    }
    if (!(mscale_all_dim >= 0.0) || !detail::is_finite(mscale_all_dim)) {
      fail("mscale_all_dim", mscale_all_dim, "must be finite and >= 0");
    }
  }

  constexpr bool operator==(const YarnConfig&) const = default;
};

/// YaRN's magnitude correction mscale(s, a) = 0.1 * a * ln(s) + 1 for s > 1, else 1.
inline double yarn_mscale(double factor, double mscale) {
  return factor <= 1.0 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

/// The attention factor m = mscale(s, mscale_all_dim); the softmax scale is multiplied
/// by m^2. 1 when YaRN is off or mscale_all_dim is 0. DeepSeek-V2: 1.2608038.
inline double yarn_attention_factor(const YarnConfig& yarn) {
  if (!yarn.enabled || yarn.mscale_all_dim == 0.0) return 1.0;
  return yarn_mscale(yarn.factor, yarn.mscale_all_dim);
}

}  // namespace kvattn
