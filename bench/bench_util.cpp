// Shared helpers of kvattn_bench (see bench_util.hpp).
#include "bench_util.hpp"

#include <kvattn/analysis/decode_cost.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <thread>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace kvb {

namespace {
bool g_smoke = false;
std::atomic<bool> g_failed{false};
}  // namespace

bool smoke() { return g_smoke; }
void set_smoke(bool on) { g_smoke = on; }

int all_threads() {
#ifdef _OPENMP
  return std::max(1, omp_get_max_threads());
#else
  return 1;
#endif
}

std::vector<int> thread_counts() {
  const int all = all_threads();
  if (all == 1) return {1};
  return {1, all};
}

void add(const std::string& name, Body body, const std::vector<Index>& lengths,
         const std::vector<int>& threads) {
  auto* b = benchmark::RegisterBenchmark(name.c_str(), std::move(body));
  b->ArgNames({"L", "T"});
  const std::vector<Index> ls = smoke() ? std::vector<Index>{kSmokeLength} : lengths;
  for (const Index l : ls) {
    for (const int t : threads) b->Args({static_cast<std::int64_t>(l), t});
  }
  // Real time throughout: multi-threaded steps need it, and one clock for every
  // family keeps them comparable.
  b->UseRealTime()->Unit(benchmark::kMicrosecond);
  if (smoke()) b->Iterations(1);
}

// ---- Read pass -------------------------------------------------------------------------

namespace {

// Sums `n` bytes from p as 32-bit integers (integer adds: no denormal or NaN slow
// paths whatever the bytes hold), four independent accumulators.
std::uint64_t read_bytes(const unsigned char* p, std::size_t n) {
  std::size_t i = 0;
  std::uint64_t total = 0;
#if defined(__AVX512F__)
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 256 <= n; i += 256) {
    a0 = _mm512_add_epi32(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_add_epi32(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_add_epi32(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_add_epi32(a3, _mm512_loadu_si512(p + i + 192));
  }
  const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
  total += static_cast<std::uint32_t>(_mm512_reduce_add_epi32(sum));
#elif defined(__AVX2__)
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 128 <= n; i += 128) {
    a0 = _mm256_add_epi32(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi32(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_add_epi32(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_add_epi32(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  alignas(32) std::uint32_t lanes[8];
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3));
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sum);
  for (const std::uint32_t v : lanes) total += v;
#else
  std::uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  for (; i + 32 <= n; i += 32) {
    std::uint64_t w[4];
    std::memcpy(w, p + i, sizeof(w));
    a0 += w[0];
    a1 += w[1];
    a2 += w[2];
    a3 += w[3];
  }
  total += a0 + a1 + a2 + a3;
#endif
  for (; i < n; ++i) total += p[i];
  return total;
}

// Reads bytes [first, last) of the concatenation of the set's spans.
std::uint64_t read_range(const ReadSet& set, std::size_t first, std::size_t last) {
  std::uint64_t total = 0;
  std::size_t offset = 0;
  for (const auto& span : set.spans()) {
    const std::size_t begin = std::max(first, offset);
    const std::size_t end = std::min(last, offset + span.bytes);
    if (begin < end) total += read_bytes(span.data + (begin - offset), end - begin);
    offset += span.bytes;
    if (offset >= last) break;
  }
  return total;
}

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

double read_pass(const ReadSet& set, int threads) {
  const std::size_t total = set.size_bytes();
  std::uint64_t sum = 0;
  const auto start = Clock::now();
#ifdef _OPENMP
  if (threads > 1) {
#pragma omp parallel num_threads(threads) reduction(+ : sum)
    {
      const auto n = static_cast<std::size_t>(omp_get_num_threads());
      const auto t = static_cast<std::size_t>(omp_get_thread_num());
      // Thread t reads its share of the bytes, boundaries on 64-byte lines.
      const std::size_t first = t == 0 ? 0 : (total / n * t) & ~std::size_t{63};
      const std::size_t last = t + 1 == n ? total : (total / n * (t + 1)) & ~std::size_t{63};
      sum += read_range(set, first, last);
    }
  } else {
    sum = read_range(set, 0, total);
  }
#else
  (void)threads;
  sum = read_range(set, 0, total);
#endif
  const double seconds = seconds_since(start);
  benchmark::DoNotOptimize(sum);
  return seconds;
}

namespace {

// Best-of-`reps` FLOP/s of C = A * B (n x n, float) with `threads` threads.
double measure_gemm(int threads, int reps) {
  const Index n = smoke() ? 128 : 1024;
  const Mat a = Mat::Random(n, n);
  const Mat b = Mat::Random(n, n);
  Mat c(n, n);
  auto multiply = [&] {
#ifdef _OPENMP
    if (threads > 1) {
      // Each thread multiplies its own row block (kvattn builds with
      // EIGEN_DONT_PARALLELIZE, and inside a parallel region Eigen stays serial anyway).
#pragma omp parallel num_threads(threads)
      {
        const Index parts = omp_get_num_threads();
        const Index t = omp_get_thread_num();
        const Index first = n * t / parts;
        const Index last = n * (t + 1) / parts;
        c.middleRows(first, last - first).noalias() = a.middleRows(first, last - first) * b;
      }
      return;
    }
#endif
    c.noalias() = a * b;
  };
  multiply();  // warm-up: page faults, thread team
  double best = std::numeric_limits<double>::infinity();
  for (int rep = 0; rep < reps; ++rep) {
    const auto start = Clock::now();
    multiply();
    best = std::min(best, seconds_since(start));
    benchmark::DoNotOptimize(c.data());
  }
  const double nd = static_cast<double>(n);
  return 2.0 * nd * nd * nd / best;
}

std::map<int, double>& best_gemm_rates() {
  static std::map<int, double> rates;
  return rates;
}

}  // namespace

double gemm_flop_rate(int threads) {
  double& best = best_gemm_rates()[threads];
  best = std::max(best, measure_gemm(threads, 5));
  return best;
}

void calibrate_gemm() {
  for (const int t : thread_counts()) {
    double& best = best_gemm_rates()[t];
    best = std::max(best, measure_gemm(t, smoke() ? 2 : 20));
  }
}

// ---- Counters --------------------------------------------------------------------------

double report(benchmark::State& state, const Cost& cost, const Limits& limits, int threads) {
  using benchmark::Counter;
  const double iterations = static_cast<double>(state.iterations());
  const double bw_ref = limits.bandwidth();
  const double flop_ref = gemm_flop_rate(threads);
  const double memory_seconds = bw_ref > 0 ? cost.bytes / bw_ref : 0.0;
  const double compute_seconds = flop_ref > 0 ? cost.flops / flop_ref : 0.0;
  const double bound_seconds = std::max(memory_seconds, compute_seconds);
  // Rates are divided by the benchmark's (real) time: bytes_per_second = bytes per
  // step / time per step, roofline_frac = bound time per step / time per step.
  state.counters["bytes_per_second"] = Counter(cost.bytes * iterations, Counter::kIsRate);
  state.counters["bytes"] = Counter(cost.bytes);
  state.counters["cache_bytes"] = Counter(cost.cache_bytes);
  state.counters["flops"] = Counter(cost.flops);
  state.counters["bw_ref"] = Counter(bw_ref);
  state.counters["flop_ref"] = Counter(flop_ref);
  state.counters["roofline_frac"] = Counter(bound_seconds * iterations, Counter::kIsRate);
  state.SetLabel(memory_seconds >= compute_seconds ? "bound:memory" : "bound:compute");
  if (cost.predicted_bytes > 0 && bw_ref > 0 && flop_ref > 0) {
    const kvattn::analysis::StepCost predicted{cost.predicted_bytes, cost.predicted_flops};
    state.counters["predicted_seconds"] =
        Counter(kvattn::analysis::roofline_seconds(predicted, {bw_ref, flop_ref}));
  }
  return bound_seconds;
}

int rotation_count(double slot_bytes) {
  if (smoke() || slot_bytes <= 0) return 1;
  constexpr double target = 96.0 * 1024 * 1024;
  return static_cast<int>(std::clamp(std::ceil(target / slot_bytes), 1.0, 256.0));
}

int rotation_count(double slot_bytes, int reads) {
  int n = rotation_count(slot_bytes);
  if (n > 1) {
    while (std::gcd(n, reads) != 1) ++n;
  }
  return n;
}

// ---- Failures --------------------------------------------------------------------------

void fail(benchmark::State& state, const std::string& message) {
  g_failed = true;
  state.SkipWithError(message.c_str());
}

bool any_failure() { return g_failed; }

double relative_error(const Mat& a, const Mat& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) return std::numeric_limits<double>::infinity();
  const double scale = std::max(1e-30, static_cast<double>(b.cwiseAbs().maxCoeff()));
  return static_cast<double>((a - b).cwiseAbs().maxCoeff()) / scale;
}

namespace {
std::map<std::string, StepRecord>& step_records() {
  static std::map<std::string, StepRecord> records;
  return records;
}
}  // namespace

void record_step(const std::string& name, const StepRecord& record) {
  step_records()[name] = record;
}

StepRecord recorded_step(const std::string& name) {
  const auto it = step_records().find(name);
  return it == step_records().end() ? StepRecord{} : it->second;
}

std::shared_ptr<const void>& layer_slot(const std::string& key) {
  static std::map<std::string, std::shared_ptr<const void>> layers;
  return layers[key];
}

}  // namespace kvb
