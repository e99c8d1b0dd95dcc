// The index type of every size and position in kvattn, without Eigen.
//
// Configs and the analytic module use it without pulling in Eigen; core/types.hpp
// checks that it is Eigen::Index (Eigen's default, std::ptrdiff_t).
#pragma once

#include <cstddef>

namespace kvattn {

/// Signed 64-bit on every platform kvattn targets; equal to Eigen::Index.
using Index = std::ptrdiff_t;

}  // namespace kvattn
