// [window][cache]: windowed paged caches are bounded. With a window W, sink tokens k and
// max_rollback R, a PagedGqaCache / PagedMlaCache / PagedLrkvCache holds the first k
// tokens and the last W + R, returns every other page to its pool, and stays exact:
// token-by-token decode and chunked prefill over sequences many windows long equal the
// expanded reference, in a pool that has only the pages the bound allows; bytes() equals
// the analysis module's windowed prediction at every length; truncate is exact within
// the rollback margin and a clear error (changing nothing) beyond it.
#include <catch2/catch.hpp>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"
#include "kvattn/reference/gqa.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "kvattn/reference/mla.hpp"
#include "test_util.hpp"
#include "window_cases.hpp"

using namespace kvattn;
using test::random_input;
using test::relative_error;
namespace an = kvattn::analysis;

namespace {

using MatD = RowMatrix<double>;
constexpr double kExact = 1e-12;  // double against double: the order of sums only

constexpr Index kWindow = 16, kSinks = 3, kRollback = 5, kPage = 4;
// Pages a sequence holds between calls: the sink tokens' page and the pages that W + R
// tokens not aligned to a page touch. A call needs the pages of its new tokens on top,
// before the append returns the oldest ones: one more for a decode.
constexpr Index kHeldPages = (kSinks + kPage - 1) / kPage + (kWindow + kRollback) / kPage + 2;

template <class Config>
Config windowed(Config c) {
  c.window = kWindow;
  c.sink_tokens = kSinks;
  c.sink_logits = true;
  c.logit_softcap = 1.5;
  return c;
}

GqaConfig gqa_case(Index n_kv = 2) { return test::window_gqa_case(n_kv); }
MlaConfig mla_case() { return test::window_mla_case(); }
LrkvConfig lrkv_case() { return test::window_lrkv_case(); }

std::shared_ptr<PagePool> pool_for(const GqaConfig& c, Index pages) {
  return make_gqa_page_pool<double>(c, kPage, pages);
}
std::shared_ptr<PagePool> pool_for(const MlaConfig& c, Index pages) {
  return make_mla_page_pool<double>(c, kPage, pages);
}
std::shared_ptr<PagePool> pool_for(const LrkvConfig& c, Index pages) {
  return make_lrkv_page_pool<double>(c, kPage, pages);
}
auto paged_cache(const GqaConfig& c, std::shared_ptr<PagePool> pool, Index rollback) {
  return PagedGqaCache<double>(c, std::move(pool), rollback);
}
auto paged_cache(const MlaConfig& c, std::shared_ptr<PagePool> pool, Index rollback) {
  return PagedMlaCache<double>(c, std::move(pool), rollback);
}
auto paged_cache(const LrkvConfig& c, std::shared_ptr<PagePool> pool, Index rollback) {
  return PagedLrkvCache<double>(c, std::move(pool), rollback);
}

// The bytes the analysis module predicts for one windowed layer at sequence length L.
template <class Config>
std::size_t predicted_bytes(const Config& c, Index length) {
  const an::LayerStack stack{1, 1, c.window, c.sink_tokens, kRollback};
  return static_cast<std::size_t>(
      an::total_bytes(an::cache_layout(c), an::storage_of<double>(), stack, {length, 1}));
}

template <class Cache>
void check_bounds(const Cache& cache, const PagePool& pool, Index length) {
  CAPTURE(length);
  REQUIRE(cache.sequence_length() == length);
  CHECK(cache.tokens() == std::min(length, kSinks + kWindow + kRollback));
  CHECK(cache.bytes() == predicted_bytes(cache.config(), length));
  CHECK(pool.pages_in_use() <= kHeldPages);
}

// Prefill of the first `prompt` tokens of x in chunks of `chunk`, then decode, in a pool
// with only the pages the bound allows: equal to the reference, within the bounds after
// every call.
template <class Layer>
void check_bounded_run(const Layer& layer, Index length, Index prompt, Index chunk,
                       std::uint64_t seed) {
  const MatD x = random_input<double>(length, layer.config().d_model, seed);
  const MatD want = reference::forward(layer, x);
  auto pool = pool_for(layer.config(), kHeldPages + (chunk + kPage - 1) / kPage + 1);
  auto cache = paged_cache(layer.config(), pool, kRollback);
  MatD out(length, layer.config().d_model);
  Index done = 0;
  while (done < prompt) {
    const Index n = std::min(chunk, prompt - done);
    out.middleRows(done, n) = layer.prefill(x.middleRows(done, n), cache);
    done += n;
    check_bounds(cache, *pool, done);
  }
  auto ws = layer.make_workspace(Threads{2});
  for (; done < length; ++done) {
    RowVector<double> y(layer.config().d_model);
    layer.decode(x.row(done), cache, y, ws, Threads{2});
    out.row(done) = y;
    check_bounds(cache, *pool, done + 1);
  }
  const double error = relative_error(out, want);
  CAPTURE(error);
  CHECK(error <= kExact);
}

// Rolling back: within the margin the continuation equals the reference of the spliced
// sequence; one token further throws shape_error and changes nothing.
template <class Layer>
void check_rollback(const Layer& layer, std::uint64_t seed) {
  const Index length = 120;
  const MatD x = random_input<double>(length, layer.config().d_model, seed);
  auto pool = pool_for(layer.config(), 64);
  auto cache = paged_cache(layer.config(), pool, kRollback);
  layer.prefill(x.topRows(length - 40), cache);
  for (Index i = length - 40; i < length; ++i) layer.decode(x.row(i), cache);
  // A query at n sees n - W + 1 ... n - 1 of the cache: the cache keeps W + R tokens, so
  // n = length - R - 1 is the furthest exact rollback.
  const Index furthest = length - kRollback - 1;
  const auto tokens = cache.tokens();
  const auto bytes = cache.bytes();
  const auto pages = cache.block_table();
  CHECK_THROWS_AS(cache.truncate(furthest - 1), shape_error);
  CHECK_THROWS_WITH(cache.truncate(furthest - 1), Catch::Contains("max_rollback 5"));
  CHECK(cache.sequence_length() == length);
  CHECK(cache.tokens() == tokens);
  CHECK(cache.bytes() == bytes);
  CHECK(cache.block_table() == pages);
  cache.truncate(furthest);
  CHECK(cache.sequence_length() == furthest);
  // Continue with other tokens: the reference of x[0, furthest) followed by them.
  MatD spliced = x;
  spliced.bottomRows(length - furthest) =
      random_input<double>(length - furthest, layer.config().d_model, seed + 1);
  const MatD want = reference::forward(layer, spliced);
  MatD out(length - furthest, layer.config().d_model);
  out.topRows(2) = layer.prefill(spliced.middleRows(furthest, 2), cache);
  for (Index i = furthest + 2; i < length; ++i)
    out.row(i - furthest) = layer.decode(spliced.row(i), cache);
  const double error = relative_error(out, want.bottomRows(length - furthest));
  CAPTURE(error);
  CHECK(error <= kExact);
  check_bounds(cache, *pool, length);
}

template <class Layer, class Config>
void check_mechanism(const Config& base, std::uint64_t seed) {
  const auto layer = Layer::random(windowed(base), seed);
  SECTION("decode of 600 tokens after a short prompt") {
    check_bounded_run(layer, 600, 7, 7, seed);
  }
  SECTION("chunked prefill across the window, then decode") {
    check_bounded_run(layer, 200, 150, 13, seed + 1);
  }
  SECTION("rollback") { check_rollback(layer, seed + 2); }
  SECTION("fork: both sequences go on exactly, the pool stays bounded") {
    const MatD x = random_input<double>(100, base.d_model, seed + 3);
    const MatD y = random_input<double>(100, base.d_model, seed + 4);
    auto pool = pool_for(layer.config(), 64);
    auto first = paged_cache(layer.config(), pool, kRollback);
    layer.prefill(x.topRows(60), first);
    auto second = first;
    MatD out_x(40, base.d_model), out_y(40, base.d_model);
    for (Index i = 60; i < 100; ++i) {
      out_x.row(i - 60) = layer.decode(x.row(i), first);
      out_y.row(i - 60) = layer.decode(y.row(i), second);
      CHECK(pool->pages_in_use() <= 2 * kHeldPages);
    }
    MatD xy = x;
    xy.bottomRows(40) = y.bottomRows(40);
    CHECK(relative_error(out_x, reference::forward(layer, x).bottomRows(40)) <= kExact);
    CHECK(relative_error(out_y, reference::forward(layer, xy).bottomRows(40)) <= kExact);
  }
}

}  // namespace

TEST_CASE("a windowed PagedGqaCache is bounded and exact", "[window][cache]") {
  check_mechanism<GqaLayer<double>>(gqa_case(), 1);
}

TEST_CASE("a windowed PagedMlaCache is bounded and exact", "[window][cache]") {
  check_mechanism<MlaLayer<double>>(mla_case(), 2);
}

TEST_CASE("a windowed PagedLrkvCache is bounded and exact", "[window][cache]") {
  check_mechanism<LrkvLayer<double>>(lrkv_case(), 3);
}

TEST_CASE("max_rollback is validated; without a window nothing is dropped", "[window][cache]") {
  const GqaConfig plain = gqa_case();
  auto pool = pool_for(plain, 64);
  CHECK_THROWS_AS(paged_cache(windowed(plain), pool_for(windowed(plain), 4), -1), config_error);
  auto cache = paged_cache(plain, pool, 7);  // no window: max_rollback has nothing to keep
  CHECK(cache.max_rollback() == 0);
  const auto layer = GqaLayer<double>::random(plain, 9);
  layer.prefill(random_input<double>(100, plain.d_model, 1), cache);
  CHECK(cache.tokens() == 100);
  CHECK(cache.sequence_length() == 100);
  cache.truncate(3);
  CHECK(cache.tokens() == 3);
}

TEST_CASE("decode_batch over windowed forks ignores shared_prefix and equals the reference",
          "[window][cache][batch]") {
  const auto layer = GqaLayer<double>::random(windowed(gqa_case()), 12);
  const GqaConfig& c = layer.config();
  const MatD x = random_input<double>(80, c.d_model, 13);
  const MatD y = random_input<double>(80, c.d_model, 14);
  auto pool = pool_for(c, 64);
  auto first = paged_cache(c, pool, kRollback);
  layer.prefill(x.topRows(60), first);
  auto second = first;
  layer.prefill(y.middleRows(60, 19), second);
  layer.prefill(x.middleRows(60, 19), first);
  std::vector<PagedGqaCache<double>*> caches{&first, &second};
  MatD rows(2, c.d_model);
  rows.row(0) = x.row(79);
  rows.row(1) = y.row(79);
  MatD out(2, c.d_model);
  // The prompt's 60 tokens are not where either window is: a shared prefix cannot be read
  // once for both, and is not used (nor checked).
  layer.decode_batch(rows, std::span<PagedGqaCache<double>* const>(caches), out, Threads{2},
                     BatchOptions{.shared_prefix = 60});
  MatD xy = x;
  xy.bottomRows(20) = y.bottomRows(20);
  CHECK(relative_error(out.row(0), reference::forward(layer, x).bottomRows(1)) <= kExact);
  CHECK(relative_error(out.row(1), reference::forward(layer, xy).bottomRows(1)) <= kExact);
}

TEST_CASE("reserve on a windowed cache takes at most a window's pages", "[window][cache]") {
  const GqaConfig c = windowed(gqa_case());
  auto pool = pool_for(c, kHeldPages + 1);
  auto cache = paged_cache(c, pool, kRollback);
  cache.reserve(1'000'000);  // a long generation: the window is what it will hold
  CHECK(pool->pages_in_use() <= kHeldPages + 1);
  CHECK(cache.tokens() == 0);
  const auto layer = GqaLayer<double>::random(c, 3);
  for (Index i = 0; i < 200; ++i) layer.decode(random_input<double>(1, c.d_model, i), cache);
  CHECK(cache.sequence_length() == 200);
  CHECK(pool->pages_in_use() <= kHeldPages);
}
