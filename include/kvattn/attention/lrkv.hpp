// LRKV, low-rank key-value attention (seed 000), with associative (factored) decode.
//
// Shapes (rows are tokens): x L x d in, L x d out; the weights are in
// attention/lrkv_weights.hpp, the cache layout in cache/lrkv_cache.hpp.
//
// The model (seed 000, Eqs. 2-7), for head h, query token i and key token t:
//   k_s,t = x_t W_shared^K,   r_h,t = x_t U_h^K,   k_h,t = k_s,t + r_h,t (B_h^K)^T
//   v_h,t = x_t W_shared^V + (x_t U_h^V)(B_h^V)^T
//   key_norm:  k_h,t <- g (.) k_h,t / rho_h,t,   rho_h,t = sqrt(mean(k_h,t^2) + eps)
//   logits and RoPE as the LrkvRopeMode says; a_h = softmax(scale * logits + mask)
//   o_h = sum_t a_h,t v_h,t,   output = [o_1 ... o_H] W_O
// The factored path never forms k_h,t or v_h,t of a cached token:
//   logit_h,t = (q_h . k~_s,t + q~_h . r~_h,t) / rho_h,t (+ q^R_h . k~_R,t)    (Eq. 6)
//   o_h = a_h V_s + (a_h R_h^V)(B_h^V)^T                                       (Eq. 7)
// with q~_h = (q_h (.) g) B_h^K; docs/lrkv.md derives every mode.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvattn/attention/attend_states.hpp"
#include "kvattn/attention/attention_layer.hpp"
#include "kvattn/attention/decode_batch.hpp"
#include "kvattn/attention/lrkv_weights.hpp"
#include "kvattn/cache/lrkv_cache.hpp"
#include "kvattn/cache/paged_lrkv_cache.hpp"
#include "kvattn/config/lrkv_config.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/quantized.hpp"
#include "kvattn/core/rms_norm.hpp"
#include "kvattn/core/rope.hpp"
#include "kvattn/core/simd.hpp"
#include "kvattn/core/threads.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/detail/batch_attention.hpp"
#include "kvattn/detail/bf16_dot_kernels.hpp"
#include "kvattn/detail/causal_attention.hpp"
#include "kvattn/detail/decode_kernels.hpp"
#include "kvattn/detail/lrkv_kernels.hpp"
#include "kvattn/detail/quantized_kernels.hpp"
#include "kvattn/detail/row_source.hpp"
#include "kvattn/detail/split_attention.hpp"

namespace kvattn {

namespace detail {
/// The caches an LrkvLayer<T> reads and writes: LrkvCache<T, S> and PagedLrkvCache<T, S>.
template <class Cache, class T>
inline constexpr bool is_lrkv_cache = false;
template <class T, class S>
inline constexpr bool is_lrkv_cache<LrkvCache<T, S>, T> = true;
template <class T, class S>
inline constexpr bool is_lrkv_cache<PagedLrkvCache<T, S>, T> = true;
}  // namespace detail

/// An LRKV attention layer (models AttentionLayer). Immutable after construction (but for
/// set_decode_arithmetic, to be set before sharing): one layer may be used from several
/// threads at once, each with its own workspace.
template <class T>
class LrkvLayer {
 public:
  using scalar_type = T;
  using config_type = LrkvConfig;
  template <class S = T>
  using cache_type = LrkvCache<T, S>;

  /// The scratch of decode and attend, owned by the caller: one per thread that calls
  /// them at once. Sized by make_workspace for a thread count; a call at a larger thread
  /// count (or with another layer's workspace) grows it first, which allocates.
  struct Workspace {
    RowVector<T> query;             // 1 x H*d_h   q_h for the shared path (scaled, maybe rotated)
    RowVector<T> query_latent;      // 1 x H*r     q_h (.) g B_h^K (scaled)
    RowVector<T> query_rope;        // 1 x H*d_R   P_i q_h^R (scaled)
    RowMatrix<T> query_t;           // d_h x H_p   q_h as column h (H_p: H in whole packets)
    RowVector<T> key;               // 1 x key width    the new token's key row
    RowVector<T> value;             // 1 x value width  the new token's value row
    RowVector<T> rms;               // 1 x H       the new token's key RMS
    RowVector<T> scratch;           // 1 x d_h     one head's materialized new key
    RowVector<T> heads;             // 1 x H*d_h   per-head outputs o_h
    RowMatrix<T> acc;               // H x (d_h + r)  [a_h V_s | a_h R_h^V]
    detail::SplitScratch<T> split;  // partial softmax states per thread
    // decode_batch: B rows of the same (acc: B*H rows), and the batch's units and states.
    RowMatrix<T> batch_query, batch_query_latent, batch_query_rope, batch_key, batch_value,
        batch_rms, batch_acc, batch_heads;
    RowMatrix<T> batch_query_t;  // B*d_h x H_p: each sequence's query_t, one below the other
    detail::BatchScratch<T> batch;
    // DecodeArithmetic::bf16_dot: query_t in bf16 pairs ((d_h / 2) x H_p x 2) and
    // query_latent rounded (H x r rounded up to 32, zero-padded); batch_*: one row per sequence.
    RowVector<Eigen::bfloat16> query_pairs_bf16, query_latent_bf16;
    RowMatrix<Eigen::bfloat16> batch_query_pairs_bf16, batch_query_latent_bf16;
  };

  /// Validates the config and the weights (config_error / shape_error). A rope_mode full
  /// layer can be built (reference::forward computes it) but cannot prefill or decode.
  LrkvLayer(const LrkvConfig& config, LrkvWeights<T> weights)
      : config_(config), weights_(std::move(weights)) {
    config_.validate();
    weights_.check(config_);
    if (config_.rotates_shared()) rope_ = Rope(config_.rope, config_.head_dim);
    if (config_.rope_mode == LrkvRopeMode::decoupled) rope_ = Rope(config_.rope, config_.rope_dim);
    if (config_.rope_mode == LrkvRopeMode::commuting) {
      // P~_t: latent pair j of head h turns with the angle of the plane it maps into.
      const std::vector<Index> planes = detail::lrkv_latent_planes(config_, weights_.basis_k);
      std::vector<double> inv_freq;
      inv_freq.reserve(planes.size());
      for (const Index p : planes)
        inv_freq.push_back(rope_.inverse_frequencies()[static_cast<std::size_t>(p)]);
      latent_rope_ = Rope(RopeLayout::interleaved, std::move(inv_freq), rope_.amplitude());
    }
    // q~_h = (q_h (.) g) B_h^K = q_h (diag(g) B_h^K): the gain folds into B^K once.
    basis_k_gained_ = weights_.basis_k;
    if (config_.key_norm) basis_k_gained_ = weights_.key_norm_gain.asDiagonal() * weights_.basis_k;
    scale_ = static_cast<T>(config_.scale());
  }

  /// A layer with LrkvWeights<T>::random(config, seed, residual_scale).
  static LrkvLayer random(const LrkvConfig& config, std::uint64_t seed,
                          double residual_scale = 0.1) {
    return LrkvLayer(config, LrkvWeights<T>::random(config, seed, residual_scale));
  }

  const LrkvConfig& config() const { return config_; }
  const LrkvWeights<T>& weights() const { return weights_; }
  /// P_t: width d_h (shared / full / commuting), d_R (decoupled), disabled (none).
  const Rope& rope() const { return rope_; }
  /// P~_t over all heads' key latents (width H * r), commuting only; disabled otherwise.
  const Rope& latent_rope() const { return latent_rope_; }
  /// The scale multiplying the logits before the softmax.
  T softmax_scale() const { return scale_; }
  /// How decode, decode_batch, attend and attend_states multiply with a bf16 cache
  /// (core/simd.hpp): `bf16_dot` rounds the scaled queries (q_h and q~_h) to bf16 once per
  /// step and the softmax weights once per tile, and scores the shared key and the
  /// residual slices and sums the shared values with the CPU's bf16 dot-product
  /// instruction where the build has it (docs/api.md, "bf16 dot products"); the residual
  /// values, the decoupled RoPE part and the key norms stay in float. The default, `fp32`,
  /// widens the rows and multiplies in float. Needs d_h a multiple of 32 (otherwise
  /// ignored); other caches and prefill are unaffected. Not synchronized: set it before
  /// the layer is shared between threads.
  void set_decode_arithmetic(DecodeArithmetic arithmetic) { arithmetic_ = arithmetic; }
  DecodeArithmetic decode_arithmetic() const { return arithmetic_; }

  /// Columns of attend's query: H * (d_h + d_R), head h's [q_h | q_h^R] (the q_h^R part
  /// with rope_mode decoupled only) in columns [h*(d_h+d_R), (h+1)*(d_h+d_R)).
  Index query_width() const { return config_.query_width(); }
  /// Columns of attend's heads output: H * d_h.
  Index heads_width() const { return config_.n_heads * config_.head_dim; }

  /// An empty cache for this layer, with room for `reserve_tokens`.
  template <class S = T>
  LrkvCache<T, S> make_cache(Index reserve_tokens = 0) const {
    return LrkvCache<T, S>(config_, reserve_tokens);
  }

  /// A workspace sized for decode and attend at `threads`: with it they allocate nothing.
  Workspace make_workspace(Threads threads = {}) const {
    Workspace ws;
    prepare(ws, 0, threads.resolved());
    return ws;
  }

  /// Causal prefill of L new tokens x (L x d) after the cache's tokens: returns the L x d
  /// output and appends their shared features and latents. Factored and tiled (online
  /// softmax over key tiles), so memory is O(L * (d + H * r) + tile^2). The new rows are
  /// appended last: a call that throws leaves the cache as it was. With threads, the
  /// projections are split by output column and the attention by (query tile, head).
  template <class Cache>
  requires detail::is_lrkv_cache<Cache, T> RowMatrix<T> prefill(const ConstMatrixRef<T>& x,
                                                                Cache& cache, Threads threads = {})
  const {
    using S = typename Cache::storage_type;
    constexpr const char* where = "LrkvLayer::prefill";
    check_factored(where);
    check_cache(cache, where);
    detail::check_shape(where, "x", x, -1, config_.d_model);
    const int thread_count = threads.resolved();
    // No tokens: nothing to append or attend (and no block of an empty matrix to take).
    if (x.rows() == 0) return RowMatrix<T>(0, config_.d_model);
    const Index n = x.rows();
    const Index past = cache.sequence_length();
    const Index H = config_.n_heads;
    const Index dh = config_.head_dim;
    const Index r = config_.rank;
    const Index hr = H * r;
    const Index dr = config_.decoupled_dim();
    RowMatrix<T> key, value, rms, query, query_latent(n, hr), query_rope;
    project_rows(x, past, key, value, rms, thread_count);
    if constexpr (detail::is_quantized_storage<S>) {  // before any work: nothing to undo
      detail::require_finite(where, "keys", key);
      detail::require_finite(where, "values", value);
    }
    query.resize(n, weights_.w_q.cols());
    detail::parallel_product(x, weights_.w_q, query, thread_count);
    query_rope.noalias() = x * weights_.w_qr;
    for (Index i = 0; i < n; ++i) {
      const double position = static_cast<double>(config_.rope.position_offset + past + i);
      finish_query(position, query.row(i).data(), query_latent.row(i).data(),
                   query_rope.row(i).data());
    }
    // The new rows as the cache will store them (keys and values in S, RMS in norm_type).
    using norm_type = typename LrkvCache<T, S>::norm_type;
    const Staged<S> fresh(config_, key, value);
    const RowMatrix<norm_type> fresh_rms = rms.template cast<norm_type>();
    const Index key_stride = cache.key_row_stride(), value_stride = cache.value_row_stride();
    PrefillSource<S> source{{nullptr, key_stride, fresh.keys_data, key_stride, past},
                            {nullptr, value_stride, fresh.values_data, value_stride, past},
                            {nullptr, H, fresh_rms.data(), H, past},
                            {nullptr, dr, fresh.rope.data(), dr, past}};
    if constexpr (requires { cache.page_tokens(); }) {  // blocks: RMS, keys, values (, rope)
      source.rms.paged = source.keys.paged = source.values.paged = source.rope.paged = &cache.rows_;
      source.rms.block = 0;
      source.keys.block = 1;
      source.values.block = 2;
      source.rope.block = 3;
    } else {
      source.keys.cached = cache.key_row(0);
      source.values.cached = cache.value_row(0);
      source.rms.cached = cache.rms_row(0);
      if constexpr (detail::is_quantized_storage<S>) source.rope.cached = cache.rope_row(0);
    }
    // Quantized: one head's parts [k_s | r_h | k_R] dequantized per key tile.
    const Index buffer_width = detail::is_quantized_storage<S> ? dh + r + dr
                               : std::is_same_v<S, T>          ? 0
                                                               : std::max(key_width(), dh + hr);
    const detail::CausalShape shape{past,  past, dh + r, buffer_width, detail::cache_segment(cache),
                                    span()};
    struct PerThread {
      detail::CausalScratch<T> scratch;
      RowMatrix<T> out;  // tile x (d_h + r): [a_h V_s | a_h R_h^V], normalized
    };
    std::vector<PerThread> per_thread(static_cast<std::size_t>(thread_count));
    for (auto& p : per_thread) {
      p.scratch.fit(shape);
      p.out.resize(detail::kPrefillTile, dh + r);
    }
    RowMatrix<T> heads(n, H * dh);
    const Index query_tiles = (n + detail::kPrefillTile - 1) / detail::kPrefillTile;
    detail::parallel_for(query_tiles * H, thread_count, [&](Index unit) {
      const Index q0 = (unit / H) * detail::kPrefillTile;
      const Index h = unit % H;
      const Index nq = std::min(detail::kPrefillTile, n - q0);
      auto& p = per_thread[static_cast<std::size_t>(detail::thread_index())];
      const PrefillOps<S> ops{source, query, query_latent, query_rope,      h,
                              dh,     r,     dr,           config_.key_norm};
      detail::causal_query_tile(shape, p.scratch, ops, q0, nq, p.out.data(), dh + r,
                                sink_logits() != nullptr ? sink_logits() + h : nullptr);
      // o_h = a_h V_s + (a_h R_h^V)(B_h^V)^T, already normalized.
      auto out = heads.block(q0, h * dh, nq, dh);
      out = p.out.topLeftCorner(nq, dh);
      if (r > 0) {
        out.noalias() +=
            p.out.block(0, dh, nq, r) * weights_.basis_v.middleCols(h * r, r).transpose();
      }
    });
    RowMatrix<T> out(n, config_.d_model);
    detail::parallel_product(heads, weights_.w_o, out, thread_count);
    cache.append_unchecked({key.leftCols(dh), value.leftCols(dh), key.middleCols(dh, hr),
                            value.rightCols(hr), key.rightCols(dr),
                            rms});  // last: strong guarantee
    return out;
  }

  /// One new token x (1 x d) through the associative path (seed 000, Eqs. 6-7): appends
  /// its row, attends over the whole cache (see attend) and writes the 1 x d output into
  /// `out`. Allocates nothing when the cache has capacity and the workspace was made for
  /// at least this thread count. A call that throws leaves the cache as it was.
  template <class Cache>
  requires detail::is_lrkv_cache<Cache, T>
  void decode(const ConstMatrixRef<T>& x, Cache& cache, MatrixRef<T> out, Workspace& ws,
              Threads threads = {}) const {
    constexpr const char* where = "LrkvLayer::decode";
    check_factored(where);
    check_cache(cache, where);
    detail::check_shape(where, "x", x, 1, config_.d_model);
    detail::check_shape(where, "out", out, 1, config_.d_model);
    const int thread_count = threads.resolved();
    auto plan = prepare(ws, cache.sequence_length() + 1, thread_count);
    plan.segment = detail::cache_segment(cache);
    const Index dh = config_.head_dim;
    const Index hr = config_.n_heads * config_.rank;
    const Index dr = config_.decoupled_dim();
    ws.key.head(dh).noalias() = x.row(0) * weights_.w_k_shared;
    detail::parallel_product(x, weights_.u_k, ws.key.segment(dh, hr), thread_count);
    ws.key.tail(dr).noalias() = x.row(0) * weights_.w_kr;
    ws.value.head(dh).noalias() = x.row(0) * weights_.w_v_shared;
    detail::parallel_product(x, weights_.u_v, ws.value.tail(hr), thread_count);
    detail::parallel_product(x, weights_.w_q, ws.query, thread_count);
    ws.query_rope.noalias() = x.row(0) * weights_.w_qr;
    const double position =
        static_cast<double>(config_.rope.position_offset + cache.sequence_length());
    finish_key(position, ws.key.data(), ws.rms.data(), ws.scratch.data());
    if constexpr (detail::is_quantized_storage<typename Cache::storage_type>) {
      detail::require_finite(where, "the new token's key", ws.key);
      detail::require_finite(where, "the new token's value", ws.value);
    }
    cache.grow_for(cache.sequence_length() + 1);
    // Everything that may throw is done; from here the step cannot fail.
    cache.append_token(ws.key.head(dh), ws.key.segment(dh, hr), ws.key.tail(dr), ws.value.head(dh),
                       ws.value.tail(hr), ws.rms);
    attend_prepared(cache, ws, plan, ws.heads.data(), thread_count, cache.sequence_length() - 1);
    detail::parallel_product(ws.heads, weights_.w_o, out, thread_count);
  }

  /// decode with a workspace of its own (allocates one on every call).
  template <class Cache>
  requires detail::is_lrkv_cache<Cache, T>
  void decode(const ConstMatrixRef<T>& x, Cache& cache, MatrixRef<T> out,
              Threads threads = {}) const {
    Workspace ws = make_workspace(threads);
    decode(x, cache, out, ws, threads);
  }

  /// decode returning the 1 x d output (allocates it and a workspace on every call).
  template <class Cache>
  requires detail::is_lrkv_cache<Cache, T> RowVector<T> decode(const ConstMatrixRef<T>& x,
                                                               Cache& cache, Threads threads = {})
  const {
    RowVector<T> out(config_.d_model);
    decode(x, cache, out, threads);
    return out;
  }

  /// The attention step alone, for the newest cached token (index tokens() - 1):
  /// `query` (1 x H*(d_h + d_R)) holds each head's projected query [x W_Q_h | x W_QR_h]
  /// (the W_QR part only with rope_mode decoupled), before RoPE; `heads` (1 x H*d_h)
  /// receives the per-head outputs o_h, before W_O. The latent query
  /// q~_h = (q_h (.) g) B_h^K and the final (a_h R_h^V)(B_h^V)^T are part of the step.
  /// The cache is only read: several threads may attend over one const cache at once,
  /// each with its own workspace.
  ///
  /// The associative step (Eqs. 6-7): each tile of cached rows is scored by every head,
  /// q_h . k~_s,t for all heads at once against the shared key, plus each head's
  /// latent q~_h . r~_h,t (/ rho_h,t with key norm, + q^R_h . k~_R,t when decoupled);
  /// the tile's values accumulate a_h V_s and a_h R_h^V under an online softmax. No
  /// per-head key or value of a cached token is formed, and each cached element is read
  /// once per step. With threads, the sequence is split across them and the partial
  /// softmax states merged exactly (flash-decoding).
  template <class Cache>
  requires detail::is_lrkv_cache<Cache, T>
  void attend(const ConstMatrixRef<T>& query, const Cache& cache, MatrixRef<T> heads, Workspace& ws,
              Threads threads = {}) const {
    constexpr const char* where = "LrkvLayer::attend";
    check_factored(where);
    check_cache(cache, where);
    detail::check_shape(where, "query", query, 1, query_width());
    detail::check_shape(where, "heads", heads, 1, heads_width());
    detail::require_tokens(where, cache.sequence_length());
    const int thread_count = threads.resolved();
    auto plan = prepare(ws, cache.sequence_length(), thread_count);
    plan.segment = detail::cache_segment(cache);
    load_query(query, ws);
    attend_prepared(cache, ws, plan, heads.data(), thread_count, cache.sequence_length() - 1);
  }

  /// attend with a workspace of its own (allocates one on every call).
  template <class Cache>
  requires detail::is_lrkv_cache<Cache, T>
  void attend(const ConstMatrixRef<T>& query, const Cache& cache, MatrixRef<T> heads,
              Threads threads = {}) const {
    Workspace ws = make_workspace(threads);
    attend(query, cache, heads, ws, threads);
  }

  /// The queries of x (n x d) as attend and attend_states take them: [x W_Q_h | x W_QR_h]
  /// per head (the W_QR part only with rope_mode decoupled), n x H*(d_h + d_R), before
  /// RoPE.
  RowMatrix<T> project_query(const ConstMatrixRef<T>& x, Threads threads = {}) const {
    detail::check_shape("LrkvLayer::project_query", "x", x, -1, config_.d_model);
    const Index dh = config_.head_dim;
    const Index dr = config_.decoupled_dim();
    RowMatrix<T> content(x.rows(), weights_.w_q.cols());
    detail::parallel_product(x, weights_.w_q, content, threads.resolved());
    const RowMatrix<T> rope = x * weights_.w_qr;
    RowMatrix<T> query(x.rows(), query_width());
    for (Index h = 0; h < config_.n_heads; ++h) {
      query.middleCols(h * (dh + dr), dh) = content.middleCols(h * dh, dh);
      query.middleCols(h * (dh + dr) + dh, dr) = rope.middleCols(h * dr, dr);
    }
    return query;
  }

  /// Appends the rows of x's n tokens (n x d) without attending: what prefill appends,
  /// for a cache that holds part of a sequence whose attention is computed elsewhere
  /// (attention/attend_states.hpp). Strong exception guarantee.
  template <class Cache>
  requires detail::is_lrkv_cache<Cache, T>
  void append(const ConstMatrixRef<T>& x, Cache& cache, Threads threads = {}) const {
    constexpr const char* where = "LrkvLayer::append";
    check_factored(where);
    check_cache(cache, where);
    detail::check_shape(where, "x", x, -1, config_.d_model);
    if (x.rows() == 0) return;
    const Index dh = config_.head_dim;
    const Index hr = config_.n_heads * config_.rank;
    const Index dr = config_.decoupled_dim();
    RowMatrix<T> key, value, rms;
    project_rows(x, cache.sequence_length(), key, value, rms, threads.resolved());
    if constexpr (detail::is_quantized_storage<typename Cache::storage_type>) {
      detail::require_finite(where, "keys", key);
      detail::require_finite(where, "values", value);
    }
    cache.append_unchecked({key.leftCols(dh), value.leftCols(dh), key.middleCols(dh, hr),
                            value.rightCols(hr), key.rightCols(dr), rms});
  }

  /// The partial softmax state of each query head over the tokens of `cache` that a
  /// query at sequence index `position` sees (attention/attend_states.hpp): states gets
  /// H rows of d_h (a_h V_s + (a_h R_h^V)(B_h^V)^T, unnormalized), without the sink
  /// logits. config_error for a layer with a sliding window.
  template <class Cache>
  requires detail::is_lrkv_cache<Cache, T>
  void attend_states(const ConstMatrixRef<T>& query, Index position, const Cache& cache,
                     SoftmaxStates<T>& states, Workspace& ws, Threads threads = {}) const {
    constexpr const char* where = "LrkvLayer::attend_states";
    check_factored(where);
    check_cache(cache, where);
    detail::check_shape(where, "query", query, 1, query_width());
    const Index visible =
        detail::states_visible(where, config_.window, position, cache.sequence_length());
    states.reset(config_.n_heads, config_.head_dim);
    if (visible == 0) return;
    const int thread_count = threads.resolved();
    auto plan = prepare(ws, visible, thread_count);
    plan.segment = detail::cache_segment(cache);
    load_query(query, ws);
    attend_prepared(cache, ws, plan, ws.heads.data(), thread_count, position, states.max.data(),
                    states.sum.data());
    detail::states_from_heads(ws.heads.data(), states);
  }

  /// One new token for each of B sequences, as GqaLayer::decode_batch (docs/api.md): x
  /// and out are B x d, caches B distinct caches of one type; row s of out is what
  /// decode(x.row(s), *caches[s], ...) writes. The projections run as products over the B
  /// rows (the weights read once for the batch). With options.shared_prefix = P > 0
  /// (paged caches holding tokens [0, P) in the same pool pages), each tile of the
  /// prefix is read from memory once and scored by every sequence's heads while it is in
  /// cache (cascade attention). A call that throws appends to no cache.
  template <class Cache>
  requires detail::is_lrkv_cache<Cache, T>
  void decode_batch(const ConstMatrixRef<T>& x, std::span<Cache* const> caches, MatrixRef<T> out,
                    Workspace& ws, Threads threads = {}, BatchOptions options = {}) const {
    using S = typename Cache::storage_type;
    constexpr const char* where = "LrkvLayer::decode_batch";
    check_factored(where);
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
    const Index H = config_.n_heads;
    const Index dh = config_.head_dim;
    const Index r = config_.rank;
    const Index hr = H * r;
    const Index dr = config_.decoupled_dim();
    detail::product(x, weights_.w_k_shared, ws.batch_key.leftCols(dh));
    detail::parallel_product(x, weights_.u_k, ws.batch_key.middleCols(dh, hr), thread_count);
    detail::product(x, weights_.w_kr, ws.batch_key.rightCols(dr));
    detail::product(x, weights_.w_v_shared, ws.batch_value.leftCols(dh));
    detail::parallel_product(x, weights_.u_v, ws.batch_value.rightCols(hr), thread_count);
    detail::parallel_product(x, weights_.w_q, ws.batch_query, thread_count);
    detail::product(x, weights_.w_qr, ws.batch_query_rope);
    for (Index s = 0; s < batch; ++s) {
      Cache& cache = *caches[static_cast<std::size_t>(s)];
      const double position =
          static_cast<double>(config_.rope.position_offset + cache.sequence_length());
      finish_key(position, ws.batch_key.row(s).data(), ws.batch_rms.row(s).data(),
                 ws.scratch.data());
      finish_query(position, ws.batch_query.row(s).data(), ws.batch_query_latent.row(s).data(),
                   ws.batch_query_rope.row(s).data());
      transpose_query(ws.batch_query.row(s).data(), ws.batch_query_t.middleRows(s * dh, dh));
    }
    const bool rounded = bf16_dot_cache<Cache> && uses_bf16_dot();
    if (rounded) {
      for (Index s = 0; s < batch; ++s) {
        round_query(ws.batch_query_t.data() + s * dh * ws.batch_query_t.cols(),
                    ws.batch_query_latent.row(s).data(), ws.batch_query_pairs_bf16.row(s).data(),
                    ws.batch_query_latent_bf16.row(s).data());
      }
    }
    if constexpr (detail::is_quantized_storage<S>) {
      detail::require_finite(where, "the new tokens' keys", ws.batch_key);
      detail::require_finite(where, "the new tokens' values", ws.batch_value);
    }
    detail::BatchGrowth::grow(caches);
    // Everything that may throw is done; from here the step cannot fail.
    for (Index s = 0; s < batch; ++s) {
      auto key = ws.batch_key.row(s);
      auto value = ws.batch_value.row(s);
      caches[static_cast<std::size_t>(s)]->append_token(key.head(dh), key.segment(dh, hr),
                                                        key.tail(dr), value.head(dh),
                                                        value.tail(hr), ws.batch_rms.row(s));
    }
    // Sources 0 ... B-1: the sequences; source B: the shared prefix, every sequence's
    // heads in turn on each tile (read through the first cache).
    auto ops_for = [&](const Cache& cache, Index first_sequence, Index sequences) {
      DecodeOps<Cache> ops{cache,
                           ws.batch_query.row(first_sequence).data(),
                           ws.batch_query_latent.row(first_sequence).data(),
                           ws.batch_query_rope.row(first_sequence).data(),
                           H,
                           dh,
                           r,
                           dr,
                           key_width(),
                           dh + hr,
                           config_.key_norm};
      ops.sequences = sequences;
      ops.query_t = ws.batch_query_t.data() + first_sequence * dh * ws.batch_query_t.cols();
      ops.query_t_stride = ws.batch_query_t.cols();
      if (rounded) {
        ops.query_pairs_bf16 = ws.batch_query_pairs_bf16.row(first_sequence).data();
        ops.query_latent_bf16 = ws.batch_query_latent_bf16.row(first_sequence).data();
        ops.latent_bf16_stride = latent_stride_bf16();
      }
      return ops;
    };
    detail::run_batch(ws.batch, [&](Index source) {
      if (source == batch) return ops_for(*caches[0], 0, batch);
      return ops_for(*caches[static_cast<std::size_t>(source)], source, 1);
    });
    detail::finish_batch(ws.batch, ws.batch_acc.data());
    restore_order<S>(ws.batch_acc, batch * H, rounded);
    // o_h = a_h V_s + (a_h R_h^V)(B_h^V)^T for all B rows of head h at once.
    detail::parallel_for(H, thread_count, [&](Index h) {
      const detail::ConstRowsMap<T> acc(ws.batch_acc.data() + h * (dh + r), batch, dh + r,
                                        Eigen::OuterStride<>(H * (dh + r)));
      auto heads = ws.batch_heads.middleCols(h * dh, dh);
      heads = acc.leftCols(dh);
      if (r > 0) {
        heads.noalias() += acc.rightCols(r) * weights_.basis_v.middleCols(h * r, r).transpose();
      }
    });
    detail::parallel_product(ws.batch_heads, weights_.w_o, out, thread_count);
  }

  /// decode_batch with a workspace of its own (allocates one on every call).
  template <class Cache>
  requires detail::is_lrkv_cache<Cache, T>
  void decode_batch(const ConstMatrixRef<T>& x, std::span<Cache* const> caches, MatrixRef<T> out,
                    Threads threads = {}, BatchOptions options = {}) const {
    Workspace ws = make_workspace(threads);
    decode_batch(x, caches, out, ws, threads, options);
  }

  /// Tokens per tile of the decode pass: a cached row is (d_h + H r) wide twice over, so
  /// a few rows already fill L1; 16 keep the tile in L2 while every head reads its slices.
  Index decode_tile() const { return kDecodeTile; }

 private:
  static constexpr Index kDecodeTile = 16;

  // Whether a step over a Cache may take the bf16 dot kernels (DecodeArithmetic::bf16_dot:
  // plain bf16 rows, float queries, a build with the instruction), and whether this layer
  // does (d_h whole chunks of 32, as the dot accumulate takes them).
  template <class Cache>
  static constexpr bool bf16_dot_cache = detail::bf16_dot_storage<T, typename Cache::storage_type>;
  bool uses_bf16_dot() const {
    return bf16_dot_available() && std::is_same_v<T, float> &&
           arithmetic_ == DecodeArithmetic::bf16_dot && detail::bf16_dot_values(config_.head_dim);
  }
  // Columns per head of the rounded latent query: r in whole chunks of 32.
  Index latent_stride_bf16() const { return (config_.rank + 31) / 32 * 32; }
  // query_t (d_h x H_p, row stride H_p) and query_latent (H x r) rounded to bf16 (nearest,
  // ties even) in the layouts of detail::lrkv_score_bf16_dot. The kernel loads each q~_h in
  // whole chunks of 32, unmasked: the zeros after it keep the masked-off keys' products 0.
  void round_query(const T* query_t, const T* query_latent, Eigen::bfloat16* pairs,
                   Eigen::bfloat16* latent) const {
    const Index hp = padded_heads();
    const Index r = config_.rank;
    const Index stride = latent_stride_bf16();
    for (Index p = 0; p < config_.head_dim / 2; ++p) {
      for (Index h = 0; h < hp; ++h) {
        pairs[(p * hp + h) * 2] = Eigen::bfloat16(query_t[2 * p * hp + h]);
        pairs[(p * hp + h) * 2 + 1] = Eigen::bfloat16(query_t[(2 * p + 1) * hp + h]);
      }
    }
    for (Index h = 0; h < config_.n_heads; ++h) {
      for (Index j = 0; j < stride; ++j) {
        latent[h * stride + j] = Eigen::bfloat16(j < r ? query_latent[h * r + j] : T(0));
      }
    }
  }
  // Puts the shared columns of `rows` accumulator rows (d_h + r each) back in column order
  // after a step whose shared values were summed by the bf16 dot kernel (`rounded`) or in
  // pairs (storage S).
  template <class S>
  void restore_order(RowMatrix<T>& acc, Index rows, bool rounded) const {
    const Index dh = config_.head_dim;
    if (rounded) {
      for (Index k = 0; k < rows; ++k) detail::from_bf16_dot_order(acc.row(k).data(), dh);
    } else if (detail::paired_rows<T, S>(dh)) {
      for (Index k = 0; k < rows; ++k) detail::from_paired(acc.row(k).data(), dh);
    }
  }

  // H rounded up to whole packets: the columns of Workspace::query_t.
  Index padded_heads() const {
    constexpr Index P = detail::packet_size<T>;
    return (config_.n_heads + P - 1) / P * P;
  }

  // The shared queries q_h (H rows of d_h) as the columns of `columns` (d_h x H_p), the
  // padding heads zero: detail::lrkv_score's layout.
  template <class Columns>
  void transpose_query(const T* query, Columns&& columns) const {
    const Index H = config_.n_heads;
    const Index dh = config_.head_dim;
    columns.leftCols(H) =
        detail::ConstRowsMap<T>(query, H, dh, Eigen::OuterStride<>(dh)).transpose();
    columns.rightCols(columns.cols() - H).setZero();
  }

  Index key_width() const {
    return config_.head_dim + config_.n_heads * config_.rank + config_.decoupled_dim();
  }

  void check_factored(const char* where) const {
    if (config_.factored_exact()) return;
    throw config_error(
        std::string(where) +
        ": rope_mode full cannot be computed from the LRKV cache. RoPE on the whole key "
        "rotates the residual B_h^K r_h,t, and P_t B_h^K = B_h^K P~_t has no solution P~_t for "
        "a general B_h^K (seed 000, backup slide: B = [1; 0], P = [[0, -1], [1, 0]], PB = [0; 1] "
        "is not B c for any c), so the rotated key cannot be formed from the cached latent "
        "without expanding it. Use rope_mode commuting (B_h^K built from scaled rotations into "
        "rotary planes; exact full RoPE), shared or decoupled, or reference::forward for the "
        "expanded full-RoPE model");
  }

  // The window, sink tokens and soft-cap the kernels apply; the sink logits (one per
  // query head) or nullptr.
  detail::AttentionSpan span() const { return detail::AttentionSpan::of(config_); }
  const T* sink_logits() const { return config_.sink_logits ? weights_.sinks.data() : nullptr; }

  template <class Cache>
  void check_cache(const Cache& cache, const char* where) const {
    if (!(cache.config() == config_)) {
      throw config_error(std::string(where) + ": the cache was made for config " +
                         detail::describe(cache.config()) +
                         " (or other RoPE/key-norm settings), the layer has " +
                         detail::describe(config_));
    }
  }

  // attend's query layout (head h's [content | rope] side by side) into the workspace's
  // separate content and rope rows.
  void load_query(const ConstMatrixRef<T>& query, Workspace& ws) const {
    const Index dh = config_.head_dim;
    const Index dr = config_.decoupled_dim();
    for (Index h = 0; h < config_.n_heads; ++h) {
      ws.query.segment(h * dh, dh) = query.row(0).segment(h * (dh + dr), dh);
      ws.query_rope.segment(h * dr, dr) = query.row(0).segment(h * (dh + dr) + dh, dr);
    }
  }

  // The cache rows of x's tokens, token i at cache index past + i: keys [k~_s | R^K | k~_R]
  // (finished by finish_key), values [V_s | R^V] and the key RMS (key_norm, else 0 columns).
  void project_rows(const ConstMatrixRef<T>& x, Index past, RowMatrix<T>& key, RowMatrix<T>& value,
                    RowMatrix<T>& rms, int threads) const {
    const Index n = x.rows();
    const Index dh = config_.head_dim;
    const Index hr = config_.n_heads * config_.rank;
    const Index dr = config_.decoupled_dim();
    key.resize(n, key_width());
    value.resize(n, dh + hr);
    rms.resize(n, config_.key_norm ? config_.n_heads : 0);
    key.leftCols(dh).noalias() = x * weights_.w_k_shared;
    detail::parallel_product(x, weights_.u_k, key.middleCols(dh, hr), threads);
    key.rightCols(dr).noalias() = x * weights_.w_kr;
    value.leftCols(dh).noalias() = x * weights_.w_v_shared;
    detail::parallel_product(x, weights_.u_v, value.rightCols(hr), threads);
    RowVector<T> scratch(dh);
    for (Index i = 0; i < n; ++i) {
      const double position = static_cast<double>(config_.rope.position_offset + past + i);
      finish_key(position, key.row(i).data(), rms.row(i).data(), scratch.data());
    }
  }

  void finish_key(double position, T* key, T* rms, T* scratch) const {
    using RowMap = Eigen::Map<RowVector<T>>;
    const Index dh = config_.head_dim;
    const Index r = config_.rank;
    const Index H = config_.n_heads;
    const Index hr = H * r;
    RowMap shared_key(key, dh);
    if (config_.key_norm) {
      // rho_h from the new token's materialized key k_s + r_h (B_h^K)^T, before gain/RoPE.
      RowMap full_key(scratch, dh);
      for (Index h = 0; h < H; ++h) {
        full_key = shared_key;
        if (r > 0) {
          full_key.noalias() +=
              RowMap(key + dh + h * r, r) * weights_.basis_k.middleCols(h * r, r).transpose();
        }
        rms[h] = rms_of(scratch, dh);
      }
      shared_key = shared_key.cwiseProduct(weights_.key_norm_gain);
    }
    if (config_.rotates_shared()) rope_.rotate(key, position);
    if (config_.rope_mode == LrkvRopeMode::commuting) latent_rope_.rotate(key + dh, position);
    if (config_.rope_mode == LrkvRopeMode::decoupled) rope_.rotate(key + dh + hr, position);
  }

  void finish_query(double position, T* query, T* query_latent, T* query_rope) const {
    using RowMap = Eigen::Map<RowVector<T>>;
    const Index dh = config_.head_dim;
    const Index r = config_.rank;
    const Index H = config_.n_heads;
    const Index hr = H * r;
    // The residual query uses the rotated query only when the residual key is rotated.
    if (config_.rope_mode == LrkvRopeMode::commuting) rope_.rotate(query, position, H, dh);
    for (Index h = 0; h < H && r > 0; ++h) {
      RowMap(query_latent + h * r, r).noalias() =
          RowMap(query + h * dh, dh) * basis_k_gained_.middleCols(h * r, r);
    }
    if (config_.rope_mode == LrkvRopeMode::shared) rope_.rotate(query, position, H, dh);
    if (config_.rope_mode == LrkvRopeMode::decoupled) {
      rope_.rotate(query_rope, position, H, config_.rope_dim);
    }
    RowMap(query, H * dh) *= scale_;
    RowMap(query_latent, hr) *= scale_;
    RowMap(query_rope, H * config_.decoupled_dim()) *= scale_;
  }

  T rms_of(const T* x, Index n) const { return rms(x, n, config_.key_norm_epsilon); }

  // Sizes the workspace for a step over `length` tokens; may allocate and throw.
  detail::SplitPlan prepare(Workspace& ws, Index length, int threads) const {
    const Index H = config_.n_heads;
    const Index dh = config_.head_dim;
    const Index hr = H * config_.rank;
    auto fit = [](RowVector<T>& v, Index n) { detail::reshape(v, n); };
    fit(ws.query, H * dh);
    fit(ws.query_latent, hr);
    fit(ws.query_rope, H * config_.decoupled_dim());
    fit(ws.key, key_width());
    fit(ws.value, dh + hr);
    fit(ws.rms, config_.key_norm ? H : 0);
    fit(ws.scratch, dh);
    fit(ws.heads, H * dh);
    detail::reshape(ws.acc, H, dh + config_.rank);
    detail::reshape(ws.query_t, dh, padded_heads());
    detail::reshape(ws.query_pairs_bf16, uses_bf16_dot() ? dh * padded_heads() : 0);
    detail::reshape(ws.query_latent_bf16, uses_bf16_dot() ? H * latent_stride_bf16() : 0);
    const auto plan =
        detail::plan_split(1, H, dh + config_.rank, length, kDecodeTile, 0, threads, span());
    ws.split.fit(plan);
    return plan;
  }

  // Sizes the workspace and plans the units of a decode_batch step; may allocate and throw.
  // The prefix unit's rows are all B sequences' heads (its ops score them block by block).
  template <class Cache>
  void prepare_batch(Workspace& ws, std::span<Cache* const> caches, Index prefix,
                     int threads) const {
    const Index batch = static_cast<Index>(caches.size());
    const Index H = config_.n_heads;
    const Index dh = config_.head_dim;
    const Index hr = H * config_.rank;
    detail::reshape(ws.scratch, dh);
    detail::reshape(ws.batch_query, batch, H * dh);
    detail::reshape(ws.batch_query_latent, batch, hr);
    detail::reshape(ws.batch_query_t, batch * dh, padded_heads());
    const Index rounded_rows = uses_bf16_dot() ? batch : 0;
    detail::reshape(ws.batch_query_pairs_bf16, rounded_rows, dh * padded_heads());
    detail::reshape(ws.batch_query_latent_bf16, rounded_rows, H * latent_stride_bf16());
    detail::reshape(ws.batch_query_rope, batch, H * config_.decoupled_dim());
    detail::reshape(ws.batch_key, batch, key_width());
    detail::reshape(ws.batch_value, batch, dh + hr);
    detail::reshape(ws.batch_rms, batch, config_.key_norm ? H : 0);
    detail::reshape(ws.batch_acc, batch * H, dh + config_.rank);
    detail::reshape(ws.batch_heads, batch, H * dh);
    auto& b = ws.batch;
    b.tile = kDecodeTile;
    b.segment = detail::cache_segment(*caches[0]);
    b.width = dh + config_.rank;
    b.units.clear();
    Index slot = 0;
    detail::plan_batch_units(b.units, slot, caches, prefix, 1, H, b.tile, threads, span());
    b.softcap = config_.logit_softcap;
    b.sinks = sink_logits();
    b.heads = H;
    b.fit(batch * H, threads);
  }

  // Every head against a tile of cached rows (one group: all heads share the rows).
  // Accumulator row h is [a_h V_s (d_h) | a_h R_h^V (r)]. A key row is 7 KiB at the
  // benchmark shape and each phase passes over the tile several times (shared part,
  // then each head's residual slice), so the tile is kept small enough for L2 and each
  // phase prefetches what the other reads next: the tile's value rows while its keys
  // are scored, the next tile's key rows while its values are summed.
  template <class Cache>
  struct DecodeOps {
    using S = typename Cache::storage_type;
    const Cache& cache;
    const T* query;         // H x d_h        scaled (and rotated as the mode says)
    const T* query_latent;  // H x r          scaled
    const T* query_rope;    // H x d_R        scaled, rotated (decoupled)
    Index heads, head_dim, rank, rope_dim, key_width, value_width;
    bool key_norm;
    // Query blocks of H rows scored against each tile one after the other (a shared
    // prefix's tile, read from memory once, serves every sequence of a batch: logits and
    // accumulator rows b*H ... b*H + H-1, the queries b*H*d_h etc. on).
    Index sequences = 1;
    // The shared queries as columns (d_h x query_t_stride), for detail::lrkv_score (null:
    // score_rows instead); a block of sequences has one such matrix per sequence, d_h rows
    // apart, so each sequence's heads are scored as a single decode scores them.
    const T* query_t = nullptr;
    Index query_t_stride = 0;
    // The same rounded to bf16 (Workspace::query_pairs_bf16, query_latent_bf16) for the
    // bf16 dot kernels, or null.
    const Eigen::bfloat16* query_pairs_bf16 = nullptr;
    const Eigen::bfloat16* query_latent_bf16 = nullptr;
    Index latent_bf16_stride = 0;  // its row stride

    // [data, data + bytes) cut in two at `fraction`, for two consecutive kernel calls.
    static std::pair<detail::Prefetcher, detail::Prefetcher> halves(const void* data, Index bytes,
                                                                    double fraction) {
      const Index first = static_cast<Index>(static_cast<double>(bytes) * fraction) / 64 * 64;
      const char* p = static_cast<const char*>(data);
      return {detail::Prefetcher(p, first), detail::Prefetcher(p + first, bytes - first)};
    }

    // `spare`: (sequences * H + 1) x ld scalars; a quantized cache's kernels use H + 1 rows.
    void score(Index group, Index first, Index n, T* logits, Index ld, T* spare) const {
      for (Index b = 0; b < sequences; ++b) {
        sequence_ops(b).score_one(group, first, n, logits + b * heads * ld, ld, b == 0, spare);
      }
    }
    void accumulate(Index group, Index first, Index n, const T* weights, Index ld, T* acc,
                    T* spare) const {
      for (Index b = 0; b < sequences; ++b) {
        sequence_ops(b).accumulate_one(group, first, n, weights + b * heads * ld, ld,
                                       acc + b * heads * (head_dim + rank), b + 1 == sequences,
                                       spare);
      }
    }

    DecodeOps sequence_ops(Index b) const {
      DecodeOps ops = *this;
      ops.query += b * heads * head_dim;
      ops.query_latent += b * heads * rank;
      ops.query_rope += b * heads * rope_dim;
      ops.sequences = 1;
      if (query_t != nullptr) ops.query_t += b * head_dim * query_t_stride;
      if (query_pairs_bf16 != nullptr) {
        ops.query_pairs_bf16 += b * head_dim * query_t_stride;
        ops.query_latent_bf16 += b * heads * latent_bf16_stride;
      }
      return ops;
    }

    // One block of H query rows; `prefetch`: whether this pass prefetches (the first
    // score of a tile, the last accumulate: the others find the tile in cache).
    void score_one(Index, Index first, Index n, T* logits, Index ld, bool prefetch,
                   T* spare) const {
      if constexpr (detail::is_quantized_storage<S>) {
        score_quantized(first, n, logits, ld, prefetch, spare);
      } else {
        score_plain(first, n, logits, ld, prefetch);
      }
    }

    void score_plain(Index first, Index n, T* logits, Index ld, bool prefetch) const {
      const S* rows = cache.key_row(first);
      detail::Prefetcher values(prefetch ? cache.value_row(first) : nullptr,
                                n * value_width * Index{sizeof(S)});
      values.touch = kTouchPages;
      values.page_lead = kPageTouchLead;
      // q_h . k~_s,t for every head against the shared key (rows read by all heads) + q~_h .
      // r~_h,t, head h reading its own slice (seg = r), in one pass over each row ...
      if (!score_bf16_dot(rows, n, logits, ld, values)) {
        if (query_t != nullptr && rank >= detail::packet_size<T>) {
          detail::lrkv_score(query_t, query_t_stride, query_latent, heads, head_dim, rank, rows,
                             key_width, n, logits, ld, &values);
        } else {
          const detail::SecondDot<T> residual{query_latent, rank, rank, head_dim, rank};
          detail::score_rows(query, head_dim, heads, head_dim, rows, key_width, 0, n, logits, ld,
                             false, &values, rank > 0 ? &residual : nullptr);
        }
      }
      // ... / rho_h,t ...
      if (key_norm) {
        for (Index t = 0; t < n; ++t) {
          const auto* rho = cache.rms_row(first + t);
          for (Index h = 0; h < heads; ++h) logits[h * ld + t] /= static_cast<T>(rho[h]);
        }
      }
      // ... + q^R_h . k~_R,t (decoupled).
      if (rope_dim > 0) {
        detail::score_rows(query_rope, rope_dim, heads, rope_dim, rows + head_dim + heads * rank,
                           key_width, 0, n, logits, ld, true);
      }
    }

    void accumulate_one(Index, Index first, Index n, const T* weights, Index ld, T* acc,
                        bool prefetch, T* spare) const {
      if constexpr (detail::is_quantized_storage<S>) {
        accumulate_quantized(first, n, weights, ld, acc, prefetch, spare);
      } else {
        accumulate_plain(first, n, weights, ld, acc, prefetch, spare);
      }
    }

    // `spare`: the softmax weights rounded to bf16 for the dot kernel (H x ld bf16, half of
    // the H x ld scalars the driver's contract gives).
    void accumulate_plain(Index first, Index n, const T* weights, Index ld, T* acc, bool prefetch,
                          T* spare) const {
      const S* rows = cache.value_row(first);
      const Index acc_stride = head_dim + rank;
      // The next tile's key rows, up to the end of their page (of a paged cache).
      const Index ahead = prefetch ? std::min(n, detail::contiguous_rows(cache, first + n)) : 0;
      auto [keys_a, keys_b] = halves(ahead > 0 ? cache.key_row(first + n) : nullptr,
                                     ahead * key_width * Index{sizeof(S)}, rank > 0 ? 0.6 : 1.0);
      keys_a.touch = keys_b.touch = kTouchPages;
      keys_a.page_lead = keys_b.page_lead = kPageTouchLead;
      // (bf16 shared values are summed in pairs or by the dot kernel, each in its column
      // order, which the callers of split_attention restore.)
      if (!accumulate_bf16_dot(rows, n, weights, ld, acc, acc_stride, keys_a, spare)) {
        detail::accumulate_rows(weights, ld, heads, rows, value_width, 0, head_dim, n, acc,
                                acc_stride, kTokenBlock, &keys_a,
                                detail::paired_rows<T, S>(head_dim));
      }
      if (rank > 0) {
        detail::accumulate_rows(weights, ld, heads, rows + head_dim, value_width, rank, rank, n,
                                acc + head_dim, acc_stride, kTokenBlock, &keys_b);
      }
    }
    static constexpr Index kTokenBlock = 16;
    // Whether the plain rows' prefetches touch their pages ahead (detail::Prefetcher), in
    // AVX-512 builds: one thread, L = 65536, fp32 0.64-0.69 -> 0.74-0.83 of a read pass;
    // bf16 1.05-1.16x as fast in 7 of 8 alternating pairs (0.59-0.63 -> 0.62-0.71; the 8th
    // 0.99x), with the bf16 dot kernels 1.04-1.05x (0.675 -> 0.70-0.71). An AVX2 build's
    // fp32 step, which waits on its arithmetic, was 6-17% slower with them.
#if defined(EIGEN_VECTORIZE_AVX512)
    static constexpr bool kTouchPages = true;
#else
    static constexpr bool kTouchPages = false;
#endif
    // Pages touched 24 KiB ahead of the lines, where other mechanisms touch 8 KiB ahead:
    // each pass prefetches one short range (a 16-token tile, 59 KiB in bf16), in another
    // array than the last. One thread, decode steps over cold caches with 8, 16, 24, 32
    // and 64 KiB alternating in one process (AVX-512, docs/benchmarks.md "Rows addressed
    // from a stride; pages touched further ahead"): bf16 L = 65536 1.08-1.26x as fast
    // with 24 KiB, L = 16384 1.18x, two threads 1.17x; fp32 1.00-1.05x. 16 KiB did less,
    // 32 about the same, 64 less; touching past the tile's end (touch_past) was slower.
    static constexpr Index kPageTouchLead = 24 * 1024;

    // With the rounded queries (DecodeArithmetic::bf16_dot on a bf16 cache): the tile's
    // logits, shared and residual parts, by vdpbf16ps; false (nothing done) otherwise.
    bool score_bf16_dot(const S* rows, Index n, T* logits, Index ld,
                        detail::Prefetcher& prefetch) const {
      if constexpr (bf16_dot_cache<Cache>) {
        if (query_pairs_bf16 != nullptr) {
          detail::lrkv_score_bf16_dot(query_pairs_bf16, query_t_stride, query_latent_bf16,
                                      latent_bf16_stride, heads, head_dim, rank, rows, key_width, n,
                                      logits, ld, &prefetch);
          return true;
        }
      }
      (void)rows, (void)n, (void)logits, (void)ld, (void)prefetch;
      return false;
    }
    // The same for the shared values (acc rows acc_stride apart, in the dot kernel's
    // column order), the weights rounded into `spare` (H x ld bf16).
    bool accumulate_bf16_dot(const S* rows, Index n, const T* weights, Index ld, T* acc,
                             Index acc_stride, detail::Prefetcher& prefetch, T* spare) const {
      if constexpr (bf16_dot_cache<Cache>) {
        if (query_pairs_bf16 != nullptr) {
          detail::accumulate_rows_bf16_dot(weights, ld, heads, rows, value_width, head_dim, n, acc,
                                           acc_stride, reinterpret_cast<Eigen::bfloat16*>(spare),
                                           &prefetch, kTokenBlock);
          return true;
        }
      }
      (void)rows, (void)n, (void)weights, (void)ld, (void)acc, (void)acc_stride, (void)prefetch,
          (void)spare;
      return false;
    }

    // A quantized cache (cache/lrkv_cache.hpp): the kernels run on each part's codes and
    // fold its block scales in per token (detail/quantized_kernels.hpp). The shared part
    // is one row for all heads (score_quantized / accumulate_quantized); the residual
    // parts, head h's at residual_offset(h) = shared + h * seg, are read segmented (query
    // row h at h * seg) one scale block at a time, with head h's scale of token t folded
    // into its partial logit or its weight. k~_R is read from its bf16 rows.
    using Element = detail::storage_element_t<S>;
    using Layout = detail::LrkvRowLayout<S>;

    void score_quantized(Index first, Index n, T* logits, Index ld, bool prefetch, T* spare) const {
      using Traits = detail::StorageTraits<S>;
      const LrkvConfig& c = cache.config();
      const Element* rows = cache.key_row(first);
      const Index stride = cache.key_row_stride();
      const Index shared = Layout::shared(c), seg = Layout::residual(c);
      detail::Prefetcher values(prefetch ? cache.value_row(first) : nullptr,
                                n * cache.value_row_stride() * Index{sizeof(Element)});
      // q_h . k~_s,t for every head against the shared part ...
      detail::score_quantized<T, S>(query, head_dim, heads, rows, stride, head_dim, n, logits, ld,
                                    spare, &values);
      // ... + q~_h . r~_h,t, block by block of r, into spare (H rows), scaled per token ...
      for (Index b = 0; b * Traits::block < rank; ++b) {
        const Index c0 = b * Traits::block, w = std::min(Traits::block, rank - c0);
        detail::score_rows(query_latent + c0, rank, heads, w, rows + shared + c0, stride, seg, n,
                           spare, ld, false);
        for (Index h = 0; h < heads; ++h) {
          const Element* part = rows + shared + h * seg;
          T* out = logits + h * ld;
          const T* partial = spare + h * ld;
          for (Index t = 0; t < n; ++t) {
            out[t] += partial[t] * static_cast<T>(Traits::scale(part + t * stride, rank, b));
          }
        }
      }
      // ... / rho_h,t ...
      if (key_norm) {
        for (Index t = 0; t < n; ++t) {
          const auto* rho = cache.rms_row(first + t);
          for (Index h = 0; h < heads; ++h) logits[h * ld + t] /= static_cast<T>(load_rms(rho, h));
        }
      }
      // ... + q^R_h . k~_R,t (decoupled, bf16).
      if (rope_dim > 0) {
        detail::score_rows(query_rope, rope_dim, heads, rope_dim, cache.rope_row(first), rope_dim,
                           0, n, logits, ld, true);
      }
    }

    void accumulate_quantized(Index first, Index n, const T* weights, Index ld, T* acc,
                              bool prefetch, T* spare) const {
      using Traits = detail::StorageTraits<S>;
      const LrkvConfig& c = cache.config();
      const Element* rows = cache.value_row(first);
      const Index stride = cache.value_row_stride();
      const Index shared = Layout::shared(c), seg = Layout::residual(c);
      const Index acc_stride = head_dim + rank;
      const Index ahead = prefetch ? std::min(n, detail::contiguous_rows(cache, first + n)) : 0;
      auto [keys_a, keys_b] =
          halves(ahead > 0 ? cache.key_row(first + n) : nullptr,
                 ahead * cache.key_row_stride() * Index{sizeof(Element)}, rank > 0 ? 0.6 : 1.0);
      // a_h V_s: the shared part, every head's weights ...
      detail::accumulate_quantized<T, S>(weights, ld, heads, rows, stride, head_dim, n, acc,
                                         acc_stride, kTokenBlock, &keys_a, spare);
      // ... and a_h R_h^V, head h's weights scaled by its part's block scale of each token.
      for (Index b = 0; b * Traits::block < rank; ++b) {
        const Index c0 = b * Traits::block, w = std::min(Traits::block, rank - c0);
        for (Index h = 0; h < heads; ++h) {
          const Element* part = rows + shared + h * seg;
          const T* weight = weights + h * ld;
          T* scaled = spare + h * ld;
          for (Index t = 0; t < n; ++t) {
            scaled[t] = weight[t] * static_cast<T>(Traits::scale(part + t * stride, rank, b));
          }
        }
        detail::accumulate_rows(spare, ld, heads, rows + shared + c0, stride, seg, w, n,
                                acc + head_dim + c0, acc_stride, kTokenBlock,
                                b == 0 ? &keys_b : nullptr);
      }
    }
  };

  // Head h's key RMS from a stored RMS row (memcpy: a quantized paged cache's pages need
  // not start on a multiple of 4 bytes).
  template <class N>
  static N load_rms(const N* row, Index h) {
    N rho;
    std::memcpy(&rho, reinterpret_cast<const unsigned char*>(row) + h * Index{sizeof(N)},
                sizeof rho);
    return rho;
  }

  // A prefill's new rows as the cache will store them: the projections themselves when S
  // is T, rounded copies for a scalar S, or for a quantized S the rows quantized part by
  // part (cache/lrkv_cache.hpp) and k~_R in bf16.
  template <class S>
  struct Staged {
    using Element = detail::storage_element_t<S>;
    using Rope = typename LrkvCache<T, S>::rope_type;
    RowMatrix<Element> keys, values;  // empty when S is T
    RowMatrix<Rope> rope;             // quantized only: n x d_R
    const Element* keys_data;
    const Element* values_data;
    Staged(const LrkvConfig& c, const RowMatrix<T>& key, const RowMatrix<T>& value) {
      if constexpr (std::is_same_v<S, T>) {
        keys_data = key.data();
        values_data = value.data();
      } else if constexpr (detail::is_quantized_storage<S>) {
        using Layout = detail::LrkvRowLayout<S>;
        const Index dh = c.head_dim, hr = c.residual_width(), dr = c.decoupled_dim();
        keys.resize(key.rows(), Layout::key_row(c));
        values.resize(key.rows(), Layout::value_row(c));
        rope.resize(key.rows(), dr);
        for (Index i = 0; i < key.rows(); ++i) {
          detail::write_quantized_lrkv_token<S>(c, keys.row(i).data(), values.row(i).data(),
                                                rope.row(i).data(), key.row(i).head(dh),
                                                key.row(i).segment(dh, hr), key.row(i).tail(dr),
                                                value.row(i).head(dh), value.row(i).tail(hr));
        }
        keys_data = keys.data();
        values_data = values.data();
      } else {
        keys = key.template cast<S>();
        values = value.template cast<S>();
        keys_data = keys.data();
        values_data = values.data();
      }
    }
  };

  // Where a prefill reads key rows, value rows and key RMS rows (and a quantized cache's
  // bf16 rotary keys): the cache, then the new rows (not appended yet).
  template <class S>
  struct PrefillSource {
    detail::RowSource<S> keys, values;
    detail::RowSource<typename LrkvCache<T, S>::norm_type> rms;
    detail::RowSource<typename LrkvCache<T, S>::rope_type> rope;  // quantized S only
  };

  // One head's query tile against key tiles, factored (causal_attention.hpp's ops):
  //   logits = (Q_h K_s^T + Q~_h R_h^T) / rho_h (+ Q^R_h K_R^T), the queries scaled;
  //   acc    = [a V_s | a R_h^V] (d_h + r wide).
  template <class S>
  struct PrefillOps {
    const PrefillSource<S>& source;
    const RowMatrix<T>& query;         // L x H*d_h
    const RowMatrix<T>& query_latent;  // L x H*r
    const RowMatrix<T>& query_rope;    // L x H*d_R
    Index h, head_dim, rank, rope_dim;
    bool key_norm;

    void score(Index q0, Index nq, Index k0, Index nk, T* scores, Index stride, T* buffer) const {
      if constexpr (detail::is_quantized_storage<S>) {
        score_quantized(q0, nq, k0, nk, scores, stride, buffer);
        return;
      }
      const Index dh = head_dim;
      const Index hr = query_latent.cols();
      const auto keys = detail::rows_as<T>(source.keys, k0, nk, 0, dh + hr + rope_dim, buffer);
      detail::RowsMap<T> s(scores, nq, nk, Eigen::OuterStride<>(stride));
      s.noalias() = query.block(q0, h * dh, nq, dh) * keys.leftCols(dh).transpose();
      if (rank > 0) {
        s.noalias() += query_latent.block(q0, h * rank, nq, rank) *
                       keys.middleCols(dh + h * rank, rank).transpose();
      }
      if (key_norm) {
        for (Index c = 0; c < nk; ++c) s.col(c) /= static_cast<T>(source.rms.row(k0 + c)[h]);
      }
      if (rope_dim > 0) {
        s.noalias() +=
            query_rope.block(q0, h * rope_dim, nq, rope_dim) * keys.rightCols(rope_dim).transpose();
      }
    }

    void accumulate(Index, Index nq, Index k0, Index nk, const T* weights, Index stride, T* acc,
                    Index acc_stride, T* buffer) const {
      const Index dh = head_dim;
      const detail::ConstRowsMap<T> w(weights, nq, nk, Eigen::OuterStride<>(stride));
      detail::RowsMap<T> a(acc, nq, dh + rank, Eigen::OuterStride<>(acc_stride));
      if constexpr (detail::is_quantized_storage<S>) {
        // [v_s | r^V_h] of the tile, dequantized (this head's parts only).
        const Index width = dh + rank;
        for (Index c = 0; c < nk; ++c) dequantize_parts(source.values, k0 + c, buffer + c * width);
        const detail::ConstRowsMap<T> values(buffer, nk, width, Eigen::OuterStride<>(width));
        a.leftCols(dh).noalias() += w * values.leftCols(dh);
        if (rank > 0) a.rightCols(rank).noalias() += w * values.rightCols(rank);
        return;
      }
      const auto values =
          detail::rows_as<T>(source.values, k0, nk, 0, dh + query_latent.cols(), buffer);
      a.leftCols(dh).noalias() += w * values.leftCols(dh);
      if (rank > 0) a.rightCols(rank).noalias() += w * values.middleCols(dh + h * rank, rank);
    }

    // Token t's shared part and head h's residual part of a quantized key or value row,
    // dequantized into out[0, d_h + r).
    void dequantize_parts(const detail::RowSource<S>& rows, Index t, T* out) const {
      using Traits = detail::StorageTraits<S>;
      const auto* row = rows.row(t);
      Traits::dequantize(row, head_dim, 0, head_dim, out);
      if (rank > 0) {
        Traits::dequantize(row + Traits::row_elements(head_dim) + h * Traits::row_elements(rank),
                           rank, 0, rank, out + head_dim);
      }
    }

    // score over a quantized cache: the tile's [k~_s | r~_h | k~_R] in buffer, then as above.
    void score_quantized(Index q0, Index nq, Index k0, Index nk, T* scores, Index stride,
                         T* buffer) const {
      const Index dh = head_dim;
      const Index width = dh + rank + rope_dim;
      for (Index c = 0; c < nk; ++c) {
        T* out = buffer + c * width;
        dequantize_parts(source.keys, k0 + c, out);
        const auto* rope = source.rope.row(k0 + c);
        for (Index j = 0; j < rope_dim; ++j) out[dh + rank + j] = static_cast<T>(rope[j]);
      }
      const detail::ConstRowsMap<T> keys(buffer, nk, width, Eigen::OuterStride<>(width));
      detail::RowsMap<T> s(scores, nq, nk, Eigen::OuterStride<>(stride));
      s.noalias() = query.block(q0, h * dh, nq, dh) * keys.leftCols(dh).transpose();
      if (rank > 0) {
        s.noalias() +=
            query_latent.block(q0, h * rank, nq, rank) * keys.middleCols(dh, rank).transpose();
      }
      if (key_norm) {
        for (Index c = 0; c < nk; ++c) {
          s.col(c) /= static_cast<T>(load_rms(source.rms.row(k0 + c), h));
        }
      }
      if (rope_dim > 0) {
        s.noalias() +=
            query_rope.block(q0, h * rope_dim, nq, rope_dim) * keys.rightCols(rope_dim).transpose();
      }
    }
  };

  // The associative step of the query at sequence index `position` over the plan's
  // tokens; ws.query / ws.query_rope hold its raw projected query. With row_max /
  // row_sum, each head's max and normalizer go there and the sink logits are left out
  // (attend_states). Never throws: prepare() has sized everything.
  template <class Cache>
  void attend_prepared(const Cache& cache, Workspace& ws, const detail::SplitPlan& plan, T* heads,
                       int threads, Index position, T* row_max = nullptr,
                       T* row_sum = nullptr) const {
    using S = typename Cache::storage_type;
    const Index H = config_.n_heads;
    const Index dh = config_.head_dim;
    const Index r = config_.rank;
    finish_query(static_cast<double>(config_.rope.position_offset + position), ws.query.data(),
                 ws.query_latent.data(), ws.query_rope.data());
    transpose_query(ws.query.data(), ws.query_t);
    DecodeOps<Cache> ops{cache,
                         ws.query.data(),
                         ws.query_latent.data(),
                         ws.query_rope.data(),
                         H,
                         dh,
                         r,
                         config_.decoupled_dim(),
                         key_width(),
                         dh + H * r,
                         config_.key_norm};
    ops.query_t = ws.query_t.data();
    ops.query_t_stride = ws.query_t.cols();
    const bool rounded = bf16_dot_cache<Cache> && uses_bf16_dot();
    if (rounded) {
      round_query(ws.query_t.data(), ws.query_latent.data(), ws.query_pairs_bf16.data(),
                  ws.query_latent_bf16.data());
      ops.query_pairs_bf16 = ws.query_pairs_bf16.data();
      ops.query_latent_bf16 = ws.query_latent_bf16.data();
      ops.latent_bf16_stride = latent_stride_bf16();
    }
    detail::split_attention(plan, ws.split, ops, ws.acc.data(),
                            row_max != nullptr ? nullptr : sink_logits(), row_max, row_sum);
    restore_order<S>(ws.acc, H, rounded);
    // o_h = a_h V_s + (a_h R_h^V)(B_h^V)^T: one r x d_h product per head, independent of L.
    detail::parallel_for(H, threads, [&](Index h) {
      auto out = Eigen::Map<RowVector<T>>(heads + h * dh, dh);
      out = ws.acc.row(h).head(dh);
      if (r > 0) {
        out.noalias() += ws.acc.row(h).tail(r) * weights_.basis_v.middleCols(h * r, r).transpose();
      }
    });
  }

  LrkvConfig config_;
  LrkvWeights<T> weights_;
  Rope rope_;
  Rope latent_rope_;
  RowMatrix<T> basis_k_gained_;  // diag(g) B^K (B^K without key_norm)
  T scale_ = T(1);
  DecodeArithmetic arithmetic_ = DecodeArithmetic::fp32;
};

static_assert(AttentionLayer<LrkvLayer<float>>);
static_assert(AttentionLayer<LrkvLayer<double>>);

}  // namespace kvattn
