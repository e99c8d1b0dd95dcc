// The KV cache of multi-head latent attention: per token the latent c_kv and the
// shared rope key k_R, nothing per head.
#pragma once

#include <cstddef>
#include <string>
#include <type_traits>

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
/// T is the compute type of the layer that fills it; S (default T) the storage type: a
/// scalar, or a block-quantized format (Int8<B>, Fp8E4M3<B>). A quantized cache stores
/// DeepSeek's fp8 layout: per token the latent's d_c codes followed by its ceil(d_c / B)
/// fp32 block scales (one row of the latent buffer), and the rope key in bf16 in a
/// buffer of its own (rope_storage); Fp8E4M3<128> at d_c = 512, d_R = 64 is 512 + 16 +
/// 128 = 656 bytes per token. Its rows() / latent() / rope_keys() return dequantized
/// copies; the kernels read latent_row(t) and rope_row(t).
/// A cache holds tokens only (no kernel scratch): several threads may read one const
/// cache at once; a thread that appends must be the only one using it. Copying forks it.
template <class T, class S = T>
class MlaCache {
 public:
  using compute_type = T;
  using storage_type = S;
  static constexpr bool quantized = detail::is_quantized_storage<S>;
  /// What a latent row is stored as: S itself, or the one-byte codes of a quantized S.
  using element_type = detail::storage_element_t<S>;
  /// What the rope keys are stored as: S, or bf16 beside a quantized latent.
  using rope_storage = std::conditional_t<quantized, Eigen::bfloat16, S>;
  using Rows = typename detail::TokenBuffer<S>::ConstBlock;

  /// Already-projected rows for append: latents n x d_c and rope keys n x d_R
  /// (rotated already, each at its own position).
  struct rows_type {
    ConstMatrixRef<T> latent;
    ConstMatrixRef<T> rope_keys;
  };

  explicit MlaCache(const MlaConfig& config, Index reserve_tokens = 0)
      : config_(validated(config)),
        rows_(1, quantized ? config.kv_rank : config.cache_elements_per_token()),
        rope_(1, quantized ? config.rope_dim : 0) {
    if (reserve_tokens != 0) reserve(reserve_tokens);  // shape_error when negative
  }

  const MlaConfig& config() const { return config_; }
  Index tokens() const { return rows_.tokens(); }
  /// The sequence's length: tokens() (a contiguous cache holds every token, also with a
  /// window; PagedCache drops what the window no longer sees).
  Index sequence_length() const { return rows_.tokens(); }
  Index capacity() const { return rows_.capacity(); }
  /// d_c + d_R, from the storage layout.
  Index elements_per_token() const {
    return rows_.elements_per_token() + rope_.elements_per_token();
  }
  /// Bytes of the cached tokens (block scales included).
  std::size_t bytes() const { return rows_.bytes() + rope_.bytes(); }
  std::size_t capacity_bytes() const { return rows_.capacity_bytes() + rope_.capacity_bytes(); }

  /// Makes room for `n` tokens in total; never shrinks. Strong exception guarantee.
  void reserve(Index n) {
    if (n < 0) throw shape_error("MlaCache::reserve: n (" + std::to_string(n) + ") must be >= 0");
    if (n <= capacity()) return;
    auto grown = rows_.grown(n);
    auto rope = rope_.grown(n);
    rows_.swap(grown);
    rope_.swap(rope);
  }

  void clear() noexcept { set_tokens(0); }

  /// Rolls back to the first n tokens (speculative decoding). Keeps capacity.
  void truncate(Index n) {
    detail::check_truncate("MlaCache", n, tokens());
    set_tokens(n);
  }

  void append(const rows_type& rows) { append(rows.latent, rows.rope_keys); }

  /// Appends n tokens: latents (n x d_c) and rotated rope keys (n x d_R). Strong
  /// exception guarantee. A quantized cache takes finite values only (value_error
  /// otherwise, nothing appended).
  void append(const ConstMatrixRef<T>& latent, const ConstMatrixRef<T>& rope_keys) {
    detail::check_shape("MlaCache::append", "latent", latent, -1, config_.kv_rank);
    detail::check_shape("MlaCache::append", "rope_keys", rope_keys, latent.rows(),
                        config_.rope_dim);
    if constexpr (quantized) {
      detail::require_finite("MlaCache::append", "latent", latent);
      detail::require_finite("MlaCache::append", "rope_keys", rope_keys);
    }
    grow_for(tokens() + latent.rows());
    for (Index t = 0; t < latent.rows(); ++t) write_row(t, latent.row(t), rope_keys.row(t));
    commit(latent.rows());
  }

  /// The cached rows [c_kv | k_R], tokens() x (d_c + d_R), one dense matrix (for a
  /// quantized S a dequantized copy, RowMatrix<T>).
  auto rows() const {
    if constexpr (quantized) {
      RowMatrix<T> out(tokens(), config_.cache_elements_per_token());
      out.leftCols(config_.kv_rank) = rows_.template dequantized<T>(0);
      out.rightCols(config_.rope_dim) = rope_.template dequantized<T>(0);
      return out;
    } else {
      return rows(0, tokens());
    }
  }
  /// Cached rows first ... first + count - 1 (a tile of the matrix above); shape_error
  /// unless they are cached (0 <= first, 0 <= count, first + count <= tokens()).
  Rows rows(Index first, Index count) const requires(!quantized) {
    if (first < 0 || count < 0 || count > tokens() - first) {
      throw shape_error("MlaCache::rows: rows [" + std::to_string(first) + ", " +
                        std::to_string(first) + " + " + std::to_string(count) +
                        ") must lie in the " + std::to_string(tokens()) + " cached rows");
    }
    return Rows(rows_.row(0, first), count, config_.cache_elements_per_token(),
                Eigen::OuterStride<>(config_.cache_elements_per_token()));
  }
  /// Pointer to cached row t, [c_t | k_R,t] (rows are contiguous, d_c + d_R apart).
  const S* row_data(Index t) const requires(!quantized) { return rows_.row(0, t); }
  /// Pointer to token t's latent: row_data(t), or for a quantized S the d_c codes followed
  /// by the row's ceil(d_c / B) fp32 scales. Rows are latent_stride() elements apart.
  const element_type* latent_row(Index t) const { return rows_.row(0, t); }
  Index latent_stride() const { return rows_.row_stride(); }
  /// Pointer to token t's rope key (d_R elements); rows are rope_stride() elements apart.
  const rope_storage* rope_row(Index t) const {
    if constexpr (quantized) {
      return rope_.row(0, t);
    } else {
      return rows_.row(0, t) + config_.kv_rank;
    }
  }
  Index rope_stride() const { return quantized ? config_.rope_dim : rows_.row_stride(); }
  /// The latents C, tokens() x d_c (a column block of rows(); dequantized for a quantized S).
  auto latent() const {
    if constexpr (quantized) {
      return rows_.template dequantized<T>(0);
    } else {
      return rows().leftCols(config_.kv_rank);
    }
  }
  /// The rotated rope keys K_R, tokens() x d_R (a column block of rows(); widened from
  /// bf16 for a quantized S).
  auto rope_keys() const {
    if constexpr (quantized) {
      return rope_.template dequantized<T>(0);
    } else {
      return rows().rightCols(config_.rope_dim);
    }
  }

 private:
  friend class MlaLayer<T>;
  friend struct detail::BatchGrowth;

  // Grows geometrically to hold `needed` tokens. Strong exception guarantee.
  void grow_for(Index needed) {
    if (needed > capacity()) reserve(detail::grown_capacity(capacity(), needed));
  }

  // Writes and counts one token's latent and rope key; requires capacity; never throws.
  template <class LatentRow, class RopeRow>
  void append_token(const LatentRow& latent, const RopeRow& rope_key) noexcept {
    write_row(0, latent, rope_key);
    commit(1);
  }

  void commit(Index n) noexcept {
    rows_.commit(n);
    rope_.commit(n);
  }
  void set_tokens(Index n) noexcept {
    rows_.set_tokens(n);
    rope_.set_tokens(n);
  }

  static const MlaConfig& validated(const MlaConfig& config) {
    config.validate();
    return config;
  }

  // Writes row tokens() + offset; requires capacity. A quantized S takes finite values
  // (checked before).
  template <class LatentRow, class RopeRow>
  void write_row(Index offset, const LatentRow& latent, const RopeRow& rope_key) noexcept {
    const Index t = tokens() + offset;
    element_type* dst = rows_.row(0, t);
    rope_storage* rope_dst;
    if constexpr (quantized) {
      detail::StorageTraits<S>::encode([&](Index j) { return latent(j); }, config_.kv_rank, dst);
      rope_dst = rope_.row(0, t);
    } else {
      for (Index j = 0; j < config_.kv_rank; ++j) dst[j] = static_cast<S>(latent(j));
      rope_dst = dst + config_.kv_rank;
    }
    for (Index j = 0; j < config_.rope_dim; ++j) {
      rope_dst[j] = static_cast<rope_storage>(rope_key(j));
    }
  }

  MlaConfig config_;
  detail::TokenBuffer<S> rows_;             // [c_kv | k_R], d_c + d_R wide; quantized: c_kv only
  detail::TokenBuffer<rope_storage> rope_;  // quantized: k_R, d_R wide; else 0 wide
};

static_assert(detail::check_kv_cache<MlaCache<float>>());
static_assert(detail::check_kv_cache<MlaCache<double, float>>());
static_assert(detail::check_kv_cache<MlaCache<float, BlockQuantized<Dtype::fp8_e4m3, 128>>>());

}  // namespace kvattn
