// The dense attention kernel every expanded reference is built on: the spec in code.
#pragma once

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "kvattn/core/errors.hpp"
#include "kvattn/core/mask.hpp"
#include "kvattn/core/softmax.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn::reference {

/// How a head's logits are shaped after scaling, in the plainest form:
///   softcap  c > 0: every scaled logit s becomes c tanh(s / c) (Gemma 2); 0: off
///   sink     a logit z that joins the softmax with no value (GPT-OSS's learned sink):
///            weights exp(s_j) / (sum_j exp(s_j) + exp(z)); not scaled, not capped
struct LogitShaping {
  double softcap = 0.0;
  std::optional<double> sink;
};

/// The logit shaping of head h of a layer: its config's soft-cap, and its sink logit
/// (weights.sinks(h)) when the config has sink logits.
template <class Config, class Weights>
LogitShaping shaping_of(const Config& config, const Weights& weights, Index h) {
  LogitShaping shaping;
  shaping.softcap = config.logit_softcap;
  if (config.sink_logits) shaping.sink = static_cast<double>(weights.sinks(h));
  return shaping;
}

/// A layer's own mask: causal, or its sliding window with its sink tokens.
template <class Config>
Mask mask_of(const Config& config) {
  return Mask::of_layer(config.window, config.sink_tokens);
}

/// softmax(shape(scale * q * k^T), masked) * v for one head, materializing the scores.
///   q  Lq x dk   (query i at position query_offset + i)
///   k  Lk x dk   (key j at position key_positions[j], or j when key_positions is empty)
///   v  Lk x dv
///   result Lq x dv
template <class T>
RowMatrix<T> attention(const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                       const ConstMatrixRef<T>& v, T scale, const Mask& mask,
                       Index query_offset = 0, const LogitShaping& shaping = {},
                       const std::vector<Index>& key_positions = {}) {
  mask.validate();
  detail::check_shape("reference::attention", "k", k, -1, q.cols());
  detail::check_shape("reference::attention", "v", v, k.rows(), -1);
  if (!key_positions.empty() && static_cast<Index>(key_positions.size()) != k.rows()) {
    throw shape_error("reference::attention: key_positions has " +
                      std::to_string(key_positions.size()) + " entries, expected " +
                      std::to_string(k.rows()));
  }
  auto position = [&](Index j) {
    return key_positions.empty() ? j : key_positions[static_cast<std::size_t>(j)];
  };
  const Index keys = k.rows();
  // One more column for the sink logit (-inf without one: weight 0).
  RowMatrix<T> scores(q.rows(), keys + 1);
  scores.leftCols(keys) = scale * (q * k.transpose());
  for (Index i = 0; i < scores.rows(); ++i) {
    for (Index j = 0; j < keys; ++j) {
      if (!mask.visible(query_offset + i, position(j))) {
        scores(i, j) = -std::numeric_limits<T>::infinity();
      } else if (shaping.softcap > 0.0) {
        const T c = static_cast<T>(shaping.softcap);
        scores(i, j) = c * std::tanh(scores(i, j) / c);
      }
    }
    scores(i, keys) =
        shaping.sink ? static_cast<T>(*shaping.sink) : -std::numeric_limits<T>::infinity();
  }
  softmax_rows_inplace(scores);
  // Sum over visible keys only: a masked weight is 0, and 0 * (an invisible token's
  // NaN or inf) must not reach the output.
  RowMatrix<T> out = RowMatrix<T>::Zero(q.rows(), v.cols());
  for (Index i = 0; i < scores.rows(); ++i) {
    for (Index j = 0; j < keys; ++j) {
      if (mask.visible(query_offset + i, position(j))) out.row(i) += scores(i, j) * v.row(j);
    }
  }
  return out;
}

}  // namespace kvattn::reference
