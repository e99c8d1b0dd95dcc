// docs/distributed.md: context-parallel decode of a sequence whose cache does not fit one
// process's memory budget. Each rank holds at most --rank-budget-mib of cache; the
// sequence's tokens fill rank 0's shard, then rank 1's, and so on
// (kvattn::mpi::ContextParallel). The program restores a long history (append: rows
// only), prefills a prompt after it, decodes new tokens, and prints each rank's shard,
// its bytes, and the tokens per second.
//
//   mpiexec -n 4 ./05_context_parallel [--history N] [--prompt N] [--decode N]
//                                      [--rank-budget-mib M] [--threads T]
//
// On several machines: mpiexec --hostfile hosts -n 8 ./05_context_parallel ... (the
// binary and its libraries at the same path on every host; docs/distributed.md).
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

#include "kvattn/distributed/mpi.hpp"
#include "kvattn/kvattn.hpp"

namespace {

struct Options {
  kvattn::Index history = 6144;  // tokens restored with append
  kvattn::Index prompt = 256;    // tokens prefilled after them
  kvattn::Index decode = 64;     // tokens decoded one by one
  double rank_budget_mib = 2.0;  // cache bytes one rank may hold
  int threads = 1;
};

// false (and a message from rank 0) on an unknown flag or a bad value.
bool parse(int argc, char** argv, Options& o, int rank) {
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    const char* value = i + 1 < argc ? argv[i + 1] : nullptr;
    char* end = nullptr;
    if (value == nullptr) {
      if (rank == 0) std::fprintf(stderr, "%s needs a value\n", flag.c_str());
      return false;
    }
    const double number = std::strtod(value, &end);
    if (end == value || *end != '\0' || number < 0) {
      if (rank == 0) std::fprintf(stderr, "%s: '%s' is not a number >= 0\n", flag.c_str(), value);
      return false;
    }
    if (flag == "--history") {
      o.history = static_cast<kvattn::Index>(number);
    } else if (flag == "--prompt") {
      o.prompt = static_cast<kvattn::Index>(number);
    } else if (flag == "--decode") {
      o.decode = static_cast<kvattn::Index>(number);
    } else if (flag == "--rank-budget-mib") {
      o.rank_budget_mib = number;
    } else if (flag == "--threads") {
      o.threads = static_cast<int>(number);
    } else {
      if (rank == 0) std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return false;
    }
    ++i;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvattn;
  using Clock = std::chrono::steady_clock;
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  Options o;
  if (!parse(argc, argv, o, rank)) {
    MPI_Finalize();
    return 2;
  }
  // 8 query heads of width 64 sharing 2 KV heads: 1 KiB of fp32 cache per token.
  const GqaConfig config = gqa_config(256, 8, 64, 2, {RopeLayout::half_split, 10000.0, 0});
  const auto layer = GqaLayer<float>::random(config, /*seed=*/42);
  const Index bytes_per_token =
      analysis::bytes_per_token_per_layer(config, analysis::storage_of<float>());
  const Index total = o.history + o.prompt + o.decode;
  const Index capacity = static_cast<Index>(o.rank_budget_mib * 1024 * 1024) / bytes_per_token;
  const Index needed = capacity > 0 ? (total + capacity - 1) / capacity : 0;
  if (rank == 0) {
    std::printf(
        "sequence: %lld tokens x %lld B = %.2f MiB of cache; budget %.2f MiB per rank "
        "(%lld tokens): %lld rank(s) needed, %d running\n",
        static_cast<long long>(total), static_cast<long long>(bytes_per_token),
        static_cast<double>(total * bytes_per_token) / (1024.0 * 1024.0), o.rank_budget_mib,
        static_cast<long long>(capacity), static_cast<long long>(needed), ranks);
  }
  if (capacity < 1 || needed > ranks) {
    if (rank == 0) {
      std::printf("does not fit: run with mpiexec -n %lld, or raise --rank-budget-mib\n",
                  static_cast<long long>(needed));
    }
    MPI_Finalize();
    return 1;
  }
  int status = 0;
  try {
    mpi::ContextParallel<GqaLayer<float>> sequence(layer, MPI_COMM_WORLD, capacity,
                                                   Threads{o.threads});
    // The inputs: random rows on rank 0 (only rank 0's are read).
    std::mt19937_64 rng(7);
    const RowMatrix<float> x = random_normal<float>(total, config.d_model, rng);
    auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };

    auto t0 = Clock::now();
    sequence.append(x.topRows(o.history));
    auto t1 = Clock::now();
    const RowMatrix<float> prompt_out = sequence.prefill(x.middleRows(o.history, o.prompt));
    auto t2 = Clock::now();
    RowVector<float> out(config.d_model);
    for (Index i = o.history + o.prompt; i < total; ++i) sequence.decode(x.row(i), out);
    auto t3 = Clock::now();

    // Each rank's shard, printed in rank order.
    for (int r = 0; r < ranks; ++r) {
      if (r == rank) {
        const Index held = sequence.shard().tokens();
        std::printf(
            "rank %d: tokens [%lld, %lld), %lld held, %.2f MiB (budget %.2f MiB)\n", rank,
            static_cast<long long>(sequence.shard_first()),
            static_cast<long long>(sequence.shard_first() + held), static_cast<long long>(held),
            static_cast<double>(sequence.shard().bytes()) / (1024.0 * 1024.0), o.rank_budget_mib);
        std::fflush(stdout);
      }
      MPI_Barrier(MPI_COMM_WORLD);
    }
    if (rank == 0) {
      std::printf("append  %lld tokens: %.3f s\n", static_cast<long long>(o.history),
                  seconds(t1 - t0));
      std::printf("prefill %lld tokens: %.3f s (%.0f tokens/s)\n", static_cast<long long>(o.prompt),
                  seconds(t2 - t1), static_cast<double>(o.prompt) / seconds(t2 - t1));
      std::printf("decode  %lld tokens: %.3f s (%.0f tokens/s), last output norm %.4f\n",
                  static_cast<long long>(o.decode), seconds(t3 - t2),
                  static_cast<double>(o.decode) / seconds(t3 - t2),
                  static_cast<double>(out.norm()));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    status = 1;
  }
  MPI_Finalize();
  return status;
}
