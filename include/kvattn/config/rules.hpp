// Rules every mechanism config shares: finite scalars, the softmax-scale rule, and
// derived sizes that must be representable. All constexpr; only the throwing branch
// (config_error) is not constant.
#pragma once

#include <cmath>
#include <limits>

#include "kvattn/core/checked.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/index.hpp"

namespace kvattn::detail {

/// std::isfinite, usable in constant expressions.
constexpr bool is_finite(double x) {
  return x == x && x != std::numeric_limits<double>::infinity() &&
         x != -std::numeric_limits<double>::infinity();
}

/// The softmax_scale field of every config: 0 selects the default, anything else must
/// be finite and > 0.
constexpr void check_softmax_scale(const char* where, double softmax_scale,
                                   const char* default_rule) {
  if (!(softmax_scale >= 0.0) || !is_finite(softmax_scale)) {
    fail_config(where, ": softmax_scale (", softmax_scale, ") must be finite and >= 0 (0 selects ",
                default_rule, ")");
  }
}

/// The fields every mechanism shares for which keys a query sees and how its logits are
/// shaped: window (W >= 0, 0 = global), sink_tokens (k >= 0, needs a window: with global
/// attention every token stays visible anyway), logit_softcap (c >= 0, finite).
constexpr void check_attention_span(const char* where, Index window, Index sink_tokens,
                                    double logit_softcap) {
  require(window >= 0, where, "window", window, "must be >= 0 (0 means global attention)");
  require(sink_tokens >= 0, where, "sink_tokens", sink_tokens, "must be >= 0");
  if (sink_tokens > 0 && window == 0) {
    fail_config(where, ": sink_tokens (", sink_tokens,
                ") needs a window (window > 0): with global attention every token stays visible");
  }
  if (!(logit_softcap >= 0.0) || !is_finite(logit_softcap)) {
    fail_config(where, ": logit_softcap (", logit_softcap,
                ") must be finite and >= 0 (0 means no soft-capping)");
  }
}

/// The one softmax-scale rule: the explicit scale when set (> 0), else
/// factor / sqrt(width), where width is the width of the dotted query/key vectors.
inline double softmax_scale_or_default(double softmax_scale, Index width, double factor = 1.0) {
  if (softmax_scale > 0.0) return softmax_scale;
  return factor / std::sqrt(static_cast<double>(width));
}

/// a * b for two sizes named in `what` ("n_heads x head_dim"); config_error unless the
/// product, and its size in bytes of the widest scalar (8), fit in a signed 64-bit Index.
constexpr Index size_product(const char* where, const char* what, Index a, Index b) {
  const auto product = checked_mul(a, b);
  if (!product || !checked_mul(*product, kMaxScalarBytes)) {
    fail_config(where, ": ", what, " (", a, " x ", b,
                ") does not fit in a signed 64-bit size in bytes; the dimensions are too large");
  }
  return *product;
}

/// a + b for two sizes named in `what`; config_error on overflow, as size_product.
constexpr Index size_sum(const char* where, const char* what, Index a, Index b) {
  const auto sum = checked_add(a, b);
  if (!sum || !checked_mul(*sum, kMaxScalarBytes)) {
    fail_config(where, ": ", what, " (", a, " + ", b,
                ") does not fit in a signed 64-bit size in bytes; the dimensions are too large");
  }
  return *sum;
}

}  // namespace kvattn::detail
