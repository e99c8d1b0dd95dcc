// Seeded random weights for tests, benchmarks and examples.
//
// Draws come from std::mt19937_64 and std::normal_distribution, so a seed gives
// the same weights on every run with the same standard library (libstdc++ and
// libc++ may differ from each other).
#pragma once

#include <cmath>
#include <cstdint>
#include <random>

#include "kvattn/core/types.hpp"

namespace kvattn {

/// A weight matrix `in x out` drawn from N(0, 1/fan_in) with fan_in = in, so a
/// projection of unit-variance inputs has unit-variance outputs and logits stay O(1).
template <class T>
RowMatrix<T> random_weight(Index in, Index out, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0 / std::sqrt(static_cast<double>(in)));
  RowMatrix<T> w(in, out);
  for (Index i = 0; i < w.size(); ++i) w.data()[i] = static_cast<T>(normal(rng));
  return w;
}

/// A matrix with entries from N(0, stddev^2) (inputs, biases).
template <class T>
RowMatrix<T> random_normal(Index rows, Index cols, std::mt19937_64& rng, double stddev = 1.0) {
  std::normal_distribution<double> normal(0.0, stddev);
  RowMatrix<T> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<T>(normal(rng));
  return m;
}

}  // namespace kvattn
