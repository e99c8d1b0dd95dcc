// Head (tensor) parallelism: a layer's heads split across the ranks of an MPI
// communicator by kvcalc's --tp rules (attention/head_shard.hpp), each rank holding the
// whole sequence for its heads only (docs/distributed.md).
//
// Each rank runs shard_heads(layer, rank, ranks), an ordinary layer with its own cache
// (its KV heads, or MLA's whole latent, or LRKV's shared rows and its heads' residuals);
// its output is that rank's partial x -> heads -> W_O[rows of its heads], and the layer's
// output is their sum: an MPI_Reduce to rank 0, then a broadcast, so every rank returns
// the same bits. Windows, sink tokens and sink logits work as in one process (every rank
// sees the whole sequence of its heads).
#pragma once

#include <mpi.h>

#include <optional>
#include <string>
#include <utility>

#include "kvattn/attention/head_shard.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/threads.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/distributed/mpi_comm.hpp"

namespace kvattn::mpi {

/// One sequence of `Layer` (GqaLayer, MlaLayer or LrkvLayer) with its heads split over a
/// communicator; S is the caches' storage type. Every member function that changes or
/// reads the sequence is collective. Not copyable; destroy it before MPI_Finalize.
template <class Layer, class S = typename Layer::scalar_type>
class HeadParallel {
 public:
  using T = typename Layer::scalar_type;
  using cache_type = typename Layer::template cache_type<S>;

  /// Collective. `layer` must be the same on every rank; config_error (on every rank)
  /// when the rank count does not fit its heads (analysis::cache_layout's tp rules).
  /// `reserve_tokens` sizes each rank's cache up front.
  HeadParallel(const Layer& layer, MPI_Comm comm, Index reserve_tokens = 0, Threads threads = {})
      : comm_(comm), threads_(threads) {
    detail::agree(comm_, "HeadParallel", [&] {
      threads_.resolved();
      layer_.emplace(shard_heads(layer, comm_.rank(), comm_.size()));
      cache_.emplace(layer_->template make_cache<S>(reserve_tokens));
      ws_ = layer_->make_workspace(threads_);
      const Index d = layer.config().d_model;
      kvattn::detail::reshape(token_, 1, d);
      kvattn::detail::reshape(partial_, 1, d);
      kvattn::detail::reshape(out_, 1, d);
    });
  }

  int rank() const { return comm_.rank(); }
  int ranks() const { return comm_.size(); }
  Index sequence_length() const { return cache_->sequence_length(); }
  /// This rank's layer (its heads) and its cache.
  const Layer& shard_layer() const { return *layer_; }
  const cache_type& shard() const { return *cache_; }

  /// Collective: causal prefill of L new tokens (x: L x d, significant on rank 0; every
  /// rank passes L x d). Returns the L x d output on every rank; a call that throws
  /// changes nothing.
  RowMatrix<T> prefill(const ConstMatrixRef<T>& x) {
    constexpr const char* where = "HeadParallel::prefill";
    const Index d = layer_->config().d_model;
    RowMatrix<T> tokens, partial, out;
    detail::receive(comm_, where, x, -1, d, tokens, [&] { out.resize(x.rows(), d); });
    if (x.rows() == 0) return out;
    detail::agree_or_undo(comm_, where, *cache_,
                          [&] { partial = layer_->prefill(tokens, *cache_, threads_); });
    detail::sum_to_root(partial, out, 0, comm_.get());
    detail::broadcast(out, 0, comm_.get());
    return out;
  }

  /// Collective: one new token (x: 1 x d, significant on rank 0) into out (1 x d on every
  /// rank); a call that throws changes nothing.
  void decode(const ConstMatrixRef<T>& x, MatrixRef<T> out) {
    constexpr const char* where = "HeadParallel::decode";
    const Index d = layer_->config().d_model;
    detail::receive(comm_, where, x, 1, d, token_,
                    [&] { kvattn::detail::check_shape(where, "out", out, 1, d); });
    detail::agree_or_undo(comm_, where, *cache_,
                          [&] { layer_->decode(token_, *cache_, partial_, ws_, threads_); });
    detail::sum_to_root(partial_, out_, 0, comm_.get());
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
  detail::Communicator comm_;
  Threads threads_;
  std::optional<Layer> layer_;
  std::optional<cache_type> cache_;
  typename Layer::Workspace ws_;
  RowMatrix<T> token_, partial_, out_;
};

}  // namespace kvattn::mpi
