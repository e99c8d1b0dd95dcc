// The paged KV cache of the MHA / GQA / MQA family: the rows of GqaCache, kept in pages
// of a shared PagePool (see page_pool.hpp, paged_rows.hpp).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "kvattn/cache/gqa_cache.hpp"
#include "kvattn/cache/kv_cache.hpp"
#include "kvattn/cache/page_pool.hpp"
#include "kvattn/cache/paged_cache_base.hpp"
#include "kvattn/cache/paged_rows.hpp"
#include "kvattn/cache/token_buffer.hpp"
#include "kvattn/config/gqa_config.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn {

template <class T>
class GqaLayer;

namespace detail {
// Blocks of a GQA page: each KV head's keys, then each KV head's values (d_h wide).
template <class S>
PageLayout gqa_page_layout(const GqaConfig& c, Index page_tokens) {
  c.validate();
  using Traits = StorageTraits<S>;
  std::vector<PageBlock> blocks(
      static_cast<std::size_t>(2 * c.n_kv_heads),
      PageBlock{Traits::row_elements(c.head_dim), sizeof(typename Traits::element), 0});
  return page_layout(page_tokens, std::move(blocks));
}
}  // namespace detail

/// A pool of pages for GQA-family caches of `config` with storage type S.
template <class S>
std::shared_ptr<PagePool> make_gqa_page_pool(const GqaConfig& config, Index page_tokens,
                                             Index max_pages) {
  const auto layout = detail::gqa_page_layout<S>(config, page_tokens);
  return std::make_shared<PagePool>(
      detail::page_layout_name<S>("GqaCache", detail::describe(config), page_tokens), page_tokens,
      layout.page_bytes, max_pages);
}

/// GqaCache's rows (K and V of every KV head, keys rotated) in pool pages: a block table
/// of pages of page_tokens tokens. Models KVCache. Copying forks the sequence: the copy
/// shares every page, and whichever writes into a shared page first copies it
/// (copy-on-write). truncate, clear and destruction return pages to the pool; capacity
/// is the pages held. A call that needs a page from an exhausted pool throws
/// pool_exhausted and changes nothing.
template <class T, class S = T>
class PagedGqaCache : public detail::PagedCacheBase<GqaConfig> {
 public:
  using compute_type = T;
  using storage_type = S;
  using element_type = detail::storage_element_t<S>;
  using rows_type = typename GqaCache<T, S>::rows_type;

  /// With a window (config.window > 0), the cache keeps the sink tokens and the last
  /// window + max_rollback tokens, returning every page past them to the pool.
  PagedGqaCache(const GqaConfig& config, std::shared_ptr<PagePool> pool, Index max_rollback = 0)
      : detail::PagedCacheBase<GqaConfig>(
            "PagedGqaCache", config, pool,
            detail::gqa_page_layout<S>(config, pool ? pool->page_tokens() : 1),
            detail::page_layout_name<S>("GqaCache", detail::describe(config),
                                        pool ? pool->page_tokens() : 1),
            "make_gqa_page_pool", max_rollback) {}

  void append(const rows_type& rows) { append(rows.keys, rows.values); }

  /// Appends n tokens of keys and values (n x (n_kv * d_h) each). Strong guarantee.
  void append(const ConstMatrixRef<T>& keys, const ConstMatrixRef<T>& values) {
    const Index width = config_.kv_width();
    detail::check_shape("PagedGqaCache::append", "keys", keys, -1, width);
    detail::check_shape("PagedGqaCache::append", "values", values, keys.rows(), width);
    if constexpr (detail::is_quantized_storage<S>) {
      detail::require_finite("PagedGqaCache::append", "keys", keys);
      detail::require_finite("PagedGqaCache::append", "values", values);
    }
    rows_.prepare_append(keys.rows());
    for (Index t = 0; t < keys.rows(); ++t) append_token(keys.row(t), values.row(t));
  }

  /// Pointer to KV head g's key / value row of token t; rows are contiguous (row_stride()
  /// elements apart, laid out as in GqaCache) to the end of t's page.
  const element_type* key_row(Index g, Index t) const {
    return rows_.template row<element_type>(g, t);
  }
  const element_type* value_row(Index g, Index t) const {
    return rows_.template row<element_type>(config_.n_kv_heads + g, t);
  }
  Index row_stride() const { return detail::StorageTraits<S>::row_elements(config_.head_dim); }

 private:
  friend class GqaLayer<T>;
  friend struct detail::BatchGrowth;
  using detail::PagedCacheBase<GqaConfig>::grow_for;

  // Writes and counts one token (1 x n_kv*d_h rows); grow_for must have run.
  template <class KeyRow, class ValueRow>
  void append_token(const KeyRow& key, const ValueRow& value) noexcept {
    const Index t = sequence_length();
    const Index dh = config_.head_dim;
    using Traits = detail::StorageTraits<S>;
    for (Index g = 0; g < config_.n_kv_heads; ++g) {
      element_type* k = rows_.template writable_row<element_type>(g, t);
      element_type* v = rows_.template writable_row<element_type>(config_.n_kv_heads + g, t);
      if constexpr (Traits::quantized) {
        Traits::encode([&](Index j) { return key(g * dh + j); }, dh, k);
        Traits::encode([&](Index j) { return value(g * dh + j); }, dh, v);
      } else {
        for (Index j = 0; j < dh; ++j) {
          k[j] = static_cast<S>(key(g * dh + j));
          v[j] = static_cast<S>(value(g * dh + j));
        }
      }
    }
    rows_.commit(1);
  }
};

static_assert(detail::check_kv_cache<PagedGqaCache<float>>());

}  // namespace kvattn
