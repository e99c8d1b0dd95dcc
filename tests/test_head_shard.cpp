// [head_shard]: shard_heads splits a layer into the layers of tensor (head)
// parallelism, by the analysis module's --tp rules (analysis/cache_size.hpp).
//
//  * The sub-layers' outputs summed over the ranks equal the layer's output, for a
//    prefill of L tokens and for the decode steps after it (head parallelism's
//    all-reduce): MHA, GQA with KV heads split, GQA and MQA with KV heads replicated,
//    MLA with and without query compression (and with YaRN), LRKV in every factored
//    RoPE mode with and without key_norm, and windows, sink tokens and sink logits.
//  * Each rank's cache holds analysis::bytes_per_token_per_layer(config, storage, t)
//    bytes per token (what kvcalc --tp prints per device), stored as fp64, fp32, bf16.
//  * A rank count the rules refuse throws the analysis module's config_error, naming
//    tp; a rank outside [0, ranks) throws config_error naming rank.
#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/head_shard.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"
#include "test_util.hpp"

using namespace kvattn;
namespace an = kvattn::analysis;
using kvattn::test::max_abs_error;
using kvattn::test::random_input;
using kvattn::test::relative_error;

namespace {

using MatD = RowMatrix<double>;
using bf16 = Eigen::bfloat16;

// Prefilled at once, then decoded one token at a time. The prompt is longer than
// the windows below, so they drop tokens in both phases.
constexpr Index kPrompt = 11;
constexpr Index kDecodes = 4;
// The sum over ranks regroups the W_O product by row blocks; in double that moves
// the result by a few ulps of its terms, as every double path in the suite.
constexpr double kTolerance = 1e-12;

// A prefill of x's first `prompt` rows, then one decode step per remaining row.
template <class Layer, class Cache>
MatD prefill_then_decode(const Layer& layer, const MatD& x, Index prompt, Cache& cache) {
  MatD y(x.rows(), layer.config().d_model);
  y.topRows(prompt) = layer.prefill(x.topRows(prompt), cache);
  for (Index t = prompt; t < x.rows(); ++t) y.row(t) = layer.decode(x.row(t), cache);
  return y;
}

// Sums each rank's output over `ranks` ranks and compares it with the whole layer's,
// the prefill rows and the decoded rows separately. Also checks what every sub-layer
// must keep: its share of the heads, the layer's softmax scale, and as its own cache
// (tp 1) what the analysis module says one device of tp `ranks` holds.
template <class Layer>
void check_ranks_sum_to_layer(const Layer& layer, Index ranks, const std::string& what) {
  const auto& config = layer.config();
  const MatD x = random_input<double>(kPrompt + kDecodes, config.d_model,
                                      static_cast<std::uint64_t>(100 + ranks));
  auto cache = layer.make_cache();
  const MatD full = prefill_then_decode(layer, x, kPrompt, cache);
  MatD sum = MatD::Zero(full.rows(), full.cols());
  for (Index rank = 0; rank < ranks; ++rank) {
    const Layer part = shard_heads(layer, rank, ranks);
    CAPTURE(what, ranks, rank);
    CHECK(part.config().n_heads == config.n_heads / ranks);
    CHECK(part.softmax_scale() == layer.softmax_scale());
    CHECK(an::cache_layout(part.config()) == an::cache_layout(config, ranks));
    auto part_cache = part.make_cache();
    sum += prefill_then_decode(part, x, kPrompt, part_cache);
  }
  const double prefill_error = relative_error(sum.topRows(kPrompt), full.topRows(kPrompt));
  const double decode_error = relative_error(sum.bottomRows(kDecodes), full.bottomRows(kDecodes));
  INFO(what << ", tp " << ranks << ": prefill relative error " << prefill_error << " (max abs "
            << max_abs_error(sum.topRows(kPrompt), full.topRows(kPrompt))
            << "), decode relative error " << decode_error << " (max abs "
            << max_abs_error(sum.bottomRows(kDecodes), full.bottomRows(kDecodes)) << ")");
  CHECK(prefill_error <= kTolerance);
  CHECK(decode_error <= kTolerance);
}

// Every rank's cache after `length` prefilled tokens, stored as S, against the
// analysis module's bytes per token per layer on one device of tp `ranks`.
template <class S, class Layer>
void check_rank_cache_bytes(const Layer& layer, Index ranks, Index length) {
  const Index per_token = an::bytes_per_token_per_layer(layer.config(), an::storage_of<S>(), ranks);
  const MatD x = random_input<double>(length, layer.config().d_model, 7);
  for (Index rank = 0; rank < ranks; ++rank) {
    const Layer part = shard_heads(layer, rank, ranks);
    auto cache = part.template make_cache<S>();
    (void)part.prefill(x, cache);
    CAPTURE(ranks, rank, sizeof(S), per_token, length);
    CHECK(cache.bytes() == static_cast<std::size_t>(per_token * length));
  }
}

template <class Layer>
void check_cache_bytes_in_every_storage(const Layer& layer, Index ranks) {
  check_rank_cache_bytes<double>(layer, ranks, kPrompt);
  check_rank_cache_bytes<float>(layer, ranks, kPrompt);
  check_rank_cache_bytes<bf16>(layer, ranks, kPrompt);
}

// The call throws config_error and its message contains `text`.
template <class Call>
void check_config_error(const Call& call, const std::string& text) {
  INFO("expected a config_error containing: " << text);
  CHECK_THROWS_AS(call(), config_error);
  CHECK_THROWS_WITH(call(), Catch::Contains(text));
}

// H = 12 divides by every degree below; d_model is not H * d_h on purpose.
constexpr Index kHeads = 12;
const std::vector<Index> kDegrees = {2, 3, 4, 6, 12};

GqaConfig gqa_case(Index n_kv) {
  GqaConfig c = gqa_config(20, kHeads, 8, n_kv, {RopeLayout::half_split, 10000.0, 7});
  c.qkv_bias = n_kv % 2 == 0;
  return c;
}

// The analysis module's rule, restated: KV heads split or replicate, nothing between.
bool kv_heads_fit(Index n_kv, Index ranks) { return n_kv % ranks == 0 || ranks % n_kv == 0; }

MlaConfig mla_case(Index q_rank) {
  MlaConfig c;
  c.d_model = 19;
  c.n_heads = kHeads;
  c.kv_rank = 10;
  c.q_rank = q_rank;
  c.qk_nope_dim = 5;
  c.rope_dim = 4;
  c.v_dim = 6;
  c.rope = {RopeLayout::interleaved, 10000.0, 3};
  c.q_norm = q_rank > 0;
  c.kv_norm = true;
  return c;
}

LrkvConfig lrkv_case(LrkvRopeMode mode, bool key_norm) {
  LrkvConfig c;
  c.d_model = 21;
  c.n_heads = kHeads;
  c.head_dim = 8;
  c.rank = mode == LrkvRopeMode::commuting ? 4 : 3;
  c.rope_mode = mode;
  if (mode != LrkvRopeMode::none) c.rope = {RopeLayout::half_split, 500.0, 5};
  if (mode == LrkvRopeMode::decoupled) c.rope_dim = 4;
  c.key_norm = key_norm;
  return c;
}

std::string describe_lrkv(const LrkvConfig& c) {
  return std::string("LRKV rope_mode ") + to_string(c.rope_mode) + ", key_norm " +
         (c.key_norm ? "on" : "off");
}

}  // namespace

TEST_CASE("GQA-family ranks sum to the layer: KV heads split or replicated as --tp says",
          "[head_shard]") {
  for (const Index n_kv : {Index{12}, Index{6}, Index{4}, Index{3}, Index{2}, Index{1}}) {
    const auto layer = GqaLayer<double>::random(gqa_case(n_kv), static_cast<std::uint64_t>(n_kv));
    for (const Index ranks : kDegrees) {
      const std::string what = "GQA H 12, n_kv " + std::to_string(n_kv);
      CAPTURE(what, ranks);
      if (!kv_heads_fit(n_kv, ranks)) {
        check_config_error([&] { return shard_heads(layer, 0, ranks); },
                           "tp (" + std::to_string(ranks) + ") must divide n_kv_heads");
        continue;
      }
      const Index expected_kv = n_kv % ranks == 0 ? n_kv / ranks : 1;
      for (Index rank = 0; rank < ranks; ++rank) {
        CHECK(shard_heads(layer, rank, ranks).config().n_kv_heads == expected_kv);
      }
      check_ranks_sum_to_layer(layer, ranks, what);
    }
  }
}

TEST_CASE("A replicated KV head is the one its rank's query heads read", "[head_shard]") {
  // n_kv 2, tp 4: ranks 0, 1 hold KV head 0 and ranks 2, 3 KV head 1 (group size 6).
  const auto layer = GqaLayer<double>::random(gqa_case(2), 11);
  const Index dh = layer.config().head_dim;
  for (Index rank = 0; rank < 4; ++rank) {
    const auto part = shard_heads(layer, rank, 4);
    const Index kv_head = rank / 2;
    CAPTURE(rank, kv_head);
    CHECK(part.weights().w_k == layer.weights().w_k.middleCols(kv_head * dh, dh));
    CHECK(part.weights().bias_v == layer.weights().bias_v.middleCols(kv_head * dh, dh));
    CHECK(part.weights().w_q == layer.weights().w_q.middleCols(rank * 3 * dh, 3 * dh));
  }
}

TEST_CASE("One rank is the layer itself", "[head_shard]") {
  const auto gqa = GqaLayer<float>::random(gqa_case(4), 3);
  const auto gqa_part = shard_heads(gqa, 0, 1);
  CHECK(gqa_part.config() == gqa.config());
  CHECK(gqa_part.weights().w_q == gqa.weights().w_q);
  CHECK(gqa_part.weights().w_o == gqa.weights().w_o);
  const auto mla = MlaLayer<float>::random(mla_case(7), 3);
  CHECK(shard_heads(mla, 0, 1).config() == mla.config());
  CHECK(shard_heads(mla, 0, 1).weights().w_uk == mla.weights().w_uk);
  const auto lrkv = LrkvLayer<float>::random(lrkv_case(LrkvRopeMode::decoupled, true), 3);
  CHECK(shard_heads(lrkv, 0, 1).config() == lrkv.config());
  CHECK(shard_heads(lrkv, 0, 1).weights().w_qr == lrkv.weights().w_qr);
}

TEST_CASE("MLA ranks sum to the layer, with and without query compression", "[head_shard]") {
  for (const Index q_rank : {Index{0}, Index{7}}) {
    const auto layer = MlaLayer<double>::random(mla_case(q_rank), 20);
    for (const Index ranks : kDegrees) {
      check_ranks_sum_to_layer(layer, ranks, "MLA d_c' " + std::to_string(q_rank));
    }
  }
  // YaRN puts m^2 into the scale; the sub-layers must keep it.
  MlaConfig yarn = mla_case(7);
  yarn.yarn = {true, 4.0, 8, 32.0, 1.0, 0.707, 0.707};
  const auto layer = MlaLayer<double>::random(yarn, 21);
  check_ranks_sum_to_layer(layer, 4, "MLA with YaRN");
}

TEST_CASE("LRKV ranks sum to the layer in every factored RoPE mode", "[head_shard]") {
  const std::vector<LrkvConfig> configs = {
      lrkv_case(LrkvRopeMode::none, false),      lrkv_case(LrkvRopeMode::none, true),
      lrkv_case(LrkvRopeMode::shared, false),    lrkv_case(LrkvRopeMode::shared, true),
      lrkv_case(LrkvRopeMode::decoupled, false), lrkv_case(LrkvRopeMode::decoupled, true),
      lrkv_case(LrkvRopeMode::commuting, true)};
  std::uint64_t seed = 30;
  for (const LrkvConfig& config : configs) {
    const auto layer = LrkvLayer<double>::random(config, seed++);
    for (const Index ranks : kDegrees)
      check_ranks_sum_to_layer(layer, ranks, describe_lrkv(config));
  }
}

TEST_CASE("Windows, sink tokens, sink logits and soft-capping survive sharding", "[head_shard]") {
  // Sink logits are per head: a rank that kept another head's logit would be off.
  GqaConfig gqa = gqa_case(4);
  gqa.window = 5;
  gqa.sink_tokens = 2;
  gqa.sink_logits = true;
  gqa.logit_softcap = 3.0;
  const auto gqa_layer = GqaLayer<double>::random(gqa, 40);
  for (const Index ranks : {Index{2}, Index{4}, Index{12}}) {
    check_ranks_sum_to_layer(gqa_layer, ranks, "GQA windowed, sinks");
  }
  MlaConfig mla = mla_case(7);
  mla.window = 6;
  mla.sink_tokens = 1;
  mla.sink_logits = true;
  const auto mla_layer = MlaLayer<double>::random(mla, 41);
  for (const Index ranks : {Index{3}, Index{6}}) {
    check_ranks_sum_to_layer(mla_layer, ranks, "MLA windowed, sinks");
  }
  LrkvConfig lrkv = lrkv_case(LrkvRopeMode::decoupled, true);
  lrkv.window = 4;
  lrkv.sink_tokens = 3;
  lrkv.sink_logits = true;
  lrkv.logit_softcap = 5.0;
  const auto lrkv_layer = LrkvLayer<double>::random(lrkv, 42);
  for (const Index ranks : {Index{2}, Index{4}}) {
    check_ranks_sum_to_layer(lrkv_layer, ranks, "LRKV windowed, sinks");
  }
}

TEST_CASE("Each rank's cache holds what the analysis module counts per device (kvcalc --tp)",
          "[head_shard]") {
  for (const Index n_kv : {Index{12}, Index{4}, Index{2}, Index{1}}) {
    const auto layer = GqaLayer<double>::random(gqa_case(n_kv), 50);
    for (const Index ranks : {Index{2}, Index{4}, Index{12}}) {
      CAPTURE(n_kv);
      check_cache_bytes_in_every_storage(layer, ranks);
    }
  }
  for (const Index q_rank : {Index{0}, Index{7}}) {
    const auto layer = MlaLayer<double>::random(mla_case(q_rank), 51);
    for (const Index ranks : {Index{2}, Index{12}})
      check_cache_bytes_in_every_storage(layer, ranks);
  }
  for (const LrkvConfig& config :
       {lrkv_case(LrkvRopeMode::none, false), lrkv_case(LrkvRopeMode::decoupled, true),
        lrkv_case(LrkvRopeMode::commuting, true)}) {
    const auto layer = LrkvLayer<double>::random(config, 52);
    for (const Index ranks : {Index{3}, Index{12}}) {
      CAPTURE(describe_lrkv(config));
      check_cache_bytes_in_every_storage(layer, ranks);
    }
  }
}

TEST_CASE("Rank counts the --tp rules refuse, and ranks out of range, throw config_error",
          "[head_shard]") {
  const auto gqa = GqaLayer<double>::random(gqa_case(4), 60);
  check_config_error([&] { return shard_heads(gqa, 0, 5); },
                     "tensor parallelism: tp (5) must divide n_heads");
  check_config_error([&] { return shard_heads(gqa, 0, 3); },
                     "tp (3) must divide n_kv_heads (KV heads shard) or be a multiple of it");
  check_config_error([&] { return shard_heads(gqa, 0, 0); }, "tp (0) must be >= 1");
  check_config_error([&] { return shard_heads(gqa, 0, -2); }, "tp (-2) must be >= 1");
  check_config_error([&] { return shard_heads(gqa, 4, 4); },
                     "shard_heads: rank (4) must be in [0, ranks) = [0, 4)");
  check_config_error([&] { return shard_heads(gqa, -1, 2); },
                     "shard_heads: rank (-1) must be in [0, ranks) = [0, 2)");

  const auto mla = MlaLayer<double>::random(mla_case(7), 61);
  check_config_error([&] { return shard_heads(mla, 0, 5); }, "tp (5) must divide n_heads");
  check_config_error([&] { return shard_heads(mla, 0, 24); }, "tp (24) must divide n_heads");
  check_config_error([&] { return shard_heads(mla, 12, 12); }, "rank (12)");

  const auto lrkv = LrkvLayer<double>::random(lrkv_case(LrkvRopeMode::shared, true), 62);
  check_config_error([&] { return shard_heads(lrkv, 0, 8); }, "tp (8) must divide n_heads");
  check_config_error([&] { return shard_heads(lrkv, 0, 0); }, "tp (0) must be >= 1");
  check_config_error([&] { return shard_heads(lrkv, 6, 6); }, "rank (6)");
}
