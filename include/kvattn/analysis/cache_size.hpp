// Analytic KV-cache size of every mechanism, from its configuration alone.
//
// Pure constexpr functions of the configs (config/*_config.hpp); the cache code is
// never included. The caches count their own buffers and tests/test_analysis_cache.cpp
// holds the two equal. Formulas (docs/cache-size.md; seed 002 Chapters 1-4, seed 000):
//
//   elements per token per layer        MHA 2*H*d_h   GQA 2*n_kv*d_h   MQA 2*d_h
//                                       MLA d_c + d_R
//                                       LRKV 2*(d_h + H*r) + d_R (decoupled) + H (key norm)
//   bytes per token per layer           sum over parts of elements * bytes_per_element,
//                                       plus one scale per block of a block-quantized row
//   total bytes                         batch * sum over layers of bytes per token per
//                                       layer * tokens that layer keeps (min(L, W) for a
//                                       sliding-window layer), rounded up to whole pages
//
// Tensor parallelism of degree t (cache_layout(config, t) is what ONE device holds):
//   H % t == 0 always. GQA/MHA: KV heads shard when t divides n_kv; when n_kv < t and
//   n_kv divides t, each device holds one KV head (replicated t / n_kv times). MQA's
//   single head and MLA's latent are replicated on every device. LRKV: the shared
//   K_s, V_s (and decoupled k_R) replicate, the per-head latents and key RMS shard.
//   Anything else is a config_error. Summed over devices = t * per device.
#pragma once

#include <algorithm>
#include <limits>
#include <string>
#include <type_traits>

#include "kvattn/analysis/dtype.hpp"
#include "kvattn/config/gqa_config.hpp"
#include "kvattn/config/lrkv_config.hpp"
#include "kvattn/config/mla_config.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/index.hpp"

namespace kvattn::analysis {

namespace detail {

using kvattn::detail::require;

[[noreturn]] inline void fail_overflow(const char* what) {
  throw kvattn::overflow_error(std::string("kvattn::analysis: ") + what +
                               " does not fit in a signed 64-bit integer");
}

/// a * b for a, b >= 0; throws kvattn::overflow_error naming `what` on overflow.
constexpr Index mul(Index a, Index b, const char* what) {
  if (a != 0 && b > std::numeric_limits<Index>::max() / a) fail_overflow(what);
  return a * b;
}

/// a + b for a, b >= 0; throws kvattn::overflow_error naming `what` on overflow.
constexpr Index add(Index a, Index b, const char* what) {
  if (a > std::numeric_limits<Index>::max() - b) fail_overflow(what);
  return a + b;
}

/// ceil(a / b) for a >= 0, b >= 1.
constexpr Index ceil_div(Index a, Index b) { return a / b + (a % b != 0 ? 1 : 0); }

}  // namespace detail

// ---- What one token stores in one layer ----------------------------------------------

/// `count` rows of `width` elements each (a block scale never spans two rows).
struct Rows {
  Index count = 0;
  Index width = 0;
  constexpr Index elements() const {
    detail::require(count >= 0, "CacheLayout", "rows' count", count, "must be >= 0");
    detail::require(width >= 0, "CacheLayout", "rows' width", width, "must be >= 0");
    return detail::mul(count, width, "cache row elements");
  }
  constexpr bool operator==(const Rows&) const = default;
};

/// The cache of one token in one layer, split by how its parts are stored:
///   main      GQA: K and V of each KV head (2*n_kv rows of d_h); MLA: the latent c_kv
///             (1 row of d_c); LRKV: the shared K_s, V_s (2 rows of d_h)
///   residual  LRKV: each head's latents R_h^K, R_h^V (2*H rows of r); empty otherwise
///   rope      decoupled rope key k_R (MLA; LRKV decoupled), kept in rope_dtype
///   norms     LRKV key RMS scalars (key_norm, one per head), kept at >= fp32
/// main and residual are the quantizable content; a block-scaled cache adds one scale
/// per block of each of their rows.
struct CacheLayout {
  Rows main{};
  Rows residual{};
  Index rope = 0;
  Index norms = 0;

  /// Scalars stored per token per layer (scales not included).
  constexpr Index elements() const {
    detail::require(rope >= 0, "CacheLayout", "rope", rope, "must be >= 0");
    detail::require(norms >= 0, "CacheLayout", "norms", norms, "must be >= 0");
    return detail::add(detail::add(main.elements(), residual.elements(), "cache elements"),
                       detail::add(rope, norms, "cache elements"), "cache elements");
  }
  constexpr bool operator==(const CacheLayout&) const = default;
};

/// MHA at H heads of width d_h: 2*H rows of d_h (the reference of every ratio).
constexpr CacheLayout mha_layout(Index n_heads, Index head_dim) {
  detail::require(n_heads >= 1, "mha_layout", "n_heads", n_heads, "must be >= 1");
  detail::require(head_dim >= 1, "mha_layout", "head_dim", head_dim, "must be >= 1");
  return {{detail::mul(2, n_heads, "2 * n_heads"), head_dim}, {}, 0, 0};
}

/// KV heads one device holds under tensor parallelism of degree tp (rules above).
constexpr Index kv_heads_per_device(const GqaConfig& c, Index tp) {
  c.validate();
  detail::require(tp >= 1, "tensor parallelism", "tp", tp, "must be >= 1");
  detail::require(c.n_heads % tp == 0, "tensor parallelism", "tp", tp,
                  "must divide n_heads (query heads are split across devices)");
  if (c.n_kv_heads % tp == 0) return c.n_kv_heads / tp;
  detail::require(
      tp % c.n_kv_heads == 0, "tensor parallelism", "tp", tp,
      "must divide n_kv_heads (KV heads shard) or be a multiple of it (each device then "
      "holds one replicated KV head)");
  return 1;
}

/// How many devices hold a copy of each KV head: 1 when KV heads shard, t / n_kv when
/// they are replicated.
constexpr Index kv_replication(const GqaConfig& c, Index tp) {
  return detail::mul(kv_heads_per_device(c, tp), tp, "KV heads over devices") / c.n_kv_heads;
}

/// MHA / GQA / MQA: per device, 2 * (KV heads on the device) rows of d_h.
constexpr CacheLayout cache_layout(const GqaConfig& c, Index tp = 1) {
  const Index kv = kv_heads_per_device(c, tp);
  return {{detail::mul(2, kv, "2 * n_kv_heads"), c.head_dim}, {}, 0, 0};
}

/// MLA: the latent c_kv (d_c) and the shared rope key k_R (d_R), replicated on every
/// device under tensor parallelism.
constexpr CacheLayout cache_layout(const MlaConfig& c, Index tp = 1) {
  c.validate();
  detail::require(tp >= 1, "tensor parallelism", "tp", tp, "must be >= 1");
  detail::require(c.n_heads % tp == 0, "tensor parallelism", "tp", tp,
                  "must divide n_heads (query heads are split across devices)");
  return {{1, c.kv_rank}, {}, c.rope_dim, 0};
}

/// LRKV: shared K_s, V_s (replicated), each head's latents R_h^K, R_h^V (sharded),
/// the decoupled rope key (replicated) and the per-head key RMS (sharded).
constexpr CacheLayout cache_layout(const LrkvConfig& c, Index tp = 1) {
  c.validate();
  detail::require(tp >= 1, "tensor parallelism", "tp", tp, "must be >= 1");
  detail::require(c.n_heads % tp == 0, "tensor parallelism", "tp", tp,
                  "must divide n_heads (query heads and their residual latents are split)");
  const Index heads = c.n_heads / tp;
  const Index rope = c.rope_mode == LrkvRopeMode::decoupled ? c.rope_dim : 0;
  return {{2, c.head_dim},
          {detail::mul(2, heads, "2 * n_heads"), c.rank},
          rope,
          c.key_norm ? heads : 0};
}

/// Stored scalars per token per layer (on one device when tp > 1).
template <class Config>
constexpr Index elements_per_token_per_layer(const Config& c, Index tp = 1) {
  return cache_layout(c, tp).elements();
}

/// Stored scalars per token over `layers` layers.
constexpr Index elements_per_token(const CacheLayout& layout, Index layers) {
  detail::require(layers >= 1, "elements_per_token", "layers", layers, "must be >= 1");
  return detail::mul(layout.elements(), layers, "elements per token");
}

template <class Config>
constexpr Index elements_per_token(const Config& c, Index layers, Index tp = 1) {
  return elements_per_token(cache_layout(c, tp), layers);
}

// ---- Bytes -----------------------------------------------------------------------

/// How a cache stores its parts.
struct CacheStorage {
  Dtype dtype = Dtype::bf16;        // main and residual rows
  Dtype rope_dtype = Dtype::bf16;   // rope keys (MLA k_R, LRKV decoupled k_R)
  Index scale_block = 0;            // elements per block scale along each row; 0: none
  Dtype scale_dtype = Dtype::fp32;  // type of each block scale
  constexpr bool operator==(const CacheStorage&) const = default;
};

/// Every part in one type, no block scales (what the library's caches do).
constexpr CacheStorage plain_storage(Dtype dtype) { return {dtype, dtype, 0, Dtype::fp32}; }

/// Block-quantized content: rows in `dtype` with one `scale_dtype` scale per block of
/// `block` elements, the rope part kept in `rope_dtype`. The default is DeepSeek's fp8
/// MLA cache: 512 fp8 + 4 fp32 scales + 64 bf16 = 656 bytes per token per layer.
constexpr CacheStorage block_scaled_storage(Dtype dtype = Dtype::fp8_e4m3, Index block = 128,
                                            Dtype rope_dtype = Dtype::bf16,
                                            Dtype scale_dtype = Dtype::fp32) {
  return {dtype, rope_dtype, block, scale_dtype};
}

/// The storage of a library cache whose storage type is S (LrkvCache keeps key RMS as
/// max(S, float), which the >= fp32 rule for norms reproduces). A block-quantized S
/// (kvattn::Int8<B>, kvattn::Fp8E4M3<B>) has its codes' dtype, one fp32 scale per B
/// elements of each row, and a rope part in bf16.
template <class S>
constexpr CacheStorage storage_of() {
  if constexpr (is_block_quantized_v<S>) {
    return block_scaled_storage(S::code, S::block, Dtype::bf16, Dtype::fp32);
  } else {
    return plain_storage(dtype_of<S>());
  }
}

/// Block scales per token per layer: sum over rows of ceil(width / block).
constexpr Index scales_per_token_per_layer(const CacheLayout& layout, const CacheStorage& storage) {
  detail::require(storage.scale_block >= 0, "CacheStorage", "scale_block", storage.scale_block,
                  "must be >= 0 (0 means no block scales)");
  if (storage.scale_block == 0) return 0;
  auto scales = [&](const Rows& rows) {
    return rows.width == 0
               ? Index{0}
               : detail::mul(rows.count, detail::ceil_div(rows.width, storage.scale_block),
                             "block scales");
  };
  return detail::add(scales(layout.main), scales(layout.residual), "block scales");
}

/// Bytes per token per layer: content rows in dtype, rope in rope_dtype, norm scalars
/// at max(dtype, fp32), plus the block scales.
constexpr Index bytes_per_token_per_layer(const CacheLayout& layout,
                                          const CacheStorage& storage = {}) {
  using detail::add;
  using detail::mul;
  const Index element = bytes_per_element(storage.dtype);
  const Index content = add(layout.main.elements(), layout.residual.elements(), "elements");
  const Index norm_bytes = std::max(element, bytes_per_element(Dtype::fp32));
  Index bytes = mul(content, element, "bytes per token per layer");
  bytes = add(bytes, mul(layout.rope, bytes_per_element(storage.rope_dtype), "rope bytes"),
              "bytes per token per layer");
  bytes = add(bytes, mul(layout.norms, norm_bytes, "norm bytes"), "bytes per token per layer");
  bytes = add(bytes,
              mul(scales_per_token_per_layer(layout, storage),
                  bytes_per_element(storage.scale_dtype), "scale bytes"),
              "bytes per token per layer");
  return bytes;
}

template <class Config>
constexpr Index bytes_per_token_per_layer(const Config& c, const CacheStorage& storage = {},
                                          Index tp = 1) {
  return bytes_per_token_per_layer(cache_layout(c, tp), storage);
}

/// Bytes per token over `layers` layers (every layer holding the token).
constexpr Index bytes_per_token(const CacheLayout& layout, const CacheStorage& storage,
                                Index layers) {
  detail::require(layers >= 1, "bytes_per_token", "layers", layers, "must be >= 1");
  return detail::mul(bytes_per_token_per_layer(layout, storage), layers, "bytes per token");
}

// ---- Totals over layers x sequence length x batch ---------------------------------

/// The attention layers of a model. A sliding-window layer keeps at most
/// sink_tokens + window + max_rollback tokens (the first sink_tokens, StreamingLLM's
/// sinks, and the most recent window + max_rollback), as kvattn's windowed paged caches
/// and serving systems do; the others keep them all.
struct LayerStack {
  Index layers = 1;         // l, attention layers in the model
  Index window_layers = 0;  // how many of them use a sliding window
  Index window = 0;         // W, tokens a window layer keeps (>= 1 when window_layers > 0)
  Index sink_tokens = 0;    // k, first tokens a window layer keeps as well
  Index max_rollback = 0;   // tokens past the window kept so truncate can roll back
  constexpr bool operator==(const LayerStack&) const = default;

  /// The most tokens one window layer keeps: k + W + max_rollback.
  constexpr Index window_keeps() const {
    return detail::add(detail::add(window, sink_tokens, "window tokens"), max_rollback,
                       "window tokens");
  }
};

/// What is being served: `batch` sequences of `seq_len` tokens each, in a cache that
/// allocates whole pages of `page_tokens` tokens (0: exact, not paged).
struct Workload {
  Index seq_len = 1;
  Index batch = 1;
  Index page_tokens = 0;
  constexpr bool operator==(const Workload&) const = default;
};

constexpr void check(const LayerStack& s) {
  constexpr const char* where = "LayerStack";
  detail::require(s.layers >= 1, where, "layers", s.layers, "must be >= 1");
  detail::require(s.window_layers >= 0 && s.window_layers <= s.layers, where, "window_layers",
                  s.window_layers, "must be in [0, layers]");
  detail::require(s.window_layers == 0 || s.window >= 1, where, "window", s.window,
                  "must be >= 1 when there are sliding-window layers");
  detail::require(s.window >= 0, where, "window", s.window, "must be >= 0");
  detail::require(s.sink_tokens >= 0, where, "sink_tokens", s.sink_tokens, "must be >= 0");
  detail::require(s.max_rollback >= 0, where, "max_rollback", s.max_rollback, "must be >= 0");
  detail::require((s.sink_tokens == 0 && s.max_rollback == 0) || s.window_layers > 0, where,
                  "sink_tokens / max_rollback", s.sink_tokens + s.max_rollback,
                  "need sliding-window layers (they apply to window layers only)");
}

constexpr void check(const Workload& w) {
  constexpr const char* where = "Workload";
  detail::require(w.seq_len >= 0, where, "seq_len", w.seq_len, "must be >= 0");
  detail::require(w.batch >= 1, where, "batch", w.batch, "must be >= 1");
  detail::require(w.page_tokens >= 0, where, "page_tokens", w.page_tokens,
                  "must be >= 0 (0 means not paged)");
}

/// Token slots one sequence occupies in one layer: min(seq_len, limit) (limit 0: none),
/// rounded up to a whole number of pages when page_tokens > 0.
constexpr Index cached_tokens(Index seq_len, Index limit, Index page_tokens) {
  const Index kept = limit > 0 ? std::min(seq_len, limit) : seq_len;
  return page_tokens > 0 ? detail::mul(detail::ceil_div(kept, page_tokens), page_tokens, "pages")
                         : kept;
}

/// Token slots of one sequence summed over the layers of `stack`.
constexpr Index cached_token_layers(const LayerStack& stack, const Workload& work) {
  check(stack);
  check(work);
  const Index full = stack.layers - stack.window_layers;
  const Index full_tokens = cached_tokens(work.seq_len, 0, work.page_tokens);
  const Index window_tokens =
      stack.window_layers > 0 ? cached_tokens(work.seq_len, stack.window_keeps(), work.page_tokens)
                              : 0;
  return detail::add(detail::mul(full, full_tokens, "token slots"),
                     detail::mul(stack.window_layers, window_tokens, "token slots"), "token slots");
}

/// Scalars the whole cache stores: batch * sum over layers of elements * kept tokens.
constexpr Index total_elements(const CacheLayout& layout, const LayerStack& stack,
                               const Workload& work) {
  return detail::mul(
      work.batch,
      detail::mul(layout.elements(), cached_token_layers(stack, work), "total elements"),
      "total elements");
}

/// Bytes the whole cache stores (block scales included).
constexpr Index total_bytes(const CacheLayout& layout, const CacheStorage& storage,
                            const LayerStack& stack, const Workload& work) {
  return detail::mul(work.batch,
                     detail::mul(bytes_per_token_per_layer(layout, storage),
                                 cached_token_layers(stack, work), "total bytes"),
                     "total bytes");
}

// ---- Comparisons ---------------------------------------------------------------------

/// Elements relative to MHA at the same H and d_h: 2*n_kv*d_h / (2*H*d_h) for GQA,
/// 1/H + r/d_h for LRKV (seed 000, Eq. 9), (d_c + d_R) / (2*H*d_h) for MLA.
constexpr double ratio_to_mha(const CacheLayout& layout, Index n_heads, Index head_dim) {
  return static_cast<double>(layout.elements()) /
         static_cast<double>(mha_layout(n_heads, head_dim).elements());
}

/// Bytes relative to MHA at the same H, d_h and storage (block scales on both sides).
constexpr double ratio_to_mha(const CacheLayout& layout, const CacheStorage& storage, Index n_heads,
                              Index head_dim) {
  return static_cast<double>(bytes_per_token_per_layer(layout, storage)) /
         static_cast<double>(bytes_per_token_per_layer(mha_layout(n_heads, head_dim), storage));
}

/// The number of GQA groups (KV heads of width d_h) with the same cache elements:
/// elements / (2 * d_h). MLA at DeepSeek-V2's shape: 576 / 256 = 2.25.
constexpr double gqa_equivalent_groups(const CacheLayout& layout, Index head_dim) {
  return static_cast<double>(layout.elements()) /
         static_cast<double>(mha_layout(1, head_dim).elements());
}

/// The same in bytes: bytes / bytes of one KV group in the same storage.
constexpr double gqa_equivalent_groups(const CacheLayout& layout, const CacheStorage& storage,
                                       Index head_dim) {
  return static_cast<double>(bytes_per_token_per_layer(layout, storage)) /
         static_cast<double>(bytes_per_token_per_layer(mha_layout(1, head_dim), storage));
}

/// The head width an MHA comparison uses for each mechanism: d_h; for MLA the content
/// width of a query/key head, d_nope (DeepSeek-V2: 128, as the seeds count MHA).
constexpr Index reference_head_dim(const GqaConfig& c) { return c.head_dim; }
constexpr Index reference_head_dim(const MlaConfig& c) { return c.qk_nope_dim; }
constexpr Index reference_head_dim(const LrkvConfig& c) { return c.head_dim; }

/// Cache elements relative to MHA with the config's own H and reference head width.
template <class Config>
constexpr double ratio_to_mha(const Config& c) {
  return ratio_to_mha(cache_layout(c), c.n_heads, reference_head_dim(c));
}

/// GQA-equivalent group count at the config's reference head width.
template <class Config>
constexpr double gqa_equivalent_groups(const Config& c) {
  return gqa_equivalent_groups(cache_layout(c), reference_head_dim(c));
}

}  // namespace kvattn::analysis
