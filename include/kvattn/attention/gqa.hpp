// MHA, GQA and MQA as one family: H query heads over n_kv shared KV heads.
//
// Shapes (rows are tokens):
//   x        L x d                    input hidden states
//   w_q      d x (H * d_h)            b_q 1 x (H * d_h)   (biases only with qkv_bias)
//   w_k, w_v d x (n_kv * d_h)         b_k, b_v 1 x (n_kv * d_h)
//   w_o      (H * d_h) x d
//   output   L x d
// Query head h (columns [h*d_h, (h+1)*d_h) of Q) attends with KV head h / (H / n_kv).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <utility>

#include "kvattn/attention/gqa_config.hpp"
#include "kvattn/cache/gqa_cache.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/random.hpp"
#include "kvattn/core/rope.hpp"
#include "kvattn/core/softmax.hpp"
#include "kvattn/core/threads.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/detail/causal_attention.hpp"
#include "kvattn/detail/decode_kernels.hpp"
#include "kvattn/detail/split_attention.hpp"

namespace kvattn {

/// The projection weights of a GQA-family layer (`in x out`, Y = X * W).
template <class T>
struct GqaWeights {
  RowMatrix<T> w_q;  // d x (H * d_h)
  RowMatrix<T> w_k;  // d x (n_kv * d_h)
  RowMatrix<T> w_v;  // d x (n_kv * d_h)
  RowMatrix<T> w_o;  // (H * d_h) x d
  RowVector<T> b_q;  // 1 x (H * d_h), empty without qkv_bias
  RowVector<T> b_k;  // 1 x (n_kv * d_h), empty without qkv_bias
  RowVector<T> b_v;  // 1 x (n_kv * d_h), empty without qkv_bias

  /// Weights drawn from N(0, 1/fan_in); biases (with qkv_bias) from N(0, 0.25).
  static GqaWeights random(const GqaConfig& config, std::uint64_t seed) {
    config.validate();
    std::mt19937_64 rng(seed);
    const Index q_width = config.n_heads * config.head_dim;
    const Index kv_width = config.n_kv_heads * config.head_dim;
    GqaWeights w;
    w.w_q = random_weight<T>(config.d_model, q_width, rng);
    w.w_k = random_weight<T>(config.d_model, kv_width, rng);
    w.w_v = random_weight<T>(config.d_model, kv_width, rng);
    w.w_o = random_weight<T>(q_width, config.d_model, rng);
    if (config.qkv_bias) {
      w.b_q = random_normal<T>(1, q_width, rng, 0.5);
      w.b_k = random_normal<T>(1, kv_width, rng, 0.5);
      w.b_v = random_normal<T>(1, kv_width, rng, 0.5);
    }
    return w;
  }

  /// The same weights in another scalar type (e.g. double for a reference).
  template <class U>
  GqaWeights<U> cast() const {
    return {w_q.template cast<U>(), w_k.template cast<U>(), w_v.template cast<U>(),
            w_o.template cast<U>(), b_q.template cast<U>(), b_k.template cast<U>(),
            b_v.template cast<U>()};
  }

  /// Throws shape_error unless every matrix matches `config`.
  void check(const GqaConfig& config) const {
    constexpr const char* where = "GqaWeights";
    const Index q_width = config.n_heads * config.head_dim;
    const Index kv_width = config.n_kv_heads * config.head_dim;
    detail::check_shape(where, "w_q", w_q, config.d_model, q_width);
    detail::check_shape(where, "w_k", w_k, config.d_model, kv_width);
    detail::check_shape(where, "w_v", w_v, config.d_model, kv_width);
    detail::check_shape(where, "w_o", w_o, q_width, config.d_model);
    const Index bias_q = config.qkv_bias ? q_width : 0;
    const Index bias_kv = config.qkv_bias ? kv_width : 0;
    detail::check_shape(where, "b_q", b_q, bias_q == 0 ? -1 : 1, bias_q);
    detail::check_shape(where, "b_k", b_k, bias_kv == 0 ? -1 : 1, bias_kv);
    detail::check_shape(where, "b_v", b_v, bias_kv == 0 ? -1 : 1, bias_kv);
  }
};

namespace detail {
inline std::string describe(const GqaConfig& c) {
  return "{d_model " + std::to_string(c.d_model) + ", n_heads " + std::to_string(c.n_heads) +
         ", head_dim " + std::to_string(c.head_dim) + ", n_kv_heads " +
         std::to_string(c.n_kv_heads) + "}";
}
}  // namespace detail

/// A GQA-family attention layer. Immutable after construction: one layer may be
/// used from several threads at once, each thread decoding its own cache.
template <class T>
class GqaLayer {
 public:
  using scalar_type = T;
  template <class S = T>
  using cache_type = GqaCache<T, S>;

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

  /// An empty cache for this layer, with room for `reserve_tokens`.
  template <class S = T>
  GqaCache<T, S> make_cache(Index reserve_tokens = 0) const {
    return GqaCache<T, S>(config_, reserve_tokens);
  }

  /// Causal prefill of L new tokens x (L x d) after the cache's tokens: appends their
  /// K and V to the cache and returns the L x d output. Attention is tiled with an
  /// online softmax, so memory is O(L * d + tile^2), never L x L.
  ///
  /// With threads, the projections are split by output column and the attention by
  /// query head.
  template <class S>
  RowMatrix<T> prefill(const ConstMatrixRef<T>& x, GqaCache<T, S>& cache,
                       Threads threads = {}) const {
    check_cache(cache, "GqaLayer::prefill");
    detail::check_shape("GqaLayer::prefill", "x", x, -1, config_.d_model);
    const int thread_count = threads.resolved();
    const Index past = cache.tokens();
    const Index length = x.rows();
    RowMatrix<T> query, key, value;
    project(x, past, query, key, value, thread_count);
    cache.append(key, value);  // strong guarantee: on failure nothing changed
    RowMatrix<T> heads(length, config_.n_heads * config_.head_dim);
    attend_tiled(query, cache, past, heads, thread_count);
    RowMatrix<T> out(length, config_.d_model);
    detail::parallel_product(heads, weights_.w_o, out, thread_count);
    return out;
  }

  /// One new token x (1 x d) through the factored path: appends its K and V, attends
  /// over the whole cache and writes the 1 x d output into `out`. All query heads of
  /// a KV group are scored together against each tile of the group's keys, so each
  /// cached element is read once per step (see attend). Allocates nothing once the
  /// cache has capacity and has decoded at this thread count.
  ///
  /// x and out are taken as matrices so that a wrongly shaped argument (say 2 x d)
  /// reaches the shape check instead of failing inside Eigen's conversion.
  template <class S>
  void decode(const ConstMatrixRef<T>& x, GqaCache<T, S>& cache, MatrixRef<T> out,
              Threads threads = {}) const {
    check_cache(cache, "GqaLayer::decode");
    detail::check_shape("GqaLayer::decode", "x", x, 1, config_.d_model);
    detail::check_shape("GqaLayer::decode", "out", out, 1, config_.d_model);
    const int thread_count = threads.resolved();
    auto& ws = cache.workspace();
    cache.ensure_capacity(cache.tokens() + 1);
    const auto plan = prepare(ws, cache.tokens() + 1, thread_count);
    // Everything that may throw is done; from here the step cannot fail.
    const Index position = cache.tokens();
    detail::parallel_product(x, weights_.w_q, ws.query, thread_count);
    detail::parallel_product(x, weights_.w_k, ws.key, thread_count);
    detail::parallel_product(x, weights_.w_v, ws.value, thread_count);
    if (config_.qkv_bias) {
      ws.query += weights_.b_q;
      ws.key += weights_.b_k;
      ws.value += weights_.b_v;
    }
    const double angle_position = static_cast<double>(config_.rope.position_offset + position);
    rope_.rotate(ws.key.data(), angle_position, config_.n_kv_heads, config_.head_dim);
    cache.push_row(ws.key, ws.value);
    attend_prepared(cache, ws, plan, ws.heads.data());
    detail::parallel_product(ws.heads, weights_.w_o, out, thread_count);
  }

  /// Convenience overload returning the 1 x d output (allocates the result).
  template <class S>
  RowVector<T> decode(const ConstMatrixRef<T>& x, GqaCache<T, S>& cache,
                      Threads threads = {}) const {
    RowVector<T> out(config_.d_model);
    decode(x, cache, out, threads);
    return out;
  }

  /// The attention step alone, for the newest cached token (index tokens() - 1):
  /// `query` (1 x H*d_h) is that token's projected query x W_Q (+ b_q) before RoPE;
  /// `heads` (1 x H*d_h) receives the per-head outputs o_h, before W_O. decode is
  /// projections + append + attend + W_O. The cache is not modified.
  ///
  /// Each KV group's query heads are scored against a tile of the group's keys with
  /// one small matrix product, the tile's softmax weights folded into a running
  /// (online) softmax, and the same tile's values accumulated, so each cached element
  /// is read once per step. With threads, KV groups are spread over the threads, and
  /// when there are fewer groups than threads the sequence is split too and the
  /// partial softmax states merged exactly (flash-decoding).
  template <class S>
  void attend(const ConstMatrixRef<T>& query, GqaCache<T, S>& cache, MatrixRef<T> heads,
              Threads threads = {}) const {
    constexpr const char* where = "GqaLayer::attend";
    check_cache(cache, where);
    const Index q_width = config_.n_heads * config_.head_dim;
    detail::check_shape(where, "query", query, 1, q_width);
    detail::check_shape(where, "heads", heads, 1, q_width);
    detail::require_tokens(where, cache.tokens());
    const int thread_count = threads.resolved();
    auto& ws = cache.workspace();
    const auto plan = prepare(ws, cache.tokens(), thread_count);
    ws.query = query.row(0);
    attend_prepared(cache, ws, plan, heads.data());
  }

  /// Tokens per tile of the decode pass: about 128 KiB of keys and values, so a tile
  /// read from memory stays in L2 while the group's heads are scored and accumulated.
  Index decode_tile() const {
    const Index row_bytes = 2 * config_.head_dim * static_cast<Index>(sizeof(T));
    return std::clamp<Index>((Index{128} * 1024 / row_bytes) / 8 * 8, 8, 1024);
  }

 private:
  template <class S>
  void check_cache(const GqaCache<T, S>& cache, const char* where) const {
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
      query.rowwise() += weights_.b_q;
      key.rowwise() += weights_.b_k;
      value.rowwise() += weights_.b_v;
    }
    for (Index i = 0; i < x.rows(); ++i) {
      const double position = static_cast<double>(config_.rope.position_offset + past + i);
      rope_.rotate(query.row(i).data(), position, config_.n_heads, config_.head_dim);
      rope_.rotate(key.row(i).data(), position, config_.n_kv_heads, config_.head_dim);
    }
  }

  // Sizes the workspace for a step over `length` tokens; may allocate and throw.
  template <class Workspace>
  detail::SplitPlan prepare(Workspace& ws, Index length, int threads) const {
    const Index q_width = config_.n_heads * config_.head_dim;
    const Index kv_width = config_.n_kv_heads * config_.head_dim;
    detail::reshape(ws.query, q_width);
    detail::reshape(ws.query_transposed, q_width);
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
  // the tile's keys, then the weighted sum of the tile's values.
  template <class S>
  struct DecodeOps {
    const GqaCache<T, S>& cache;
    const T* query;             // H x d_h
    const T* query_transposed;  // per group d_h x group_size, or null (see prepare)
    Index group_size;
    Index head_dim;

    void score(Index group, Index first, Index n, T* logits, T* /*buffer*/) const {
      const T* qt =
          query_transposed != nullptr ? query_transposed + group * group_size * head_dim : nullptr;
      const Index ahead = std::min(n, cache.tokens() - first - n);
      if (ahead > 0) {  // the next tile's keys and values, while this one computes
        detail::prefetch_rows(cache.key_row(group, first + n), head_dim, ahead, head_dim);
        detail::prefetch_rows(cache.value_row(group, first + n), head_dim, ahead, head_dim);
      }
      detail::score(query + group * group_size * head_dim, qt, group_size, head_dim,
                    cache.key_row(group, first), head_dim, n, logits, group_size, false);
    }

    void accumulate(Index group, Index first, Index n, const T* weights, T* acc,
                    T* /*buffer*/) const {
      detail::accumulate(weights, group_size, group_size, cache.value_row(group, first), head_dim,
                         head_dim, n, acc, head_dim);
    }
  };

  // The attention of the newest token with ws.query (projected, not yet rotated) into
  // `heads` (H * d_h scalars). Never throws: prepare() has sized everything.
  template <class S, class Workspace>
  void attend_prepared(const GqaCache<T, S>& cache, Workspace& ws, const detail::SplitPlan& plan,
                       T* heads) const {
    const double position = static_cast<double>(config_.rope.position_offset + cache.tokens() - 1);
    rope_.rotate(ws.query.data(), position, config_.n_heads, config_.head_dim);
    ws.query *= scale_;
    const Index group = config_.group_size();
    const Index dh = config_.head_dim;
    const bool broadcast = group % detail::packet_size<T> == 0;
    if (broadcast) {  // each group's heads transposed, d_h x group, for score_broadcast
      for (Index g = 0; g < config_.n_kv_heads; ++g) {
        Eigen::Map<RowMatrix<T>>(ws.query_transposed.data() + g * group * dh, dh, group) =
            Eigen::Map<const RowMatrix<T>>(ws.query.data() + g * group * dh, group, dh).transpose();
      }
    }
    const DecodeOps<S> ops{cache, ws.query.data(), broadcast ? ws.query_transposed.data() : nullptr,
                           group, dh};
    detail::split_attention(plan, ws.split, ops, heads);
  }

  // Causal attention of `query` (the L new tokens, at cache indices past ...
  // past+L-1) over the cache, one query head at a time against its KV head's rows,
  // tiled with an online softmax (detail/causal_attention.hpp).
  template <class S>
  void attend_tiled(const RowMatrix<T>& query, const GqaCache<T, S>& cache, Index past,
                    RowMatrix<T>& heads, int threads) const {
    const Index dh = config_.head_dim;
    detail::parallel_for(config_.n_heads, threads, [&](Index h) {
      const Index g = h / config_.group_size();
      detail::causal_attention<T>(query.middleCols(h * dh, dh), cache.keys(g).template cast<T>(),
                                  cache.values(g).template cast<T>(), past, scale_,
                                  heads.middleCols(h * dh, dh));
    });
  }

  GqaConfig config_;
  GqaWeights<T> weights_;
  Rope rope_;
  T scale_ = T(1);
};

/// Named aliases: MHA is GQA with n_kv_heads == n_heads (see mha_config), MQA is
/// GQA with n_kv_heads == 1 (see mqa_config).
template <class T>
using MhaLayer = GqaLayer<T>;
template <class T>
using MqaLayer = GqaLayer<T>;

}  // namespace kvattn
