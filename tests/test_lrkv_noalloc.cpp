// An LRKV decode step allocates nothing once the cache has capacity. Two counters in
// this test binary: a replaced global operator new (std containers), and Eigen's own
// run-time malloc guard (EIGEN_RUNTIME_NO_MALLOC; Eigen allocates with std::malloc, not
// new) whose eigen_assert is made to throw here, in every build type.
#define EIGEN_RUNTIME_NO_MALLOC
#include <stdexcept>
#define eigen_assert(x)                                           \
  do {                                                            \
    if (!(x)) throw std::logic_error("eigen_assert failed: " #x); \
  } while (false)

#include <catch2/catch.hpp>

#include <atomic>
#include <cstdlib>
#include <new>

#include "kvattn/attention/lrkv.hpp"
#include "test_lrkv_util.hpp"
#include "test_util.hpp"

namespace {
std::atomic<long> allocations{0};
}

void* operator new(std::size_t size) {
  ++allocations;
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
// Catch2 allocates with new (std::nothrow): replace it too, so that every pointer
// reaching the replaced delete came from malloc (AddressSanitizer checks the pairing).
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  ++allocations;
  return std::malloc(size == 0 ? 1 : size);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }

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
      layer.decode(x.row(8), cache, out);  // sizes the workspace
      const long before = allocations.load();
      bool eigen_allocated = false;
      Eigen::internal::set_is_malloc_allowed(false);
      try {
        for (Index t = 9; t < 64; ++t) layer.decode(x.row(t), cache, out);
      } catch (const std::logic_error&) {
        eigen_allocated = true;
      }
      Eigen::internal::set_is_malloc_allowed(true);
      const long during_decode = allocations.load() - before;  // before CAPTURE allocates
      CAPTURE(to_string(mode), key_norm);
      CHECK(during_decode == 0);
      CHECK_FALSE(eigen_allocated);
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
  layer.decode(x.row(4), cache, out);
  const long before = allocations.load();
  Eigen::internal::set_is_malloc_allowed(false);
  bool eigen_allocated = false;
  try {
    for (Index t = 5; t < 40; ++t) layer.decode(x.row(t), cache, out);
  } catch (const std::logic_error&) {
    eigen_allocated = true;
  }
  Eigen::internal::set_is_malloc_allowed(true);
  const long during_decode = allocations.load() - before;
  CHECK(during_decode == 0);
  CHECK_FALSE(eigen_allocated);
}

TEST_CASE("The Eigen malloc guard of this binary fires on a heap allocation", "[cache][lrkv]") {
  bool fired = false;
  Eigen::internal::set_is_malloc_allowed(false);
  try {
    Eigen::MatrixXf m(64, 64);
    m.setZero();
  } catch (const std::logic_error&) {
    fired = true;
  }
  Eigen::internal::set_is_malloc_allowed(true);
  CHECK(fired);
}
