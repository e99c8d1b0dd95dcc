// [mpi][head_parallel]: a layer's heads split over 1-4 ranks by kvcalc's --tp rules
// (kvattn/distributed/head_parallel.hpp) give what one process gives (double, 1e-12) for
// GQA/MHA/MQA (KV heads split and replicated), MLA and LRKV, windows included; each
// rank's cache bytes equal the analysis module's per-device figure and, when the tools
// are built (KVATTN_TEST_KVCALC), what kvcalc --tp <ranks> --json prints per device, run
// in-process through kvcalc_core.
#include <catch2/catch.hpp>

#include <sstream>
#include <string>
#include <vector>

#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/distributed/mpi.hpp"
#include "mpi_cases.hpp"
#include "test_util.hpp"
#if KVATTN_TEST_KVCALC
#include <nlohmann/json.hpp>

#include "kvcalc.hpp"
#endif

using namespace kvattn;
using kvattn::test::relative_error;

namespace {

template <class Layer>
void check_head_parallel(const Layer& layer, std::uint64_t seed) {
  const Index prompt = 9, decoded = 5;
  const RowMatrix<double> x =
      kvattn::test::random_input<double>(prompt + decoded, layer.config().d_model, seed);
  auto cache = layer.make_cache();
  const int ranks = kvattn::test::world_size();
  mpi::HeadParallel<Layer> split(layer, MPI_COMM_WORLD);
  CHECK(relative_error(split.prefill(x.topRows(prompt)), layer.prefill(x.topRows(prompt), cache)) <
        1e-12);
  for (Index i = prompt; i < prompt + decoded; ++i) {
    CHECK(relative_error(split.decode(x.row(i)), layer.decode(x.row(i), cache)) < 1e-12);
  }
  CHECK(split.shard_layer().config().n_heads == layer.config().n_heads / ranks);
  const Index per_token =
      analysis::bytes_per_token_per_layer(layer.config(), analysis::storage_of<double>(), ranks);
  CHECK(split.shard().bytes() == static_cast<std::size_t>(per_token * (prompt + decoded)));
}

bool fits(Index kv_heads, int ranks) { return kv_heads % ranks == 0 || ranks % kv_heads == 0; }

}  // namespace

TEST_CASE("head-parallel GQA-family equals one process", "[mpi][head_parallel]") {
  const int ranks = kvattn::test::world_size();
  for (const Index kv_heads : {12, 6, 4, 3, 2, 1}) {
    if (!fits(kv_heads, ranks)) continue;
    for (const bool sinks : {false, true}) {
      INFO("ranks " << ranks << ", n_kv " << kv_heads << ", sink logits " << sinks);
      check_head_parallel(
          GqaLayer<double>::random(kvattn::test::mpi_gqa_config(kv_heads, sinks), 13), 14);
    }
  }
  auto windowed = kvattn::test::mpi_gqa_config(4, false);
  windowed.window = 5;
  windowed.sink_tokens = 2;
  if (fits(4, ranks)) check_head_parallel(GqaLayer<double>::random(windowed, 15), 16);
}

TEST_CASE("head-parallel MLA equals one process", "[mpi][head_parallel]") {
  check_head_parallel(MlaLayer<double>::random(kvattn::test::mpi_mla_config(), 17), 18);
}

TEST_CASE("head-parallel LRKV equals one process", "[mpi][head_parallel]") {
  check_head_parallel(LrkvLayer<double>::random(kvattn::test::mpi_lrkv_config(), 19), 20);
}

TEST_CASE("head-parallel refuses a rank count that does not fit", "[mpi][head_parallel]") {
  const int ranks = kvattn::test::world_size();
  auto config = kvattn::test::mpi_gqa_config(12, false);
  config.n_heads = 5 * 12;  // H = 60: 1-4 ranks divide it, 7 would not
  config.n_kv_heads = 5;    // 2, 3, 4 ranks neither divide 5 nor are multiples of it
  const auto layer = GqaLayer<double>::random(config, 21);
  if (ranks == 1) {
    CHECK_NOTHROW(mpi::HeadParallel<GqaLayer<double>>(layer, MPI_COMM_WORLD));
  } else {
    CHECK_THROWS_AS(mpi::HeadParallel<GqaLayer<double>>(layer, MPI_COMM_WORLD), config_error);
  }
}

TEST_CASE("head-parallel refuses bad input on every rank", "[mpi][head_parallel]") {
  const auto layer = GqaLayer<double>::random(kvattn::test::mpi_gqa_config(12, true), 22);
  const Index d = layer.config().d_model;
  const int ranks = kvattn::test::world_size();
  const int rank = kvattn::test::world_rank();
  const RowMatrix<double> x = kvattn::test::random_input<double>(6, d, 23);
  mpi::HeadParallel<GqaLayer<double>> split(layer, MPI_COMM_WORLD);
  auto cache = layer.make_cache();
  CHECK(relative_error(split.prefill(x.topRows(4)), layer.prefill(x.topRows(4), cache)) < 1e-12);
  if (ranks > 1) {
    const RowMatrix<double> token =
        rank == ranks - 1 ? RowMatrix<double>::Zero(1, d + 1) : RowMatrix<double>(x.row(4));
    CHECK_THROWS_AS(split.decode(token), shape_error);
    CHECK_THROWS_WITH(split.prefill(x.topRows(rank == 0 ? 2 : 1)), Catch::Contains("disagree"));
  }
  CHECK(split.sequence_length() == 4);
  CHECK(relative_error(split.decode(x.row(4)), layer.decode(x.row(4), cache)) < 1e-12);
  CHECK(split.sequence_length() == 5);
}

#if KVATTN_TEST_KVCALC
namespace kvcalc_check {

// kvcalc's per-device bytes per token of mechanism `name` (one layer).
Index kvcalc_device_bytes(std::vector<std::string> args, const std::string& name) {
  args.push_back("--json");
  std::ostringstream out, err;
  kvcalc::Io io;
  io.out = &out;
  io.err = &err;
  const int status = kvcalc::run(args, io);
  INFO(err.str());
  REQUIRE(status == 0);
  const auto j = nlohmann::json::parse(out.str());
  for (const auto& row : j.at("mechanisms")) {
    if (row.at("name") == name) return row.at("per_device").at("bytes_per_token").get<Index>();
  }
  FAIL("kvcalc printed no row " << name);
  return -1;
}

template <class S, class Layer>
Index rank_bytes_per_token(const Layer& layer, Index tokens) {
  mpi::HeadParallel<Layer, S> split(layer, MPI_COMM_WORLD);
  split.prefill(kvattn::test::random_input<float>(tokens, layer.config().d_model, 3));
  return static_cast<Index>(split.shard().bytes()) / tokens;
}

// kvcalc's shape flags every mechanism shares, 12 heads (its --kv-heads must fit --heads
// and --tp even when only MLA or LRKV is printed).
std::vector<std::string> common(const char* dtype, Index kv_heads, int ranks) {
  return {"--layers",   "1",
          "--heads",    "12",
          "--kv-heads", std::to_string(kv_heads),
          "--dtype",    dtype,
          "--tp",       std::to_string(ranks)};
}

template <class S>
void check_all(const char* dtype) {
  const int ranks = kvattn::test::world_size();
  const Index tokens = 7;
  for (const Index kv_heads : {12, 4, 2, 1}) {
    if (kv_heads % ranks != 0 && ranks % kv_heads != 0) continue;
    INFO(dtype << ", ranks " << ranks << ", n_kv " << kv_heads);
    auto config = kvattn::test::mpi_gqa_config(kv_heads, false);
    config.rope = {};
    const auto layer = GqaLayer<float>::random(config, 1);
    auto args = common(dtype, kv_heads, ranks);
    args.insert(args.end(), {"--head-dim", "6", "--d-model", "20", "--mechanism", "GQA"});
    CHECK(rank_bytes_per_token<S>(layer, tokens) == kvcalc_device_bytes(args, "GQA"));
  }
  {
    const MlaConfig config = kvattn::test::mpi_mla_config();
    const auto layer = MlaLayer<float>::random(config, 2);
    auto args = common(dtype, 12, ranks);
    args.insert(args.end(), {"--head-dim", "4", "--d-model", "16", "--kv-rank", "10", "--q-rank",
                             "8", "--rope-dim", "4", "--v-dim", "3", "--mechanism", "MLA"});
    CHECK(rank_bytes_per_token<S>(layer, tokens) == kvcalc_device_bytes(args, "MLA"));
  }
  {
    LrkvConfig config;  // kvcalc's LRKV: no RoPE, no key norm
    config.d_model = 16;
    config.n_heads = 12;
    config.head_dim = 4;
    config.rank = 2;
    const auto layer = LrkvLayer<float>::random(config, 3);
    auto args = common(dtype, 12, ranks);
    args.insert(args.end(),
                {"--head-dim", "4", "--d-model", "16", "--lrkv-rank", "2", "--mechanism", "LRKV"});
    CHECK(rank_bytes_per_token<S>(layer, tokens) == kvcalc_device_bytes(args, "LRKV"));
  }
}

}  // namespace kvcalc_check

TEST_CASE("head-parallel per-rank bytes equal kvcalc --tp", "[mpi][head_parallel][kvcalc]") {
  kvcalc_check::check_all<float>("fp32");
  kvcalc_check::check_all<Eigen::bfloat16>("bf16");
}
#endif  // KVATTN_TEST_KVCALC
