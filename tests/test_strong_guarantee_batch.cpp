// [alloc][batch]: decode_batch keeps the strong guarantee when any one of its allocations
// fails (tests/strong_guarantee.hpp), for every layer family (GQA, MQA, MLA, LRKV), fp32
// and bf16 storage, 1 and 2 threads, with a new workspace (its sizing fails too) and with
// one already sized (only the step's own allocations fail):
//  - over 3 contiguous caches of different lengths, each exactly full (the step grows
//    each): a failed step leaves every cache's tokens and rows as they were (it may keep
//    capacity grown for the step, docs/serving.md);
//  - over 3 paged forks of one prompt in one pool, the prompt's cache kept (the step
//    writes into a page shared with it: copy-on-write; into a fork's own page; and past a
//    page's end: a new page), with and without a shared prefix: a failed step leaves
//    every cache's tokens, capacity and rows, the prompt's too, and the pool's pages in
//    use as they were. (It did not: a fork that had copied a shared page kept the copy
//    when a later fork's growth failed. decode_batch now takes every page before any
//    cache changes: detail::PagedRows::stage_token.) The same forks with the pool's
//    last page taken by fork 0's copy: pool_exhausted, and the pool as it was.
// After every failure a following decode_batch on the same caches equals (==) the one
// on caches that never saw the failed step.
#include "fault_injection.hpp"  // first: replaces operator new and eigen_assert

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "paged_util.hpp"
#include "strong_guarantee.hpp"

using namespace kvattn;
using test::make_paged;
using test::make_pool;

namespace {

constexpr Index kBatch = 3;

// What a failed decode_batch must leave as it was: every cache's state (the batch's, then
// any other cache that shares pages with them), and a pool's pages (-1 without a pool).
struct BatchState {
  std::vector<test::CacheState> caches;
  Index pages_in_use = -1;
  Index pages_free = -1;
  bool operator==(const BatchState&) const = default;
};

}  // namespace

// Failure messages: each cache's tokens, capacity and bytes of rows, and the pool's pages.
template <>
struct Catch::StringMaker<BatchState> {
  static std::string convert(const BatchState& b) {
    std::string s = "{";
    for (const auto& c : b.caches) {
      s += " [tokens " + std::to_string(c.tokens) + ", capacity " + std::to_string(c.capacity) +
           ", " + std::to_string(c.rows.size()) + " bytes of rows]";
    }
    return s + " pages in use " + std::to_string(b.pages_in_use) + ", free " +
           std::to_string(b.pages_free) + " }";
  }
};

namespace {

// The caches of a step: the first kBatch are the batch; a paged batch keeps after them the
// prompt's cache its forks were made from, and the pool.
template <class Cache>
struct Subject {
  std::vector<Cache> caches;
  std::shared_ptr<PagePool> pool;

  std::array<Cache*, kBatch> batch() {  // on the stack: no allocation while armed
    return {&caches[0], &caches[1], &caches[2]};
  }
};

// One sweep: decode_batch(x, batch, out, ws, threads, options) with each allocation
// failing in turn; the following call is a decode_batch of other new tokens. With a new,
// unsized workspace the step's first allocations size it; with `sized`, the step gets a
// workspace that has already run a batch of this shape (made before arming), so every
// allocation that fails is one of the step itself (the caches' growth).
template <class Layer, class Cache, class Make, class State>
long sweep(const std::string& what, const Layer& layer, Threads threads, BatchOptions options,
           bool sized, Make make, State state) {
  using T = typename Layer::scalar_type;
  using Workspace = typename Layer::Workspace;
  const Index d = layer.config().d_model;
  const RowMatrix<T> x = test::random_input<T>(kBatch, d, 71);
  const RowMatrix<T> next = test::random_input<T>(kBatch, d, 72);
  RowMatrix<T> out(kBatch, d);  // made here: the call allocates nothing of its own
  auto step = [&](Subject<Cache>& s, const RowMatrix<T>& tokens, RowMatrix<T>& result,
                  Workspace& ws) {
    const auto batch = s.batch();
    layer.decode_batch(tokens, std::span<Cache* const>(batch), result, ws, threads, options);
  };
  struct Run {
    Subject<Cache> subject;
    std::optional<Workspace> sized;  // the workspace of every call on the subject
  };
  auto make_run = [&] {
    Run run{make(), std::nullopt};
    if (sized) {
      Subject<Cache> other = make();
      run.sized.emplace(layer.make_workspace(threads));
      step(other, x, out, *run.sized);
    }
    return run;
  };
  auto follow = [&](Run& run, Workspace& ws) {
    RowMatrix<T> got(kBatch, d);
    step(run.subject, next, got, run.sized ? *run.sized : ws);
    return got;
  };
  // Untouched: the following call on caches that never saw the step. Its threads also
  // start the OpenMP thread team before anything is armed.
  RowMatrix<T> want;
  {
    Run fresh = make_run();
    Workspace ws = layer.make_workspace(threads);
    want = follow(fresh, ws);
  }
  return test::sweep_every_allocation_failure<Workspace>(
      what + (sized ? ", workspace sized" : ", new workspace"), threads, make_run,
      [&](const Run& run) { return state(run.subject); },
      [&](Run& run, Workspace& ws) { step(run.subject, x, out, run.sized ? *run.sized : ws); },
      follow, want);
}

// (a) Contiguous caches of 5, 12 and 17 tokens, each exactly full.
template <class S, class Layer>
long contiguous_batch(const std::string& name, const Layer& layer, Threads threads, bool sized) {
  using T = typename Layer::scalar_type;
  using Cache = typename Layer::template cache_type<S>;
  std::vector<Cache> start;
  std::uint64_t seed = 11;
  for (const Index length : {5, 12, 17}) {
    Cache cache = layer.template make_cache<S>();
    cache.reserve(length);
    layer.prefill(test::random_input<T>(length, layer.config().d_model, seed++), cache);
    REQUIRE(cache.tokens() == length);
    REQUIRE(cache.capacity() == cache.tokens());  // the step must grow it
    start.push_back(std::move(cache));
  }
  auto make = [&] { return Subject<Cache>{start, nullptr}; };
  auto state = [](const Subject<Cache>& s) {
    BatchState b;
    for (const Cache& cache : s.caches) {
      test::CacheState c = test::state_of(cache);
      c.capacity = 0;  // a failed step may keep capacity grown for it (docs/serving.md)
      c.capacity_bytes = 0;
      b.caches.push_back(std::move(c));
    }
    return b;
  };
  const std::string what = name + " " + detail::storage_name<S>() + " contiguous";
  return sweep<Layer, Cache>(what, layer, threads, {}, sized, make, state);
}

// (b) Forks of a 6-token prompt in pages of 4 tokens, the prompt's cache kept (after the
// batch): fork 0 holds the prompt (its last page is shared with the prompt's cache: the
// step copies it), fork 1 two more tokens (8: the step takes a new page), fork 2 one more
// (7: its last page is its own, copied when the token was appended). 4 pages in use.
template <class S, class Layer>
auto make_forks(const Layer& layer, Index pool_pages) {
  using T = typename Layer::scalar_type;
  using Cache = decltype(make_paged<S>(layer, nullptr));
  const Index d = layer.config().d_model;
  Subject<Cache> s{{}, make_pool<S>(layer, 4, pool_pages)};
  Cache root = make_paged<S>(layer, s.pool);
  layer.prefill(test::random_input<T>(6, d, 21), root);
  s.caches.reserve(kBatch + 1);
  for (Index f = 0; f < kBatch; ++f) s.caches.push_back(root);  // forks: share every page
  layer.prefill(test::random_input<T>(2, d, 22), s.caches[1]);
  layer.prefill(test::random_input<T>(1, d, 23), s.caches[2]);
  s.caches.push_back(std::move(root));
  return s;
}

// Every cache's state (the prompt's included: a write into a page it shares would show)
// and the pool's pages.
template <class Cache>
BatchState paged_state(const Subject<Cache>& s) {
  BatchState b;
  for (const Cache& cache : s.caches) b.caches.push_back(test::state_of(cache));
  b.pages_in_use = s.pool->pages_in_use();
  b.pages_free = s.pool->pages_free();
  return b;
}

template <class S, class Layer>
long paged_forks(const std::string& name, const Layer& layer, Threads threads, Index shared_prefix,
                 bool sized) {
  using Cache = decltype(make_paged<S>(layer, nullptr));
  auto make = [&] { return make_forks<S>(layer, 16); };
  {  // the layout make_forks describes
    Subject<Cache> s = make();
    const auto& root = s.caches[3];
    REQUIRE(s.caches[0].tokens() == 6);
    REQUIRE(s.caches[1].tokens() == 8);
    REQUIRE(s.caches[2].tokens() == 7);
    REQUIRE(s.caches[0].block_table() == root.block_table());
    REQUIRE(s.caches[1].block_table().size() == 2);
    REQUIRE(s.caches[2].block_table()[1] != root.block_table()[1]);
    REQUIRE(s.pool->use_count(s.caches[2].block_table()[1]) == 1);
    REQUIRE(s.pool->pages_in_use() == 4);
  }
  const std::string what = name + " " + detail::storage_name<S>() + " paged forks, shared prefix " +
                           std::to_string(shared_prefix);
  return sweep<Layer, Cache>(what, layer, threads, BatchOptions{shared_prefix}, sized, make,
                             paged_state<Cache>);
}

// Not an allocation failure, the same rule: with one page free, fork 0 takes it for its
// copy and fork 1 finds the pool exhausted; the pool must be as it was (docs/serving.md).
template <class S, class Layer>
void exhausted_after_copy(const std::string& name, const Layer& layer) {
  using T = typename Layer::scalar_type;
  using Cache = decltype(make_paged<S>(layer, nullptr));
  auto s = make_forks<S>(layer, 5);
  REQUIRE(s.pool->pages_free() == 1);
  const BatchState before = paged_state(s);
  const RowMatrix<T> x = test::random_input<T>(kBatch, layer.config().d_model, 71);
  RowMatrix<T> out(kBatch, layer.config().d_model);
  const auto batch = s.batch();
  INFO(name << " " << detail::storage_name<S>() << ": pool exhausted after a copy-on-write");
  CHECK_THROWS_AS(layer.decode_batch(x, std::span<Cache* const>(batch), out), pool_exhausted);
  CHECK(paged_state(s) == before);
}

template <class Layer>
void check_batches(const std::string& name, const Layer& layer) {
  for (const Threads threads : {Threads{1}, Threads{2}}) {
    for (const bool sized : {false, true}) {
      INFO(name << ", threads " << threads.count << (sized ? ", workspace sized" : ""));
      CHECK(contiguous_batch<float>(name, layer, threads, sized) > 0);
      CHECK(contiguous_batch<Eigen::bfloat16>(name, layer, threads, sized) > 0);
      // Shared prefixes: none, one whole page, the whole prompt (ending mid-page).
      for (const Index prefix : {0, 4, 6}) {
        CAPTURE(prefix);
        CHECK(paged_forks<float>(name, layer, threads, prefix, sized) > 0);
        CHECK(paged_forks<Eigen::bfloat16>(name, layer, threads, prefix, sized) > 0);
      }
    }
  }
  exhausted_after_copy<float>(name, layer);
  exhausted_after_copy<Eigen::bfloat16>(name, layer);
}

}  // namespace

TEST_CASE("decode_batch keeps the strong guarantee under allocation failure",
          "[alloc][batch][reliability]") {
  SECTION("GQA and MQA") {
    check_batches("GQA", GqaLayer<float>::random(
                             gqa_config(24, 4, 6, 2, {RopeLayout::half_split, 10000.0, 1}), 1));
    check_batches("MQA", GqaLayer<float>::random(mqa_config(16, 4, 8), 2));
  }
  SECTION("MLA") {
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
    check_batches("MLA", MlaLayer<float>::random(c, 3));
  }
  SECTION("LRKV") {
    LrkvConfig c{20, 3, 6, 4, LrkvRopeMode::decoupled, {RopeLayout::half_split, 10000.0, 1}};
    c.rope_dim = 4;
    c.key_norm = true;
    check_batches("LRKV", LrkvLayer<float>::random(c, 4));
  }
}
