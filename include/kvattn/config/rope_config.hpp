// RoPE settings of a layer (the rotation itself is core/rope.hpp).
#pragma once

#include "kvattn/config/rules.hpp"
#include "kvattn/core/index.hpp"

namespace kvattn {

enum class RopeLayout {
  none,         ///< no rotation
  half_split,   ///< pairs (i, i + dim/2): GPT-NeoX, Llama, Hugging Face
  interleaved,  ///< pairs (2i, 2i + 1): GPT-J, Meta's original Llama, DeepSeek checkpoints
};

/// RoPE settings of a layer. Token t of a cache sits at position
/// `position_offset + t` (offset > 0 continues a sequence whose start is not cached).
struct RopeConfig {
  RopeLayout layout = RopeLayout::none;
  double theta = 10000.0;     ///< base of the inverse frequencies
  Index position_offset = 0;  ///< position of the cache's first token

  /// Largest position_offset: positions are computed in double, exact up to 2^53.
  static constexpr Index kMaxPositionOffset = Index{1} << 53;

  constexpr bool enabled() const { return layout != RopeLayout::none; }

  constexpr void validate(const char* where) const {
    if (layout != RopeLayout::none && layout != RopeLayout::half_split &&
        layout != RopeLayout::interleaved) {
      detail::fail_config(where, ": rope.layout (", static_cast<int>(layout),
                          ") is not a RopeLayout (none, half_split or interleaved)");
    }
    if (!enabled()) return;
    if (!(theta > 1.0) || !detail::is_finite(theta)) {
      detail::fail_config(where, ": rope.theta (", theta, ") must be finite and > 1");
    }
    detail::require(position_offset >= 0 && position_offset <= kMaxPositionOffset, where,
                    "rope.position_offset", position_offset,
                    "must be in [0, 2^53] (positions are exact in double up to 2^53)");
  }

  constexpr bool operator==(const RopeConfig&) const = default;
};

}  // namespace kvattn
