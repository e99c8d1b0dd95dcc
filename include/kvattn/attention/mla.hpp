// Multi-head latent attention (MLA, DeepSeek-V2) with decoupled RoPE, YaRN and an
// absorbed decode that never materializes a per-head key or value of a cached token.
//
// Shapes (rows are tokens, weights are `in x out`, Y = X * W):
//   x          L x d                       input hidden states
//   queries, with compression (q_rank = d_c' > 0):
//     w_dq     d x d_c'                    c_q = x w_dq, then RMSNorm (q_norm_gain 1 x d_c')
//     w_uq     d_c' x H*(d_nope + d_R)     q = c_q w_uq
//   queries, without compression (q_rank = 0):
//     w_q      d x H*(d_nope + d_R)        q = x w_q
//   head h's query is q[:, h*(d_nope+d_R) ...]: content part q_h^nope (d_nope) first,
//   then the rope part q_h^R (d_R), rotated at the token's position.
//   keys and values:
//     w_dkv    d x d_c                     c_kv = RMSNorm(x w_dkv) (kv_norm_gain 1 x d_c)
//     w_kr     d x d_R                     k_R = RoPE(x w_kr), shared by all heads
//     w_uk     d_c x H*d_nope              W_UK_h = w_uk[:, h*d_nope ...], k_h^nope = c_kv W_UK_h
//     w_uv     d_c x H*d_v                 W_UV_h = w_uv[:, h*d_v ...],    v_h = c_kv W_UV_h
//   output:
//     w_o      H*d_v x d                   y = [o_1 ... o_H] w_o
//   cache      per token [c_kv | k_R], d_c + d_R elements (see MlaCache)
//   output     L x d
//
// Head h's logit for query t and key j (seed 002, Chapter 3, decoupled RoPE):
//   s_h,t,j = scale * ([q_h^nope ; q_h^R]_t . [k_h^nope ; k_R]_j)
//           = scale * ((q_h,t^nope W_UK_h^T) . c_j + q_h,t^R . k_R,j)      (absorbed)
// with scale = 1/sqrt(d_nope + d_R) * m^2 (MlaConfig::scale()).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvattn/attention/attend_states.hpp"
#include "kvattn/attention/attention_layer.hpp"
#include "kvattn/attention/decode_batch.hpp"
#include "kvattn/cache/mla_cache.hpp"
#include "kvattn/cache/paged_mla_cache.hpp"
#include "kvattn/config/mla_config.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/random.hpp"
#include "kvattn/core/rms_norm.hpp"
#include "kvattn/core/rope.hpp"
#include "kvattn/core/simd.hpp"
#include "kvattn/core/threads.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/core/yarn.hpp"
#include "kvattn/detail/batch_attention.hpp"
#include "kvattn/detail/bf16_dot_kernels.hpp"
#include "kvattn/detail/causal_attention.hpp"
#include "kvattn/detail/decode_kernels.hpp"
#include "kvattn/detail/quantized_kernels.hpp"
#include "kvattn/detail/row_source.hpp"
#include "kvattn/detail/split_attention.hpp"
#include "kvattn/detail/transposed_score.hpp"

namespace kvattn {

namespace detail {
/// The caches an MlaLayer<T> reads and writes: MlaCache<T, S> and PagedMlaCache<T, S>.
template <class Cache, class T>
inline constexpr bool is_mla_cache = false;
template <class T, class S>
inline constexpr bool is_mla_cache<MlaCache<T, S>, T> = true;
template <class T, class S>
inline constexpr bool is_mla_cache<PagedMlaCache<T, S>, T> = true;
}  // namespace detail

/// How prefill computes attention (decode is always absorbed).
enum class MlaPrefill {
  automatic,  ///< whichever of the two below costs fewer FLOPs for this call
  expanded,   ///< reconstruct k_h^nope = C W_UK_h, v_h = C W_UV_h per head, then attend
  absorbed,   ///< score absorbed queries against the latent rows, as decode does
};

/// The projection weights of an MLA layer, in DeepSeek-V2's layout (`in x out`).
/// Matrices a config does not use are empty (0 x 0).
template <class T>
struct MlaWeights {
  RowMatrix<T> w_dq;          // d x d_c'                (q_rank > 0)
  RowVector<T> q_norm_gain;   // 1 x d_c'                (q_norm)
  RowMatrix<T> w_uq;          // d_c' x H*(d_nope+d_R)   (q_rank > 0)
  RowMatrix<T> w_q;           // d x H*(d_nope+d_R)      (q_rank == 0)
  RowMatrix<T> w_dkv;         // d x d_c
  RowVector<T> kv_norm_gain;  // 1 x d_c                 (kv_norm)
  RowMatrix<T> w_kr;          // d x d_R
  RowMatrix<T> w_uk;          // d_c x H*d_nope
  RowMatrix<T> w_uv;          // d_c x H*d_v
  RowMatrix<T> w_o;           // H*d_v x d
  RowVector<T> sinks;         // 1 x H, the per-head sink logits (sink_logits only, else empty)

  /// Weights drawn from N(0, 1/fan_in); RMSNorm gains from 1 + N(0, 0.2^2).
  static MlaWeights random(const MlaConfig& config, std::uint64_t seed) {
    config.validate();
    std::mt19937_64 rng(seed);
    const MlaConfig& c = config;
    auto gain = [&rng](Index n) -> RowVector<T> {
      return (random_normal<T>(1, n, rng, 0.2).array() + T(1)).matrix();
    };
    MlaWeights w;
    if (c.q_rank > 0) {
      w.w_dq = random_weight<T>(c.d_model, c.q_rank, rng);
      if (c.q_norm) w.q_norm_gain = gain(c.q_rank);
      w.w_uq = random_weight<T>(c.q_rank, c.query_width(), rng);
    } else {
      w.w_q = random_weight<T>(c.d_model, c.query_width(), rng);
    }
    w.w_dkv = random_weight<T>(c.d_model, c.kv_rank, rng);
    if (c.kv_norm) w.kv_norm_gain = gain(c.kv_rank);
    w.w_kr = random_weight<T>(c.d_model, c.rope_dim, rng);
    w.w_uk = random_weight<T>(c.kv_rank, c.n_heads * c.qk_nope_dim, rng);
    w.w_uv = random_weight<T>(c.kv_rank, c.n_heads * c.v_dim, rng);
    w.w_o = random_weight<T>(c.n_heads * c.v_dim, c.d_model, rng);
    // Drawn last, so a config without sink logits keeps the weights it always had.
    if (config.sink_logits) w.sinks = random_normal<T>(1, config.n_heads, rng);
    return w;
  }

  /// The same weights in another scalar type (e.g. double for a reference).
  template <class U>
  MlaWeights<U> cast() const {
    return {
        w_dq.template cast<U>(), q_norm_gain.template cast<U>(), w_uq.template cast<U>(),
        w_q.template cast<U>(),  w_dkv.template cast<U>(),       kv_norm_gain.template cast<U>(),
        w_kr.template cast<U>(), w_uk.template cast<U>(),        w_uv.template cast<U>(),
        w_o.template cast<U>(),  sinks.template cast<U>()};
  }

  /// Throws shape_error unless every matrix matches `config` (unused ones empty).
  void check(const MlaConfig& config) const {
    constexpr const char* where = "MlaWeights";
    const MlaConfig& c = config;
    const bool compressed = c.q_rank > 0;
    detail::check_shape(where, "w_dq", w_dq, compressed ? c.d_model : 0, compressed ? c.q_rank : 0);
    detail::check_shape(where, "q_norm_gain", q_norm_gain, c.q_norm ? 1 : -1,
                        c.q_norm ? c.q_rank : 0);
    detail::check_shape(where, "w_uq", w_uq, compressed ? c.q_rank : 0,
                        compressed ? c.query_width() : 0);
    detail::check_shape(where, "w_q", w_q, compressed ? 0 : c.d_model,
                        compressed ? 0 : c.query_width());
    detail::check_shape(where, "w_dkv", w_dkv, c.d_model, c.kv_rank);
    detail::check_shape(where, "kv_norm_gain", kv_norm_gain, c.kv_norm ? 1 : -1,
                        c.kv_norm ? c.kv_rank : 0);
    detail::check_shape(where, "w_kr", w_kr, c.d_model, c.rope_dim);
    detail::check_shape(where, "w_uk", w_uk, c.kv_rank, c.n_heads * c.qk_nope_dim);
    detail::check_shape(where, "w_uv", w_uv, c.kv_rank, c.n_heads * c.v_dim);
    detail::check_shape(where, "w_o", w_o, c.n_heads * c.v_dim, c.d_model);
    detail::check_shape(where, "sinks", sinks, config.sink_logits ? 1 : -1,
                        config.sink_logits ? config.n_heads : 0);
  }
};

/// An MLA layer (models AttentionLayer). Immutable after construction: one layer may be
/// used from several threads at once, each with its own workspace.
template <class T>
class MlaLayer {
 public:
  using scalar_type = T;
  using config_type = MlaConfig;
  template <class S = T>
  using cache_type = MlaCache<T, S>;

  /// The scratch of decode and attend, owned by the caller: one per thread that calls
  /// them at once. Its size does not depend on the number of tokens. Sized by
  /// make_workspace for a thread count; a call at a larger thread count (or with another
  /// layer's workspace) grows it first, which allocates.
  struct Workspace {
    RowVector<T> q_latent;          // 1 x d_c'            c_q (with query compression)
    RowVector<T> query;             // 1 x H*(d_nope+d_R)  [q_h^nope | q_h^R] per head
    RowVector<T> latent;            // 1 x d_c             the new token's c_kv
    RowVector<T> rope_key;          // 1 x d_R             the new token's k_R
    RowMatrix<T> absorbed;          // H x (d_c+d_R)  scale * [q_h^nope W_UK_h^T | q_h^R]
    RowMatrix<T> latent_heads;      // H x d_c        o-bar_h = sum_t a_h,t c_t
    RowVector<T> heads;             // 1 x H*d_v      o_h = o-bar_h W_UV_h, all heads
    detail::SplitScratch<T> split;  // partial softmax states per thread
    // absorbed (batch_absorbed) rounded to bf16, for DecodeArithmetic::bf16_dot.
    RowMatrix<Eigen::bfloat16> absorbed_bf16, batch_absorbed_bf16;
    // absorbed transposed ((d_c+d_R) x H) for the transposed score, where it is taken
    // (H a multiple of 16 on AVX-512; else empty); batch_absorbed's: (d_c+d_R) x B*H.
    RowMatrix<T> absorbed_t, batch_absorbed_t;
    // decode_batch: B rows of the same (absorbed and latent_heads: B*H rows), and the
    // batch's units and states.
    RowMatrix<T> batch_q_latent, batch_query, batch_latent, batch_rope_key, batch_absorbed,
        batch_latent_heads, batch_heads;
    detail::BatchScratch<T> batch;
  };

  /// Validates the config and the weights' shapes (config_error / shape_error).
  MlaLayer(const MlaConfig& config, MlaWeights<T> weights)
      : config_(config), weights_(std::move(weights)) {
    config_.validate();
    weights_.check(config_);
    rope_ = make_rope(config_.rope, config_.rope_dim, config_.yarn);
    scale_ = static_cast<T>(config_.scale());
  }

  /// A layer with MlaWeights<T>::random(config, seed).
  static MlaLayer random(const MlaConfig& config, std::uint64_t seed) {
    return MlaLayer(config, MlaWeights<T>::random(config, seed));
  }

  const MlaConfig& config() const { return config_; }
  const MlaWeights<T>& weights() const { return weights_; }
  /// The rope channel's rotation (YaRN frequencies and amplitude when enabled).
  const Rope& rope() const { return rope_; }
  /// The scale multiplying every logit: 1/sqrt(d_nope + d_R) * m^2, stored explicitly.
  T softmax_scale() const { return scale_; }
  /// How decode, decode_batch and attend score a bf16 cache (core/simd.hpp): `bf16_dot`
  /// rounds the absorbed query to bf16 and scores with the CPU's bf16 dot-product
  /// instruction where the build has it (docs/api.md, "bf16 dot products"); the default,
  /// `fp32`, scores in float. Other caches and the expanded paths are unaffected. Not
  /// synchronized: set it before the layer is shared between threads.
  void set_decode_arithmetic(DecodeArithmetic arithmetic) { arithmetic_ = arithmetic; }
  DecodeArithmetic decode_arithmetic() const { return arithmetic_; }
  /// Columns of attend's query: H * (d_nope + d_R), head h's [q_h^nope | q_h^R] in
  /// columns [h*(d_nope+d_R), (h+1)*(d_nope+d_R)).
  Index query_width() const { return config_.query_width(); }
  /// Columns of attend's heads output: H * d_v.
  Index heads_width() const { return config_.n_heads * config_.v_dim; }

  /// An empty cache for this layer, with room for `reserve_tokens`.
  template <class S = T>
  MlaCache<T, S> make_cache(Index reserve_tokens = 0) const {
    return MlaCache<T, S>(config_, reserve_tokens);
  }

  /// A workspace sized for decode and attend at `threads`: with it they allocate nothing.
  Workspace make_workspace(Threads threads = {}) const {
    Workspace ws;
    prepare(ws, 0, threads.resolved());
    return ws;
  }

  /// Causal prefill of L new tokens x (L x d) after the cache's tokens: returns the L x d
  /// output and appends their latents and rope keys to the cache. `mode` picks the
  /// formulation (see MlaPrefill and docs/mla.md); both are exact, tiled with an online
  /// softmax, and never build an L x L matrix. The new rows are appended last: a call
  /// that throws leaves the cache as it was.
  /// With threads, the large projections are split by output column and the
  /// attention by head.
  template <class Cache>
  requires detail::is_mla_cache<Cache, T> RowMatrix<T> prefill(
      const ConstMatrixRef<T>& x, Cache& cache, Threads threads = {},
      MlaPrefill mode = MlaPrefill::automatic)
  const {
    using S = typename Cache::storage_type;
    constexpr const char* where = "MlaLayer::prefill";
    check_cache(cache, where);
    detail::check_shape(where, "x", x, -1, config_.d_model);
    if (mode != MlaPrefill::automatic && mode != MlaPrefill::expanded &&
        mode != MlaPrefill::absorbed) {
      throw config_error(std::string(where) + ": mode (" + std::to_string(static_cast<int>(mode)) +
                         ") is not an MlaPrefill (automatic, expanded or absorbed)");
    }
    const int thread_count = threads.resolved();
    // No tokens: nothing to append or attend (and no block of an empty matrix to take).
    if (x.rows() == 0) return RowMatrix<T>(0, config_.d_model);
    const Index past = cache.sequence_length();
    const Index length = x.rows();
    RowMatrix<T> query, latent, rope_keys;
    project(x, past, query, latent, rope_keys, thread_count);
    if constexpr (detail::is_quantized_storage<S>) {  // before any work: nothing to undo
      detail::require_finite(where, "latent", latent);
      detail::require_finite(where, "rope_keys", rope_keys);
    }
    RowMatrix<T> heads(length, heads_width());
    const bool absorbed = prefill_mode(mode, past, length) == MlaPrefill::absorbed;
    // The cached rows are read where they are, except a quantized cache's (dequantized
    // into one T matrix with the new rows, below).
    constexpr bool in_place = !detail::is_quantized_storage<S>;
    if (absorbed && in_place) {
      if constexpr (in_place) {
        // The new rows as the cache will store them: [c_kv | k_R] rounded to S.
        RowMatrix<S> fresh(length, config_.cache_elements_per_token());
        fresh.leftCols(config_.kv_rank) = latent.template cast<S>();
        fresh.rightCols(config_.rope_dim) = rope_keys.template cast<S>();
        detail::RowSource<S> rows{nullptr, fresh.cols(), fresh.data(), fresh.cols(), past};
        if constexpr (requires { cache.page_tokens(); }) {
          rows.paged = &cache.rows_;
        } else {
          rows.cached = cache.row_data(0);
        }
        attend_absorbed_prefill(query, rows, detail::cache_segment(cache), heads, thread_count);
      }
    } else {
      // Every row as stored (dequantized for a quantized S), then the new ones.
      const RowMatrix<T> rows = stored_rows(cache, latent, rope_keys);
      if (absorbed) {
        const detail::RowSource<T> source{rows.data(), rows.cols(),
                                          rows.data() + past * rows.cols(), rows.cols(), past};
        attend_absorbed_prefill(query, source, 0, heads, thread_count);
      } else {
        attend_expanded_prefill(query, rows, heads, thread_count);
      }
    }
    RowMatrix<T> out(length, config_.d_model);
    detail::parallel_product(heads, weights_.w_o, out, thread_count);
    cache.append(latent, rope_keys);  // last: strong guarantee
    return out;
  }

  /// The formulation prefill(x, cache, threads, mode) uses for `length` new tokens
  /// after `past` cached ones: `mode` itself unless automatic, else the cheaper in
  /// FLOPs. Expanded reconstructs K and V for every visible token once per call
  /// (H * (past + L) * d_c * (d_nope + d_v) multiply-adds) and then attends at width
  /// d_nope + d_R + d_v per query/key pair; absorbed maps each new query into the latent
  /// (H * L * d_c * (d_nope + d_v)) and then attends at width 2 d_c + d_R per pair. A
  /// fresh prompt therefore goes expanded, a few tokens after a long cache absorbed.
  MlaPrefill prefill_mode(MlaPrefill mode, Index past, Index length) const {
    if (mode != MlaPrefill::automatic) return mode;
    const auto& c = config_;
    const double queries = static_cast<double>(length);
    const double keys = static_cast<double>(past) + queries;
    const double pairs = queries * static_cast<double>(past) + queries * (queries + 1.0) / 2.0;
    const double up = static_cast<double>(c.kv_rank) * static_cast<double>(c.qk_nope_dim + c.v_dim);
    const double expanded =
        keys * up + pairs * static_cast<double>(c.qk_nope_dim + c.rope_dim + c.v_dim);
    const double absorbed = queries * up + pairs * static_cast<double>(2 * c.kv_rank + c.rope_dim);
    return absorbed < expanded ? MlaPrefill::absorbed : MlaPrefill::expanded;
  }

  /// One new token x (1 x d) through the absorbed path: appends its latent and rope
  /// key, attends over the whole cache (see attend) and writes the 1 x d output into
  /// `out`. No per-head key or value of a cached token is ever formed. Allocates
  /// nothing when the cache has capacity and the workspace was made for at least this
  /// thread count. A call that throws leaves the cache as it was (capacity included).
  /// On an empty cache the token attends to itself only (as a one-token prefill).
  template <class Cache>
  requires detail::is_mla_cache<Cache, T>
  void decode(const ConstMatrixRef<T>& x, Cache& cache, MatrixRef<T> out, Workspace& ws,
              Threads threads = {}) const {
    constexpr const char* where = "MlaLayer::decode";
    check_cache(cache, where);
    detail::check_shape(where, "x", x, 1, config_.d_model);
    detail::check_shape(where, "out", out, 1, config_.d_model);
    const int thread_count = threads.resolved();
    auto plan = prepare(ws, cache.sequence_length() + 1, thread_count);
    plan.segment = detail::cache_segment(cache);
    project_token(x, cache.sequence_length(), ws, thread_count);
    if constexpr (detail::is_quantized_storage<typename Cache::storage_type>) {
      detail::require_finite(where, "the new token's latent", ws.latent);
      detail::require_finite(where, "the new token's rope key", ws.rope_key);
    }
    cache.grow_for(cache.sequence_length() + 1);
    // Everything that may throw is done; from here the step cannot fail.
    cache.append_token(ws.latent, ws.rope_key);
    attend_prepared(cache, ws, plan, ws.heads.data(), thread_count);
    detail::parallel_product(ws.heads, weights_.w_o, out, thread_count);
  }

  /// decode with a workspace of its own (allocates one on every call).
  template <class Cache>
  requires detail::is_mla_cache<Cache, T>
  void decode(const ConstMatrixRef<T>& x, Cache& cache, MatrixRef<T> out,
              Threads threads = {}) const {
    Workspace ws = make_workspace(threads);
    decode(x, cache, out, ws, threads);
  }

  /// decode returning the 1 x d output (allocates it and a workspace on every call).
  template <class Cache>
  requires detail::is_mla_cache<Cache, T> RowVector<T> decode(const ConstMatrixRef<T>& x,
                                                              Cache& cache, Threads threads = {})
  const {
    RowVector<T> out(config_.d_model);
    decode(x, cache, out, threads);
    return out;
  }

  /// The attention step alone, for the newest cached token (index tokens() - 1):
  /// `query` (1 x H*(d_nope + d_R)) is that token's projected query [q_h^nope | q_h^R]
  /// per head, before RoPE; `heads` (1 x H*d_v) receives the per-head outputs o_h,
  /// before W_O. The run-time absorption through W_UK and W_UV is part of the step.
  /// The cache is only read: several threads may attend over one const cache at once,
  /// each with its own workspace.
  ///
  /// The absorbed step (seed 000, backup slide "MLA also admits associative
  /// computation": q K^T = (q W_UK^T) Z^T and a V = (a Z) W_UV): each head's content
  /// query is absorbed, q~_h = q_h^nope W_UK_h^T, so the row [q~_h | q_h^R] scores a
  /// whole cached row [c_t | k_R,t] with one dot product; all heads are scored against
  /// a tile of cached rows at once (every row is read once per step, from memory),
  /// the tile's latents accumulate o-bar_h = sum_t a_h,t c_t under an online softmax,
  /// and o_h = o-bar_h W_UV_h at the end. With threads, the sequence is split across
  /// them and the partial softmax states merged exactly (flash-decoding); the
  /// absorptions are split by head.
  template <class Cache>
  requires detail::is_mla_cache<Cache, T>
  void attend(const ConstMatrixRef<T>& query, const Cache& cache, MatrixRef<T> heads, Workspace& ws,
              Threads threads = {}) const {
    constexpr const char* where = "MlaLayer::attend";
    check_cache(cache, where);
    detail::check_shape(where, "query", query, 1, query_width());
    detail::check_shape(where, "heads", heads, 1, heads_width());
    detail::require_tokens(where, cache.sequence_length());
    const int thread_count = threads.resolved();
    auto plan = prepare(ws, cache.sequence_length(), thread_count);
    plan.segment = detail::cache_segment(cache);
    ws.query = query.row(0);
    const double position =
        static_cast<double>(config_.rope.position_offset + cache.sequence_length() - 1);
    rope_.rotate(ws.query.data() + config_.qk_nope_dim, position, config_.n_heads,
                 config_.qk_head_dim());
    attend_prepared(cache, ws, plan, heads.data(), thread_count);
  }

  /// attend with a workspace of its own (allocates one on every call).
  template <class Cache>
  requires detail::is_mla_cache<Cache, T>
  void attend(const ConstMatrixRef<T>& query, const Cache& cache, MatrixRef<T> heads,
              Threads threads = {}) const {
    Workspace ws = make_workspace(threads);
    attend(query, cache, heads, ws, threads);
  }

  /// The queries of x (n x d) as attend and attend_states take them: [q_h^nope | q_h^R]
  /// per head (through W_DQ, its norm and W_UQ when q_rank > 0), n x H*(d_nope + d_R),
  /// before RoPE.
  RowMatrix<T> project_query(const ConstMatrixRef<T>& x, Threads threads = {}) const {
    detail::check_shape("MlaLayer::project_query", "x", x, -1, config_.d_model);
    const int thread_count = threads.resolved();
    RowMatrix<T> query(x.rows(), config_.query_width());
    if (config_.q_rank > 0) {
      RowMatrix<T> q_latent(x.rows(), config_.q_rank);
      detail::parallel_product(x, weights_.w_dq, q_latent, thread_count);
      if (config_.q_norm) norm_rows(q_latent, weights_.q_norm_gain);
      detail::parallel_product(q_latent, weights_.w_uq, query, thread_count);
    } else {
      detail::parallel_product(x, weights_.w_q, query, thread_count);
    }
    return query;
  }

  /// Appends the latents and rope keys of x's n tokens (n x d) without attending: what
  /// prefill appends, for a cache that holds part of a sequence whose attention is
  /// computed elsewhere (attention/attend_states.hpp). Strong exception guarantee.
  template <class Cache>
  requires detail::is_mla_cache<Cache, T>
  void append(const ConstMatrixRef<T>& x, Cache& cache, Threads threads = {}) const {
    constexpr const char* where = "MlaLayer::append";
    check_cache(cache, where);
    detail::check_shape(where, "x", x, -1, config_.d_model);
    if (x.rows() == 0) return;
    RowMatrix<T> latent, rope_keys;
    project_rows(x, cache.sequence_length(), latent, rope_keys, threads.resolved());
    cache.append(latent, rope_keys);
  }

  /// The partial softmax state of each query head over the tokens of `cache` that a
  /// query at sequence index `position` sees (attention/attend_states.hpp): states gets
  /// H rows of d_v (the absorbed step's latent output times W_UV_h, unnormalized),
  /// without the sink logits. config_error for a layer with a sliding window.
  template <class Cache>
  requires detail::is_mla_cache<Cache, T>
  void attend_states(const ConstMatrixRef<T>& query, Index position, const Cache& cache,
                     SoftmaxStates<T>& states, Workspace& ws, Threads threads = {}) const {
    constexpr const char* where = "MlaLayer::attend_states";
    check_cache(cache, where);
    detail::check_shape(where, "query", query, 1, query_width());
    const Index visible =
        detail::states_visible(where, config_.window, position, cache.sequence_length());
    states.reset(config_.n_heads, config_.v_dim);
    if (visible == 0) return;
    const int thread_count = threads.resolved();
    auto plan = prepare(ws, visible, thread_count);
    plan.segment = detail::cache_segment(cache);
    ws.query = query.row(0);
    rope_.rotate(ws.query.data() + config_.qk_nope_dim,
                 static_cast<double>(config_.rope.position_offset + position), config_.n_heads,
                 config_.qk_head_dim());
    attend_prepared(cache, ws, plan, ws.heads.data(), thread_count, states.max.data(),
                    states.sum.data());
    detail::states_from_heads(ws.heads.data(), states);
  }

  /// One new token for each of B sequences, as GqaLayer::decode_batch (docs/api.md): x
  /// and out are B x d, caches B distinct caches of one type; row s of out is what
  /// decode(x.row(s), *caches[s], ...) writes. The projections and each head's
  /// absorptions through W_UK and W_UV run as products over the B rows (the weights read
  /// once for the batch). With options.shared_prefix = P > 0 (paged caches holding tokens
  /// [0, P) in the same pool pages), the prefix's latent rows are read once for all B x H
  /// absorbed queries (cascade attention). A call that throws appends to no cache.
  template <class Cache>
  requires detail::is_mla_cache<Cache, T>
  void decode_batch(const ConstMatrixRef<T>& x, std::span<Cache* const> caches, MatrixRef<T> out,
                    Workspace& ws, Threads threads = {}, BatchOptions options = {}) const {
    using S = typename Cache::storage_type;
    constexpr const char* where = "MlaLayer::decode_batch";
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
    const MlaConfig& c = config_;
    const Index H = c.n_heads;
    const Index dc = c.kv_rank;
    const Index dn = c.qk_nope_dim;
    const Index dr = c.rope_dim;
    const Index qd = c.qk_head_dim();
    const Index width = c.cache_elements_per_token();
    if (c.q_rank > 0) {
      detail::parallel_product(x, weights_.w_dq, ws.batch_q_latent, thread_count);
      for (Index s = 0; s < batch && c.q_norm; ++s) {
        rms_norm_inplace(ws.batch_q_latent.row(s).data(), c.q_rank, weights_.q_norm_gain.data(),
                         c.norm_epsilon);
      }
      detail::parallel_product(ws.batch_q_latent, weights_.w_uq, ws.batch_query, thread_count);
    } else {
      detail::parallel_product(x, weights_.w_q, ws.batch_query, thread_count);
    }
    detail::parallel_product(x, weights_.w_dkv, ws.batch_latent, thread_count);
    detail::product(x, weights_.w_kr, ws.batch_rope_key);
    for (Index s = 0; s < batch; ++s) {
      const Cache& cache = *caches[static_cast<std::size_t>(s)];
      if (c.kv_norm) {
        rms_norm_inplace(ws.batch_latent.row(s).data(), dc, weights_.kv_norm_gain.data(),
                         c.norm_epsilon);
      }
      const double position = static_cast<double>(c.rope.position_offset + cache.sequence_length());
      rope_.rotate(ws.batch_query.row(s).data() + dn, position, H, qd);
      rope_.rotate(ws.batch_rope_key.row(s).data(), position);
    }
    if constexpr (detail::is_quantized_storage<S>) {
      detail::require_finite(where, "the new tokens' latents", ws.batch_latent);
      detail::require_finite(where, "the new tokens' rope keys", ws.batch_rope_key);
    }
    detail::BatchGrowth::grow(caches);
    // Everything that may throw is done; from here the step cannot fail.
    for (Index s = 0; s < batch; ++s) {
      caches[static_cast<std::size_t>(s)]->append_token(ws.batch_latent.row(s),
                                                        ws.batch_rope_key.row(s));
    }
    // Absorb W_UK per head for all B rows at once: row s*H + h of batch_absorbed.
    detail::parallel_for(H, thread_count, [&](Index h) {
      detail::RowsMap<T> absorbed(ws.batch_absorbed.data() + h * width, batch, width,
                                  Eigen::OuterStride<>(H * width));
      absorbed.leftCols(dc).noalias() = scale_ * ws.batch_query.middleCols(h * qd, dn) *
                                        weights_.w_uk.middleCols(h * dn, dn).transpose();
      absorbed.rightCols(dr) = scale_ * ws.batch_query.middleCols(h * qd + dn, dr);
    });
    // Sources 0 ... B-1: the sequences; source B: the shared prefix, every sequence's
    // heads at once (read through the first cache).
    const Eigen::bfloat16* rounded =
        absorbed_bf16<Cache>(ws.batch_absorbed, ws.batch_absorbed_bf16);
    const T* transposed =
        transposed_absorbed<Cache>(ws.batch_absorbed, batch * H, rounded, ws.batch_absorbed_t);
    detail::run_batch(ws.batch, [&](Index source) {
      if (source == batch) {
        const T* absorbed = ws.batch_absorbed.data();
        return DecodeOps<Cache>{*caches[0], absorbed, batch * H,  dc,
                                width,      rounded,  transposed, batch * H};
      }
      const Index offset = source * H * width;
      const Eigen::bfloat16* own = rounded != nullptr ? rounded + offset : nullptr;
      const T* own_t = transposed != nullptr ? transposed + source * H : nullptr;
      const Cache& cache = *caches[static_cast<std::size_t>(source)];
      const T* absorbed = ws.batch_absorbed.data() + offset;
      return DecodeOps<Cache>{cache, absorbed, H, dc, width, own, own_t, batch * H};
    });
    detail::finish_batch(ws.batch, ws.batch_latent_heads.data());
    restore_order<S>(ws.batch_latent_heads.data(), batch * H, rounded != nullptr);
    // o_h = o-bar_h W_UV_h for all B rows of head h at once.
    detail::parallel_for(H, thread_count, [&](Index h) {
      const detail::ConstRowsMap<T> latent(ws.batch_latent_heads.data() + h * dc, batch, dc,
                                           Eigen::OuterStride<>(H * dc));
      detail::product(latent, weights_.w_uv.middleCols(h * c.v_dim, c.v_dim),
                      ws.batch_heads.middleCols(h * c.v_dim, c.v_dim));
    });
    detail::parallel_product(ws.batch_heads, weights_.w_o, out, thread_count);
  }

  /// decode_batch with a workspace of its own (allocates one on every call).
  template <class Cache>
  requires detail::is_mla_cache<Cache, T>
  void decode_batch(const ConstMatrixRef<T>& x, std::span<Cache* const> caches, MatrixRef<T> out,
                    Threads threads = {}, BatchOptions options = {}) const {
    Workspace ws = make_workspace(threads);
    decode_batch(x, caches, out, ws, threads, options);
  }

  /// Tokens per tile of the decode pass: about 64 KiB of cached rows (as T), so a tile
  /// read from memory stays in L2 while every head is scored and accumulated against
  /// it, and at least 64 tokens. Each tile costs the same whatever its length: every
  /// head's accumulator row loaded and stored once (the accumulate takes the whole tile
  /// as one token block) and a softmax over whole packets of logits. DeepSeek's rows
  /// (576 elements) made 64 KiB tiles of 24 tokens: the accumulate then moved as many
  /// accumulator bytes per token as it read cached bytes, and the softmax ran a quarter
  /// of its lanes on padding. Steps over cold caches, tiles of 24 and 64 alternating in
  /// one process (AVX-512, Zen 5): V2-Lite 7-12% faster with 64 (fp32 and bf16, one and
  /// two threads), V2 fp32 7-11%, an int8 cache 25-28%; 96 and 128 no faster than 64.
  Index decode_tile() const {
    const Index row_bytes = config_.cache_elements_per_token() * static_cast<Index>(sizeof(T));
    return std::clamp<Index>((Index{64} * 1024 / row_bytes) / 8 * 8, 64, 256);
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
                         detail::describe(cache.config()) +
                         " (or other RoPE/YaRN/norm settings), the layer has " +
                         detail::describe(config_));
    }
  }

  void norm_rows(RowMatrix<T>& m, const RowVector<T>& gain) const {
    for (Index i = 0; i < m.rows(); ++i) {
      rms_norm_inplace(m.row(i).data(), m.cols(), gain.data(), config_.norm_epsilon);
    }
  }

  // Queries (rope part rotated), normalized latents and rotated rope keys of x;
  // token i sits at cache index past + i.
  void project(const ConstMatrixRef<T>& x, Index past, RowMatrix<T>& query, RowMatrix<T>& latent,
               RowMatrix<T>& rope_keys, int threads) const {
    const MlaConfig& c = config_;
    query = project_query(x, Threads{threads});
    for (Index i = 0; i < x.rows(); ++i) {
      const double position = static_cast<double>(c.rope.position_offset + past + i);
      rope_.rotate(query.row(i).data() + c.qk_nope_dim, position, c.n_heads, c.qk_head_dim());
    }
    project_rows(x, past, latent, rope_keys, threads);
  }

  // The cache rows of x (normalized latents, rotated rope keys): what append needs,
  // without the query's projection.
  void project_rows(const ConstMatrixRef<T>& x, Index past, RowMatrix<T>& latent,
                    RowMatrix<T>& rope_keys, int threads) const {
    const MlaConfig& c = config_;
    latent.resize(x.rows(), c.kv_rank);
    detail::parallel_product(x, weights_.w_dkv, latent, threads);
    if (c.kv_norm) norm_rows(latent, weights_.kv_norm_gain);
    rope_keys.noalias() = x * weights_.w_kr;
    for (Index i = 0; i < x.rows(); ++i) {
      rope_.rotate(rope_keys.row(i).data(), static_cast<double>(c.rope.position_offset + past + i));
    }
  }

  // The same for one token into the workspace (no allocation).
  void project_token(const ConstMatrixRef<T>& x, Index index, Workspace& ws, int threads) const {
    const MlaConfig& c = config_;
    if (c.q_rank > 0) {
      detail::parallel_product(x, weights_.w_dq, ws.q_latent, threads);
      if (c.q_norm) {
        rms_norm_inplace(ws.q_latent.data(), c.q_rank, weights_.q_norm_gain.data(), c.norm_epsilon);
      }
      detail::parallel_product(ws.q_latent, weights_.w_uq, ws.query, threads);
    } else {
      detail::parallel_product(x, weights_.w_q, ws.query, threads);
    }
    detail::parallel_product(x, weights_.w_dkv, ws.latent, threads);
    if (c.kv_norm) {
      rms_norm_inplace(ws.latent.data(), c.kv_rank, weights_.kv_norm_gain.data(), c.norm_epsilon);
    }
    ws.rope_key.noalias() = x * weights_.w_kr;
    const double position = static_cast<double>(c.rope.position_offset + index);
    rope_.rotate(ws.query.data() + c.qk_nope_dim, position, c.n_heads, c.qk_head_dim());
    rope_.rotate(ws.rope_key.data(), position);
  }

  // Sizes the workspace for a step over `length` tokens; may allocate and throw.
  detail::SplitPlan prepare(Workspace& ws, Index length, int threads) const {
    const MlaConfig& c = config_;
    const Index width = c.cache_elements_per_token();
    detail::reshape(ws.q_latent, c.q_rank);
    detail::reshape(ws.query, c.query_width());
    detail::reshape(ws.latent, c.kv_rank);
    detail::reshape(ws.rope_key, c.rope_dim);
    detail::reshape(ws.absorbed, c.n_heads, width);
    detail::reshape(ws.absorbed_bf16, uses_bf16_dot() ? c.n_heads : 0, width);
    detail::reshape(ws.absorbed_t, transposes_queries() ? width : 0, c.n_heads);
    detail::reshape(ws.latent_heads, c.n_heads, c.kv_rank);
    detail::reshape(ws.heads, c.n_heads * c.v_dim);
    const auto plan =
        detail::plan_split(1, c.n_heads, c.kv_rank, length, decode_tile(), 0, threads, span());
    ws.split.fit(plan);
    return plan;
  }

  // Sizes the workspace and plans the units of a decode_batch step; may allocate and throw.
  template <class Cache>
  void prepare_batch(Workspace& ws, std::span<Cache* const> caches, Index prefix,
                     int threads) const {
    const MlaConfig& c = config_;
    const Index batch = static_cast<Index>(caches.size());
    detail::reshape(ws.batch_q_latent, batch, c.q_rank);
    detail::reshape(ws.batch_query, batch, c.query_width());
    detail::reshape(ws.batch_latent, batch, c.kv_rank);
    detail::reshape(ws.batch_rope_key, batch, c.rope_dim);
    detail::reshape(ws.batch_absorbed, batch * c.n_heads, c.cache_elements_per_token());
    detail::reshape(ws.batch_absorbed_bf16, uses_bf16_dot() ? batch * c.n_heads : 0,
                    c.cache_elements_per_token());
    detail::reshape(ws.batch_absorbed_t, transposes_queries() ? c.cache_elements_per_token() : 0,
                    batch * c.n_heads);
    detail::reshape(ws.batch_latent_heads, batch * c.n_heads, c.kv_rank);
    detail::reshape(ws.batch_heads, batch, heads_width());
    auto& b = ws.batch;
    b.tile = decode_tile();
    b.segment = detail::cache_segment(*caches[0]);
    b.width = c.kv_rank;
    b.units.clear();
    Index slot = 0;
    detail::plan_batch_units(b.units, slot, caches, prefix, 1, c.n_heads, b.tile, threads, span());
    b.softcap = config_.logit_softcap;
    b.sinks = sink_logits();
    b.heads = c.n_heads;
    b.fit(batch * c.n_heads, threads);
  }

  // Whether the absorbed score of a Cache can take the bf16 dot kernel: plain (not
  // quantized) bf16 rows, float queries, a build with the instruction.
  template <class Cache>
  static constexpr bool bf16_dot_cache = detail::bf16_dot_storage<T, typename Cache::storage_type>;
  // Whether the value pass of a bf16 dot step takes the dot kernel too (whole chunks of
  // 32 latent columns; else it widens the rows as with fp32).
  static constexpr bool dot_values(Index kv_rank) { return detail::bf16_dot_values(kv_rank); }
  bool uses_bf16_dot() const {
    return bf16_dot_available() && std::is_same_v<T, float> &&
           arithmetic_ == DecodeArithmetic::bf16_dot;
  }
  // The absorbed queries rounded into `rounded` (sized by prepare) when this step takes
  // the bf16 dot kernel, else null.
  template <class Cache>
  const Eigen::bfloat16* absorbed_bf16(const RowMatrix<T>& absorbed,
                                       RowMatrix<Eigen::bfloat16>& rounded) const {
    if constexpr (bf16_dot_cache<Cache>) {
      if (uses_bf16_dot()) {
        rounded.noalias() = absorbed.template cast<Eigen::bfloat16>();  // nearest, ties even
        return rounded.data();
      }
    }
    (void)absorbed, (void)rounded;
    return nullptr;
  }

  // Whether a step scores fp32 and bf16 caches by the transposed score
  // (detail/transposed_score.hpp): this build has it and H is a multiple of 16, so every
  // sequence's heads and a batch's shared prefix rows (B H) fill whole packets.
  bool transposes_queries() const { return detail::transposed_score<T, T>(config_.n_heads); }
  // The absorbed queries (rows x (d_c + d_R)) transposed into `transposed` (sized by
  // prepare) when this step scores a Cache by the transposed score, else null. Not with
  // the bf16 dot kernel, which reads the rounded queries.
  template <class Cache>
  const T* transposed_absorbed(const RowMatrix<T>& absorbed, Index rows,
                               const Eigen::bfloat16* rounded, RowMatrix<T>& transposed) const {
    if constexpr (detail::transposed_score_types<T, typename Cache::storage_type>) {
      if (rounded == nullptr && transposes_queries()) {
        const Index width = absorbed.cols();
        detail::transpose_queries(absorbed.data(), width, rows, width, transposed.data(), rows);
        return transposed.data();
      }
    }
    (void)absorbed, (void)rows, (void)rounded, (void)transposed;
    return nullptr;
  }

  // All heads against a tile of cached rows [c_t | k_R,t] (one group: every head
  // shares the rows); the values are the rows' latent columns. The accumulate re-reads
  // the tile from L1/L2 (it was just scored), so the two phases together prefetch the
  // next tile, spread over both loops.
  template <class Cache>
  struct DecodeOps {
    using S = typename Cache::storage_type;
    static constexpr bool quantized = detail::is_quantized_storage<S>;
    const Cache& cache;
    const T* absorbed;  // H x (d_c + d_R), scaled
    Index heads;
    Index kv_rank;
    Index width;  // d_c + d_R
    // absorbed rounded to bf16 (DecodeArithmetic::bf16_dot on a bf16 cache), or null.
    const Eigen::bfloat16* absorbed_bf16 = nullptr;
    // absorbed transposed, element (j, h) at absorbed_t[j * absorbed_t_stride + h], or
    // null (transposed_absorbed).
    const T* absorbed_t = nullptr;
    Index absorbed_t_stride = 0;

    // The half of the next tile's bytes phase `half` (0: score, 1: accumulate) prefetches
    // (a quantized cache: its latent rows, then its rope rows).
    detail::Prefetcher next_tile(Index first, Index n, int half) const {
      // The next tile's rows up to the end of their page (of a paged cache).
      const Index ahead = std::min(n, detail::contiguous_rows(cache, first + n));
      if (ahead <= 0) return {};
      if constexpr (quantized) {
        return half == 0
                   ? detail::Prefetcher(cache.latent_row(first + n), ahead * cache.latent_stride())
                   : detail::Prefetcher(
                         cache.rope_row(first + n),
                         ahead * cache.rope_stride() * Index{sizeof(typename Cache::rope_storage)});
      } else {
        const Index bytes = ahead * width * Index{sizeof(S)};
        const Index split = bytes / 2 / 64 * 64;
        return half == 0 ? detail::Prefetcher(cache.latent_row(first + n), split)
                         : detail::Prefetcher(
                               reinterpret_cast<const char*>(cache.latent_row(first + n)) + split,
                               bytes - split);
      }
    }
    void score(Index, Index first, Index n, T* logits, Index ld, T* spare) const {
      detail::Prefetcher next = next_tile(first, n, 0);
      if constexpr (quantized) {
        detail::score_quantized<T, S>(absorbed, width, heads, cache.latent_row(first),
                                      cache.latent_stride(), kv_rank, n, logits, ld, spare, &next);
        detail::score_rows(absorbed + kv_rank, width, heads, width - kv_rank, cache.rope_row(first),
                           cache.rope_stride(), 0, n, logits, ld, true);
      } else {
        (void)spare;
        if constexpr (bf16_dot_cache<Cache>) {
          if (absorbed_bf16 != nullptr) {
            detail::score_rows_bf16_dot(absorbed_bf16, width, heads, width, cache.latent_row(first),
                                        width, n, logits, ld, &next);
            return;
          }
        }
        if constexpr (detail::transposed_score_types<T, S>) {
          if (absorbed_t != nullptr) {
            detail::score_transposed(absorbed_t, absorbed_t_stride, heads, width,
                                     cache.latent_row(first), width, n, logits, ld, &next);
            return;
          }
        }
        detail::score_rows(absorbed, width, heads, width, cache.latent_row(first), width, 0, n,
                           logits, ld, false, &next);
      }
    }
    void accumulate(Index, Index first, Index n, const T* weights, Index ld, T* acc,
                    T* spare) const {
      detail::Prefetcher next = next_tile(first, n, 1);
      if constexpr (quantized) {
        detail::accumulate_quantized<T, S>(weights, ld, heads, cache.latent_row(first),
                                           cache.latent_stride(), kv_rank, n, acc, kv_rank,
                                           kTokenBlock, &next, spare);
      } else {
        if constexpr (bf16_dot_cache<Cache>) {
          if (absorbed_bf16 != nullptr && dot_values(kv_rank)) {
            detail::accumulate_rows_bf16_dot(weights, ld, heads, cache.latent_row(first), width,
                                             kv_rank, n, acc, kv_rank,
                                             reinterpret_cast<Eigen::bfloat16*>(spare), &next);
            return;
          }
        }
        (void)spare;
        detail::accumulate_rows(weights, ld, heads, cache.latent_row(first), width, 0, kv_rank, n,
                                acc, kv_rank, kTokenBlock, &next,
                                detail::paired_rows<T, S>(kv_rank));
      }
    }
    // Value rows per accumulate block: the whole tile (0), so each register block of
    // accumulators is loaded and stored once per tile (kernel test at the V2-Lite shape:
    // 72 GFLOP/s against 64 with blocks of 8 rows).
    static constexpr Index kTokenBlock = 0;
  };

  // Puts `rows` latent accumulator rows (d_c each, contiguous) back in column order after
  // a step whose bf16 latents were summed by the dot kernel (`rounded`: the step had a
  // rounded query) or in pairs (storage S): one or the other, never both.
  template <class S>
  void restore_order(T* latent, Index rows, bool rounded) const {
    const Index dc = config_.kv_rank;
    if (rounded && dot_values(dc)) {
      detail::from_bf16_dot_order(latent, rows, dc);
    } else if (detail::paired_rows<T, S>(dc)) {
      for (Index r = 0; r < rows; ++r) detail::from_paired(latent + r * dc, dc);
    }
  }

  // The absorbed step over the plan's tokens; ws.query holds the rotated query. With
  // row_max / row_sum, each head's max and normalizer go there and the sink logits are
  // left out (attend_states). Never throws: prepare() has sized everything.
  template <class Cache>
  void attend_prepared(const Cache& cache, Workspace& ws, const detail::SplitPlan& plan, T* heads,
                       int threads, T* row_max = nullptr, T* row_sum = nullptr) const {
    using S = typename Cache::storage_type;
    const MlaConfig& c = config_;
    const Index dc = c.kv_rank;
    // 1. Absorb W_UK into each head's content query, at run time, and scale.
    absorb_queries(ws.query.data(), ws.absorbed.data(), threads);
    // 2. One pass over the cached rows for all heads (split_attention.hpp).
    const Eigen::bfloat16* rounded = absorbed_bf16<Cache>(ws.absorbed, ws.absorbed_bf16);
    const Index width = c.cache_elements_per_token();
    const T* transposed =
        transposed_absorbed<Cache>(ws.absorbed, c.n_heads, rounded, ws.absorbed_t);
    const DecodeOps<Cache> ops{cache,   ws.absorbed.data(), c.n_heads, dc, width,
                               rounded, transposed,         c.n_heads};
    detail::split_attention(plan, ws.split, ops, ws.latent_heads.data(),
                            row_max != nullptr ? nullptr : sink_logits(), row_max, row_sum);
    restore_order<S>(ws.latent_heads.data(), c.n_heads, rounded != nullptr);
    // 3. Up-project each head's latent output by its own W_UV_h: o_h = o-bar_h W_UV_h.
    up_project_heads(ws.latent_heads.data(), heads, threads);
  }

  // The two products of a decode step with the up-projections, as the decode kernels'
  // segmented passes over the rows of W_UK and W_UV (d_c x H*d, row-major: row i holds
  // every head's column block i), one contiguous range of heads per thread, so that each
  // matrix is read front to back once. Taken head by head, each a product with the
  // head's own column block, every 64 KiB row of DeepSeek-V2's matrices was visited 128
  // times, 512 bytes at a time, and read at 16-22 GB/s where this way reads 27-34 (one
  // thread, cold, AVX-512 VM; docs/benchmarks.md, "MLA's up-projections").
  //
  // absorbed_h = scale [q_h^nope W_UK_h^T | q_h^R] (H x (d_c + d_R)) from the rotated
  // query [q_h^nope | q_h^R] per head: row h of the segmented score reads columns
  // h d_nope ... of every row of W_UK.
  void absorb_queries(const T* query, T* absorbed, int threads) const {
    const MlaConfig& c = config_;
    const Index H = c.n_heads, dc = c.kv_rank, dn = c.qk_nope_dim, dr = c.rope_dim;
    const Index qd = c.qk_head_dim(), width = dc + dr;
    const Index units = std::min<Index>(H, std::max(threads, 1));
    detail::parallel_for(units, threads, [&](Index u) {
      const Index h0 = u * H / units, h1 = (u + 1) * H / units;
      detail::score_rows(query + h0 * qd, qd, h1 - h0, dn, weights_.w_uk.data() + h0 * dn,
                         weights_.w_uk.cols(), dn, dc, absorbed + h0 * width, width, false);
      for (Index h = h0; h < h1; ++h) {
        Eigen::Map<RowVector<T>> row(absorbed + h * width, width);
        row.head(dc) *= scale_;
        row.tail(dr) = scale_ * Eigen::Map<const RowVector<T>>(query + h * qd + dn, dr);
      }
    });
  }
  // heads_h = o-bar_h W_UV_h (H x d_v) from the latent outputs (H x d_c): a segmented
  // accumulate whose "tokens" are W_UV's rows, each weighted by o-bar_h's element.
  void up_project_heads(const T* latent_heads, T* heads, int threads) const {
    const MlaConfig& c = config_;
    const Index H = c.n_heads, dc = c.kv_rank, dv = c.v_dim;
    const Index units = std::min<Index>(H, std::max(threads, 1));
    detail::parallel_for(units, threads, [&](Index u) {
      const Index h0 = u * H / units, h1 = (u + 1) * H / units;
      Eigen::Map<RowVector<T>>(heads + h0 * dv, (h1 - h0) * dv).setZero();
      detail::accumulate_rows(latent_heads + h0 * dc, dc, h1 - h0, weights_.w_uv.data() + h0 * dv,
                              weights_.w_uv.cols(), dv, dv, dc, heads + h0 * dv, dv);
    });
  }

  // Queries of one head (scaled) against keys and values given as T matrices
  // (causal_attention.hpp's ops): expanded prefill's reconstructed K_h, V_h.
  struct DenseOps {
    const T* query;  // L x k_dim, row stride query_stride
    Index query_stride;
    const RowMatrix<T>& keys;    // keys x k_dim
    const RowMatrix<T>& values;  // keys x v_dim

    void score(Index q0, Index nq, Index k0, Index nk, T* scores, Index stride, T*) const {
      const detail::ConstRowsMap<T> q(query + q0 * query_stride, nq, keys.cols(),
                                      Eigen::OuterStride<>(query_stride));
      detail::RowsMap<T>(scores, nq, nk, Eigen::OuterStride<>(stride)).noalias() =
          q * keys.middleRows(k0, nk).transpose();
    }
    void accumulate(Index, Index nq, Index k0, Index nk, const T* weights, Index stride, T* acc,
                    Index acc_stride, T*) const {
      detail::RowsMap<T>(acc, nq, values.cols(), Eigen::OuterStride<>(acc_stride)).noalias() +=
          detail::ConstRowsMap<T>(weights, nq, nk, Eigen::OuterStride<>(stride)) *
          values.middleRows(k0, nk);
    }
  };

  // Absorbed queries of one head (scaled) against the cached and new rows [c_t | k_R,t]
  // themselves; the values are the rows' latent columns.
  template <class S>
  struct LatentOps {
    const RowMatrix<T>& absorbed;  // L x (d_c + d_R)
    detail::RowSource<S> rows;
    Index kv_rank;

    void score(Index q0, Index nq, Index k0, Index nk, T* scores, Index stride, T* buffer) const {
      const auto k = detail::rows_as<T>(rows, k0, nk, 0, absorbed.cols(), buffer);
      detail::RowsMap<T>(scores, nq, nk, Eigen::OuterStride<>(stride)).noalias() =
          absorbed.middleRows(q0, nq) * k.transpose();
    }
    void accumulate(Index, Index nq, Index k0, Index nk, const T* weights, Index stride, T* acc,
                    Index acc_stride, T* buffer) const {
      const auto v = detail::rows_as<T>(rows, k0, nk, 0, kv_rank, buffer);
      detail::RowsMap<T>(acc, nq, kv_rank, Eigen::OuterStride<>(acc_stride)).noalias() +=
          detail::ConstRowsMap<T>(weights, nq, nk, Eigen::OuterStride<>(stride)) * v;
    }
  };

  // Causal attention of every query tile of one unit with `ops`, into out (L rows).
  template <class Ops>
  static void attend_all_tiles(const detail::CausalShape& shape, detail::CausalScratch<T>& scratch,
                               const Ops& ops, Index length, T* out, Index out_stride,
                               const T* sink) {
    for (Index q0 = 0; q0 < length; q0 += detail::kPrefillTile) {
      detail::causal_query_tile(shape, scratch, ops, q0,
                                std::min(detail::kPrefillTile, length - q0), out + q0 * out_stride,
                                out_stride, sink);
    }
  }

  // Every cached row [c_t | k_R,t] as stored, then the new rows as the cache will store
  // them (rounded to S, or quantized), all widened to T: what a prefill attends to. A
  // windowed cache's rows it no longer holds are zero (no new query sees them).
  template <class Cache>
  RowMatrix<T> stored_rows(const Cache& cache, const RowMatrix<T>& latent,
                           const RowMatrix<T>& rope_keys) const {
    using S = typename Cache::storage_type;
    using Traits = detail::StorageTraits<S>;
    using Rope = typename Cache::rope_storage;
    const Index dc = config_.kv_rank;
    const Index dr = config_.rope_dim;
    const Index past = cache.sequence_length();
    RowMatrix<T> rows(past + latent.rows(), dc + dr);
    for (Index t = 0; t < past; ++t) {
      if (!detail::cache_holds(cache, t)) {
        rows.row(t).setZero();
        continue;
      }
      T* out = rows.row(t).data();
      if constexpr (Traits::quantized) {
        Traits::dequantize(cache.latent_row(t), dc, 0, dc, out);
      } else {
        for (Index j = 0; j < dc; ++j) out[j] = static_cast<T>(cache.latent_row(t)[j]);
      }
      for (Index j = 0; j < dr; ++j) out[dc + j] = static_cast<T>(cache.rope_row(t)[j]);
    }
    std::vector<typename Traits::element> codes(
        static_cast<std::size_t>(Traits::quantized ? Traits::row_elements(dc) : 0));
    for (Index i = 0; i < latent.rows(); ++i) {
      T* out = rows.row(past + i).data();
      if constexpr (Traits::quantized) {
        Traits::encode([&](Index j) { return latent(i, j); }, dc, codes.data());
        Traits::dequantize(codes.data(), dc, 0, dc, out);
      } else {
        for (Index j = 0; j < dc; ++j) out[j] = static_cast<T>(static_cast<S>(latent(i, j)));
      }
      for (Index j = 0; j < dr; ++j) {
        out[dc + j] = static_cast<T>(static_cast<Rope>(rope_keys(i, j)));
      }
    }
    return rows;
  }

  // Expanded prefill ("reconstruct, then attend", seed 002 Chapter 2): per head,
  // K_h = [C W_UK_h | K_R] and V_h = C W_UV_h for every visible token (`rows`, the
  // stored rows then the new ones), then tiled causal attention. Compute-friendly: big
  // matrix products, width d_nope + d_R.
  void attend_expanded_prefill(const RowMatrix<T>& query, const RowMatrix<T>& rows,
                               RowMatrix<T>& heads, int threads) const {
    const MlaConfig& c = config_;
    const Index dc = c.kv_rank;
    const Index dn = c.qk_nope_dim;
    const Index dr = c.rope_dim;
    const Index qd = c.qk_head_dim();
    const Index length = query.rows();
    const Index past = rows.rows() - length;
    const auto latent = rows.leftCols(dc);
    const RowMatrix<T> scaled = query * scale_;
    const detail::CausalShape shape{past, 0, c.v_dim, 0, 0, span()};
    struct PerThread {
      RowMatrix<T> key, value;
      detail::CausalScratch<T> scratch;
    };
    std::vector<PerThread> per_thread(static_cast<std::size_t>(threads));
    for (auto& p : per_thread) {
      p.key.resize(past + length, qd);
      p.value.resize(past + length, c.v_dim);
      p.scratch.fit(shape);
    }
    detail::parallel_for(c.n_heads, threads, [&](Index h) {
      auto& p = per_thread[static_cast<std::size_t>(detail::thread_index())];
      p.key.rightCols(dr) = rows.rightCols(dr);
      p.key.leftCols(dn).noalias() = latent * weights_.w_uk.middleCols(h * dn, dn);
      p.value.noalias() = latent * weights_.w_uv.middleCols(h * c.v_dim, c.v_dim);
      const DenseOps ops{scaled.data() + h * qd, scaled.cols(), p.key, p.value};
      attend_all_tiles(shape, p.scratch, ops, length, heads.data() + h * c.v_dim, heads.cols(),
                       sink_logits() != nullptr ? sink_logits() + h : nullptr);
    });
  }

  // Absorbed prefill: per head, queries [q_h^nope W_UK_h^T | q_h^R] against the rows of
  // `rows` (the cached ones before its split, in pages of `segment` tokens when paged,
  // then the new ones), values the latents, then o_h = o-bar_h W_UV_h. Cheaper when few
  // new tokens attend to a long cache.
  template <class S>
  void attend_absorbed_prefill(const RowMatrix<T>& query, const detail::RowSource<S>& rows,
                               Index segment, RowMatrix<T>& heads, int threads) const {
    const MlaConfig& c = config_;
    const Index dc = c.kv_rank;
    const Index dn = c.qk_nope_dim;
    const Index dr = c.rope_dim;
    const Index qd = c.qk_head_dim();
    const Index width = c.cache_elements_per_token();
    const Index past = rows.split;
    const Index length = query.rows();
    const detail::CausalShape shape{past,    past,  dc, std::is_same_v<S, T> ? 0 : width,
                                    segment, span()};
    struct PerThread {
      RowMatrix<T> absorbed, latent_out;
      detail::CausalScratch<T> scratch;
    };
    std::vector<PerThread> per_thread(static_cast<std::size_t>(threads));
    for (auto& p : per_thread) {
      p.absorbed.resize(length, width);
      p.latent_out.resize(length, dc);
      p.scratch.fit(shape);
    }
    detail::parallel_for(c.n_heads, threads, [&](Index h) {
      auto& p = per_thread[static_cast<std::size_t>(detail::thread_index())];
      p.absorbed.leftCols(dc).noalias() =
          scale_ * query.middleCols(h * qd, dn) * weights_.w_uk.middleCols(h * dn, dn).transpose();
      p.absorbed.rightCols(dr) = scale_ * query.middleCols(h * qd + dn, dr);
      const LatentOps<S> ops{p.absorbed, rows, dc};
      attend_all_tiles(shape, p.scratch, ops, length, p.latent_out.data(), dc,
                       sink_logits() != nullptr ? sink_logits() + h : nullptr);
      heads.middleCols(h * c.v_dim, c.v_dim).noalias() =
          p.latent_out * weights_.w_uv.middleCols(h * c.v_dim, c.v_dim);
    });
  }

  MlaConfig config_;
  MlaWeights<T> weights_;
  Rope rope_;
  T scale_ = T(1);
  DecodeArithmetic arithmetic_ = DecodeArithmetic::fp32;
};

static_assert(AttentionLayer<MlaLayer<float>>);
static_assert(AttentionLayer<MlaLayer<double>>);

}  // namespace kvattn
