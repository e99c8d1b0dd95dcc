// [mpi][context_parallel]: a sequence sharded by token range over 1-4 ranks
// (kvattn/distributed/context_parallel.hpp) gives what one process gives: prefill and
// decode outputs equal a single-process layer over the whole sequence (double, 1e-12),
// for GQA/MHA/MQA, MLA and LRKV, with uneven and empty shards; bad input fails on every
// rank and changes nothing.
#include <algorithm>
#include <catch2/catch.hpp>
#include <limits>
#include <vector>

#include "kvattn/distributed/mpi.hpp"
#include "mpi_cases.hpp"
#include "test_util.hpp"

using namespace kvattn;
using kvattn::test::relative_error;

namespace {

// The whole sequence in one process: prefill of `prompt` tokens, a decode step per
// following token, a second prefill of the rest. Rows stacked.
template <class Layer>
RowMatrix<double> single_process(const Layer& layer, const RowMatrix<double>& x, Index prompt,
                                 Index decoded) {
  auto cache = layer.make_cache();
  RowMatrix<double> out(x.rows(), layer.config().d_model);
  out.topRows(prompt) = layer.prefill(x.topRows(prompt), cache);
  for (Index i = prompt; i < prompt + decoded; ++i) out.row(i) = layer.decode(x.row(i), cache);
  const Index rest = x.rows() - prompt - decoded;
  out.bottomRows(rest) = layer.prefill(x.bottomRows(rest), cache);
  return out;
}

template <class Layer>
void check_context_parallel(const Layer& layer, std::uint64_t seed) {
  const Index prompt = 10, decoded = 6, rest = 5;
  const Index length = prompt + decoded + rest;
  const RowMatrix<double> x =
      kvattn::test::random_input<double>(length, layer.config().d_model, seed);
  const RowMatrix<double> expected = single_process(layer, x, prompt, decoded);
  const int ranks = kvattn::test::world_size();
  // Tight (the last shard short), loose (the last ranks empty), and everything on rank 0.
  for (const Index capacity : {(length + ranks - 1) / ranks, length / ranks + 3, length}) {
    INFO("ranks " << ranks << ", shard capacity " << capacity);
    mpi::ContextParallel<Layer> sharded(layer, MPI_COMM_WORLD, capacity);
    RowMatrix<double> got(length, layer.config().d_model);
    got.topRows(prompt) = sharded.prefill(x.topRows(prompt));
    for (Index i = prompt; i < prompt + decoded; ++i) got.row(i) = sharded.decode(x.row(i));
    got.bottomRows(rest) = sharded.prefill(x.bottomRows(rest));
    CHECK(sharded.sequence_length() == length);
    const Index first = sharded.shard_first();
    CHECK(sharded.shard().tokens() == std::clamp<Index>(length - first, 0, capacity));
    CHECK(relative_error(got.topRows(prompt), expected.topRows(prompt)) < 1e-12);
    CHECK(relative_error(got.middleRows(prompt, decoded), expected.middleRows(prompt, decoded)) <
          1e-12);
    CHECK(relative_error(got.bottomRows(rest), expected.bottomRows(rest)) < 1e-12);
  }
}

}  // namespace

TEST_CASE("context-parallel GQA-family equals one process", "[mpi][context_parallel]") {
  for (const Index kv_heads : {12, 4, 1}) {
    for (const bool sinks : {false, true}) {
      INFO("n_kv " << kv_heads << ", sink logits " << sinks);
      check_context_parallel(
          GqaLayer<double>::random(kvattn::test::mpi_gqa_config(kv_heads, sinks), 3), 4);
    }
  }
}

TEST_CASE("context-parallel MLA equals one process", "[mpi][context_parallel]") {
  check_context_parallel(MlaLayer<double>::random(kvattn::test::mpi_mla_config(), 5), 6);
}

TEST_CASE("context-parallel LRKV equals one process", "[mpi][context_parallel]") {
  check_context_parallel(LrkvLayer<double>::random(kvattn::test::mpi_lrkv_config(), 7), 8);
}

TEST_CASE("context-parallel bf16 shards in float", "[mpi][context_parallel]") {
  const auto layer = GqaLayer<float>::random(kvattn::test::mpi_gqa_config(4, false), 9);
  const RowMatrix<float> x = kvattn::test::random_input<float>(20, layer.config().d_model, 10);
  auto cache = layer.make_cache<Eigen::bfloat16>();
  const RowMatrix<float> expected_prompt = layer.prefill(x.topRows(12), cache);
  const Index ranks = kvattn::test::world_size();
  mpi::ContextParallel<GqaLayer<float>, Eigen::bfloat16> sharded(layer, MPI_COMM_WORLD,
                                                                 (18 + ranks - 1) / ranks);
  CHECK(relative_error(sharded.prefill(x.topRows(12)), expected_prompt) < 1e-5);
  for (Index i = 12; i < 18; ++i) {
    CHECK(relative_error(sharded.decode(x.row(i)), layer.decode(x.row(i), cache)) < 1e-5);
  }
}

TEST_CASE("context-parallel refuses bad input on every rank", "[mpi][context_parallel]") {
  const auto layer = GqaLayer<double>::random(kvattn::test::mpi_gqa_config(4, false), 11);
  const Index d = layer.config().d_model;
  const int ranks = kvattn::test::world_size();
  const int rank = kvattn::test::world_rank();
  CHECK_THROWS_AS(mpi::ContextParallel<GqaLayer<double>>(layer, MPI_COMM_WORLD, 0), config_error);
  auto windowed = layer.config();
  windowed.window = 8;
  CHECK_THROWS_WITH(mpi::ContextParallel<GqaLayer<double>>(GqaLayer<double>::random(windowed, 1),
                                                           MPI_COMM_WORLD, 8),
                    Catch::Contains("window"));

  const RowMatrix<double> x = kvattn::test::random_input<double>(4 * ranks + 2, d, 12);
  mpi::ContextParallel<GqaLayer<double>> sharded(layer, MPI_COMM_WORLD, 4);
  auto cache = layer.make_cache();
  // Past the capacity: length_error everywhere, nothing appended.
  CHECK_THROWS_AS(sharded.prefill(x.topRows(4 * ranks + 1)), length_error);
  CHECK(sharded.sequence_length() == 0);
  CHECK(sharded.shard().tokens() == 0);
  CHECK(relative_error(sharded.prefill(x.topRows(3)), layer.prefill(x.topRows(3), cache)) < 1e-12);
  // The last rank's x of the wrong shape: every rank throws, the sequence is unchanged.
  if (ranks > 1) {
    const RowMatrix<double> token =
        rank == ranks - 1 ? RowMatrix<double>::Zero(1, d + 1) : RowMatrix<double>(x.row(3));
    CHECK_THROWS_AS(sharded.decode(token), shape_error);
    CHECK(sharded.sequence_length() == 3);
    CHECK(sharded.shard().tokens() == (rank == 0 ? 3 : 0));
  }
  // Ranks that disagree on a prompt's length.
  if (ranks > 1) {
    CHECK_THROWS_WITH(sharded.prefill(x.topRows(rank == 0 ? 2 : 1)), Catch::Contains("disagree"));
  }
  CHECK(relative_error(sharded.decode(x.row(3)), layer.decode(x.row(3), cache)) < 1e-12);
  CHECK(sharded.sequence_length() == 4);
}

TEST_CASE("context-parallel append, then decode", "[mpi][context_parallel]") {
  const auto layer = MlaLayer<double>::random(kvattn::test::mpi_mla_config(), 23);
  const RowMatrix<double> x = kvattn::test::random_input<double>(15, layer.config().d_model, 24);
  auto cache = layer.make_cache();
  layer.prefill(x.topRows(12), cache);
  const int ranks = kvattn::test::world_size();
  mpi::ContextParallel<MlaLayer<double>> sharded(layer, MPI_COMM_WORLD, (15 + ranks - 1) / ranks);
  sharded.append(x.topRows(12));
  CHECK(sharded.sequence_length() == 12);
  for (Index i = 12; i < 15; ++i) {
    CHECK(relative_error(sharded.decode(x.row(i)), layer.decode(x.row(i), cache)) < 1e-12);
  }
}

TEST_CASE("context-parallel: a failed append on one rank is taken back on all",
          "[mpi][context_parallel]") {
  // An int8 cache refuses non-finite rows; the infinite token is the second shard's, so
  // with 2+ ranks rank 0's append goes through first and must be taken back.
  const auto layer = GqaLayer<float>::random(kvattn::test::mpi_gqa_config(4, false), 25);
  const int ranks = kvattn::test::world_size();
  mpi::ContextParallel<GqaLayer<float>, Int8<>> sharded(layer, MPI_COMM_WORLD, 4);
  RowMatrix<float> x = kvattn::test::random_input<float>(4 * ranks, layer.config().d_model, 26);
  x(std::min(5, 4 * ranks - 1), 0) = std::numeric_limits<float>::infinity();
  CHECK_THROWS_AS(sharded.prefill(x), value_error);
  CHECK(sharded.sequence_length() == 0);
  CHECK(sharded.shard().tokens() == 0);
  CHECK_THROWS_AS(sharded.append(x), value_error);
  CHECK(sharded.shard().tokens() == 0);
  // The sequence goes on: the same tokens without the infinity.
  x(std::min(5, 4 * ranks - 1), 0) = 0.5f;
  auto cache = layer.make_cache<Int8<>>();
  CHECK(relative_error(sharded.prefill(x), layer.prefill(x, cache)) < 1e-5);
  CHECK(sharded.shard().tokens() == 4);
}
