// The paged KV cache of MLA: MlaCache's rows [c_kv | k_R] in pages of a shared PagePool.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "kvattn/cache/kv_cache.hpp"
#include "kvattn/cache/mla_cache.hpp"
#include "kvattn/cache/page_pool.hpp"
#include "kvattn/cache/paged_cache_base.hpp"
#include "kvattn/cache/paged_gqa_cache.hpp"
#include "kvattn/cache/paged_rows.hpp"
#include "kvattn/config/mla_config.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/quantized.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn {

template <class T>
class MlaLayer;

namespace detail {
// One block per page: the rows [c_kv | k_R], d_c + d_R wide; for a quantized S two: the
// latents' codes and scales, then the rope keys in bf16 (MlaCache's layout).
template <class S>
PageLayout mla_page_layout(const MlaConfig& c, Index page_tokens) {
  c.validate();
  using Traits = StorageTraits<S>;
  if constexpr (Traits::quantized) {
    return page_layout(page_tokens, {PageBlock{Traits::row_elements(c.kv_rank), 1, 0},
                                     PageBlock{c.rope_dim, sizeof(Eigen::bfloat16), 0}});
  } else {
    return page_layout(page_tokens, {PageBlock{c.cache_elements_per_token(), sizeof(S), 0}});
  }
}
}  // namespace detail

/// A pool of pages for MLA caches of `config` with storage type S.
template <class S>
std::shared_ptr<PagePool> make_mla_page_pool(const MlaConfig& config, Index page_tokens,
                                             Index max_pages) {
  const auto layout = detail::mla_page_layout<S>(config, page_tokens);
  return std::make_shared<PagePool>(
      detail::page_layout_name<S>("MlaCache", detail::describe(config), page_tokens), page_tokens,
      layout.page_bytes, max_pages);
}

/// MlaCache's rows in pool pages (see PagedGqaCache for the paging rules).
template <class T, class S = T>
class PagedMlaCache : public detail::PagedCacheBase<MlaConfig> {
 public:
  using compute_type = T;
  using storage_type = S;
  static constexpr bool quantized = MlaCache<T, S>::quantized;
  using element_type = typename MlaCache<T, S>::element_type;
  using rope_storage = typename MlaCache<T, S>::rope_storage;
  using rows_type = typename MlaCache<T, S>::rows_type;

  /// With a window (config.window > 0), the cache keeps the sink tokens and the last
  /// window + max_rollback tokens, returning every page past them to the pool.
  PagedMlaCache(const MlaConfig& config, std::shared_ptr<PagePool> pool, Index max_rollback = 0)
      : detail::PagedCacheBase<MlaConfig>(
            "PagedMlaCache", config, pool,
            detail::mla_page_layout<S>(config, pool ? pool->page_tokens() : 1),
            detail::page_layout_name<S>("MlaCache", detail::describe(config),
                                        pool ? pool->page_tokens() : 1),
            "make_mla_page_pool", max_rollback) {}

  void append(const rows_type& rows) { append(rows.latent, rows.rope_keys); }

  /// Appends n tokens: latents (n x d_c) and rotated rope keys (n x d_R). Strong guarantee.
  void append(const ConstMatrixRef<T>& latent, const ConstMatrixRef<T>& rope_keys) {
    detail::check_shape("PagedMlaCache::append", "latent", latent, -1, config_.kv_rank);
    detail::check_shape("PagedMlaCache::append", "rope_keys", rope_keys, latent.rows(),
                        config_.rope_dim);
    if constexpr (quantized) {
      detail::require_finite("PagedMlaCache::append", "latent", latent);
      detail::require_finite("PagedMlaCache::append", "rope_keys", rope_keys);
    }
    rows_.prepare_append(latent.rows());
    for (Index t = 0; t < latent.rows(); ++t) append_token(latent.row(t), rope_keys.row(t));
  }

  /// Pointer to cached row t, [c_t | k_R,t]; rows are contiguous to segment_end(t).
  const S* row_data(Index t) const requires(!quantized) { return rows_.template row<S>(0, t); }
  /// Token t's latent and rope key, laid out as in MlaCache (latent_row, rope_row); rows
  /// are contiguous, latent_stride() / rope_stride() elements apart, to segment_end(t).
  const element_type* latent_row(Index t) const { return rows_.template row<element_type>(0, t); }
  Index latent_stride() const {
    return quantized ? detail::StorageTraits<S>::row_elements(config_.kv_rank)
                     : config_.cache_elements_per_token();
  }
  const rope_storage* rope_row(Index t) const {
    if constexpr (quantized) {
      return rows_.template row<rope_storage>(1, t);
    } else {
      return rows_.template row<S>(0, t) + config_.kv_rank;
    }
  }
  Index rope_stride() const {
    return quantized ? config_.rope_dim : config_.cache_elements_per_token();
  }

 private:
  friend class MlaLayer<T>;
  friend struct detail::BatchGrowth;
  using detail::PagedCacheBase<MlaConfig>::grow_for;

  // Writes and counts one token; prepare_append must have run.
  template <class LatentRow, class RopeRow>
  void append_token(const LatentRow& latent, const RopeRow& rope_key) noexcept {
    const Index t = sequence_length();
    auto* dst = rows_.template writable_row<element_type>(0, t);
    rope_storage* rope_dst;
    if constexpr (quantized) {
      detail::StorageTraits<S>::encode([&](Index j) { return latent(j); }, config_.kv_rank, dst);
      rope_dst = rows_.template writable_row<rope_storage>(1, t);
    } else {
      for (Index j = 0; j < config_.kv_rank; ++j) dst[j] = static_cast<S>(latent(j));
      rope_dst = dst + config_.kv_rank;
    }
    for (Index j = 0; j < config_.rope_dim; ++j) {
      rope_dst[j] = static_cast<rope_storage>(rope_key(j));
    }
    rows_.commit(1);
  }
};

static_assert(detail::check_kv_cache<PagedMlaCache<float>>());
static_assert(detail::check_kv_cache<PagedMlaCache<float, BlockQuantized<Dtype::int8, 128>>>());

}  // namespace kvattn
