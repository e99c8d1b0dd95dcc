// Sliding-window decode (docs/serving.md § Windows): decode_window/<mech>/W:<W> attends
// with a window of W tokens over a sequence of L >= W tokens held in a bounded paged
// cache, against global attention over a contiguous cache of W tokens: the cost should
// follow the window, not the sequence. bench/main.cpp documents the names and counters.
#include <array>
#include <random>
#include <string>
#include <vector>

#include "bench_drivers.hpp"
#include "mech_gqa.hpp"
#include "mech_lrkv.hpp"
#include "mech_mla.hpp"
#include "serving_util.hpp"

namespace kvb {
namespace {

/// The window of decode_window/ (smoke mode: 16 of the 64-token smoke sequence).
Index window_tokens() { return smoke() ? 16 : 4096; }

/// decode_window/<mech>/W:<W>/L:<L>/T:<T>: layer.attend with config.window = W over a
/// paged cache (pages of page_tokens()) filled with L tokens, which holds the last W of
/// them (the others' pages are back in the pool). After each timed step, untimed: attend
/// of the global layer over a contiguous cache of W tokens (what decode/<mech>/L:<W>
/// times), then a read pass over the window's pages. vs_decode_W: that global step's
/// time / this step's time (>= 0.9: within 10% of decode at L = W).
template <class M>
void run_decode_window(benchmark::State& state, M mech) {
  const Index L = state.range(0);
  const int T = static_cast<int>(state.range(1));
  const Index W = window_tokens();
  const kvattn::Threads threads{T};
  const auto global = layer_of(mech);
  M windowed = mech;
  windowed.name += "/window";  // layer_of keys its shared layers by name
  windowed.config.window = W;
  const auto layer = layer_of(windowed);
  std::mt19937_64 rng(7);
  const auto rows = mech.make_pool(rng, std::min(W, kPoolRows));
  // The pages of W tokens, plus the ones a fill chunk of kPoolRows needs before the
  // append returns the oldest.
  const auto pool = windowed.template make_page_pool<float>(
      page_tokens(), pages_for(W + std::min(W, kPoolRows), 1));
  typename M::template PagedCache<float> cache(windowed.config, pool);
  mech.fill(cache, L, rows);
  if (cache.tokens() != W || cache.sequence_length() != L) {
    fail(state, mech.name + ": the windowed cache holds " + std::to_string(cache.tokens()) +
                    " of " + std::to_string(cache.sequence_length()) + " tokens, expected " +
                    std::to_string(W) + " of " + std::to_string(L));
    return;
  }
  auto contiguous = global->template make_cache<float>(W);
  mech.fill(contiguous, W, rows);
  ReadSet reads;
  add_pages(reads, std::array{&cache});
  mech.add_attend_weights(reads, *layer);
  auto workspace = layer->make_workspace(threads);
  const Row query = kvattn::random_normal<float>(1, mech.query_width(), rng);
  Row heads(mech.heads_width()), global_heads(mech.heads_width());

  auto run_window = [&] { layer->attend(query, cache, heads, workspace, threads); };
  auto run_global = [&] { global->attend(query, contiguous, global_heads, workspace, threads); };
  run_window();  // untimed: page faults, the thread team
  run_global();
  Limits limits;
  std::array<double, 1> global_seconds{};
  const double window_seconds =
      compared_loop<1>(state, run_window, {run_global}, global_seconds, limits, reads, T);
  Cost cost;
  cost.bytes = reads.bytes();
  cost.cache_bytes = static_cast<double>(cache.bytes());
  cost.flops = mech.attend_flops(W);
  report(state, cost, limits, T);
  if (window_seconds > 0)
    state.counters["vs_decode_W"] = benchmark::Counter(global_seconds[0] / window_seconds);
}

template <class M>
void add_window(const M& mech, const std::vector<int>& threads) {
  add(
      "decode_window/" + mech.name + "/W:" + std::to_string(window_tokens()),
      [mech](benchmark::State& s) { run_decode_window<M>(s, mech); }, {65536}, threads);
}

}  // namespace

void register_window() {
  const std::vector<int> threads = thread_counts();
  add_window(mha_mech(), threads);
  add_window(gqa_mech(), threads);
  add_window(mqa_mech(), threads);
  add_window(mla_mech(), threads);
  add_window(lrkv_mech(), threads);
}

}  // namespace kvb
