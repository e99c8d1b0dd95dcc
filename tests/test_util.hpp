// Helpers shared by the tests: error measures and reproducible inputs.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <string>

#include "kvattn/core/random.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn::test {

/// Normwise relative error ||y - y_ref||_F / ||y_ref||_F, computed in double.
/// (Element-wise relative error is meaningless near zero.)
template <class A, class B>
double relative_error(const A& y, const B& y_ref) {
  const auto yd = y.template cast<double>();
  const auto rd = y_ref.template cast<double>();
  const double denominator = rd.norm();
  return denominator == 0.0 ? (yd - rd).norm() : (yd - rd).norm() / denominator;
}

/// Largest absolute element-wise difference, for failure messages.
template <class A, class B>
double max_abs_error(const A& y, const B& y_ref) {
  return (y.template cast<double>() - y_ref.template cast<double>()).cwiseAbs().maxCoeff();
}

/// L x d input with N(0, 1) entries.
template <class T>
RowMatrix<T> random_input(Index rows, Index cols, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  return random_normal<T>(rows, cols, rng);
}

/// Tolerance on the normwise relative error for compute type T against a double reference.
template <class T>
constexpr double tolerance() {
  return sizeof(T) == sizeof(double) ? 1e-12 : 1e-5;
}

}  // namespace kvattn::test
