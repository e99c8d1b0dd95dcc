// The KV cache of multi-head latent attention: per token the latent c_kv and the
// shared rope key k_R, nothing per head.
#pragma once

#include <cstddef>
#include <string>

#include "kvattn/cache/kv_cache.hpp"
#include "kvattn/cache/token_buffer.hpp"
#include "kvattn/config/mla_config.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/quantized.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn {

template <class T>
class MlaLayer;

/// Per token one contiguous row [c_kv | k_R] of d_c + d_R elements of storage type S:
/// the (RMS-normalized, when kv_norm) KV latent c_kv (d_c) and the rope key k_R (d_R),
/// already rotated at its own position (rope.position_offset + its index in the cache).
/// The rows form one dense `tokens x (d_c + d_R)` matrix: an absorbed decode step
/// streams it once for all heads, scoring [q~_h | q_h^R] against whole rows.
///
/// T is the compute type of the layer that fills it; S (default T) the storage type.
/// A cache holds tokens only (no kernel scratch): several threads may read one const
/// cache at once; a thread that appends must be the only one using it. Copying forks it.
template <class T, class S = T>
class MlaCache {
 public:
  static_assert(!detail::is_quantized_storage<S>,
                "kvattn::MlaCache: block-quantized storage (Int8, Fp8E4M3) is not implemented for "
                "this mechanism yet; GqaCache and PagedGqaCache take it (docs/api.md)");
  using compute_type = T;
  using storage_type = S;
  using Rows = typename detail::TokenBuffer<S>::ConstBlock;

  /// Already-projected rows for append: latents n x d_c and rope keys n x d_R
  /// (rotated already, each at its own position).
  struct rows_type {
    ConstMatrixRef<T> latent;
    ConstMatrixRef<T> rope_keys;
  };

  explicit MlaCache(const MlaConfig& config, Index reserve_tokens = 0)
      : config_(validated(config)), rows_(1, config.cache_elements_per_token()) {
    if (reserve_tokens > 0) reserve(reserve_tokens);
  }

  const MlaConfig& config() const { return config_; }
  Index tokens() const { return rows_.tokens(); }
  /// The sequence's length: tokens() (a contiguous cache holds every token, also with a
  /// window; PagedCache drops what the window no longer sees).
  Index sequence_length() const { return rows_.tokens(); }
  Index capacity() const { return rows_.capacity(); }
  /// d_c + d_R, from the storage layout.
  Index elements_per_token() const { return rows_.elements_per_token(); }
  std::size_t bytes() const { return rows_.bytes(); }
  std::size_t capacity_bytes() const { return rows_.capacity_bytes(); }

  /// Makes room for `n` tokens in total; never shrinks. Strong exception guarantee.
  void reserve(Index n) {
    if (n < 0) throw shape_error("MlaCache::reserve: n (" + std::to_string(n) + ") must be >= 0");
    if (n <= capacity()) return;
    auto grown = rows_.grown(n);
    rows_.swap(grown);
  }

  void clear() noexcept { rows_.set_tokens(0); }

  /// Rolls back to the first n tokens (speculative decoding). Keeps capacity.
  void truncate(Index n) {
    detail::check_truncate("MlaCache", n, tokens());
    rows_.set_tokens(n);
  }

  void append(const rows_type& rows) { append(rows.latent, rows.rope_keys); }

  /// Appends n tokens: latents (n x d_c) and rotated rope keys (n x d_R). Strong
  /// exception guarantee.
  void append(const ConstMatrixRef<T>& latent, const ConstMatrixRef<T>& rope_keys) {
    detail::check_shape("MlaCache::append", "latent", latent, -1, config_.kv_rank);
    detail::check_shape("MlaCache::append", "rope_keys", rope_keys, latent.rows(),
                        config_.rope_dim);
    grow_for(tokens() + latent.rows());
    for (Index t = 0; t < latent.rows(); ++t) write_row(t, latent.row(t), rope_keys.row(t));
    rows_.commit(latent.rows());
  }

  /// The cached rows [c_kv | k_R], tokens() x (d_c + d_R), one dense matrix.
  Rows rows() const { return rows(0, tokens()); }
  /// Cached rows first ... first + count - 1 (a tile of the matrix above).
  Rows rows(Index first, Index count) const {
    return Rows(rows_.row(0, first), count, config_.cache_elements_per_token(),
                Eigen::OuterStride<>(config_.cache_elements_per_token()));
  }
  /// Pointer to cached row t, [c_t | k_R,t] (rows are contiguous, d_c + d_R apart).
  const S* row_data(Index t) const { return rows_.row(0, t); }
  /// The latents C, tokens() x d_c (a column block of rows()).
  auto latent() const { return rows().leftCols(config_.kv_rank); }
  /// The rotated rope keys K_R, tokens() x d_R (a column block of rows()).
  auto rope_keys() const { return rows().rightCols(config_.rope_dim); }

 private:
  friend class MlaLayer<T>;

  // Grows geometrically to hold `needed` tokens. Strong exception guarantee.
  void grow_for(Index needed) {
    if (needed > capacity()) reserve(detail::grown_capacity(capacity(), needed));
  }

  // Writes and counts one token's latent and rope key; requires capacity; never throws.
  template <class LatentRow, class RopeRow>
  void append_token(const LatentRow& latent, const RopeRow& rope_key) noexcept {
    write_row(0, latent, rope_key);
    rows_.commit(1);
  }

  static const MlaConfig& validated(const MlaConfig& config) {
    config.validate();
    return config;
  }

  // Writes row tokens() + offset; requires capacity.
  template <class LatentRow, class RopeRow>
  void write_row(Index offset, const LatentRow& latent, const RopeRow& rope_key) noexcept {
    S* dst = rows_.row(0, tokens() + offset);
    for (Index j = 0; j < config_.kv_rank; ++j) dst[j] = static_cast<S>(latent(j));
    S* rope_dst = dst + config_.kv_rank;
    for (Index j = 0; j < config_.rope_dim; ++j) rope_dst[j] = static_cast<S>(rope_key(j));
  }

  MlaConfig config_;
  detail::TokenBuffer<S> rows_;  // one block of width d_c + d_R
};

static_assert(detail::check_kv_cache<MlaCache<float>>());
static_assert(detail::check_kv_cache<MlaCache<double, float>>());

}  // namespace kvattn
