// The one layer contract (attention/attention_layer.hpp) every mechanism honours: the
// concept, caches whose token writers are private, one const cache read by several
// threads at once (each with its own workspace, the sequence split across threads where
// there is one query group) giving bitwise the results of reading it one after the
// other, decode's 1 x d shape check in every build type, and the exception hierarchy.
#include <catch2/catch.hpp>

#include <functional>
#include <limits>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/attention/attention_layer.hpp"
#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"
#include "kvattn/cache/page_pool.hpp"
#include "kvattn/detail/split_attention.hpp"
#include "kvattn/pooling/token_mask.hpp"
#include "test_util.hpp"

using namespace kvattn;

static_assert(AttentionLayer<GqaLayer<float>> && AttentionLayer<GqaLayer<double>>);
static_assert(AttentionLayer<MlaLayer<float>> && AttentionLayer<MlaLayer<double>>);
static_assert(AttentionLayer<LrkvLayer<float>> && AttentionLayer<LrkvLayer<double>>);

// The caches' mutators are private (each befriends its layer): outside code writes a
// cache only through append(rows) and the layers. Each requires-expression below names a
// private member of the cache headers with arguments it accepts (the token writers are
// templates taking any row), so it is false for access alone; PublicMirror, with the same
// members public, shows each expression true where the member is reachable.
namespace mutators {

using Row = RowVector<float>;
template <class C>
constexpr bool grow_for = requires(C& c) {
  c.grow_for(Index{1});
};
template <class C>
constexpr bool truncate_unchecked = requires(C& c) {
  c.truncate_unchecked(Index{0});
};
template <class C>
constexpr bool append_token_2 = requires(C& c, const Row& r) {
  c.append_token(r, r);
};
template <class C>
constexpr bool append_token_6 = requires(C& c, const Row& r) {
  c.append_token(r, r, r, r, r, r);
};
template <class C>
constexpr bool write_row = requires(C& c, const Row& r) {
  c.write_row(Index{0}, r, r);
};
template <class C>
constexpr bool append_unchecked = requires(C& c, const typename C::rows_type& rows) {
  c.append_unchecked(rows);
};
// The public ones, for contrast.
template <class C>
constexpr bool reserve = requires(C& c) {
  c.reserve(Index{1});
};
template <class C>
constexpr bool append = requires(C& c, const typename C::rows_type& rows) {
  c.append(rows);
};

struct PublicMirror {
  struct rows_type {};
  void grow_for(Index);
  void truncate_unchecked(Index);
  template <class... Rows>
  void append_token(const Rows&...);
  template <class A, class B>
  void write_row(Index, const A&, const B&);
  void append_unchecked(const rows_type&);
};
static_assert(grow_for<PublicMirror> && truncate_unchecked<PublicMirror> &&
              append_token_2<PublicMirror> && append_token_6<PublicMirror> &&
              write_row<PublicMirror> && append_unchecked<PublicMirror>);

using Gqa = GqaCache<float>;
using Mla = MlaCache<float>;
using Lrkv = LrkvCache<float>;
static_assert(reserve<Gqa> && append<Gqa> && reserve<Mla> && append<Mla> && reserve<Lrkv> &&
              append<Lrkv>);
static_assert(!grow_for<Gqa> && !append_token_2<Gqa> && !truncate_unchecked<Gqa>,
              "GqaCache's token writers must stay private (friend GqaLayer)");
static_assert(!grow_for<Mla> && !append_token_2<Mla> && !write_row<Mla>,
              "MlaCache's token writers must stay private (friend MlaLayer)");
static_assert(!grow_for<Lrkv> && !append_token_6<Lrkv> && !append_unchecked<Lrkv> &&
                  !truncate_unchecked<Lrkv>,
              "LrkvCache's token writers must stay private (friend LrkvLayer)");
static_assert(!grow_for<GqaCache<float, Eigen::bfloat16>> &&
              !append_token_2<MlaCache<double, Eigen::bfloat16>> &&
              !append_token_6<LrkvCache<float, Eigen::bfloat16>>);

}  // namespace mutators

// validate() is constexpr: the analysis module's compile-time checks run it.
static_assert((deepseek_v2_config().validate(), true));
static_assert(analysis::elements_per_token_per_layer(deepseek_v2_config()) == 576);
static_assert((gqa_config(4096, 32, 128, 8).validate(), true));

namespace {

MlaConfig small_mla() {
  MlaConfig c;
  c.d_model = 24;
  c.n_heads = 4;
  c.kv_rank = 20;
  c.q_rank = 10;
  c.q_norm = true;
  c.qk_nope_dim = 8;
  c.rope_dim = 4;
  c.v_dim = 6;
  c.rope = {RopeLayout::interleaved, 10000.0, 5};
  return c;
}

LrkvConfig small_lrkv() {
  LrkvConfig c{24, 4, 8, 3, LrkvRopeMode::decoupled, {RopeLayout::half_split, 10000.0, 2}};
  c.rope_dim = 4;
  c.key_norm = true;
  return c;
}

// kThreads threads attend over one const cache of `tokens` tokens at once, each with its
// own workspace and queries (and Threads{2} inside, so OpenMP teams nest under
// std::threads); the results equal, bitwise, the same calls made one after the other on
// this thread. `groups` is the layer's number of query groups (KV heads; 1 for MLA and
// LRKV): when it is below 2, the length must make the decode driver split the sequence
// over the two threads, so the partial softmax states are merged too.
template <class Layer>
void check_concurrent_attend(const Layer& layer, Index tokens, Index groups) {
  using T = typename Layer::scalar_type;
  constexpr int kThreads = 4, kQueries = 6;
  if (groups < 2) {
    const auto plan = detail::plan_split(groups, 1, 1, tokens, layer.decode_tile(), 0, 2);
    CAPTURE(tokens, layer.decode_tile());
    REQUIRE(plan.splits >= 2);
  }
  auto cache = layer.make_cache();
  layer.prefill(test::random_input<T>(tokens, layer.config().d_model, 3), cache);
  const auto& shared = cache;  // read-only from here on
  const RowMatrix<T> queries = test::random_input<T>(kThreads * kQueries, layer.query_width(), 4);
  auto run = [&](int id, RowMatrix<T>& out) {
    auto workspace = layer.make_workspace(Threads{2});
    for (int q = 0; q < kQueries; ++q) {
      layer.attend(queries.row(id * kQueries + q), shared, out.row(q), workspace, Threads{2});
    }
  };
  std::vector<RowMatrix<T>> sequential(kThreads), concurrent(kThreads);
  for (int id = 0; id < kThreads; ++id) {
    sequential[std::size_t(id)].resize(kQueries, layer.heads_width());
    concurrent[std::size_t(id)].resize(kQueries, layer.heads_width());
    run(id, sequential[std::size_t(id)]);
  }
  std::vector<std::thread> threads;
  for (int id = 0; id < kThreads; ++id) {
    threads.emplace_back(run, id, std::ref(concurrent[std::size_t(id)]));
  }
  for (auto& t : threads) t.join();
  for (int id = 0; id < kThreads; ++id) {
    CAPTURE(id);
    CHECK(concurrent[std::size_t(id)] == sequential[std::size_t(id)]);
    CHECK(sequential[std::size_t(id)].allFinite());
  }
  CHECK(cache.tokens() == tokens);
}

// decode takes x and out as 1 x d matrices in every layer, so a 2 x d x is a
// shape_error naming its real shape, in every build type (not row 0 decoded silently).
template <class Layer>
void check_two_row_decode(const Layer& layer, const char* name) {
  using T = typename Layer::scalar_type;
  const Index d = layer.config().d_model;
  auto cache = layer.make_cache();
  layer.prefill(test::random_input<T>(3, d, 1), cache);
  const RowMatrix<T> two_rows = test::random_input<T>(2, d, 2);
  RowMatrix<T> out(1, d);
  const std::string shape = "(2 x " + std::to_string(d) + ")";
  CHECK_THROWS_MATCHES(
      layer.decode(two_rows, cache, out), shape_error,
      Catch::Matchers::Message(std::string(name) + "::decode: x has shape " + shape +
                               ", expected (1 x " + std::to_string(d) + ")"));
  RowMatrix<T> wide_out(2, d);
  CHECK_THROWS_AS(layer.decode(two_rows.topRows(1), cache, wide_out), shape_error);
  CHECK(cache.tokens() == 3);
}

}  // namespace

TEST_CASE("several threads attend over one const cache at once, bitwise as in sequence",
          "[threads][gqa][mla][lrkv]") {
  // GQA and MHA: two or more KV groups, split over the threads by group.
  SECTION("GQA") {
    check_concurrent_attend(GqaLayer<float>::random(gqa_config(32, 8, 8, 2), 1), 300, 2);
  }
  SECTION("MHA double") {
    check_concurrent_attend(GqaLayer<double>::random(mha_config(16, 4, 4), 2), 300, 4);
  }
  // One group: the sequence is split (MLA's tile is 256 tokens here and a split needs
  // 4 tiles per range, so 2100 tokens make two ranges; LRKV's tile is 16).
  SECTION("MLA") { check_concurrent_attend(MlaLayer<float>::random(small_mla(), 3), 2100, 1); }
  SECTION("LRKV") { check_concurrent_attend(LrkvLayer<float>::random(small_lrkv(), 4), 300, 1); }
}

TEST_CASE("decode refuses a two-row x in every layer", "[reliability][gqa][mla][lrkv]") {
  check_two_row_decode(GqaLayer<float>::random(gqa_config(16, 4, 4, 2), 1), "GqaLayer");
  check_two_row_decode(MlaLayer<float>::random(small_mla(), 2), "MlaLayer");
  check_two_row_decode(LrkvLayer<float>::random(small_lrkv(), 3), "LrkvLayer");
}

namespace {

// `thrower` must throw E; E is caught as std::exception, as its standard base
// `Standard` and as kvattn::error, with the same message each way.
template <class E, class Standard>
void check_catchable(const std::function<void()>& thrower) {
  std::string message;
  try {
    thrower();
    FAIL("nothing thrown");
  } catch (const std::exception& e) {
    CHECK(dynamic_cast<const E*>(&e) != nullptr);
    message = e.what();
  }
  CHECK_FALSE(message.empty());
  try {
    thrower();
  } catch (const Standard& e) {
    CHECK(e.what() == message);
  }
  try {
    thrower();
  } catch (const kvattn::error& e) {
    CHECK(e.what() == message);
  }
}

}  // namespace

TEST_CASE("every kvattn exception is a std::exception, its standard base and kvattn::error",
          "[reliability]") {
  check_catchable<config_error, std::invalid_argument>([] { gqa_config(8, 12, 4, 5).validate(); });
  check_catchable<shape_error, std::invalid_argument>([] {
    GqaCache<float> cache(gqa_config(8, 2, 4, 2));
    cache.truncate(3);
  });
  check_catchable<pooling_error, std::invalid_argument>(
      [] { detail::check_pool_input("pool", RowMatrix<float>(0, 4), 4, {}); });
  check_catchable<kvattn::overflow_error, std::overflow_error>([] {
    analysis::elements_per_token(analysis::cache_layout(gqa_config(1024, 1024, 1024, 1024)),
                                 Index{1} << 60);
  });
  // A capacity whose size in bytes cannot be represented (cache/token_buffer.hpp).
  check_catchable<kvattn::length_error, std::length_error>([] {
    GqaCache<float> cache(gqa_config(8, 2, 4, 2));
    cache.reserve(std::numeric_limits<Index>::max());
  });
  // A pool of one page, asked for a second (cache/page_pool.hpp).
  check_catchable<pool_exhausted, std::runtime_error>([] {
    PagePool pool("test layout", 4, 64, 1);
    pool.acquire();
    pool.acquire();
  });
  // The mixin base alone is not a std::exception (no ambiguous std::exception base).
  static_assert(!std::is_base_of_v<std::exception, kvattn::error>);
  static_assert(std::is_base_of_v<kvattn::error, config_error>);
  static_assert(std::is_base_of_v<std::invalid_argument, shape_error>);
  static_assert(std::is_base_of_v<std::length_error, kvattn::length_error> &&
                std::is_base_of_v<kvattn::error, kvattn::length_error>);
  static_assert(std::is_base_of_v<std::runtime_error, pool_exhausted> &&
                std::is_base_of_v<kvattn::error, pool_exhausted>);
}
