// [equivalence][mla] at DeepSeek-V2's real attention shape (d 5120, 128 heads,
// d_c 512, d_c' 1536, d_nope 128, d_R 64, d_v 128, interleaved RoPE with YaRN) on a
// short sequence: expanded prefill of a prompt, then absorbed decodes, against the
// expanded reference (both prefill formulations are checked at small shapes in
// test_mla_equivalence).
// The weights are about 149 M parameters (0.6 GB in float, 1.2 GB in double), and
// each token reads all of them, so the sequence is short.
//
// Decode at this shape must also allocate nothing (tests/alloc_counter.hpp).
#include "alloc_counter.hpp"  // first: replaces operator new, arms Eigen's malloc guard

#include <catch2/catch.hpp>

#include "kvattn/attention/mla.hpp"
#include "kvattn/reference/mla.hpp"
#include "test_util.hpp"

using namespace kvattn;
using kvattn::test::relative_error;

namespace {

// 149 M normal draws take many seconds, so this test fills the weights with a fast
// seeded uniform generator of the same variance 1/fan_in (splitmix64, U(-a, a) with
// a = sqrt(3 / fan_in)). Drawn in float so the float and double layers hold the
// very same values.
struct FastFill {
  std::uint64_t state;
  double next() {  // U[0, 1)
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return static_cast<double>((z ^ (z >> 31)) >> 11) * 0x1.0p-53;
  }
  RowMatrix<float> weight(Index in, Index out) {
    const double a = std::sqrt(3.0 / static_cast<double>(in));
    RowMatrix<float> w(in, out);
    for (Index i = 0; i < w.size(); ++i) w.data()[i] = static_cast<float>(a * (2.0 * next() - 1.0));
    return w;
  }
  RowVector<float> gain(Index n) {
    RowVector<float> g(n);
    for (Index i = 0; i < n; ++i) g(i) = static_cast<float>(0.8 + 0.4 * next());
    return g;
  }
};

MlaWeights<float> fast_weights(const MlaConfig& c, std::uint64_t seed) {
  FastFill f{seed};
  MlaWeights<float> w;
  w.w_dq = f.weight(c.d_model, c.q_rank);
  w.q_norm_gain = f.gain(c.q_rank);
  w.w_uq = f.weight(c.q_rank, c.query_width());
  w.w_dkv = f.weight(c.d_model, c.kv_rank);
  w.kv_norm_gain = f.gain(c.kv_rank);
  w.w_kr = f.weight(c.d_model, c.rope_dim);
  w.w_uk = f.weight(c.kv_rank, c.n_heads * c.qk_nope_dim);
  w.w_uv = f.weight(c.kv_rank, c.n_heads * c.v_dim);
  w.w_o = f.weight(c.n_heads * c.v_dim, c.d_model);
  return w;
}

}  // namespace

TEST_CASE("MLA at DeepSeek-V2's shape: absorbed equals expanded", "[equivalence][mla]") {
  MlaConfig c = deepseek_v2_config();
  c.rope.position_offset = 70000;  // past YaRN's original 4096 positions
  const Index length = 6, prompt = 3;

  const MlaLayer<float> layer_float(c, fast_weights(c, 2024));
  const MlaLayer<double> layer(c, layer_float.weights().cast<double>());
  const RowMatrix<double> x = kvattn::test::random_input<double>(length, c.d_model, 7);
  const RowMatrix<double> expected = reference::forward(layer, x);
  REQUIRE(expected.allFinite());

  auto cache = layer.make_cache(length);
  CHECK(cache.elements_per_token() == 576);
  RowMatrix<double> y(length, c.d_model);
  y.topRows(prompt) = layer.prefill(x.topRows(prompt), cache);
  CHECK(layer.prefill_mode(MlaPrefill::automatic, 0, prompt) == MlaPrefill::expanded);
  RowVector<double> out(c.d_model);
  auto workspace = layer.make_workspace();
  for (Index t = prompt; t < length - 2; ++t) {
    layer.decode(x.row(t), cache, out, workspace);
    y.row(t) = out;
  }
  // The last two decodes run with allocation checks on (the cache has capacity).
  const auto count = kvattn::test::count_allocations([&] {
    for (Index t = length - 2; t < length; ++t) {
      layer.decode(x.row(t), cache, out, workspace);
      y.row(t) = out;
    }
  });
  CHECK(count.operator_new == 0);
  CHECK_FALSE(count.eigen_malloc);

  const double error = relative_error(y, expected);
  CAPTURE(error, kvattn::test::max_abs_error(y, expected));
  CHECK(error <= 1e-10);
  CHECK(cache.bytes() == static_cast<std::size_t>(length) * 576 * sizeof(double));

  // The float layer (same weight values) against the same double reference.
  auto cache_float = layer_float.make_cache();
  const RowMatrix<float> x_float = x.cast<float>();
  RowMatrix<float> y_float(length, c.d_model);
  y_float.topRows(prompt) = layer_float.prefill(x_float.topRows(prompt), cache_float);
  for (Index t = prompt; t < length; ++t) {
    y_float.row(t) = layer_float.decode(x_float.row(t), cache_float);
  }
  const double float_error = relative_error(y_float, expected);
  CAPTURE(float_error);
  CHECK(float_error <= 1e-4);
}
