// The layer calls that must refuse a non-finite row headed for a quantized cache, shared
// by the quantized-cache tests of every mechanism (each checks its own cache's append and
// stored bytes, then runs these).
#pragma once

#include <catch2/catch.hpp>

#include <limits>
#include <span>
#include <vector>

#include "kvattn/core/errors.hpp"
#include "kvattn/core/types.hpp"
#include "test_util.hpp"

namespace kvattn::test {

/// prefill, append, decode and decode_batch with an input whose projections are not
/// finite each throw value_error and leave `cache` as `unchanged()` checks it (its rows,
/// tokens, capacity, pool pages); then a finite token still decodes.
template <class Layer, class Cache, class Unchanged>
void check_layer_refusals(const Layer& layer, Cache& cache, Unchanged unchanged) {
  const Index d = layer.config().d_model;
  const Index tokens = cache.tokens();
  RowMatrix<float> x = random_input<float>(4, d, 5);
  x(2, 0) = std::numeric_limits<float>::infinity();  // projects to infinite (or NaN) rows
  CHECK_THROWS_AS(layer.prefill(x, cache), value_error);
  unchanged();
  CHECK_THROWS_AS(layer.append(x, cache), value_error);
  unchanged();
  RowVector<float> out(d);
  CHECK_THROWS_AS(layer.decode(x.row(2), cache, out), value_error);
  unchanged();
  Cache other = cache;
  std::vector<Cache*> pointers{&other, &cache};
  const RowMatrix<float> two = x.middleRows(1, 2);  // rows 1 (finite) and 2 (infinite)
  RowMatrix<float> two_out(2, d);
  CHECK_THROWS_AS(layer.decode_batch(two, std::span<Cache* const>(pointers), two_out), value_error);
  unchanged();
  CHECK(other.tokens() == tokens);
  layer.decode(x.row(1), cache, out);
  CHECK(cache.tokens() == tokens + 1);
  CHECK(out.allFinite());
}

}  // namespace kvattn::test
