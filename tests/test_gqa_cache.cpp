// [cache][gqa]: what the GQA cache holds, how it grows, forks and rolls back.
#include <catch2/catch.hpp>

#include <limits>

#include "kvattn/attention/gqa.hpp"
#include "kvattn/cache/kv_cache.hpp"
#include "kvattn/reference/gqa.hpp"
#include "test_util.hpp"

using namespace kvattn;

static_assert(KVCache<GqaCache<float>>);
static_assert(KVCache<GqaCache<double>>);
static_assert(KVCache<GqaCache<double, float>>);

TEST_CASE("GQA cache bytes are 2 * n_kv * d_h * L * sizeof(S)", "[cache][gqa]") {
  for (const Index n_kv : {1, 2, 4, 8}) {
    const auto config = gqa_config(64, 8, 16, n_kv);
    const auto layer = GqaLayer<float>::random(config, 1);
    auto cache = layer.make_cache();
    const Index length = 37;
    layer.prefill(kvattn::test::random_input<float>(length, 64, 2), cache);
    const std::size_t expected = 2u * static_cast<std::size_t>(n_kv) * 16u * 37u * sizeof(float);
    CAPTURE(n_kv);
    CHECK(cache.elements_per_token() == 2 * n_kv * 16);
    CHECK(cache.bytes() == expected);
    CHECK(cache.capacity_bytes() >= cache.bytes());
    CHECK(cache.capacity_bytes() == 2u * static_cast<std::size_t>(n_kv) * 16u *
                                        static_cast<std::size_t>(cache.capacity()) * sizeof(float));
  }
  GqaCache<double, float> narrow(gqa_config(8, 2, 4, 1), 5);
  const RowMatrix<double> rows = RowMatrix<double>::Ones(5, 4);
  narrow.append(rows, rows);
  CHECK(narrow.bytes() == 2u * 4u * 5u * sizeof(float));
}

TEST_CASE("GQA cache grows geometrically and never reallocates within capacity", "[cache][gqa]") {
  const auto config = gqa_config(16, 4, 4, 2);
  GqaCache<double> cache(config);
  CHECK(cache.capacity() == 0);
  CHECK(cache.capacity_bytes() == 0);
  const RowMatrix<double> row = RowMatrix<double>::Ones(1, 8);
  Index reallocations = 0;
  Index previous = cache.capacity();
  for (int t = 0; t < 1000; ++t) {
    cache.append(row, row);
    if (cache.capacity() != previous) {
      ++reallocations;
      CHECK(cache.capacity() >= 2 * previous);
      previous = cache.capacity();
    }
  }
  CHECK(reallocations <= 8);  // 16, 32, ..., 1024

  cache.reserve(5000);
  const double* keys_before = cache.keys(0).data();
  for (int t = 0; t < 3000; ++t) cache.append(row, row);
  CHECK(cache.keys(0).data() == keys_before);
  CHECK(cache.capacity() == 5000);
}

TEST_CASE("Copying a GQA cache forks the sequence", "[cache][gqa]") {
  const auto config = gqa_config(24, 4, 6, 2, {RopeLayout::interleaved, 10000.0, 0});
  const auto layer = GqaLayer<double>::random(config, 3);
  const RowMatrix<double> x = kvattn::test::random_input<double>(12, 24, 4);
  auto cache = layer.make_cache();
  layer.prefill(x.topRows(10), cache);
  auto fork = cache;
  const RowVector<double> a = layer.decode(x.row(10), cache);
  const RowVector<double> b = layer.decode(x.row(11), fork);
  CHECK(cache.tokens() == 11);
  CHECK(fork.tokens() == 11);
  RowMatrix<double> seq_a = x.topRows(11);
  RowMatrix<double> seq_b = x.topRows(11);
  seq_b.row(10) = x.row(11);
  CHECK(kvattn::test::relative_error(a, reference::forward(layer, seq_a).row(10)) <= 1e-12);
  CHECK(kvattn::test::relative_error(b, reference::forward(layer, seq_b).row(10)) <= 1e-12);
}

TEST_CASE("Unused cache capacity filled with NaN never leaks into an output", "[cache][gqa]") {
  const auto config = gqa_config(32, 4, 8, 2, {RopeLayout::half_split, 10000.0, 0});
  const auto layer = GqaLayer<double>::random(config, 5);
  const RowMatrix<double> x = kvattn::test::random_input<double>(20, 32, 6);
  auto cache = layer.make_cache(64);
  layer.prefill(x.topRows(19), cache);
  // Fill the slots past the cached tokens with NaN, then roll them back.
  const RowMatrix<double> nan_rows =
      RowMatrix<double>::Constant(40, 16, std::numeric_limits<double>::quiet_NaN());
  cache.append(nan_rows, nan_rows);
  cache.truncate(19);
  const RowVector<double> y = layer.decode(x.row(19), cache);
  CHECK(y.allFinite());
  CHECK(kvattn::test::relative_error(y, reference::forward(layer, x).row(19)) <= 1e-12);
  // Prefill reads only cached tokens too.
  cache.append(nan_rows.topRows(10), nan_rows.topRows(10));
  cache.truncate(10);
  const RowMatrix<double> tail = layer.prefill(x.middleRows(10, 10), cache);
  CHECK(tail.allFinite());
  CHECK(kvattn::test::relative_error(tail, reference::forward(layer, x).bottomRows(10)) <= 1e-12);
}

TEST_CASE("A raw append of projected rows then decode equals the reference", "[cache][gqa]") {
  const auto config = gqa_config(20, 6, 4, 3, {RopeLayout::half_split, 10000.0, 9});
  const auto layer = GqaLayer<double>::random(config, 8);
  const RowMatrix<double> x = kvattn::test::random_input<double>(30, 20, 9);
  // Project and rotate the first 29 tokens by hand, the way a user importing a cache would.
  RowMatrix<double> keys = x.topRows(29) * layer.weights().w_k;
  const RowMatrix<double> values = x.topRows(29) * layer.weights().w_v;
  const Rope rope(config.rope, config.head_dim);
  for (Index t = 0; t < 29; ++t) {
    rope.rotate(keys.row(t).data(), static_cast<double>(config.rope.position_offset + t),
                config.n_kv_heads, config.head_dim);
  }
  auto cache = layer.make_cache();
  cache.append({keys, values});
  CHECK(cache.tokens() == 29);
  const RowVector<double> y = layer.decode(x.row(29), cache);
  CHECK(kvattn::test::relative_error(y, reference::forward(layer, x).row(29)) <= 1e-12);
}

TEST_CASE("clear and truncate keep capacity; truncate validates its argument", "[cache][gqa]") {
  GqaCache<float> cache(gqa_config(8, 2, 4, 1), 10);
  const RowMatrix<float> rows = RowMatrix<float>::Ones(6, 4);
  cache.append(rows, rows);
  cache.truncate(6);
  CHECK(cache.tokens() == 6);
  CHECK_THROWS_AS(cache.truncate(7), shape_error);
  CHECK_THROWS_AS(cache.truncate(-1), shape_error);
  cache.truncate(2);
  CHECK(cache.tokens() == 2);
  CHECK(cache.bytes() == 2u * 4u * 2u * sizeof(float));
  cache.clear();
  CHECK(cache.tokens() == 0);
  CHECK(cache.bytes() == 0);
  CHECK(cache.capacity() == 10);
}
