// Serving benchmarks (docs/serving.md): decode over a paged cache against the same rows
// in a contiguous cache (decode_paged/), batched ragged decode against one decode call
// per sequence (decode_batch/), and 16 sequences sharing a prompt prefix decoded with the
// prefix read once (decode_shared/). bench/main.cpp documents the names and counters.
#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "bench_drivers.hpp"
#include "mech_gqa.hpp"
#include "mech_lrkv.hpp"
#include "mech_mla.hpp"
#include "serving_util.hpp"

namespace kvb {
namespace {

/// The ragged lengths of decode_batch/<mech>/B:<B>: spread evenly from 1,024 tokens to
/// 2 x 65,536 / B - 1,024, so that every B holds 65,536 tokens in all (B = 1: 65,536;
/// B = 4: 1,024 ... 31,744). Smoke mode: 16 ... 64.
std::vector<Index> ragged_lengths(Index batch) {
  if (smoke()) {
    std::vector<Index> lengths;
    for (Index s = 0; s < batch; ++s)
      lengths.push_back(16 + 48 * s / std::max<Index>(1, batch - 1));
    return lengths;
  }
  const Index total = 65536, shortest = 1024;
  if (batch == 1) return {total};
  const Index longest = 2 * total / batch - shortest;
  std::vector<Index> lengths;
  for (Index s = 0; s < batch; ++s)
    lengths.push_back(shortest + (longest - shortest) * s / (batch - 1));
  return lengths;
}

/// decode_paged/<mech>/L:<L>/T:<T>: layer.attend over a paged cache (pages of
/// page_tokens()) of L tokens; after each timed step, untimed, the same attend over a
/// contiguous cache with the same rows, then a read pass over the paged cache's pages
/// (each step finds the other cache's data, >= 64 MiB, in between). vs_contiguous:
/// contiguous time per step / paged time per step (>= 0.95: paging costs at most 5%).
template <class M>
void run_decode_paged(benchmark::State& state, const M& mech) {
  const Index L = state.range(0);
  const int T = static_cast<int>(state.range(1));
  const kvattn::Threads threads{T};
  const auto layer = layer_of(mech);
  std::mt19937_64 rng(7);
  const auto rows = mech.make_pool(rng, std::min(L, kPoolRows));
  auto contiguous = layer->template make_cache<float>(L);
  mech.fill(contiguous, L, rows);
  const auto pool = mech.template make_page_pool<float>(page_tokens(), pages_for(L, 1));
  typename M::template PagedCache<float> paged(mech.config, pool);
  mech.fill(paged, L, rows);
  ReadSet reads;
  add_pages(reads, std::array{&paged});
  mech.add_attend_weights(reads, *layer);
  auto workspace = layer->make_workspace(threads);
  const Row query = kvattn::random_normal<float>(1, mech.query_width(), rng);
  Row heads(mech.heads_width()), want(mech.heads_width());

  auto run_paged = [&] { layer->attend(query, paged, heads, workspace, threads); };
  auto run_contiguous = [&] { layer->attend(query, contiguous, want, workspace, threads); };
  run_paged();  // untimed: page faults, the thread team
  run_contiguous();
  if (!smoke_check(state, mech.name + ": attend over the paged and the contiguous cache", heads,
                   want)) {
    return;
  }
  Limits limits;
  std::array<double, 1> contiguous_seconds{};
  const double paged_seconds =
      compared_loop<1>(state, run_paged, {run_contiguous}, contiguous_seconds, limits, reads, T);
  Cost cost;
  cost.bytes = reads.bytes();
  cost.cache_bytes = static_cast<double>(paged.bytes());
  cost.flops = mech.attend_flops(L);
  report(state, cost, limits, T);
  if (paged_seconds > 0)
    state.counters["vs_contiguous"] = benchmark::Counter(contiguous_seconds[0] / paged_seconds);
}

/// decode_batch/<mech>/B:<B>/T:<T>: one layer.decode_batch over B contiguous caches of
/// ragged_lengths(B) tokens (projections, appends, attention, W_O), then each cache
/// truncated back; after each timed step, untimed, B layer.decode calls (one per
/// sequence, the same threads, truncated back), then a read pass over every cache and
/// weight. vs_separate: the B decode calls' time / decode_batch's time.
template <class M>
void run_decode_batch(benchmark::State& state, const M& mech) {
  const Index B = state.range(0);
  const int T = static_cast<int>(state.range(1));
  const kvattn::Threads threads{T};
  const auto layer = layer_of(mech);
  const std::vector<Index> lengths = ragged_lengths(B);
  std::mt19937_64 rng(7);
  const auto rows = mech.make_pool(rng, std::min(lengths.back(), kPoolRows));
  using Cache = typename M::template Cache<float>;
  std::vector<Cache> caches;
  caches.reserve(static_cast<std::size_t>(B));
  std::vector<Cache*> pointers;
  ReadSet reads;
  Cost cost;
  for (const Index L : lengths) {
    caches.push_back(layer->template make_cache<float>(L + 1));
    mech.fill(caches.back(), L, rows);
    pointers.push_back(&caches.back());
    if (!add_cache_checked(state, mech, reads, caches.back())) return;
    cost.flops += mech.layer_flops(L);
  }
  cost.cache_bytes = reads.bytes();
  mech.add_layer_weights(reads, *layer);
  cost.bytes = reads.bytes();
  const Mat x = kvattn::random_normal<float>(B, mech.d_model(), rng);
  Mat out(B, mech.d_model()), single(B, mech.d_model());
  auto workspace = layer->make_workspace(threads);
  const std::span<Cache* const> batch(pointers);

  auto run_batch = [&] {
    layer->decode_batch(x, batch, out, workspace, threads);
    for (Index s = 0; s < B; ++s) caches[static_cast<std::size_t>(s)].truncate(lengths[s]);
  };
  auto run_separate = [&] {
    for (Index s = 0; s < B; ++s) {
      auto& cache = caches[static_cast<std::size_t>(s)];
      layer->decode(x.row(s), cache, single.row(s), workspace, threads);
      cache.truncate(lengths[s]);
    }
  };
  run_batch();  // untimed: page faults, the thread team, the workspace's batch buffers
  run_separate();
  if (!smoke_check(state, mech.name + ": decode_batch and B decode calls", out, single)) return;
  Limits limits;
  std::array<double, 1> separate_seconds{};
  const double batch_seconds =
      compared_loop<1>(state, run_batch, {run_separate}, separate_seconds, limits, reads, T);
  report(state, cost, limits, T);
  if (batch_seconds > 0)
    state.counters["vs_separate"] = benchmark::Counter(separate_seconds[0] / batch_seconds);
}

/// decode_shared/<mech>/B:16/T:<T>: 16 paged sequences forked from one 8,192-token
/// prompt, each holding 512 tokens of its own (smoke mode: 32 + 16 tokens).
/// Timed: decode_batch with shared_prefix = the prompt (read once for all 16). Untimed,
/// after each step: decode_batch without the shared prefix (unshared), and 16 decode
/// calls (separate); then a read pass over every page and weight. Counters: vs_separate
/// and vs_unshared (their times / the shared step's); roofline_ratio, the separate
/// calls' roofline time over the shared step's (max(bytes / bw_ref, flops / flop_ref)
/// of each: what reading the prefix once can gain at most).
template <class M>
void run_decode_shared(benchmark::State& state, const M& mech) {
  const Index B = state.range(0);
  const int T = static_cast<int>(state.range(1));
  const Index prefix = smoke() ? 32 : 8192, own = smoke() ? 16 : 512;
  const kvattn::Threads threads{T};
  const auto layer = layer_of(mech);
  std::mt19937_64 rng(7);
  const auto rows = mech.make_pool(rng, kPoolRows);
  using Paged = typename M::template PagedCache<float>;
  const auto pool =
      mech.template make_page_pool<float>(page_tokens(), pages_for(prefix + B * own, B));
  std::vector<Paged> caches;
  caches.reserve(static_cast<std::size_t>(B));
  {
    Paged prompt(mech.config, pool);
    mech.fill(prompt, prefix, rows);
    for (Index s = 0; s < B; ++s) caches.push_back(prompt);  // forks: the prompt's pages
  }
  std::vector<Paged*> pointers;
  for (auto& cache : caches) {
    // Each sequence's own tokens (the same pool rows in each: values do not change the work).
    mech.fill(cache, prefix + own, rows);
    pointers.push_back(&cache);
  }
  ReadSet reads, weights;
  add_pages(reads, pointers);
  const double cache_bytes = reads.bytes();
  mech.add_layer_weights(weights, *layer);
  for (const auto& span : weights.spans()) reads.add(span.data, span.bytes);
  const Mat x = kvattn::random_normal<float>(B, mech.d_model(), rng);
  Mat out(B, mech.d_model()), unshared(B, mech.d_model()), single(B, mech.d_model());
  auto workspace = layer->make_workspace(threads);
  const std::span<Paged* const> batch(pointers);
  const Index L = prefix + own;
  auto truncate_all = [&] {
    for (auto& cache : caches) cache.truncate(L);
  };
  auto run_shared = [&] {
    layer->decode_batch(x, batch, out, workspace, threads,
                        kvattn::BatchOptions{.shared_prefix = prefix});
    truncate_all();
  };
  auto run_unshared = [&] {
    layer->decode_batch(x, batch, unshared, workspace, threads);
    truncate_all();
  };
  auto run_separate = [&] {
    for (Index s = 0; s < B; ++s) {
      layer->decode(x.row(s), caches[static_cast<std::size_t>(s)], single.row(s), workspace,
                    threads);
    }
    truncate_all();
  };
  run_shared();  // untimed: page faults, the thread team, the workspace
  run_unshared();
  run_separate();
  if (!smoke_check(state, mech.name + ": the shared-prefix decode and B decode calls", out,
                   single) ||
      !smoke_check(state, mech.name + ": decode_batch and B decode calls", unshared, single)) {
    return;
  }
  Limits limits;
  std::array<double, 2> seconds{};  // unshared, separate
  const double shared_seconds =
      compared_loop<2>(state, run_shared, {run_unshared, run_separate}, seconds, limits, reads, T);
  Cost cost;
  cost.bytes = reads.bytes();  // the prefix's pages once, every sequence's own, weights once
  cost.cache_bytes = cache_bytes;
  cost.flops = static_cast<double>(B) * mech.layer_flops(L);
  report(state, cost, limits, T);
  if (shared_seconds <= 0) return;
  state.counters["vs_separate"] = benchmark::Counter(seconds[1] / shared_seconds);
  state.counters["vs_unshared"] = benchmark::Counter(seconds[0] / shared_seconds);
  // The separate calls read every sequence's whole cache and every weight B times.
  const double bw_ref = limits.bandwidth(), flop_ref = gemm_flop_rate(T);
  const double separate_bytes =
      static_cast<double>(B) * (static_cast<double>(caches[0].bytes()) + weights.bytes());
  const auto bound = [&](double bytes) { return std::max(bytes / bw_ref, cost.flops / flop_ref); };
  if (bw_ref > 0 && flop_ref > 0)
    state.counters["roofline_ratio"] =
        benchmark::Counter(bound(separate_bytes) / bound(cost.bytes));
}

/// Registers `name` with ArgNames {"B", "T"} (as add() does with {"L", "T"}).
void add_batch(const std::string& name, Body body, const std::vector<Index>& batches,
               const std::vector<int>& threads) {
  auto* b = benchmark::RegisterBenchmark(name.c_str(), std::move(body));
  b->ArgNames({"B", "T"});
  const std::vector<Index> bs = smoke() ? std::vector<Index>{batches.front()} : batches;
  for (const Index batch : bs) {
    for (const int t : threads) b->Args({static_cast<std::int64_t>(batch), t});
  }
  b->UseRealTime()->Unit(benchmark::kMicrosecond);
  if (smoke()) b->Iterations(1);
}

template <class M>
void add_serving(const M& mech, const std::vector<int>& threads) {
  add(
      "decode_paged/" + mech.name, [mech](benchmark::State& s) { run_decode_paged<M>(s, mech); },
      {65536}, threads);
  add_batch(
      "decode_batch/" + mech.name, [mech](benchmark::State& s) { run_decode_batch<M>(s, mech); },
      smoke() ? std::vector<Index>{3} : std::vector<Index>{1, 4, 16, 64}, threads);
  add_batch(
      "decode_shared/" + mech.name, [mech](benchmark::State& s) { run_decode_shared<M>(s, mech); },
      {16}, threads);
}

}  // namespace

void register_serving() {
  const std::vector<int> threads = thread_counts();
  add_serving(mha_mech(), threads);
  add_serving(gqa_mech(), threads);
  add_serving(mqa_mech(), threads);
  add_serving(mla_mech(), threads);
  add_serving(lrkv_mech(), threads);
}

}  // namespace kvb
