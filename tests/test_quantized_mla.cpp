// [quantized]: MLA layers over block-quantized caches (Int8<B>, Fp8E4M3<B>), contiguous
// and paged: the latent c_kv in codes with fp32 block scales, the rope key k_R in bf16
// (DeepSeek's fp8 MLA layout, docs/api.md § Quantized storage).
//
//  * The stored latent, read byte by byte and decoded by this test, is within the
//    format's bound of the appended one; the rope key within bf16's rounding; latent() and
//    rope_keys() return exactly what the bytes say.
//  * bytes() equals the analysis module's prediction (scales included) and the hand count
//    d_c + 4 ceil(d_c / B) + 2 d_R per token: 656 for DeepSeek-V2's 512 + 64.
//  * attend (1 and 2 threads, contiguous and paged) equals the double reference (which
//    re-projects K and V per head) on the rows this test decoded, to float precision.
//  * prefill (expanded and absorbed, after cached tokens) and decode equal the double
//    reference on the cache's own contents, and stay within the format's accuracy of an
//    fp32 cache; decode_batch (contiguous, and paged with a shared prefix) equals single
//    decodes.
//  * A NaN or infinity headed for a quantized cache throws value_error and changes nothing.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "attend_util.hpp"
#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/attention/mla.hpp"
#include "kvattn/cache/paged_mla_cache.hpp"
#include "kvattn/reference/mla.hpp"
#include "quantized_refusal.hpp"
#include "quantized_util.hpp"
#include "test_util.hpp"

using namespace kvattn;
using kvattn::test::bf16_value;
using kvattn::test::decode_row;
using kvattn::test::element_bound;
using kvattn::test::format_tolerance;
using kvattn::test::project_query;
using kvattn::test::random_input;
using kvattn::test::relative_error;
using kvattn::test::to_double;
namespace an = kvattn::analysis;

namespace {

using MatF = RowMatrix<float>;
using MatD = RowMatrix<double>;

// Against the double reference on the same stored rows only float arithmetic differs.
constexpr double kFloatTolerance = 1e-5;

MlaConfig mla(Index d_model, Index heads, Index kv_rank, Index q_rank, Index nope, Index rope,
              Index v_dim) {
  MlaConfig c;
  c.d_model = d_model;
  c.n_heads = heads;
  c.kv_rank = kv_rank;
  c.q_rank = q_rank;
  c.q_norm = q_rank > 0;
  c.qk_nope_dim = nope;
  c.rope_dim = rope;
  c.v_dim = v_dim;
  c.rope = RopeConfig{RopeLayout::half_split, 10000.0, 0};
  return c;
}

// A latent of one partial block at B = 128 (96) and of several at B = 16 / 32, one with
// query compression, and a narrow one whose rope key is shorter than a packet.
std::vector<MlaConfig> configs() {
  return {mla(64, 4, 96, 0, 16, 16, 16), mla(48, 3, 64, 24, 8, 4, 12)};
}

// Every stored row [c_t | k_R,t] of a cache, decoded by this test from latent_row(t)
// (codes and scales) and rope_row(t) (bf16).
template <class Cache>
MatD stored_rows(const Cache& cache) {
  using S = typename Cache::storage_type;
  const MlaConfig& c = cache.config();
  MatD rows(cache.sequence_length(), c.kv_rank + c.rope_dim);
  for (Index t = 0; t < rows.rows(); ++t) {
    const auto latent = decode_row<S>(cache.latent_row(t), c.kv_rank);
    for (Index j = 0; j < c.kv_rank; ++j) rows(t, j) = latent[static_cast<std::size_t>(j)];
    const auto* rope = reinterpret_cast<const unsigned char*>(cache.rope_row(t));
    for (Index j = 0; j < c.rope_dim; ++j) rows(t, c.kv_rank + j) = bf16_value(rope + 2 * j);
  }
  return rows;
}

MlaCache<double> double_cache(const MlaLayer<double>& dlayer, const MatD& rows) {
  const Index dc = dlayer.config().kv_rank;
  auto cache = dlayer.make_cache();
  cache.append(rows.leftCols(dc), rows.rightCols(rows.cols() - dc));
  return cache;
}

// The layer's output (1 x d) the double reference gives for the newest of `rows` (rows
// this test decoded from a cache), x_row being that token's input.
MatD reference_output(const MlaLayer<double>& dlayer, const MatD& rows, const MatF& x_row) {
  const MatD q = project_query(dlayer, x_row.cast<double>());
  return reference::decode_step(dlayer, double_cache(dlayer, rows), q) * dlayer.weights().w_o;
}

template <class S>
Index hand_bytes_per_token(const MlaConfig& c) {
  return c.kv_rank + 4 * ((c.kv_rank + S::block - 1) / S::block) + 2 * c.rope_dim;
}

// Raw rows into a contiguous and a paged cache of format S: the stored rows, bytes, and
// attend against the double reference on the decoded rows.
template <class S>
void check_rows_and_attend(const MlaConfig& c, Index length, std::uint64_t seed) {
  const auto layer = MlaLayer<float>::random(c, seed);
  const auto dlayer = to_double(layer);
  MatF latent = random_input<float>(length, c.kv_rank, seed + 1);
  const MatF rope = random_input<float>(length, c.rope_dim, seed + 2);
  latent.row(length / 2) *= 30.0f;  // an outlier token: its own scales, others unaffected
  auto cache = layer.template make_cache<S>();
  cache.append(latent, rope);
  const MatD stored = stored_rows(cache);
  for (Index t = 0; t < length; ++t) {
    for (Index j = 0; j < c.kv_rank; ++j) {
      const Index c0 = j / S::block * S::block;
      const Index c1 = std::min(c.kv_rank, c0 + S::block);
      const double amax = latent.row(t).segment(c0, c1 - c0).cwiseAbs().maxCoeff();
      const double x = latent(t, j);
      CAPTURE(t, j, x, stored(t, j), amax);
      REQUIRE(std::fabs(x - stored(t, j)) <= element_bound<S>(x, amax));
    }
    for (Index j = 0; j < c.rope_dim; ++j) {  // bf16: 8 significant bits, half an ulp
      REQUIRE(std::fabs(rope(t, j) - stored(t, c.kv_rank + j)) <=
              std::ldexp(std::fabs(rope(t, j)), -8));
    }
  }
  CHECK(cache.latent() == stored.leftCols(c.kv_rank).cast<float>());
  CHECK(cache.rope_keys() == stored.rightCols(c.rope_dim).cast<float>());
  CHECK(cache.rows() == stored.cast<float>());

  // Bytes: the hand count, and the analysis for the format.
  const auto tokens = static_cast<std::size_t>(length);
  const an::CacheStorage storage = an::storage_of<S>();
  const an::CacheLayout layout = an::cache_layout(c);
  CHECK(cache.bytes() == static_cast<std::size_t>(hand_bytes_per_token<S>(c)) * tokens);
  CHECK(cache.bytes() ==
        static_cast<std::size_t>(an::bytes_per_token_per_layer(layout, storage)) * tokens);
  CHECK(cache.capacity_bytes() ==
        static_cast<std::size_t>(an::total_bytes(layout, storage, {1}, {cache.capacity(), 1})));
  CHECK(cache.elements_per_token() == layout.elements());

  // The same rows in pages: the same bytes.
  auto pool = make_mla_page_pool<S>(c, 16, (length + 15) / 16 + 1);
  PagedMlaCache<float, S> paged(c, pool);
  paged.append(latent, rope);
  CHECK(paged.bytes() == cache.bytes());
  CHECK(pool->page_bytes() == static_cast<std::size_t>(16 * hand_bytes_per_token<S>(c)));
  for (Index t = 0; t < length; ++t) {
    REQUIRE(std::memcmp(paged.latent_row(t), cache.latent_row(t),
                        static_cast<std::size_t>(cache.latent_stride())) == 0);
    REQUIRE(std::memcmp(paged.rope_row(t), cache.rope_row(t), 2 * std::size_t(c.rope_dim)) == 0);
  }

  const MatF query = random_input<float>(1, c.query_width(), seed + 3);
  const MatD want =
      reference::decode_step(dlayer, double_cache(dlayer, stored), query.cast<double>());
  for (const Threads threads : {Threads{1}, Threads{2}}) {
    RowVector<float> heads(c.n_heads * c.v_dim), paged_heads(c.n_heads * c.v_dim);
    layer.attend(query, cache, heads, threads);
    layer.attend(query, paged, paged_heads, threads);
    CAPTURE(length, threads.count);
    CHECK(relative_error(heads, want) <= kFloatTolerance);
    CHECK(relative_error(paged_heads, want) <= kFloatTolerance);
  }
}

// A prompt, a second chunk (expanded in one cache, absorbed in another), then decode
// steps: every output equals the double reference on the quantized cache's own contents
// (decoded by this test) to float precision, and the fp32 cache's output within the
// format's tolerance. Returns the largest normwise error against the fp32 cache.
template <class S>
double check_prefill_and_decode(const MlaConfig& c, std::uint64_t seed, Index first = 70,
                                Index second = 50, Index steps = 12) {
  const auto layer = MlaLayer<float>::random(c, seed);
  const auto dlayer = to_double(layer);
  const MatF x = random_input<float>(first + second + steps, c.d_model, seed + 1);
  auto cache = layer.template make_cache<S>();
  auto full = layer.make_cache();
  layer.prefill(x.topRows(first), cache);
  layer.prefill(x.topRows(first), full);
  auto absorbed_cache = cache;
  const MatF chunk = layer.prefill(x.middleRows(first, second), cache, {}, MlaPrefill::expanded);
  const MatF chunk_absorbed =
      layer.prefill(x.middleRows(first, second), absorbed_cache, {}, MlaPrefill::absorbed);
  const MatF chunk_full = layer.prefill(x.middleRows(first, second), full);
  const MatD rows = stored_rows(cache);
  CHECK(stored_rows(absorbed_cache) == rows);
  double max_vs_fp32 = relative_error(chunk, chunk_full);
  for (Index i = 0; i < second; i += 7) {
    const Index visible = first + i + 1;
    const MatD want = reference_output(dlayer, rows.topRows(visible), x.row(first + i));
    CAPTURE(i);
    CHECK(relative_error(chunk.row(i), want) <= kFloatTolerance);
    CHECK(relative_error(chunk_absorbed.row(i), want) <= kFloatTolerance);
  }
  RowVector<float> out(c.d_model), out_full(c.d_model);
  for (Index s = 0; s < steps; ++s) {
    const Index t = first + second + s;
    const Threads threads{s % 2 == 0 ? 1 : 2};
    layer.decode(x.row(t), cache, out, threads);
    layer.decode(x.row(t), full, out_full, threads);
    const MatD want = reference_output(dlayer, stored_rows(cache), x.row(t));
    CAPTURE(s);
    CHECK(relative_error(out, want) <= kFloatTolerance);
    max_vs_fp32 = std::max(max_vs_fp32, relative_error(out, out_full));
  }
  CAPTURE(max_vs_fp32);
  CHECK(max_vs_fp32 <= format_tolerance<S>());
  CHECK(max_vs_fp32 > 0.0);  // the format does round
  return max_vs_fp32;
}

// decode_batch over three contiguous caches of different lengths, and over paged forks
// of one prompt read as a shared prefix, equals single decodes.
template <class S>
void check_decode_batch(const MlaConfig& c, std::uint64_t seed) {
  const auto layer = MlaLayer<float>::random(c, seed);
  const MatF x = random_input<float>(3, c.d_model, seed + 5);
  MatF out(3, c.d_model);
  {
    std::vector<MlaCache<float, S>> batch, single;
    const Index lengths[] = {5, 300, 41};
    for (int s = 0; s < 3; ++s) {
      auto cache = layer.template make_cache<S>();
      cache.append(random_input<float>(lengths[s], c.kv_rank, seed + 10 * s),
                   random_input<float>(lengths[s], c.rope_dim, seed + 10 * s + 1));
      batch.push_back(cache);
      single.push_back(cache);
    }
    std::vector<MlaCache<float, S>*> pointers{&batch[0], &batch[1], &batch[2]};
    layer.decode_batch(x, std::span<MlaCache<float, S>* const>(pointers), out, Threads{2});
    for (int s = 0; s < 3; ++s) {
      RowVector<float> want(c.d_model);
      layer.decode(x.row(s), single[static_cast<std::size_t>(s)], want);
      CAPTURE(s);
      CHECK(batch[static_cast<std::size_t>(s)].tokens() == lengths[s] + 1);
      CHECK(relative_error(out.row(s), want) <= kFloatTolerance);
    }
  }
  auto pool = make_mla_page_pool<S>(c, 16, 64);
  PagedMlaCache<float, S> root(c, pool);
  layer.prefill(random_input<float>(300, c.d_model, seed + 7), root);
  std::vector<PagedMlaCache<float, S>> batch{root, root, root};
  layer.prefill(random_input<float>(20, c.d_model, seed + 8), batch[1]);
  std::vector<PagedMlaCache<float, S>> single = batch;
  std::vector<PagedMlaCache<float, S>*> pointers{&batch[0], &batch[1], &batch[2]};
  layer.decode_batch(x, std::span<PagedMlaCache<float, S>* const>(pointers), out, Threads{2},
                     BatchOptions{300});
  for (int s = 0; s < 3; ++s) {
    RowVector<float> want(c.d_model);
    layer.decode(x.row(s), single[static_cast<std::size_t>(s)], want);
    CAPTURE(s);
    CHECK(relative_error(out.row(s), want) <= kFloatTolerance);
  }
}

template <class S>
void check_format(Index length) {
  for (const MlaConfig& c : configs()) {
    CAPTURE(c.kv_rank, c.rope_dim, c.q_rank, S::block);
    check_rows_and_attend<S>(c, length, 11);
    check_prefill_and_decode<S>(c, 21);
    check_decode_batch<S>(c, 31);
  }
}

}  // namespace

TEST_CASE("MLA int8 caches, one scale per latent block of 128", "[quantized]") {
  check_format<Int8<128>>(600);
}
TEST_CASE("MLA int8 caches, blocks of 32", "[quantized]") { check_format<Int8<32>>(300); }
TEST_CASE("MLA fp8 e4m3 caches, blocks of 128", "[quantized]") { check_format<Fp8E4M3<128>>(600); }
TEST_CASE("MLA fp8 e4m3 caches, blocks of 16", "[quantized]") { check_format<Fp8E4M3<16>>(300); }

TEST_CASE("DeepSeek-V2's fp8 MLA cache: 656 bytes per token, as kvcalc predicts", "[quantized]") {
  // DeepSeek-V2 (and V2-Lite): d_c = 512, d_R = 64 (docs/cache-size.md).
  const MlaConfig c = mla(256, 2, 512, 0, 16, 64, 16);
  const MatF latent = random_input<float>(10, 512, 1), rope = random_input<float>(10, 64, 2);
  MlaCache<float, Fp8E4M3<128>> fp8(c);
  fp8.append(latent, rope);
  CHECK(fp8.bytes() == 10u * 656u);  // 512 fp8 + 4 fp32 scales + 64 bf16
  CHECK(an::bytes_per_token_per_layer(an::cache_layout(c), an::block_scaled_storage()) == 656);
  MlaCache<float, Int8<64>> int8(c);
  int8.append(latent, rope);
  CHECK(int8.bytes() == 10u * (512u + 8u * 4u + 128u));
}

TEST_CASE("MLA quantized caches: decode error against fp32 at a DeepSeek-V2-Lite shape",
          "[quantized]") {
  // V2-Lite's attention widths (d_c 512, d_nope 128, d_R 64, d_v 128) at 4 heads and a
  // narrow model width, so the double reference stays quick. The errors are the figures
  // docs/api.md quotes.
  const MlaConfig c = mla(256, 4, 512, 0, 128, 64, 128);
  const double int8 = check_prefill_and_decode<Int8<128>>(c, 51, 100, 40, 6);
  const double fp8 = check_prefill_and_decode<Fp8E4M3<128>>(c, 51, 100, 40, 6);
  WARN("V2-Lite-shaped MLA, normwise error vs an fp32 cache: int8/128 " << int8 << ", fp8 e4m3/128 "
                                                                        << fp8);
}

TEST_CASE("MLA quantized caches with a window and sink tokens", "[quantized][window]") {
  // Contiguous: decode equals the double reference (the window's mask) on the rows this
  // test decoded; paged (pages the window passed go back to the pool): the same outputs.
  MlaConfig c = configs()[0];
  c.window = 40;
  c.sink_tokens = 3;
  const auto layer = MlaLayer<float>::random(c, 61);
  const auto dlayer = to_double(layer);
  const MatF x = random_input<float>(160, c.d_model, 62);
  auto cache = layer.template make_cache<Fp8E4M3<32>>();
  auto pool = make_mla_page_pool<Fp8E4M3<32>>(c, 16, 16);
  PagedMlaCache<float, Fp8E4M3<32>> paged(c, pool);
  layer.prefill(x.topRows(100), cache);
  layer.prefill(x.topRows(100), paged);
  RowVector<float> out(c.d_model), paged_out(c.d_model);
  for (Index t = 100; t < x.rows(); ++t) {
    const Threads threads{t % 2 == 0 ? 1 : 2};
    layer.decode(x.row(t), cache, out, threads);
    layer.decode(x.row(t), paged, paged_out, threads);
    const MatD want = reference_output(dlayer, stored_rows(cache), x.row(t));
    CAPTURE(t);
    CHECK(relative_error(out, want) <= kFloatTolerance);
    CHECK(relative_error(paged_out, out) <= kFloatTolerance);
  }
  // The paged cache keeps the sinks' page and the window's: at most 1 + ceil(40 / 16) + 1.
  CHECK(pool->pages_in_use() <= 5);
}

namespace {

// A NaN or infinity for a quantized cache: value_error, and the cache as it was.
template <class Cache>
void check_refused(const MlaLayer<float>& layer, Cache& cache, const PagePool* pool = nullptr) {
  const MlaConfig& c = layer.config();
  const MatD before = stored_rows(cache);
  const Index tokens = cache.tokens(), capacity = cache.capacity();
  const Index pages = pool != nullptr ? pool->pages_in_use() : 0;
  auto unchanged = [&] {
    if (pool != nullptr) CHECK(pool->pages_in_use() == pages);
    CHECK(cache.tokens() == tokens);
    CHECK(cache.capacity() == capacity);
    CHECK(stored_rows(cache) == before);
  };
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  MatF latent = random_input<float>(3, c.kv_rank, 3), rope = random_input<float>(3, c.rope_dim, 4);
  latent(1, 2) = nan;
  CHECK_THROWS_AS(cache.append(latent, rope), value_error);
  unchanged();
  latent(1, 2) = 0.5f;
  rope(2, c.rope_dim - 1) = -inf;
  CHECK_THROWS_AS(cache.append(latent, rope), value_error);
  unchanged();
  kvattn::test::check_layer_refusals(layer, cache, unchanged);
}

}  // namespace

TEST_CASE("MLA quantized caches refuse NaN and infinity and change nothing", "[quantized]") {
  // Without the latent norm an infinite input stays infinite in the latent (the norm
  // would turn it into NaN: refused all the same).
  MlaConfig c = configs()[0];
  c.kv_norm = false;
  const auto layer = MlaLayer<float>::random(c, 41);
  auto int8 = layer.template make_cache<Int8<>>();
  int8.append(random_input<float>(20, c.kv_rank, 1), random_input<float>(20, c.rope_dim, 2));
  check_refused(layer, int8);
  auto pool = make_mla_page_pool<Fp8E4M3<>>(c, 8, 16);
  PagedMlaCache<float, Fp8E4M3<>> paged(c, pool);
  paged.append(random_input<float>(20, c.kv_rank, 1), random_input<float>(20, c.rope_dim, 2));
  check_refused(layer, paged, pool.get());
}

TEST_CASE("An MLA pool names the quantized format it is for", "[quantized]") {
  const MlaConfig c = configs()[0];
  auto pool = make_mla_page_pool<Int8<32>>(c, 8, 4);
  CHECK_THAT(pool->layout(), Catch::Contains("int8/32"));
  CHECK_THROWS_AS((PagedMlaCache<float, Fp8E4M3<32>>(c, pool)), config_error);
}
