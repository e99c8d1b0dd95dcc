// Shared by the bf16 dot-product tests (test_bf16_dot.cpp, test_bf16_dot_gqa.cpp,
// test_bf16_dot_lrkv.cpp): the accuracy DecodeArithmetic::bf16_dot states, its
// no-allocation check, and its check on paged caches and in decode_batch. Include after
// alloc_counter.hpp (which must come first in the test's translation unit).
#pragma once

#include <catch2/catch.hpp>

#include <cstdint>
#include <span>
#include <vector>

#include "alloc_counter.hpp"
#include "attend_util.hpp"
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

// decode, attend and decode_batch with DecodeArithmetic::bf16_dot on a paged bf16 cache
// (test_bf16_dot_gqa.cpp, test_bf16_dot_lrkv.cpp): a copy of `empty_root`, an empty
// paged cache of the layer, takes a prompt of 500 tokens (its pages cut the tiles); attend on it,
// decode on a fork of it, and decode_batch over four forks of it with the prompt as a shared prefix
// (each fork with a few tokens of its own, or none) are held to the stated accuracy
// against `reference(cache, query)`: the double reference step on the cache's stored
// rows for a query in double (the projected one for decode, then W_O).
template <class Layer, class Cache, class Reference>
void check_bf16_dot_paged_and_batch(const Layer& layer, const Cache& empty_root,
                                    Reference reference) {
  using MatF = RowMatrix<float>;
  using MatD = RowMatrix<double>;
  const auto dlayer = to_double(layer);
  const Index d_model = layer.config().d_model;
  const Index prompt = 500;
  const std::vector<Index> suffix{0, 3, 40, 1};
  Cache root = empty_root;
  layer.prefill(random_input<float>(prompt, d_model, 81), root);
  std::vector<Cache> caches;
  for (std::size_t s = 0; s < suffix.size(); ++s) {
    caches.push_back(root);  // a fork: shares every page of the prompt
    if (suffix[s] > 0)
      layer.prefill(random_input<float>(suffix[s], d_model, 90 + s), caches.back());
  }
  const MatF query = random_input<float>(1, layer.query_width(), 82);
  const MatF token = random_input<float>(1, d_model, 87);
  for (const Threads threads : {Threads{1}, Threads{2}}) {
    RowVector<float> heads(layer.heads_width());
    layer.attend(query, root, heads, threads);
    CAPTURE(threads.count);
    check_bf16_dot_error(relative_error(heads, reference(root, query.cast<double>())),
                         bf16_dot_available());
    // decode: the new token appended (to a fork of the prompt), then the step over all.
    Cache fork = root;
    const RowVector<float> out = layer.decode(token, fork, threads);
    const MatD decoded =
        reference(fork, project_query(dlayer, token.cast<double>())) * dlayer.weights().w_o;
    check_bf16_dot_error(relative_error(out, decoded), bf16_dot_available());
  }
  const Index batch = static_cast<Index>(caches.size());
  const MatF x = random_input<float>(batch, d_model, 83);
  MatF got(batch, d_model);
  std::vector<Cache*> pointers;
  for (auto& cache : caches) pointers.push_back(&cache);
  layer.decode_batch(x, std::span<Cache* const>(pointers), got, Threads{2}, BatchOptions{prompt});
  for (Index s = 0; s < batch; ++s) {
    const MatD q = project_query(dlayer, x.row(s).cast<double>());
    const MatD want = reference(caches[static_cast<std::size_t>(s)], q) * dlayer.weights().w_o;
    CAPTURE(s);
    check_bf16_dot_error(relative_error(got.row(s), want), bf16_dot_available());
  }
}

}  // namespace kvattn::test
