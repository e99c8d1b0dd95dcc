// The benchmark bodies shared by every mechanism: decode (attend), decode_naive (the
// obvious Eigen code over the same cache), decode_expanded (the reference decode
// step), layer_decode and prefill. A mechanism is described
// by a traits struct (mech_gqa.hpp, mech_mla.hpp, mech_lrkv.hpp) with:
//
//   Layer, Cache<S>, Pool, Naive          types (Naive: naive.hpp's baseline)
//   name                                  "mha", "mla", ...
//   has_naive()                           whether Naive computes this configuration
//   block_bytes(L, storage bytes)         the largest block one query head reads (one KV
//                                         group's K and V; MLA's latent rows; LRKV's rows)
//   make_layer()                          the layer (seed 1)
//   d_model(), query_width(), heads_width()
//   make_pool(rng, rows)                  random raw cache rows (kvattn::random_normal)
//   fill(cache, L, pool)                  append L tokens: the pool's rows, cyclically
//   add_cache(set, cache)                 the cache's bytes as a ReadSet
//   add_attend_weights(set, layer)        the weights attend reads (none for GQA)
//   add_layer_weights(set, layer)         every weight decode reads
//   attend_flops(L), expanded_flops(L), layer_flops(L), prefill_flops(layer, L)
//
// Cache rows are a pool of min(L, 1024) random rows appended cyclically: the values do
// not change the work, and filling a 2 GiB cache then costs a memcpy, not 500 M
// normal draws.
#pragma once

#include <algorithm>
#include <chrono>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <kvattn/reference/gqa.hpp>
#include <kvattn/reference/lrkv.hpp>
#include <kvattn/reference/mla.hpp>

#include "bench_util.hpp"
#include "naive.hpp"

namespace kvb {

inline constexpr Index kPoolRows = 1024;

/// Tolerance of the smoke-mode comparison of a factored step with the reference.
inline constexpr double kCheckTolerance = 2e-3;

/// Whether `mech`'s layer uses DecodeArithmetic::bf16_dot (a mechanism with an
/// `arithmetic` member: MLA, the GQA family, LRKV).
template <class M>
bool uses_bf16_dot(const M& mech) {
  if constexpr (requires { mech.arithmetic; }) {
    return mech.arithmetic == kvattn::DecodeArithmetic::bf16_dot;
  }
  return false;
}

/// The smoke check's tolerance for `mech`'s layer: kCheckTolerance, or the accuracy
/// docs/api.md states for DecodeArithmetic::bf16_dot (4 bf16 units, 2^-6).
template <class M>
double check_tolerance(const M& mech) {
  return uses_bf16_dot(mech) ? 1.0 / 64.0 : kCheckTolerance;
}

/// The key of `mech`'s shared layer instance (shared_layer) and of its recorded steps.
template <class M>
std::string layer_key(const M& mech) {
  return uses_bf16_dot(mech) ? mech.name + "/bf16_dot" : mech.name;
}

/// The rotation slots of one benchmark: a layer (a private copy when the step reads
/// its weights, so each slot's weights are cold like another layer's), a cache and the
/// workspace its steps use (made for the benchmark's thread count, so no timed step
/// allocates).
template <class M, class S>
struct Slots {
  using Layer = typename M::Layer;
  using Cache = typename M::template Cache<S>;
  std::vector<std::shared_ptr<const Layer>> layers;
  std::vector<Cache> caches;
  std::vector<typename Layer::Workspace> workspaces;
  std::vector<ReadSet> reads;

  int size() const { return static_cast<int>(caches.size()); }
};

/// n slots with caches of L tokens (capacity `reserve`) filled from `pool`, each with a
/// workspace for T threads.
template <class M, class S>
Slots<M, S> make_slots(const M& mech, const std::shared_ptr<const typename M::Layer>& base, int n,
                       bool copy_layers, Index L, Index reserve, const typename M::Pool& pool,
                       int T) {
  static_assert(kvattn::AttentionLayer<typename M::Layer>,
                "a benchmark mechanism's Layer must model kvattn::AttentionLayer");
  Slots<M, S> slots;
  slots.layers.reserve(static_cast<std::size_t>(n));
  slots.caches.reserve(static_cast<std::size_t>(n));  // no reallocation: spans stay valid
  for (int i = 0; i < n; ++i) {
    slots.layers.push_back(
        i == 0 || !copy_layers ? base : std::make_shared<const typename M::Layer>(*base));
    slots.caches.push_back(slots.layers.back()->template make_cache<S>(reserve));
    mech.fill(slots.caches.back(), L, pool);
    slots.workspaces.push_back(slots.layers.back()->make_workspace(kvattn::Threads{T}));
  }
  return slots;
}

template <class M>
std::shared_ptr<const typename M::Layer> layer_of(const M& mech) {
  return shared_layer<typename M::Layer>(layer_key(mech), [&] { return mech.make_layer(); });
}

/// Adds the cache's buffers to `set`; fails the benchmark (false) unless they cover
/// exactly cache.bytes(), so a change of cache layout cannot silently skew bw_ref.
template <class M, class C>
bool add_cache_checked(benchmark::State& state, const M& mech, ReadSet& set, const C& cache) {
  ReadSet part;
  mech.add_cache(part, cache);
  if (part.size_bytes() != cache.bytes()) {
    fail(state, mech.name + ": the read set covers " + std::to_string(part.size_bytes()) +
                    " bytes of the cache, cache.bytes() is " + std::to_string(cache.bytes()));
    return false;
  }
  for (const auto& span : part.spans()) set.add(span.data, span.bytes);
  return true;
}

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// The naive baseline of a mechanism (naive.hpp) over a set of float slots: picks the
/// faster of its two forms (one untimed step each, after a warm-up step), then runs it.
template <class M>
struct NaiveRunner {
  typename M::Naive naive;
  NaiveForm form = NaiveForm::per_head;

  template <class Slot>
  void choose(const Slot& slots, const Row& query, Row& heads, int T) {
    naive.prepare(*slots.layers[0], slots.caches[0].tokens(), T);
    const int n = slots.size();
    double best = std::numeric_limits<double>::infinity();
    int k = 0;
    naive.run(NaiveForm::per_group, slots.caches[k++ % n], query, heads);  // warm-up
    for (const NaiveForm f : {NaiveForm::per_head, NaiveForm::per_group}) {
      const auto start = Clock::now();
      naive.run(f, slots.caches[k++ % n], query, heads);
      const double t = seconds_since(start);
      if (t < best) best = t, form = f;
    }
  }
  template <class Cache>
  void run(const Cache& cache, const Row& query, Row& heads) {
    naive.run(form, cache, query, heads);
  }
};

/// decode/<mech> (expanded = false): layer.attend over a filled cache of L tokens.
/// decode_expanded/<mech> (expanded = true): reference::decode_step on the same cache.
/// A float decode/ row also gets vs_naive: the naive step (decode_naive's, the faster
/// form) timed after each timed step, over the same iterations.
template <class M, class S>
void run_decode(benchmark::State& state, const M& mech, bool expanded) {
  const Index L = state.range(0);
  const int T = static_cast<int>(state.range(1));
  const kvattn::Threads threads{T};
  const auto base = layer_of(mech);
  ReadSet weights;
  mech.add_attend_weights(weights, *base);
  const auto probe = base->template make_cache<S>();
  using Element = kvattn::detail::storage_element_t<S>;  // scales aside: an estimate
  const double cache_estimate =
      static_cast<double>(L) * static_cast<double>(probe.elements_per_token()) * sizeof(Element);
  // The reads per iteration of the timed loop below: the step, the read pass and, for a
  // float decode/ row with a baseline, the naive step.
  const int reads = std::is_same_v<S, float> && !expanded && mech.has_naive() ? 3 : 2;
  const int n = rotation_count(cache_estimate + weights.bytes(), reads);
  std::mt19937_64 rng(7);
  const auto pool = mech.make_pool(rng, std::min(L, kPoolRows));
  auto slots = make_slots<M, S>(mech, base, n, weights.bytes() > 0, L, L, pool, T);
  for (int i = 0; i < n; ++i) {
    ReadSet set;
    if (!add_cache_checked(state, mech, set, slots.caches[i])) return;
    mech.add_attend_weights(set, *slots.layers[i]);
    slots.reads.push_back(set);
  }
  const Row query = kvattn::random_normal<float>(1, mech.query_width(), rng);
  Row heads(mech.heads_width());

  if (smoke() && !expanded) {
    slots.layers[0]->attend(query, slots.caches[0], heads, slots.workspaces[0], threads);
    const Mat want = kvattn::reference::decode_step(*slots.layers[0], slots.caches[0], query);
    const double err = relative_error(heads, want);
    if (!(err <= check_tolerance(mech))) {
      fail(state, mech.name + ": attend differs from reference::decode_step by " +
                      std::to_string(err) + " (relative)");
      return;
    }
  }

  // One untimed step per slot (page faults, the thread team). The slots are then cold
  // again by the time the timed loop reaches them (the rotation spans >= 96 MiB).
  if (!expanded) {
    for (int i = 0; i < n; ++i) {
      slots.layers[i]->attend(query, slots.caches[i], heads, slots.workspaces[i], threads);
    }
  }

  // vs_naive's baseline, timed inside the loop: one naive step (paused) after every
  // timed step, so both see the same memory bandwidth. Timed in separate benchmarks
  // minutes apart, they did not: this VM's read bandwidth moved between 50 and 110 GB/s
  // within one report run, and vs_naive with it (0.68 at mha L=1024 T=2, 1.03 rerun).
  std::optional<NaiveRunner<M>> naive;
  if constexpr (std::is_same_v<S, float>) {
    if (!expanded && mech.has_naive()) {
      naive.emplace();
      naive->choose(slots, query, heads, T);
    }
  }
  Row naive_heads(mech.heads_width());
  double naive_step_seconds = 0;

  // Every read (the step, the read pass, the naive step) takes the slot read longest
  // ago, so none finds another's data in L3.
  int next_slot = 0;
  auto take_slot = [&] {
    const int k = next_slot;
    next_slot = (next_slot + 1) % n;
    return k;
  };
  Limits limits;
  Index it = 0;
  double step_seconds = 0;
  for (auto _ : state) {
    const int k = take_slot();
    const auto start = Clock::now();
    if (expanded) {
      const Mat out = kvattn::reference::decode_step(*slots.layers[k], slots.caches[k], query);
      benchmark::DoNotOptimize(out.data());
    } else {
      slots.layers[k]->attend(query, slots.caches[k], heads, slots.workspaces[k], threads);
      benchmark::DoNotOptimize(heads.data());
    }
    benchmark::ClobberMemory();
    step_seconds += seconds_since(start);
    state.PauseTiming();
    limits.read(slots.reads[take_slot()], T);
    if constexpr (std::is_same_v<S, float>) {
      if (naive) {
        const auto naive_start = Clock::now();
        naive->run(slots.caches[take_slot()], query, naive_heads);
        benchmark::DoNotOptimize(naive_heads.data());
        benchmark::ClobberMemory();
        naive_step_seconds += seconds_since(naive_start);
      }
    }
    state.ResumeTiming();
    ++it;
  }
  Cost cost;
  cost.bytes = slots.reads[0].bytes();
  cost.cache_bytes = static_cast<double>(slots.caches[0].bytes());
  cost.flops = expanded ? mech.expanded_flops(L) : mech.attend_flops(L);
  if (!expanded) {
    const auto predicted = mech.template analysis_cost<S>(L);
    cost.predicted_bytes = predicted.bytes;
    cost.predicted_flops = predicted.flops;
  }
  const double roofline_seconds = report(state, cost, limits, T);
  state.counters["block_bytes"] = benchmark::Counter(mech.block_bytes(L, sizeof(Element)));
  // A quantized cache against the bf16 one of the same row (decode_bf16/, earlier in the
  // run): vs_bf16 = bf16 time / this time, its goal 0.85 x the ratio of their rooflines.
  // (Keyed by the layer: a decode_bf16dot/ row must not stand in for decode_bf16/'s.)
  const std::string row = layer_key(mech) + "/L:" + std::to_string(L) + "/T:" + std::to_string(T);
  if (!expanded && it > 0) {
    const double per_step = step_seconds / static_cast<double>(it);
    if constexpr (std::is_same_v<S, Eigen::bfloat16>) {
      record_step("decode_bf16/" + row, {per_step, roofline_seconds});
    }
    if constexpr (kvattn::detail::is_quantized_storage<S>) {
      const StepRecord bf16 = recorded_step("decode_bf16/" + row);
      if (bf16.seconds > 0 && roofline_seconds > 0) {
        state.counters["vs_bf16"] = benchmark::Counter(bf16.seconds / per_step);
        state.counters["vs_bf16_goal"] =
            benchmark::Counter(0.85 * bf16.roofline_seconds / roofline_seconds);
      }
    }
  }
  if (naive && it > 0) {
    state.counters["vs_naive"] = benchmark::Counter(naive_step_seconds / step_seconds);
  }
}

/// decode_naive/<mech>: the naive baseline (naive.hpp) over the same float caches,
/// in the faster of its two forms (the label says which), as a row of its own
/// (decode/<mech>'s vs_naive times the same step inside its own loop).
template <class M>
void run_naive(benchmark::State& state, const M& mech) {
  const Index L = state.range(0);
  const int T = static_cast<int>(state.range(1));
  const auto base = layer_of(mech);
  ReadSet weights;
  mech.add_attend_weights(weights, *base);
  const auto probe = base->template make_cache<float>();
  const double cache_estimate =
      static_cast<double>(L) * static_cast<double>(probe.elements_per_token()) * sizeof(float);
  const int n = rotation_count(cache_estimate + weights.bytes());
  std::mt19937_64 rng(7);
  const auto pool = mech.make_pool(rng, std::min(L, kPoolRows));
  auto slots = make_slots<M, float>(mech, base, n, weights.bytes() > 0, L, L, pool, T);
  for (int i = 0; i < n; ++i) {
    ReadSet set;
    if (!add_cache_checked(state, mech, set, slots.caches[i])) return;
    mech.add_attend_weights(set, *slots.layers[i]);
    slots.reads.push_back(set);
  }
  const Row query = kvattn::random_normal<float>(1, mech.query_width(), rng);
  Row heads(mech.heads_width());
  NaiveRunner<M> runner;
  if (smoke()) {
    runner.naive.prepare(*slots.layers[0], L, T);
    const Mat want = kvattn::reference::decode_step(*slots.layers[0], slots.caches[0], query);
    for (const NaiveForm f : {NaiveForm::per_head, NaiveForm::per_group}) {
      runner.naive.run(f, slots.caches[0], query, heads);
      const double err = relative_error(heads, want);
      if (!(err <= kCheckTolerance)) {
        fail(state, mech.name + ": the naive " + to_string(f) +
                        " step differs from reference::decode_step by " + std::to_string(err));
        return;
      }
    }
  }
  runner.choose(slots, query, heads, T);

  Limits limits;
  Index it = 0;
  double step_seconds = 0;
  for (auto _ : state) {
    const int k = static_cast<int>(it % n);
    const auto start = Clock::now();
    runner.run(slots.caches[k], query, heads);
    benchmark::DoNotOptimize(heads.data());
    benchmark::ClobberMemory();
    step_seconds += seconds_since(start);
    state.PauseTiming();
    limits.read(slots.reads[read_slot(it, n)], T);
    state.ResumeTiming();
    ++it;
  }
  Cost cost;
  cost.bytes = slots.reads[0].bytes();
  cost.cache_bytes = static_cast<double>(slots.caches[0].bytes());
  cost.flops = mech.attend_flops(L);
  report(state, cost, limits, T);
  state.counters["block_bytes"] = benchmark::Counter(mech.block_bytes(L, sizeof(float)));
  state.SetLabel(std::string("form:") + to_string(runner.form));
}

/// layer_decode/<mech>: layer.decode(x, cache, out, workspace, threads) (projections,
/// append, attention over L + 1 tokens, W_O) with each slot's own workspace, made for
/// these threads (so the step allocates nothing), then cache.truncate(L).
template <class M, class S>
void run_layer_decode(benchmark::State& state, const M& mech) {
  const Index L = state.range(0);
  const int T = static_cast<int>(state.range(1));
  const kvattn::Threads threads{T};
  const auto base = layer_of(mech);
  ReadSet weights;
  mech.add_layer_weights(weights, *base);
  const auto probe = base->template make_cache<S>();
  const double cache_estimate =
      static_cast<double>(L + 1) * static_cast<double>(probe.elements_per_token()) * sizeof(S);
  const int n = rotation_count(cache_estimate + weights.bytes());
  std::mt19937_64 rng(7);
  const auto pool = mech.make_pool(rng, std::min(L, kPoolRows));
  auto slots = make_slots<M, S>(mech, base, n, true, L, L + 1, pool, T);
  for (int i = 0; i < n; ++i) {
    ReadSet set;
    if (!add_cache_checked(state, mech, set, slots.caches[i])) return;
    mech.add_layer_weights(set, *slots.layers[i]);
    slots.reads.push_back(set);
  }
  const Row x = kvattn::random_normal<float>(1, mech.d_model(), rng);
  Row out(mech.d_model());
  for (int i = 0; i < n; ++i) {  // untimed: page faults, the thread team
    slots.layers[i]->decode(x, slots.caches[i], out, slots.workspaces[i], threads);
    slots.caches[i].truncate(L);
  }
  Limits limits;
  Index it = 0;
  for (auto _ : state) {
    const int k = static_cast<int>(it % n);
    slots.layers[k]->decode(x, slots.caches[k], out, slots.workspaces[k], threads);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
    slots.caches[k].truncate(L);
    state.PauseTiming();
    limits.read(slots.reads[read_slot(it, n)], T);
    state.ResumeTiming();
    ++it;
  }
  Cost cost;
  cost.cache_bytes = static_cast<double>(slots.caches[0].bytes());  // L tokens
  cost.bytes = slots.reads[0].bytes();                              // + every weight
  cost.flops = mech.layer_flops(L);
  report(state, cost, limits, T);
}

/// prefill/<mech>: layer.prefill(x, cache, threads) of L tokens on a cleared cache.
template <class M>
void run_prefill(benchmark::State& state, const M& mech) {
  const Index L = state.range(0);
  const int T = static_cast<int>(state.range(1));
  const auto base = layer_of(mech);
  std::mt19937_64 rng(7);
  const Mat x = kvattn::random_normal<float>(L, mech.d_model(), rng);
  ReadSet weights;
  mech.add_layer_weights(weights, *base);
  const auto probe = base->template make_cache<float>();
  const double cache_estimate =
      static_cast<double>(L) * static_cast<double>(probe.elements_per_token()) * sizeof(float);
  const double x_bytes = static_cast<double>(x.size()) * sizeof(float);
  const int n = rotation_count(cache_estimate + weights.bytes() + x_bytes);
  // Caches are filled once with raw rows (pages touched, spans of L tokens for the
  // read pass), then cleared before every prefill.
  const auto pool = mech.make_pool(rng, std::min(L, kPoolRows));
  auto slots = make_slots<M, float>(mech, base, n, true, L, L, pool, T);
  for (int i = 0; i < n; ++i) {
    ReadSet set;
    set.add_dense(x);
    mech.add_layer_weights(set, *slots.layers[i]);
    if (!add_cache_checked(state, mech, set, slots.caches[i])) return;
    slots.reads.push_back(set);
  }
  Limits limits;
  Index it = 0;
  for (auto _ : state) {
    const int k = static_cast<int>(it % n);
    slots.caches[k].clear();
    const Mat y = slots.layers[k]->prefill(x, slots.caches[k], kvattn::Threads{T});
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
    state.PauseTiming();
    limits.read(slots.reads[read_slot(it, n)], T);
    state.ResumeTiming();
    ++it;
  }
  Cost cost;
  cost.cache_bytes = static_cast<double>(slots.caches[0].bytes());
  cost.bytes = slots.reads[0].bytes();  // x + weights + the cache it writes and reads
  cost.flops = mech.prefill_flops(*base, L);
  report(state, cost, limits, T);
}

// ---- Registration helpers --------------------------------------------------------------

template <class M, class S = float>
void add_decode(const std::string& family, const M& mech, const std::vector<Index>& lengths,
                const std::vector<int>& threads) {
  add(
      family + "/" + mech.name,
      [mech](benchmark::State& state) { run_decode<M, S>(state, mech, false); }, lengths, threads);
}

template <class M>
void add_naive(const M& mech, const std::vector<Index>& lengths, const std::vector<int>& threads) {
  if (!mech.has_naive()) return;
  add(
      "decode_naive/" + mech.name, [mech](benchmark::State& state) { run_naive<M>(state, mech); },
      lengths, threads);
}

template <class M>
void add_expanded(const M& mech, const std::vector<Index>& lengths) {
  // The references run on one thread (kvattn compiles Eigen with EIGEN_DONT_PARALLELIZE).
  add("decode_expanded/" + mech.name,
      [mech](benchmark::State& state) { run_decode<M, float>(state, mech, true); }, lengths, {1});
}

template <class M>
void add_layer_decode(const M& mech, const std::vector<Index>& lengths,
                      const std::vector<int>& threads) {
  add(
      "layer_decode/" + mech.name,
      [mech](benchmark::State& state) { run_layer_decode<M, float>(state, mech); }, lengths,
      threads);
}

template <class M>
void add_prefill(const M& mech, const std::vector<Index>& lengths,
                 const std::vector<int>& threads) {
  add(
      "prefill/" + mech.name, [mech](benchmark::State& state) { run_prefill<M>(state, mech); },
      lengths, threads);
}

/// The decode lengths of the issue: 1024 ... 65536.
inline const std::vector<Index> kDecodeLengths = {1024, 4096, 16384, 65536};

}  // namespace kvb
