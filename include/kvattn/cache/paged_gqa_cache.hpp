// The paged KV cache of the MHA / GQA / MQA family: the rows of GqaCache, kept in pages
// of a shared PagePool (see page_pool.hpp, paged_rows.hpp).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "kvattn/analysis/dtype.hpp"
#include "kvattn/cache/gqa_cache.hpp"
#include "kvattn/cache/kv_cache.hpp"
#include "kvattn/cache/page_pool.hpp"
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
  std::vector<PageBlock> blocks(static_cast<std::size_t>(2 * c.n_kv_heads),
                                PageBlock{c.head_dim, sizeof(S), 0});
  return page_layout(page_tokens, std::move(blocks));
}
template <class S>
std::string page_layout_name(const std::string& cache, const std::string& config,
                             Index page_tokens) {
  return cache + " " + config + " " + std::string(analysis::to_string(analysis::dtype_of<S>())) +
         ", " + std::to_string(page_tokens) + " tokens per page";
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
class PagedGqaCache {
 public:
  using compute_type = T;
  using storage_type = S;
  using rows_type = typename GqaCache<T, S>::rows_type;

  PagedGqaCache(const GqaConfig& config, std::shared_ptr<PagePool> pool)
      : config_(config), rows_(checked(config, std::move(pool))) {}

  const GqaConfig& config() const { return config_; }
  const PagePool& pool() const { return rows_.pool(); }
  Index tokens() const { return rows_.tokens(); }
  Index capacity() const { return rows_.capacity(); }
  Index page_tokens() const { return rows_.page_tokens(); }
  /// The pages holding the sequence, in order (pool page indices).
  const std::vector<Index>& block_table() const { return rows_.table(); }
  Index elements_per_token() const { return config_.cache_elements_per_token(); }
  std::size_t bytes() const { return rows_.bytes(); }
  std::size_t capacity_bytes() const { return rows_.capacity_bytes(); }

  /// Pages for `n` tokens in all. Strong exception guarantee (pool_exhausted).
  void reserve(Index n) {
    if (n < 0)
      throw shape_error("PagedGqaCache::reserve: n (" + std::to_string(n) + ") must be >= 0");
    rows_.reserve(n);
  }
  void clear() noexcept { rows_.truncate(0); }
  /// Rolls back to the first n tokens, returning the pages past them to the pool.
  void truncate(Index n) {
    detail::check_truncate("PagedGqaCache", n, tokens());
    rows_.truncate(n);
  }

  void append(const rows_type& rows) { append(rows.keys, rows.values); }

  /// Appends n tokens of keys and values (n x (n_kv * d_h) each). Strong guarantee.
  void append(const ConstMatrixRef<T>& keys, const ConstMatrixRef<T>& values) {
    const Index width = config_.kv_width();
    detail::check_shape("PagedGqaCache::append", "keys", keys, -1, width);
    detail::check_shape("PagedGqaCache::append", "values", values, keys.rows(), width);
    rows_.prepare_append(keys.rows());
    for (Index t = 0; t < keys.rows(); ++t) write(keys.row(t), values.row(t));
  }

  /// Pointer to KV head g's key / value of token t; rows are contiguous to the end of
  /// t's page (segment_end).
  const S* key_row(Index g, Index t) const { return rows_.template row<S>(g, t); }
  const S* value_row(Index g, Index t) const {
    return rows_.template row<S>(config_.n_kv_heads + g, t);
  }
  /// The first token past the page that holds token t.
  Index segment_end(Index t) const { return (t / page_tokens() + 1) * page_tokens(); }

 private:
  friend class GqaLayer<T>;

  static detail::PagedRows checked(const GqaConfig& config, std::shared_ptr<PagePool> pool) {
    config.validate();
    if (!pool) throw config_error("PagedGqaCache: the page pool is null");
    auto layout = detail::gqa_page_layout<S>(config, pool->page_tokens());
    const std::string want =
        detail::page_layout_name<S>("GqaCache", detail::describe(config), pool->page_tokens());
    if (pool->layout() != want || pool->page_bytes() != layout.page_bytes) {
      throw config_error("PagedGqaCache: the pool holds pages of " + pool->layout() +
                         ", this cache needs " + want + " (make it with make_gqa_page_pool)");
    }
    return detail::PagedRows(std::move(pool), std::move(layout));
  }

  void grow_for(Index needed) { rows_.prepare_append(needed - tokens()); }

  template <class KeyRow, class ValueRow>
  void append_token(const KeyRow& key, const ValueRow& value) noexcept {
    write(key, value);
  }

  // Writes and counts one token; prepare_append must have run.
  template <class KeyRow, class ValueRow>
  void write(const KeyRow& key, const ValueRow& value) noexcept {
    const Index t = tokens();
    const Index dh = config_.head_dim;
    for (Index g = 0; g < config_.n_kv_heads; ++g) {
      S* k = rows_.template writable_row<S>(g, t);
      S* v = rows_.template writable_row<S>(config_.n_kv_heads + g, t);
      for (Index j = 0; j < dh; ++j) {
        k[j] = static_cast<S>(key(g * dh + j));
        v[j] = static_cast<S>(value(g * dh + j));
      }
    }
    rows_.commit(1);
  }

  GqaConfig config_;
  detail::PagedRows rows_;
};

static_assert(detail::check_kv_cache<PagedGqaCache<float>>());

}  // namespace kvattn
