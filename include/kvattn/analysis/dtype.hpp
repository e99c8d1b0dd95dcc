// Storage types of a KV cache and their sizes, for the analytic module: the names of
// core/dtype.hpp (where the caches find them too) in namespace kvattn::analysis, so
// analysis code and its users write analysis::Dtype, analysis::bytes_per_element, ...
// Everything here is constexpr and free of Eigen.
#pragma once

#include "kvattn/core/dtype.hpp"

namespace kvattn::analysis {

using kvattn::bytes_per_element;
using kvattn::Dtype;
using kvattn::dtype_of;
using kvattn::parse_dtype;
using kvattn::to_string;

}  // namespace kvattn::analysis
