// The concept every attention layer models: one contract for GQA/MHA/MQA, MLA and LRKV.
//
//   scalar_type, config_type          T (float / double) and the layer's config
//   cache_type<S>                     its cache with storage type S (default T)
//   Workspace                         decode/attend scratch, owned by the caller
//   config(), softmax_scale()         the config; the scale multiplying every logit
//   query_width(), heads_width()      columns of attend's query and heads arguments
//   make_cache<S>(reserve = 0)        an empty cache, for S = T and for S = Eigen::bfloat16
//                                     (prefill, decode and attend take either)
//   make_workspace(threads = {})      a workspace sized for `threads` (one thread by default)
//   prefill(x, cache, threads = {})   L new tokens (L x d): appends them, returns L x d
//   decode(x, cache, out, ws, threads = {})
//                                     one new token (1 x d) into out (1 x d)
//   attend(query, const cache, heads, ws, threads = {})
//                                     the attention step of the newest cached token:
//                                     query 1 x query_width(), heads 1 x heads_width()
// decode and attend also have overloads without the workspace that allocate one.
// Layouts: attend's query holds head h's projected query, before RoPE, in columns
// [h * w, (h + 1) * w), w = query_width() / H, content part first, then the decoupled
// rope part (MLA, LRKV decoupled); heads holds head h's output o_h, before W_O.
#pragma once

#include <concepts>

#include "kvattn/core/threads.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn {

template <class L>
concept AttentionLayer = requires(
    const L& layer, typename L::Workspace& workspace, typename L::template cache_type<>& cache,
    const typename L::template cache_type<>& const_cache,
    typename L::template cache_type<Eigen::bfloat16>& narrow_cache,
    const typename L::template cache_type<Eigen::bfloat16>& const_narrow_cache,
    const RowMatrix<typename L::scalar_type>& x, RowMatrix<typename L::scalar_type>& out,
    Threads threads) {
  typename L::scalar_type;
  typename L::config_type;
  typename L::Workspace;
  { layer.config() } -> std::same_as<const typename L::config_type&>;
  { layer.softmax_scale() } -> std::same_as<typename L::scalar_type>;
  { layer.query_width() } -> std::same_as<Index>;
  { layer.heads_width() } -> std::same_as<Index>;
  { layer.make_cache() } -> std::same_as<typename L::template cache_type<>>;
  {
    layer.template make_cache<Eigen::bfloat16>()
    } -> std::same_as<typename L::template cache_type<Eigen::bfloat16>>;
  { layer.make_workspace() } -> std::same_as<typename L::Workspace>;
  { layer.make_workspace(threads) } -> std::same_as<typename L::Workspace>;
  { layer.prefill(x, cache, threads) } -> std::same_as<RowMatrix<typename L::scalar_type>>;
  layer.decode(x, cache, out, workspace, threads);
  layer.decode(x, cache, out, threads);
  layer.attend(x, const_cache, out, workspace, threads);
  layer.attend(x, const_cache, out, threads);
  // The same calls over a cache storing bfloat16 (one workspace type serves both).
  { layer.prefill(x, narrow_cache, threads) } -> std::same_as<RowMatrix<typename L::scalar_type>>;
  layer.decode(x, narrow_cache, out, workspace, threads);
  layer.attend(x, const_narrow_cache, out, workspace, threads);
};

}  // namespace kvattn
