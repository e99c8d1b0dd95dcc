// [cache][mla]: what the MLA cache holds and counts, raw import, forks, NaN-filled
// capacity, decoding against an empty cache, and an allocation-free decode step.
#include "alloc_counter.hpp"  // first: replaces operator new, arms Eigen's malloc guard

#include <catch2/catch.hpp>

#include <limits>

#include "kvattn/attention/mla.hpp"
#include "kvattn/cache/mla_cache.hpp"
#include "kvattn/reference/mla.hpp"
#include "test_util.hpp"

using namespace kvattn;
using kvattn::test::relative_error;

namespace {

MlaConfig small_config(Index rope_dim = 6, Index q_rank = 0) {
  MlaConfig c;
  c.d_model = 20;
  c.n_heads = 3;
  c.kv_rank = 10;
  c.q_rank = q_rank;
  c.q_norm = q_rank > 0;
  c.qk_nope_dim = 8;
  c.rope_dim = rope_dim;
  c.v_dim = 5;
  c.rope = {rope_dim > 0 ? RopeLayout::interleaved : RopeLayout::none, 10000.0, 3};
  return c;
}

}  // namespace

TEST_CASE("MLA cache stores d_c + d_R elements per token and counts its bytes", "[cache][mla]") {
  // DeepSeek-V2: 512 + 64 = 576 per token per layer (seed 002: 34,560 over 60 layers).
  const MlaCache<float> v2(deepseek_v2_config());
  CHECK(v2.elements_per_token() == 576);
  CHECK(v2.elements_per_token() * 60 == 34560);
  CHECK(v2.bytes() == 0);

  for (const Index rope_dim : {0, 2, 6}) {
    const MlaConfig c = small_config(rope_dim);
    CAPTURE(rope_dim);
    const auto layer = MlaLayer<double>::random(c, 1);
    const RowMatrix<double> x = kvattn::test::random_input<double>(37, c.d_model, 2);
    auto cache = layer.make_cache();
    MlaCache<double, float> narrow(c);
    layer.prefill(x.topRows(30), cache);
    layer.prefill(x.topRows(30), narrow);
    for (Index t = 30; t < 37; ++t) {
      layer.decode(x.row(t), cache);
      layer.decode(x.row(t), narrow);
    }
    const std::size_t per_token = static_cast<std::size_t>(10 + rope_dim);
    CHECK(cache.elements_per_token() == 10 + rope_dim);
    CHECK(cache.tokens() == 37);
    CHECK(cache.bytes() == 37 * per_token * sizeof(double));
    CHECK(narrow.bytes() == 37 * per_token * sizeof(float));
    CHECK(cache.capacity() >= 37);
    CHECK(cache.capacity_bytes() ==
          static_cast<std::size_t>(cache.capacity()) * per_token * sizeof(double));
    CHECK(cache.latent().rows() == 37);
    CHECK(cache.latent().cols() == 10);
    CHECK(cache.rope_keys().cols() == rope_dim);
    cache.truncate(5);
    CHECK(cache.bytes() == 5 * per_token * sizeof(double));
    cache.clear();
    CHECK(cache.bytes() == 0);
  }
}

TEST_CASE("MLA cache: raw append imports a cache, copies fork, a failed append changes nothing",
          "[cache][mla]") {
  const MlaConfig c = small_config();
  const auto layer = MlaLayer<double>::random(c, 3);
  const RowMatrix<double> x = kvattn::test::random_input<double>(25, c.d_model, 4);
  auto cache = layer.make_cache();
  layer.prefill(x.topRows(20), cache);

  // Import: the rows of one cache appended raw into another decode identically.
  MlaCache<double> imported(c);
  imported.append({cache.latent(), cache.rope_keys()});
  CHECK(imported.tokens() == 20);
  CHECK(RowMatrix<double>(imported.rows()) == RowMatrix<double>(cache.rows()));
  const RowVector<double> a = layer.decode(x.row(20), cache);
  const RowVector<double> b = layer.decode(x.row(20), imported);
  CHECK(a == b);

  // A copy forks the sequence: decoding the copy leaves the original alone, and the
  // original then continues exactly as the copy did.
  auto fork = cache;
  const RowVector<double> y_fork = layer.decode(x.row(21), fork);
  CHECK(fork.tokens() == 22);
  CHECK(cache.tokens() == 21);
  CHECK(layer.decode(x.row(21), cache) == y_fork);

  // A failed append leaves the cache exactly as it was.
  const RowMatrix<double> rows_before = cache.rows();
  const Index tokens_before = cache.tokens();
  const Index capacity_before = cache.capacity();
  CHECK_THROWS_AS(cache.append(RowMatrix<double>::Zero(2, 9), RowMatrix<double>::Zero(2, 6)),
                  shape_error);
  CHECK_THROWS_AS(cache.append(RowMatrix<double>::Zero(2, 10), RowMatrix<double>::Zero(3, 6)),
                  shape_error);
  CHECK_THROWS_AS(cache.append(RowMatrix<double>::Zero(2, 10), RowMatrix<double>::Zero(2, 5)),
                  shape_error);
  CHECK(cache.tokens() == tokens_before);
  CHECK(cache.capacity() == capacity_before);
  CHECK(RowMatrix<double>(cache.rows()) == rows_before);
}

TEST_CASE("MLA: NaN in unused cache capacity never leaks into an output", "[cache][mla]") {
  for (const bool narrow_tile : {false, true}) {
    MlaConfig c = small_config(4, 12);
    CAPTURE(narrow_tile);
    const auto layer = MlaLayer<double>::random(c, 5);
    const RowMatrix<double> x = kvattn::test::random_input<double>(300, c.d_model, 6);
    // Fill the whole capacity with NaN rows, then roll back: every slot past
    // tokens() holds NaN.
    auto cache = layer.make_cache(600);
    const double nan = std::numeric_limits<double>::quiet_NaN();
    cache.append(RowMatrix<double>::Constant(600, c.kv_rank, nan),
                 RowMatrix<double>::Constant(600, c.rope_dim, nan));
    cache.clear();
    auto clean = layer.make_cache();
    const Index prompt = narrow_tile ? 7 : 250;
    const RowMatrix<double> y = layer.prefill(x.topRows(prompt), cache);
    const RowMatrix<double> y_clean = layer.prefill(x.topRows(prompt), clean);
    CHECK(y.allFinite());
    CHECK(y == y_clean);
    for (Index t = prompt; t < 300; ++t) {
      const RowVector<double> out = layer.decode(x.row(t), cache);
      CHECK(out.allFinite());
      CHECK(out == layer.decode(x.row(t), clean));
    }
    // Roll back into the middle and continue: the NaN-free prefix is all that is read.
    cache.truncate(100);
    cache.append(RowMatrix<double>::Constant(50, c.kv_rank, nan),
                 RowMatrix<double>::Constant(50, c.rope_dim, nan));
    cache.truncate(100);
    clean.truncate(100);
    for (const MlaPrefill mode : {MlaPrefill::absorbed, MlaPrefill::expanded}) {
      auto a = cache;
      auto b = clean;
      const RowMatrix<double> ya = layer.prefill(x.middleRows(100, 20), a, {}, mode);
      CHECK(ya.allFinite());
      CHECK(ya == layer.prefill(x.middleRows(100, 20), b, {}, mode));
    }
  }
}

TEST_CASE("MLA: decoding against an empty cache attends to the new token only", "[cache][mla]") {
  // Documented result (docs/mla.md): decode appends first, so on an empty cache the
  // token sees itself alone and the output is v(x) W_UV W_O path of that token, the
  // same as a one-token prefill and as the reference on a one-token sequence.
  for (const Index q_rank : {0, 9}) {
    const MlaConfig c = small_config(6, q_rank);
    const auto layer = MlaLayer<double>::random(c, 7);
    const RowMatrix<double> x = kvattn::test::random_input<double>(1, c.d_model, 8);
    auto cache = layer.make_cache();
    const RowVector<double> y = layer.decode(x.row(0), cache);
    CHECK(cache.tokens() == 1);
    CHECK(y.allFinite());
    const RowMatrix<double> expected = reference::forward(layer, x);
    CHECK(relative_error(y, expected) <= 1e-12);
    // With one visible key the softmax weight is exactly 1: the output is
    // c_kv W_UV_h per head, then W_O, whatever the logits.
    const auto& w = layer.weights();
    RowVector<double> latent = x.row(0) * w.w_dkv;
    double sum = 0;
    for (Index k = 0; k < c.kv_rank; ++k) sum += latent(k) * latent(k);
    latent *= 1.0 / std::sqrt(sum / static_cast<double>(c.kv_rank) + c.norm_epsilon);
    latent = latent.cwiseProduct(w.kv_norm_gain);
    const RowVector<double> by_hand = (latent * w.w_uv) * w.w_o;
    CHECK(relative_error(y, by_hand) <= 1e-12);
    // A zero-token prefill returns 0 x d and leaves the cache empty.
    auto empty = layer.make_cache();
    const RowMatrix<double> none = layer.prefill(RowMatrix<double>(0, c.d_model), empty);
    CHECK(none.rows() == 0);
    CHECK(none.cols() == c.d_model);
    CHECK(empty.tokens() == 0);
  }
}

TEST_CASE("MLA: narrow storage (double compute, float cache) stays close to the reference",
          "[cache][mla]") {
  MlaConfig c = small_config(8, 12);
  c.yarn = {true, 8.0, 64, 32.0, 1.0, 0.9, 0.8};
  const auto layer = MlaLayer<double>::random(c, 9);
  const RowMatrix<double> x = kvattn::test::random_input<double>(120, c.d_model, 10);
  MlaCache<double, float> cache(c);
  RowMatrix<double> y(120, c.d_model);
  y.topRows(60) = layer.prefill(x.topRows(60), cache);
  for (Index t = 60; t < 120; ++t) y.row(t) = layer.decode(x.row(t), cache);
  const double error = relative_error(y, reference::forward(layer, x));
  CAPTURE(error);
  CHECK(error <= 1e-5);  // float rounding of the stored rows, about 6e-8 each
  CHECK(error > 0.0);    // the rows really were stored narrower
}

namespace {

template <class T, class S>
void check_no_allocation(const MlaConfig& c) {
  const auto layer = MlaLayer<T>::random(c, 11);
  const RowMatrix<T> x = kvattn::test::random_input<T>(700, c.d_model, 12);
  MlaCache<T, S> cache(c, 700);
  layer.prefill(x.topRows(500), cache);
  RowVector<T> out(c.d_model);
  auto workspace = layer.make_workspace();
  layer.decode(x.row(500), cache, out, workspace);  // warms up
  const auto count = kvattn::test::count_allocations([&] {
    for (Index t = 501; t < 700; ++t) layer.decode(x.row(t), cache, out, workspace);
  });
  CAPTURE(sizeof(T), sizeof(S), c.n_heads, c.kv_rank, c.rope_dim, layer.decode_tile());
  CHECK(count.operator_new == 0);
  CHECK_FALSE(count.eigen_malloc);
  CHECK(out.allFinite());
}

}  // namespace

TEST_CASE("MLA decode allocates nothing once the cache has capacity", "[cache][mla]") {
  MlaConfig c = small_config(16, 24);
  c.n_heads = 16;
  c.kv_rank = 64;
  c.qk_nope_dim = 32;
  c.v_dim = 24;
  c.d_model = 96;
  c.yarn = {true, 4.0, 128, 32.0, 1.0, 1.0, 1.0};
  check_no_allocation<float, float>(c);
  check_no_allocation<double, double>(c);
  check_no_allocation<double, float>(c);
  c.q_rank = 0;
  c.q_norm = false;
  c.kv_norm = false;
  check_no_allocation<float, float>(c);
  // Sanity: both counters of this binary do fire.
  CHECK(kvattn::test::count_allocations([] { RowMatrix<float> m(4, 4); }).eigen_malloc);
  CHECK(kvattn::test::count_allocations([] {
          void* volatile p = ::operator new(16);
          ::operator delete(p);
        }).operator_new == 1);
}
