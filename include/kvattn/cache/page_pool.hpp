// A pool of fixed-size pages that paged caches carve their tokens from (vLLM's
// PagedAttention): memory is reserved once for the pool, not per sequence, and a page
// can be shared by several sequences (a common prompt prefix) with reference counts.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvattn/cache/aligned_buffer.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/index.hpp"

namespace kvattn {

/// A page pool has no free page left: the call that needed one changed nothing.
class pool_exhausted : public std::runtime_error, public error {
 public:
  using std::runtime_error::runtime_error;
  const char* what() const noexcept override { return std::runtime_error::what(); }
};

/// `max_pages` pages of `page_bytes` bytes, each holding `page_tokens` tokens of one
/// cache layout (named by `layout`, e.g. "GqaCache {d_model 4096, ...} bf16"; a paged
/// cache refuses a pool of another layout). The memory is allocated once, 64-byte
/// aligned (huge-page advised when large), when the pool is made; pages are packed
/// (page p starts p * page_bytes in), so with a page_bytes that is a multiple of 64, as
/// for power-of-two head widths, every page starts on a cache line.
///
/// Thread safety: every member may be called from several threads at once. Handing out
/// and returning pages takes a lock; reference counts are atomic. Several threads may
/// decode different sequences that share pages of one pool at once; one sequence
/// (one paged cache) is used by one thread at a time, as any cache.
class PagePool {
 public:
  PagePool(std::string layout, Index page_tokens, std::size_t page_bytes, Index max_pages)
      : layout_(std::move(layout)),
        page_tokens_(page_tokens),
        page_bytes_(checked_page_bytes(page_bytes)),
        max_pages_(max_pages),
        memory_(checked_total(page_bytes_, page_tokens, max_pages)),
        use_counts_(static_cast<std::size_t>(max_pages)) {
    free_.reserve(static_cast<std::size_t>(max_pages));
    for (Index p = max_pages - 1; p >= 0; --p) free_.push_back(p);
  }

  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  const std::string& layout() const noexcept { return layout_; }
  Index page_tokens() const noexcept { return page_tokens_; }
  std::size_t page_bytes() const noexcept { return page_bytes_; }
  Index max_pages() const noexcept { return max_pages_; }

  /// Pages handed out (held by at least one cache).
  Index pages_in_use() const {
    std::lock_guard lock(mutex_);
    return max_pages_ - static_cast<Index>(free_.size());
  }
  Index pages_free() const {
    std::lock_guard lock(mutex_);
    return static_cast<Index>(free_.size());
  }
  /// pages_in_use() * page_bytes(): the pool's memory that holds tokens now.
  std::size_t bytes_in_use() const {
    return static_cast<std::size_t>(pages_in_use()) * page_bytes_;
  }
  /// How many caches hold page p (0: free).
  long use_count(Index page) const noexcept {
    return use_counts_[static_cast<std::size_t>(page)].load(std::memory_order_acquire);
  }

  /// A free page, held once. Throws pool_exhausted (nothing changed) when none is left.
  Index acquire() {
    std::lock_guard lock(mutex_);
    if (free_.empty()) {
      throw pool_exhausted("PagePool (" + layout_ + "): all " + std::to_string(max_pages_) +
                           " pages of " + std::to_string(page_tokens_) +
                           " tokens are in use; free a sequence or make a larger pool");
    }
    const Index page = free_.back();
    free_.pop_back();
    use_counts_[static_cast<std::size_t>(page)].store(1, std::memory_order_release);
    return page;
  }

  /// One more holder of page p (a forked sequence).
  void retain(Index page) noexcept {
    use_counts_[static_cast<std::size_t>(page)].fetch_add(1, std::memory_order_relaxed);
  }

  /// One holder fewer; the last one returns the page to the pool. Never throws: the
  /// free list has room for every page from the start.
  void release(Index page) noexcept {
    if (use_counts_[static_cast<std::size_t>(page)].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard lock(mutex_);
      free_.push_back(page);
    }
  }

  std::byte* data(Index page) noexcept {
    return memory_.data() + static_cast<std::size_t>(page) * page_bytes_;
  }
  const std::byte* data(Index page) const noexcept {
    return memory_.data() + static_cast<std::size_t>(page) * page_bytes_;
  }

 private:
  static std::size_t checked_page_bytes(std::size_t bytes) {
    // Pages are packed, not padded: the pool's bytes in use are exactly the tokens'
    // bytes of the pages handed out, as the analysis module's page rounding counts them.
    if (bytes == 0) throw config_error("PagePool: page_bytes (0) must be > 0");
    return bytes;
  }
  static std::size_t checked_total(std::size_t page_bytes, Index page_tokens, Index max_pages) {
    detail::require(page_tokens >= 1, "PagePool", "page_tokens", page_tokens, "must be >= 1");
    detail::require(max_pages >= 1, "PagePool", "max_pages", max_pages, "must be >= 1");
    if (page_bytes > 0 && static_cast<std::size_t>(max_pages) > SIZE_MAX / 2 / page_bytes) {
      throw config_error("PagePool: max_pages (" + std::to_string(max_pages) + ") x " +
                         std::to_string(page_bytes) + " bytes per page does not fit in memory");
    }
    return static_cast<std::size_t>(max_pages) * page_bytes;
  }

  std::string layout_;
  Index page_tokens_;
  std::size_t page_bytes_;
  Index max_pages_;
  AlignedBuffer<std::byte> memory_;
  std::vector<std::atomic<long>> use_counts_;
  mutable std::mutex mutex_;
  std::vector<Index> free_;
};

}  // namespace kvattn
