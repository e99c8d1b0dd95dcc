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
#include <string>
#include <type_traits>
#include <utility>

#include "kvattn/attention/mla_config.hpp"
#include "kvattn/cache/mla_cache.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/random.hpp"
#include "kvattn/core/rms_norm.hpp"
#include "kvattn/core/rope.hpp"
#include "kvattn/core/threads.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/core/yarn.hpp"
#include "kvattn/detail/causal_attention.hpp"
#include "kvattn/detail/decode_kernels.hpp"
#include "kvattn/detail/split_attention.hpp"

namespace kvattn {

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
    return w;
  }

  /// The same weights in another scalar type (e.g. double for a reference).
  template <class U>
  MlaWeights<U> cast() const {
    return {w_dq.template cast<U>(),  q_norm_gain.template cast<U>(),
            w_uq.template cast<U>(),  w_q.template cast<U>(),
            w_dkv.template cast<U>(), kv_norm_gain.template cast<U>(),
            w_kr.template cast<U>(),  w_uk.template cast<U>(),
            w_uv.template cast<U>(),  w_o.template cast<U>()};
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
  }
};

namespace detail {

inline std::string describe(const MlaConfig& c) {
  return "{d_model " + std::to_string(c.d_model) + ", n_heads " + std::to_string(c.n_heads) +
         ", kv_rank " + std::to_string(c.kv_rank) + ", q_rank " + std::to_string(c.q_rank) +
         ", qk_nope_dim " + std::to_string(c.qk_nope_dim) + ", rope_dim " +
         std::to_string(c.rope_dim) + ", v_dim " + std::to_string(c.v_dim) + "}";
}

}  // namespace detail

/// An MLA layer. Immutable after construction: one layer may be used from several
/// threads at once, each thread decoding its own cache.
template <class T>
class MlaLayer {
 public:
  using scalar_type = T;
  template <class S = T>
  using cache_type = MlaCache<T, S>;

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

  /// An empty cache for this layer, with room for `reserve_tokens`.
  template <class S = T>
  MlaCache<T, S> make_cache(Index reserve_tokens = 0) const {
    return MlaCache<T, S>(config_, reserve_tokens);
  }

  /// Causal prefill of L new tokens x (L x d) after the cache's tokens: appends their
  /// latents and rope keys to the cache and returns the L x d output. `mode` picks the
  /// formulation (see MlaPrefill and docs/mla.md); both are exact, tiled with an online
  /// softmax, and never build an L x L matrix.
  /// With threads, the large projections are split by output column and the
  /// attention by head.
  template <class S>
  RowMatrix<T> prefill(const ConstMatrixRef<T>& x, MlaCache<T, S>& cache,
                       MlaPrefill mode = MlaPrefill::automatic, Threads threads = {}) const {
    check_cache(cache, "MlaLayer::prefill");
    detail::check_shape("MlaLayer::prefill", "x", x, -1, config_.d_model);
    const int thread_count = threads.resolved();
    const Index past = cache.tokens();
    const Index length = x.rows();
    RowMatrix<T> query, latent, rope_keys;
    project(x, past, query, latent, rope_keys, thread_count);
    cache.append(latent, rope_keys);  // strong guarantee: on failure nothing changed
    RowMatrix<T> heads(length, config_.n_heads * config_.v_dim);
    if (length > 0) {
      if (prefill_mode(mode, past, length) == MlaPrefill::absorbed) {
        attend_absorbed_prefill(query, cache, past, heads, thread_count);
      } else {
        attend_expanded_prefill(query, cache, past, heads, thread_count);
      }
    }
    RowMatrix<T> out(length, config_.d_model);
    detail::parallel_product(heads, weights_.w_o, out, thread_count);
    return out;
  }

  /// prefill(x, cache, MlaPrefill::automatic, threads).
  template <class S>
  RowMatrix<T> prefill(const ConstMatrixRef<T>& x, MlaCache<T, S>& cache, Threads threads) const {
    return prefill(x, cache, MlaPrefill::automatic, threads);
  }

  /// The formulation prefill(x, cache, mode) uses for `length` new tokens after `past`
  /// cached ones: `mode` itself unless automatic, else the cheaper in FLOPs. Expanded
  /// reconstructs K and V for every visible token once per call (H * (past + L) * d_c *
  /// (d_nope + d_v) multiply-adds) and then attends at width d_nope + d_R + d_v per
  /// query/key pair; absorbed maps each new query into the latent (H * L * d_c *
  /// (d_nope + d_v)) and then attends at width 2 d_c + d_R per pair. A fresh prompt
  /// therefore goes expanded, a few tokens after a long cache absorbed.
  MlaPrefill prefill_mode(MlaPrefill mode, Index past, Index length) const {
    if (mode != MlaPrefill::automatic) return mode;
    const auto& c = config_;
    const double queries = static_cast<double>(length);
    const double keys = static_cast<double>(past + length);
    const double pairs = queries * static_cast<double>(past) + queries * (queries + 1.0) / 2.0;
    const double up = static_cast<double>(c.kv_rank * (c.qk_nope_dim + c.v_dim));
    const double expanded =
        keys * up + pairs * static_cast<double>(c.qk_nope_dim + c.rope_dim + c.v_dim);
    const double absorbed = queries * up + pairs * static_cast<double>(2 * c.kv_rank + c.rope_dim);
    return absorbed < expanded ? MlaPrefill::absorbed : MlaPrefill::expanded;
  }

  /// One new token x (1 x d) through the absorbed path: appends its latent and rope
  /// key, attends over the whole cache (see attend) and writes the 1 x d output into
  /// `out`. No per-head key or value of a cached token is ever formed. Allocates
  /// nothing once the cache has capacity and has decoded at this thread count. On an
  /// empty cache the token attends to itself only (the result equals a one-token
  /// prefill).
  template <class S>
  void decode(const ConstRowRef<T>& x, MlaCache<T, S>& cache, RowRef<T> out,
              Threads threads = {}) const {
    check_cache(cache, "MlaLayer::decode");
    detail::check_shape("MlaLayer::decode", "x", x, 1, config_.d_model);
    detail::check_shape("MlaLayer::decode", "out", out, 1, config_.d_model);
    const int thread_count = threads.resolved();
    auto& ws = cache.workspace();
    cache.ensure_capacity(cache.tokens() + 1);
    const auto plan = prepare(ws, cache.tokens() + 1, thread_count);
    // Everything that may throw is done; from here the step cannot fail.
    project_token(x, cache.tokens(), ws);
    cache.push_row(ws.latent, ws.rope_key);
    attend_prepared(cache, ws, plan, ws.heads.data(), thread_count);
    detail::parallel_product(ws.heads, weights_.w_o, out, thread_count);
  }

  /// Convenience overload returning the 1 x d output (allocates the result).
  template <class S>
  RowVector<T> decode(const ConstRowRef<T>& x, MlaCache<T, S>& cache, Threads threads = {}) const {
    RowVector<T> out(config_.d_model);
    decode(x, cache, out, threads);
    return out;
  }

  /// The attention step alone, for the newest cached token (index tokens() - 1):
  /// `query` (1 x H*(d_nope + d_R)) is that token's projected query [q_h^nope | q_h^R]
  /// per head, before RoPE; `heads` (1 x H*d_v) receives the per-head outputs o_h,
  /// before W_O. The run-time absorption through W_UK and W_UV is part of the step.
  /// The cache is not modified.
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
  template <class S>
  void attend(const ConstMatrixRef<T>& query, MlaCache<T, S>& cache, MatrixRef<T> heads,
              Threads threads = {}) const {
    constexpr const char* where = "MlaLayer::attend";
    check_cache(cache, where);
    detail::check_shape(where, "query", query, 1, config_.query_width());
    detail::check_shape(where, "heads", heads, 1, config_.n_heads * config_.v_dim);
    detail::require_tokens(where, cache.tokens());
    const int thread_count = threads.resolved();
    auto& ws = cache.workspace();
    const auto plan = prepare(ws, cache.tokens(), thread_count);
    ws.query = query.row(0);
    const double position = static_cast<double>(config_.rope.position_offset + cache.tokens() - 1);
    rope_.rotate(ws.query.data() + config_.qk_nope_dim, position, config_.n_heads,
                 config_.qk_head_dim());
    attend_prepared(cache, ws, plan, heads.data(), thread_count);
  }

  /// Tokens per tile of the decode pass: about 64 KiB of cached rows, so a tile read
  /// from memory stays in L1/L2 while every head is scored and accumulated against it.
  Index decode_tile() const {
    const Index row_bytes = config_.cache_width() * static_cast<Index>(sizeof(T));
    return std::clamp<Index>((Index{64} * 1024 / row_bytes) / 8 * 8, 8, 256);
  }

 private:
  template <class S>
  void check_cache(const MlaCache<T, S>& cache, const char* where) const {
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
    query.resize(x.rows(), c.query_width());
    if (c.q_rank > 0) {
      RowMatrix<T> q_latent(x.rows(), c.q_rank);
      detail::parallel_product(x, weights_.w_dq, q_latent, threads);
      if (c.q_norm) norm_rows(q_latent, weights_.q_norm_gain);
      detail::parallel_product(q_latent, weights_.w_uq, query, threads);
    } else {
      detail::parallel_product(x, weights_.w_q, query, threads);
    }
    latent.resize(x.rows(), c.kv_rank);
    detail::parallel_product(x, weights_.w_dkv, latent, threads);
    if (c.kv_norm) norm_rows(latent, weights_.kv_norm_gain);
    rope_keys.noalias() = x * weights_.w_kr;
    for (Index i = 0; i < x.rows(); ++i) {
      const double position = static_cast<double>(c.rope.position_offset + past + i);
      rope_.rotate(query.row(i).data() + c.qk_nope_dim, position, c.n_heads, c.qk_head_dim());
      rope_.rotate(rope_keys.row(i).data(), position);
    }
  }

  // The same for one token into the workspace (no allocation).
  template <class Workspace>
  void project_token(const ConstRowRef<T>& x, Index index, Workspace& ws) const {
    const MlaConfig& c = config_;
    if (c.q_rank > 0) {
      ws.q_latent.noalias() = x * weights_.w_dq;
      if (c.q_norm) {
        rms_norm_inplace(ws.q_latent.data(), c.q_rank, weights_.q_norm_gain.data(), c.norm_epsilon);
      }
      ws.query.noalias() = ws.q_latent * weights_.w_uq;
    } else {
      ws.query.noalias() = x * weights_.w_q;
    }
    ws.latent.noalias() = x * weights_.w_dkv;
    if (c.kv_norm) {
      rms_norm_inplace(ws.latent.data(), c.kv_rank, weights_.kv_norm_gain.data(), c.norm_epsilon);
    }
    ws.rope_key.noalias() = x * weights_.w_kr;
    const double position = static_cast<double>(c.rope.position_offset + index);
    rope_.rotate(ws.query.data() + c.qk_nope_dim, position, c.n_heads, c.qk_head_dim());
    rope_.rotate(ws.rope_key.data(), position);
  }

  // Sizes the workspace for a step over `length` tokens; may allocate and throw.
  template <class Workspace>
  detail::SplitPlan prepare(Workspace& ws, Index length, int threads) const {
    const MlaConfig& c = config_;
    auto fit_row = [](RowVector<T>& v, Index n) { detail::reshape(v, n); };
    auto fit = [](RowMatrix<T>& m, Index rows, Index cols) { detail::reshape(m, rows, cols); };
    fit_row(ws.q_latent, c.q_rank);
    fit_row(ws.query, c.query_width());
    fit_row(ws.latent, c.kv_rank);
    fit_row(ws.rope_key, c.rope_dim);
    fit(ws.absorbed, c.n_heads, c.cache_width());
    fit(ws.absorbed_transposed, c.cache_width(), c.n_heads);
    fit(ws.latent_heads, c.n_heads, c.kv_rank);
    fit_row(ws.heads, c.n_heads * c.v_dim);
    const auto plan =
        detail::plan_split(1, c.n_heads, c.kv_rank, length, decode_tile(), 0, threads);
    ws.split.fit(plan);
    return plan;
  }

  // All heads against a tile of cached rows [c_t | k_R,t] (one group: every head
  // shares the rows); the values are the rows' latent columns.
  template <class S>
  struct DecodeOps {
    const MlaCache<T, S>& cache;
    const T* absorbed;             // H x (d_c + d_R), scaled
    const T* absorbed_transposed;  // (d_c + d_R) x H
    Index heads;
    Index kv_rank;
    Index width;  // d_c + d_R

    void score(Index, Index first, Index n, T* logits, T*) const {
      const Index ahead = std::min(n, cache.tokens() - first - n);
      if (ahead > 0) detail::prefetch_rows(cache.row_data(first + n), width, ahead, width);
      detail::score(absorbed, absorbed_transposed, heads, width, cache.row_data(first), width, n,
                    logits, heads, false);
    }
    void accumulate(Index, Index first, Index n, const T* weights, T* acc, T*) const {
      detail::accumulate(weights, heads, heads, cache.row_data(first), width, kv_rank, n, acc,
                         kv_rank);
    }
  };

  // The absorbed step for the newest token; ws.query holds its rotated query. Never
  // throws: prepare() has sized everything.
  template <class S, class Workspace>
  void attend_prepared(const MlaCache<T, S>& cache, Workspace& ws, const detail::SplitPlan& plan,
                       T* heads, int threads) const {
    const MlaConfig& c = config_;
    const Index dc = c.kv_rank;
    const Index dn = c.qk_nope_dim;
    const Index dr = c.rope_dim;
    const Index qd = c.qk_head_dim();
    // 1. Absorb W_UK into each head's content query, at run time, and scale.
    detail::parallel_for(c.n_heads, threads, [&](Index h) {
      ws.absorbed.row(h).head(dc).noalias() =
          scale_ * ws.query.segment(h * qd, dn) * weights_.w_uk.middleCols(h * dn, dn).transpose();
      ws.absorbed.row(h).tail(dr) = scale_ * ws.query.segment(h * qd + dn, dr);
    });
    ws.absorbed_transposed = ws.absorbed.transpose();
    // 2. One pass over the cached rows for all heads (split_attention.hpp).
    const DecodeOps<S> ops{cache, ws.absorbed.data(), ws.absorbed_transposed.data(), c.n_heads,
                           dc,    c.cache_width()};
    detail::split_attention(plan, ws.split, ops, ws.latent_heads.data());
    // 3. Up-project each head's latent output by its own W_UV_h: o_h = o-bar_h W_UV_h.
    detail::parallel_for(c.n_heads, threads, [&](Index h) {
      Eigen::Map<RowVector<T>>(heads + h * c.v_dim, c.v_dim).noalias() =
          ws.latent_heads.row(h) * weights_.w_uv.middleCols(h * c.v_dim, c.v_dim);
    });
  }

  // Expanded prefill ("reconstruct, then attend", seed 002 Chapter 2): per head,
  // K_h = [C W_UK_h | K_R] and V_h = C W_UV_h for every visible token, then tiled
  // causal attention. Compute-friendly: big matrix products, width d_nope + d_R.
  template <class S>
  void attend_expanded_prefill(const RowMatrix<T>& query, const MlaCache<T, S>& cache, Index past,
                               RowMatrix<T>& heads, int threads) const {
    const MlaConfig& c = config_;
    const Index dc = c.kv_rank;
    const Index dn = c.qk_nope_dim;
    const Index dr = c.rope_dim;
    const Index qd = c.qk_head_dim();
    const RowMatrix<T> rows = cache.rows().template cast<T>();
    const auto latent = rows.leftCols(dc);
    detail::parallel_for(c.n_heads, threads, [&](Index h) {
      RowMatrix<T> key(rows.rows(), qd);
      RowMatrix<T> value(rows.rows(), c.v_dim);
      key.rightCols(dr) = rows.rightCols(dr);
      key.leftCols(dn).noalias() = latent * weights_.w_uk.middleCols(h * dn, dn);
      value.noalias() = latent * weights_.w_uv.middleCols(h * c.v_dim, c.v_dim);
      detail::causal_attention<T>(query.middleCols(h * qd, qd), key, value, past, scale_,
                                  heads.middleCols(h * c.v_dim, c.v_dim));
    });
  }

  // Absorbed prefill: per head, queries [q_h^nope W_UK_h^T | q_h^R] against the cached
  // rows, values the latents, then o_h = o-bar_h W_UV_h. Cheaper when few new tokens
  // attend to a long cache.
  template <class S>
  void attend_absorbed_prefill(const RowMatrix<T>& query, const MlaCache<T, S>& cache, Index past,
                               RowMatrix<T>& heads, int threads) const {
    const MlaConfig& c = config_;
    const Index dc = c.kv_rank;
    const Index dn = c.qk_nope_dim;
    const Index dr = c.rope_dim;
    const Index qd = c.qk_head_dim();
    const Index length = query.rows();
    const RowMatrix<T> rows = cache.rows().template cast<T>();
    detail::parallel_for(c.n_heads, threads, [&](Index h) {
      RowMatrix<T> absorbed(length, c.cache_width());
      RowMatrix<T> latent_out(length, dc);
      absorbed.leftCols(dc).noalias() =
          query.middleCols(h * qd, dn) * weights_.w_uk.middleCols(h * dn, dn).transpose();
      absorbed.rightCols(dr) = query.middleCols(h * qd + dn, dr);
      detail::causal_attention<T>(absorbed, rows, rows.leftCols(dc), past, scale_, latent_out);
      heads.middleCols(h * c.v_dim, c.v_dim).noalias() =
          latent_out * weights_.w_uv.middleCols(h * c.v_dim, c.v_dim);
    });
  }

  MlaConfig config_;
  MlaWeights<T> weights_;
  Rope rope_;
  T scale_ = T(1);
};

}  // namespace kvattn
