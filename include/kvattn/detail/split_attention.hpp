// The decode-time attention driver shared by every mechanism: an online softmax over
// tiles of cached rows, split across threads by group and, when there are fewer
// groups than threads, by sequence range (flash-decoding), with the partial softmax
// states merged exactly at the end.
//
// A mechanism supplies the two tile operations (its "ops"):
//   score(group, first, n, logits, buffer)        logits[t * rows + i] = logit of the
//                                                 group's query row i against cached
//                                                 token first + t, t < n
//   accumulate(group, first, n, weights, acc, buffer)
//                                                 acc (rows x acc_width, row-major)
//                                                 += what the weights (same layout
//                                                 as the logits) select
// The driver calls accumulate right after score for the same tile on the same
// thread, so `buffer` (tile x buffer_width scalars of per-thread scratch, e.g. the
// tile converted from a narrower storage type) may carry data from one to the other.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvattn/core/threads.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn::detail {

/// How one decode step is cut into work units (group x sequence split).
struct SplitPlan {
  Index groups = 1;        // independent query groups (KV heads; 1 for MLA / LRKV)
  Index rows = 1;          // query rows per group
  Index acc_width = 0;     // accumulator width per row
  Index length = 0;        // cached tokens
  Index tile = 1;          // tokens per tile
  Index buffer_width = 0;  // per-thread buffer scalars per tile token (0: none)
  Index splits = 1;        // sequence ranges per group
  int threads = 1;         // threads of the parallel region
  // What the scratch is sized for: the most splits and threads this thread count can
  // ever use, whatever the length, so a growing sequence never reallocates.
  Index max_splits = 1;
  int max_threads = 1;

  Index units() const { return groups * splits; }
};

/// Splits the sequence only when groups alone cannot keep every thread busy, and
/// never into ranges shorter than a few tiles (the merge is not free).
inline SplitPlan plan_split(Index groups, Index rows, Index acc_width, Index length, Index tile,
                            Index buffer_width, int threads) {
  SplitPlan plan{groups, rows, acc_width, length, tile, buffer_width, 1, std::max(threads, 1)};
  if (plan.threads > 1 && groups < plan.threads) {
    plan.max_splits = (plan.threads + groups - 1) / groups;
    const Index by_length = std::max<Index>(1, length / (4 * tile));
    plan.splits = std::min(plan.max_splits, by_length);
  }
  plan.max_threads = plan.threads;
  plan.threads = static_cast<int>(std::min<Index>(plan.threads, plan.units()));
  return plan;
}

/// Scratch of the driver; grows to the largest plan seen and is then reused, so a
/// step allocates nothing once it has run at its size.
template <class T>
struct SplitScratch {
  RowMatrix<T> scores;    // threads*rows x tile
  RowMatrix<T> buffer;    // threads*tile x buffer_width
  RowMatrix<T> acc;       // units*rows x acc_width
  RowVector<T> max;       // units*rows   running maximum of each partial softmax
  RowVector<T> sum;       // units*rows   running normalizer
  RowVector<T> tile_max;  // threads*rows  a tile's maximum, then its shift

  void fit(const SplitPlan& p) {
    const Index threads = p.max_threads;
    const Index slots = p.groups * p.max_splits * p.rows;
    grow(scores, threads * p.rows, p.tile);
    grow(buffer, threads * p.tile, p.buffer_width);
    grow(acc, slots, p.acc_width);
    if (max.cols() < slots) reshape(max, slots);
    if (sum.cols() < slots) reshape(sum, slots);
    if (tile_max.cols() < threads * p.rows) reshape(tile_max, threads * p.rows);
  }

 private:
  static void grow(RowMatrix<T>& m, Index rows, Index cols) {
    if (m.rows() < rows || m.cols() != cols) reshape(m, std::max(rows, m.rows()), cols);
  }
};

/// Runs the plan and writes each group's normalized attention (groups*rows x
/// acc_width, row stride acc_width) to `out`. scratch.fit(plan) must have run.
///
/// The ops see a tile's logits token-major: logits[t * rows + i] for token t of the
/// tile and query row i (see decode_kernels.hpp), so the online-softmax update below
/// is vectorized over query rows.
template <class T, class Ops>
void split_attention(const SplitPlan& plan, SplitScratch<T>& scratch, const Ops& ops, T* out) {
  using RowMap = Eigen::Map<RowVector<T>>;
  using TileMap = Eigen::Map<RowMatrix<T>>;
  using AccMap = Eigen::Map<RowMatrix<T>>;
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  constexpr T nan = std::numeric_limits<T>::quiet_NaN();
  const Index rows = plan.rows;
  const Index width = plan.acc_width;
  const Index splits = plan.splits;
  const Index per_split = (plan.length + splits - 1) / splits;

  auto run_unit = [&](Index unit, int thread) {
    const Index group = unit / splits;
    const Index first = std::min(plan.length, (unit % splits) * per_split);
    const Index last = std::min(plan.length, first + per_split);
    T* logits = scratch.scores.data() + thread * rows * plan.tile;
    T* buffer = plan.buffer_width > 0
                    ? scratch.buffer.data() + thread * plan.tile * plan.buffer_width
                    : nullptr;
    RowMap max(scratch.max.data() + unit * rows, rows);
    RowMap sum(scratch.sum.data() + unit * rows, rows);
    AccMap acc(scratch.acc.data() + unit * rows * width, rows, width);
    RowMap tile_max(scratch.tile_max.data() + thread * rows, rows);
    max.setConstant(neg_inf);
    sum.setZero();
    acc.setZero();
    for (Index t0 = first; t0 < last; t0 += plan.tile) {
      const Index n = std::min(plan.tile, last - t0);
      ops.score(group, t0, n, logits, buffer);
      TileMap tile(logits, n, rows);
      tile_max = tile.row(0);
      for (Index t = 1; t < n; ++t) tile_max = tile_max.cwiseMax(tile.row(t));
      for (Index i = 0; i < rows; ++i) {
        const T row_max = tile_max(i);
        // A NaN or +inf logit poisons its query row, as softmax_inplace does: the
        // output shows the bad input instead of dropping it. (cwiseMax may or may
        // not propagate NaN; a NaN it drops reaches the sum through exp below.)
        if (std::isnan(row_max) || row_max == std::numeric_limits<T>::infinity()) {
          sum(i) = nan;
          if (max(i) == neg_inf) max(i) = T(0);
          tile_max(i) = max(i);
          continue;
        }
        const T new_max = std::max(max(i), row_max);
        // tile_max becomes the shift of the tile's exponentials; -inf everywhere so
        // far (nothing visible yet) shifts by 0 and keeps the weights at 0.
        tile_max(i) = (new_max == neg_inf || std::isnan(new_max)) ? T(0) : new_max;
        if (max(i) != neg_inf && new_max != max(i)) acc.row(i) *= std::exp(max(i) - new_max);
        if (max(i) != neg_inf) sum(i) *= std::exp(max(i) - new_max);
        max(i) = new_max;
      }
      tile.array().rowwise() -= tile_max.array();
      tile.array() = tile.array().exp();
      for (Index t = 0; t < n; ++t) sum += tile.row(t);
      ops.accumulate(group, t0, n, logits, acc.data(), buffer);
    }
  };

#ifdef _OPENMP
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
      result.setZero();
      if (total_max == neg_inf) continue;  // no visible key: the zero vector, as softmax
      T denominator = 0;
      for (Index s = 0; s < splits; ++s) {
        const Index slot = (group * splits + s) * rows + i;
        const T m = scratch.max(slot);
        if (m == neg_inf) continue;
        const T weight = std::exp(m - total_max);
        denominator += weight * scratch.sum(slot);
        result += weight * scratch.acc.row(slot);
      }
      result /= denominator;
    }
  }
}

}  // namespace kvattn::detail
