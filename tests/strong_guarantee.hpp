// The strong guarantee under allocation failure, for every call that changes a cache:
// run the call with the 1st, 2nd, ... allocation failing (tests/fault_injection.hpp)
// until a run no longer reaches the failing allocation; after each failure the cache must be
// bitwise as it was (tokens, capacity, bytes, stored rows), and a following decode — with the
// workspace the failed call may have left half-sized — must equal the decode of a cache that never
// saw the failed call. The sweep itself (sweep_every_allocation_failure) takes any subject, e.g.
// a batch of paged caches with their pool (tests/test_strong_guarantee_batch.cpp). Include
// fault_injection.hpp first, then this header.
#pragma once

#include <cstring>
#include <string>
#include <vector>

#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"
#include "test_util.hpp"

namespace kvattn::test {

/// Everything a failed call must leave as it was.
struct CacheState {
  Index tokens = 0;
  Index capacity = 0;
  std::size_t bytes = 0;
  std::size_t capacity_bytes = 0;
  std::vector<unsigned char> rows;  // every stored row's bytes, in order
  bool operator==(const CacheState&) const = default;
};

template <class Rows>
void append_bytes(std::vector<unsigned char>& out, const Rows& rows) {
  for (Index t = 0; t < rows.rows(); ++t) {
    const auto* p = reinterpret_cast<const unsigned char*>(rows.row(t).data());
    out.insert(out.end(), p, p + rows.cols() * sizeof(typename Rows::Scalar));
  }
}

template <class T, class S>
CacheState state_of(const GqaCache<T, S>& cache) {
  CacheState s{cache.tokens(), cache.capacity(), cache.bytes(), cache.capacity_bytes(), {}};
  // The stored rows themselves (a quantized cache's codes and scales included).
  const auto bytes = static_cast<std::size_t>(cache.tokens() * cache.row_stride()) *
                     sizeof(typename GqaCache<T, S>::element_type);
  for (Index g = 0; g < cache.config().n_kv_heads; ++g) {
    for (const void* rows : {static_cast<const void*>(cache.key_row(g, 0)),
                             static_cast<const void*>(cache.value_row(g, 0))}) {
      const auto* p = static_cast<const unsigned char*>(rows);
      s.rows.insert(s.rows.end(), p, p + bytes);
    }
  }
  return s;
}
template <class T, class S>
CacheState state_of(const MlaCache<T, S>& cache) {
  using Cache = MlaCache<T, S>;
  CacheState s{cache.tokens(), cache.capacity(), cache.bytes(), cache.capacity_bytes(), {}};
  const auto tokens = static_cast<std::size_t>(cache.tokens());
  auto add = [&](const void* rows, std::size_t bytes) {
    const auto* p = static_cast<const unsigned char*>(rows);
    s.rows.insert(s.rows.end(), p, p + bytes);
  };
  // Scalar storage: the whole rows [c | k_R]; quantized: the latents' codes and scales,
  // then the bf16 rope keys.
  add(cache.latent_row(0), tokens * static_cast<std::size_t>(cache.latent_stride()) *
                               sizeof(typename Cache::element_type));
  if constexpr (Cache::quantized) {
    add(cache.rope_row(0), tokens * static_cast<std::size_t>(cache.config().rope_dim) *
                               sizeof(typename Cache::rope_storage));
  }
  return s;
}
template <class T, class S>
CacheState state_of(const LrkvCache<T, S>& cache) {
  CacheState s{cache.tokens(), cache.capacity(), cache.bytes(), cache.capacity_bytes(), {}};
  append_bytes(s.rows, cache.shared_keys());
  append_bytes(s.rows, cache.shared_values());
  append_bytes(s.rows, cache.residual_keys());
  append_bytes(s.rows, cache.residual_values());
  append_bytes(s.rows, cache.rope_keys());
  append_bytes(s.rows, cache.key_rms());
  return s;
}

// Paged caches: the rows of every held token, token by token (rows are contiguous only
// within a page).
inline void append_row(std::vector<unsigned char>& out, const void* row, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(row);
  out.insert(out.end(), p, p + bytes);
}
template <class Cache>
CacheState paged_state_of(const Cache& cache, auto add_rows) {
  CacheState s{cache.tokens(), cache.capacity(), cache.bytes(), cache.capacity_bytes(), {}};
  for (Index t = 0; t < cache.sequence_length(); ++t) {
    if (cache.holds(t)) add_rows(s.rows, t);
  }
  return s;
}
template <class T, class S>
CacheState state_of(const PagedGqaCache<T, S>& cache) {
  using Element = typename PagedGqaCache<T, S>::element_type;
  const auto bytes = static_cast<std::size_t>(cache.row_stride()) * sizeof(Element);
  return paged_state_of(cache, [&](std::vector<unsigned char>& out, Index t) {
    for (Index g = 0; g < cache.config().n_kv_heads; ++g) {
      append_row(out, cache.key_row(g, t), bytes);
      append_row(out, cache.value_row(g, t), bytes);
    }
  });
}
template <class T, class S>
CacheState state_of(const PagedMlaCache<T, S>& cache) {
  using Cache = PagedMlaCache<T, S>;
  // Scalar storage: the whole row [c | k_R]; quantized: the latent's codes and scales,
  // then the bf16 rope key.
  return paged_state_of(cache, [&](std::vector<unsigned char>& out, Index t) {
    append_row(
        out, cache.latent_row(t),
        static_cast<std::size_t>(cache.latent_stride()) * sizeof(typename Cache::element_type));
    if constexpr (Cache::quantized) {
      append_row(
          out, cache.rope_row(t),
          static_cast<std::size_t>(cache.config().rope_dim) * sizeof(typename Cache::rope_storage));
    }
  });
}
template <class T, class S>
CacheState state_of(const PagedLrkvCache<T, S>& cache) {
  using Cache = PagedLrkvCache<T, S>;
  using Element = typename Cache::element_type;
  const auto& c = cache.config();
  // Key RMS (key_norm only), whole key and value rows, and a quantized cache's bf16 rope keys.
  return paged_state_of(cache, [&](std::vector<unsigned char>& out, Index t) {
    if (c.key_norm) {
      append_row(out, cache.rms_row(t),
                 static_cast<std::size_t>(c.n_heads) * sizeof(typename Cache::norm_type));
    }
    append_row(out, cache.key_row(t),
               static_cast<std::size_t>(cache.key_row_stride()) * sizeof(Element));
    append_row(out, cache.value_row(t),
               static_cast<std::size_t>(cache.value_row_stride()) * sizeof(Element));
    if constexpr (detail::is_quantized_storage<S>) {
      append_row(out, cache.rope_row(t),
                 static_cast<std::size_t>(c.decoupled_dim()) * sizeof(typename Cache::rope_type));
    }
  });
}

/// The sweep of check_every_allocation_failure, over any subject of a call (a cache, or
/// a batch of caches with their page pool). For n = 1, 2, ...: make() gives a fresh
/// subject as the call finds it (called before arming: copies allocate), call(subject,
/// ws) runs with the n-th allocation failing and a new, unsized Workspace ws; until a
/// run makes fewer than n allocations. After a failure, state(subject) must equal what
/// it was before the call, and follow(subject, ws) — a following call, with the
/// workspace the failed call may have left half-sized, returning its result — must
/// equal `want` (what it gives on a subject that never saw the call). A run that
/// completes must leave state(subject) as a run without any failure does; one that
/// completes although its n-th allocation failed swallowed the failure (a test failure
/// naming the allocation and its form; the sweep goes on to n + 1). A std::bad_alloc
/// that was not the injected one is a failure too. `threads` only labels the messages.
/// Returns the number of runs that threw (the allocations the call makes, less any
/// swallowed).
template <class Workspace, class Make, class State, class Call, class Follow, class Result>
long sweep_every_allocation_failure(const std::string& what, Threads threads, Make make,
                                    State state, Call call, Follow follow, const Result& want) {
  // Succeeded without failures: the state every successful run must reach.
  decltype(state(make())) after;
  {
    auto clean = make();
    Workspace ws;
    call(clean, ws);
    after = state(clean);
  }
  long failures = 0;
  for (long n = 1;; ++n) {
    auto subject = make();  // copies allocate: before arming
    const auto before = state(subject);
    Workspace ws;
    const bool threw = fault::throws_bad_alloc([&] {
      fault::arm(n);
      call(subject, ws);
    });
    fault::disarm();
    const bool injected = fault::injected;
    INFO(what << ", threads " << threads.count << ", allocation " << n << " failing");
    if (!threw) {
      CHECK(state(subject) == after);
      if (!injected) break;  // fewer than n allocations: the sweep is complete
      FAIL_CHECK("allocation " << n << " (" << fault::injected_form.load()
                               << ") failed but the call completed: the failure was swallowed");
      REQUIRE(n < 10000);
      continue;
    }
    CHECK(injected);  // else a real std::bad_alloc, not the one injected
    ++failures;
    CHECK(state(subject) == before);
    CHECK(follow(subject, ws) == want);
    REQUIRE(n < 10000);
  }
  return failures;
}

/// Runs call(cache, workspace) on copies of `start` with the n-th allocation failing,
/// n = 1, 2, ..., until a run makes fewer than n allocations (the countdown is never
/// reached: every allocation of the call has been failed once); checks the guarantee
/// after every failure (state_of: tokens, capacity, bytes, stored rows), and that the
/// final run leaves the cache as a run without any failure does; a following decode
/// must equal the decode of `start`. See sweep_every_allocation_failure. Returns the
/// number of runs that threw (the allocations the call makes, less any swallowed).
template <class Layer, class Cache, class Call>
long check_every_allocation_failure(const std::string& what, const Layer& layer, const Cache& start,
                                    Threads threads, Call call) {
  using T = typename Layer::scalar_type;
  using Workspace = typename Layer::Workspace;
  const Index d = layer.config().d_model;
  const RowMatrix<T> next = random_input<T>(1, d, 99);
  // Untouched: what a following decode gives on a cache that never saw the call.
  RowMatrix<T> want(1, d);
  {
    Cache fresh = start;
    Workspace ws = layer.make_workspace(threads);
    layer.decode(next, fresh, want, ws, threads);
  }
  return sweep_every_allocation_failure<Workspace>(
      what, threads, [&] { return Cache(start); },
      [](const Cache& cache) { return state_of(cache); }, call,
      [&](Cache& cache, Workspace& ws) {
        RowMatrix<T> got(1, d);
        layer.decode(next, cache, got, ws, threads);
        return got;
      },
      want);
}

/// The calls that change a cache (prefill, decode, append, reserve) and attend, each
/// through check_every_allocation_failure, on a cache of 16 tokens that is exactly full
/// (so the next token needs a larger buffer). `rows_of(n)` makes n tokens of raw rows.
template <class S, class Layer, class RowsOf, class Prefill>
void check_layer(const std::string& name, const Layer& layer, Threads threads, RowsOf rows_of,
                 Prefill prefill) {
  using T = typename Layer::scalar_type;
  using Cache = typename Layer::template cache_type<S>;
  using Workspace = typename Layer::Workspace;
  const Index d = layer.config().d_model;
  Cache start = layer.template make_cache<S>();
  start.append(rows_of(16));
  REQUIRE(start.capacity() == start.tokens());
  const RowMatrix<T> x = random_input<T>(5, d, 3);
  const RowMatrix<T> query = random_input<T>(1, layer.query_width(), 4);
  {  // start the OpenMP thread team before anything is armed
    Cache warm = start;
    layer.prefill(x, warm, threads);
  }
  const std::string label = name + " " + detail::storage_name<S>();
  CHECK(check_every_allocation_failure(label + " prefill", layer, start, threads,
                                       [&](Cache& c, Workspace&) { prefill(c, x, threads); }) > 0);
  // The outputs are made before arming, so every allocation counted is the call's own
  // (and "> 0" says the call allocated at all: its workspace starts unsized).
  RowMatrix<T> out(1, d), heads(1, layer.heads_width());
  CHECK(check_every_allocation_failure(
            label + " decode", layer, start, threads,
            [&](Cache& c, Workspace& ws) { layer.decode(x.topRows(1), c, out, ws, threads); }) > 0);
  CHECK(check_every_allocation_failure(
            label + " attend", layer, start, threads,
            [&](Cache& c, Workspace& ws) { layer.attend(query, c, heads, ws, threads); }) > 0);
  const auto rows = rows_of(3);
  CHECK(check_every_allocation_failure(label + " append", layer, start, threads,
                                       [&](Cache& c, Workspace&) { c.append(rows); }) > 0);
  CHECK(check_every_allocation_failure(label + " reserve", layer, start, threads,
                                       [&](Cache& c, Workspace&) { c.reserve(100); }) > 0);
}

}  // namespace kvattn::test
