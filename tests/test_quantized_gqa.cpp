// [quantized]: MHA, GQA and MQA layers over block-quantized caches (Int8<B>, Fp8E4M3<B>),
// contiguous and paged.
//
//  * The stored rows, read byte by byte in the layout docs/api.md gives and decoded by
//    this test, are within the format's bound of the appended rows, and cache.keys(g)
//    returns exactly them.
//  * bytes() and capacity_bytes() equal the analysis module's prediction for the format
//    (scales included) and the hand count 2 n_kv (d_h + 4 ceil(d_h / B)) per token.
//  * attend (1 and 2 threads, contiguous and paged) equals the double reference on the
//    rows this test decoded, to float precision: the kernels are exact on what is stored.
//  * prefill (chunked, after cached tokens) and decode equal the double reference on the
//    cache's own contents, and stay within the format's accuracy of an fp32 cache.
//  * decode_batch equals single decodes.
//  * A NaN or infinity headed for a quantized cache throws value_error and changes nothing
//    (append, prefill, decode, decode_batch; contiguous and paged).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attend_util.hpp"
#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/attention/gqa.hpp"
#include "kvattn/cache/paged_gqa_cache.hpp"
#include "kvattn/reference/gqa.hpp"
#include "quantized_refusal.hpp"
#include "quantized_util.hpp"
#include "test_util.hpp"

using namespace kvattn;
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

// Against the double reference on the same stored rows only float arithmetic differs
// (as for every float path of the suite, test_util.hpp).
constexpr double kFloatTolerance = 1e-5;

const RopeConfig kRope{RopeLayout::half_split, 10000.0, 0};

// MHA, GQA (4 query heads per KV head) and MQA, head widths of one packet and more, and
// one (48) that is not a multiple of the AVX-512 packet.
std::vector<GqaConfig> configs() {
  return {mha_config(64, 4, 32, kRope), gqa_config(96, 8, 48, 2, kRope),
          mqa_config(64, 8, 128, kRope)};
}

// Every stored key and value row of a cache, decoded by this test, as two
// tokens x (n_kv * d_h) matrices (the append layout).
template <class Cache>
std::pair<MatD, MatD> stored_rows(const Cache& cache) {
  using S = typename Cache::storage_type;
  const GqaConfig& c = cache.config();
  const Index dh = c.head_dim;
  MatD keys(cache.tokens(), c.kv_width()), values(cache.tokens(), c.kv_width());
  for (Index t = 0; t < cache.tokens(); ++t) {
    for (Index g = 0; g < c.n_kv_heads; ++g) {
      const auto k = decode_row<S>(cache.key_row(g, t), dh);
      const auto v = decode_row<S>(cache.value_row(g, t), dh);
      for (Index j = 0; j < dh; ++j) {
        keys(t, g * dh + j) = k[static_cast<std::size_t>(j)];
        values(t, g * dh + j) = v[static_cast<std::size_t>(j)];
      }
    }
  }
  return {keys, values};
}

// Each stored element within the format's bound of the appended one (rows of d_h
// elements, blocks of B along each row).
template <class S>
void check_within_bound(const MatF& appended, const MatD& stored, Index dh) {
  for (Index t = 0; t < appended.rows(); ++t) {
    for (Index j = 0; j < appended.cols(); ++j) {
      const Index head = j / dh, b = (j % dh) / S::block;
      const Index c0 = head * dh + b * S::block;
      const Index c1 = std::min(head * dh + dh, c0 + S::block);
      const double amax = appended.row(t).segment(c0, c1 - c0).cwiseAbs().maxCoeff();
      const double x = appended(t, j);
      CAPTURE(t, j, x, stored(t, j), amax);
      REQUIRE(std::fabs(x - stored(t, j)) <= element_bound<S>(x, amax));
    }
  }
}

GqaCache<double> double_cache(const GqaLayer<double>& dlayer, const MatD& keys,
                              const MatD& values) {
  auto cache = dlayer.make_cache();
  cache.append(keys, values);
  return cache;
}

template <class S>
Index hand_bytes_per_token(const GqaConfig& c) {
  return 2 * c.n_kv_heads * (c.head_dim + 4 * ((c.head_dim + S::block - 1) / S::block));
}

// Raw rows into a contiguous and a paged cache of format S: the stored rows, bytes, and
// attend against the double reference on the decoded rows.
template <class S>
void check_rows_and_attend(const GqaConfig& c, Index length, std::uint64_t seed) {
  const auto layer = GqaLayer<float>::random(c, seed);
  const auto dlayer = to_double(layer);
  const MatF keys = random_input<float>(length, c.kv_width(), seed + 1);
  MatF values = random_input<float>(length, c.kv_width(), seed + 2);
  values.row(length / 2) *= 30.0f;  // an outlier token: its own scale, others unaffected
  auto cache = layer.template make_cache<S>();
  cache.append(keys, values);
  const auto [stored_keys, stored_values] = stored_rows(cache);
  check_within_bound<S>(keys, stored_keys, c.head_dim);
  check_within_bound<S>(values, stored_values, c.head_dim);
  // keys(g) / values(g): the same rows, code x scale rounded once to float.
  for (Index g = 0; g < c.n_kv_heads; ++g) {
    CHECK(cache.keys(g) ==
          stored_keys.middleCols(g * c.head_dim, c.head_dim).template cast<float>());
    CHECK(cache.values(g) ==
          stored_values.middleCols(g * c.head_dim, c.head_dim).template cast<float>());
  }

  // Bytes: the hand count, and the analysis for the format.
  const auto tokens = static_cast<std::size_t>(length);
  const an::CacheStorage storage = an::storage_of<S>();
  CHECK(storage.dtype == S::code);
  CHECK(storage.scale_block == S::block);
  CHECK(storage.scale_dtype == an::Dtype::fp32);
  const an::CacheLayout layout = an::cache_layout(c);
  CHECK(cache.bytes() == static_cast<std::size_t>(hand_bytes_per_token<S>(c)) * tokens);
  CHECK(cache.bytes() ==
        static_cast<std::size_t>(an::bytes_per_token_per_layer(layout, storage)) * tokens);
  CHECK(cache.bytes() ==
        static_cast<std::size_t>(an::total_bytes(layout, storage, {1}, {length, 1})));
  CHECK(cache.capacity_bytes() ==
        static_cast<std::size_t>(an::total_bytes(layout, storage, {1}, {cache.capacity(), 1})));
  CHECK(cache.elements_per_token() == layout.elements());

  // The same rows in pages: the same codes, the same bytes.
  auto pool = make_gqa_page_pool<S>(c, 16, (length + 15) / 16 + 1);
  PagedGqaCache<float, S> paged(c, pool);
  paged.append(keys, values);
  CHECK(paged.bytes() == cache.bytes());
  for (Index t = 0; t < length; ++t) {
    for (Index g = 0; g < c.n_kv_heads; ++g) {
      REQUIRE(std::memcmp(paged.key_row(g, t), cache.key_row(g, t),
                          std::size_t(cache.row_stride())) == 0);
      REQUIRE(std::memcmp(paged.value_row(g, t), cache.value_row(g, t),
                          std::size_t(cache.row_stride())) == 0);
    }
  }

  const MatF query = random_input<float>(1, c.n_heads * c.head_dim, seed + 3);
  const MatD want = reference::decode_step(dlayer, double_cache(dlayer, stored_keys, stored_values),
                                           query.cast<double>());
  for (const Threads threads : {Threads{1}, Threads{2}}) {
    RowVector<float> heads(c.n_heads * c.head_dim), paged_heads(c.n_heads * c.head_dim);
    layer.attend(query, cache, heads, threads);
    layer.attend(query, paged, paged_heads, threads);
    CAPTURE(length, threads.count);
    CHECK(relative_error(heads, want) <= kFloatTolerance);
    CHECK(relative_error(paged_heads, want) <= kFloatTolerance);
  }
}

// Prefill in two chunks, then decode, into a quantized and an fp32 cache: every output
// equals the double reference on the quantized cache's own contents (decoded by this
// test) to float precision, and the fp32 cache's within the format's tolerance.
template <class S>
void check_prefill_and_decode(const GqaConfig& c, std::uint64_t seed) {
  const auto layer = GqaLayer<float>::random(c, seed);
  const auto dlayer = to_double(layer);
  constexpr Index first = 70, second = 50, steps = 12;
  const MatF x = random_input<float>(first + second + steps, c.d_model, seed + 1);
  auto cache = layer.template make_cache<S>();
  auto full = layer.make_cache();
  layer.prefill(x.topRows(first), cache);
  layer.prefill(x.topRows(first), full);
  const MatF chunk = layer.prefill(x.middleRows(first, second), cache);
  const MatF chunk_full = layer.prefill(x.middleRows(first, second), full);
  const auto [keys, values] = stored_rows(cache);
  double max_vs_fp32 = relative_error(chunk, chunk_full);
  for (Index i = 0; i < second; i += 7) {
    const Index visible = first + i + 1;
    const MatD q = project_query(dlayer, x.row(first + i).cast<double>());
    const MatD want =
        reference::decode_step(
            dlayer, double_cache(dlayer, keys.topRows(visible), values.topRows(visible)), q) *
        dlayer.weights().w_o;
    CAPTURE(i);
    CHECK(relative_error(chunk.row(i), want) <= kFloatTolerance);
  }
  RowVector<float> out(c.d_model), out_full(c.d_model);
  for (Index s = 0; s < steps; ++s) {
    const Index t = first + second + s;
    const Threads threads{s % 2 == 0 ? 1 : 2};
    layer.decode(x.row(t), cache, out, threads);
    layer.decode(x.row(t), full, out_full, threads);
    const auto [k, v] = stored_rows(cache);
    const MatD q = project_query(dlayer, x.row(t).cast<double>());
    const MatD want =
        reference::decode_step(dlayer, double_cache(dlayer, k, v), q) * dlayer.weights().w_o;
    CAPTURE(s);
    CHECK(relative_error(out, want) <= kFloatTolerance);
    max_vs_fp32 = std::max(max_vs_fp32, relative_error(out, out_full));
  }
  CAPTURE(max_vs_fp32);
  CHECK(max_vs_fp32 <= format_tolerance<S>());
  CHECK(max_vs_fp32 > 0.0);  // the format does round
}

// decode_batch over three quantized caches of different lengths equals three decodes.
template <class S>
void check_decode_batch(const GqaConfig& c, std::uint64_t seed) {
  const auto layer = GqaLayer<float>::random(c, seed);
  std::vector<GqaCache<float, S>> batch, single;
  const Index lengths[] = {5, 300, 41};
  for (int s = 0; s < 3; ++s) {
    auto cache = layer.template make_cache<S>();
    cache.append(random_input<float>(lengths[s], c.kv_width(), seed + 10 * s),
                 random_input<float>(lengths[s], c.kv_width(), seed + 10 * s + 1));
    batch.push_back(cache);
    single.push_back(cache);
  }
  std::vector<GqaCache<float, S>*> pointers{&batch[0], &batch[1], &batch[2]};
  const MatF x = random_input<float>(3, c.d_model, seed + 5);
  MatF out(3, c.d_model);
  layer.decode_batch(x, std::span<GqaCache<float, S>* const>(pointers), out, Threads{2});
  for (int s = 0; s < 3; ++s) {
    RowVector<float> want(c.d_model);
    layer.decode(x.row(s), single[static_cast<std::size_t>(s)], want);
    CAPTURE(s);
    CHECK(batch[static_cast<std::size_t>(s)].tokens() == lengths[s] + 1);
    CHECK(relative_error(out.row(s), want) <= kFloatTolerance);
  }
}

template <class S>
void check_format(Index length) {
  for (const GqaConfig& c : configs()) {
    CAPTURE(c.n_heads, c.n_kv_heads, c.head_dim, S::block);
    check_rows_and_attend<S>(c, length, 11);
    check_prefill_and_decode<S>(c, 21);
    check_decode_batch<S>(c, 31);
  }
}

}  // namespace

TEST_CASE("int8 caches, one scale per row", "[quantized]") { check_format<Int8<128>>(600); }
TEST_CASE("int8 caches, blocks of 32 along each row", "[quantized]") {
  check_format<Int8<32>>(300);
}
TEST_CASE("fp8 e4m3 caches, one scale per row", "[quantized]") { check_format<Fp8E4M3<128>>(600); }
TEST_CASE("fp8 e4m3 caches, blocks of 16 along each row", "[quantized]") {
  check_format<Fp8E4M3<16>>(300);
}

namespace {

// A NaN or infinity for a quantized cache: value_error, and the cache as it was (rows,
// tokens, capacity; a paged cache's pool pages).
template <class Cache>
void check_refused(const GqaLayer<float>& layer, Cache& cache, const PagePool* pool = nullptr) {
  const GqaConfig& c = layer.config();
  const auto before = stored_rows(cache);
  const Index tokens = cache.tokens(), capacity = cache.capacity();
  const Index pages = pool != nullptr ? pool->pages_in_use() : 0;
  auto unchanged = [&] {
    if (pool != nullptr) CHECK(pool->pages_in_use() == pages);
    CHECK(cache.tokens() == tokens);
    CHECK(cache.capacity() == capacity);
    const auto after = stored_rows(cache);
    CHECK(after.first == before.first);
    CHECK(after.second == before.second);
  };
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  MatF keys = random_input<float>(3, c.kv_width(), 3),
       values = random_input<float>(3, c.kv_width(), 4);
  keys(1, 2) = nan;
  CHECK_THROWS_AS(cache.append(keys, values), value_error);
  unchanged();
  keys(1, 2) = 0.5f;
  values(2, c.kv_width() - 1) = -inf;
  CHECK_THROWS_AS(cache.append(keys, values), value_error);
  unchanged();
  kvattn::test::check_layer_refusals(layer, cache, unchanged);
}

}  // namespace

TEST_CASE("Quantized caches refuse NaN and infinity and change nothing", "[quantized]") {
  const auto layer = GqaLayer<float>::random(gqa_config(64, 4, 32, 2, kRope), 41);
  const GqaConfig& c = layer.config();
  auto int8 = layer.template make_cache<Int8<>>();
  int8.append(random_input<float>(20, c.kv_width(), 1), random_input<float>(20, c.kv_width(), 2));
  check_refused(layer, int8);
  auto pool = make_gqa_page_pool<Fp8E4M3<>>(c, 8, 16);
  PagedGqaCache<float, Fp8E4M3<>> paged(c, pool);
  paged.append(random_input<float>(20, c.kv_width(), 1), random_input<float>(20, c.kv_width(), 2));
  check_refused(layer, paged, pool.get());
}

TEST_CASE("A pool names the quantized format it is for", "[quantized]") {
  const GqaConfig c = gqa_config(64, 4, 32, 2, kRope);
  auto pool = make_gqa_page_pool<Int8<32>>(c, 8, 4);
  CHECK_THAT(pool->layout(), Catch::Contains("int8/32"));
  CHECK(pool->page_bytes() == static_cast<std::size_t>(8 * hand_bytes_per_token<Int8<32>>(c)));
  // A cache of another format cannot use it.
  CHECK_THROWS_AS((PagedGqaCache<float, Fp8E4M3<32>>(c, pool)), config_error);
}
