// [alloc][gqa]: every GQA-family call that changes a cache keeps the strong guarantee
// when any one of its allocations fails (tests/strong_guarantee.hpp).
#include "fault_injection.hpp"  // first: replaces operator new and eigen_assert

#include <catch2/catch.hpp>

#include "strong_guarantee.hpp"

using namespace kvattn;

namespace {

// Raw rows that own their matrices (a rows_type only views them).
struct Rows {
  RowMatrix<float> keys, values;
  template <class R>
  operator R() const {
    return R{keys, values};
  }
};

}  // namespace

TEST_CASE("GQA-family calls keep the strong guarantee under allocation failure",
          "[alloc][gqa][reliability]") {
  for (const GqaConfig& config :
       {gqa_config(24, 4, 6, 2, {RopeLayout::half_split, 10000.0, 1}), mqa_config(16, 4, 8)}) {
    const auto layer = GqaLayer<float>::random(config, 1);
    auto rows_of = [&](Index n) {
      return Rows{test::random_input<float>(n, config.kv_width(), 5),
                  test::random_input<float>(n, config.kv_width(), 6)};
    };
    auto prefill = [&](auto& cache, const RowMatrix<float>& x, Threads threads) {
      layer.prefill(x, cache, threads);
    };
    for (const Threads threads : {Threads{1}, Threads{2}}) {
      test::check_layer<float>("GQA", layer, threads, rows_of, prefill);
      test::check_layer<Eigen::bfloat16>("GQA", layer, threads, rows_of, prefill);
      test::check_layer<Int8<>>("GQA", layer, threads, rows_of, prefill);
      test::check_layer<Fp8E4M3<4>>("GQA", layer, threads, rows_of, prefill);  // 2 blocks a row
    }
  }
}
