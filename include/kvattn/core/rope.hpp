// Rotary position embedding (RoPE) in the two layouts models use.
//
// A vector of width `dim` is split into dim/2 planes; plane i is rotated by the
// angle position * inv_freq[i], with inv_freq[i] = theta^(-2i/dim).
//   * half_split  (GPT-NeoX, Llama, Hugging Face): plane i pairs dims (i, i + dim/2).
//   * interleaved (GPT-J, Meta's original Llama, DeepSeek checkpoints):
//                 plane i pairs dims (2i, 2i + 1).
// Both define the same rotation up to a fixed permutation of the dims, so a model
// in one layout equals the model in the other after permuting its weights.
#pragma once

#include <cmath>
#include <vector>

#include "kvattn/config/rope_config.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn {

/// Standard inverse frequencies theta^(-2i/dim), i = 0 ... dim/2 - 1. Throws
/// config_error unless dim is even and > 0 and theta finite and > 1.
inline std::vector<double> rope_inverse_frequencies(Index dim, double theta) {
  if (dim <= 0 || dim % 2 != 0) {
    throw config_error("rope_inverse_frequencies: rotary width (" + std::to_string(dim) +
                       ") must be even and > 0");
  }
  if (!(theta > 1.0) || !std::isfinite(theta)) {
    throw config_error("rope_inverse_frequencies: theta (" + std::to_string(theta) +
                       ") must be finite and > 1");
  }
  std::vector<double> inv_freq(static_cast<std::size_t>(dim / 2));
  for (Index i = 0; i < dim / 2; ++i) {
    inv_freq[static_cast<std::size_t>(i)] =
        std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(dim));
  }
  return inv_freq;
}

/// Rotates vectors of width dim() in place. Immutable after construction.
class Rope {
 public:
  Rope() = default;

  /// Standard RoPE of width `dim` (even) with the layout and theta of `config`.
  /// Throws config_error for an odd or non-positive width (checked before anything is
  /// allocated) or an invalid config.
  Rope(const RopeConfig& config, Index dim) : Rope(config.layout, frequencies(config, dim)) {}

  /// RoPE with explicit inverse frequencies (one per plane, so dim = 2 * size) and
  /// an amplitude multiplying cos and sin (YaRN's attention factor; 1 otherwise).
  Rope(RopeLayout layout, std::vector<double> inv_freq, double amplitude = 1.0)
      : layout_(layout), inv_freq_(std::move(inv_freq)), amplitude_(amplitude) {}

  RopeLayout layout() const { return layout_; }
  bool enabled() const { return layout_ != RopeLayout::none; }
  Index dim() const { return 2 * static_cast<Index>(inv_freq_.size()); }
  const std::vector<double>& inverse_frequencies() const { return inv_freq_; }
  double amplitude() const { return amplitude_; }

  /// Rotates `count` vectors of width dim(), the k-th at data + k * stride, all at
  /// `position`. The angles are computed once, in double, and shared by the vectors.
  template <class T>
  void rotate(T* data, double position, Index count = 1, Index stride = 0) const {
    if (!enabled()) return;
    const Index planes = dim() / 2;
    for (Index i = 0; i < planes; ++i) {
      const double angle = position * inv_freq_[static_cast<std::size_t>(i)];
      const T c = static_cast<T>(amplitude_ * std::cos(angle));
      const T s = static_cast<T>(amplitude_ * std::sin(angle));
      const Index a = layout_ == RopeLayout::half_split ? i : 2 * i;
      const Index b = layout_ == RopeLayout::half_split ? i + planes : 2 * i + 1;
      for (Index k = 0; k < count; ++k) {
        T* v = data + k * stride;
        const T x = v[a];
        const T y = v[b];
        v[a] = x * c - y * s;
        v[b] = x * s + y * c;
      }
    }
  }

  /// Rotates one row vector of width dim() in place; shape_error for another width
  /// (a disabled Rope leaves any vector as it is).
  template <class T>
  void rotate(RowVector<T>& v, double position) const {
    if (!enabled()) return;
    if (v.cols() != dim()) {
      throw shape_error("Rope::rotate: the vector has " + std::to_string(v.cols()) +
                        " entries, expected the rotary width " + std::to_string(dim()));
    }
    rotate(v.data(), position);
  }

 private:
  static std::vector<double> frequencies(const RopeConfig& config, Index dim) {
    config.validate("Rope");
    if (!config.enabled()) return {};
    if (dim <= 0 || dim % 2 != 0) {
      throw config_error("Rope: rotary width (" + std::to_string(dim) + ") must be even and > 0");
    }
    return rope_inverse_frequencies(dim, config.theta);
  }

  RopeLayout layout_ = RopeLayout::none;
  std::vector<double> inv_freq_;
  double amplitude_ = 1.0;
};

/// The permutation taking an interleaved-layout vector to the half-split layout:
/// half_split[j] = interleaved[perm[j]]. Apply it to the output columns of a
/// query/key projection to convert weights between the two layouts. config_error unless
/// dim is even and > 0.
inline std::vector<Index> interleaved_to_half_split(Index dim) {
  if (dim <= 0 || dim % 2 != 0) {
    throw config_error("interleaved_to_half_split: rotary width (" + std::to_string(dim) +
                       ") must be even and > 0");
  }
  std::vector<Index> perm(static_cast<std::size_t>(dim));
  for (Index i = 0; i < dim / 2; ++i) {
    perm[static_cast<std::size_t>(i)] = 2 * i;
    perm[static_cast<std::size_t>(i + dim / 2)] = 2 * i + 1;
  }
  return perm;
}

}  // namespace kvattn
