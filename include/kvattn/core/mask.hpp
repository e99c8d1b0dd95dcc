// Attention masks over sequence positions.
#pragma once

#include <string>

#include "kvattn/core/errors.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn {

enum class MaskKind {
  causal,          ///< token t sees keys 0 ... t
  bidirectional,   ///< every token sees every key
  sliding_window,  ///< token t sees keys t-W+1 ... t (W = window, itself included)
};

/// Which keys a query may attend to. Positions are indices in one sequence.
struct Mask {
  MaskKind kind = MaskKind::causal;
  Index window = 0;  ///< W, only for sliding_window: number of visible keys, >= 1

  static Mask causal() { return {MaskKind::causal, 0}; }
  static Mask bidirectional() { return {MaskKind::bidirectional, 0}; }
  static Mask sliding_window(Index window) {
    Mask mask{MaskKind::sliding_window, window};
    mask.validate();
    return mask;
  }

  void validate() const {
    if (kind == MaskKind::sliding_window) {
      detail::require(window >= 1, "Mask", "window", window, "must be >= 1 for a sliding window");
    }
  }

  /// Whether the query at `query_pos` may attend to the key at `key_pos`.
  bool visible(Index query_pos, Index key_pos) const {
    switch (kind) {
      case MaskKind::bidirectional:
        return true;
      case MaskKind::sliding_window:
        return key_pos <= query_pos && key_pos > query_pos - window;
      case MaskKind::causal:
        break;
    }
    return key_pos <= query_pos;
  }

  bool operator==(const Mask&) const = default;
};

}  // namespace kvattn
