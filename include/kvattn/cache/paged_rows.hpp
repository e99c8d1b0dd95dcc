// The block table of one paged sequence: which pool pages hold its tokens, in order,
// and the copy-on-write rules. Paged caches (paged_*_cache.hpp) keep their rows here.
//
// A page holds page_tokens tokens of every block of a layout, block by block: block b
// (say KV head g's keys) is page_tokens rows of width_b elements of element_bytes_b,
// contiguous, starting at offset_b (packed after the blocks before it). So within a page each block
// is one dense matrix, which the decode kernels read as they read a contiguous cache; a tile never
// crosses a page.
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kvattn/cache/page_pool.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/index.hpp"

namespace kvattn::detail {

/// Rows of `width` elements of `element_bytes` bytes each.
struct PageBlock {
  Index width = 0;
  std::size_t element_bytes = 0;
  std::size_t offset = 0;  // from the page's start (packed); set by page_layout()
};

/// The blocks of a layout with their offsets, and the bytes of one page.
struct PageLayout {
  Index page_tokens = 0;
  std::vector<PageBlock> blocks;
  std::size_t page_bytes = 0;
};

inline PageLayout page_layout(Index page_tokens, std::vector<PageBlock> blocks) {
  require(page_tokens >= 1, "page layout", "page_tokens", page_tokens, "must be >= 1");
  PageLayout layout{page_tokens, std::move(blocks), 0};
  std::size_t offset = 0;
  for (auto& block : layout.blocks) {
    block.offset = offset;
    const std::size_t bytes = static_cast<std::size_t>(page_tokens) *
                              static_cast<std::size_t>(block.width) * block.element_bytes;
    offset += bytes;  // packed: page_bytes is exactly page_tokens x bytes per token
  }
  layout.page_bytes = offset;
  return layout;
}

/// One sequence's pages. Copying shares every page (copy-on-write: the copy and the
/// original each copy a shared page before writing into it); destruction and truncate
/// return pages to the pool.
class PagedRows {
 public:
  PagedRows(std::shared_ptr<PagePool> pool, PageLayout layout)
      : pool_(std::move(pool)), layout_(std::move(layout)) {}

  PagedRows(const PagedRows& other)
      : pool_(other.pool_), layout_(other.layout_), tokens_(other.tokens_) {
    table_ = other.table_;  // may throw: nothing retained yet
    for (const Index page : table_) pool_->retain(page);
  }
  PagedRows& operator=(PagedRows other) noexcept {
    swap(other);
    return *this;
  }
  PagedRows(PagedRows&& other) noexcept { swap(other); }
  ~PagedRows() { release_from(0); }

  void swap(PagedRows& other) noexcept {
    std::swap(pool_, other.pool_);
    std::swap(layout_, other.layout_);
    table_.swap(other.table_);
    std::swap(tokens_, other.tokens_);
  }

  const PagePool& pool() const { return *pool_; }
  const std::shared_ptr<PagePool>& pool_ptr() const { return pool_; }
  const PageLayout& layout() const { return layout_; }
  Index page_tokens() const { return layout_.page_tokens; }
  Index tokens() const { return tokens_; }
  Index pages() const { return static_cast<Index>(table_.size()); }
  Index capacity() const { return pages() * layout_.page_tokens; }
  const std::vector<Index>& table() const { return table_; }

  /// Bytes of the cached tokens' rows (what a contiguous cache of them would hold).
  std::size_t bytes() const {
    std::size_t per_token = 0;
    for (const auto& b : layout_.blocks)
      per_token += static_cast<std::size_t>(b.width) * b.element_bytes;
    return per_token * static_cast<std::size_t>(tokens_);
  }
  /// Bytes of the pages this sequence holds (shared pages counted in full).
  std::size_t capacity_bytes() const {
    return static_cast<std::size_t>(pages()) * pool_->page_bytes();
  }

  /// Row t (< capacity) of block b. Rows of one block are contiguous up to the end of
  /// the page that holds t.
  template <class S>
  const S* row(Index block, Index t) const {
    return reinterpret_cast<const S*>(address(block, t));
  }

  /// Room for `n` (>= 0) tokens in all: acquires the missing pages (all of them, or
  /// none: pool_exhausted leaves the table as it was, also when n needs more pages
  /// than the whole pool holds).
  void reserve(Index n) {
    // Pages for n tokens, rounded up without forming n + page_tokens - 1 (n may be
    // near the Index maximum).
    const Index needed = n / layout_.page_tokens + (n % layout_.page_tokens != 0 ? 1 : 0);
    if (needed <= pages()) return;
    if (needed > pool_->max_pages()) {
      throw pool_exhausted("PagePool (" + pool_->layout() + "): " + std::to_string(n) +
                           " tokens need " + std::to_string(needed) + " pages of " +
                           std::to_string(layout_.page_tokens) + " tokens, the pool holds " +
                           std::to_string(pool_->max_pages()) + " in all; make a larger pool");
    }
    std::vector<Index> fresh;
    fresh.reserve(static_cast<std::size_t>(needed - pages()));
    table_.reserve(static_cast<std::size_t>(needed));  // may throw: before any page
    try {
      while (pages() + static_cast<Index>(fresh.size()) < needed) fresh.push_back(pool_->acquire());
    } catch (...) {
      for (const Index page : fresh) pool_->release(page);
      throw;
    }
    table_.insert(table_.end(), fresh.begin(), fresh.end());  // capacity reserved: no throw
  }

  /// Prepares writing tokens tokens() ... tokens() + n - 1: pages for them, and a private
  /// copy of a shared page they would write into (copy-on-write). All or nothing.
  void prepare_append(Index n) {
    if (n <= 0) return;
    const Index first_page = tokens_ / layout_.page_tokens;
    const Index last_page = (tokens_ + n - 1) / layout_.page_tokens;
    // Shared pages among those written must be copied first. Pages past the table's
    // end do not exist yet; reserve makes them private.
    std::vector<std::pair<Index, Index>> copies;  // (table slot, new page)
    for (Index slot = first_page; slot <= last_page && slot < pages(); ++slot) {
      if (pool_->use_count(table_[static_cast<std::size_t>(slot)]) > 1)
        copies.emplace_back(slot, -1);
    }
    try {
      for (auto& copy : copies) copy.second = pool_->acquire();
      reserve(tokens_ + n);
    } catch (...) {
      for (const auto& copy : copies) {
        if (copy.second >= 0) pool_->release(copy.second);
      }
      throw;
    }
    for (const auto& [slot, page] : copies) {  // nothing below throws
      Index& entry = table_[static_cast<std::size_t>(slot)];
      std::copy_n(pool_->data(entry), pool_->page_bytes(), pool_->data(page));
      pool_->release(entry);
      entry = page;
    }
  }

  /// Writable row t of block b; prepare_append must have made its page private.
  template <class S>
  S* writable_row(Index block, Index t) {
    return reinterpret_cast<S*>(const_cast<std::byte*>(address(block, t)));
  }

  void commit(Index n) noexcept { tokens_ += n; }

  /// Rolls back to n tokens, returning the pages past them to the pool.
  void truncate(Index n) noexcept {
    tokens_ = n;
    release_from((n + layout_.page_tokens - 1) / layout_.page_tokens);
  }

 private:
  const std::byte* address(Index block, Index t) const {
    const Index page = table_[static_cast<std::size_t>(t / layout_.page_tokens)];
    const PageBlock& b = layout_.blocks[static_cast<std::size_t>(block)];
    return pool_->data(page) + b.offset +
           static_cast<std::size_t>(t % layout_.page_tokens) * static_cast<std::size_t>(b.width) *
               b.element_bytes;
  }

  void release_from(Index slot) noexcept {
    if (!pool_) return;
    for (Index s = slot; s < pages(); ++s) pool_->release(table_[static_cast<std::size_t>(s)]);
    table_.resize(static_cast<std::size_t>(std::min(slot, pages())));
  }

  std::shared_ptr<PagePool> pool_;
  PageLayout layout_;
  std::vector<Index> table_;
  Index tokens_ = 0;
};

}  // namespace kvattn::detail
