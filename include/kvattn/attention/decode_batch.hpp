// What every layer's decode_batch shares: its options and the checks of its caches.
//
//   layer.decode_batch(x, caches, out, workspace, threads = {}, options = {})
//
// x is B x d, one new token for each of B sequences; caches a std::span<Cache* const>
// of B distinct caches of one cache type (contiguous or paged) and any lengths; out
// B x d. Equal to B single decodes (each row's attention is computed over its own
// cache exactly as decode computes it, up to the order in which split ranges merge).
// The projections run as B x d matrix products, so the weights are read once for the
// batch, and the attention is cut into (sequence x KV group x token range) units spread
// over the threads.
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "kvattn/core/errors.hpp"
#include "kvattn/core/index.hpp"

namespace kvattn {

/// Options of decode_batch.
struct BatchOptions {
  /// Tokens [0, shared_prefix) hold the same rows in every sequence of the batch (forks
  /// of one prompt): they are read once for all B query rows (cascade attention) and
  /// merged with each sequence's own tokens. 0: no shared prefix. Paged caches only;
  /// every cache must hold the prefix in the same pool pages (checked).
  Index shared_prefix = 0;
};

namespace detail {

/// shape_error unless every cache pointer is set and no cache appears twice (a token
/// would be appended to it twice).
template <class Cache>
void check_batch_caches(const char* where, std::span<Cache* const> caches) {
  const Index count = static_cast<Index>(caches.size());
  for (Index i = 0; i < count; ++i) {
    if (caches[static_cast<std::size_t>(i)] == nullptr) {
      throw shape_error(std::string(where) + ": caches[" + std::to_string(i) + "] is null");
    }
    for (Index j = 0; j < i; ++j) {
      if (caches[static_cast<std::size_t>(j)] == caches[static_cast<std::size_t>(i)]) {
        throw shape_error(std::string(where) + ": caches[" + std::to_string(j) + "] and caches[" +
                          std::to_string(i) + "] are the same cache (one token each is appended)");
      }
    }
  }
}

/// Room for one more token in every cache of a decode_batch, all or none: a contiguous
/// cache grows its buffers (and keeps the capacity when a later cache fails); a paged
/// cache takes its page only once every cache has one (detail::PagedRows::stage_token),
/// so a failure gives every page back and leaves each block table as it was.
struct BatchGrowth {
  template <class Cache>
  static void grow(std::span<Cache* const> caches) {
    if constexpr (requires(Cache & cache) { cache.page_tokens(); }) {
      std::size_t staged = 0;
      try {
        for (; staged < caches.size(); ++staged) caches[staged]->rows_.stage_token();
      } catch (...) {
        for (std::size_t i = 0; i < staged; ++i) caches[i]->rows_.unstage();
        throw;
      }
      for (Cache* cache : caches) cache->rows_.apply_staged();
    } else {
      for (Cache* cache : caches) cache->grow_for(cache->sequence_length() + 1);
    }
  }
};

}  // namespace detail
}  // namespace kvattn
