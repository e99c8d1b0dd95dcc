// The benchmark bodies shared by every mechanism: decode (attend), decode_expanded
// (the reference decode step), layer_decode and prefill. A mechanism is described
// by a traits struct (mech_gqa.hpp, mech_mla.hpp, mech_lrkv.hpp) with:
//
//   Layer, Cache<S>, Pool                 types
//   name                                  "mha", "mla", ...
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

#include <memory>
#include <random>
#include <string>
#include <vector>

#include <kvattn/reference/gqa.hpp>
#include <kvattn/reference/lrkv.hpp>
#include <kvattn/reference/mla.hpp>

#include "bench_util.hpp"

namespace kvb {

inline constexpr Index kPoolRows = 1024;

/// Tolerance of the smoke-mode comparison of a factored step with the reference.
inline constexpr double kCheckTolerance = 2e-3;

/// The rotation slots of one benchmark: a layer (a private copy when the step reads
/// its weights, so each slot's weights are cold like another layer's) and a cache.
template <class M, class S>
struct Slots {
  using Layer = typename M::Layer;
  using Cache = typename M::template Cache<S>;
  std::vector<std::shared_ptr<const Layer>> layers;
  std::vector<Cache> caches;
  std::vector<ReadSet> reads;

  int size() const { return static_cast<int>(caches.size()); }
};

/// n slots with caches of L tokens (capacity `reserve`) filled from `pool`.
template <class M, class S>
Slots<M, S> make_slots(const M& mech, const std::shared_ptr<const typename M::Layer>& base, int n,
                       bool copy_layers, Index L, Index reserve, const typename M::Pool& pool) {
  Slots<M, S> slots;
  slots.layers.reserve(static_cast<std::size_t>(n));
  slots.caches.reserve(static_cast<std::size_t>(n));  // no reallocation: spans stay valid
  for (int i = 0; i < n; ++i) {
    slots.layers.push_back(
        i == 0 || !copy_layers ? base : std::make_shared<const typename M::Layer>(*base));
    slots.caches.push_back(slots.layers.back()->template make_cache<S>(reserve));
    mech.fill(slots.caches.back(), L, pool);
  }
  return slots;
}

template <class M>
std::shared_ptr<const typename M::Layer> layer_of(const M& mech) {
  return shared_layer<typename M::Layer>(mech.name, [&] { return mech.make_layer(); });
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

/// decode/<mech> (expanded = false): layer.attend over a filled cache of L tokens.
/// decode_expanded/<mech> (expanded = true): reference::decode_step on the same cache.
template <class M, class S>
void run_decode(benchmark::State& state, const M& mech, bool expanded) {
  using Layer = typename M::Layer;
  using Cache = typename M::template Cache<S>;
  const Index L = state.range(0);
  const int T = static_cast<int>(state.range(1));
  if (!expanded && !HasAttend<Layer, Cache>) {
    skip(state, mech.name + ": this kvattn has no Layer::attend(query, cache, heads, Threads)");
    return;
  }
  const auto base = layer_of(mech);
  ReadSet weights;
  mech.add_attend_weights(weights, *base);
  const auto probe = base->template make_cache<S>();
  const double cache_estimate =
      static_cast<double>(L) * static_cast<double>(probe.elements_per_token()) * sizeof(S);
  const int n = rotation_count(cache_estimate + weights.bytes());
  std::mt19937_64 rng(7);
  const auto pool = mech.make_pool(rng, std::min(L, kPoolRows));
  auto slots = make_slots<M, S>(mech, base, n, weights.bytes() > 0, L, L, pool);
  for (int i = 0; i < n; ++i) {
    ReadSet set;
    if (!add_cache_checked(state, mech, set, slots.caches[i])) return;
    mech.add_attend_weights(set, *slots.layers[i]);
    slots.reads.push_back(set);
  }
  const Row query = kvattn::random_normal<float>(1, mech.query_width(), rng);
  Row heads(mech.heads_width());

  if (smoke() && !expanded) {
    attend(*slots.layers[0], query, slots.caches[0], heads, T);
    const Mat want = kvattn::reference::decode_step(*slots.layers[0], slots.caches[0], query);
    const double err = relative_error(heads, want);
    if (!(err <= kCheckTolerance)) {
      fail(state, mech.name + ": attend differs from reference::decode_step by " +
                      std::to_string(err) + " (relative)");
      return;
    }
  }

  // One untimed step per slot: the cache's workspace is sized (attend allocates nothing
  // after its first call at a thread count). The slots are then cold again by the time
  // the timed loop reaches them (the rotation spans >= 96 MiB).
  if (!expanded) {
    for (int i = 0; i < n; ++i) attend(*slots.layers[i], query, slots.caches[i], heads, T);
  }

  Limits limits;
  Index it = 0;
  for (auto _ : state) {
    const int k = static_cast<int>(it % n);
    if (expanded) {
      const Mat out = kvattn::reference::decode_step(*slots.layers[k], slots.caches[k], query);
      benchmark::DoNotOptimize(out.data());
    } else {
      attend(*slots.layers[k], query, slots.caches[k], heads, T);
      benchmark::DoNotOptimize(heads.data());
    }
    benchmark::ClobberMemory();
    state.PauseTiming();
    limits.read(slots.reads[read_slot(it, n)], T);
    state.ResumeTiming();
    ++it;
  }
  Cost cost;
  cost.bytes = slots.reads[0].bytes();
  cost.cache_bytes = static_cast<double>(slots.caches[0].bytes());
  cost.flops = expanded ? mech.expanded_flops(L) : mech.attend_flops(L);
  report(state, cost, limits, T);
}

/// layer_decode/<mech>: layer.decode(x, cache, out, threads) (projections, append,
/// attention over L + 1 tokens, W_O), then cache.truncate(L).
template <class M, class S>
void run_layer_decode(benchmark::State& state, const M& mech) {
  using Layer = typename M::Layer;
  using Cache = typename M::template Cache<S>;
  const Index L = state.range(0);
  const int T = static_cast<int>(state.range(1));
  if (!can_decode<Layer, Cache>(T)) {
    skip(state, mech.name + ": this kvattn's decode takes no Threads");
    return;
  }
  const auto base = layer_of(mech);
  ReadSet weights;
  mech.add_layer_weights(weights, *base);
  const auto probe = base->template make_cache<S>();
  const double cache_estimate =
      static_cast<double>(L + 1) * static_cast<double>(probe.elements_per_token()) * sizeof(S);
  const int n = rotation_count(cache_estimate + weights.bytes());
  std::mt19937_64 rng(7);
  const auto pool = mech.make_pool(rng, std::min(L, kPoolRows));
  auto slots = make_slots<M, S>(mech, base, n, true, L, L + 1, pool);
  for (int i = 0; i < n; ++i) {
    ReadSet set;
    if (!add_cache_checked(state, mech, set, slots.caches[i])) return;
    mech.add_layer_weights(set, *slots.layers[i]);
    slots.reads.push_back(set);
  }
  const Row x = kvattn::random_normal<float>(1, mech.d_model(), rng);
  Row out(mech.d_model());
  for (int i = 0; i < n; ++i) {  // untimed: sizes each cache's workspace
    decode(*slots.layers[i], x, slots.caches[i], out, T);
    slots.caches[i].truncate(L);
  }
  Limits limits;
  Index it = 0;
  for (auto _ : state) {
    const int k = static_cast<int>(it % n);
    decode(*slots.layers[k], x, slots.caches[k], out, T);
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
  using Layer = typename M::Layer;
  using Cache = typename M::template Cache<float>;
  const Index L = state.range(0);
  const int T = static_cast<int>(state.range(1));
  if (!can_prefill<Layer, Cache>(T)) {
    skip(state, mech.name + ": this kvattn's prefill takes no Threads");
    return;
  }
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
  auto slots = make_slots<M, float>(mech, base, n, true, L, L, pool);
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
    const Mat y = prefill(*slots.layers[k], x, slots.caches[k], T);
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
