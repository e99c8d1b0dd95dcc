// kvattn_bench_mpi: what context parallelism costs per decode step (docs/distributed.md).
// Run under mpiexec; rank 0 reports.
//
//   mpiexec -n 2 kvattn_bench_mpi [--kvattn_smoke] [Google Benchmark flags]
//
// NAMES (L = tokens of the sequence, spread over the ranks in order: rank r holds
// [r*C, (r+1)*C) with C = L / ranks + 512; P = ranks; mechanisms as kvattn_bench's,
// at d_model 64 so that filling 65536 tokens is quick (the step's attention does not
// depend on d_model): mha (32 heads x 128), gqa (8 KV heads), mla (DeepSeek-V2-Lite's
// attention: 16 heads, d_c 512, d_R 64))
//   mpi_attend/<mech>/L:<L>/ranks:<P>   each rank's attend_states over its own shard,
//       between two barriers: the attention part of a step (the slowest rank's).
//   mpi_merge/<mech>/L:<L>/ranks:<P>    the states' merge alone: the MPI_Reduce of H
//       records (max, sum, d_v accumulator) with the merge operation to rank 0, and the
//       broadcast of the 1 x d output.
//   mpi_decode/<mech>/L:<L>/ranks:<P>   ContextParallel::decode: the whole step (the
//       input's broadcast, the owner's append, every rank's query and attention, the
//       merge, W_O, the output's broadcast). Counters: attend_ms and merge_ms (from the
//       two rows above, same run), merge_frac = merge time / step time, and
//       overhead_frac = (step - attention) / step.
// Every benchmark runs a fixed number of iterations (ranks must stay in step: no rank
// may decide on its own to run one more), timed manually between barriers. The step
// grows the sequence by one token per iteration (64 iterations: 0.1% of L).
// --kvattn_smoke: L = 512, one iteration (a CTest test under mpiexec).
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <chrono>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <string_view>

#include "kvattn/distributed/mpi.hpp"
#include "kvattn/kvattn.hpp"

namespace {

using namespace kvattn;
using Clock = std::chrono::steady_clock;

bool smoke = false;
int world_rank = 0;
int world_size = 1;
// Per benchmark family key (mech, L): the attention and merge times measured first.
std::map<std::string, double> attend_seconds, merge_seconds;

class NullReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

template <class F>
double timed(F&& f) {
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = Clock::now();
  f();
  MPI_Barrier(MPI_COMM_WORLD);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The sequence of L tokens of one mechanism, built once and shared by its three rows.
template <class Layer>
struct Fixture {
  Layer layer;
  std::unique_ptr<mpi::ContextParallel<Layer>> sequence;
  RowMatrix<float> inputs;  // the tokens decoded by mpi_decode, one per iteration

  Fixture(Layer l, Index length) : layer(std::move(l)) {
    const Index capacity = length / world_size + 512;
    sequence = std::make_unique<mpi::ContextParallel<Layer>>(layer, MPI_COMM_WORLD, capacity);
    std::mt19937_64 rng(1);
    const Index d = layer.config().d_model;
    for (Index done = 0; done < length;) {
      const Index n = std::min<Index>(8192, length - done);
      sequence->append(random_normal<float>(n, d, rng));
      done += n;
    }
    inputs = random_normal<float>(1024, d, rng);
  }
};

template <class Layer>
Fixture<Layer>& fixture(const std::string& key, const Layer& layer, Index length) {
  static std::map<std::string, std::unique_ptr<Fixture<Layer>>> fixtures;
  const auto found = fixtures.find(key);
  if (found != fixtures.end()) return *found->second;
  fixtures.clear();  // one sequence per layer type in memory at a time
  auto& made = fixtures[key];
  made = std::make_unique<Fixture<Layer>>(layer, length);
  return *made;
}

template <class Layer>
void register_mechanism(const std::string& mech, const Layer& layer, Index length) {
  const std::string suffix =
      mech + "/L:" + std::to_string(length) + "/ranks:" + std::to_string(world_size);
  const std::string key = suffix;
  const int iterations = smoke ? 1 : 64;
  const Index heads = layer.config().n_heads;

  benchmark::RegisterBenchmark(
      ("mpi_attend/" + suffix).c_str(),
      [=](benchmark::State& state) {
        auto& f = fixture(key, layer, length);
        const Layer& shard_layer = f.sequence->shard_layer();
        auto ws = shard_layer.make_workspace();
        SoftmaxStates<float> states;
        const RowMatrix<float> query = shard_layer.project_query(f.inputs.topRows(1));
        const Index position = f.sequence->sequence_length() - f.sequence->shard_first();
        double total = 0;
        for (auto _ : state) {
          const double s = timed([&] {
            if (f.sequence->shard().tokens() > 0) {
              shard_layer.attend_states(query, position, f.sequence->shard(), states, ws);
            }
          });
          state.SetIterationTime(s);
          total += s;
        }
        attend_seconds[key] = total / static_cast<double>(state.iterations());
      })
      ->Iterations(iterations)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);

  benchmark::RegisterBenchmark(
      ("mpi_merge/" + suffix).c_str(),
      [=](benchmark::State& state) {
        const Index width = layer.heads_width() / heads;
        mpi::detail::StatesReduction<float> reduction(width);
        SoftmaxStates<float> states(heads, width);
        std::mt19937_64 rng(2);
        states.max = random_normal<float>(1, heads, rng);
        states.sum.setOnes();
        states.acc = random_normal<float>(heads, width, rng);
        RowMatrix<float> records(heads, width + 2), merged(heads, width + 2);
        RowMatrix<float> out(1, layer.config().d_model);
        reduction.pack(states, records.data());
        double total = 0;
        for (auto _ : state) {
          const double s = timed([&] {
            reduction.reduce(records.data(), merged.data(), heads, 0, MPI_COMM_WORLD);
            mpi::detail::broadcast(out, 0, MPI_COMM_WORLD);
          });
          state.SetIterationTime(s);
          total += s;
        }
        merge_seconds[key] = total / static_cast<double>(state.iterations());
      })
      ->Iterations(iterations)
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);

  benchmark::RegisterBenchmark(
      ("mpi_decode/" + suffix).c_str(),
      [=](benchmark::State& state) {
        auto& f = fixture(key, layer, length);
        RowMatrix<float> out(1, layer.config().d_model);
        Index i = 0;
        double total = 0;
        for (auto _ : state) {
          const double s =
              timed([&] { f.sequence->decode(f.inputs.row(i++ % f.inputs.rows()), out); });
          state.SetIterationTime(s);
          total += s;
        }
        const double step = total / static_cast<double>(state.iterations());
        state.counters["attend_ms"] = attend_seconds[key] * 1e3;
        state.counters["merge_ms"] = merge_seconds[key] * 1e3;
        state.counters["merge_frac"] = merge_seconds[key] / step;
        state.counters["overhead_frac"] = (step - attend_seconds[key]) / step;
      })
      ->Iterations(iterations)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--kvattn_smoke") {
      smoke = true;
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  argv[argc] = nullptr;
  Eigen::setNbThreads(1);
  benchmark::Initialize(&argc, argv);
  benchmark::AddCustomContext("simd_level", kvattn::simd_level());
  benchmark::AddCustomContext("mpi_ranks", std::to_string(world_size));
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) {
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  const Index length = smoke ? 512 : 65536;
  const Index d = 64;
  register_mechanism("mha", GqaLayer<float>::random(mha_config(d, 32, 128), 11), length);
  register_mechanism("gqa", GqaLayer<float>::random(gqa_config(d, 32, 128, 8), 12), length);
  MlaConfig mla = deepseek_v2_lite_config();
  mla.d_model = d;
  register_mechanism("mla", MlaLayer<float>::random(mla, 13), length);
  if (world_rank == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    NullReporter quiet;
    benchmark::RunSpecifiedBenchmarks(&quiet);
  }
  benchmark::Shutdown();
  MPI_Finalize();
  return 0;
}
