// [alloc][lrkv]: every LRKV call that changes a cache keeps the strong guarantee when
// any one of its allocations fails (tests/strong_guarantee.hpp).
#include "fault_injection.hpp"  // first: replaces operator new and eigen_assert

#include <catch2/catch.hpp>

#include "strong_guarantee.hpp"

using namespace kvattn;

namespace {

// Raw rows that own their matrices (a rows_type only views them).
struct Rows {
  RowMatrix<float> shared_keys, shared_values, residual_keys, residual_values, rope_keys, key_rms;
  template <class R>
  operator R() const {
    return R{shared_keys, shared_values, residual_keys, residual_values, rope_keys, key_rms};
  }
};

}  // namespace

TEST_CASE("LRKV calls keep the strong guarantee under allocation failure",
          "[alloc][lrkv][reliability]") {
  LrkvConfig c{20, 3, 6, 4, LrkvRopeMode::decoupled, {RopeLayout::half_split, 10000.0, 1}};
  c.rope_dim = 4;
  c.key_norm = true;
  const auto layer = LrkvLayer<float>::random(c, 1);
  auto rows_of = [&](Index n) {
    return Rows{test::random_input<float>(n, c.head_dim, 5),
                test::random_input<float>(n, c.head_dim, 6),
                test::random_input<float>(n, c.residual_width(), 7),
                test::random_input<float>(n, c.residual_width(), 8),
                test::random_input<float>(n, c.decoupled_dim(), 9),
                RowMatrix<float>::Constant(n, c.n_heads, 1.25f)};
  };
  auto prefill = [&](auto& cache, const RowMatrix<float>& x, Threads threads) {
    layer.prefill(x, cache, threads);
  };
  for (const Threads threads : {Threads{1}, Threads{2}}) {
    test::check_layer<float>("LRKV", layer, threads, rows_of, prefill);
    test::check_layer<Eigen::bfloat16>("LRKV", layer, threads, rows_of, prefill);
    test::check_layer<Int8<>>("LRKV", layer, threads, rows_of, prefill);
    test::check_layer<Fp8E4M3<4>>("LRKV", layer, threads, rows_of, prefill);  // 2 blocks a part
  }
}
