// Context parallelism: one sequence's cache cut into token ranges across the ranks of an
// MPI communicator, each range an ordinary cache of its rank (docs/distributed.md).
//
// Layout: rank r holds the sequence's tokens [r*C, (r+1)*C), C = shard_capacity, as a
// cache of the layer's own type whose RoPE offset is r*C (plus the layer's own offset):
// tokens fill rank 0, then rank 1, and so on, so appends always go to the rank that owns
// the tail, and each shard's RoPE positions are its tokens' positions in the sequence.
// A sequence holds at most ranks()*C tokens (length_error past that).
//
// decode: rank 0's x is broadcast; the owner of the new token's position appends its
// rows; every rank computes the token's query (project_query) and the partial softmax
// state of each head over its shard (attend_states); the states are merged exactly on
// rank 0 by an MPI_Reduce with a user-defined operation (core/softmax_states.hpp's
// merge), rank 0 folds in the sink logits, normalizes and applies W_O, and broadcasts the
// 1 x d output, so every rank returns the same bits.
//
// prefill: the same with the prompt's queries moving instead of the keys and values
// ("pass-Q"): every rank holds the prompt x (broadcast from rank 0, L x d, smaller than
// its keys and values), projects every query itself and attends them over its own shard,
// causally where the query lies inside it; the states are reduced chunk by chunk. No
// rank ever holds another rank's keys and values, which is the point of sharding the
// cache; the attention runs as decode-shaped steps, one query row at a time (see
// docs/distributed.md for what that costs against a ring of K/V blocks).
//
// Layers with a sliding window are refused (config_error): a shard cannot tell which
// of its tokens a far query sees (use HeadParallel, which keeps whole sequences).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "kvattn/attention/attend_states.hpp"
#include "kvattn/config/rope_config.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/softmax_states.hpp"
#include "kvattn/core/threads.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/distributed/mpi_comm.hpp"

namespace kvattn::mpi {

/// One sequence of `Layer` (GqaLayer, MlaLayer or LrkvLayer) sharded by token range over
/// a communicator; S is the caches' storage type. Every member function that changes
/// or reads the sequence is collective (all ranks, same order). Not copyable; destroy it
/// before MPI_Finalize.
template <class Layer, class S = typename Layer::scalar_type>
class ContextParallel {
 public:
  using T = typename Layer::scalar_type;
  using cache_type = typename Layer::template cache_type<S>;

  /// Collective. `layer` (same config and weights on every rank) and `shard_capacity`
  /// (tokens per rank, >= 1, the same on every rank) set the layout above; each shard
  /// reserves its whole capacity now, so appends never allocate. `threads` run each
  /// rank's attention and projections.
  ContextParallel(const Layer& layer, MPI_Comm comm, Index shard_capacity, Threads threads = {})
      : comm_(comm),
        capacity_(checked_capacity(layer, shard_capacity, comm_.size())),
        first_(capacity_ * comm_.rank()),
        threads_(threads),
        reduction_(layer.heads_width() / layer.config().n_heads) {
    // Everything that may fail on one rank alone (allocations) runs inside the agreement.
    detail::agree(comm_, "ContextParallel", [&] {
      const int thread_count = threads_.resolved();
      layer_.emplace(moved_layer(layer, first_));
      cache_.emplace(layer_->template make_cache<S>());
      cache_->reserve(capacity_);
      ws_ = layer_->make_workspace(Threads{thread_count});
      const Index heads = layer.config().n_heads;
      kvattn::detail::reshape(records_, heads, reduction_.record_size());
      kvattn::detail::reshape(merged_, heads, reduction_.record_size());
      kvattn::detail::reshape(heads_, 1, layer.heads_width());
      kvattn::detail::reshape(token_, 1, layer.config().d_model);
      kvattn::detail::reshape(out_, 1, layer.config().d_model);
      states_.reset(heads, reduction_.width());
    });
  }

  int rank() const { return comm_.rank(); }
  int ranks() const { return comm_.size(); }
  /// Tokens in the whole sequence (the same on every rank).
  Index sequence_length() const { return length_; }
  /// Tokens each rank holds at most, and the whole sequence's limit.
  Index shard_capacity() const { return capacity_; }
  Index capacity() const { return capacity_ * ranks(); }
  /// This rank's first token's position in the sequence, r * shard_capacity().
  Index shard_first() const { return first_; }
  /// The rank that holds (or will hold) the token at `position`.
  int owner(Index position) const { return static_cast<int>(position / capacity_); }
  /// This rank's shard: an ordinary cache of tokens [shard_first(), ...), read-only.
  const cache_type& shard() const { return *cache_; }
  /// The layer of this rank's shard: the given layer with its RoPE offset moved by
  /// shard_first().
  const Layer& shard_layer() const { return *layer_; }

  /// Collective: the causal prefill of L new tokens (x: L x d, significant on rank 0;
  /// every rank passes L x d). Returns the L x d output on every rank. length_error when
  /// the sequence would outgrow capacity(); a call that throws changes nothing.
  RowMatrix<T> prefill(const ConstMatrixRef<T>& x) {
    constexpr const char* where = "ContextParallel::prefill";
    const Index past = length_;
    const RowMatrix<T> tokens = receive(where, x);
    const Index count = tokens.rows();
    const Index heads = layer_->config().n_heads;
    const Index record = reduction_.record_size();
    // Tokens per reduction: a few MiB of records.
    const Index chunk =
        std::max<Index>(1, Index{4} * 1024 * 1024 / (heads * record * Index{sizeof(T)}));
    RowMatrix<T> out, queries, mine, merged, heads_out;
    append_own(where, tokens, [&] {
      out.resize(count, layer_->config().d_model);
      queries = layer_->project_query(tokens, threads_);
      mine.resize(chunk * heads, record);
      merged.resize(chunk * heads, record);
      heads_out.resize(count, layer_->heads_width());
    });
    if (count == 0) return out;
    for (Index c0 = 0; c0 < count; c0 += chunk) {
      const Index n = std::min(chunk, count - c0);
      for (Index i = 0; i < n; ++i) {
        attend_position(queries.row(c0 + i), past + c0 + i);
        reduction_.pack(states_, mine.data() + i * heads * record);
      }
      reduction_.reduce(mine.data(), merged.data(), n * heads, 0, comm_.get());
      if (rank() == 0) {
        for (Index i = 0; i < n; ++i) {
          reduction_.unpack(merged.data() + i * heads * record, heads, states_);
          finish(heads_out.row(c0 + i).data());
        }
      }
    }
    if (rank() == 0) {
      kvattn::detail::parallel_product(heads_out, layer_->weights().w_o, out, threads_.resolved());
    }
    detail::broadcast(out, 0, comm_.get());
    return out;
  }

  /// Collective: appends L new tokens (x: L x d, significant on rank 0) to their shards
  /// without computing their outputs: a sequence restored from its tokens, or a prompt
  /// whose outputs nobody reads. Each rank projects only its own tokens' rows.
  /// length_error past capacity(); a call that throws changes nothing.
  void append(const ConstMatrixRef<T>& x) {
    const RowMatrix<T> tokens = receive("ContextParallel::append", x);
    append_own("ContextParallel::append", tokens, [] {});
  }

  /// Collective: one new token (x: 1 x d, significant on rank 0; every rank passes 1 x d)
  /// into out (1 x d on every rank, the same bits). length_error when the sequence is
  /// full; a call that throws changes nothing.
  void decode(const ConstMatrixRef<T>& x, MatrixRef<T> out) {
    constexpr const char* where = "ContextParallel::decode";
    const Index d = layer_->config().d_model;
    detail::receive(comm_, where, x, 1, d, token_, [&] {
      kvattn::detail::check_shape(where, "out", out, 1, d);
      check_room(where, 1);
    });
    const Index position = length_;
    // The query is projected before the append (it allocates; the append must be last).
    append_own(where, token_, [&] { query_ = layer_->project_query(token_, threads_); });
    attend_position(query_, position);
    const Index heads = layer_->config().n_heads;
    reduction_.pack(states_, records_.data());
    reduction_.reduce(records_.data(), merged_.data(), heads, 0, comm_.get());
    if (rank() == 0) {
      reduction_.unpack(merged_.data(), heads, states_);
      finish(heads_.data());
      kvattn::detail::parallel_product(heads_, layer_->weights().w_o, out_, threads_.resolved());
    }
    detail::broadcast(out_, 0, comm_.get());
    out = out_;
  }

  /// decode returning the 1 x d output.
  RowVector<T> decode(const ConstMatrixRef<T>& x) {
    RowMatrix<T> out(1, layer_->config().d_model);
    decode(x, out);
    return out;
  }

 private:
  // config_error, the same on every rank, unless the layout fits the layer.
  static Index checked_capacity(const Layer& layer, Index capacity, int ranks) {
    if (capacity < 1) {
      throw config_error("ContextParallel: shard_capacity (" + std::to_string(capacity) +
                         ") must be >= 1 token per rank");
    }
    if (layer.config().window > 0) {
      throw config_error("ContextParallel: the layer has a sliding window (window " +
                         std::to_string(layer.config().window) +
                         "); a shard cannot tell which of its tokens a later query sees (use "
                         "HeadParallel, or window 0)");
    }
    const Index room = RopeConfig::kMaxPositionOffset - layer.config().rope.position_offset;
    if (capacity > room / ranks) {
      throw config_error("ContextParallel: shard_capacity (" + std::to_string(capacity) + ") x " +
                         std::to_string(ranks) + " ranks passes RoPE's largest position (2^53)");
    }
    return capacity;
  }

  static Layer moved_layer(const Layer& layer, Index first) {
    auto config = layer.config();
    config.rope.position_offset += first;
    return Layer(config, layer.weights());
  }

  // Rank 0's x (L x d) on every rank, after every rank agreed that it fits.
  RowMatrix<T> receive(const char* where, const ConstMatrixRef<T>& x) const {
    RowMatrix<T> tokens;
    detail::receive(comm_, where, x, -1, layer_->config().d_model, tokens,
                    [&] { check_room(where, x.rows()); });
    return tokens;
  }

  // Runs `prepare` (which may allocate) on every rank, then appends the rows of this
  // rank's share of `tokens`, the sequence's next tokens. When any rank fails, every
  // rank throws and a rank whose own append went through takes it back: nothing changed.
  template <class Prepare>
  void append_own(const char* where, const RowMatrix<T>& tokens, Prepare&& prepare) {
    const Index past = length_;
    const Index count = tokens.rows();
    const Index begin = std::clamp(first_, past, past + count);
    const Index end = std::clamp(first_ + capacity_, past, past + count);
    detail::agree_or_undo(comm_, where, *cache_, [&] {
      prepare();
      if (end > begin) {
        layer_->append(tokens.middleRows(begin - past, end - begin), *cache_, threads_);
      }
    });
    length_ = past + count;
  }

  void check_room(const char* where, Index count) const {
    if (count > capacity() - length_) {
      throw length_error(std::string(where) + ": " + std::to_string(count) + " new tokens after " +
                         std::to_string(length_) + " pass the capacity of " +
                         std::to_string(ranks()) + " ranks x " + std::to_string(capacity_) +
                         " tokens = " + std::to_string(capacity()));
    }
  }

  // states_ = this rank's partial state of the query of the token at `position` (empty
  // when the shard starts after it).
  void attend_position(const ConstMatrixRef<T>& query, Index position) {
    if (position < first_ || cache_->tokens() == 0) {
      states_.reset(layer_->config().n_heads, reduction_.width());
      return;
    }
    layer_->attend_states(query, position - first_, *cache_, states_, ws_, threads_);
  }

  // The merged states_ with the sink logits, normalized into heads (H * width scalars).
  void finish(T* heads) {
    if (layer_->config().sink_logits) add_sink_logits(layer_->weights().sinks, states_);
    const Index width = reduction_.width();
    for (Index h = 0; h < states_.rows(); ++h) {
      kvattn::detail::finish_state_row(states_.max(h), states_.sum(h), states_.acc.row(h).data(),
                                       heads + h * width, width);
    }
  }

  detail::Communicator comm_;
  Index capacity_;
  Index first_;
  Threads threads_;
  detail::StatesReduction<T> reduction_;
  std::optional<Layer> layer_;
  std::optional<cache_type> cache_;
  typename Layer::Workspace ws_;
  Index length_ = 0;
  SoftmaxStates<T> states_;
  RowMatrix<T> token_, query_, records_, merged_, heads_, out_;
};

}  // namespace kvattn::mpi
