// Causal attention with an online softmax over key tiles (FlashAttention), the prefill
// driver shared by every mechanism's fast path, as split_attention.hpp is for decode.
//
// A mechanism supplies two tile operations (its "ops"), for query rows of one unit
// (a head, or a head's query tile) against cached-token keys:
//   score(q0, nq, k0, nk, scores, stride, buffer)
//       scores[i * stride + j] = the scaled logit of query q0 + i against key k0 + j
//   accumulate(q0, nq, k0, nk, weights, stride, acc, acc_stride, buffer)
//       acc row i (+)= sum_j weights[i * stride + j] * value of key k0 + j
// `buffer` is tile x buffer_width scalars of scratch the driver owns (say, key rows
// widened from a narrower storage type); score and accumulate of one tile run back to
// back on one thread. Key tiles never straddle `split`: keys before it may live in the
// cache and keys after it in the new rows of a prefill that is not appended yet.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvattn/core/types.hpp"
#include "kvattn/detail/attention_span.hpp"
#include "kvattn/detail/packet_ops.hpp"

namespace kvattn::detail {

/// Rows of queries and keys per tile.
inline constexpr Index kPrefillTile = 128;

/// The shape of one causal attention: query i (0-based among the new tokens) sits at
/// cache index past + i and sees keys 0 ... past + i (within span's window and sinks).
struct CausalShape {
  Index past = 0;          // cached tokens before the first query
  Index split = 0;         // key index no tile straddles (0: none)
  Index acc_width = 0;     // accumulator (value) width per query row
  Index buffer_width = 0;  // scratch scalars per key row of a tile (0: none)
  Index segment = 0;       // key tiles before `split` never cross a multiple of it: the
                           // pages of a paged cache (0: contiguous)
  AttentionSpan span;      // window, sink tokens and soft-cap (default: plain causal)
};

/// One thread's scratch; fit() allocates, the driver never does.
template <class T>
struct CausalScratch {
  RowMatrix<T> scores;                   // tile x tile
  RowMatrix<T> acc;                      // tile x acc_width
  RowMatrix<T> buffer;                   // tile x buffer_width
  RowVector<T> running_max, normalizer;  // tile

  void fit(const CausalShape& shape) {
    reshape(scores, kPrefillTile, kPrefillTile);
    reshape(acc, kPrefillTile, shape.acc_width);
    reshape(buffer, kPrefillTile, shape.buffer_width);
    reshape(running_max, kPrefillTile);
    reshape(normalizer, kPrefillTile);
  }
};

/// Queries q0 ... q0 + nq - 1 (nq <= kPrefillTile) against every key they see, with an
/// online softmax; writes the normalized result to out (nq rows of acc_width, row
/// stride out_stride), with the sink logit `*sink` (nullptr: none) in each row's
/// denominator. Key tiles that no row sees (before the window of the first row, past
/// the sink tokens) are skipped, and no tile straddles the end of the sink tokens, so
/// within a tile each row sees one run of keys [lo, hi). Never allocates
/// (scratch.fit(shape) must have run).
template <class T, class Ops>
void causal_query_tile(const CausalShape& shape, CausalScratch<T>& scratch, const Ops& ops,
                       Index q0, Index nq, T* out, Index out_stride, const T* sink = nullptr) {
  constexpr Index tile = kPrefillTile;
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  constexpr Index P = packet_size<T>;
  static_assert(tile % P == 0, "a tile's logits row is whole packets");
  const AttentionSpan& span = shape.span;
  auto& acc = scratch.acc;
  auto& running_max = scratch.running_max;
  auto& normalizer = scratch.normalizer;
  T* buffer = shape.buffer_width > 0 ? scratch.buffer.data() : nullptr;
  const Index width = shape.acc_width;
  const Index first_query = shape.past + q0;  // position of row 0
  const Index key_end = first_query + nq;     // keys visible to the tile's last row
  const Index sink_end = span.window > 0 ? std::min(span.sink_tokens, key_end) : 0;
  const T softcap = static_cast<T>(span.softcap);
  acc.topRows(nq).setZero();
  running_max.head(nq).setConstant(neg_inf);
  normalizer.head(nq).setZero();
  // Row r's visible keys among k0 ... k0 + nk - 1, as columns [lo, hi).
  auto visible_run = [&](Index r, Index k0, Index nk, Index& lo, Index& hi) {
    const Index position = first_query + r;
    hi = std::min(nk, position - k0 + 1);
    lo = k0 >= sink_end ? std::max<Index>(0, span.window_begin(position) - k0) : 0;
  };
  auto attend_keys = [&](Index k0, Index end) {
    while (k0 < end) {
      Index nk = std::min(tile, end - k0);
      if (k0 < shape.split) nk = std::min(nk, shape.split - k0);
      if (k0 < shape.split && shape.segment > 0)
        nk = std::min(nk, shape.segment - k0 % shape.segment);
      T* s = scratch.scores.data();
      const Index n_pad = (nk + P - 1) / P * P;
      ops.score(q0, nq, k0, nk, s, tile, buffer);
      bool whole_tile = true;  // every row sees every key of the tile
      for (Index r = 0; r < nq; ++r) {
        T* row = s + r * tile;
        Index lo = 0, hi = 0;
        visible_run(r, k0, nk, lo, hi);
        whole_tile = whole_tile && lo == 0 && hi == nk;
        if (softcap > T(0) && hi > lo) cap_logits(row + lo, hi - lo, softcap);
        // Invisible keys and the padding to whole packets -inf (weight exactly 0).
        const Index begin = std::min(lo, nk), end = std::clamp(hi, begin, nk);
        std::fill(row, row + begin, neg_inf);
        std::fill(row + end, row + n_pad, neg_inf);
        softmax_tile_row(row, n_pad, running_max(r), normalizer(r), acc.row(r).data(), width);
      }
      if (whole_tile) {
        ops.accumulate(q0, nq, k0, nk, s, tile, acc.data(), width, buffer);
      } else {
        // Row r reads only its visible values: a masked weight is 0, but 0 * (a NaN in an
        // invisible token's value) would still leak into row r.
        for (Index r = 0; r < nq; ++r) {
          Index lo = 0, hi = 0;
          visible_run(r, k0, nk, lo, hi);
          if (hi <= lo) continue;
          ops.accumulate(q0 + r, 1, k0 + lo, hi - lo, s + r * tile + lo, tile,
                         acc.data() + r * width, width, buffer);
        }
      }
      k0 += nk;
    }
  };
  // The sink tokens, then the keys from the first row's window on (everything without
  // a window).
  attend_keys(0, sink_end);
  attend_keys(std::max(sink_end, span.window_begin(first_query)), key_end);
  for (Index r = 0; r < nq; ++r) {
    if (sink != nullptr) {
      add_sink_logit(*sink, running_max(r), normalizer(r), acc.row(r).data(), width);
    }
    // Every query sees at least itself, so the normalizer is >= 1.
    Eigen::Map<RowVector<T>>(out + r * out_stride, width) = acc.row(r) / normalizer(r);
  }
}

}  // namespace kvattn::detail
