// The KV cache of the MHA / GQA / MQA family: K and V of every KV head.
#pragma once

#include <cstddef>
#include <string>

#include "kvattn/cache/kv_cache.hpp"
#include "kvattn/cache/token_buffer.hpp"
#include "kvattn/config/gqa_config.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/quantized.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn {

template <class T>
class GqaLayer;

/// Per token: K and V (already rotated by RoPE) for each of the n_kv KV heads,
/// 2 * n_kv * d_h elements of storage type S. Each KV head's keys are one dense
/// `tokens x d_h` block, so decode streams them once per step for the whole group.
///
/// T is the compute type of the layer that fills it; S (default T) the storage type: a
/// scalar (float, double, Eigen::bfloat16, Eigen::half) or a block-quantized format
/// (Int8<B>, Fp8E4M3<B>: each KV head's key and value row quantized on append, one fp32
/// scale per B elements; see core/quantized.hpp and docs/api.md).
/// A cache holds tokens only (no kernel scratch): several threads may read one const
/// cache at once; a thread that appends must be the only one using it. Copying forks it.
template <class T, class S = T>
class GqaCache {
 public:
  using compute_type = T;
  using storage_type = S;
  /// What a row is stored as: S itself, or the one-byte codes of a quantized S.
  using element_type = detail::storage_element_t<S>;

  /// Already-projected rows for append: keys and values, n x (n_kv * d_h) each,
  /// KV head g in columns [g * d_h, (g + 1) * d_h). Keys carry RoPE already (each at
  /// its own position, position_offset + its index in the cache).
  struct rows_type {
    ConstMatrixRef<T> keys;
    ConstMatrixRef<T> values;
  };

  explicit GqaCache(const GqaConfig& config, Index reserve_tokens = 0)
      : config_(validated(config)),
        keys_(config.n_kv_heads, config.head_dim),
        values_(config.n_kv_heads, config.head_dim) {
    if (reserve_tokens != 0) reserve(reserve_tokens);  // shape_error when negative
  }

  const GqaConfig& config() const { return config_; }
  Index tokens() const { return keys_.tokens(); }
  /// The sequence's length: tokens() (a contiguous cache holds every token, also with a
  /// window; PagedCache drops what the window no longer sees).
  Index sequence_length() const { return keys_.tokens(); }
  Index capacity() const { return keys_.capacity(); }
  Index elements_per_token() const {
    return keys_.elements_per_token() + values_.elements_per_token();
  }
  std::size_t bytes() const { return keys_.bytes() + values_.bytes(); }
  std::size_t capacity_bytes() const { return keys_.capacity_bytes() + values_.capacity_bytes(); }

  /// Makes room for `n` tokens in total; never shrinks. Strong exception guarantee.
  void reserve(Index n) {
    if (n < 0) throw shape_error("GqaCache::reserve: n (" + std::to_string(n) + ") must be >= 0");
    if (n <= capacity()) return;
    auto keys = keys_.grown(n);
    auto values = values_.grown(n);
    keys_.swap(keys);
    values_.swap(values);
  }

  void clear() noexcept { truncate_unchecked(0); }

  /// Rolls back to the first n tokens (speculative decoding). Keeps capacity.
  void truncate(Index n) {
    detail::check_truncate("GqaCache", n, tokens());
    truncate_unchecked(n);
  }

  /// Appends n tokens of keys and values (rows_type). Strong exception guarantee.
  void append(const rows_type& rows) { append(rows.keys, rows.values); }

  /// Appends n tokens of keys and values (n x (n_kv * d_h) each). A quantized cache takes
  /// finite values only (value_error otherwise, nothing appended).
  void append(const ConstMatrixRef<T>& keys, const ConstMatrixRef<T>& values) {
    const Index width = config_.kv_width();
    detail::check_shape("GqaCache::append", "keys", keys, -1, width);
    detail::check_shape("GqaCache::append", "values", values, keys.rows(), width);
    if constexpr (detail::is_quantized_storage<S>) {
      detail::require_finite("GqaCache::append", "keys", keys);
      detail::require_finite("GqaCache::append", "values", values);
    }
    grow_for(tokens() + keys.rows());
    keys_.write_rows(keys);
    values_.write_rows(values);
    keys_.commit(keys.rows());
    values_.commit(keys.rows());
  }

  /// KV head g's cached keys / values, tokens() x d_h: a view of the stored rows, or for
  /// a quantized S a dequantized copy (RowMatrix<T>). shape_error unless 0 <= g < n_kv.
  auto keys(Index g) const {
    detail::check_index("GqaCache::keys", "KV head g", g, config_.n_kv_heads);
    if constexpr (detail::is_quantized_storage<S>) {
      return keys_.template dequantized<T>(g);
    } else {
      return keys_.block(g);
    }
  }
  auto values(Index g) const {
    detail::check_index("GqaCache::values", "KV head g", g, config_.n_kv_heads);
    if constexpr (detail::is_quantized_storage<S>) {
      return values_.template dequantized<T>(g);
    } else {
      return values_.block(g);
    }
  }
  /// Pointer to KV head g's key / value row of token t. A head's rows are contiguous,
  /// row_stride() elements apart: d_h elements of S, or d_h codes followed by the row's
  /// ceil(d_h / B) fp32 block scales for a quantized S.
  const element_type* key_row(Index g, Index t) const { return keys_.row(g, t); }
  const element_type* value_row(Index g, Index t) const { return values_.row(g, t); }
  Index row_stride() const { return keys_.row_stride(); }

 private:
  friend class GqaLayer<T>;
  friend struct detail::BatchGrowth;

  static const GqaConfig& validated(const GqaConfig& config) {
    config.validate();
    return config;
  }

  // Grows geometrically to hold `needed` tokens. Strong exception guarantee.
  void grow_for(Index needed) {
    if (needed > capacity()) reserve(detail::grown_capacity(capacity(), needed));
  }

  // Writes and counts one token (1 x n_kv*d_h rows); requires capacity; never throws.
  template <class KeyRow, class ValueRow>
  void append_token(const KeyRow& key, const ValueRow& value) noexcept {
    keys_.write_rows(key);
    values_.write_rows(value);
    keys_.commit(1);
    values_.commit(1);
  }

  void truncate_unchecked(Index n) noexcept {
    keys_.set_tokens(n);
    values_.set_tokens(n);
  }

  GqaConfig config_;
  detail::TokenBuffer<S> keys_;
  detail::TokenBuffer<S> values_;
};

static_assert(detail::check_kv_cache<GqaCache<float>>());
static_assert(detail::check_kv_cache<GqaCache<double, float>>());
static_assert(detail::check_kv_cache<GqaCache<float, BlockQuantized<Dtype::int8, 128>>>());

}  // namespace kvattn
