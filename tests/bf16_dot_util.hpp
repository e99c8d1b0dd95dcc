// Shared by the bf16 dot-product tests (test_bf16_dot.cpp, test_bf16_dot_gqa.cpp): the
// accuracy DecodeArithmetic::bf16_dot states, and its no-allocation check. Include after
// alloc_counter.hpp (which must come first in the test's translation unit).
#pragma once

#include <catch2/catch.hpp>

#include <cstdint>
#include <span>
#include <vector>

#include "alloc_counter.hpp"
#include "kvattn/core/threads.hpp"
#include "kvattn/core/types.hpp"
#include "test_util.hpp"

namespace kvattn::test {

// Rounding the query (MLA: the absorbed query) to bf16 (u = 2^-8, round to nearest) moves
// logit s_t by at most u * sum_i |q_i k_t,i|, the bound a bf16 key's rounding has in
// test_storage_bf16.cpp, and rounding the softmax weights moves the output by at most u
// relative (a combination of values with weights each off by <= u), the bound of a bf16
// value's rounding there. By that file's argument (independent errors add in quadrature,
// ~u in all) the outputs stay within 4u = 2^-6 of the reference on the stored rows.
inline constexpr double kBf16DotTolerance = 1.0 / 64.0;
// The float paths of the suite agree with double references to 1e-5 (test_util.hpp).
inline constexpr double kFloatTolerance = 1e-5;

// A bf16 dot step's relative error against the double reference on the stored rows:
// where the dot kernels run, within the stated bound and above float rounding (the query
// or the weights were rounded, so they did run; a cache of one token shows nothing, its
// weight is 1 whatever its logit); elsewhere, float arithmetic's.
inline void check_bf16_dot_error(double error, bool kernels_run) {
  CAPTURE(error, kernels_run);
  if (kernels_run) {
    CHECK(error <= kBf16DotTolerance);
    CHECK(error >= 1e-5);
  } else {
    CHECK(error <= kFloatTolerance);
  }
}

// The rounded query and weights live in the workspace and the split scratch: with a
// workspace sized by make_workspace and warmed by a step, decode, attend and decode_batch
// on bf16 caches allocate nothing, as test_decode_noalloc.cpp checks for the float
// arithmetic. `fill(cache, length, seed)` appends `length` random tokens.
template <class Layer, class Fill>
void check_bf16_dot_steps_allocate_nothing(const Layer& layer, Fill fill, std::uint64_t seed) {
  using Cache = typename Layer::template cache_type<Eigen::bfloat16>;
  constexpr Index kSteps = 8;
  const Index d_model = layer.config().d_model;
  for (const Threads threads : {Threads{1}, Threads{2}}) {
    std::vector<Cache> caches;
    for (const Index length : {1000, 300}) {
      caches.push_back(layer.template make_cache<Eigen::bfloat16>(length + 2 * kSteps + 2));
      fill(caches.back(), length, seed + static_cast<std::uint64_t>(length));
    }
    std::vector<Cache*> pointers{&caches[0], &caches[1]};
    const std::span<Cache* const> batch(pointers);
    const RowMatrix<float> x = random_input<float>(2, d_model, seed + 1);
    const RowMatrix<float> query = random_input<float>(1, layer.query_width(), seed + 2);
    RowVector<float> out(d_model), heads(layer.heads_width());
    RowMatrix<float> batch_out(2, d_model);
    auto workspace = layer.make_workspace(threads);
    // The warm-up: the OpenMP team, and the workspace's batch plan for these caches.
    layer.decode(x.row(0), caches[0], out, workspace, threads);
    layer.decode_batch(x, batch, batch_out, workspace, threads);
    const auto count = count_allocations([&] {
      for (Index i = 0; i < kSteps; ++i) {
        layer.decode(x.row(0), caches[0], out, workspace, threads);
        layer.attend(query, caches[0], heads, workspace, threads);
        layer.decode_batch(x, batch, batch_out, workspace, threads);
      }
    });
    CAPTURE(threads.count);
    CHECK(count.operator_new == 0);
    CHECK_FALSE(count.eigen_malloc);
    CHECK(out.allFinite());
    CHECK(heads.allFinite());
    CHECK(batch_out.allFinite());
  }
}

}  // namespace kvattn::test
