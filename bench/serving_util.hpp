// What the serving benchmarks (bench_serving.cpp, bench_window.cpp) share: their page
// size, the read set of paged caches, and the loop that times one path against others
// in the same run.
#pragma once

#include <array>
#include <cstddef>
#include <functional>
#include <set>
#include <string>

#include "bench_drivers.hpp"

namespace kvb {

/// Tokens per page of the serving benchmarks: the decode tile of the GQA family at
/// d_h = 128 (smoke mode: 16, so that a 64-token cache spans pages).
inline Index page_tokens() { return smoke() ? 16 : 256; }

/// Every page the paged caches `caches` (pointers) hold, each page once (forks share
/// pages).
template <class Pointers>
void add_pages(ReadSet& set, const Pointers& caches) {
  std::set<Index> seen;
  for (const auto* cache : caches) {
    for (const Index page : cache->block_table()) {
      if (seen.insert(page).second) set.add(cache->pool().data(page), cache->pool().page_bytes());
    }
  }
}

/// Pages for `tokens` tokens in all, held by `sequences` caches (each may hold one page
/// it only partly fills, and one more while a step's token is appended).
inline Index pages_for(Index tokens, Index sequences) {
  return tokens / page_tokens() + 2 * sequences + 1;
}

/// Smoke mode only: false (and the benchmark failed) unless `got` equals `want` to
/// kCheckTolerance (relative); `what` names the two paths.
inline bool smoke_check(benchmark::State& state, const std::string& what, const Mat& got,
                        const Mat& want) {
  if (!smoke()) return true;
  const double err = relative_error(got, want);
  if (err <= kCheckTolerance) return true;
  fail(state, what + " differ by " + std::to_string(err) + " (relative)");
  return false;
}

/// The loop of a serving benchmark: each iteration times `timed` (real time), then,
/// untimed, runs each of `untimed` in turn (its time summed into untimed_seconds) and a
/// read pass over `reads` with T threads. Returns the timed steps' seconds summed (0 when
/// no iteration ran).
template <std::size_t N>
double compared_loop(benchmark::State& state, const std::function<void()>& timed,
                     const std::array<std::function<void()>, N>& untimed,
                     std::array<double, N>& untimed_seconds, Limits& limits, const ReadSet& reads,
                     int T) {
  double timed_seconds = 0;
  untimed_seconds.fill(0);
  for (auto _ : state) {
    const auto start = Clock::now();
    timed();
    benchmark::ClobberMemory();
    timed_seconds += seconds_since(start);
    state.PauseTiming();
    for (std::size_t i = 0; i < N; ++i) {
      const auto other = Clock::now();
      untimed[i]();
      benchmark::ClobberMemory();
      untimed_seconds[i] += seconds_since(other);
    }
    limits.read(reads, T);
    state.ResumeTiming();
  }
  return timed_seconds;
}

}  // namespace kvb
