// Which cached tokens a query sees (a sliding window with sink tokens) and how its
// logits are shaped (soft-cap, sink logit): the pieces the decode and prefill drivers
// share. reference::attention is the spec: a query at position p sees keys j <= p with
// j > p - W or j < k; a capped logit is c tanh(s / c); a sink logit z joins the
// denominator once, with no value.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvattn/core/types.hpp"

namespace kvattn::detail {

/// A layer's window (0: global) and sink tokens, and its soft-cap (0: off).
struct AttentionSpan {
  Index window = 0;
  Index sink_tokens = 0;
  double softcap = 0.0;

  template <class Config>
  static AttentionSpan of(const Config& c) {
    return {c.window, c.window > 0 ? c.sink_tokens : 0, c.logit_softcap};
  }
  /// The first key the window of a query at `position` holds (0 without a window).
  Index window_begin(Index position) const {
    return window > 0 ? std::max<Index>(0, position - window + 1) : 0;
  }
  /// Whether the query at `query` sees the key at `key` (key <= query assumed).
  bool sees(Index query, Index key) const {
    return window == 0 || key > query - window || key < sink_tokens;
  }
};

/// The keys the newest of `length` tokens sees: [0, sink_end) and [window_begin, length),
/// sink_end <= window_begin (both 0 without a window, or when the window reaches the sinks).
struct VisibleTokens {
  Index sink_end = 0;
  Index window_begin = 0;
  Index length = 0;

  Index count() const { return sink_end + length - window_begin; }
  /// The v-th visible token (v < count()).
  Index token(Index v) const { return v < sink_end ? v : window_begin + (v - sink_end); }
};

inline VisibleTokens visible_tokens(const AttentionSpan& span, Index length) {
  const Index begin = span.window_begin(length - 1);
  if (begin <= span.sink_tokens) return {0, 0, length};
  return {span.sink_tokens, begin, length};
}

/// s[0 .. n) = c tanh(s / c) (c > 0).
template <class T>
inline void cap_logits(T* s, Index n, T c) {
  auto a = Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>>(s, n);
  a = c * (a / c).tanh();
}

/// Folds a sink logit z (a key with no value) into one row's softmax state (max m,
/// normalizer l, accumulator acc[width]): the state then covers its keys and the sink.
template <class T>
inline void add_sink_logit(T z, T& m, T& l, T* acc, Index width) {
  if (m == -std::numeric_limits<T>::infinity() || z > m) {
    const T scale = m == -std::numeric_limits<T>::infinity() ? T(0) : std::exp(m - z);
    l *= scale;
    Eigen::Map<RowVector<T>>(acc, width) *= scale;
    m = z;
  }
  l += std::exp(z - m);
}

}  // namespace kvattn::detail
