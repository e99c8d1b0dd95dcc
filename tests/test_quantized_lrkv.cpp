// [quantized]: LRKV layers over block-quantized caches (Int8<B>, Fp8E4M3<B>), contiguous
// (LrkvCache) and paged (PagedLrkvCache).
//
//  * The stored rows, read byte by byte in the layout docs/api.md gives (per token: the
//    key row [k~_s | r~_1 ... r~_H] and the value row [v_s | r^V_1 ... r^V_H], each part
//    its codes then its fp32 block scales; k~_R in bf16; key RMS in fp32) and decoded by
//    this test, are within the format's bound of the appended rows, and the cache's views
//    return exactly them.
//  * bytes() equals the analysis module's prediction for the format and a hand count.
//  * attend (1 and 2 threads, contiguous and paged) and attend_states equal the double
//    reference (reference::decode_step) on the rows this test decoded, to float precision.
//  * prefill (chunked, after cached tokens) and decode equal the double reference on the
//    cache's own contents, and stay within the format's accuracy of an fp32 cache.
//  * decode_batch equals single decodes (also with a shared prefix over forks).
//  * A double layer over an int8 cache equals the reference to double precision.
//  * A NaN or infinity headed for a quantized cache throws value_error and changes nothing.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "attend_util.hpp"
#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/cache/paged_lrkv_cache.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "quantized_refusal.hpp"
#include "quantized_util.hpp"
#include "test_util.hpp"

using namespace kvattn;
using kvattn::test::bf16_value;
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

constexpr double kFloatTolerance = 1e-5;

LrkvConfig make_config(Index d, Index H, Index dh, Index r, LrkvRopeMode mode, Index rope_dim,
                       bool key_norm) {
  LrkvConfig c{d, H, dh, r};
  c.rope_mode = mode;
  if (mode != LrkvRopeMode::none) c.rope = {RopeLayout::half_split, 10000.0, 3};
  c.rope_dim = rope_dim;
  c.key_norm = key_norm;
  return c;
}

// The three rope modes the reference decode step computes, key norm on and off, head
// widths of one packet and more, ranks wider and narrower than a block of 16 or 32 (and
// 0: MQA), and one rank (20) that is not a multiple of a packet.
std::vector<LrkvConfig> configs() {
  return {make_config(64, 4, 32, 8, LrkvRopeMode::shared, 0, true),
          make_config(96, 3, 48, 20, LrkvRopeMode::decoupled, 16, false),
          make_config(64, 2, 64, 40, LrkvRopeMode::none, 0, true),
          make_config(48, 2, 24, 0, LrkvRopeMode::decoupled, 8, true)};
}

// Bytes of one part of a row (w values): w codes, then ceil(w / B) fp32 scales.
template <class S>
Index part_bytes(Index w) {
  return w + 4 * ((w + S::block - 1) / S::block);
}

// A part of w values stored at `part`, decoded from its bytes (quantized_util.hpp).
template <class S>
void decode_part(const unsigned char* part, Index w, double* out) {
  const std::vector<double> values = kvattn::test::decode_row<S>(part, w);
  std::copy(values.begin(), values.end(), out);
}

// Every stored row of a cache, decoded by this test, in the append layout (rows_type).
struct Decoded {
  MatD shared_keys, shared_values, residual_keys, residual_values, rope_keys, key_rms;
  bool operator==(const Decoded&) const = default;
};

template <class Cache>
Decoded stored_rows(const Cache& cache) {
  using S = typename Cache::storage_type;
  const LrkvConfig& c = cache.config();
  const Index L = cache.tokens(), dh = c.head_dim, r = c.rank, H = c.n_heads;
  const Index dr = c.decoupled_dim(), norms = c.key_norm ? H : 0;
  Decoded d{MatD(L, dh), MatD(L, dh), MatD(L, H * r), MatD(L, H * r), MatD(L, dr), MatD(L, norms)};
  for (Index t = 0; t < L; ++t) {
    const auto* k = reinterpret_cast<const unsigned char*>(cache.key_row(t));
    const auto* v = reinterpret_cast<const unsigned char*>(cache.value_row(t));
    decode_part<S>(k, dh, d.shared_keys.row(t).data());
    decode_part<S>(v, dh, d.shared_values.row(t).data());
    for (Index h = 0; h < H && r > 0; ++h) {
      const Index at = part_bytes<S>(dh) + h * part_bytes<S>(r);
      decode_part<S>(k + at, r, d.residual_keys.row(t).data() + h * r);
      decode_part<S>(v + at, r, d.residual_values.row(t).data() + h * r);
    }
    const auto* rope = reinterpret_cast<const unsigned char*>(cache.rope_row(t));
    for (Index j = 0; j < dr; ++j) d.rope_keys(t, j) = bf16_value(rope + 2 * j);
    const auto* rms = reinterpret_cast<const unsigned char*>(cache.rms_row(t));
    for (Index h = 0; h < norms; ++h) {
      float rho;
      std::memcpy(&rho, rms + 4 * h, sizeof rho);
      d.key_rms(t, h) = rho;
    }
  }
  return d;
}

// Each stored element within the bound of the appended one; parts `w` wide (blocks of B
// along each part, never across two).
template <class S>
void check_within_bound(const MatF& appended, const MatD& stored, Index w) {
  REQUIRE(stored.rows() == appended.rows());
  REQUIRE(stored.cols() == appended.cols());
  for (Index t = 0; t < appended.rows(); ++t) {
    for (Index j = 0; j < appended.cols(); ++j) {
      const Index part = j / w, b = (j % w) / S::block;
      const Index c0 = part * w + b * S::block;
      const Index c1 = std::min(part * w + w, c0 + S::block);
      const double amax = appended.row(t).segment(c0, c1 - c0).cwiseAbs().maxCoeff();
      const double x = appended(t, j);
      CAPTURE(t, j, x, stored(t, j), amax);
      REQUIRE(std::fabs(x - stored(t, j)) <= element_bound<S>(x, amax));
    }
  }
}

// A double cache holding the decoded rows (the reference's input).
LrkvCache<double> double_cache(const LrkvConfig& c, const Decoded& d, Index tokens) {
  LrkvCache<double> cache(c);
  cache.append({d.shared_keys.topRows(tokens), d.shared_values.topRows(tokens),
                d.residual_keys.topRows(tokens), d.residual_values.topRows(tokens),
                d.rope_keys.topRows(tokens), d.key_rms.topRows(tokens)});
  return cache;
}

template <class S>
Index hand_bytes_per_token(const LrkvConfig& c) {
  return 2 * part_bytes<S>(c.head_dim) + 2 * c.n_heads * (c.rank == 0 ? 0 : part_bytes<S>(c.rank)) +
         2 * c.decoupled_dim() + (c.key_norm ? 4 * c.n_heads : 0);
}

// Raw rows into a contiguous and a paged cache of format S: the stored rows, the bytes,
// and attend against the double reference on the decoded rows.
template <class S>
void check_rows_and_attend(const LrkvConfig& c, Index length, std::uint64_t seed) {
  const auto layer = LrkvLayer<float>::random(c, seed);
  const auto dlayer = to_double(layer);
  const Index dh = c.head_dim, hr = c.residual_width(), dr = c.decoupled_dim();
  const MatF shared_keys = random_input<float>(length, dh, seed + 1);
  MatF shared_values = random_input<float>(length, dh, seed + 2);
  shared_values.row(length / 2) *= 30.0f;  // an outlier token: its own scales
  const MatF residual_keys = random_input<float>(length, hr, seed + 3);
  MatF residual_values = random_input<float>(length, hr, seed + 4);
  if (hr > 0) residual_values.col(hr - 1) *= 50.0f;  // an outlier channel of the last head
  const MatF rope_keys = random_input<float>(length, dr, seed + 5);
  const MatF key_rms =
      (random_input<float>(length, c.key_norm ? c.n_heads : 0, seed + 6).array().abs() + 0.5f)
          .matrix();
  auto cache = layer.template make_cache<S>();
  cache.append({shared_keys, shared_values, residual_keys, residual_values, rope_keys, key_rms});
  const Decoded d = stored_rows(cache);
  check_within_bound<S>(shared_keys, d.shared_keys, dh);
  check_within_bound<S>(shared_values, d.shared_values, dh);
  check_within_bound<S>(residual_keys, d.residual_keys, std::max<Index>(c.rank, 1));
  check_within_bound<S>(residual_values, d.residual_values, std::max<Index>(c.rank, 1));
  // k~_R in bf16 (round to nearest: half an ulp of 8 bits), the key RMS in fp32 exactly.
  for (Index t = 0; t < length; ++t) {
    for (Index j = 0; j < dr; ++j) {
      const double x = rope_keys(t, j);
      REQUIRE(std::fabs(d.rope_keys(t, j) - x) <= std::ldexp(std::fabs(x), -8));
    }
  }
  CHECK(d.key_rms == key_rms.cast<double>());
  // The views: the same values, code x scale rounded once to float.
  CHECK(cache.shared_keys() == d.shared_keys.cast<float>());
  CHECK(cache.shared_values() == d.shared_values.cast<float>());
  CHECK(cache.residual_keys() == d.residual_keys.cast<float>());
  CHECK(cache.residual_values() == d.residual_values.cast<float>());
  for (Index h = 0; h < c.n_heads; ++h) {
    CHECK(cache.residual_keys(h) == d.residual_keys.middleCols(h * c.rank, c.rank).cast<float>());
  }
  CHECK(cache.rope_keys().template cast<double>() == d.rope_keys);
  CHECK(cache.elements_per_token() == c.cache_elements_per_token());

  // Bytes: the hand count, and the analysis for the format.
  const auto tokens = static_cast<std::size_t>(length);
  const an::CacheStorage storage = an::storage_of<S>();
  const an::CacheLayout layout = an::cache_layout(c);
  CHECK(cache.bytes() == static_cast<std::size_t>(hand_bytes_per_token<S>(c)) * tokens);
  CHECK(cache.bytes() ==
        static_cast<std::size_t>(an::bytes_per_token_per_layer(layout, storage)) * tokens);
  CHECK(cache.capacity_bytes() ==
        static_cast<std::size_t>(an::total_bytes(layout, storage, {1}, {cache.capacity(), 1})));

  // The same rows in pages: the same bytes.
  auto pool = make_lrkv_page_pool<S>(c, 16, (length + 15) / 16 + 1);
  CHECK(pool->page_bytes() == static_cast<std::size_t>(16 * hand_bytes_per_token<S>(c)));
  PagedLrkvCache<float, S> paged(c, pool);
  paged.append({shared_keys, shared_values, residual_keys, residual_values, rope_keys, key_rms});
  CHECK(paged.bytes() == cache.bytes());
  CHECK(paged.key_row_stride() == cache.key_row_stride());
  for (Index t = 0; t < length; ++t) {
    REQUIRE(std::memcmp(paged.key_row(t), cache.key_row(t),
                        static_cast<std::size_t>(cache.key_row_stride())) == 0);
    REQUIRE(std::memcmp(paged.value_row(t), cache.value_row(t),
                        static_cast<std::size_t>(cache.value_row_stride())) == 0);
  }
  CHECK(stored_rows(paged) == d);

  const MatF query = random_input<float>(1, c.query_width(), seed + 7);
  const MatD want =
      reference::decode_step(dlayer, double_cache(c, d, length), query.cast<double>());
  for (const Threads threads : {Threads{1}, Threads{2}}) {
    RowVector<float> heads(c.n_heads * dh), paged_heads(c.n_heads * dh);
    layer.attend(query, cache, heads, threads);
    layer.attend(query, paged, paged_heads, threads);
    CAPTURE(length, threads.count);
    CHECK(relative_error(heads, want) <= kFloatTolerance);
    CHECK(relative_error(paged_heads, want) <= kFloatTolerance);
  }
  // attend_states: the same attention as unnormalized partial states (no sink logits).
  auto ws = layer.make_workspace();
  for (int paged_states = 0; paged_states < 2; ++paged_states) {
    SoftmaxStates<float> states;
    if (paged_states == 1) {
      layer.attend_states(query, length - 1, paged, states, ws);
    } else {
      layer.attend_states(query, length - 1, cache, states, ws);
    }
    RowVector<float> heads(c.n_heads * dh);
    for (Index h = 0; h < c.n_heads; ++h)
      heads.segment(h * dh, dh) = states.acc.row(h) / states.sum(h);
    CAPTURE(paged_states);
    CHECK(relative_error(heads, want) <= kFloatTolerance);
  }
}

// Prefill in two chunks, then decode, into a quantized cache (contiguous or paged) and an
// fp32 one: every output equals the double reference on the quantized cache's own
// contents (decoded by this test) to float precision, and the fp32 cache's within the
// format's tolerance.
template <class S, class Cache>
void check_prefill_and_decode(const LrkvLayer<float>& layer, Cache cache) {
  const LrkvConfig& c = layer.config();
  const auto dlayer = to_double(layer);
  constexpr Index first = 70, second = 50, steps = 10;
  const MatF x = random_input<float>(first + second + steps, c.d_model, 77);
  auto full = layer.make_cache();
  layer.prefill(x.topRows(first), cache);
  layer.prefill(x.topRows(first), full);
  const MatF chunk = layer.prefill(x.middleRows(first, second), cache, Threads{2});
  const MatF chunk_full = layer.prefill(x.middleRows(first, second), full);
  const Decoded d = stored_rows(cache);
  double max_vs_fp32 = relative_error(chunk, chunk_full);
  for (Index i = 0; i < second; i += 7) {
    const MatD q = project_query(dlayer, x.row(first + i).cast<double>());
    const MatD want =
        reference::decode_step(dlayer, double_cache(c, d, first + i + 1), q) * dlayer.weights().w_o;
    CAPTURE(i);
    CHECK(relative_error(chunk.row(i), want) <= kFloatTolerance);
  }
  RowVector<float> out(c.d_model), out_full(c.d_model);
  for (Index s = 0; s < steps; ++s) {
    const Index t = first + second + s;
    const Threads threads{s % 2 == 0 ? 1 : 2};
    layer.decode(x.row(t), cache, out, threads);
    layer.decode(x.row(t), full, out_full, threads);
    const Decoded now = stored_rows(cache);
    const MatD q = project_query(dlayer, x.row(t).cast<double>());
    const MatD want =
        reference::decode_step(dlayer, double_cache(c, now, now.shared_keys.rows()), q) *
        dlayer.weights().w_o;
    CAPTURE(s);
    CHECK(relative_error(out, want) <= kFloatTolerance);
    max_vs_fp32 = std::max(max_vs_fp32, relative_error(out, out_full));
  }
  CAPTURE(max_vs_fp32);
  CHECK(max_vs_fp32 <= format_tolerance<S>());
  CHECK(max_vs_fp32 > 0.0);  // the format does round
}

// decode_batch over three quantized caches of different lengths equals three decodes.
template <class Cache>
void check_decode_batch(const LrkvLayer<float>& layer, std::vector<Cache> batch) {
  const LrkvConfig& c = layer.config();
  const std::vector<Cache> single = batch;
  std::vector<Cache*> pointers;
  for (auto& cache : batch) pointers.push_back(&cache);
  const auto n = static_cast<Index>(batch.size());
  const MatF x = random_input<float>(n, c.d_model, 5);
  MatF out(n, c.d_model);
  layer.decode_batch(x, std::span<Cache* const>(pointers), out, Threads{2});
  for (Index s = 0; s < n; ++s) {
    Cache alone = single[static_cast<std::size_t>(s)];
    RowVector<float> want(c.d_model);
    layer.decode(x.row(s), alone, want);
    CAPTURE(s);
    CHECK(batch[static_cast<std::size_t>(s)].tokens() == alone.tokens());
    CHECK(stored_rows(batch[static_cast<std::size_t>(s)]) == stored_rows(alone));
    CHECK(relative_error(out.row(s), want) <= kFloatTolerance);
  }
}

template <class S>
void check_format(Index length) {
  for (const LrkvConfig& c : configs()) {
    CAPTURE(c.n_heads, c.head_dim, c.rank, to_string(c.rope_mode), c.key_norm, S::block);
    check_rows_and_attend<S>(c, length, 11);
    const auto layer = LrkvLayer<float>::random(c, 21);
    check_prefill_and_decode<S>(layer, layer.template make_cache<S>());
    auto pool = make_lrkv_page_pool<S>(c, 16, 64);
    check_prefill_and_decode<S>(layer, PagedLrkvCache<float, S>(c, pool));
    std::vector<LrkvCache<float, S>> batch;
    std::vector<PagedLrkvCache<float, S>> paged;
    const Index lengths[] = {5, 200, 41};
    for (int s = 0; s < 3; ++s) {
      const MatF x = random_input<float>(lengths[s], c.d_model, 31 + s);
      batch.push_back(layer.template make_cache<S>());
      layer.prefill(x, batch.back());
      paged.emplace_back(c, pool);
      layer.prefill(x, paged.back());
    }
    check_decode_batch(layer, batch);
    check_decode_batch(layer, paged);
  }
}

}  // namespace

TEST_CASE("LRKV int8 caches, one scale per part", "[quantized]") { check_format<Int8<128>>(300); }
TEST_CASE("LRKV int8 caches, blocks of 32 along each part", "[quantized]") {
  check_format<Int8<32>>(200);
}
TEST_CASE("LRKV fp8 e4m3 caches, one scale per part", "[quantized]") {
  check_format<Fp8E4M3<128>>(300);
}
TEST_CASE("LRKV fp8 e4m3 caches, blocks of 16 along each part", "[quantized]") {
  check_format<Fp8E4M3<16>>(200);
}

namespace {

// A NaN or infinity for a quantized cache: value_error, and the cache as it was (rows,
// tokens, capacity; a paged cache's pool pages).
template <class Cache>
void check_refused(const LrkvLayer<float>& layer, Cache& cache, const PagePool* pool = nullptr) {
  const LrkvConfig& c = layer.config();
  const Decoded before = stored_rows(cache);
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
  const Index dh = c.head_dim, hr = c.residual_width(), dr = c.decoupled_dim();
  MatF shared = random_input<float>(3, dh, 3), latent = random_input<float>(3, hr, 4);
  MatF rope = random_input<float>(3, dr, 5);
  const MatF rms = MatF::Constant(3, c.key_norm ? c.n_heads : 0, 1.5f);
  latent(1, hr - 1) = nan;
  CHECK_THROWS_AS(cache.append({shared, shared, latent, latent, rope, rms}), value_error);
  unchanged();
  latent(1, hr - 1) = 0.5f;
  shared(2, 0) = -inf;
  CHECK_THROWS_AS(cache.append({shared, shared, latent, latent, rope, rms}), value_error);
  unchanged();
  shared(2, 0) = 0.5f;
  if (dr > 0) {
    rope(0, dr - 1) = inf;  // the bf16 rotary keys are checked too
    CHECK_THROWS_AS(cache.append({shared, shared, latent, latent, rope, rms}), value_error);
    unchanged();
  }
  kvattn::test::check_layer_refusals(layer, cache, unchanged);
}

}  // namespace

TEST_CASE("Quantized LRKV caches refuse NaN and infinity and change nothing", "[quantized]") {
  const LrkvConfig c = make_config(64, 4, 32, 8, LrkvRopeMode::decoupled, 8, true);
  const auto layer = LrkvLayer<float>::random(c, 41);
  auto int8 = layer.template make_cache<Int8<>>();
  layer.prefill(random_input<float>(20, c.d_model, 1), int8);
  check_refused(layer, int8);
  auto pool = make_lrkv_page_pool<Fp8E4M3<>>(c, 8, 16);
  PagedLrkvCache<float, Fp8E4M3<>> paged(c, pool);
  layer.prefill(random_input<float>(20, c.d_model, 1), paged);
  check_refused(layer, paged, pool.get());
}

TEST_CASE("An LRKV pool names the quantized format it is for", "[quantized]") {
  const LrkvConfig c = make_config(64, 4, 32, 8, LrkvRopeMode::decoupled, 8, true);
  auto pool = make_lrkv_page_pool<Int8<32>>(c, 8, 4);
  CHECK_THAT(pool->layout(), Catch::Contains("int8/32"));
  CHECK(pool->page_bytes() == static_cast<std::size_t>(8 * hand_bytes_per_token<Int8<32>>(c)));
  CHECK_THROWS_AS((PagedLrkvCache<float, Fp8E4M3<32>>(c, pool)), config_error);
  // An odd page of an odd row: the key RMS of every page still read right.
  const LrkvConfig odd = make_config(40, 3, 17, 4, LrkvRopeMode::none, 0, true);
  const auto layer = LrkvLayer<float>::random(odd, 3);
  auto odd_pool = make_lrkv_page_pool<Int8<>>(odd, 3, 16);
  CHECK(odd_pool->page_bytes() % 4 != 0);
  PagedLrkvCache<float, Int8<>> paged(odd, odd_pool);
  auto cache = layer.template make_cache<Int8<>>();
  const MatF x = random_input<float>(11, odd.d_model, 4);
  const MatF y = layer.prefill(x, cache);
  CHECK(relative_error(layer.prefill(x, paged), y) <= kFloatTolerance);
  CHECK(stored_rows(paged) == stored_rows(cache));
}

TEST_CASE("A windowed paged quantized LRKV cache equals the contiguous one", "[quantized]") {
  // Window 24 with 2 sink tokens over pages of 8: the paged cache returns the pages the
  // window has passed; the outputs equal the contiguous cache's (same stored rows).
  LrkvConfig c = make_config(64, 4, 32, 8, LrkvRopeMode::decoupled, 8, true);
  c.window = 24;
  c.sink_tokens = 2;
  const auto layer = LrkvLayer<float>::random(c, 51);
  auto pool = make_lrkv_page_pool<Int8<32>>(c, 8, 16);
  PagedLrkvCache<float, Int8<32>> paged(c, pool);
  auto cache = layer.template make_cache<Int8<32>>();
  const MatF x = random_input<float>(100, c.d_model, 6);
  CHECK(relative_error(layer.prefill(x.topRows(60), paged), layer.prefill(x.topRows(60), cache)) <=
        kFloatTolerance);
  for (Index t = 60; t < 100; ++t) {
    const RowVector<float> a = layer.decode(x.row(t), paged, Threads{2});
    const RowVector<float> b = layer.decode(x.row(t), cache);
    CAPTURE(t);
    CHECK(relative_error(a, b) <= kFloatTolerance);
  }
  CHECK(paged.tokens() < cache.tokens());  // pages were returned
}

TEST_CASE("decode_batch over forks of a quantized LRKV prompt, the prompt read once",
          "[quantized]") {
  // Forks of one prompt share its pages; with shared_prefix the prefix tiles are scored by
  // every sequence's heads in one pass (cascade). Each row equals a single decode.
  for (const LrkvConfig& c : configs()) {
    CAPTURE(c.n_heads, c.head_dim, c.rank, to_string(c.rope_mode), c.key_norm);
    const auto layer = LrkvLayer<float>::random(c, 61);
    using Cache = PagedLrkvCache<float, Fp8E4M3<32>>;
    auto pool = make_lrkv_page_pool<Fp8E4M3<32>>(c, 16, 128);
    Cache root(c, pool);
    constexpr Index prompt = 90;  // mid-page
    layer.prefill(random_input<float>(prompt, c.d_model, 7), root);
    std::vector<Cache> forks;
    const Index suffix[] = {0, 5, 40};
    for (int s = 0; s < 3; ++s) {
      forks.push_back(root);
      if (suffix[s] > 0) {
        layer.prefill(random_input<float>(suffix[s], c.d_model, 8 + s), forks.back());
      }
    }
    for (const Index shared : {prompt, Index{33}}) {
      for (const int threads : {1, 2}) {
        std::vector<Cache> batch = forks, single = forks;
        std::vector<Cache*> pointers{&batch[0], &batch[1], &batch[2]};
        const MatF x = random_input<float>(3, c.d_model, 9);
        MatF out(3, c.d_model);
        layer.decode_batch(x, std::span<Cache* const>(pointers), out, Threads{threads},
                           BatchOptions{shared});
        for (int s = 0; s < 3; ++s) {
          RowVector<float> want(c.d_model);
          layer.decode(x.row(s), single[static_cast<std::size_t>(s)], want);
          CAPTURE(shared, threads, s);
          CHECK(relative_error(out.row(s), want) <= kFloatTolerance);
        }
      }
    }
  }
}

TEST_CASE("A double LRKV layer over an int8 cache is exact on the stored rows", "[quantized]") {
  // Codes and fp32 scales widen exactly to double: prefill and decode equal the double
  // reference on the decoded rows to double precision.
  const LrkvConfig c = make_config(48, 3, 24, 10, LrkvRopeMode::decoupled, 8, true);
  const auto layer = LrkvLayer<double>::random(c, 71);
  auto cache = layer.template make_cache<Int8<16>>();
  const MatD x = random_input<double>(45, c.d_model, 8);
  const MatD y = layer.prefill(x.topRows(40), cache);
  {
    const Decoded d = stored_rows(cache);
    const MatD q = project_query(layer, x.row(39));
    const MatD want =
        reference::decode_step(layer, double_cache(c, d, 40), q) * layer.weights().w_o;
    CHECK(relative_error(y.row(39), want) <= 1e-12);
  }
  for (Index t = 40; t < 45; ++t) {
    const RowVector<double> out = layer.decode(x.row(t), cache, Threads{2});
    const Decoded d = stored_rows(cache);
    const MatD q = project_query(layer, x.row(t));
    const MatD want =
        reference::decode_step(layer, double_cache(c, d, t + 1), q) * layer.weights().w_o;
    CAPTURE(t);
    CHECK(relative_error(out, want) <= 1e-12);
  }
}
