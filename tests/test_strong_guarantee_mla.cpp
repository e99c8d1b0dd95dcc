// [alloc][mla]: every MLA call that changes a cache keeps the strong guarantee when any
// one of its allocations fails (tests/strong_guarantee.hpp), prefill in every mode.
#include "fault_injection.hpp"  // first: replaces operator new and eigen_assert

#include <catch2/catch.hpp>

#include "strong_guarantee.hpp"

using namespace kvattn;

namespace {

// Raw rows that own their matrices (a rows_type only views them).
struct Rows {
  RowMatrix<float> latent, rope_keys;
  template <class R>
  operator R() const {
    return R{latent, rope_keys};
  }
};

}  // namespace

TEST_CASE("MLA calls keep the strong guarantee under allocation failure",
          "[alloc][mla][reliability]") {
  MlaConfig c;
  c.d_model = 20;
  c.n_heads = 3;
  c.kv_rank = 12;
  c.q_rank = 8;
  c.q_norm = true;
  c.qk_nope_dim = 6;
  c.rope_dim = 4;
  c.v_dim = 5;
  c.rope = {RopeLayout::interleaved, 10000.0, 2};
  c.yarn = {true, 4.0, 16, 32.0, 1.0, 1.0, 1.0};
  const auto layer = MlaLayer<float>::random(c, 1);
  auto rows_of = [&](Index n) {
    return Rows{test::random_input<float>(n, c.kv_rank, 5),
                test::random_input<float>(n, c.rope_dim, 6)};
  };
  for (const MlaPrefill mode :
       {MlaPrefill::automatic, MlaPrefill::expanded, MlaPrefill::absorbed}) {
    auto prefill = [&](auto& cache, const RowMatrix<float>& x, Threads threads) {
      layer.prefill(x, cache, threads, mode);
    };
    CAPTURE(static_cast<int>(mode));
    for (const Threads threads : {Threads{1}, Threads{2}}) {
      test::check_layer<float>("MLA", layer, threads, rows_of, prefill);
      test::check_layer<Eigen::bfloat16>("MLA", layer, threads, rows_of, prefill);
      test::check_layer<Int8<>>("MLA", layer, threads, rows_of, prefill);
      test::check_layer<Fp8E4M3<4>>("MLA", layer, threads, rows_of, prefill);  // 3 blocks
    }
  }
}
