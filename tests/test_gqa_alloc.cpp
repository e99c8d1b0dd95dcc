// A GQA-family decode step allocates nothing once the cache has capacity.
#include "alloc_counter.hpp"  // first: replaces operator new, arms Eigen's malloc guard

#include <catch2/catch.hpp>

#include "kvattn/attention/gqa.hpp"
#include "test_util.hpp"

using namespace kvattn;

TEST_CASE("GQA decode allocates nothing once the cache has capacity", "[cache][gqa]") {
  for (const Index n_kv : {8, 2, 1}) {
    const auto config = gqa_config(256, 8, 32, n_kv, {RopeLayout::half_split, 10000.0, 0});
    const auto layer = GqaLayer<float>::random(config, 1);
    const RowMatrix<float> x = kvattn::test::random_input<float>(64, 256, 2);
    auto cache = layer.make_cache(64);
    layer.prefill(x.topRows(8), cache);
    RowVector<float> out(256);
    auto workspace = layer.make_workspace();
    layer.decode(x.row(8), cache, out, workspace);  // warms up
    const auto count = kvattn::test::count_allocations([&] {
      for (Index t = 9; t < 64; ++t) layer.decode(x.row(t), cache, out, workspace);
    });
    CAPTURE(n_kv);
    CHECK(count.operator_new == 0);
    CHECK_FALSE(count.eigen_malloc);
    CHECK(out.allFinite());
  }
}

TEST_CASE("The allocation counters of this binary do fire", "[cache][gqa]") {
  const auto by_new = kvattn::test::count_allocations([] {
    // A direct call, kept alive by volatile, so the compiler cannot elide it.
    void* volatile p = ::operator new(16);
    ::operator delete(p);
  });
  CHECK(by_new.operator_new == 1);
  const auto by_eigen = kvattn::test::count_allocations([] {
    Eigen::MatrixXf m(64, 64);
    m.setZero();
  });
  CHECK(by_eigen.eigen_malloc);
}
