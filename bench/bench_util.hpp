// Shared helpers of kvattn_bench: the run mode, registration, the limits every
// benchmark measures next to its kernel (a read-only pass over the step's bytes and a
// dense GEMM), the counters, cache rotation, and the record of naive baseline times.
// Layers are used through the kvattn::AttentionLayer concept (bench_drivers.hpp).
// bench/main.cpp documents every benchmark name and counter.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <kvattn/kvattn.hpp>

namespace kvb {

using kvattn::Index;
using Mat = kvattn::RowMatrix<float>;
using Row = kvattn::RowVector<float>;

// ---- Run mode and threads -------------------------------------------------------

/// --kvattn_smoke: every family at a tiny L, one iteration, no rotation; the
/// factored steps are checked against the expanded references.
bool smoke();
void set_smoke(bool on);
/// The tiny sequence length of smoke mode.
inline constexpr Index kSmokeLength = 64;

/// "All cores": omp_get_max_threads() with OpenMP (what kvattn::Threads::all()
/// resolves to), else 1.
int all_threads();
/// {1, all_threads()}, or {1} when there is one.
std::vector<int> thread_counts();

// ---- Registration ------------------------------------------------------------------

using Body = std::function<void(benchmark::State&)>;

/// Registers `name` (e.g. "decode/mha") with ArgNames {"L", "T"} for every L x T, in
/// real time and microseconds. In smoke mode: one L (kSmokeLength), Iterations(1).
void add(const std::string& name, Body body, const std::vector<Index>& lengths,
         const std::vector<int>& threads);

// Registration functions, one per file (called by main in this order).
void register_gqa();
void register_mla();
void register_lrkv();
void register_prefill();
void register_serving();
void register_window();
void register_kernels();

// ---- Limits: read-only pass and dense GEMM -------------------------------------------

/// A set of byte ranges a step must read (cache blocks, weights).
class ReadSet {
 public:
  void add(const void* data, std::size_t bytes) {
    if (bytes == 0) return;
    spans_.push_back({static_cast<const unsigned char*>(data), bytes});
    bytes_ += bytes;
  }
  /// A whole dense matrix or map (contiguous: outer stride == inner size).
  template <class Derived>
  void add_dense(const Eigen::DenseBase<Derived>& m) {
    add(m.derived().data(), static_cast<std::size_t>(m.size()) * sizeof(typename Derived::Scalar));
  }
  double bytes() const { return static_cast<double>(bytes_); }
  std::size_t size_bytes() const { return bytes_; }

  struct Span {
    const unsigned char* data;
    std::size_t bytes;
  };
  const std::vector<Span>& spans() const { return spans_; }

 private:
  std::vector<Span> spans_;
  std::size_t bytes_ = 0;
};

/// One read-only vectorized pass over every byte of `set` with `threads` threads
/// (the bytes split evenly, OpenMP); returns its wall time in seconds.
double read_pass(const ReadSet& set, int threads);

/// flop_ref: the best FLOP/s of a dense float GEMM (1024^3, 128^3 in smoke mode) with
/// `threads` threads, each multiplying its own row block with Eigen, seen so far in this
/// run: measures best-of-5 now and returns the maximum over this and every earlier
/// measurement (calibrate_gemm's included). The best, because on a shared machine a
/// single measurement is often preempted: the attainable rate is the fastest one seen.
double gemm_flop_rate(int threads);
/// Best-of-20 GEMM measurements for every thread count, once before the benchmarks.
void calibrate_gemm();

/// The read passes of one benchmark, interleaved with its timed steps.
class Limits {
 public:
  void read(const ReadSet& set, int threads) {
    seconds_ += read_pass(set, threads);
    bytes_ += set.bytes();
  }
  double bandwidth() const { return seconds_ > 0 ? bytes_ / seconds_ : 0.0; }

 private:
  double seconds_ = 0;
  double bytes_ = 0;
};

/// What one step must do: bytes read (cache + weights), of those the cache bytes,
/// and FLOPs.
struct Cost {
  double bytes = 0;
  double cache_bytes = 0;
  double flops = 0;
  // The analysis module's prediction of the step (attend_cost), when there is one:
  // report() turns it into predicted_seconds with this run's bw_ref and flop_ref.
  double predicted_bytes = 0;
  double predicted_flops = 0;
};

/// Sets bytes_per_second, bytes, cache_bytes, flops, bw_ref, flop_ref, roofline_frac
/// and (with a prediction) predicted_seconds (measuring flop_ref now, with `threads`), and the
/// label "bound:memory" or "bound:compute". Returns the roofline time of one step,
/// max(bytes / bw_ref, flops / flop_ref), in seconds.
double report(benchmark::State& state, const Cost& cost, const Limits& limits, int threads);

// ---- Cache rotation -------------------------------------------------------------------

/// How many copies of a step's data (cache and the weights it reads) to rotate over
/// so that their sum is at least 96 MiB, three times the 32 MiB L3: each step then
/// reads data that was evicted since it was last used, as a layer of a deep model
/// would. 1 in smoke mode; at most 256.
int rotation_count(double slot_bytes);

/// rotation_count for a loop whose reads take the slots in turn, `reads` per iteration
/// (decode/: the step, the read pass, the naive step): rounded up to a count prime to
/// `reads`, so that every read visits every slot. With a multiple of `reads`, each read
/// would keep to its own slots (two per iteration over 2 slots: the steps all on one, the
/// read passes all on the other), and buffers differ in read bandwidth on this VM: four
/// 128 MiB buffers read in turn, 11 passes each, had medians of 25-37 GB/s, in the same
/// order in two runs.
int rotation_count(double slot_bytes, int reads);

/// The rotation slot whose read pass follows step `iteration`: half the rotation away
/// from the slots the neighbouring steps use, so neither the read pass nor the next
/// step finds its data in L3 (the same slot when there is only one).
inline int read_slot(Index iteration, int slots) {
  return static_cast<int>((iteration + slots / 2) % slots);
}

// ---- Failures -------------------------------------------------------------------------

/// A failed check (smoke mode compares against the references): SkipWithError, and
/// main() then exits with 1.
void fail(benchmark::State& state, const std::string& message);
bool any_failure();

/// max |a - b| / max |b|.
double relative_error(const Mat& a, const Mat& b);

// ---- Layers: built once per run, shared by the benchmarks -------------------------------

/// The layer registered under `key`, built by make() the first time. Layers stay alive
/// for the whole run (about 1.4 GB for all six shapes), so each is built once.
std::shared_ptr<const void>& layer_slot(const std::string& key);

template <class Layer, class Make>
std::shared_ptr<const Layer> shared_layer(const std::string& key, Make make) {
  auto& slot = layer_slot(key);
  if (!slot) slot = std::make_shared<const Layer>(make());
  return std::static_pointer_cast<const Layer>(slot);
}

// ---- Rows measured against each other in one run (vs_bf16) ------------------------------

/// One row's mean time per step and roofline time per step (report's return value).
struct StepRecord {
  double seconds = 0;
  double roofline_seconds = 0;
};
/// Keeps the latest repetition of row `name` ("decode_bf16/mha/L:65536/T:1").
void record_step(const std::string& name, const StepRecord& record);
/// The record of row `name` from earlier in this run; seconds == 0 when it has not run.
StepRecord recorded_step(const std::string& name);

}  // namespace kvb
