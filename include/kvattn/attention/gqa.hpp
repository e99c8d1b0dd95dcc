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
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvattn/attention/attend_states.hpp"
#include "kvattn/attention/attention_layer.hpp"
#include "kvattn/attention/decode_batch.hpp"
#include "kvattn/cache/gqa_cache.hpp"
#include "kvattn/cache/paged_gqa_cache.hpp"
#include "kvattn/config/gqa_config.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/random.hpp"
#include "kvattn/core/rope.hpp"
#include "kvattn/core/simd.hpp"
#include "kvattn/core/threads.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/detail/batch_attention.hpp"
#include "kvattn/detail/bf16_dot_kernels.hpp"
#include "kvattn/detail/causal_attention.hpp"
#include "kvattn/detail/decode_kernels.hpp"
#include "kvattn/detail/quantized_kernels.hpp"
#include "kvattn/detail/row_source.hpp"
#include "kvattn/detail/split_attention.hpp"

namespace kvattn {

namespace detail {
/// The caches a GqaLayer<T> reads and writes: GqaCache<T, S> and PagedGqaCache<T, S>.
template <class Cache, class T>
inline constexpr bool is_gqa_cache = false;
template <class T, class S>
inline constexpr bool is_gqa_cache<GqaCache<T, S>, T> = true;
template <class T, class S>
inline constexpr bool is_gqa_cache<PagedGqaCache<T, S>, T> = true;
}  // namespace detail

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

/// A GQA-family attention layer (models AttentionLayer). Immutable after construction (but
/// for set_decode_arithmetic, to be set before sharing): one layer may be used from
/// several threads at once, each with its own workspace.
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
    // decode_batch: B rows of the same, and the batch's units and states.
    RowMatrix<T> batch_query, batch_key, batch_value, batch_heads;
    RowMatrix<T> batch_stacked;  // with a shared prefix: each group's query rows, stacked
    detail::BatchScratch<T> batch;
    // DecodeArithmetic::bf16_dot: query, batch_query and batch_stacked rounded to bf16.
    RowVector<Eigen::bfloat16> query_bf16;
    RowMatrix<Eigen::bfloat16> batch_query_bf16, batch_stacked_bf16;
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
  /// How decode, decode_batch, attend and attend_states multiply with a bf16 cache
  /// (core/simd.hpp): `bf16_dot` rounds the scaled, rotated query to bf16 once per step
  /// and the softmax weights once per tile, and multiplies with the CPU's bf16
  /// dot-product instruction where the build has it (docs/api.md, "bf16 dot products");
  /// the default, `fp32`, widens the rows and multiplies in float. Groups of one query
  /// row (MHA), other caches and the expanded paths are unaffected. Not synchronized: set
  /// it before the layer is shared between threads.
  void set_decode_arithmetic(DecodeArithmetic arithmetic) { arithmetic_ = arithmetic; }
  DecodeArithmetic decode_arithmetic() const { return arithmetic_; }
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
  template <class Cache>
  requires detail::is_gqa_cache<Cache, T> RowMatrix<T> prefill(const ConstMatrixRef<T>& x,
                                                               Cache& cache, Threads threads = {})
  const {
    using S = typename Cache::storage_type;
    constexpr const char* where = "GqaLayer::prefill";
    check_cache(cache, where);
    detail::check_shape(where, "x", x, -1, config_.d_model);
    const int thread_count = threads.resolved();
    // No tokens: nothing to append or attend (and no block of an empty matrix to take).
    if (x.rows() == 0) return RowMatrix<T>(0, config_.d_model);
    const Index past = cache.sequence_length();
    const Index length = x.rows();
    const Index dh = config_.head_dim;
    RowMatrix<T> query, key, value;
    project(x, past, query, key, value, thread_count);
    query *= scale_;
    if constexpr (detail::is_quantized_storage<S>) {  // before any work: nothing to undo
      detail::require_finite(where, "keys", key);
      detail::require_finite(where, "values", value);
    }
    // The new keys and values as the cache will store them (rounded to S).
    const Staged<S> staged(key, value, config_.n_kv_heads, dh);
    const detail::CausalShape shape{
        past, past, dh, std::is_same_v<S, T> ? 0 : dh, detail::cache_segment(cache), span()};
    std::vector<detail::CausalScratch<T>> scratch(static_cast<std::size_t>(thread_count));
    for (auto& s : scratch) s.fit(shape);
    RowMatrix<T> heads(length, config_.query_width());
    const Index query_tiles = (length + detail::kPrefillTile - 1) / detail::kPrefillTile;
    detail::parallel_for(config_.n_heads * query_tiles, thread_count, [&](Index unit) {
      const Index h = unit / query_tiles;
      const Index q0 = (unit % query_tiles) * detail::kPrefillTile;
      const Index g = h / config_.group_size();
      const PrefillOps<S> ops{query.data() + h * dh, query.cols(),
                              row_source(cache, staged.key_data, g, false),
                              row_source(cache, staged.value_data, g, true), dh};
      detail::causal_query_tile(shape, scratch[static_cast<std::size_t>(detail::thread_index())],
                                ops, q0, std::min(detail::kPrefillTile, length - q0),
                                heads.data() + q0 * heads.cols() + h * dh, heads.cols(),
                                sink_logits() != nullptr ? sink_logits() + h : nullptr);
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
  template <class Cache>
  requires detail::is_gqa_cache<Cache, T>
  void decode(const ConstMatrixRef<T>& x, Cache& cache, MatrixRef<T> out, Workspace& ws,
              Threads threads = {}) const {
    constexpr const char* where = "GqaLayer::decode";
    check_cache(cache, where);
    detail::check_shape(where, "x", x, 1, config_.d_model);
    detail::check_shape(where, "out", out, 1, config_.d_model);
    const int thread_count = threads.resolved();
    auto plan = prepare(ws, cache.sequence_length() + 1, thread_count);
    plan.segment = detail::cache_segment(cache);
    const Index position = cache.sequence_length();
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
    if constexpr (detail::is_quantized_storage<typename Cache::storage_type>) {
      detail::require_finite(where, "the new token's key", ws.key);
      detail::require_finite(where, "the new token's value", ws.value);
    }
    cache.grow_for(position + 1);
    // Everything that may throw is done; from here the step cannot fail.
    cache.append_token(ws.key, ws.value);
    attend_prepared(cache, ws, plan, ws.heads.data(), position);
    detail::parallel_product(ws.heads, weights_.w_o, out, thread_count);
  }

  /// decode with a workspace of its own (allocates one on every call).
  template <class Cache>
  requires detail::is_gqa_cache<Cache, T>
  void decode(const ConstMatrixRef<T>& x, Cache& cache, MatrixRef<T> out,
              Threads threads = {}) const {
    Workspace ws = make_workspace(threads);
    decode(x, cache, out, ws, threads);
  }

  /// decode returning the 1 x d output (allocates it and a workspace on every call).
  template <class Cache>
  requires detail::is_gqa_cache<Cache, T> RowVector<T> decode(const ConstMatrixRef<T>& x,
                                                              Cache& cache, Threads threads = {})
  const {
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
  template <class Cache>
  requires detail::is_gqa_cache<Cache, T>
  void attend(const ConstMatrixRef<T>& query, const Cache& cache, MatrixRef<T> heads, Workspace& ws,
              Threads threads = {}) const {
    constexpr const char* where = "GqaLayer::attend";
    check_cache(cache, where);
    detail::check_shape(where, "query", query, 1, query_width());
    detail::check_shape(where, "heads", heads, 1, heads_width());
    detail::require_tokens(where, cache.sequence_length());
    const int thread_count = threads.resolved();
    auto plan = prepare(ws, cache.sequence_length(), thread_count);
    plan.segment = detail::cache_segment(cache);
    ws.query = query.row(0);
    attend_prepared(cache, ws, plan, heads.data(), cache.sequence_length() - 1);
  }

  /// attend with a workspace of its own (allocates one on every call).
  template <class Cache>
  requires detail::is_gqa_cache<Cache, T>
  void attend(const ConstMatrixRef<T>& query, const Cache& cache, MatrixRef<T> heads,
              Threads threads = {}) const {
    Workspace ws = make_workspace(threads);
    attend(query, cache, heads, ws, threads);
  }

  /// The queries of x (n x d) as attend and attend_states take them: x W_Q (+ bias_q),
  /// n x H*d_h, before RoPE.
  RowMatrix<T> project_query(const ConstMatrixRef<T>& x, Threads threads = {}) const {
    detail::check_shape("GqaLayer::project_query", "x", x, -1, config_.d_model);
    RowMatrix<T> query(x.rows(), config_.query_width());
    detail::parallel_product(x, weights_.w_q, query, threads.resolved());
    if (config_.qkv_bias) query.rowwise() += weights_.bias_q;
    return query;
  }

  /// Appends the keys and values of x's n tokens (n x d) without attending: what prefill
  /// appends, for a cache that holds part of a sequence whose attention is computed
  /// elsewhere (attention/attend_states.hpp). Strong exception guarantee.
  template <class Cache>
  requires detail::is_gqa_cache<Cache, T>
  void append(const ConstMatrixRef<T>& x, Cache& cache, Threads threads = {}) const {
    constexpr const char* where = "GqaLayer::append";
    check_cache(cache, where);
    detail::check_shape(where, "x", x, -1, config_.d_model);
    if (x.rows() == 0) return;
    RowMatrix<T> key, value;
    project_rows(x, cache.sequence_length(), key, value, threads.resolved());
    cache.append(key, value);
  }

  /// The partial softmax state of each query head over the tokens of `cache` that a
  /// query at sequence index `position` sees (attention/attend_states.hpp): states gets
  /// H rows of d_h, without the sink logits. Allocates nothing once states and the
  /// workspace have their size. config_error for a layer with a sliding window.
  template <class Cache>
  requires detail::is_gqa_cache<Cache, T>
  void attend_states(const ConstMatrixRef<T>& query, Index position, const Cache& cache,
                     SoftmaxStates<T>& states, Workspace& ws, Threads threads = {}) const {
    constexpr const char* where = "GqaLayer::attend_states";
    check_cache(cache, where);
    detail::check_shape(where, "query", query, 1, query_width());
    const Index visible =
        detail::states_visible(where, config_.window, position, cache.sequence_length());
    states.reset(config_.n_heads, config_.head_dim);
    if (visible == 0) return;
    auto plan = prepare(ws, visible, threads.resolved());
    plan.segment = detail::cache_segment(cache);
    ws.query = query.row(0);
    attend_prepared(cache, ws, plan, ws.heads.data(), position, states.max.data(),
                    states.sum.data());
    detail::states_from_heads(ws.heads.data(), states);
  }

  /// One new token for each of B sequences (docs/api.md, attention/decode_batch.hpp): x
  /// and out are B x d, caches B distinct caches of one type. Row s of out is what
  /// decode(x.row(s), *caches[s], ...) writes, and each cache gets its token. The
  /// projections are B x d products (the weights read once for the batch); the attention
  /// runs in (sequence x KV group x token range) units over the threads. With
  /// options.shared_prefix = P > 0 (paged caches holding tokens [0, P) in the same pool
  /// pages), each KV group's prefix keys and values are read once for all B sequences'
  /// query rows and merged with each sequence's own tokens (cascade attention).
  /// Allocates nothing once the workspace has run a batch of this shape. A call that
  /// throws appends to no cache and leaves every cache's rows as they were (a cache may
  /// keep capacity grown for the step; pages taken from a pool are given back).
  template <class Cache>
  requires detail::is_gqa_cache<Cache, T>
  void decode_batch(const ConstMatrixRef<T>& x, std::span<Cache* const> caches, MatrixRef<T> out,
                    Workspace& ws, Threads threads = {}, BatchOptions options = {}) const {
    constexpr const char* where = "GqaLayer::decode_batch";
    const Index batch = static_cast<Index>(caches.size());
    detail::check_shape(where, "x", x, batch, config_.d_model);
    detail::check_shape(where, "out", out, batch, config_.d_model);
    detail::check_batch_caches(where, caches);
    for (const Cache* cache : caches) check_cache(*cache, where);
    const int thread_count = threads.resolved();
    // With a window each sequence reads its own window: no shared prefix (docs/serving.md).
    const Index prefix = config_.window > 0
                             ? 0
                             : detail::checked_shared_prefix(where, caches, options.shared_prefix);
    if (batch == 0) return;
    prepare_batch(ws, caches, prefix, thread_count);
    const Index dh = config_.head_dim;
    const Index group = config_.group_size();
    detail::parallel_product(x, weights_.w_q, ws.batch_query, thread_count);
    detail::parallel_product(x, weights_.w_k, ws.batch_key, thread_count);
    detail::parallel_product(x, weights_.w_v, ws.batch_value, thread_count);
    for (Index s = 0; s < batch; ++s) {
      Cache& cache = *caches[static_cast<std::size_t>(s)];
      auto query = ws.batch_query.row(s);
      auto key = ws.batch_key.row(s);
      auto value = ws.batch_value.row(s);
      if (config_.qkv_bias) {
        query += weights_.bias_q;
        key += weights_.bias_k;
        value += weights_.bias_v;
      }
      const double position =
          static_cast<double>(config_.rope.position_offset + cache.sequence_length());
      rope_.rotate(key.data(), position, config_.n_kv_heads, dh);
      rope_.rotate(query.data(), position, config_.n_heads, dh);
      query *= scale_;
      if (paired_query<Cache>()) {
        for (Index h = 0; h < config_.n_heads; ++h) detail::to_paired(query.data() + h * dh, dh);
      }
    }
    if constexpr (detail::is_quantized_storage<typename Cache::storage_type>) {
      detail::require_finite(where, "the new tokens' keys", ws.batch_key);
      detail::require_finite(where, "the new tokens' values", ws.batch_value);
    }
    detail::BatchGrowth::grow(caches);
    // Everything that may throw is done; from here the step cannot fail.
    for (Index s = 0; s < batch; ++s) {
      caches[static_cast<std::size_t>(s)]->append_token(ws.batch_key.row(s), ws.batch_value.row(s));
    }
    // Sources 0 ... B-1: the sequences; source B: the shared prefix, read through the first
    // cache with every sequence's query rows of a group stacked.
    if (prefix > 0) stack_prefix_queries(ws, batch);
    const T* stacked = ws.batch_stacked.data();
    const bool paired = paired_query<Cache>();
    const Eigen::bfloat16* rounded = rounded_queries<Cache>(ws.batch_query, ws.batch_query_bf16);
    const Eigen::bfloat16* rounded_stacked =
        prefix > 0 ? rounded_queries<Cache>(ws.batch_stacked, ws.batch_stacked_bf16) : nullptr;
    detail::run_batch(ws.batch, [&](Index source) {
      if (source == batch) {
        return DecodeOps<Cache>{*caches[0],         stacked, batch * group,  dh,
                                batch * group * dh, paired,  rounded_stacked};
      }
      return DecodeOps<Cache>{
          *caches[static_cast<std::size_t>(source)],
          ws.batch_query.row(source).data(),
          group,
          dh,
          group * dh,
          paired,
          rounded != nullptr ? rounded + source * config_.query_width() : nullptr};
    });
    detail::finish_batch(ws.batch, ws.batch_heads.data());
    restore_order<Cache>(ws.batch_heads.data(), batch * config_.n_heads, rounded != nullptr);
    detail::parallel_product(ws.batch_heads, weights_.w_o, out, thread_count);
  }

  /// decode_batch with a workspace of its own (allocates one on every call).
  template <class Cache>
  requires detail::is_gqa_cache<Cache, T>
  void decode_batch(const ConstMatrixRef<T>& x, std::span<Cache* const> caches, MatrixRef<T> out,
                    Threads threads = {}, BatchOptions options = {}) const {
    Workspace ws = make_workspace(threads);
    decode_batch(x, caches, out, ws, threads, options);
  }

  /// Tokens per tile of the decode pass (one online-softmax update per tile): about
  /// 1 MiB of keys and values (1024 tokens at d_h = 128 in fp32). Each pass streams its
  /// own block (and prefetches it), so the tile need not stay in cache; it sets how often
  /// the softmax state is rescaled and how often the reading switches between the key
  /// and the value block, each switch a new stream for the prefetchers to pick up.
  /// Measured on AVX-512 (37 GB/s, MHA fp32, L = 65536, one thread): 256 tokens 0.93,
  /// 1024 1.00, 4096 1.01 of the read-only bandwidth; GQA and MQA the same at all three.
  Index decode_tile() const {
    const Index row_bytes = 2 * config_.head_dim * static_cast<Index>(sizeof(T));
    return std::clamp<Index>((Index{1024} * 1024 / row_bytes) / 8 * 8, 8, 4096);
  }

 private:
  // The window, sink tokens and soft-cap the kernels apply; the sink logits (one per
  // query head) or nullptr.
  detail::AttentionSpan span() const { return detail::AttentionSpan::of(config_); }
  const T* sink_logits() const { return config_.sink_logits ? weights_.sinks.data() : nullptr; }

  template <class Cache>
  void check_cache(const Cache& cache, const char* where) const {
    if (!(cache.config() == config_)) {
      throw config_error(std::string(where) + ": the cache was made for config " +
                         detail::describe(cache.config()) + " (or other RoPE/bias settings)" +
                         ", the layer has " + detail::describe(config_));
    }
  }

  // Q, K, V of x with biases and RoPE; token i sits at cache index past + i.
  void project(const ConstMatrixRef<T>& x, Index past, RowMatrix<T>& query, RowMatrix<T>& key,
               RowMatrix<T>& value, int threads) const {
    query = project_query(x, Threads{threads});
    for (Index i = 0; i < x.rows(); ++i) {
      const double position = static_cast<double>(config_.rope.position_offset + past + i);
      rope_.rotate(query.row(i).data(), position, config_.n_heads, config_.head_dim);
    }
    project_rows(x, past, key, value, threads);
  }

  // K and V of x as the cache stores them (biases, RoPE on K): what append needs, without
  // the query's projection (W_Q is the largest weight a decode step reads).
  void project_rows(const ConstMatrixRef<T>& x, Index past, RowMatrix<T>& key, RowMatrix<T>& value,
                    int threads) const {
    key.resize(x.rows(), weights_.w_k.cols());
    value.resize(x.rows(), weights_.w_v.cols());
    detail::parallel_product(x, weights_.w_k, key, threads);
    detail::parallel_product(x, weights_.w_v, value, threads);
    if (config_.qkv_bias) {
      key.rowwise() += weights_.bias_k;
      value.rowwise() += weights_.bias_v;
    }
    for (Index i = 0; i < x.rows(); ++i) {
      const double position = static_cast<double>(config_.rope.position_offset + past + i);
      rope_.rotate(key.row(i).data(), position, config_.n_kv_heads, config_.head_dim);
    }
  }

  // A prefill's new keys and values in storage type S: the projections themselves
  // when S is T, else rounded (or quantized) copies, laid out as the cache's rows: token
  // i's KV head g at (i * n_kv + g) * row_stride.
  template <class S>
  struct Staged {
    using Element = detail::storage_element_t<S>;
    RowMatrix<Element> keys, values;  // empty when S is T
    const Element* key_data;
    const Element* value_data;
    Staged(const RowMatrix<T>& key, const RowMatrix<T>& value, Index n_kv, Index head_dim) {
      using Traits = detail::StorageTraits<S>;
      if constexpr (std::is_same_v<S, T>) {
        key_data = key.data();
        value_data = value.data();
      } else if constexpr (Traits::quantized) {
        const Index stride = Traits::row_elements(head_dim);
        keys.resize(key.rows(), n_kv * stride);
        values.resize(value.rows(), n_kv * stride);
        for (Index i = 0; i < key.rows(); ++i) {
          for (Index g = 0; g < n_kv; ++g) {
            Traits::encode([&](Index j) { return key(i, g * head_dim + j); }, head_dim,
                           keys.data() + (i * n_kv + g) * stride);
            Traits::encode([&](Index j) { return value(i, g * head_dim + j); }, head_dim,
                           values.data() + (i * n_kv + g) * stride);
          }
        }
        key_data = keys.data();
        value_data = values.data();
      } else {
        keys = key.template cast<S>();
        values = value.template cast<S>();
        key_data = keys.data();
        value_data = values.data();
      }
    }
  };

  // KV group g's keys (or values) for a prefill: the cache's rows, then the new ones.
  template <class Cache>
  auto row_source(const Cache& cache, const typename Cache::element_type* fresh, Index g,
                  bool values) const {
    using S = typename Cache::storage_type;
    const Index stride = cache.row_stride();
    detail::RowSource<S> source{nullptr, stride, fresh + g * stride, config_.n_kv_heads * stride,
                                cache.sequence_length()};
    source.quantized_width = config_.head_dim;
    if constexpr (requires { cache.page_tokens(); }) {
      source.paged = &cache.rows_;
      source.block = values ? config_.n_kv_heads + g : g;
    } else {
      source.cached = values ? cache.value_row(g, 0) : cache.key_row(g, 0);
    }
    return source;
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
    detail::reshape(ws.query_bf16, uses_bf16_dot() ? q_width : 0);
    const Index tile = decode_tile();
    const Index buffer_width = 0;
    const auto plan = detail::plan_split(config_.n_kv_heads, config_.group_size(), config_.head_dim,
                                         length, tile, buffer_width, threads, span());
    ws.split.fit(plan);
    return plan;
  }

  // Sizes the workspace and plans the units of a decode_batch step (the caches' lengths
  // after the new token); may allocate and throw.
  template <class Cache>
  void prepare_batch(Workspace& ws, std::span<Cache* const> caches, Index prefix,
                     int threads) const {
    const Index batch = static_cast<Index>(caches.size());
    const Index q_width = config_.query_width();
    const Index kv_width = config_.kv_width();
    const Index groups = config_.n_kv_heads;
    const Index group = config_.group_size();
    detail::reshape(ws.batch_query, batch, q_width);
    detail::reshape(ws.batch_key, batch, kv_width);
    if (prefix > 0) detail::reshape(ws.batch_stacked, batch, q_width);
    detail::reshape(ws.batch_query_bf16, uses_bf16_dot() ? batch : 0, q_width);
    if (prefix > 0) detail::reshape(ws.batch_stacked_bf16, uses_bf16_dot() ? batch : 0, q_width);
    detail::reshape(ws.batch_value, batch, kv_width);
    detail::reshape(ws.batch_heads, batch, q_width);
    auto& b = ws.batch;
    b.tile = decode_tile();
    b.segment = detail::cache_segment(*caches[0]);
    b.width = config_.head_dim;
    b.units.clear();
    Index slot = 0;
    detail::plan_batch_units(b.units, slot, caches, prefix, groups, group, b.tile, threads, span());
    b.softcap = config_.logit_softcap;
    b.sinks = sink_logits();
    b.heads = config_.n_heads;
    b.fit(batch * config_.n_heads, threads);
  }

  // Every sequence's query rows of KV group g, stacked (B * group_size rows of d_h per
  // group, groups one after the other), into ws.batch_stacked.
  void stack_prefix_queries(Workspace& ws, Index batch) const {
    const Index dh = config_.head_dim;
    const Index group = config_.group_size();
    T* stacked = ws.batch_stacked.data();
    for (Index g = 0; g < config_.n_kv_heads; ++g) {
      for (Index s = 0; s < batch; ++s) {
        const T* q = ws.batch_query.row(s).data() + g * group * dh;
        std::copy(q, q + group * dh, stacked + (g * batch + s) * group * dh);
      }
    }
  }

  // One KV group's tiles: logits of the group's query heads (scaled, rotated) against
  // the tile's keys, then the weighted sum of the tile's values. Keys and values are two
  // dense blocks per group, each read front to back a tile at a time, and each pass
  // prefetches its own block 8 KiB ahead (detail::Prefetcher): without it, on an AVX-512
  // machine reading 37 GB/s, the score pass of a 4-head group waited on memory between
  // its register blocks (0.58 -> 0.98 of the read-only bandwidth, GQA fp32, L = 65536).
  //
  // bf16 rows are read in pairs (packet_ops.hpp), the query then in paired order and the
  // output put back in order. AVX2 pairs the accumulate (detail::paired_rows) and the
  // score of one query row per group (MHA; with more rows its 16-register score measured
  // no faster). AVX-512 pairs the score of groups of 2 or more rows that do not take the
  // outer-product score (GQA; MQA's 32 rows do): widening each key packet was what bound
  // it (kernel-only, 4 rows: 10.2 -> 7.7 ns per token); its accumulate stays widened.
  template <class Cache>
  struct DecodeOps {
    using S = typename Cache::storage_type;
    const Cache& cache;
    const T* query;  // group g's rows at query + g * group_stride, d_h apart
    Index group_size;
    Index head_dim;
    Index group_stride;
    bool paired_query;  // the query is in paired order (see paired_score)
    // The query rounded to bf16, laid out as `query` (DecodeArithmetic::bf16_dot on a bf16
    // cache, see rounded_queries), or null.
    const Eigen::bfloat16* query_bf16 = nullptr;

    // Whether a layer with groups of group_size query rows scores bf16 keys in pairs.
    static bool paired_score(Index group_size, Index head_dim) {
#if defined(EIGEN_VECTORIZE_AVX512)
      return group_size >= 2 && !detail::kernels::outer_score<T>(group_size, head_dim) &&
             detail::paired_rows<T, S>(head_dim);
#else
      return group_size == 1 && detail::paired_rows<T, S>(head_dim);
#endif
    }

    // Whether a pass's prefetches touch their rows' pages ahead (detail::Prefetcher). A
    // pass that waits on memory gains, one that waits on its arithmetic loses a little.
    // In AVX-512 builds the fp32 and bf16 passes gained (one core, cold caches: MHA and
    // GQA 1.05-1.5x as fast; MQA 0.89-1.08x in loops of steps, its kvattn_bench rows about
    // 1.2x); in an AVX2 build only the passes with at most one multiply-add per cached
    // byte gained (fp32 MHA and GQA of 4 rows 1.2-1.3x, bf16 MHA 1.05x), the others lost
    // (bf16 GQA 8-20%, MQA 4-9%). Quantized rows: not measured, no touches.
    static constexpr bool touch_pages(Index group_size) {
      if constexpr (detail::is_quantized_storage<S>) {
        return false;
      } else {
#if defined(EIGEN_VECTORIZE_AVX512)
        (void)group_size;
        return true;
#else
        return group_size <= Index{sizeof(S)};
#endif
      }
    }

    // Whether the touches go on past the prefetch range, over the later tiles' rows on the
    // same page (Prefetcher::touch_past): in AVX-512 builds, for fp32 rows shared by 2-4
    // query rows. kvattn_bench, builds with and without them run in turn, one thread, L =
    // 16384 and 65536: fp32 GQA (4 rows) 0.95-1.28 of the read pass with them, 0.78-0.98 without,
    // faster in each of 10 comparisons; MHA (1 row) within the noise (fp32 1.11-1.26
    // against 1.15-1.34); fp32 MQA (32 rows) 0.61-0.87 against 0.79-0.93 and bf16 GQA
    // 0.74-0.89 against 0.81-0.95, slower. Groups of 2 and 3 rows were not measured.
    static constexpr bool touch_past_pages(Index group_size) {
#if defined(EIGEN_VECTORIZE_AVX512)
      return std::is_same_v<S, float> && group_size >= 2 && group_size <= 4;
#else
      (void)group_size;
      return false;
#endif
    }

    // The group's key (or value) rows kPrefetchAhead bytes past those of the tile
    // [first, first + n): in a paged cache the part on the tile's page, then the part on
    // the next page (without the second part each page began with 8 KiB not prefetched).
    detail::Prefetcher prefetch_ahead(bool keys, Index group, Index first, Index n) const {
      using Element = detail::storage_element_t<S>;
      const Index row_bytes = cache.row_stride() * Index{sizeof(Element)};
      const Index ahead = std::max<Index>(1, kPrefetchAhead / row_bytes);
      const Index last = std::min(cache.sequence_length(), first + n + ahead);
      const Index begin = first + ahead;
      // Rows on begin's page (contiguous_rows is 0 past the end or where none are held).
      const Index count = std::min(last - begin, detail::contiguous_rows(cache, begin));
      if (count <= 0) return {};
      auto rows = [&](Index t) {
        return keys ? cache.key_row(group, t) : cache.value_row(group, t);
      };
      const Index next = begin + count;
      const Index count2 = std::min(last - next, detail::contiguous_rows(cache, next));
      detail::Prefetcher ranges = count2 <= 0 ? detail::Prefetcher(rows(begin), count * row_bytes)
                                              : detail::Prefetcher(rows(begin), count * row_bytes,
                                                                   rows(next), count2 * row_bytes);
      ranges.touch = touch_pages(group_size);
      if (touch_past_pages(group_size)) {
        // The rows after the last one prefetched, on its page: in memory right after the
        // range.
        const Index tail = count2 <= 0 ? next : next + count2;
        const Index more = std::min(detail::contiguous_rows(cache, tail - 1) - 1,
                                    detail::Prefetcher::kPageLead / row_bytes + 1);
        ranges.touch_past = std::max<Index>(0, more) * row_bytes;
      }
      return ranges;
    }

    void score(Index group, Index first, Index n, T* logits, Index ld, T* spare) const {
      detail::Prefetcher keys = prefetch_ahead(true, group, first, n);
      if constexpr (bf16_dot_cache<Cache>) {
        if (dot_score(query_bf16, group_size, head_dim)) {
          detail::score_rows_bf16_dot(query_bf16 + group * group_stride, head_dim, group_size,
                                      head_dim, cache.key_row(group, first), head_dim, n, logits,
                                      ld, &keys);
          return;
        }
      }
      if constexpr (detail::is_quantized_storage<S>) {
        detail::score_quantized<T, S>(query + group * group_stride, head_dim, group_size,
                                      cache.key_row(group, first), cache.row_stride(), head_dim, n,
                                      logits, ld, spare, &keys);
      } else {
        detail::score_rows(query + group * group_stride, head_dim, group_size, head_dim,
                           cache.key_row(group, first), head_dim, 0, n, logits, ld, false, &keys,
                           nullptr, paired_query);
      }
    }

    void accumulate(Index group, Index first, Index n, const T* weights, Index ld, T* acc,
                    T* spare) const {
      detail::Prefetcher values = prefetch_ahead(false, group, first, n);
      if constexpr (bf16_dot_cache<Cache>) {
        if (query_bf16 != nullptr && dot_values(head_dim)) {
          detail::accumulate_rows_bf16_dot(
              weights, ld, group_size, cache.value_row(group, first), head_dim, head_dim, n, acc,
              head_dim, reinterpret_cast<Eigen::bfloat16*>(spare), &values, kTokenBlock);
          return;
        }
      }
      if constexpr (detail::is_quantized_storage<S>) {
        detail::accumulate_quantized<T, S>(weights, ld, group_size, cache.value_row(group, first),
                                           cache.row_stride(), head_dim, n, acc, head_dim,
                                           kTokenBlock, &values, spare);
      } else {
        (void)spare;
        detail::accumulate_rows(weights, ld, group_size, cache.value_row(group, first), head_dim, 0,
                                head_dim, n, acc, head_dim, kTokenBlock, &values,
                                detail::paired_rows<T, S>(head_dim));
      }
    }
  };

  // Whether a step over a Cache may take the bf16 dot kernels (DecodeArithmetic::bf16_dot:
  // plain bf16 rows, float queries, a build with the instruction), and whether this layer
  // does: not with one query row per group (MHA), whose step measured no faster with them
  // (0.66-0.88 of its roofline against 0.76-0.95 widened, alternating runs of a build that
  // still gave MHA the setting, L = 16384 and 65536): its float kernels do not bound it.
  template <class Cache>
  static constexpr bool bf16_dot_cache = detail::bf16_dot_storage<T, typename Cache::storage_type>;
  bool uses_bf16_dot() const {
    return bf16_dot_available() && std::is_same_v<T, float> &&
           arithmetic_ == DecodeArithmetic::bf16_dot && config_.group_size() >= 2;
  }
  // Which passes of a bf16 dot step take the dot kernels: the score, unless its rows take
  // the float outer-product score (outer_score: MQA's 32 rows x 128, kernel-only 48 ns per
  // token against 78 by the dot kernel, bf16_dot_kernels.hpp; a shared prefix's stacked
  // rows in decode_batch); the values, where d_h is whole chunks of 32.
  static bool dot_score(const Eigen::bfloat16* query_bf16, Index rows, Index head_dim) {
#if KVATTN_HAVE_BF16_DOT  // (outer_score exists in AVX-512 builds only)
    return query_bf16 != nullptr && !detail::kernels::outer_score<T>(rows, head_dim);
#else
    (void)query_bf16, (void)rows, (void)head_dim;
    return false;
#endif
  }
  static constexpr bool dot_values(Index head_dim) { return detail::bf16_dot_values(head_dim); }

  // The queries (scaled, rotated, in order) rounded into `rounded` (sized by prepare) when
  // a step over a Cache takes the bf16 dot kernels, else null.
  template <class Cache, class Queries, class Rounded>
  const Eigen::bfloat16* rounded_queries(const Queries& queries, Rounded& rounded) const {
    if constexpr (bf16_dot_cache<Cache>) {
      if (uses_bf16_dot()) {
        rounded.noalias() = queries.template cast<Eigen::bfloat16>();  // nearest, ties even
        return rounded.data();
      }
    }
    (void)queries, (void)rounded;
    return nullptr;
  }
  // Whether a step over a Cache reads bf16 keys in pairs, the query then in paired order
  // (DecodeOps::paired_score); never with the bf16 dot kernels, which take it in order.
  template <class Cache>
  bool paired_query() const {
    if constexpr (bf16_dot_cache<Cache>) {
      if (uses_bf16_dot()) return false;
    }
    return DecodeOps<Cache>::paired_score(config_.group_size(), config_.head_dim);
  }
  // Puts `rows` output rows (d_h each) back in column order after a step over a Cache whose
  // values were summed by the bf16 dot kernel (`rounded`: the step had a rounded query)
  // or in pairs.
  template <class Cache>
  void restore_order(T* heads, Index rows, bool rounded) const {
    const Index dh = config_.head_dim;
    if (rounded && dot_values(dh)) {
      detail::from_bf16_dot_order(heads, rows, dh);
    } else if (detail::paired_rows<T, typename Cache::storage_type>(dh)) {
      for (Index r = 0; r < rows; ++r) detail::from_paired(heads + r * dh, dh);
    }
  }

  // Tokens per accumulate block (see detail::accumulate_rows), and how far ahead of the
  // value rows being summed the accumulate prefetches (measured best at 4-8 KiB).
  static constexpr Index kTokenBlock = 16;
  static constexpr Index kPrefetchAhead = 8 * 1024;

  // The attention of the query in ws.query (projected, not yet rotated) at sequence index
  // `position` over the plan's tokens into `heads` (H * d_h scalars). With row_max /
  // row_sum, each head's max and normalizer go there and the sink logits are left out
  // (attend_states). Never throws: prepare() has sized everything.
  template <class Cache>
  void attend_prepared(const Cache& cache, Workspace& ws, const detail::SplitPlan& plan, T* heads,
                       Index position, T* row_max = nullptr, T* row_sum = nullptr) const {
    const double angle = static_cast<double>(config_.rope.position_offset + position);
    rope_.rotate(ws.query.data(), angle, config_.n_heads, config_.head_dim);
    ws.query *= scale_;
    const Index group = config_.group_size();
    const Index dh = config_.head_dim;
    const bool paired = paired_query<Cache>();
    if (paired) {
      for (Index h = 0; h < config_.n_heads; ++h) detail::to_paired(ws.query.data() + h * dh, dh);
    }
    const Eigen::bfloat16* rounded = rounded_queries<Cache>(ws.query, ws.query_bf16);
    const DecodeOps<Cache> ops{cache, ws.query.data(), group, dh, group * dh, paired, rounded};
    detail::split_attention(plan, ws.split, ops, heads,
                            row_max != nullptr ? nullptr : sink_logits(), row_max, row_sum);
    restore_order<Cache>(heads, config_.n_heads, rounded != nullptr);
  }

  GqaConfig config_;
  GqaWeights<T> weights_;
  Rope rope_;
  T scale_ = T(1);
  DecodeArithmetic arithmetic_ = DecodeArithmetic::fp32;
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
