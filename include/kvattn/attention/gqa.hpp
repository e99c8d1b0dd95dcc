// MHA, GQA and MQA as one family: H query heads over n_kv shared KV heads.
//
// Shapes (rows are tokens):
//   x        L x d                    input hidden states
//   w_q      d x (H * d_h)            bias_q 1 x (H * d_h)   (biases only with qkv_bias)
//   w_k, w_v d x (n_kv * d_h)         bias_k, bias_v 1 x (n_kv * d_h)
//   w_o      (H * d_h) x d
//   output   L x d
// Query head h (columns [h*d_h, (h+1)*d_h) of Q) attends with KV head h / (H / n_kv).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvattn/attention/attention_layer.hpp"
#include "kvattn/cache/gqa_cache.hpp"
#include "kvattn/config/gqa_config.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/random.hpp"
#include "kvattn/core/rope.hpp"
#include "kvattn/core/threads.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/detail/causal_attention.hpp"
#include "kvattn/detail/decode_kernels.hpp"
#include "kvattn/detail/row_source.hpp"
#include "kvattn/detail/split_attention.hpp"

namespace kvattn {

/// The projection weights of a GQA-family layer (`in x out`, Y = X * W).
template <class T>
struct GqaWeights {
  RowMatrix<T> w_q;     // d x (H * d_h)
  RowMatrix<T> w_k;     // d x (n_kv * d_h)
  RowMatrix<T> w_v;     // d x (n_kv * d_h)
  RowMatrix<T> w_o;     // (H * d_h) x d
  RowVector<T> bias_q;  // 1 x (H * d_h), empty without qkv_bias
  RowVector<T> bias_k;  // 1 x (n_kv * d_h), empty without qkv_bias
  RowVector<T> bias_v;  // 1 x (n_kv * d_h), empty without qkv_bias
  RowVector<T> sinks;   // 1 x H, the per-head sink logits (sink_logits only, else empty)

  /// Weights drawn from N(0, 1/fan_in); biases (with qkv_bias) from N(0, 0.25).
  static GqaWeights random(const GqaConfig& config, std::uint64_t seed) {
    config.validate();
    std::mt19937_64 rng(seed);
    const Index q_width = config.query_width();
    const Index kv_width = config.kv_width();
    GqaWeights w;
    w.w_q = random_weight<T>(config.d_model, q_width, rng);
    w.w_k = random_weight<T>(config.d_model, kv_width, rng);
    w.w_v = random_weight<T>(config.d_model, kv_width, rng);
    w.w_o = random_weight<T>(q_width, config.d_model, rng);
    if (config.qkv_bias) {
      w.bias_q = random_normal<T>(1, q_width, rng, 0.5);
      w.bias_k = random_normal<T>(1, kv_width, rng, 0.5);
      w.bias_v = random_normal<T>(1, kv_width, rng, 0.5);
    }
    // Drawn last, so a config without sink logits keeps the weights it always had.
    if (config.sink_logits) w.sinks = random_normal<T>(1, config.n_heads, rng);
    return w;
  }

  /// The same weights in another scalar type (e.g. double for a reference).
  template <class U>
  GqaWeights<U> cast() const {
    return {w_q.template cast<U>(),    w_k.template cast<U>(),    w_v.template cast<U>(),
            w_o.template cast<U>(),    bias_q.template cast<U>(), bias_k.template cast<U>(),
            bias_v.template cast<U>(), sinks.template cast<U>()};
  }

  /// Throws shape_error unless every matrix matches `config`.
  void check(const GqaConfig& config) const {
    constexpr const char* where = "GqaWeights";
    const Index q_width = config.query_width();
    const Index kv_width = config.kv_width();
    detail::check_shape(where, "w_q", w_q, config.d_model, q_width);
    detail::check_shape(where, "w_k", w_k, config.d_model, kv_width);
    detail::check_shape(where, "w_v", w_v, config.d_model, kv_width);
    detail::check_shape(where, "w_o", w_o, q_width, config.d_model);
    const Index q_bias = config.qkv_bias ? q_width : 0;
    const Index kv_bias = config.qkv_bias ? kv_width : 0;
    detail::check_shape(where, "bias_q", bias_q, q_bias == 0 ? -1 : 1, q_bias);
    detail::check_shape(where, "bias_k", bias_k, kv_bias == 0 ? -1 : 1, kv_bias);
    detail::check_shape(where, "bias_v", bias_v, kv_bias == 0 ? -1 : 1, kv_bias);
    detail::check_shape(where, "sinks", sinks, config.sink_logits ? 1 : -1,
                        config.sink_logits ? config.n_heads : 0);
  }
};

/// A GQA-family attention layer (models AttentionLayer). Immutable after construction:
/// one layer may be used from several threads at once, each with its own workspace.
template <class T>
class GqaLayer {
 public:
  using scalar_type = T;
  using config_type = GqaConfig;
  template <class S = T>
  using cache_type = GqaCache<T, S>;

  /// The scratch of decode and attend, owned by the caller: one per thread that calls
  /// them at once. Sized by make_workspace for a thread count; a call at a larger thread
  /// count (or with another layer's workspace) grows it first, which allocates.
  struct Workspace {
    RowVector<T> query, key, value, heads;  // 1 x H*d_h, n_kv*d_h, n_kv*d_h, H*d_h
    detail::SplitScratch<T> split;          // partial softmax states per thread
  };

  /// Validates the config and the weights' shapes (config_error / shape_error).
  GqaLayer(const GqaConfig& config, GqaWeights<T> weights)
      : config_(config), weights_(std::move(weights)) {
    config_.validate();
    weights_.check(config_);
    rope_ = Rope(config_.rope, config_.head_dim);
    scale_ = static_cast<T>(config_.scale());
  }

  /// A layer with GqaWeights<T>::random(config, seed).
  static GqaLayer random(const GqaConfig& config, std::uint64_t seed) {
    return GqaLayer(config, GqaWeights<T>::random(config, seed));
  }

  const GqaConfig& config() const { return config_; }
  const GqaWeights<T>& weights() const { return weights_; }
  const Rope& rope() const { return rope_; }
  /// The scale multiplying q.k before the softmax.
  T softmax_scale() const { return scale_; }
  /// Columns of attend's query: H * d_h (head h in columns [h*d_h, (h+1)*d_h)).
  Index query_width() const { return config_.query_width(); }
  /// Columns of attend's heads output: H * d_h.
  Index heads_width() const { return config_.query_width(); }

  /// An empty cache for this layer, with room for `reserve_tokens`.
  template <class S = T>
  GqaCache<T, S> make_cache(Index reserve_tokens = 0) const {
    return GqaCache<T, S>(config_, reserve_tokens);
  }

  /// A workspace sized for decode and attend at `threads`: with it they allocate nothing.
  Workspace make_workspace(Threads threads = {}) const {
    Workspace ws;
    prepare(ws, 0, threads.resolved());
    return ws;
  }

  /// Causal prefill of L new tokens x (L x d) after the cache's tokens: returns the
  /// L x d output and appends their K and V to the cache. Attention is tiled with an
  /// online softmax, so memory is O(L * d + tile^2), never L x L. The new rows are
  /// appended last, after everything else is computed: a call that throws (bad shape,
  /// allocation failure) leaves the cache as it was.
  ///
  /// With threads, the projections are split by output column and the attention by
  /// (query head, query tile).
  template <class S>
  RowMatrix<T> prefill(const ConstMatrixRef<T>& x, GqaCache<T, S>& cache,
                       Threads threads = {}) const {
    constexpr const char* where = "GqaLayer::prefill";
    check_cache(cache, where);
    detail::check_shape(where, "x", x, -1, config_.d_model);
    const int thread_count = threads.resolved();
    // No tokens: nothing to append or attend (and no block of an empty matrix to take).
    if (x.rows() == 0) return RowMatrix<T>(0, config_.d_model);
    const Index past = cache.tokens();
    const Index length = x.rows();
    const Index dh = config_.head_dim;
    RowMatrix<T> query, key, value;
    project(x, past, query, key, value, thread_count);
    query *= scale_;
    // The new keys and values as the cache will store them (rounded to S).
    const Staged<S> staged(key, value);
    const detail::CausalShape shape{past, past, dh, std::is_same_v<S, T> ? 0 : dh};
    std::vector<detail::CausalScratch<T>> scratch(static_cast<std::size_t>(thread_count));
    for (auto& s : scratch) s.fit(shape);
    RowMatrix<T> heads(length, config_.query_width());
    const Index query_tiles = (length + detail::kPrefillTile - 1) / detail::kPrefillTile;
    detail::parallel_for(config_.n_heads * query_tiles, thread_count, [&](Index unit) {
      const Index h = unit / query_tiles;
      const Index q0 = (unit % query_tiles) * detail::kPrefillTile;
      const Index g = h / config_.group_size();
      const PrefillOps<S> ops{query.data() + h * dh, query.cols(), key_source(cache, staged, g),
                              value_source(cache, staged, g), dh};
      detail::causal_query_tile(shape, scratch[static_cast<std::size_t>(detail::thread_index())],
                                ops, q0, std::min(detail::kPrefillTile, length - q0),
                                heads.data() + q0 * heads.cols() + h * dh, heads.cols());
    });
    RowMatrix<T> out(length, config_.d_model);
    detail::parallel_product(heads, weights_.w_o, out, thread_count);
    cache.append(key, value);  // last: strong guarantee
    return out;
  }

  /// One new token x (1 x d) through the factored path: appends its K and V, attends
  /// over the whole cache and writes the 1 x d output into `out`. All query heads of
  /// a KV group are scored together against each tile of the group's keys, so each
  /// cached element is read once per step (see attend). Allocates nothing when the
  /// cache has capacity and the workspace was made for at least this thread count. A
  /// call that throws leaves the cache as it was (capacity included).
  template <class S>
  void decode(const ConstMatrixRef<T>& x, GqaCache<T, S>& cache, MatrixRef<T> out, Workspace& ws,
              Threads threads = {}) const {
    constexpr const char* where = "GqaLayer::decode";
    check_cache(cache, where);
    detail::check_shape(where, "x", x, 1, config_.d_model);
    detail::check_shape(where, "out", out, 1, config_.d_model);
    const int thread_count = threads.resolved();
    const auto plan = prepare(ws, cache.tokens() + 1, thread_count);
    cache.grow_for(cache.tokens() + 1);
    // Everything that may throw is done; from here the step cannot fail.
    const Index position = cache.tokens();
    detail::parallel_product(x, weights_.w_q, ws.query, thread_count);
    detail::parallel_product(x, weights_.w_k, ws.key, thread_count);
    detail::parallel_product(x, weights_.w_v, ws.value, thread_count);
    if (config_.qkv_bias) {
      ws.query += weights_.bias_q;
      ws.key += weights_.bias_k;
      ws.value += weights_.bias_v;
    }
    const double angle_position = static_cast<double>(config_.rope.position_offset + position);
    rope_.rotate(ws.key.data(), angle_position, config_.n_kv_heads, config_.head_dim);
    cache.append_token(ws.key, ws.value);
    attend_prepared(cache, ws, plan, ws.heads.data());
    detail::parallel_product(ws.heads, weights_.w_o, out, thread_count);
  }

  /// decode with a workspace of its own (allocates one on every call).
  template <class S>
  void decode(const ConstMatrixRef<T>& x, GqaCache<T, S>& cache, MatrixRef<T> out,
              Threads threads = {}) const {
    Workspace ws = make_workspace(threads);
    decode(x, cache, out, ws, threads);
  }

  /// decode returning the 1 x d output (allocates it and a workspace on every call).
  template <class S>
  RowVector<T> decode(const ConstMatrixRef<T>& x, GqaCache<T, S>& cache,
                      Threads threads = {}) const {
    RowVector<T> out(config_.d_model);
    decode(x, cache, out, threads);
    return out;
  }

  /// The attention step alone, for the newest cached token (index tokens() - 1):
  /// `query` (1 x H*d_h) is that token's projected query x W_Q (+ bias_q) before RoPE;
  /// `heads` (1 x H*d_h) receives the per-head outputs o_h, before W_O. decode is
  /// projections + append + attend + W_O. The cache is only read: several threads may
  /// attend over one const cache at once, each with its own workspace.
  ///
  /// Each KV group's query heads are scored against a tile of the group's keys with
  /// one small matrix product, the tile's softmax weights folded into a running
  /// (online) softmax, and the same tile's values accumulated, so each cached element
  /// is read once per step. With threads, KV groups are spread over the threads, and
  /// when there are fewer groups than threads the sequence is split too and the
  /// partial softmax states merged exactly (flash-decoding).
  template <class S>
  void attend(const ConstMatrixRef<T>& query, const GqaCache<T, S>& cache, MatrixRef<T> heads,
              Workspace& ws, Threads threads = {}) const {
    constexpr const char* where = "GqaLayer::attend";
    check_cache(cache, where);
    detail::check_shape(where, "query", query, 1, query_width());
    detail::check_shape(where, "heads", heads, 1, heads_width());
    detail::require_tokens(where, cache.tokens());
    const int thread_count = threads.resolved();
    const auto plan = prepare(ws, cache.tokens(), thread_count);
    ws.query = query.row(0);
    attend_prepared(cache, ws, plan, heads.data());
  }

  /// attend with a workspace of its own (allocates one on every call).
  template <class S>
  void attend(const ConstMatrixRef<T>& query, const GqaCache<T, S>& cache, MatrixRef<T> heads,
              Threads threads = {}) const {
    Workspace ws = make_workspace(threads);
    attend(query, cache, heads, ws, threads);
  }

  /// Tokens per tile of the decode pass (one online-softmax update per tile): about
  /// 256 KiB of keys and values (256 tokens at d_h = 128 in fp32). Each pass streams
  /// its own block, so the tile need not stay in cache; it only sets how often the
  /// softmax state is rescaled and how long each stream runs before the other starts
  /// (kernel tests: 128 tokens 0.85-0.88, 256 0.91-0.94, 512 0.91-0.95 of the read-only
  /// bandwidth for MHA; GQA 0.71-0.74 / 0.73-0.80 / 0.76-0.77).
  Index decode_tile() const {
    const Index row_bytes = 2 * config_.head_dim * static_cast<Index>(sizeof(T));
    return std::clamp<Index>((Index{256} * 1024 / row_bytes) / 8 * 8, 8, 1024);
  }

 private:
  template <class S>
  void check_cache(const GqaCache<T, S>& cache, const char* where) const {
    detail::require_plain_span(config_, where);
    if (!(cache.config() == config_)) {
      throw config_error(std::string(where) + ": the cache was made for config " +
                         detail::describe(cache.config()) + " (or other RoPE/bias settings)" +
                         ", the layer has " + detail::describe(config_));
    }
  }

  // Q, K, V of x with biases and RoPE; token i sits at cache index past + i.
  void project(const ConstMatrixRef<T>& x, Index past, RowMatrix<T>& query, RowMatrix<T>& key,
               RowMatrix<T>& value, int threads) const {
    query.resize(x.rows(), weights_.w_q.cols());
    key.resize(x.rows(), weights_.w_k.cols());
    value.resize(x.rows(), weights_.w_v.cols());
    detail::parallel_product(x, weights_.w_q, query, threads);
    detail::parallel_product(x, weights_.w_k, key, threads);
    detail::parallel_product(x, weights_.w_v, value, threads);
    if (config_.qkv_bias) {
      query.rowwise() += weights_.bias_q;
      key.rowwise() += weights_.bias_k;
      value.rowwise() += weights_.bias_v;
    }
    for (Index i = 0; i < x.rows(); ++i) {
      const double position = static_cast<double>(config_.rope.position_offset + past + i);
      rope_.rotate(query.row(i).data(), position, config_.n_heads, config_.head_dim);
      rope_.rotate(key.row(i).data(), position, config_.n_kv_heads, config_.head_dim);
    }
  }

  // A prefill's new keys and values in storage type S: the projections themselves
  // when S is T, else rounded copies.
  template <class S>
  struct Staged {
    RowMatrix<S> keys, values;  // empty when S is T
    const S* key_data;
    const S* value_data;
    Staged(const RowMatrix<T>& key, const RowMatrix<T>& value) {
      if constexpr (std::is_same_v<S, T>) {
        key_data = key.data();
        value_data = value.data();
      } else {
        keys = key.template cast<S>();
        values = value.template cast<S>();
        key_data = keys.data();
        value_data = values.data();
      }
    }
  };

  template <class S>
  detail::RowSource<S> key_source(const GqaCache<T, S>& cache, const Staged<S>& staged,
                                  Index g) const {
    const Index dh = config_.head_dim;
    return {cache.key_row(g, 0), dh, staged.key_data + g * dh, config_.kv_width(), cache.tokens()};
  }
  template <class S>
  detail::RowSource<S> value_source(const GqaCache<T, S>& cache, const Staged<S>& staged,
                                    Index g) const {
    const Index dh = config_.head_dim;
    return {cache.value_row(g, 0), dh, staged.value_data + g * dh, config_.kv_width(),
            cache.tokens()};
  }

  // One query head against its KV group's rows (causal_attention.hpp's ops).
  template <class S>
  struct PrefillOps {
    const T* query;  // L x d_h (row stride query_stride), scaled and rotated
    Index query_stride;
    detail::RowSource<S> keys, values;
    Index head_dim;

    void score(Index q0, Index nq, Index k0, Index nk, T* scores, Index stride, T* buffer) const {
      const auto k = detail::rows_as<T>(keys, k0, nk, 0, head_dim, buffer);
      const detail::ConstRowsMap<T> q(query + q0 * query_stride, nq, head_dim,
                                      Eigen::OuterStride<>(query_stride));
      detail::RowsMap<T>(scores, nq, nk, Eigen::OuterStride<>(stride)).noalias() =
          q * k.transpose();
    }
    void accumulate(Index, Index nq, Index k0, Index nk, const T* weights, Index stride, T* acc,
                    Index acc_stride, T* buffer) const {
      const auto v = detail::rows_as<T>(values, k0, nk, 0, head_dim, buffer);
      detail::RowsMap<T>(acc, nq, head_dim, Eigen::OuterStride<>(acc_stride)).noalias() +=
          detail::ConstRowsMap<T>(weights, nq, nk, Eigen::OuterStride<>(stride)) * v;
    }
  };

  // Sizes the workspace for a step over `length` tokens; may allocate and throw.
  detail::SplitPlan prepare(Workspace& ws, Index length, int threads) const {
    const Index q_width = config_.query_width();
    const Index kv_width = config_.kv_width();
    detail::reshape(ws.query, q_width);
    detail::reshape(ws.heads, q_width);
    detail::reshape(ws.key, kv_width);
    detail::reshape(ws.value, kv_width);
    const Index tile = decode_tile();
    const Index buffer_width = 0;
    const auto plan = detail::plan_split(config_.n_kv_heads, config_.group_size(), config_.head_dim,
                                         length, tile, buffer_width, threads);
    ws.split.fit(plan);
    return plan;
  }

  // One KV group's tiles: logits of the group's query heads (scaled, rotated) against
  // the tile's keys, then the weighted sum of the tile's values. Keys and values are two
  // dense blocks per group, each read front to back a tile at a time. The score pass
  // reads its tile in long sequential lanes the hardware prefetcher follows; the
  // accumulate pass reads rows in column pieces and prefetches its own stream ahead
  // (detail::Prefetcher).
  //
  // bf16 rows are read in pairs (detail::paired_rows) by the accumulate, and by the
  // score when a group has one query row (MHA; with more rows the paired score measured
  // no faster): the query is then in paired order, and the output is put back in order.
  template <class S>
  struct DecodeOps {
    const GqaCache<T, S>& cache;
    const T* query;  // H x d_h
    Index group_size;
    Index head_dim;

    static bool paired_score(Index group_size, Index head_dim) {
      return group_size == 1 && detail::paired_rows<T, S>(head_dim);
    }

    void score(Index group, Index first, Index n, T* logits, Index ld) const {
      detail::score_rows(query + group * group_size * head_dim, head_dim, group_size, head_dim,
                         cache.key_row(group, first), head_dim, 0, n, logits, ld, false, nullptr,
                         nullptr, paired_score(group_size, head_dim));
    }

    void accumulate(Index group, Index first, Index n, const T* weights, Index ld, T* acc) const {
      const Index row_bytes = head_dim * Index{sizeof(S)};
      const Index ahead = std::max<Index>(1, kPrefetchAhead / row_bytes);
      const Index begin = std::min(cache.tokens(), first + ahead);
      const Index end = std::min(cache.tokens(), first + n + ahead);
      detail::Prefetcher values(cache.value_row(group, begin), (end - begin) * row_bytes);
      detail::accumulate_rows(weights, ld, group_size, cache.value_row(group, first), head_dim, 0,
                              head_dim, n, acc, head_dim, kTokenBlock, &values,
                              detail::paired_rows<T, S>(head_dim));
    }
  };

  // Tokens per accumulate block (see detail::accumulate_rows), and how far ahead of the
  // value rows being summed the accumulate prefetches (measured best at 4-8 KiB).
  static constexpr Index kTokenBlock = 16;
  static constexpr Index kPrefetchAhead = 8 * 1024;

  // The attention of the newest token with ws.query (projected, not yet rotated) into
  // `heads` (H * d_h scalars). Never throws: prepare() has sized everything.
  template <class S>
  void attend_prepared(const GqaCache<T, S>& cache, Workspace& ws, const detail::SplitPlan& plan,
                       T* heads) const {
    const double position = static_cast<double>(config_.rope.position_offset + cache.tokens() - 1);
    rope_.rotate(ws.query.data(), position, config_.n_heads, config_.head_dim);
    ws.query *= scale_;
    const Index group = config_.group_size();
    const Index dh = config_.head_dim;
    if (DecodeOps<S>::paired_score(group, dh)) {
      for (Index h = 0; h < config_.n_heads; ++h) detail::to_paired(ws.query.data() + h * dh, dh);
    }
    const DecodeOps<S> ops{cache, ws.query.data(), group, dh};
    detail::split_attention(plan, ws.split, ops, heads);
    if (detail::paired_rows<T, S>(dh)) {
      for (Index h = 0; h < config_.n_heads; ++h) detail::from_paired(heads + h * dh, dh);
    }
  }

  GqaConfig config_;
  GqaWeights<T> weights_;
  Rope rope_;
  T scale_ = T(1);
};

static_assert(AttentionLayer<GqaLayer<float>>);
static_assert(AttentionLayer<GqaLayer<double>>);

/// Named aliases: MHA is GQA with n_kv_heads == n_heads (see mha_config), MQA is
/// GQA with n_kv_heads == 1 (see mqa_config).
template <class T>
using MhaLayer = GqaLayer<T>;
template <class T>
using MqaLayer = GqaLayer<T>;

}  // namespace kvattn
