// Kernel-only benchmarks: one decode kernel over a few hot tiles (they stay in L2), so
// its time is its arithmetic and its loads, not the memory stream. They answer "is this
// kernel at its FMA bound?" apart from "does the step overlap it with streaming?" (the
// decode/ rows), the split docs/benchmarks.md § Notes needs for LRKV.
//
// kernel/lrkv_score/<fp32|bf16>            detail::lrkv_score: 32 heads (d_h 128, r 54)
//     against 4 tiles of 16 cached key rows, one call per tile, as LRKV's decode calls it.
// kernel/lrkv_values_shared/<fp32|bf16>    detail::accumulate_rows of the same 32 heads'
//     weights over the tiles' shared value parts (d_h wide, read by every head).
// kernel/lrkv_values_residual/<fp32|bf16>  the same over each head's residual slice (r).
//
// Counters: ns_per_token (the kernel's time per cached row), fma_peak (one thread's FMA
// units, FLOP/s: fma_peak_rate below) and fma_frac (the kernel's FLOP/s over fma_peak:
// 1.0 is the FMA bound).
#include <algorithm>
#include <chrono>
#include <random>
#include <string>
#include <type_traits>
#include <utility>

#include "bench_util.hpp"
#include "kvattn/detail/decode_kernels.hpp"
#include "kvattn/detail/lrkv_kernels.hpp"

namespace kvb {

namespace {

constexpr Index kHeads = 32, kHeadDim = 128, kRank = 54;
constexpr Index kTile = 16;       // LRKV's decode tile
constexpr Index kHotTokens = 64;  // 4 tiles: 475 KB of fp32 key rows, in L2

// FLOP/s of one thread's FMA units: 12 independent chains of packet FMAs (more than
// latency x pipes on the machines we know), nothing loaded; best of 5, measured once.
// flop_ref (a GEMM) reaches about two thirds of it, so a kernel is compared with this.
// Without FMA instructions (no -mfma) pmadd is a multiply and a dependent add, the chains
// wait on latency and this is no bound (docs/bench-method.md).
double fma_peak_rate() {
  static const double rate = [] {
    namespace ei = Eigen::internal;
    using Pk = kvattn::detail::Packet<float>;
    constexpr int kChains = 12;
    const Index steps = smoke() ? 1000 : 2'000'000;
    double best = 0;
    for (int rep = 0; rep < 5; ++rep) {
      Pk chain[kChains];
      for (int k = 0; k < kChains; ++k) chain[k] = ei::pset1<Pk>(1.0f + 1e-3f * k);
      const Pk scale = ei::pset1<Pk>(0.9999f), shift = ei::pset1<Pk>(1e-4f);
      const auto start = std::chrono::steady_clock::now();
      for (Index i = 0; i < steps; ++i) {
        for (int k = 0; k < kChains; ++k) chain[k] = ei::pmadd(chain[k], scale, shift);
      }
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      float sink = 0;
      for (int k = 0; k < kChains; ++k) sink += ei::predux(chain[k]);
      benchmark::DoNotOptimize(sink);
      const double flops = 2.0 * kvattn::detail::packet_size<float> * kChains * steps;
      best = std::max(best, flops / seconds);
    }
    return best;
  }();
  return rate;
}

enum class LrkvKernel { score, values_shared, values_residual };

// Smoke mode (one iteration): what the kernel wrote against plain loops over the same
// rows, so the rows time the arithmetic they name: the score of the last tile, the
// value accumulators summed over the 4 tiles (in order again where they are paired).
void check_lrkv_kernel(benchmark::State& state, LrkvKernel kernel, const Mat& rows,
                       const Mat& query_t, const Mat& query_latent, const Mat& weights,
                       const Mat& logits, const Mat& acc, bool paired) {
  Mat got(kHeads, kernel == LrkvKernel::score ? kTile : kHeadDim + kRank);
  Mat expected = Mat::Zero(got.rows(), got.cols());
  for (Index h = 0; h < kHeads; ++h) {
    if (kernel == LrkvKernel::score) {
      const Index t0 = kHotTokens - kTile;
      for (Index t = 0; t < kTile; ++t) {
        double sum = 0;
        for (Index j = 0; j < kHeadDim; ++j) sum += double(query_t(j, h)) * rows(t0 + t, j);
        for (Index j = 0; j < kRank; ++j) {
          sum += double(query_latent(h, j)) * rows(t0 + t, kHeadDim + h * kRank + j);
        }
        expected(h, t) = static_cast<float>(sum);
        got(h, t) = logits(h, t);
      }
      continue;
    }
    const bool shared = kernel == LrkvKernel::values_shared;
    const Index first = shared ? 0 : kHeadDim, width = shared ? kHeadDim : kRank;
    const Index column = shared ? 0 : kHeadDim + h * kRank;
    for (Index c = 0; c < width; ++c) {
      double sum = 0;
      for (Index t = 0; t < kHotTokens; ++t) {
        sum += double(weights(h, t % kTile)) * rows(t, column + c);
      }
      expected(h, first + c) = static_cast<float>(sum);
    }
    got.row(h) = acc.row(h);
    if (shared && paired) kvattn::detail::from_paired(got.row(h).data(), kHeadDim);
  }
  const double error = relative_error(got, expected);
  if (!(error < 1e-4)) {
    fail(state, "kernel output differs from a plain loop: relative error " + std::to_string(error));
  }
}

template <class S>
void lrkv_kernel(benchmark::State& state, LrkvKernel kernel) {
  constexpr Index P = kvattn::detail::packet_size<float>;
  const Index width = kHeadDim + kHeads * kRank;  // a cached row: [shared | r_1 ... r_H]
  const Index padded = (kHeads + P - 1) / P * P;
  std::mt19937_64 rng(7);
  const Mat rows_f = kvattn::random_normal<float>(kHotTokens, width, rng);
  const kvattn::RowMatrix<S> rows = rows_f.cast<S>();
  Mat query_t = Mat::Zero(kHeadDim, padded);
  query_t.leftCols(kHeads) = kvattn::random_normal<float>(kHeadDim, kHeads, rng);
  const Mat query_latent = kvattn::random_normal<float>(kHeads, kRank, rng);
  Mat weights = kvattn::random_normal<float>(kHeads, kTile, rng).cwiseAbs() * 1e-3f;
  Mat logits = Mat::Zero(kHeads, kTile + P);  // ld kTile + P: lrkv_score writes whole packets
  Mat acc = Mat::Zero(kHeads, kHeadDim + kRank);
  const bool paired = kvattn::detail::paired_rows<float, S>(kHeadDim);

  double flops_per_token = 0;
  switch (kernel) {
    case LrkvKernel::score:
      flops_per_token = 2.0 * kHeads * (kHeadDim + kRank);
      break;
    case LrkvKernel::values_shared:
      flops_per_token = 2.0 * kHeads * kHeadDim;
      break;
    case LrkvKernel::values_residual:
      flops_per_token = 2.0 * kHeads * kRank;
      break;
  }
  const double peak = fma_peak_rate();
  std::chrono::steady_clock::duration elapsed{};
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    for (Index t0 = 0; t0 < kHotTokens; t0 += kTile) {
      const S* tile = rows.data() + t0 * width;
      switch (kernel) {
        case LrkvKernel::score:
          kvattn::detail::lrkv_score(query_t.data(), padded, query_latent.data(), kHeads, kHeadDim,
                                     kRank, tile, width, kTile, logits.data(), logits.cols());
          break;
        case LrkvKernel::values_shared:
          kvattn::detail::accumulate_rows(weights.data(), kTile, kHeads, tile, width, 0, kHeadDim,
                                          kTile, acc.data(), acc.cols(), kTile, nullptr, paired);
          break;
        case LrkvKernel::values_residual:
          kvattn::detail::accumulate_rows(weights.data(), kTile, kHeads, tile + kHeadDim, width,
                                          kRank, kRank, kTile, acc.data() + kHeadDim, acc.cols(),
                                          kTile);
          break;
      }
    }
    benchmark::DoNotOptimize(logits.data());
    benchmark::DoNotOptimize(acc.data());
    benchmark::ClobberMemory();
    elapsed += std::chrono::steady_clock::now() - start;
  }
  if (smoke())
    check_lrkv_kernel(state, kernel, rows.template cast<float>(), query_t, query_latent, weights,
                      logits, acc, paired);
  const double tokens = static_cast<double>(kHotTokens) * static_cast<double>(state.iterations());
  const double seconds = std::chrono::duration<double>(elapsed).count();
  state.counters["ns_per_token"] = seconds / tokens * 1e9;
  state.counters["fma_peak"] = peak;
  state.counters["fma_frac"] = tokens * flops_per_token / seconds / peak;
}

template <class S>
void add_lrkv_kernel(const std::string& name, LrkvKernel kernel) {
  const std::string storage = std::is_same_v<S, float> ? "fp32" : "bf16";
  auto* b =
      benchmark::RegisterBenchmark(("kernel/" + name + "/" + storage).c_str(),
                                   [kernel](benchmark::State& s) { lrkv_kernel<S>(s, kernel); });
  b->UseRealTime()->Unit(benchmark::kNanosecond);
  if (smoke()) b->Iterations(1);
}

}  // namespace

void register_kernels() {
  for (const auto& [name, kernel] :
       {std::pair{"lrkv_score", LrkvKernel::score},
        std::pair{"lrkv_values_shared", LrkvKernel::values_shared},
        std::pair{"lrkv_values_residual", LrkvKernel::values_residual}}) {
    add_lrkv_kernel<float>(name, kernel);
    add_lrkv_kernel<Eigen::bfloat16>(name, kernel);
  }
}

}  // namespace kvb
