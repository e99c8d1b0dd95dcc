// The paged KV cache of LRKV: LrkvCache's key rows, value rows and key RMS in pages of a
// shared PagePool.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kvattn/cache/kv_cache.hpp"
#include "kvattn/cache/lrkv_cache.hpp"
#include "kvattn/cache/page_pool.hpp"
#include "kvattn/cache/paged_cache_base.hpp"
#include "kvattn/cache/paged_gqa_cache.hpp"
#include "kvattn/cache/paged_rows.hpp"
#include "kvattn/config/lrkv_config.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/quantized.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn {

template <class T>
class LrkvLayer;

namespace detail {
// Three blocks per page: key RMS rows (norm_type, key_norm only), key rows
// [k~_s | r~_1..H | k~_R] and value rows [v_s | r^V_1..H] (storage S). The wider
// norm_type comes first, so packed pages keep every element aligned: a page's bytes are
// page_tokens x (H sizeof(norm_type) + (2 d_h + 2 H r + d_R) sizeof(S)), and 2 d_h +
// 2 H r + d_R is even (d_R is), so a page is a multiple of 4 bytes even for 2-byte S.
//
// A quantized S (Int8<B>, Fp8E4M3<B>) stores key rows [k~_s | r~_1..H] and value rows
// [v_s | r^V_1..H] as one-byte codes with each part's fp32 block scales after its codes
// (LrkvRowLayout), and a fourth block of the decoupled rotary keys k~_R in bf16. A key
// row and a value row have the same even number of bytes, so the bf16 block starts on an
// even byte; the key RMS are read with memcpy (a page need not be a multiple of 4 bytes).
template <class S>
PageLayout lrkv_page_layout(const LrkvConfig& c, Index page_tokens) {
  c.validate();
  using Cache = LrkvCache<float, S>;
  using norm_type = typename Cache::norm_type;
  using Layout = LrkvRowLayout<S>;
  constexpr std::size_t element = sizeof(typename Cache::element_type);
  std::vector<PageBlock> blocks{PageBlock{c.key_norm ? c.n_heads : 0, sizeof(norm_type), 0},
                                PageBlock{Layout::key_row(c), element, 0},
                                PageBlock{Layout::value_row(c), element, 0}};
  if constexpr (is_quantized_storage<S>) {
    blocks.push_back(PageBlock{c.decoupled_dim(), sizeof(Eigen::bfloat16), 0});
  }
  return page_layout(page_tokens, std::move(blocks));
}
}  // namespace detail

/// A pool of pages for LRKV caches of `config` with storage type S.
template <class S>
std::shared_ptr<PagePool> make_lrkv_page_pool(const LrkvConfig& config, Index page_tokens,
                                              Index max_pages) {
  const auto layout = detail::lrkv_page_layout<S>(config, page_tokens);
  return std::make_shared<PagePool>(
      detail::page_layout_name<S>("LrkvCache", detail::describe(config), page_tokens), page_tokens,
      layout.page_bytes, max_pages);
}

/// LrkvCache's rows in pool pages (see PagedGqaCache for the paging rules).
template <class T, class S = T>
class PagedLrkvCache : public detail::PagedCacheBase<LrkvConfig> {
  static constexpr bool quantized = detail::is_quantized_storage<S>;
  using Layout = detail::LrkvRowLayout<S>;

 public:
  using compute_type = T;
  using storage_type = S;
  using rows_type = typename LrkvCache<T, S>::rows_type;
  using element_type = typename LrkvCache<T, S>::element_type;
  using rope_type = typename LrkvCache<T, S>::rope_type;
  using norm_type = typename LrkvCache<T, S>::norm_type;

  /// With a window (config.window > 0), the cache keeps the sink tokens and the last
  /// window + max_rollback tokens, returning every page past them to the pool.
  PagedLrkvCache(const LrkvConfig& config, std::shared_ptr<PagePool> pool, Index max_rollback = 0)
      : detail::PagedCacheBase<LrkvConfig>(
            "PagedLrkvCache", config, pool,
            detail::lrkv_page_layout<S>(config, pool ? pool->page_tokens() : 1),
            detail::page_layout_name<S>("LrkvCache", detail::describe(config),
                                        pool ? pool->page_tokens() : 1),
            "make_lrkv_page_pool", max_rollback) {}

  /// Appends n tokens of raw rows (as LrkvCache::append, key RMS finite and > 0).
  void append(const rows_type& rows) {
    detail::check_lrkv_rows("PagedLrkvCache::append", config_, rows, true);
    append_unchecked(rows);
  }

  /// Whole stored rows of token t (laid out as LrkvCache's); rows of one page are
  /// contiguous.
  const element_type* key_row(Index t) const { return rows_.template row<element_type>(1, t); }
  const element_type* value_row(Index t) const { return rows_.template row<element_type>(2, t); }
  const norm_type* rms_row(Index t) const { return rows_.template row<norm_type>(0, t); }
  /// Token t's decoupled rotary key k~_R (d_R elements; in the key row for a scalar S).
  const rope_type* rope_row(Index t) const {
    if constexpr (quantized) {
      return rows_.template row<rope_type>(3, t);
    } else {
      return key_row(t) + config_.head_dim + config_.residual_width();
    }
  }
  Index key_row_stride() const { return Layout::key_row(config_); }
  Index value_row_stride() const { return Layout::value_row(config_); }
  Index rope_stride() const {
    return quantized ? config_.decoupled_dim() : Layout::key_row(config_);
  }

 private:
  friend class LrkvLayer<T>;
  friend struct detail::BatchGrowth;
  using detail::PagedCacheBase<LrkvConfig>::grow_for;

  void append_unchecked(const rows_type& rows) {
    if constexpr (quantized) detail::require_finite_lrkv_rows("PagedLrkvCache::append", rows);
    const Index n = rows.shared_keys.rows();
    rows_.prepare_append(n);
    for (Index t = 0; t < n; ++t) {
      append_token(rows.shared_keys.row(t), rows.residual_keys.row(t), rows.rope_keys.row(t),
                   rows.shared_values.row(t), rows.residual_values.row(t), rows.key_rms.row(t));
    }
  }

  // Writes and counts one token; prepare_append must have run.
  template <class A, class B, class C, class D, class E, class F>
  void append_token(const A& shared_key, const B& residual_key, const C& rope_key,
                    const D& shared_value, const E& residual_value, const F& key_rms) noexcept {
    const Index t = sequence_length();
    if constexpr (quantized) {
      detail::write_quantized_lrkv_token<S>(
          config_, rows_.template writable_row<element_type>(1, t),
          rows_.template writable_row<element_type>(2, t),
          rows_.template writable_row<rope_type>(3, t), shared_key, residual_key, rope_key,
          shared_value, residual_value);
    } else {
      const Index dh = config_.head_dim;
      const Index hr = config_.residual_width();
      S* k = rows_.template writable_row<S>(1, t);
      for (Index j = 0; j < dh; ++j) k[j] = static_cast<S>(shared_key(j));
      for (Index j = 0; j < hr; ++j) k[dh + j] = static_cast<S>(residual_key(j));
      for (Index j = 0; j < config_.decoupled_dim(); ++j)
        k[dh + hr + j] = static_cast<S>(rope_key(j));
      S* v = rows_.template writable_row<S>(2, t);
      for (Index j = 0; j < dh; ++j) v[j] = static_cast<S>(shared_value(j));
      for (Index j = 0; j < hr; ++j) v[dh + j] = static_cast<S>(residual_value(j));
    }
    auto* n = reinterpret_cast<unsigned char*>(rows_.template writable_row<norm_type>(0, t));
    const Index norms = config_.key_norm ? config_.n_heads : 0;
    for (Index j = 0; j < norms; ++j) {  // memcpy: a quantized page may start unaligned
      const auto rho = static_cast<norm_type>(key_rms(j));
      std::memcpy(n + j * sizeof(norm_type), &rho, sizeof rho);
    }
    rows_.commit(1);
  }
};

static_assert(detail::check_kv_cache<PagedLrkvCache<float>>());
static_assert(detail::check_kv_cache<PagedLrkvCache<float, BlockQuantized<Dtype::int8, 128>>>());

}  // namespace kvattn
