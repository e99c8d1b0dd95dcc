// [bf16]: caches that store Eigen::bfloat16 (and Eigen::half) while computing in float,
// for MHA, GQA, MQA, MLA and LRKV.
//
//  * The cache holds exactly the bf16 rounding of the rows appended to it.
//  * attend over those rows (1 and 2 threads, long enough to split the sequence) equals
//    the double reference computed on the rows rounded through bfloat16 by this test:
//    the kernels widen every stored element exactly and compute in float, so this
//    agrees to float precision, not just to bf16 precision.
//  * A decoded sequence matches the same sequence decoded into an fp32 cache to the
//    accuracy bf16 storage allows (derived below), and matches the double reference on
//    the bf16 cache's own contents to float precision.
//  * bytes() halves against fp32 (LRKV's key RMS stays fp32) and equals the analysis
//    module's prediction for Dtype::bf16 / Dtype::fp16.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#include "attend_util.hpp"
#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"
#include "kvattn/reference/gqa.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "kvattn/reference/mla.hpp"
#include "test_util.hpp"

using namespace kvattn;
using kvattn::test::heads_width;
using kvattn::test::project_query;
using kvattn::test::query_width;
using kvattn::test::random_input;
using kvattn::test::relative_error;
using kvattn::test::to_double;
namespace an = kvattn::analysis;

namespace {

using MatF = RowMatrix<float>;
using MatD = RowMatrix<double>;
using bf16 = Eigen::bfloat16;
using fp16 = Eigen::half;

// Against the double reference on the same (rounded) stored rows, only float
// arithmetic differs: measured at most 1.1e-6 (see test_decode_threads.cpp for the
// error budget); 1e-5 as for every float path of the suite (test_util.hpp).
constexpr double kFloatTolerance = 1e-5;

// bf16 against an fp32 cache. bf16 keeps p = 8 significant bits, so round-to-nearest
// stores each element with relative error <= u = 2^-p = 2^-8 ~ 3.9e-3 (half an ulp of
// 2^-7; about u/sqrt(3) rms). To first order a stored value's error moves the output by
// <= u relative (a convex combination of values each off by <= u), and a stored key's
// error moves logit s_t by <= u * scale * sum_i |q_i k_i| (~5u for these shapes: scale
// sum_i |q_i k_i| ~ 8 * 2/pi at d_h 64), which moves the output by <= 2 * 5u relative.
// Worst case, all errors aligned: ~11u ~ 4e-2, too loose to test anything. Independent
// rounding errors add in quadrature instead: ~u/sqrt(3) from the values and about as
// much again from the logits, ~u ~ 4e-3 in all. Tolerance 4u = 2^-6 ~ 1.6e-2: four
// times the typical error, under the worst case. Measured (portable x86-64 build): 2.1e-3
// ... 4.0e-3 over the configs below (max over 40 steps each). The sharp checks are the others: the
// stored rows equal the test's own rounding exactly, and outputs equal the double
// reference on those rows to float precision (measured <= 1.1e-6).
constexpr double kBf16Tolerance = 1.0 / 64.0;
// fp16 keeps 11 significant bits: u = 2^-11, tolerance 4u = 2^-9 ~ 2e-3 by the same
// argument; measured 2.6e-4 ... 3.8e-4.
constexpr double kFp16Tolerance = 1.0 / 512.0;

template <class S>
constexpr an::Dtype dtype_of_storage() {
  return std::is_same_v<S, bf16> ? an::Dtype::bf16 : an::Dtype::fp16;
}

// ---- Per mechanism: the projected query of x (double), the stored rows read back in
// double, appending rows to a cache, and the layer in double.

// The raw random rows of one cache fill, in float, in each mechanism's append layout.
struct Rows {
  MatF a, b, c, d, e, f;
};

Rows random_rows(const GqaConfig& c, Index n, std::uint64_t seed) {
  const Index w = c.n_kv_heads * c.head_dim;
  return {random_input<float>(n, w, seed), random_input<float>(n, w, seed + 1), {}, {}, {}, {}};
}
Rows random_rows(const MlaConfig& c, Index n, std::uint64_t seed) {
  return {random_input<float>(n, c.kv_rank, seed),
          random_input<float>(n, c.rope_dim, seed + 1),
          {},
          {},
          {},
          {}};
}
Rows random_rows(const LrkvConfig& c, Index n, std::uint64_t seed) {
  const Index hr = c.n_heads * c.rank;
  std::mt19937_64 rng(seed + 5);
  std::uniform_real_distribution<float> rho(0.5f, 1.5f);  // key RMS, > 0
  MatF key_rms(n, c.key_norm ? c.n_heads : 0);
  for (Index i = 0; i < key_rms.size(); ++i) key_rms.data()[i] = rho(rng);
  return {random_input<float>(n, c.head_dim, seed),
          random_input<float>(n, c.head_dim, seed + 1),
          random_input<float>(n, hr, seed + 2),
          random_input<float>(n, hr, seed + 3),
          random_input<float>(n, c.decoupled_dim(), seed + 4),
          key_rms};
}

template <class T, class S>
void append(GqaCache<T, S>& cache, const Rows& r) {
  cache.append(r.a.template cast<T>(), r.b.template cast<T>());
}
template <class T, class S>
void append(MlaCache<T, S>& cache, const Rows& r) {
  cache.append(r.a.template cast<T>(), r.b.template cast<T>());
}
template <class T, class S>
void append(LrkvCache<T, S>& cache, const Rows& r) {
  const RowMatrix<T> a = r.a.template cast<T>(), b = r.b.template cast<T>();
  const RowMatrix<T> c = r.c.template cast<T>(), d = r.d.template cast<T>();
  const RowMatrix<T> e = r.e.template cast<T>(), f = r.f.template cast<T>();
  cache.append({a, b, c, d, e, f});
}

// The rows rounded through S (as float, exact): what an S cache holds (LRKV's key RMS is kept
// in fp32, so it is not rounded).
template <class S>
Rows round_rows(const Rows& r, bool lrkv) {
  auto round = [](const MatF& m) -> MatF { return m.template cast<S>().template cast<float>(); };
  return {round(r.a), round(r.b), round(r.c), round(r.d), round(r.e), lrkv ? r.f : round(r.f)};
}

// The stored rows of a cache read back (widened exactly to float), in the append layout.
template <class S>
Rows stored_rows(const GqaCache<float, S>& cache) {
  const GqaConfig& c = cache.config();
  const Index dh = c.head_dim;
  MatF keys(cache.tokens(), c.n_kv_heads * dh), values(cache.tokens(), c.n_kv_heads * dh);
  for (Index g = 0; g < c.n_kv_heads; ++g) {
    keys.middleCols(g * dh, dh) = cache.keys(g).template cast<float>();
    values.middleCols(g * dh, dh) = cache.values(g).template cast<float>();
  }
  return {keys, values, {}, {}, {}, {}};
}
template <class S>
Rows stored_rows(const MlaCache<float, S>& cache) {
  return {cache.latent().template cast<float>(),
          cache.rope_keys().template cast<float>(),
          {},
          {},
          {},
          {}};
}
template <class S>
Rows stored_rows(const LrkvCache<float, S>& cache) {
  return {
      cache.shared_keys().template cast<float>(),   cache.shared_values().template cast<float>(),
      cache.residual_keys().template cast<float>(), cache.residual_values().template cast<float>(),
      cache.rope_keys().template cast<float>(),     cache.key_rms().template cast<float>()};
}

bool same(const MatF& x, const MatF& y) {
  return x.rows() == y.rows() && x.cols() == y.cols() && x == y;
}
bool same(const Rows& x, const Rows& y) {
  return same(x.a, y.a) && same(x.b, y.b) && same(x.c, y.c) && same(x.d, y.d) && same(x.e, y.e) &&
         same(x.f, y.f);
}

// A double cache of the layer's config holding `rows`.
template <class DLayer>
auto double_cache(const DLayer& dlayer, const Rows& rows) {
  auto cache = dlayer.make_cache();
  append(cache, rows);
  return cache;
}

Index norm_scalars(const GqaConfig&) { return 0; }
Index norm_scalars(const MlaConfig&) { return 0; }
Index norm_scalars(const LrkvConfig& c) { return c.key_norm ? c.n_heads : 0; }

// bytes(): narrow storage S (2 bytes) for the content rows, fp32 for LRKV's key RMS;
// equal to the analysis for plain S storage; and fp32's bytes with the content halved.
template <class Config, class NarrowCache, class FullCache>
void check_bytes(const Config& c, const NarrowCache& narrow, const FullCache& full) {
  using S = typename NarrowCache::storage_type;
  static_assert(sizeof(S) == 2);
  REQUIRE(narrow.tokens() == full.tokens());
  const auto tokens = static_cast<std::size_t>(narrow.tokens());
  const auto norms = static_cast<std::size_t>(norm_scalars(c));
  const auto content = static_cast<std::size_t>(narrow.elements_per_token()) - norms;
  CAPTURE(tokens, content, norms);
  CHECK(narrow.elements_per_token() == full.elements_per_token());
  CHECK(narrow.bytes() == (content * 2 + norms * 4) * tokens);
  CHECK(full.bytes() == (content * 4 + norms * 4) * tokens);
  CHECK(narrow.bytes() == full.bytes() - content * 2 * tokens);  // the content halves
  // The analysis names the storage type's Dtype itself (storage_of, as in
  // test_analysis_cache.cpp); it must be bf16 / fp16.
  CHECK(an::dtype_of<S>() == dtype_of_storage<S>());
  const an::CacheStorage storage = an::storage_of<S>();
  const an::CacheLayout layout = an::cache_layout(c);
  CHECK(narrow.bytes() ==
        static_cast<std::size_t>(an::total_bytes(layout, storage, {1}, {narrow.tokens(), 1})));
  CHECK(narrow.bytes() ==
        static_cast<std::size_t>(an::bytes_per_token_per_layer(layout, storage)) * tokens);
  CHECK(narrow.capacity_bytes() ==
        static_cast<std::size_t>(an::total_bytes(layout, storage, {1}, {narrow.capacity(), 1})));
}

// Raw rows into an S cache: it stores exactly their rounding through S; attend at 1 and
// 2 threads equals the double reference on the rows this test rounded, to float precision.
template <class S, class Layer>
void check_attend(const Layer& layer, Index length, std::uint64_t seed) {
  const auto& c = layer.config();
  const auto dlayer = to_double(layer);
  constexpr bool is_lrkv = std::is_same_v<Layer, LrkvLayer<float>>;
  const Rows rows = random_rows(c, length, seed);
  const Rows rounded_rows = round_rows<S>(rows, is_lrkv);
  auto narrow = layer.template make_cache<S>();
  append(narrow, rows);
  CHECK(same(stored_rows(narrow), rounded_rows));
  auto full = layer.make_cache();
  append(full, rows);
  check_bytes(c, narrow, full);

  const MatF query = random_input<float>(1, query_width(c), seed + 9);
  const MatD want =
      reference::decode_step(dlayer, double_cache(dlayer, rounded_rows), query.cast<double>());
  for (const Threads threads : {Threads{1}, Threads{2}}) {
    RowVector<float> heads(heads_width(c));
    layer.attend(query, narrow, heads, threads);
    const double error = relative_error(heads, want);
    CAPTURE(length, threads.count, error);
    CHECK(error <= kFloatTolerance);
  }
}

// A sequence decoded token by token into an S cache and into an fp32 cache: each output
// matches the fp32 one within `tolerance`, and the double reference on the S cache's
// own (rounded) contents within float precision.
template <class S, class Layer>
void check_decode(const Layer& layer, Index steps, double tolerance, std::uint64_t seed) {
  const auto& c = layer.config();
  const auto dlayer = to_double(layer);
  auto narrow = layer.template make_cache<S>();
  auto full = layer.make_cache();
  const MatF x = random_input<float>(steps, c.d_model, seed);
  RowVector<float> out_narrow(c.d_model), out_full(c.d_model);
  double max_vs_fp32 = 0.0, max_vs_reference = 0.0;
  for (Index t = 0; t < steps; ++t) {
    // The last steps at 2 threads (each parallel region costs ~ms on a loaded machine).
    const Threads threads{t + 3 >= steps ? 2 : 1};
    layer.decode(x.row(t), narrow, out_narrow, threads);
    layer.decode(x.row(t), full, out_full, threads);
    const MatD q = project_query(dlayer, x.row(t).cast<double>());
    const MatD want = reference::decode_step(dlayer, double_cache(dlayer, stored_rows(narrow)), q) *
                      dlayer.weights().w_o;
    max_vs_fp32 = std::max(max_vs_fp32, relative_error(out_narrow, out_full));
    max_vs_reference = std::max(max_vs_reference, relative_error(out_narrow, want));
  }
  CAPTURE(steps, max_vs_fp32, max_vs_reference);
  CHECK(max_vs_fp32 <= tolerance);
  // The narrow cache does round: float storage would agree to ~1e-6.
  CHECK(max_vs_fp32 >= 1e-5);
  CHECK(max_vs_reference <= kFloatTolerance);
  check_bytes(c, narrow, full);
}

MlaConfig small_mla() {
  MlaConfig c;
  c.d_model = 48;
  c.n_heads = 4;
  c.kv_rank = 128;  // tile 112 tokens: 2 threads split L = 2000
  c.q_rank = 24;
  c.q_norm = true;
  c.qk_nope_dim = 16;
  c.rope_dim = 16;
  c.v_dim = 12;
  c.rope = {RopeLayout::interleaved, 10000.0, 3};
  return c;
}

LrkvConfig small_lrkv(LrkvRopeMode mode, bool key_norm) {
  LrkvConfig c{48, 6, 32, 8, mode};
  if (mode != LrkvRopeMode::none) c.rope = {RopeLayout::half_split, 10000.0, 2};
  if (mode == LrkvRopeMode::decoupled) c.rope_dim = 8;
  c.key_norm = key_norm;
  return c;
}

// d_h 64 (GQA tile 128 tokens), so 2000 tokens split across 2 threads where there is
// one group (MQA); head widths that are not a multiple of a packet are covered by
// d_h 20 (scalar tails of the widening loads).
std::vector<GqaConfig> gqa_configs() {
  const RopeConfig rope{RopeLayout::half_split, 10000.0, 1};
  GqaConfig biased = gqa_config(64, 8, 64, 2, rope);
  biased.qkv_bias = true;
  return {mha_config(64, 4, 64, rope), biased, gqa_config(40, 16, 20, 2, rope),
          mqa_config(64, 8, 64, rope)};
}

}  // namespace

TEST_CASE("bf16 caches store rounded rows and attend at float precision on them", "[bf16]") {
  std::uint64_t seed = 10;
  for (const GqaConfig& c : gqa_configs()) {
    CAPTURE(c.n_heads, c.n_kv_heads, c.head_dim);
    const auto layer = GqaLayer<float>::random(c, seed);
    for (const Index length : {1, 7, 2000}) check_attend<bf16>(layer, length, seed++);
  }
  const auto mla = MlaLayer<float>::random(small_mla(), 20);
  for (const Index length : {1, 7, 2000}) check_attend<bf16>(mla, length, 21 + length);
  for (const auto mode : {LrkvRopeMode::none, LrkvRopeMode::shared, LrkvRopeMode::decoupled}) {
    CAPTURE(to_string(mode));
    const auto lrkv = LrkvLayer<float>::random(small_lrkv(mode, true), 30, 0.7);
    for (const Index length : {1, 7, 700}) check_attend<bf16>(lrkv, length, 31 + length);
  }
}

TEST_CASE("bf16 caches decode a sequence like fp32 caches, to bf16 accuracy", "[bf16]") {
  std::uint64_t seed = 40;
  for (const GqaConfig& c : gqa_configs()) {
    CAPTURE(c.n_heads, c.n_kv_heads, c.head_dim);
    check_decode<bf16>(GqaLayer<float>::random(c, seed), 40, kBf16Tolerance, seed + 1);
    seed += 2;
  }
  check_decode<bf16>(MlaLayer<float>::random(small_mla(), 50), 40, kBf16Tolerance, 51);
  for (const auto mode : {LrkvRopeMode::none, LrkvRopeMode::shared, LrkvRopeMode::decoupled}) {
    for (const bool key_norm : {false, true}) {
      CAPTURE(to_string(mode), key_norm);
      check_decode<bf16>(LrkvLayer<float>::random(small_lrkv(mode, key_norm), 60, 0.7), 40,
                         kBf16Tolerance, 61);
    }
  }
}

TEST_CASE("fp16 (Eigen::half) caches work too", "[bf16][fp16]") {
  const GqaConfig c = gqa_configs()[1];
  const auto gqa = GqaLayer<float>::random(c, 70);
  check_attend<fp16>(gqa, 300, 71);
  check_decode<fp16>(gqa, 30, kFp16Tolerance, 72);
  const auto mla = MlaLayer<float>::random(small_mla(), 73);
  check_attend<fp16>(mla, 300, 74);
  check_decode<fp16>(mla, 30, kFp16Tolerance, 75);
  const auto lrkv = LrkvLayer<float>::random(small_lrkv(LrkvRopeMode::shared, true), 76, 0.7);
  check_attend<fp16>(lrkv, 300, 77);
  check_decode<fp16>(lrkv, 30, kFp16Tolerance, 78);
}
