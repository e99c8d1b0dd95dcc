// [batch][paged]: decode over paged caches equals decode over contiguous caches with
// the same rows; decode_batch over B ragged sequences equals B single decodes (and, in
// double, the expanded reference run on each sequence's whole input); a shared prefix
// read once (cascade attention) changes nothing but the cost; bad batches are refused
// without touching any cache. For every mechanism (GQA/MHA/MQA, MLA, LRKV), fp32 and
// bf16 storage, 1 and 2 threads.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <vector>

#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"
#include "kvattn/config/mla_config.hpp"
#include "kvattn/core/softmax_states.hpp"
#include "kvattn/reference/gqa.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "kvattn/reference/mla.hpp"
#include "paged_util.hpp"
#include "test_util.hpp"

using namespace kvattn;
using test::make_paged;
using test::make_pool;
using Bf16 = Eigen::bfloat16;

namespace {

// Small configs with RoPE, as the equivalence tests use them.
GqaConfig gqa(Index n_kv) {
  GqaConfig c = gqa_config(24, 4, 8, n_kv);
  c.rope = {RopeLayout::half_split, 10000.0, 3};
  return c;
}
MlaConfig mla(Index q_rank) {
  MlaConfig c{};
  c.d_model = 24;
  c.n_heads = 3;
  c.kv_rank = 16;
  c.q_rank = q_rank;
  c.q_norm = q_rank > 0;
  c.qk_nope_dim = 8;
  c.rope_dim = 4;
  c.v_dim = 6;
  c.rope = {RopeLayout::half_split, 10000.0, 0};
  return c;
}
// Decoupled RoPE and key norm: every part of the LRKV row (shared key, residual slices,
// rope key, key RMS) is read.
LrkvConfig lrkv() {
  LrkvConfig c{};
  c.d_model = 24;
  c.n_heads = 3;
  c.head_dim = 8;
  c.rank = 3;
  c.rope_mode = LrkvRopeMode::decoupled;
  c.rope = {RopeLayout::half_split, 10000.0, 0};
  c.rope_dim = 4;
  c.key_norm = true;
  return c;
}

// Tolerance of a batched step against single decodes of the same caches. The batch
// projects its tokens with one B x d product, a single decode with a 1 x d one: the
// sums differ in their last bits, and a bf16 cache may then round a key or value element
// to its neighbour (2^-8 relative), which bounds the change of the output.
template <class T, class S>
double batch_tolerance() {
  if constexpr (!std::is_same_v<S, T>) {
    return 1.0 / 256;
  } else {
    return test::tolerance<T>();
  }
}

// Sequences of the given lengths (the batch's new token is one more): inputs, and each
// sequence's cache filled by prefill.
template <class Layer, class Cache>
struct Batch {
  std::vector<RowMatrix<typename Layer::scalar_type>> inputs;  // L_s + 1 rows each
  std::vector<Cache> caches;

  RowMatrix<typename Layer::scalar_type> new_tokens() const {
    RowMatrix<typename Layer::scalar_type> x(static_cast<Index>(inputs.size()), inputs[0].cols());
    for (std::size_t s = 0; s < inputs.size(); ++s)
      x.row(static_cast<Index>(s)) = inputs[s].bottomRows(1);
    return x;
  }
  std::vector<Cache*> pointers() {
    std::vector<Cache*> p;
    for (auto& c : caches) p.push_back(&c);
    return p;
  }
};

template <class Layer, class Cache, class MakeCache>
Batch<Layer, Cache> make_batch(const Layer& layer, const std::vector<Index>& lengths,
                               MakeCache make_cache, std::uint64_t seed) {
  using T = typename Layer::scalar_type;
  Batch<Layer, Cache> b;
  for (std::size_t s = 0; s < lengths.size(); ++s) {
    b.inputs.push_back(test::random_input<T>(lengths[s] + 1, layer.config().d_model, seed + s));
    b.caches.push_back(make_cache());
    if (lengths[s] > 0) layer.prefill(b.inputs.back().topRows(lengths[s]), b.caches.back());
  }
  return b;
}

// decode_batch against single decodes of copies of the same caches, and (T = double,
// S = T) against the expanded reference of each sequence's whole input.
template <class Layer, class Cache>
void check_against_singles(const Layer& layer, Batch<Layer, Cache>& batch, int threads,
                           BatchOptions options = {}) {
  using T = typename Layer::scalar_type;
  using S = typename Cache::storage_type;
  const Index B = static_cast<Index>(batch.caches.size());
  std::vector<Cache> copies = batch.caches;
  const RowMatrix<T> x = batch.new_tokens();
  RowMatrix<T> out(B, layer.config().d_model);
  auto ws = layer.make_workspace(Threads{threads});
  const auto pointers = batch.pointers();
  layer.decode_batch(x, std::span<Cache* const>(pointers), out, ws, Threads{threads}, options);
  for (Index s = 0; s < B; ++s) {
    CAPTURE(s, batch.caches[static_cast<std::size_t>(s)].tokens());
    Cache& single = copies[static_cast<std::size_t>(s)];
    RowMatrix<T> expected(1, layer.config().d_model);
    layer.decode(x.row(s), single, expected, Threads{threads});
    CHECK(batch.caches[static_cast<std::size_t>(s)].tokens() == single.tokens());
    CHECK(test::relative_error(out.row(s), expected) <= (batch_tolerance<T, S>()));
    if constexpr (std::is_same_v<T, double> && std::is_same_v<S, T>) {
      const RowMatrix<double> full =
          reference::forward(layer, batch.inputs[static_cast<std::size_t>(s)]);
      CHECK(test::relative_error(out.row(s), full.bottomRows(1)) <= 1e-12);
    }
  }
}

template <class Layer>
void batches_equal_singles(const Layer& layer) {
  using T = typename Layer::scalar_type;
  const std::vector<Index> ragged{0, 1, 37, 300, 5, 1030};
  for (const int threads : {1, 2}) {
    CAPTURE(threads);
    {
      auto b = make_batch<Layer, typename Layer::template cache_type<T>>(
          layer, ragged, [&] { return layer.template make_cache<T>(); }, 7);
      check_against_singles(layer, b, threads);
    }
    {
      auto b = make_batch<Layer, typename Layer::template cache_type<Bf16>>(
          layer, ragged, [&] { return layer.template make_cache<Bf16>(); }, 8);
      check_against_singles(layer, b, threads);
    }
    for (const Index page : {16, 100}) {
      CAPTURE(page);
      auto pool = make_pool<T>(layer, page, 256);
      auto b = make_batch<Layer, decltype(make_paged<T>(layer, pool))>(
          layer, ragged, [&] { return make_paged<T>(layer, pool); }, 9);
      check_against_singles(layer, b, threads);
      auto bf16_pool = make_pool<Bf16>(layer, page, 256);
      auto c = make_batch<Layer, decltype(make_paged<Bf16>(layer, bf16_pool))>(
          layer, ragged, [&] { return make_paged<Bf16>(layer, bf16_pool); }, 10);
      check_against_singles(layer, c, threads);
    }
  }
}

// A paged cache decodes as a contiguous cache holding the same rows.
template <class Layer, class S>
void paged_equals_contiguous(const Layer& layer, Index page, Index length, int threads) {
  using T = typename Layer::scalar_type;
  const RowMatrix<T> x = test::random_input<T>(length + 3, layer.config().d_model, 21);
  auto pool = make_pool<S>(layer, page, (length + 3) / page + 2);
  auto paged = make_paged<S>(layer, pool);
  auto flat = layer.template make_cache<S>();
  const RowMatrix<T> p1 = layer.prefill(x.topRows(length), paged, Threads{threads});
  const RowMatrix<T> f1 = layer.prefill(x.topRows(length), flat, Threads{threads});
  CHECK(test::relative_error(p1, f1) <= test::tolerance<T>());
  for (Index i = length; i < length + 3; ++i) {
    const RowMatrix<T> p = layer.decode(x.row(i), paged, Threads{threads});
    const RowMatrix<T> f = layer.decode(x.row(i), flat, Threads{threads});
    // The same rows in the same order, tiles cut at the pages: within rounding.
    CHECK(test::relative_error(p, f) <= test::tolerance<T>());
  }
  CHECK(paged.bytes() == flat.bytes());
}

template <class Layer>
void paged_decodes_as_contiguous(const Layer& layer) {
  using T = typename Layer::scalar_type;
  for (const int threads : {1, 2}) {
    for (const Index page : {1, 16, 100}) {
      CAPTURE(threads, page);
      paged_equals_contiguous<Layer, T>(layer, page, 400, threads);
      paged_equals_contiguous<Layer, Bf16>(layer, page, 400, threads);
    }
  }
}

// B forks of one prompt, each with its own continuation, decoded with the prompt as a
// shared prefix.
template <class Layer, class S>
void shared_prefix_equals_full(const Layer& layer, Index page, Index prompt, int threads) {
  using T = typename Layer::scalar_type;
  using Cache = decltype(make_paged<S>(layer, nullptr));
  auto pool = make_pool<S>(layer, page, 512);
  const Index d = layer.config().d_model;
  const RowMatrix<T> prompt_x = test::random_input<T>(prompt, d, 31);
  Cache root = make_paged<S>(layer, pool);
  layer.prefill(prompt_x, root);
  Batch<Layer, Cache> b;
  const std::vector<Index> suffix{0, 3, 17, 200, 1};
  for (std::size_t s = 0; s < suffix.size(); ++s) {
    RowMatrix<T> input(prompt + suffix[s] + 1, d);
    input.topRows(prompt) = prompt_x;
    input.bottomRows(suffix[s] + 1) = test::random_input<T>(suffix[s] + 1, d, 40 + s);
    b.caches.push_back(root);  // a fork: shares every page of the prompt
    if (suffix[s] > 0) layer.prefill(input.middleRows(prompt, suffix[s]), b.caches.back());
    b.inputs.push_back(std::move(input));
  }
  for (const Index shared : {prompt, prompt / 2, Index{1}}) {
    CAPTURE(shared);
    auto copy = b;
    check_against_singles(layer, copy, threads, BatchOptions{shared});
  }
}

template <class Layer>
void shared_prefixes(const Layer& layer) {
  using T = typename Layer::scalar_type;
  for (const int threads : {1, 2}) {
    for (const Index page : {16, 50}) {
      CAPTURE(threads, page);
      shared_prefix_equals_full<Layer, T>(layer, page, 1000, threads);  // 1000: mid-page
      shared_prefix_equals_full<Layer, Bf16>(layer, page, 1000, threads);
    }
  }
  // A prefix longer than four decode tiles of every layer here (GQA 1024 tokens, MLA 256,
  // LRKV 16): with 2 threads its range is cut into pieces (plan_batch_units).
  shared_prefix_equals_full<Layer, T>(layer, 50, 4200, 2);
}

// Refused batches change no cache.
template <class Layer>
void bad_batches(const Layer& layer) {
  using T = typename Layer::scalar_type;
  using Cache = typename Layer::template cache_type<T>;
  auto b = make_batch<Layer, Cache>(
      layer, {4, 6}, [&] { return layer.template make_cache<T>(); }, 3);
  const RowMatrix<T> x = b.new_tokens();
  RowMatrix<T> out(2, layer.config().d_model);
  auto ws = layer.make_workspace();
  auto unchanged = [&] {
    CHECK(b.caches[0].tokens() == 4);
    CHECK(b.caches[1].tokens() == 6);
  };
  std::vector<Cache*> same{&b.caches[0], &b.caches[0]};
  CHECK_THROWS_AS(layer.decode_batch(x, std::span<Cache* const>(same), out, ws), shape_error);
  std::vector<Cache*> null{&b.caches[0], nullptr};
  CHECK_THROWS_AS(layer.decode_batch(x, std::span<Cache* const>(null), out, ws), shape_error);
  auto pointers = b.pointers();
  const std::span<Cache* const> span(pointers);
  CHECK_THROWS_AS(layer.decode_batch(x.topRows(1), span, out, ws), shape_error);
  RowMatrix<T> short_out(1, layer.config().d_model);
  CHECK_THROWS_AS(layer.decode_batch(x, span, short_out, ws), shape_error);
  // A shared prefix needs paged caches.
  CHECK_THROWS_AS(layer.decode_batch(x, span, out, ws, {}, BatchOptions{2}), config_error);
  CHECK_THROWS_AS(layer.decode_batch(x, span, out, ws, {}, BatchOptions{-1}), shape_error);
  unchanged();
  // Paged caches that do not share the prefix, or a prefix longer than a sequence.
  auto pool = make_pool<T>(layer, 4, 64);
  using Paged = decltype(make_paged<T>(layer, pool));
  auto p = make_batch<Layer, Paged>(
      layer, {6, 8}, [&] { return make_paged<T>(layer, pool); }, 4);
  auto paged_pointers = p.pointers();
  const std::span<Paged* const> paged_span(paged_pointers);
  const Index pages_before = pool->pages_in_use();
  CHECK_THROWS_AS(layer.decode_batch(x, paged_span, out, ws, {}, BatchOptions{4}), config_error);
  CHECK_THROWS_AS(layer.decode_batch(x, paged_span, out, ws, {}, BatchOptions{7}), shape_error);
  CHECK(p.caches[0].tokens() == 6);
  CHECK(p.caches[1].tokens() == 8);
  CHECK(pool->pages_in_use() == pages_before);
  // An empty batch is a no-op.
  std::vector<Cache*> none;
  RowMatrix<T> empty(0, layer.config().d_model);
  layer.decode_batch(empty, std::span<Cache* const>(none), empty, ws);
}

// An exhausted pool fails the whole batch and gives back the pages it took.
template <class Layer>
void exhausted_pool(const Layer& layer) {
  using T = typename Layer::scalar_type;
  auto pool = make_pool<T>(layer, 4, 5);
  using Paged = decltype(make_paged<T>(layer, pool));
  // Sequences of 4 and 8 tokens fill 1 + 2 whole pages; another cache takes one of the
  // two pages left, so of the two new pages the batch needs, the second is missing.
  auto b = make_batch<Layer, Paged>(
      layer, {4, 8}, [&] { return make_paged<T>(layer, pool); }, 5);
  auto extra = make_paged<T>(layer, pool);
  extra.reserve(1);
  REQUIRE(pool->pages_free() == 1);
  const RowMatrix<T> x = b.new_tokens();
  RowMatrix<T> out(2, layer.config().d_model);
  auto pointers = b.pointers();
  CHECK_THROWS_AS(layer.decode_batch(x, std::span<Paged* const>(pointers), out), pool_exhausted);
  CHECK(pool->pages_free() == 1);
  CHECK(b.caches[0].tokens() == 4);
  CHECK(b.caches[1].tokens() == 8);
}

template <class Layer>
void all_batch_checks(const Layer& layer) {
  paged_decodes_as_contiguous(layer);
  batches_equal_singles(layer);
  shared_prefixes(layer);
  bad_batches(layer);
  exhausted_pool(layer);
}

}  // namespace

TEST_CASE("GQA family: paged, batched and shared-prefix decode", "[batch][paged]") {
  for (const Index n_kv : {4, 2, 1}) {  // MHA, GQA, MQA
    CAPTURE(n_kv);
    all_batch_checks(GqaLayer<float>::random(gqa(n_kv), 1));
    batches_equal_singles(GqaLayer<double>::random(gqa(n_kv), 2));
  }
}

TEST_CASE("MLA: paged, batched and shared-prefix decode", "[batch][paged]") {
  all_batch_checks(MlaLayer<float>::random(mla(10), 3));
  batches_equal_singles(MlaLayer<double>::random(mla(0), 4));
}

TEST_CASE("LRKV: paged, batched and shared-prefix decode", "[batch][paged]") {
  all_batch_checks(LrkvLayer<float>::random(lrkv(), 5));
  batches_equal_singles(LrkvLayer<double>::random(lrkv(), 6));
  LrkvConfig shared = lrkv();
  shared.rope_mode = LrkvRopeMode::shared;
  shared.rope_dim = 0;
  shared.key_norm = false;
  batches_equal_singles(LrkvLayer<double>::random(shared, 7));
  // A rank of at least a packet (16 floats with AVX-512): the batch's units score with
  // detail::lrkv_score, each sequence's transposed queries, as a single decode does.
  LrkvConfig wide = shared;
  wide.head_dim = 24;  // rank <= head_dim
  wide.rank = 17;
  batches_equal_singles(LrkvLayer<float>::random(wide, 8));
  shared_prefixes(LrkvLayer<float>::random(wide, 9));
}

TEST_CASE("merge_states: the merge of partial softmax states is softmax over the union",
          "[batch][merge]") {
  // Two query rows, 11 keys with values of width 3, split into parts [0,4), [4,5), [5,11).
  const RowMatrix<double> logits = test::random_input<double>(2, 11, 51) * 4.0;
  const RowMatrix<double> values = test::random_input<double>(11, 3, 52);
  auto state_of = [&](Index first, Index last) {  // the definitions, as loops
    SoftmaxStates<double> st(2, 3);
    for (Index i = 0; i < 2; ++i) {
      for (Index t = first; t < last; ++t) st.max(i) = std::max(st.max(i), logits(i, t));
      for (Index t = first; t < last; ++t) {
        const double w = std::exp(logits(i, t) - st.max(i));
        st.sum(i) += w;
        st.acc.row(i) += w * values.row(t);
      }
    }
    return st;
  };
  SoftmaxStates<double> merged = state_of(5, 11);
  merge_states(state_of(0, 4), merged);
  merge_states(state_of(4, 5), merged);
  merge_states(SoftmaxStates<double>(2, 3), merged);  // an empty part changes nothing
  RowMatrix<double> out(2, 3);
  finish_states(merged, out);
  for (Index i = 0; i < 2; ++i) {
    double total = 0;
    RowVector<double> expected = RowVector<double>::Zero(3);
    for (Index t = 0; t < 11; ++t) total += std::exp(logits(i, t));
    for (Index t = 0; t < 11; ++t) expected += std::exp(logits(i, t)) / total * values.row(t);
    CHECK(test::relative_error(out.row(i), expected) <= 1e-14);
  }
  // No key at all: zeros, as the softmax of an all -inf row; a NaN sum stays NaN.
  SoftmaxStates<double> empty(1, 3);
  RowMatrix<double> zero(1, 3);
  finish_states(empty, zero);
  CHECK(zero.isZero(0.0));
  SoftmaxStates<double> poisoned(1, 3);
  poisoned.max(0) = 0;
  poisoned.sum(0) = std::numeric_limits<double>::quiet_NaN();
  SoftmaxStates<double> into(1, 3);
  into.max(0) = 1;
  into.sum(0) = 2;
  merge_states(poisoned, into);
  CHECK(std::isnan(into.sum(0)));
  // Shapes must agree.
  CHECK_THROWS_AS(merge_states(SoftmaxStates<double>(2, 3), into), shape_error);
  RowMatrix<double> wrong(2, 2);
  CHECK_THROWS_AS(finish_states(merged, wrong), shape_error);
}
