// An LRKV decode step allocates nothing once the cache has capacity.
#include "alloc_counter.hpp"  // first: replaces operator new, arms Eigen's malloc guard

#include <catch2/catch.hpp>

#include "kvattn/attention/lrkv.hpp"
#include "test_lrkv_util.hpp"
#include "test_util.hpp"

using namespace kvattn;

TEST_CASE("LRKV decode allocates nothing once the cache has capacity", "[cache][lrkv]") {
  for (const LrkvRopeMode mode : {LrkvRopeMode::none, LrkvRopeMode::shared, LrkvRopeMode::decoupled,
                                  LrkvRopeMode::commuting}) {
    for (const bool key_norm : {false, true}) {
      LrkvConfig c{256, 8, 32, 12, mode};
      if (mode != LrkvRopeMode::none) c.rope.layout = RopeLayout::half_split;
      if (mode == LrkvRopeMode::decoupled) c.rope_dim = 16;
      c.key_norm = key_norm;
      const auto layer = LrkvLayer<float>::random(c, 1);
      const RowMatrix<float> x = test::random_input<float>(64, 256, 2);
      auto cache = layer.make_cache(64);
      layer.prefill(x.topRows(8), cache);
      RowVector<float> out(256);
      auto workspace = layer.make_workspace();
      layer.decode(x.row(8), cache, out, workspace);  // warms up
      const auto count = test::count_allocations([&] {
        for (Index t = 9; t < 64; ++t) layer.decode(x.row(t), cache, out, workspace);
      });
      CAPTURE(to_string(mode), key_norm);
      CHECK(count.operator_new == 0);
      CHECK_FALSE(count.eigen_malloc);
      CHECK(out.allFinite());
    }
  }
}

TEST_CASE("LRKV decode with double compute and float storage allocates nothing either",
          "[cache][lrkv]") {
  LrkvConfig c{64, 4, 16, 6, LrkvRopeMode::commuting, {RopeLayout::interleaved, 10000.0, 0}};
  c.key_norm = true;
  const auto layer = LrkvLayer<double>::random(c, 3);
  const RowMatrix<double> x = test::random_input<double>(40, 64, 4);
  auto cache = layer.make_cache<float>(40);
  layer.prefill(x.topRows(4), cache);
  RowVector<double> out(64);
  auto workspace = layer.make_workspace();
  layer.decode(x.row(4), cache, out, workspace);
  const auto count = test::count_allocations([&] {
    for (Index t = 5; t < 40; ++t) layer.decode(x.row(t), cache, out, workspace);
  });
  CHECK(count.operator_new == 0);
  CHECK_FALSE(count.eigen_malloc);
}

TEST_CASE("LRKV decode over a quantized cache allocates nothing either",
          "[cache][lrkv][quantized]") {
  for (const LrkvRopeMode mode :
       {LrkvRopeMode::shared, LrkvRopeMode::decoupled, LrkvRopeMode::commuting}) {
    LrkvConfig c{128, 4, 32, 20, mode, {RopeLayout::half_split, 10000.0, 0}};
    if (mode == LrkvRopeMode::decoupled) c.rope_dim = 8;
    if (mode == LrkvRopeMode::commuting) c.rank = 12;
    c.key_norm = true;
    const auto layer = LrkvLayer<float>::random(c, 5);
    const RowMatrix<float> x = test::random_input<float>(64, 128, 6);
    auto int8 = layer.make_cache<Int8<16>>(64);
    auto fp8 = layer.make_cache<Fp8E4M3<>>(64);
    layer.prefill(x.topRows(8), int8);
    layer.prefill(x.topRows(8), fp8);
    RowVector<float> out(128);
    auto workspace = layer.make_workspace();
    layer.decode(x.row(8), int8, out, workspace);  // warms up
    layer.decode(x.row(8), fp8, out, workspace);
    const auto count = test::count_allocations([&] {
      for (Index t = 9; t < 64; ++t) {
        layer.decode(x.row(t), int8, out, workspace);
        layer.decode(x.row(t), fp8, out, workspace);
      }
    });
    CAPTURE(to_string(mode));
    CHECK(count.operator_new == 0);
    CHECK_FALSE(count.eigen_malloc);
    CHECK(out.allFinite());
  }
}
