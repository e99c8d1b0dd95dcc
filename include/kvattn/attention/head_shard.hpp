// Tensor (head) parallelism in one process: the layer one device runs.
//
// shard_heads(layer, rank, ranks) is the layer device `rank` of `ranks` holds under the
// analysis module's tensor-parallel rules (analysis/cache_size.hpp, kvcalc --tp):
//   query heads    H % t == 0; rank r runs heads [r*H/t, (r+1)*H/t)
//   GQA KV heads   split when t divides n_kv (rank r holds heads [r*n_kv/t, (r+1)*n_kv/t));
//                  when t is a multiple of n_kv, the one KV head its query heads read
//                  (replicated t / n_kv times)
//   MLA            W_DKV, W_KR and both norm gains (and W_DQ) replicated; W_UQ | W_Q,
//                  W_UK, W_UV split with the heads
//   LRKV           W_shared^{K,V}, W_KR and the key-norm gain g replicated; W_Q, U_h, B_h,
//                  W_QR split with the heads (so are the per-head key RMS in the cache)
// and in every mechanism W_O's rows and the sink logits of the rank's heads.
//
// Shapes (rows are tokens): the sub-layer takes the same x (L x d) and returns L x d,
// the rank's partial output [o_h0 ... o_h1) W_O[h0:h1, :]. Since y = [o_1 ... o_H] W_O
// splits by row blocks of W_O and none of these layers has an output bias, the sum of
// the sub-layers' outputs over all ranks is the layer's output (an all-reduce).
#pragma once

#include <cassert>
#include <utility>

#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn {

namespace detail {

/// The query heads one rank runs: [first, first + count).
struct HeadRange {
  Index first = 0;
  Index count = 0;
};

/// Rank `rank`'s contiguous share of n_heads query heads; `ranks` must already have
/// passed the analysis module's checks (so it divides n_heads).
inline HeadRange shard_head_range(Index n_heads, Index rank, Index ranks) {
  if (rank < 0 || rank >= ranks) {
    fail_config("shard_heads: rank (", rank, ") must be in [0, ranks) = [0, ", ranks,
                ") (one sub-layer per device of tensor parallelism tp ", ranks, ")");
  }
  const Index count = n_heads / ranks;
  return {rank * count, count};
}

/// Columns [first * width, (first + count) * width) of `m`: `count` heads of `width`.
template <class Matrix>
Matrix head_columns(const Matrix& m, const HeadRange& heads, Index width) {
  return m.middleCols(heads.first * width, heads.count * width);
}

/// Rows [first * width, (first + count) * width) of `m` (W_O's rows of the heads).
template <class Matrix>
Matrix head_rows(const Matrix& m, const HeadRange& heads, Index width) {
  return m.middleRows(heads.first * width, heads.count * width);
}

}  // namespace detail

/// The GQA-family layer device `rank` of `ranks` runs: n_heads / ranks query heads
/// and analysis::kv_heads_per_device(config, ranks) KV heads (its own share, or the one
/// replicated KV head its query heads read), with those heads' columns of w_q, w_k,
/// w_v and the biases, w_o's rows and the sink logits. Throws config_error when ranks
/// does not fit the config (the analysis module's message, naming tp) or rank is not
/// in [0, ranks).
template <class T>
GqaLayer<T> shard_heads(const GqaLayer<T>& layer, Index rank, Index ranks) {
  const GqaConfig& config = layer.config();
  const Index kv_heads = analysis::kv_heads_per_device(config, ranks);
  const detail::HeadRange queries = detail::shard_head_range(config.n_heads, rank, ranks);
  // Query heads of one rank never straddle two KV groups: either a rank holds whole
  // groups (t | n_kv) or a group spans whole ranks (n_kv | t), so its first KV head is
  // the group of its first query head in both cases.
  const detail::HeadRange keys{queries.first / config.group_size(), kv_heads};

  GqaConfig sub = config;
  sub.n_heads = queries.count;
  sub.n_kv_heads = kv_heads;
  // scale() defaults from head_dim alone, which sharding keeps.
  assert(sub.scale() == config.scale());

  const GqaWeights<T>& w = layer.weights();
  const Index dh = config.head_dim;
  GqaWeights<T> part;
  part.w_q = detail::head_columns(w.w_q, queries, dh);
  part.w_k = detail::head_columns(w.w_k, keys, dh);
  part.w_v = detail::head_columns(w.w_v, keys, dh);
  part.w_o = detail::head_rows(w.w_o, queries, dh);
  if (config.qkv_bias) {
    part.bias_q = detail::head_columns(w.bias_q, queries, dh);
    part.bias_k = detail::head_columns(w.bias_k, keys, dh);
    part.bias_v = detail::head_columns(w.bias_v, keys, dh);
  }
  if (config.sink_logits) part.sinks = detail::head_columns(w.sinks, queries, 1);
  return GqaLayer<T>(sub, std::move(part));
}

/// The MLA layer device `rank` of `ranks` runs: n_heads / ranks heads with their
/// columns of w_uq (or w_q), w_uk, w_uv, w_o's rows and the sink logits; the latent
/// projections w_dkv, w_kr, w_dq and both norm gains replicated, so every rank caches
/// the whole latent (analysis::cache_layout(config, ranks)). Throws as the GQA overload.
template <class T>
MlaLayer<T> shard_heads(const MlaLayer<T>& layer, Index rank, Index ranks) {
  const MlaConfig& config = layer.config();
  (void)analysis::cache_layout(config, ranks);
  const detail::HeadRange heads = detail::shard_head_range(config.n_heads, rank, ranks);

  MlaConfig sub = config;
  sub.n_heads = heads.count;
  // scale() defaults from d_nope + d_R and YaRN's m, which sharding keeps.
  assert(sub.scale() == config.scale());

  const MlaWeights<T>& w = layer.weights();
  MlaWeights<T> part;
  part.w_dq = w.w_dq;
  part.q_norm_gain = w.q_norm_gain;
  if (config.q_rank > 0) {
    part.w_uq = detail::head_columns(w.w_uq, heads, config.qk_head_dim());
  } else {
    part.w_q = detail::head_columns(w.w_q, heads, config.qk_head_dim());
  }
  part.w_dkv = w.w_dkv;
  part.kv_norm_gain = w.kv_norm_gain;
  part.w_kr = w.w_kr;
  part.w_uk = detail::head_columns(w.w_uk, heads, config.qk_nope_dim);
  part.w_uv = detail::head_columns(w.w_uv, heads, config.v_dim);
  part.w_o = detail::head_rows(w.w_o, heads, config.v_dim);
  if (config.sink_logits) part.sinks = detail::head_columns(w.sinks, heads, 1);
  return MlaLayer<T>(sub, std::move(part));
}

/// The LRKV layer device `rank` of `ranks` runs: n_heads / ranks heads with their
/// columns of w_q, u_k, u_v, basis_k, basis_v and w_qr, w_o's rows and the sink
/// logits; the shared w_k_shared, w_v_shared, the decoupled w_kr and the key-norm gain
/// replicated. Its cache holds the shared K_s, V_s (and k_R) plus its heads' latents
/// and key RMS, analysis::cache_layout(config, ranks). Throws as the GQA overload.
template <class T>
LrkvLayer<T> shard_heads(const LrkvLayer<T>& layer, Index rank, Index ranks) {
  const LrkvConfig& config = layer.config();
  (void)analysis::cache_layout(config, ranks);
  const detail::HeadRange heads = detail::shard_head_range(config.n_heads, rank, ranks);

  LrkvConfig sub = config;
  sub.n_heads = heads.count;
  // scale() defaults from d_h + d_R, which sharding keeps.
  assert(sub.scale() == config.scale());

  const LrkvWeights<T>& w = layer.weights();
  const Index r = config.rank;
  LrkvWeights<T> part;
  part.w_q = detail::head_columns(w.w_q, heads, config.head_dim);
  part.w_k_shared = w.w_k_shared;
  part.w_v_shared = w.w_v_shared;
  part.u_k = detail::head_columns(w.u_k, heads, r);
  part.u_v = detail::head_columns(w.u_v, heads, r);
  part.basis_k = detail::head_columns(w.basis_k, heads, r);
  part.basis_v = detail::head_columns(w.basis_v, heads, r);
  part.w_o = detail::head_rows(w.w_o, heads, config.head_dim);
  part.w_qr = detail::head_columns(w.w_qr, heads, config.decoupled_dim());
  part.w_kr = w.w_kr;
  part.key_norm_gain = w.key_norm_gain;
  if (config.sink_logits) part.sinks = detail::head_columns(w.sinks, heads, 1);
  return LrkvLayer<T>(sub, std::move(part));
}

}  // namespace kvattn
