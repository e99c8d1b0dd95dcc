// How many threads a layer call may use (OpenMP, optional).
#pragma once

#include <algorithm>
#include <exception>
#include <string>

#include "kvattn/core/errors.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/detail/batch_product.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace kvattn {

/// True when kvattn was compiled with OpenMP (the kvattn::kvattn target links it
/// when CMake finds it; see docs/building.md). Without it every call runs on the
/// calling thread, whatever Threads asks for.
inline constexpr bool have_openmp =
#ifdef _OPENMP
    true;
#else
    false;
#endif

/// Threads a decode, attend or prefill call may use: `count` threads, or every
/// available one (OpenMP's omp_get_max_threads(), at most kMax) when count is 0. The
/// default, one thread, never starts a parallel region. A count above kMax is a
/// config_error rather than a request to the OpenMP runtime: libgomp ends the process
/// when it cannot create the threads or their stacks, so an unbounded count from a
/// caller would be a crash, not an error.
struct Threads {
  int count = 1;

  /// The most threads one call may ask for (the per-thread scratch is sized by it).
  static constexpr int kMax = 256;

  static constexpr Threads all() { return Threads{0}; }

  /// The number of threads the call will run: count, or all available (at most kMax)
  /// when 0; always 1 without OpenMP. Throws config_error unless 0 <= count <= kMax.
  int resolved() const {
    if (count < 0 || count > kMax) {
      throw config_error("Threads: count (" + std::to_string(count) + ") must be in [1, " +
                         std::to_string(kMax) + "], or 0 for all available threads");
    }
#ifdef _OPENMP
    return count == 0 ? std::clamp(omp_get_max_threads(), 1, kMax) : count;
#else
    return 1;
#endif
  }
};

namespace detail {
/// The index of the calling thread inside a kvattn parallel region (0 outside).
inline int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

/// f(0) ... f(n - 1), spread over `threads` threads (static schedule). An exception
/// thrown by f (say std::bad_alloc in a prefill) cannot cross an OpenMP region: the
/// first one is caught, the remaining iterations still run, and it is rethrown here.
template <class F>
void parallel_for(Index n, int threads, F&& f) {
#ifdef _OPENMP
  if (threads > 1 && n > 1) {
    std::exception_ptr error;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (Index i = 0; i < n; ++i) {
      try {
        f(i);
      } catch (...) {
#pragma omp critical(kvattn_parallel_for_error)
        if (!error) error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
#endif
  (void)threads;
  for (Index i = 0; i < n; ++i) f(i);
}

/// out = a * b with b's columns split over `threads` threads (Eigen's own products
/// stay serial under kvattn: EIGEN_DONT_PARALLELIZE); a few rows of a take
/// detail::batch_product (batch_product.hpp). out must be a.rows() x b.cols().
template <class A, class B, class Out>
void parallel_product(const A& a, const B& b, Out&& out, int threads) {
  const Index cols = b.cols();
  const Index blocks = threads > 1 ? std::min<Index>(threads, std::max<Index>(1, cols / 64)) : 1;
  if (blocks <= 1) {
    product(a, b, out);
    return;
  }
  const Index per_block = (cols + blocks - 1) / blocks;
  parallel_for(blocks, threads, [&](Index k) {
    const Index first = k * per_block;
    const Index count = std::min(per_block, cols - first);
    if (count > 0) product(a, b.middleCols(first, count), out.middleCols(first, count));
  });
}

}  // namespace detail

}  // namespace kvattn
