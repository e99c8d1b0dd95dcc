// [attend_states]: attention over parts of a sequence, merged (attention/attend_states.hpp).
// A sequence cut into shards, each an ordinary cache whose RoPE offset is its first
// token's position: the merged partial states of every shard equal the expanded
// reference's decode step over the whole sequence (double, 1e-12), for GQA/MHA/MQA, MLA
// and LRKV; a query inside a cache sees only its causal prefix; append stores what
// prefill stores.
#include <catch2/catch.hpp>
#include <limits>
#include <string>
#include <vector>

#include "attend_util.hpp"
#include "kvattn/core/random.hpp"
#include "kvattn/reference/gqa.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "kvattn/reference/mla.hpp"
#include "test_util.hpp"

using namespace kvattn;

namespace {

GqaConfig gqa_config(Index heads, Index kv_heads, bool sinks) {
  GqaConfig c;
  c.d_model = 24;
  c.n_heads = heads;
  c.n_kv_heads = kv_heads;
  c.head_dim = 8;
  c.qkv_bias = true;
  c.rope.layout = RopeLayout::half_split;
  c.rope.position_offset = 5;
  c.sink_logits = sinks;
  c.logit_softcap = sinks ? 0.0 : 3.0;
  return c;
}

MlaConfig mla_config() {
  MlaConfig c;
  c.d_model = 20;
  c.n_heads = 3;
  c.kv_rank = 12;
  c.q_rank = 10;
  c.q_norm = true;
  c.kv_norm = true;
  c.qk_nope_dim = 6;
  c.rope_dim = 4;
  c.v_dim = 5;
  c.rope.layout = RopeLayout::interleaved;
  c.rope.position_offset = 2;
  c.sink_logits = true;
  return c;
}

LrkvConfig lrkv_config(LrkvRopeMode mode, bool key_norm) {
  LrkvConfig c;
  c.d_model = 18;
  c.n_heads = 4;
  c.head_dim = 6;
  c.rank = 2;
  c.rope_mode = mode;
  if (mode != LrkvRopeMode::none) {
    c.rope.layout = RopeLayout::half_split;
    c.rope.position_offset = 3;
  }
  if (mode == LrkvRopeMode::decoupled) c.rope_dim = 4;
  c.key_norm = key_norm;
  // The sink logits and the soft-cap: each enters a part's states differently.
  c.sink_logits = key_norm;
  c.logit_softcap = key_norm ? 0.0 : 2.5;
  return c;
}

// The layer that holds tokens [first, ...) of `layer`'s sequence: the same weights, its
// RoPE offset moved to the shard's first position.
template <class Layer>
Layer shard_layer(const Layer& layer, Index first) {
  auto config = layer.config();
  config.rope.position_offset += first;
  return Layer(config, layer.weights());
}

template <class Layer>
RowMatrix<double> merged_heads(const Layer& layer, const RowMatrix<double>& x,
                               const std::vector<Index>& bounds, const RowMatrix<double>& query,
                               Index position) {
  SoftmaxStates<double> total, part;
  const Index heads = layer.config().n_heads;
  total.reset(heads, layer.heads_width() / heads);
  for (std::size_t s = 0; s + 1 < bounds.size(); ++s) {
    const Layer shard = shard_layer(layer, bounds[s]);
    auto cache = shard.make_cache();
    shard.append(x.middleRows(bounds[s], bounds[s + 1] - bounds[s]), cache);
    REQUIRE(cache.tokens() == bounds[s + 1] - bounds[s]);
    auto ws = shard.make_workspace();
    shard.attend_states(query, position - bounds[s], cache, part, ws);
    merge_states(part, total);
  }
  if (layer.config().sink_logits) add_sink_logits(layer.weights().sinks, total);
  RowMatrix<double> heads_out(heads, layer.heads_width() / heads);
  finish_states(total, heads_out);
  return heads_out.reshaped<Eigen::RowMajor>(1, layer.heads_width());
}

template <class Layer>
void check_shards_equal_reference(const Layer& layer, std::uint64_t seed) {
  const Index length = 41;
  const RowMatrix<double> x =
      kvattn::test::random_input<double>(length, layer.config().d_model, seed);
  auto full = layer.make_cache();
  layer.prefill(x, full);
  const RowMatrix<double> query = layer.project_query(x.bottomRows(1));
  REQUIRE(kvattn::test::max_abs_error(query, kvattn::test::project_query(layer, x.bottomRows(1))) ==
          0.0);
  const RowMatrix<double> expected = reference::decode_step(layer, full, query);
  // Uneven shards, an empty one, and the query's own shard last.
  for (const std::vector<Index>& bounds :
       {std::vector<Index>{0, length}, std::vector<Index>{0, 13, 29, length},
        std::vector<Index>{0, 1, 1, 40, length}}) {
    const RowMatrix<double> got = merged_heads(layer, x, bounds, query, length - 1);
    CHECK(kvattn::test::relative_error(got, expected) < 1e-12);
  }
  // A query inside a cache sees its causal prefix only: the step of token p.
  const Index p = 17;
  auto prefix = layer.make_cache();
  layer.prefill(x.topRows(p + 1), prefix);
  const RowMatrix<double> query_p = layer.project_query(x.row(p));
  const RowMatrix<double> expected_p = reference::decode_step(layer, prefix, query_p);
  CHECK(kvattn::test::relative_error(merged_heads(layer, x, {0, 9, length}, query_p, p),
                                     expected_p) < 1e-12);
}

// append stores what prefill stores: the next decode step is bitwise the same.
template <class Layer>
void check_append_equals_prefill(const Layer& layer, std::uint64_t seed) {
  const RowMatrix<double> x = kvattn::test::random_input<double>(12, layer.config().d_model, seed);
  auto appended = layer.make_cache();
  auto prefilled = layer.make_cache();
  layer.append(x.topRows(11), appended);
  layer.prefill(x.topRows(11), prefilled);
  REQUIRE(appended.tokens() == prefilled.tokens());
  REQUIRE(appended.bytes() == prefilled.bytes());
  const RowVector<double> a = layer.decode(x.bottomRows(1), appended);
  const RowVector<double> b = layer.decode(x.bottomRows(1), prefilled);
  CHECK(kvattn::test::max_abs_error(a, b) == 0.0);
  // A failed append changes nothing.
  const RowMatrix<double> wide =
      kvattn::test::random_input<double>(2, layer.config().d_model + 1, seed);
  CHECK_THROWS_AS(layer.append(wide, appended), shape_error);
  CHECK(appended.tokens() == 12);
}

template <class Layer>
void check_errors(const Layer& layer) {
  auto cache = layer.make_cache();
  layer.append(kvattn::test::random_input<double>(3, layer.config().d_model, 1), cache);
  auto ws = layer.make_workspace();
  SoftmaxStates<double> states;
  const RowMatrix<double> query = RowMatrix<double>::Zero(1, layer.query_width());
  CHECK_THROWS_AS(layer.attend_states(query, -1, cache, states, ws), shape_error);
  // Positions past 2^53 (where position_offset + position is no longer exact in double)
  // are refused; INT64_MAX used to overflow position + 1 and give empty states.
  constexpr Index max_position = Index{1} << 53;
  for (const Index far : {max_position + 1, std::numeric_limits<Index>::max()}) {
    CHECK_THROWS_WITH(layer.attend_states(query, far, cache, states, ws),
                      Catch::Contains("position (" + std::to_string(far) + ")"));
  }
  // A zero query gives every logit 0 whatever its rotation, so each head's state sums
  // exp(0) once per visible token: 1 at position 0, all 3 tokens at 2^53.
  layer.attend_states(query, 0, cache, states, ws);
  for (Index h = 0; h < states.rows(); ++h) CHECK(states.sum(h) == 1.0);
  layer.attend_states(query, max_position, cache, states, ws);
  REQUIRE(states.rows() == layer.config().n_heads);
  for (Index h = 0; h < states.rows(); ++h) {
    CHECK(states.max(h) == 0.0);
    CHECK(states.sum(h) == 3.0);
  }
  const RowMatrix<double> wide = RowMatrix<double>::Zero(1, layer.query_width() + 1);
  CHECK_THROWS_WITH(layer.attend_states(wide, 2, cache, states, ws), Catch::Contains("query"));
  // A cache with no token gives every head an empty state (a shard nothing was appended to).
  auto empty = layer.make_cache();
  layer.attend_states(query, 0, empty, states, ws);
  CHECK(states.rows() == layer.config().n_heads);
  for (Index h = 0; h < states.rows(); ++h) {
    CHECK(states.max(h) == -std::numeric_limits<double>::infinity());
    CHECK(states.sum(h) == 0.0);
  }
  auto windowed = layer.config();
  windowed.window = 4;
  const Layer with_window(windowed, layer.weights());
  auto windowed_cache = with_window.make_cache();
  CHECK_THROWS_WITH(with_window.attend_states(query, 0, windowed_cache, states, ws),
                    Catch::Contains("window"));
}

}  // namespace

TEST_CASE("GQA-family shards merge to the reference step", "[attend_states]") {
  for (const auto& [heads, kv_heads] : {std::pair<Index, Index>{4, 4}, {6, 2}, {3, 1}}) {
    for (const bool sinks : {false, true}) {
      INFO("H " << heads << ", n_kv " << kv_heads << ", sink logits " << sinks);
      const auto layer = GqaLayer<double>::random(gqa_config(heads, kv_heads, sinks), 7);
      check_shards_equal_reference(layer, 11);
      check_append_equals_prefill(layer, 12);
      check_errors(layer);
    }
  }
}

TEST_CASE("MLA shards merge to the reference step", "[attend_states]") {
  auto config = mla_config();
  for (const bool q_rank : {true, false}) {
    config.q_rank = q_rank ? 10 : 0;
    config.q_norm = q_rank;
    INFO("q_rank " << config.q_rank);
    const auto layer = MlaLayer<double>::random(config, 21);
    check_shards_equal_reference(layer, 22);
    check_append_equals_prefill(layer, 23);
    check_errors(layer);
  }
}

TEST_CASE("LRKV shards merge to the reference step", "[attend_states]") {
  for (const auto mode : {LrkvRopeMode::decoupled, LrkvRopeMode::shared, LrkvRopeMode::none}) {
    for (const bool key_norm : {false, true}) {
      INFO("rope mode " << static_cast<int>(mode) << ", key_norm " << key_norm);
      const auto layer = LrkvLayer<double>::random(lrkv_config(mode, key_norm), 31);
      check_shards_equal_reference(layer, 32);
      check_append_equals_prefill(layer, 33);
      check_errors(layer);
    }
  }
}

TEST_CASE("attend_states over a bf16 cache in float equals attend", "[attend_states]") {
  const auto layer = GqaLayer<float>::random(gqa_config(4, 2, false), 41);
  const RowMatrix<float> x = kvattn::test::random_input<float>(30, layer.config().d_model, 42);
  auto cache = layer.make_cache<Eigen::bfloat16>();
  layer.append(x, cache);
  const RowMatrix<float> query = layer.project_query(x.bottomRows(1));
  RowMatrix<float> heads(1, layer.heads_width());
  auto ws = layer.make_workspace();
  layer.attend(query, cache, heads, ws);
  SoftmaxStates<float> states;
  layer.attend_states(query, 29, cache, states, ws, Threads{2});
  RowMatrix<float> from_states(states.rows(), states.width());
  finish_states(states, from_states);
  CHECK(kvattn::test::relative_error(from_states.reshaped<Eigen::RowMajor>(1, layer.heads_width()),
                                     heads) < 1e-6);
}

TEST_CASE("attend_states split across threads merges to the reference", "[attend_states]") {
  // Enough tokens that two threads split the sequence of MLA's and LRKV's one group
  // (the driver's merged max and normalizer, row_max / row_sum, come from the split).
  const Index length = 2600;
  const auto mla = MlaLayer<double>::random(mla_config(), 51);
  const auto lrkv = LrkvLayer<double>::random(lrkv_config(LrkvRopeMode::decoupled, true), 52);
  auto check = [&](const auto& layer) {
    const RowMatrix<double> x =
        kvattn::test::random_input<double>(length, layer.config().d_model, 53);
    auto cache = layer.make_cache();
    layer.append(x, cache);
    const RowMatrix<double> query = layer.project_query(x.bottomRows(1));
    const RowMatrix<double> expected = reference::decode_step(layer, cache, query);
    auto ws = layer.make_workspace(Threads{2});
    SoftmaxStates<double> states;
    layer.attend_states(query, length - 1, cache, states, ws, Threads{2});
    add_sink_logits(layer.weights().sinks, states);
    RowMatrix<double> heads(states.rows(), states.width());
    finish_states(states, heads);
    CHECK(kvattn::test::relative_error(heads.reshaped<Eigen::RowMajor>(1, layer.heads_width()),
                                       expected) < 1e-12);
  };
  check(mla);
  check(lrkv);
}
