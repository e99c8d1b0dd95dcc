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

/// Which tokens a windowed sequence keeps: the first `sink_tokens`, and the last `keep`
/// (its window plus the tokens a rollback may need); keep 0 keeps every token.
struct TokenRetention {
  Index sink_tokens = 0;
  Index keep = 0;
};

/// One sequence's pages. Copying shares every page (copy-on-write: the copy and the
/// original each copy a shared page before writing into it); destruction and truncate
/// return pages to the pool.
///
/// With a retention (keep > 0), the sequence holds tokens [0, sink_tokens) and
/// [first_kept, length) only, first_kept = max(sink_tokens, length - keep) as the
/// sequence grows: each page wholly between the two is returned to the pool as soon as the
/// sequence passes it, so the pages held stay O(sink_tokens + keep) however long the
/// sequence runs. The block table lists the held pages: the sink tokens' pages, then the
/// window's, `dropped` pages after the sink pages having been returned.
class PagedRows {
 public:
  PagedRows(std::shared_ptr<PagePool> pool, PageLayout layout, TokenRetention retention = {})
      : pool_(std::move(pool)),
        layout_(std::move(layout)),
        retention_(retention),
        sink_pages_(retention.keep > 0
                        ? (retention.sink_tokens + layout_.page_tokens - 1) / layout_.page_tokens
                        : 0) {}

  PagedRows(const PagedRows& other)
      : pool_(other.pool_),
        layout_(other.layout_),
        retention_(other.retention_),
        sink_pages_(other.sink_pages_),
        dropped_(other.dropped_),
        first_kept_(other.first_kept_),
        tokens_(other.tokens_) {
    table_ = other.table_;  // may throw: nothing retained yet
    for (const Index page : table_) pool_->retain(page);
  }
  PagedRows& operator=(PagedRows other) noexcept {
    swap(other);
    return *this;
  }
  PagedRows(PagedRows&& other) noexcept { swap(other); }
  ~PagedRows() {
    unstage();
    release_from(0);
  }

  void swap(PagedRows& other) noexcept {
    std::swap(pool_, other.pool_);
    std::swap(layout_, other.layout_);
    table_.swap(other.table_);
    std::swap(retention_, other.retention_);
    std::swap(sink_pages_, other.sink_pages_);
    std::swap(dropped_, other.dropped_);
    std::swap(first_kept_, other.first_kept_);
    std::swap(tokens_, other.tokens_);
    std::swap(staged_, other.staged_);
  }

  const PagePool& pool() const { return *pool_; }
  const std::shared_ptr<PagePool>& pool_ptr() const { return pool_; }
  const PageLayout& layout() const { return layout_; }
  Index page_tokens() const { return layout_.page_tokens; }
  /// The sequence's length: every token appended, held or not.
  Index length() const { return tokens_; }
  /// The tokens held: all of them, or the sink tokens and the last `keep` (retention).
  Index held_tokens() const {
    const Index sinks = std::min(retention_.sink_tokens, tokens_);
    return retention_.keep > 0 ? sinks + tokens_ - std::max(sinks, first_kept_) : tokens_;
  }
  /// The first token past the sink tokens that is held (0 while nothing was dropped).
  Index first_kept() const { return first_kept_; }
  const TokenRetention& retention() const { return retention_; }
  /// Whether token t (< length()) is held (its page is).
  bool holds(Index t) const {
    const Index page = t / layout_.page_tokens;
    return t >= 0 && t < tokens_ && (page < sink_pages_ || page >= sink_pages_ + dropped_);
  }
  Index pages() const { return static_cast<Index>(table_.size()); }
  /// Tokens of the sequence the held pages reach to (the pages returned counted too).
  Index capacity() const { return (pages() + dropped_) * layout_.page_tokens; }
  const std::vector<Index>& table() const { return table_; }

  /// Bytes of the held tokens' rows (what a contiguous cache of them would hold).
  std::size_t bytes() const {
    std::size_t per_token = 0;
    for (const auto& b : layout_.blocks)
      per_token += static_cast<std::size_t>(b.width) * b.element_bytes;
    return per_token * static_cast<std::size_t>(held_tokens());
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
    const Index needed =
        n / layout_.page_tokens + (n % layout_.page_tokens != 0 ? 1 : 0) - dropped_;
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
    for (Index slot = slot_of(first_page); slot <= slot_of(last_page) && slot < pages(); ++slot) {
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

  /// The first of two phases of appending one token, for a batch of sequences that must
  /// all get their pages before any of them changes (decode_batch: stage_token on each in
  /// turn, unstage on those staged when one fails, else apply_staged on each). Acquires
  /// the page the token needs, if any: a new page past the table's end (with room in the
  /// table), or a private copy of the shared page the token is written into; and sets it
  /// aside, the table and the pages held unchanged. All or nothing (std::bad_alloc,
  /// pool_exhausted). Nothing else may change the rows until apply_staged or unstage.
  /// (prepare_append(1) at once would let a shared page go: after a later sequence's
  /// failure the page could not be taken back, as another thread may have freed it since.)
  /// Forks in one batch that share a page no other sequence holds each stage a copy of it
  /// (prepare_append one after the other would copy it for all but the last): the last
  /// one's release frees the shared page, so as many pages are held after the step, but
  /// the step needs one more free page while it runs.
  void stage_token() {
    const Index slot = slot_of(tokens_ / layout_.page_tokens);
    if (slot < pages()) {
      if (pool_->use_count(table_[static_cast<std::size_t>(slot)]) <= 1) return;  // its own
    } else {
      table_.reserve(table_.size() + 1);  // may throw: before the page
    }
    staged_ = pool_->acquire();
  }

  /// Takes the page stage_token set aside into the table (never throws): a new page at
  /// the table's end, or the copy in place of the shared page.
  void apply_staged() noexcept {
    if (staged_ < 0) return;
    const Index page = std::exchange(staged_, Index{-1});
    const auto slot = static_cast<std::size_t>(slot_of(tokens_ / layout_.page_tokens));
    if (slot == table_.size()) {
      table_.push_back(page);  // room reserved by stage_token
      return;
    }
    Index& entry = table_[slot];
    std::copy_n(pool_->data(entry), pool_->page_bytes(), pool_->data(page));
    pool_->release(entry);
    entry = page;
  }

  /// Returns the page stage_token set aside to the pool (never throws).
  void unstage() noexcept {
    if (staged_ >= 0) pool_->release(std::exchange(staged_, Index{-1}));
  }

  /// Writable row t of block b; prepare_append must have made its page private.
  template <class S>
  S* writable_row(Index block, Index t) {
    return reinterpret_cast<S*>(const_cast<std::byte*>(address(block, t)));
  }

  /// Counts n written tokens, then returns the pages the retention no longer holds.
  void commit(Index n) noexcept {
    tokens_ += n;
    if (retention_.keep == 0) return;
    first_kept_ = std::max({first_kept_, retention_.sink_tokens, tokens_ - retention_.keep});
    // Pages [sink_pages_ + dropped_, first_kept_ / page_tokens) hold no kept token.
    const Index droppable = first_kept_ / layout_.page_tokens - sink_pages_ - dropped_;
    if (droppable <= 0) return;
    const auto first = table_.begin() + static_cast<std::ptrdiff_t>(sink_pages_);
    for (auto it = first; it != first + static_cast<std::ptrdiff_t>(droppable); ++it)
      pool_->release(*it);
    table_.erase(first, first + static_cast<std::ptrdiff_t>(droppable));  // no allocation
    dropped_ += droppable;
  }

  /// Whether truncate(n) keeps every token a query at position n sees (its sink tokens
  /// and its window of `window` tokens): always without a retention.
  bool can_truncate(Index n, Index window) const {
    if (retention_.keep == 0 || n <= retention_.sink_tokens) return true;
    return std::max(Index{0}, n - window + 1) >= first_kept_ ||
           first_kept_ <= retention_.sink_tokens;
  }

  /// Rolls back to n tokens, returning the pages past them to the pool.
  void truncate(Index n) noexcept {
    tokens_ = n;
    release_from(slot_of((n + layout_.page_tokens - 1) / layout_.page_tokens));
    if (pages() <= sink_pages_) dropped_ = 0;  // no window page left
    first_kept_ = std::min(first_kept_, n);
  }

 private:
  // The block table slot of the sequence's page number `page` (held or past the end).
  Index slot_of(Index page) const { return page < sink_pages_ ? page : page - dropped_; }

  const std::byte* address(Index block, Index t) const {
    const Index page = table_[static_cast<std::size_t>(slot_of(t / layout_.page_tokens))];
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
  TokenRetention retention_;
  Index sink_pages_ = 0;  // pages holding sink tokens (kept forever; 0 without retention)
  Index dropped_ = 0;     // pages after the sink pages returned to the pool
  Index first_kept_ = 0;  // see held_tokens()
  Index tokens_ = 0;
  Index staged_ = -1;  // the page stage_token set aside (-1: none); not copied
};

}  // namespace kvattn::detail
