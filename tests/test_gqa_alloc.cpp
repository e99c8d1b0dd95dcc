// A decode step allocates nothing once the cache has capacity: global operator new
// is replaced in this test binary to count allocations.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstdlib>
#include <new>

#include "kvattn/attention/gqa.hpp"
#include "test_util.hpp"

namespace {
std::atomic<long> allocations{0};
}

void* operator new(std::size_t size) {
  ++allocations;
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

using namespace kvattn;

TEST_CASE("GQA decode allocates nothing once the cache has capacity", "[cache][gqa]") {
  for (const Index n_kv : {8, 2, 1}) {
    const auto config = gqa_config(256, 8, 32, n_kv, {RopeLayout::half_split, 10000.0, 0});
    const auto layer = GqaLayer<float>::random(config, 1);
    const RowMatrix<float> x = kvattn::test::random_input<float>(64, 256, 2);
    auto cache = layer.make_cache(64);
    layer.prefill(x.topRows(8), cache);
    RowVector<float> out(256);
    layer.decode(x.row(8), cache, out);  // sizes the workspace
    const long before = allocations.load();
    for (Index t = 9; t < 64; ++t) layer.decode(x.row(t), cache, out);
    const long during_decode = allocations.load() - before;  // before CAPTURE allocates
    CAPTURE(n_kv);
    CHECK(during_decode == 0);
    CHECK(out.allFinite());
  }
}
