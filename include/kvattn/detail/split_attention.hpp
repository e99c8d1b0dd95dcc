// The decode-time attention driver shared by every mechanism: an online softmax over
// tiles of cached rows, split across threads by group and, when there are fewer
// groups than threads, by sequence range (flash-decoding), with the partial softmax
// states merged exactly at the end.
//
// A mechanism supplies the two tile operations (its "ops"):
//   score(group, first, n, logits, ld, spare)   logits[i * ld + t] = logit of the
//                                               group's query row i against cached
//                                               token first + t, t < n
//   accumulate(group, first, n, weights, ld, acc, spare)
//                                               acc (rows x acc_width, row-major)
//                                               += what the weights (same layout
//                                               as the logits) select
// `spare` is (rows + 1) x ld scratch of the calling thread the ops may use as they like
// (a quantized cache's partial logits, scaled weights and block scales).
// Between the two, the tile's softmax runs along each query row's tokens (query-major
// logits), vectorized with the packet exp whatever the number of rows: one row for
// MHA, where the tile is the only thing to vectorize over.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "kvattn/core/threads.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/detail/attention_span.hpp"
#include "kvattn/detail/packet_ops.hpp"

namespace kvattn::detail {

/// How one decode step is cut into work units (group x sequence split).
struct SplitPlan {
  Index groups = 1;        // independent query groups (KV heads; 1 for MLA / LRKV)
  Index rows = 1;          // query rows per group
  Index acc_width = 0;     // accumulator width per row
  Index length = 0;        // cached tokens
  Index tile = 1;          // tokens per tile
  Index buffer_width = 0;  // unused by the current kernels (kept for the ops' contract)
  Index splits = 1;        // sequence ranges per group
  int threads = 1;         // threads of the parallel region
  Index segment = 0;       // rows are contiguous within aligned runs of this many tokens
                           // (a paged cache's page_tokens; 0: the whole cache)
  // The tokens the newest token's query sees (sliding window and sink tokens; all
  // `length` without a window) and the soft-cap of its logits (0: off).
  VisibleTokens visible;
  double softcap = 0.0;
  // What the scratch is sized for: the most splits and threads this thread count can
  // ever use, whatever the length, so a growing sequence never reallocates.
  Index max_splits = 1;
  int max_threads = 1;

  Index units() const { return groups * splits; }
  /// Row stride of a tile's logits: the tile rounded up to whole packets, so the
  /// softmax runs on whole packets (the padding holds -inf).
  template <class T>
  Index logits_stride() const {
    constexpr Index P = packet_size<T>;
    return (std::max<Index>(tile, 1) + P - 1) / P * P;
  }
};

/// The unit of a split range's least length (plan_split) and of a batch unit's
/// (batch_attention.hpp): the tile, but at most 256 tokens, so that a layer whose tiles
/// are long only for the sake of streaming (GQA's 1 MiB tiles) still splits a few
/// thousand tokens across threads.
constexpr Index split_granule(Index tile) { return std::min<Index>(tile, 256); }

/// Sequence ranges per thread when the sequence is split (flash-decoding's
/// over-decomposition), dealt out as one contiguous block of units per thread (see
/// split_attention): 4 measured faster than 1 with two threads (LRKV and MLA), for
/// reasons not found (docs/benchmarks.md, "Threads and streaming").
inline constexpr Index kSplitsPerThread = 4;

/// Splits the visible tokens only when groups alone cannot keep every thread busy, into
/// ranges of at least four granules (the merge is not free), or two where four would
/// leave a thread without a unit: with ranges of four, MQA's step (one group, 256-token
/// granules) ran on one of two threads below 2048 tokens (two threads 0.9-1.2x as fast as
/// one at 1024 and 1536 tokens); with two, 1.4-2.2x (cold caches, a read pass between
/// steps, Zen 5).
inline SplitPlan plan_split(Index groups, Index rows, Index acc_width, Index length, Index tile,
                            Index buffer_width, int threads, const AttentionSpan& span = {}) {
  SplitPlan plan;
  plan.groups = groups;
  plan.rows = rows;
  plan.acc_width = acc_width;
  plan.length = length;
  plan.tile = tile;
  plan.buffer_width = buffer_width;
  plan.threads = std::max(threads, 1);
  plan.visible = visible_tokens(span, length);
  plan.softcap = span.softcap;
  if (plan.threads > 1 && groups < plan.threads) {
    plan.max_splits = kSplitsPerThread * ((plan.threads + groups - 1) / groups);
    const Index count = plan.visible.count();
    Index by_length = count / (4 * split_granule(tile));
    if (groups * by_length < plan.threads) by_length = count / (2 * split_granule(tile));
    plan.splits = std::min(plan.max_splits, std::max<Index>(1, by_length));
    // The units go to the threads in equal blocks (split_attention): a unit count that is
    // not a multiple of the threads would give some threads a whole range more (3 ranges
    // on 2 threads: 2 against 1), so round the splits down to make it one where possible.
    const Index whole = plan.threads / std::gcd(groups, Index{plan.threads});
    if (plan.splits >= whole) plan.splits = plan.splits / whole * whole;
  }
  plan.max_threads = plan.threads;
  plan.threads = static_cast<int>(std::min<Index>(plan.threads, plan.units()));
  return plan;
}

/// Rows of tile scratch one thread needs for `rows` query rows: the logits and the ops'
/// spare rows (see the ops contract above).
constexpr Index tile_rows(Index rows) { return 2 * rows + 1; }

/// Scratch of the driver; grows to the largest plan seen and is then reused, so a
/// step allocates nothing once it has run at its size.
template <class T>
struct SplitScratch {
  RowMatrix<T> scores;  // threads*tile_rows(rows) x logits_stride: logits, then spare
  RowMatrix<T> acc;     // units*rows x acc_width
  RowVector<T> max;     // units*rows   running maximum of each partial softmax
  RowVector<T> sum;     // units*rows   running normalizer

  void fit(const SplitPlan& p) {
    const Index threads = p.max_threads;
    const Index slots = p.groups * p.max_splits * p.rows;
    grow(scores, threads * tile_rows(p.rows), p.logits_stride<T>());
    grow(acc, slots, p.acc_width);
    if (max.cols() < slots) reshape(max, slots);
    if (sum.cols() < slots) reshape(sum, slots);
  }

 private:
  static void grow(RowMatrix<T>& m, Index rows, Index cols) {
    if (m.rows() < rows || m.cols() != cols) reshape(m, std::max(rows, m.rows()), cols);
  }
};

/// Continues the partial softmax state (max, sum: `rows` each; acc: rows x width,
/// row-major) of one group's query rows with tokens [first, last), tile by tile:
/// `ops.score`, the soft-cap (softcap > 0), the tile softmax, `ops.accumulate`. Tiles
/// never cross a multiple of `segment` (0: no limit), so a tile's rows are contiguous in
/// a paged cache. `logits` holds tile_rows(rows) x ld scalars (the logits, then the ops'
/// spare rows).
template <class T, class Ops>
void attend_tiles(const Ops& ops, Index group, Index first, Index last, Index tile, Index segment,
                  T softcap, Index rows, Index width, T* logits, Index ld, T* max, T* sum, T* acc) {
  T* spare = logits + rows * ld;
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  constexpr Index P = packet_size<T>;
  for (Index t0 = first; t0 < last;) {
    Index n = std::min(tile, last - t0);
    if (segment > 0) n = std::min(n, segment - t0 % segment);
    const Index n_pad = (n + P - 1) / P * P;
    ops.score(group, t0, n, logits, ld, spare);
    for (Index i = 0; i < rows; ++i) {
      T* s = logits + i * ld;
      if (softcap > T(0)) cap_logits(s, n, softcap);
      std::fill(s + n, s + n_pad, neg_inf);
      softmax_tile_row(s, n_pad, max[i], sum[i], acc + i * width, width);
    }
    ops.accumulate(group, t0, n, logits, ld, acc, spare);
    t0 += n;
  }
}

/// The partial softmax state of one group's query rows over tokens [first, last) alone
/// (see attend_tiles).
template <class T, class Ops>
void attend_range(const Ops& ops, Index group, Index first, Index last, Index tile, Index segment,
                  T softcap, Index rows, Index width, T* logits, Index ld, T* max, T* sum, T* acc) {
  Eigen::Map<RowVector<T>>(max, rows).setConstant(-std::numeric_limits<T>::infinity());
  Eigen::Map<RowVector<T>>(sum, rows).setZero();
  Eigen::Map<RowMatrix<T>>(acc, rows, width).setZero();
  attend_tiles(ops, group, first, last, tile, segment, softcap, rows, width, logits, ld, max, sum,
               acc);
}

/// Runs the plan and writes each group's normalized attention (groups*rows x
/// acc_width, row stride acc_width) to `out`. `sinks` (or nullptr) holds a sink logit
/// per output row (group * rows + i), folded in once after the splits are merged.
/// `row_max` and `row_sum` (or nullptr) receive each output row's softmax maximum and
/// normalizer (sink included), so that `out` row times its sum is the row's partial
/// softmax state (core/softmax_states.hpp) for a merge with other key sets.
/// scratch.fit(plan) must have run.
template <class T, class Ops>
void split_attention(const SplitPlan& plan, SplitScratch<T>& scratch, const Ops& ops, T* out,
                     const T* sinks = nullptr, T* row_max = nullptr, T* row_sum = nullptr) {
  using RowMap = Eigen::Map<RowVector<T>>;
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  const Index rows = plan.rows;
  const Index width = plan.acc_width;
  const Index splits = plan.splits;
  const VisibleTokens& visible = plan.visible;
  const Index count = visible.count();
  const Index per_split = (count + splits - 1) / splits;
  const Index ld = plan.logits_stride<T>();
  const T softcap = static_cast<T>(plan.softcap);

  // A unit's share of the visible tokens, [v0, v1) in visible order, may cover part of the
  // sink tokens and part of the window: one range of tokens each, one running state.
  auto run_unit = [&](Index unit, int thread) {
    const Index group = unit / splits;
    const Index v0 = std::min(count, (unit % splits) * per_split);
    const Index v1 = std::min(count, v0 + per_split);
    T* logits = scratch.scores.data() + thread * tile_rows(rows) * ld;
    T* max = scratch.max.data() + unit * rows;
    T* sum = scratch.sum.data() + unit * rows;
    T* acc = scratch.acc.data() + unit * rows * width;
    const Index sink_last = std::min(v1, visible.sink_end);
    attend_range(ops, group, v0, std::max(v0, sink_last), plan.tile, plan.segment, softcap, rows,
                 width, logits, ld, max, sum, acc);
    const Index w0 = std::max(v0, visible.sink_end);
    if (w0 < v1) {
      attend_tiles(ops, group, visible.token(w0), visible.token(v1 - 1) + 1, plan.tile,
                   plan.segment, softcap, rows, width, logits, ld, max, sum, acc);
    }
  };

#ifdef _OPENMP
  // One contiguous block of units per thread (static). Taken dynamically instead, as
  // they were from 18d2f89, the same units ran slower with two threads on the AVX-512
  // VM, whole groups and split sequences alike (docs/benchmarks.md, "Threads and
  // streaming"); why was not found. The merge below is in a fixed order either way.
  if (plan.threads > 1) {
    const Index units = plan.units();
#pragma omp parallel for num_threads(plan.threads) schedule(static)
    for (Index unit = 0; unit < units; ++unit) run_unit(unit, omp_get_thread_num());
  } else
#endif
  {
    for (Index unit = 0; unit < plan.units(); ++unit) run_unit(unit, 0);
  }

  // Merge the splits of each group: softmax over the union of their ranges.
  for (Index group = 0; group < plan.groups; ++group) {
    for (Index i = 0; i < rows; ++i) {
      RowMap result(out + (group * rows + i) * width, width);
      T total_max = neg_inf;
      for (Index s = 0; s < splits; ++s) {
        total_max = std::max(total_max, scratch.max((group * splits + s) * rows + i));
      }
      const T sink = sinks != nullptr ? sinks[group * rows + i] : neg_inf;
      total_max = std::max(total_max, sink);
      result.setZero();
      if (row_max != nullptr) {
        row_max[group * rows + i] = total_max;
        row_sum[group * rows + i] = T(0);
      }
      if (total_max == neg_inf) continue;  // no visible key: the zero vector, as softmax
      T denominator = sink != neg_inf ? std::exp(sink - total_max) : T(0);
      for (Index s = 0; s < splits; ++s) {
        const Index slot = (group * splits + s) * rows + i;
        const T m = scratch.max(slot);
        if (m == neg_inf) continue;
        const T weight = std::exp(m - total_max);
        denominator += weight * scratch.sum(slot);
        result += weight * scratch.acc.row(slot);
      }
      result /= denominator;
      if (row_sum != nullptr) row_sum[group * rows + i] = denominator;
    }
  }
}

}  // namespace kvattn::detail
