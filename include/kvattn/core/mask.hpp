// Attention masks over sequence positions.
#pragma once

#include <string>

#include "kvattn/core/errors.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn {

enum class MaskKind {
  causal,          ///< token t sees keys 0 ... t
  bidirectional,   ///< every token sees every key
  sliding_window,  ///< token t sees keys t-W+1 ... t (W = window, itself included), and
                   ///< keys 0 ... k-1 (k = sink_tokens) when they are not after t
};

/// Which keys a query may attend to. Positions are indices in one sequence.
struct Mask {
  MaskKind kind = MaskKind::causal;
  Index window = 0;       ///< W, only for sliding_window: number of visible keys, >= 1
  Index sink_tokens = 0;  ///< k, only for sliding_window: the first k keys stay visible

  static Mask causal() { return {MaskKind::causal, 0, 0}; }
  static Mask bidirectional() { return {MaskKind::bidirectional, 0, 0}; }
  static Mask sliding_window(Index window, Index sink_tokens = 0) {
    Mask mask{MaskKind::sliding_window, window, sink_tokens};
    mask.validate();
    return mask;
  }
  /// A layer's causal mask: sliding_window(window, sink_tokens), or causal when window is
  /// 0 (global attention).
  static Mask of_layer(Index window, Index sink_tokens) {
    return window > 0 ? sliding_window(window, sink_tokens) : causal();
  }

  void validate() const {
    if (kind == MaskKind::sliding_window) {
      detail::require(window >= 1, "Mask", "window", window, "must be >= 1 for a sliding window");
      detail::require(sink_tokens >= 0, "Mask", "sink_tokens", sink_tokens, "must be >= 0");
    }
  }

  /// Whether the query at `query_pos` may attend to the key at `key_pos`.
  bool visible(Index query_pos, Index key_pos) const {
    switch (kind) {
      case MaskKind::bidirectional:
        return true;
      case MaskKind::sliding_window:
        return key_pos <= query_pos && (key_pos > query_pos - window || key_pos < sink_tokens);
      case MaskKind::causal:
        break;
    }
    return key_pos <= query_pos;
  }

  bool operator==(const Mask&) const = default;
};

}  // namespace kvattn
