// What every layer's attend_states shares: attention over part of a sequence, as a
// partial softmax state to merge with the other parts (context parallelism,
// kvattn/distributed/mpi.hpp; core/softmax_states.hpp has the merge).
//
//   layer.project_query(x, threads = {})              n x query_width(): attend's query
//   layer.append(x, cache, threads = {})              n new tokens' rows, no attention
//   layer.attend_states(query, position, cache, states, workspace, threads = {})
//
// attend_states takes one query (1 x query_width(), projected, before RoPE: a row of
// project_query) at sequence index `position` in the cache's own numbering (its RoPE
// angle is rope.position_offset + position) and sees the cache's tokens 0 ...
// min(position, tokens() - 1): all of them when the query lies past the cache (a shard
// holding an earlier part of the sequence), a causal prefix when it lies inside. `states`
// gets one row per query head: its max and normalizer, and its accumulator in the
// space of attend's heads output (the unnormalized o_h, before W_O: MLA's W_UV and
// LRKV's B^V are linear, so they are applied before the merge without changing it).
// The layer's sink logits are left out, to be folded in once after every part is
// merged (add_sink_logits). Layers with a sliding window are refused (config_error): a
// part of the sequence cannot tell which of its tokens are the sink tokens.
#pragma once

#include <algorithm>
#include <string>

#include "kvattn/config/rope_config.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/softmax_states.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/detail/attention_span.hpp"

namespace kvattn {

/// Folds one sink logit per row (`sinks`, 1 x rows: the layer's weights().sinks) into
/// merged states: each is a key with that logit and a zero value. Call it once, after
/// every part of the sequence is merged; shape_error unless sinks has one entry per row
/// (and the states' max, sum and acc agree).
template <class T>
void add_sink_logits(const RowVector<T>& sinks, SoftmaxStates<T>& states) {
  detail::check_states("add_sink_logits", "states", states);
  if (sinks.cols() != states.rows()) {
    throw shape_error("add_sink_logits: sinks has " + std::to_string(sinks.cols()) +
                      " entries, expected one per state row (" + std::to_string(states.rows()) +
                      ")");
  }
  for (Index i = 0; i < states.rows(); ++i) {
    detail::add_sink_logit(sinks(i), states.max(i), states.sum(i), states.acc.row(i).data(),
                           states.width());
  }
}

namespace detail {

/// The number of the cache's tokens a query at `position` sees (see the header comment);
/// config_error for a windowed layer, shape_error for a position outside [0, 2^53] (the
/// range in which the RoPE angle, position_offset + position in double, is exact).
inline Index states_visible(const char* where, Index window, Index position, Index tokens) {
  if (window > 0) {
    throw config_error(std::string(where) + ": the layer has a sliding window (window " +
                       std::to_string(window) +
                       "); partial states over part of a sequence need window 0");
  }
  if (position < 0 || position > RopeConfig::kMaxPositionOffset) {
    throw shape_error(std::string(where) + ": position (" + std::to_string(position) +
                      ") must be in [0, 2^53]");
  }
  return std::min(tokens, position + 1);
}

/// states.acc row h = heads[h * width, (h + 1) * width) * states.sum(h): the normalized
/// output of each row back to its unnormalized accumulator (0 where no key was seen).
template <class T>
void states_from_heads(const T* heads, SoftmaxStates<T>& states) {
  const Index width = states.width();
  for (Index h = 0; h < states.rows(); ++h) {
    states.acc.row(h) = Eigen::Map<const RowVector<T>>(heads + h * width, width) * states.sum(h);
  }
}

}  // namespace detail
}  // namespace kvattn
