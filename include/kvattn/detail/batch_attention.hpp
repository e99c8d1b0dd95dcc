// The batched decode driver: one step for B sequences of different lengths, cut into
// units of (sequence or shared prefix) x group x token range, run over the threads, and
// merged exactly into each sequence's rows (core/softmax_states.hpp). The tile loop is
// split_attention.hpp's attend_range, so a unit computes what a single decode computes
// over its range.
//
// A unit reads with the ops of its `source` (the mechanism's choice: say source s < B
// for sequence s's cache and source B for a shared prefix, whose query rows are every
// sequence's rows of the group stacked). Its `rows` partial states are written at state
// slots [slot, slot + rows) and merged into final row
//   target + (j / block) * block_stride + j % block     for unit row j,
// so a sequence's unit maps its rows one to one (block = rows), and a prefix unit sends
// each sequence's block of rows to that sequence's rows.
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "kvattn/core/errors.hpp"
#include "kvattn/core/softmax_states.hpp"
#include "kvattn/core/threads.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/detail/attention_span.hpp"
#include "kvattn/detail/packet_ops.hpp"
#include "kvattn/detail/split_attention.hpp"

namespace kvattn::detail {

struct BatchUnit {
  Index source = 0;  // whose ops read the unit's tokens
  Index group = 0;   // the ops' group
  Index first = 0;   // tokens [first, last)
  Index last = 0;
  Index rows = 0;    // query rows
  Index slot = 0;    // first state slot
  Index target = 0;  // final row of unit row 0
  Index block = 1;   // unit rows per target block (see the header comment)
  Index block_stride = 0;
};

/// The units of one batched step and the scratch they run in. Sized by the layer's
/// prepare (which may allocate); running and merging allocate nothing.
template <class T>
struct BatchScratch {
  std::vector<BatchUnit> units;
  Index slots = 0;    // state slots in use
  Index tile = 1;     // tokens per tile
  Index segment = 0;  // see SplitPlan::segment
  Index width = 0;    // accumulator width
  int threads = 1;
  double softcap = 0.0;      // see SplitPlan::softcap
  const T* sinks = nullptr;  // a sink logit per head (nullptr: none); final row r is head
  Index heads = 1;           //   r % heads
  RowMatrix<T> scores;       // threads*tile_rows(max_rows) x logits stride
  RowVector<T> max, sum;     // slots
  RowMatrix<T> acc;          // slots x width
  Index final_rows = 0;      // output rows, each merged from the units that cover it
  RowVector<T> final_max, final_sum;
  RowMatrix<T> final_acc;

  Index ld() const {
    constexpr Index P = packet_size<T>;
    return (std::max<Index>(tile, 1) + P - 1) / P * P;
  }

  /// Sizes everything for the units now in `units`, `rows` output rows of `width`. Grows
  /// only: a workspace that has seen a batch this large allocates nothing.
  void fit(Index rows, int thread_count) {
    Index most_rows = 1;
    slots = 0;
    for (const auto& u : units) {
      most_rows = std::max(most_rows, u.rows);
      slots = std::max(slots, u.slot + u.rows);
    }
    threads = thread_count;
    grow(scores, Index{thread_count} * tile_rows(most_rows), ld());
    grow(acc, slots, width);
    if (max.cols() < slots) reshape(max, slots);
    if (sum.cols() < slots) reshape(sum, slots);
    final_rows = rows;
    grow(final_acc, rows, width);
    if (final_max.cols() < rows) reshape(final_max, rows);
    if (final_sum.cols() < rows) reshape(final_sum, rows);
  }

 private:
  static void grow(RowMatrix<T>& m, Index rows, Index cols) {
    if (m.rows() < rows || m.cols() != cols) reshape(m, std::max(rows, m.rows()), cols);
  }
};

/// The units of one batched step over `caches` (each about to hold tokens() + 1 tokens)
/// with `groups` groups of `rows` query rows per sequence, appended to `units` from state
/// slot `slot` on. Without a shared prefix, sequence s's group g covers [0, L_s) with
/// final rows (s * groups + g) * rows + j. With one (prefix > 0), a source-B unit per
/// group (and range) covers [0, prefix) for all B sequences' rows of the group stacked,
/// and each sequence's own units cover [prefix, L_s). A range is split only when the
/// units would not keep `threads` threads busy, into pieces of at least four granules
/// (split_granule); a prefix range, which carries every sequence's query rows (B times a
/// sequence unit's arithmetic per token), is also cut into at least 2 x threads pieces
/// of at least four granules, so that with one group (MQA, MLA) it is not one thread's
/// work while the others wait. With a sliding window (span.window > 0; prefix must be 0) a
/// sequence's units cover only the tokens its new token sees: its sink tokens and its window.
/// Allocates only when the unit list outgrows its capacity.
template <class Cache>
void plan_batch_units(std::vector<BatchUnit>& units, Index& slot, std::span<Cache* const> caches,
                      Index prefix, Index groups, Index rows, Index tile, int threads,
                      const AttentionSpan& span = {}) {
  const Index batch = static_cast<Index>(caches.size());
  double total = static_cast<double>(prefix);
  for (const Cache* cache : caches) {
    total +=
        static_cast<double>(visible_tokens(span, cache->sequence_length() + 1).count() - prefix);
  }
  total *= static_cast<double>(groups);
  const Index sources = batch + (prefix > 0 ? 1 : 0);
  const Index granule = split_granule(tile);
  Index chunk = std::numeric_limits<Index>::max();
  if (threads > 1 && sources * groups < 4 * Index{threads}) {
    const Index per_unit = static_cast<Index>(total / (4.0 * threads));
    chunk = std::max<Index>(4 * granule, (per_unit / granule + 1) * granule);
  }
  Index prefix_chunk = chunk;
  if (threads > 1 && prefix > 0) {
    const Index pieces = 2 * Index{threads};
    const Index piece = (prefix + pieces - 1) / pieces;
    prefix_chunk =
        std::min(chunk, std::max<Index>(4 * granule, (piece + granule - 1) / granule * granule));
  }
  auto add = [&](Index source, Index g, Index first, Index end, Index unit_rows, Index target,
                 Index block, Index block_stride) {
    const Index chunk_of_source = source == batch ? prefix_chunk : chunk;
    do {
      const Index last = end - first > chunk_of_source ? first + chunk_of_source : end;
      units.push_back(
          BatchUnit{source, g, first, last, unit_rows, slot, target, block, block_stride});
      slot += unit_rows;
      first = last;
    } while (first < end);
  };
  if (prefix > 0) {
    for (Index g = 0; g < groups; ++g)
      add(batch, g, 0, prefix, batch * rows, g * rows, rows, groups * rows);
  }
  for (Index s = 0; s < batch; ++s) {
    const auto visible =
        visible_tokens(span, caches[static_cast<std::size_t>(s)]->sequence_length() + 1);
    for (Index g = 0; g < groups; ++g) {
      if (visible.sink_end > 0)
        add(s, g, 0, visible.sink_end, rows, (s * groups + g) * rows, rows, 0);
      add(s, g, std::max(prefix, visible.window_begin), visible.length, rows,
          (s * groups + g) * rows, rows, 0);
    }
  }
}

/// The shared prefix of a decode_batch (BatchOptions::shared_prefix), checked: 0 <= prefix
/// <= every cache's tokens (shape_error), and prefix > 0 only for paged caches that hold
/// it in the same pages (config_error otherwise; see PagedCacheBase::shares_prefix).
template <class Cache>
Index checked_shared_prefix(const char* where, std::span<Cache* const> caches, Index prefix) {
  if (prefix == 0) return 0;
  if (prefix < 0) {
    throw shape_error(std::string(where) + ": shared_prefix (" + std::to_string(prefix) +
                      ") must be >= 0");
  }
  if constexpr (!requires(const Cache& c) { c.shares_prefix(c, prefix); }) {
    throw config_error(std::string(where) + ": shared_prefix (" + std::to_string(prefix) +
                       ") needs paged caches (forks of one sequence in one page pool); these "
                       "caches are contiguous");
  } else {
    for (std::size_t s = 0; s < caches.size(); ++s) {
      const Cache& cache = *caches[s];
      if (prefix > cache.sequence_length()) {
        throw shape_error(std::string(where) + ": shared_prefix (" + std::to_string(prefix) +
                          ") exceeds caches[" + std::to_string(s) + "]'s " +
                          std::to_string(cache.sequence_length()) + " tokens");
      }
      if (!cache.shares_prefix(*caches[0], prefix)) {
        throw config_error(std::string(where) + ": caches[" + std::to_string(s) +
                           "] does not hold tokens [0, " + std::to_string(prefix) +
                           ") in the same pages as caches[0] (fork both from one sequence "
                           "that holds the prefix)");
      }
    }
    return prefix;
  }
}

/// Runs every unit (ops_of(source) gives a unit's ops; dynamic schedule, the result of a
/// unit does not depend on the thread that runs it), then merges each unit's states into
/// the final rows (final_max, final_sum, final_acc) in unit order. Never allocates or
/// throws.
template <class T, class OpsOf>
void run_batch(BatchScratch<T>& scratch, const OpsOf& ops_of) {
  const Index count = static_cast<Index>(scratch.units.size());
  const Index ld = scratch.ld();
  const Index width = scratch.width;
  Index most_rows = 1;
  for (const auto& u : scratch.units) most_rows = std::max(most_rows, u.rows);
  auto run_unit = [&](Index k, int thread) {
    const BatchUnit& u = scratch.units[static_cast<std::size_t>(k)];
    T* logits = scratch.scores.data() + Index{thread} * tile_rows(most_rows) * ld;
    attend_range(ops_of(u.source), u.group, u.first, u.last, scratch.tile, scratch.segment,
                 static_cast<T>(scratch.softcap), u.rows, width, logits, ld,
                 scratch.max.data() + u.slot, scratch.sum.data() + u.slot,
                 scratch.acc.data() + u.slot * width);
  };
#ifdef _OPENMP
  // Taken as threads come free: the units differ in length (ragged sequences, prefix
  // units that carry every sequence's rows). Dealt in equal static blocks, as
  // split_attention's equal units are, they lowered two threads' vs_separate by up to
  // 1.6x in decode_batch/ and 2x in decode_shared/ (docs/benchmarks.md, "Threads and
  // streaming").
  if (scratch.threads > 1 && count > 1) {
#pragma omp parallel for num_threads(scratch.threads) schedule(dynamic, 1)
    for (Index k = 0; k < count; ++k) run_unit(k, omp_get_thread_num());
  } else
#endif
  {
    for (Index k = 0; k < count; ++k) run_unit(k, 0);
  }
  scratch.final_max.head(scratch.final_rows).setConstant(-std::numeric_limits<T>::infinity());
  scratch.final_sum.head(scratch.final_rows).setZero();
  scratch.final_acc.topRows(scratch.final_rows).setZero();
  for (const auto& u : scratch.units) {
    for (Index j = 0; j < u.rows; ++j) {
      const Index row = u.target + (j / u.block) * u.block_stride + j % u.block;
      const Index slot = u.slot + j;
      merge_state_row(scratch.max(slot), scratch.sum(slot), scratch.acc.row(slot).data(),
                      scratch.final_max(row), scratch.final_sum(row),
                      scratch.final_acc.row(row).data(), width);
    }
  }
}

/// Final row r's normalized attention into out + r * width (rows without keys: zeros),
/// with the head's sink logit folded in once (scratch.sinks).
template <class T>
void finish_batch(BatchScratch<T>& scratch, T* out) {
  for (Index r = 0; r < scratch.final_rows; ++r) {
    if (scratch.sinks != nullptr) {
      add_sink_logit(scratch.sinks[r % scratch.heads], scratch.final_max(r), scratch.final_sum(r),
                     scratch.final_acc.row(r).data(), scratch.width);
    }
    finish_state_row(scratch.final_max(r), scratch.final_sum(r), scratch.final_acc.row(r).data(),
                     out + r * scratch.width, scratch.width);
  }
}

}  // namespace kvattn::detail
