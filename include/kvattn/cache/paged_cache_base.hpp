// What the three paged caches (paged_{gqa,mla,lrkv}_cache.hpp) share: the config, the
// block table, and every member of the KV-cache concept but append.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvattn/cache/page_pool.hpp"
#include "kvattn/cache/paged_rows.hpp"
#include "kvattn/cache/token_buffer.hpp"
#include "kvattn/config/rules.hpp"
#include "kvattn/core/dtype.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/index.hpp"
#include "kvattn/core/quantized.hpp"

namespace kvattn::detail {

/// The name of a page layout: the cache type, its config, its storage type and the page
/// size ("GqaCache {d_model 64, ...} bf16, 16 tokens per page"). A pool is made for one.
template <class S>
std::string page_layout_name(const std::string& cache, const std::string& config,
                             Index page_tokens) {
  return cache + " " + config + " " + storage_name<S>() + ", " + std::to_string(page_tokens) +
         " tokens per page";
}

/// The members every paged cache has. `Config` is the mechanism's config type.
template <class Config>
class PagedCacheBase {
 public:
  const Config& config() const { return config_; }
  const PagePool& pool() const { return rows_.pool(); }
  /// The tokens held: every token, or with a window (config.window > 0) the sink tokens
  /// and the last window + max_rollback tokens (see sequence_length).
  Index tokens() const { return rows_.held_tokens(); }
  /// The sequence's length, held tokens or not: the position of the next token. Equal to
  /// tokens() without a window.
  Index sequence_length() const { return rows_.length(); }
  /// The tokens past the window a windowed cache keeps for truncate (0 without a window).
  Index max_rollback() const { return max_rollback_; }
  /// Whether token t (< sequence_length()) is still in the cache's pages.
  bool holds(Index t) const { return rows_.holds(t); }
  /// Tokens of the sequence the held pages reach to.
  Index capacity() const { return rows_.capacity(); }
  Index page_tokens() const { return rows_.page_tokens(); }
  /// The pages holding the sequence, in order (pool page indices).
  const std::vector<Index>& block_table() const { return rows_.table(); }
  Index elements_per_token() const { return config_.cache_elements_per_token(); }
  /// Bytes of the held tokens (as a contiguous cache of them holds).
  std::size_t bytes() const { return rows_.bytes(); }
  /// Bytes of the pages held (a page shared with a fork counted in full by each).
  std::size_t capacity_bytes() const { return rows_.capacity_bytes(); }

  /// Pages for a sequence of `n` tokens in all; with a window, at most for the next
  /// window + max_rollback tokens (the cache never holds more). Strong exception guarantee
  /// (pool_exhausted).
  void reserve(Index n) {
    if (n < 0)
      throw shape_error(std::string(name_) + "::reserve: n (" + std::to_string(n) +
                        ") must be >= 0");
    if (config_.window > 0) {
      const Index ahead = size_sum(name_, "window + max_rollback", config_.window, max_rollback_);
      n = std::min(n, sequence_length() + std::min(ahead, PTRDIFF_MAX - sequence_length()));
    }
    rows_.reserve(n);
  }
  /// Drops every token and returns every page.
  void clear() noexcept { rows_.truncate(0); }
  /// Rolls back to the first n tokens of the sequence (speculative decoding; n counts
  /// from the sequence's start, as sequence_length), returning the pages past them to the
  /// pool. With a window, exact while the tokens the next query sees are still held: a
  /// rollback of up to max_rollback + 1 tokens after an append; shape_error beyond,
  /// with nothing changed.
  void truncate(Index n) {
    check_truncate(name_, n, sequence_length());
    if (!rows_.can_truncate(n, config_.window)) {
      throw shape_error(std::string(name_) + "::truncate(" + std::to_string(n) +
                        "): a query at position " + std::to_string(n) + " sees tokens from " +
                        std::to_string(std::max(Index{0}, n - config_.window + 1)) +
                        " on, but the window (" + std::to_string(config_.window) +
                        ") with max_rollback " + std::to_string(max_rollback_) +
                        " keeps tokens from " + std::to_string(rows_.first_kept()) +
                        " on; make the cache with a larger max_rollback");
    }
    rows_.truncate(n);
  }
  /// The first token past the page that holds token t: rows are contiguous up to it.
  Index segment_end(Index t) const { return (t / page_tokens() + 1) * page_tokens(); }

  /// Whether tokens [0, n) are held as `other` holds them: one pool, the same pages for
  /// every page wholly inside [0, n), and bitwise equal rows where [0, n) ends inside a
  /// page (a fork that appended into a shared last page holds a private copy of it). So
  /// forks of one sequence share the prefix they had when they were forked. False when
  /// n exceeds either sequence's tokens.
  /// A windowed cache shares no prefix (decode_batch reads each sequence's own window).
  bool shares_prefix(const PagedCacheBase& other, Index n) const {
    if (n < 0 || n > tokens() || n > other.tokens()) return false;
    if (n > 0 && (config_.window > 0 || other.config_.window > 0)) return false;
    if (rows_.pool_ptr() != other.rows_.pool_ptr()) return false;
    const Index page = page_tokens();
    const auto& mine = rows_.table();
    const auto& theirs = other.rows_.table();
    for (Index p = 0; p < n / page; ++p) {
      if (mine[static_cast<std::size_t>(p)] != theirs[static_cast<std::size_t>(p)]) return false;
    }
    const Index whole = n / page * page;
    if (whole == n ||
        mine[static_cast<std::size_t>(n / page)] == theirs[static_cast<std::size_t>(n / page)]) {
      return true;
    }
    const auto& blocks = rows_.layout().blocks;
    for (std::size_t b = 0; b < blocks.size(); ++b) {
      const std::size_t bytes = static_cast<std::size_t>(n - whole) *
                                static_cast<std::size_t>(blocks[b].width) * blocks[b].element_bytes;
      if (bytes == 0) continue;
      const auto* a = rows_.template row<std::byte>(static_cast<Index>(b), whole);
      const auto* c = other.rows_.template row<std::byte>(static_cast<Index>(b), whole);
      if (!std::equal(a, a + bytes, c)) return false;
    }
    return true;
  }

 protected:
  // Checks that `pool` holds pages of this cache's layout (`layout_name`, made by
  // `factory`), then takes it.
  // `max_rollback` (>= 0): the tokens past the window a windowed cache keeps.
  PagedCacheBase(const char* name, const Config& config, std::shared_ptr<PagePool> pool,
                 PageLayout layout, const std::string& layout_name, const char* factory,
                 Index max_rollback)
      : config_(config),
        rows_(checked(name, std::move(pool), std::move(layout), layout_name, factory,
                      retention(name, config, max_rollback))),
        name_(name),
        max_rollback_(config.window > 0 ? max_rollback : 0) {}

  // Pages for a sequence of `needed` tokens, and private copies of shared pages written into.
  void grow_for(Index needed) { rows_.prepare_append(needed - sequence_length()); }

  Config config_;
  PagedRows rows_;

 private:
  static TokenRetention retention(const char* name, const Config& config, Index max_rollback) {
    require(max_rollback >= 0, name, "max_rollback", max_rollback, "must be >= 0");
    if (config.window == 0) return {};
    return {config.sink_tokens,
            size_sum(name, "window + max_rollback", config.window, max_rollback)};
  }

  static PagedRows checked(const char* name, std::shared_ptr<PagePool> pool, PageLayout layout,
                           const std::string& layout_name, const char* factory,
                           TokenRetention retention) {
    if (!pool) throw config_error(std::string(name) + ": the page pool is null");
    if (pool->layout() != layout_name || pool->page_bytes() != layout.page_bytes) {
      throw config_error(std::string(name) + ": the pool holds pages of " + pool->layout() +
                         ", this cache needs " + layout_name + " (make it with " + factory + ")");
    }
    return PagedRows(std::move(pool), std::move(layout), retention);
  }

  const char* name_;
  Index max_rollback_ = 0;
};

}  // namespace kvattn::detail
