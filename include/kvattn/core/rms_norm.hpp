// RMSNorm, as used on MLA's latents and on LRKV's (and Qwen3's) keys.
#pragma once

#include <cmath>

#include "kvattn/core/types.hpp"

namespace kvattn {

/// Root mean square of x[0..n) with epsilon inside the root: sqrt(mean(x^2) + eps).
template <class T>
T rms(const T* x, Index n, double epsilon) {
  double sum_squares = 0;
  for (Index i = 0; i < n; ++i) sum_squares += static_cast<double>(x[i]) * x[i];
  return static_cast<T>(std::sqrt(sum_squares / static_cast<double>(n) + epsilon));
}

/// x <- (x / rms(x)) * gain, in place, for x of width n; returns rms(x).
/// `gain` points to n gains, or is nullptr for a unit gain.
template <class T>
T rms_norm_inplace(T* x, Index n, const T* gain, double epsilon) {
  const T root = rms(x, n, epsilon);
  const T inv = T(1) / root;
  for (Index i = 0; i < n; ++i) x[i] = x[i] * inv * (gain ? gain[i] : T(1));
  return root;
}

}  // namespace kvattn
