// The KV cache of LRKV: shared K_s, V_s and each head's latents R_h^K, R_h^V.
#pragma once

#include <cmath>
#include <cstddef>
#include <string>
#include <type_traits>

#include "kvattn/cache/kv_cache.hpp"
#include "kvattn/cache/token_buffer.hpp"
#include "kvattn/config/lrkv_config.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/quantized.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn {

template <class T>
class LrkvLayer;

namespace detail {

/// The shapes of LRKV raw rows (see LrkvCache::rows_type) and, with `values`, that every
/// key RMS is finite and > 0 (logits are divided by it). Throws shape_error.
template <class Rows>
void check_lrkv_rows(const char* where, const LrkvConfig& config, const Rows& rows, bool values) {
  const Index n = rows.shared_keys.rows();
  const Index dh = config.head_dim;
  const Index hr = config.residual_width();
  check_shape(where, "shared_keys", rows.shared_keys, -1, dh);
  check_shape(where, "shared_values", rows.shared_values, n, dh);
  check_shape(where, "residual_keys", rows.residual_keys, n, hr);
  check_shape(where, "residual_values", rows.residual_values, n, hr);
  check_shape(where, "rope_keys", rows.rope_keys, n, config.decoupled_dim());
  check_shape(where, "key_rms", rows.key_rms, n, config.key_norm ? config.n_heads : 0);
  if (!values) return;
  for (Index t = 0; t < rows.key_rms.rows(); ++t) {
    for (Index h = 0; h < rows.key_rms.cols(); ++h) {
      const double rho = static_cast<double>(rows.key_rms(t, h));
      if (!(rho > 0.0) || !std::isfinite(rho)) {
        throw shape_error(std::string(where) + ": key_rms(" + std::to_string(t) + ", " +
                          std::to_string(h) + ") is " + std::to_string(rho) +
                          ", expected a finite key RMS > 0 (logits are divided by it)");
      }
    }
  }
}

/// Where the parts of an LRKV key or value row lie, in elements of storage_element_t<S>
/// from the row's start: the shared part at 0, head h's residual part at
/// residual_offset(c, h). For a scalar S the parts are plain (row_elements(w) = w); for a
/// block-quantized S each part is its codes followed by its own fp32 block scales
/// (core/quantized.hpp), so a part never shares a block with another.
template <class S>
struct LrkvRowLayout {
  using Traits = StorageTraits<S>;
  /// Elements of the shared part (d_h values).
  static constexpr Index shared(const LrkvConfig& c) { return Traits::row_elements(c.head_dim); }
  /// Elements of one head's residual part (r values): the stride from head to head.
  static constexpr Index residual(const LrkvConfig& c) { return Traits::row_elements(c.rank); }
  static constexpr Index residual_offset(const LrkvConfig& c, Index h) {
    return shared(c) + h * residual(c);
  }
  /// A value row: [v_s | r^V_1 ... r^V_H].
  static constexpr Index value_row(const LrkvConfig& c) { return residual_offset(c, c.n_heads); }
  /// A key row: [k~_s | r~_1 ... r~_H], and k~_R (decoupled) for a scalar S (a quantized
  /// cache keeps k~_R apart, in bf16).
  static constexpr Index key_row(const LrkvConfig& c) {
    return value_row(c) + (Traits::quantized ? 0 : c.decoupled_dim());
  }
};

/// Writes one token of a quantized LRKV cache: the key row's and the value row's parts,
/// each quantized on its own (LrkvRowLayout), and k~_R (decoupled) in bf16. The values
/// must be finite (require_finite before). Never throws.
template <class S, class A, class B, class C, class D, class E>
void write_quantized_lrkv_token(const LrkvConfig& c, storage_element_t<S>* key,
                                storage_element_t<S>* value, Eigen::bfloat16* rope,
                                const A& shared_key, const B& residual_key, const C& rope_key,
                                const D& shared_value, const E& residual_value) noexcept {
  using Layout = LrkvRowLayout<S>;
  using Traits = StorageTraits<S>;
  const Index dh = c.head_dim, r = c.rank;
  Traits::encode([&](Index j) { return shared_key(j); }, dh, key);
  Traits::encode([&](Index j) { return shared_value(j); }, dh, value);
  for (Index h = 0; h < c.n_heads && r > 0; ++h) {
    const Index at = Layout::residual_offset(c, h);
    Traits::encode([&](Index j) { return residual_key(h * r + j); }, r, key + at);
    Traits::encode([&](Index j) { return residual_value(h * r + j); }, r, value + at);
  }
  for (Index j = 0; j < c.decoupled_dim(); ++j) rope[j] = static_cast<Eigen::bfloat16>(rope_key(j));
}

/// The rows headed for a quantized LRKV cache are finite (value_error otherwise).
template <class Rows>
void require_finite_lrkv_rows(const char* where, const Rows& rows) {
  require_finite(where, "shared_keys", rows.shared_keys);
  require_finite(where, "shared_values", rows.shared_values);
  require_finite(where, "residual_keys", rows.residual_keys);
  require_finite(where, "residual_values", rows.residual_values);
  require_finite(where, "rope_keys", rows.rope_keys);
}

}  // namespace detail

/// Per token (seed 000, Eqs. 4-5 and the cache table):
///   key row    [ k~_s,t (d_h) | r~_1,t ... r~_H,t (r each) | k~_R,t (d_R, decoupled) ]
///   value row  [ v_s,t  (d_h) | r^V_1,t ... r^V_H,t (r each) ]
///   key RMS    [ rho_1,t ... rho_H,t ]                       (key_norm only)
/// that is 2 * (d_h + H * r) + d_R + H elements, the first two rows of storage type S.
/// Each token's row is contiguous, so a decode step streams the cache once, front to
/// back, scoring every head on the way (no head reads another buffer region).
///
/// What is stored is what the factored logits consume (see docs/lrkv.md):
///   k~_s,t  = P_t (g (.) k_s,t)  - the shared key after the key-norm gain g (key_norm)
///             and RoPE (rope_mode shared / commuting); k_s,t itself otherwise;
///   r~_h,t  = P~_t r_h,t (commuting: each latent pair rotated by its plane's angle),
///             r_h,t otherwise;
///   k~_R,t  = P_t k_R,t, the decoupled rotary key;
///   rho_h,t = RMS of head h's full key k_s,t + B_h^K r_h,t, computed when the token
///             is appended. Stored as norm_type: fp32, or S when S is wider (double),
///             so a double cache stays exact to double precision.
///
/// T is the compute type of the layer that fills it; S (default T) the storage type: a
/// scalar (float, double, Eigen::bfloat16, Eigen::half), or a block-quantized format
/// (Int8<B>, Fp8E4M3<B>, core/quantized.hpp). A quantized cache stores per token
///   key row    [ k~_s codes, scales | r~_1 codes, scales | ... | r~_H codes, scales ]
///   value row  [ v_s codes, scales  | r^V_1 codes, scales | ... | r^V_H codes, scales ]
///   rope row   [ k~_R (d_R, bf16) ]                          (decoupled only)
///   key RMS    [ rho_1,t ... rho_H,t ] (fp32)                 (key_norm only)
/// each part (d_h or r values) quantized on its own with ceil(width / B) fp32 scales
/// after its codes (detail::LrkvRowLayout), as analysis::storage_of<S>() counts.
/// A cache holds tokens only (no kernel scratch): several threads may read one const
/// cache at once; a thread that appends must be the only one using it. Copying forks it.
template <class T, class S = T>
class LrkvCache {
  static constexpr bool quantized = detail::is_quantized_storage<S>;
  using Layout = detail::LrkvRowLayout<S>;

 public:
  using compute_type = T;
  using storage_type = S;
  /// What a key or value row is made of: S itself, or the one-byte codes of a quantized S.
  using element_type = detail::storage_element_t<S>;
  /// Scalar of the decoupled rotary keys: S, or bf16 for a quantized S.
  using rope_type = std::conditional_t<quantized, Eigen::bfloat16, S>;
  /// Scalar of the per-head key RMS: at least fp32 whatever S is (fp32 when quantized).
  using norm_type = std::conditional_t<(!quantized && sizeof(S) > sizeof(float)), S, float>;
  using Map = Eigen::Map<const RowMatrix<element_type>, Eigen::Unaligned, Eigen::OuterStride<>>;
  using RopeMap = Eigen::Map<const RowMatrix<rope_type>, Eigen::Unaligned, Eigen::OuterStride<>>;
  using NormMap = Eigen::Map<const RowMatrix<norm_type>, Eigen::Unaligned, Eigen::OuterStride<>>;

  /// Already-projected rows for append, n tokens each (as stored, see above):
  ///   shared_keys     n x d_h        k~_s (gain and RoPE applied as the mode defines)
  ///   shared_values   n x d_h        v_s
  ///   residual_keys   n x (H * r)    r~_h, head h in columns [h*r, (h+1)*r)
  ///   residual_values n x (H * r)    r^V_h, same layout
  ///   rope_keys       n x d_R        k~_R (decoupled), n x 0 otherwise
  ///   key_rms         n x H          rho_h (key_norm, each finite and > 0; append
  ///                                  refuses anything else), n x 0 otherwise
  struct rows_type {
    ConstMatrixRef<T> shared_keys;
    ConstMatrixRef<T> shared_values;
    ConstMatrixRef<T> residual_keys;
    ConstMatrixRef<T> residual_values;
    ConstMatrixRef<T> rope_keys;
    ConstMatrixRef<T> key_rms;
  };

  explicit LrkvCache(const LrkvConfig& config, Index reserve_tokens = 0)
      : config_(validated(config)),
        keys_(1, Layout::key_row(config)),
        values_(1, Layout::value_row(config)),
        norms_(1, config.key_norm ? config.n_heads : 0),
        rope_(1, quantized ? config.decoupled_dim() : 0) {
    if (reserve_tokens != 0) reserve(reserve_tokens);  // shape_error when negative
  }

  const LrkvConfig& config() const { return config_; }
  Index tokens() const { return keys_.tokens(); }
  /// The sequence's length: tokens() (a contiguous cache holds every token, also with a
  /// window; PagedCache drops what the window no longer sees).
  Index sequence_length() const { return keys_.tokens(); }
  Index capacity() const { return keys_.capacity(); }
  /// 2 * (d_h + H * r) + d_R (decoupled) + H (key_norm), from the buffers' widths.
  Index elements_per_token() const {
    if constexpr (quantized) {
      return config_.cache_elements_per_token();  // values, not code bytes and scales
    } else {
      return keys_.elements_per_token() + values_.elements_per_token() +
             norms_.elements_per_token();
    }
  }
  /// Bytes of the cached tokens (block scales included).
  std::size_t bytes() const {
    return keys_.bytes() + values_.bytes() + norms_.bytes() + rope_.bytes();
  }
  std::size_t capacity_bytes() const {
    return keys_.capacity_bytes() + values_.capacity_bytes() + norms_.capacity_bytes() +
           rope_.capacity_bytes();
  }

  /// Makes room for `n` tokens in total; never shrinks. Strong exception guarantee.
  void reserve(Index n) {
    if (n < 0) throw shape_error("LrkvCache::reserve: n (" + std::to_string(n) + ") must be >= 0");
    if (n <= capacity()) return;
    auto keys = keys_.grown(n);
    auto values = values_.grown(n);
    auto norms = norms_.grown(n);
    auto rope = rope_.grown(n);
    keys_.swap(keys);
    values_.swap(values);
    norms_.swap(norms);
    rope_.swap(rope);
  }

  void clear() noexcept { truncate_unchecked(0); }

  /// Rolls back to the first n tokens (speculative decoding). Keeps capacity.
  void truncate(Index n) {
    detail::check_truncate("LrkvCache", n, tokens());
    truncate_unchecked(n);
  }

  /// Appends n tokens of raw rows (shapes above). Strong exception guarantee. A quantized
  /// cache takes finite values only (value_error otherwise, nothing appended).
  void append(const rows_type& rows) {
    detail::check_lrkv_rows("LrkvCache::append", config_, rows, true);
    append_unchecked(rows);
  }

  /// Cached tokens x d_h: the stored shared keys k~_s / values v_s (a view, or for a
  /// quantized S a dequantized RowMatrix<T> copy, as are the latents below).
  auto shared_keys() const { return part(keys_, 0, config_.head_dim); }
  auto shared_values() const { return part(values_, 0, config_.head_dim); }
  /// Cached tokens x r: head h's stored key latents r~_h / value latents r^V_h;
  /// shape_error unless 0 <= h < H.
  auto residual_keys(Index h) const {
    detail::check_index("LrkvCache::residual_keys", "head h", h, config_.n_heads);
    return residual(keys_, h, 1);
  }
  auto residual_values(Index h) const {
    detail::check_index("LrkvCache::residual_values", "head h", h, config_.n_heads);
    return residual(values_, h, 1);
  }
  /// Cached tokens x (H * r): every head's key / value latents, head h in columns
  /// [h*r, (h+1)*r) (the layout append takes).
  auto residual_keys() const { return residual(keys_, 0, config_.n_heads); }
  auto residual_values() const { return residual(values_, 0, config_.n_heads); }
  /// Cached tokens x d_R: the stored decoupled rotary keys (decoupled mode; bf16 when
  /// S is quantized).
  RopeMap rope_keys() const {
    const rope_type* base = capacity() > 0 ? rope_row(0) : nullptr;
    return RopeMap(base, tokens(), config_.decoupled_dim(), Eigen::OuterStride<>(rope_stride()));
  }
  /// Cached tokens x H: the key RMS rho_h,t (key_norm), tokens x 0 otherwise.
  NormMap key_rms() const {
    return NormMap(norms_.row(0, 0), tokens(), norms_.width(),
                   Eigen::OuterStride<>(norms_.width()));
  }

  /// Whole stored rows of token t: key row, value row, key RMS row (layout above).
  const element_type* key_row(Index t) const { return keys_.row(0, t); }
  const element_type* value_row(Index t) const { return values_.row(0, t); }
  const norm_type* rms_row(Index t) const { return norms_.row(0, t); }
  /// Token t's decoupled rotary key k~_R (d_R elements; in the key row for a scalar S).
  const rope_type* rope_row(Index t) const {
    if constexpr (quantized) {
      return rope_.row(0, t);
    } else {
      return keys_.row(0, t) + config_.head_dim + config_.residual_width();
    }
  }
  /// Elements of element_type from one token's key row (value row, rope row) to the next.
  Index key_row_stride() const { return keys_.row_stride(); }
  Index value_row_stride() const { return values_.row_stride(); }
  Index rope_stride() const { return quantized ? config_.decoupled_dim() : keys_.row_stride(); }

 private:
  friend class LrkvLayer<T>;
  friend struct detail::BatchGrowth;

  // Appends rows a layer computed (shapes checked by it; a NaN key RMS from a NaN input
  // is kept, so the bad input shows in the output). Strong exception guarantee.
  void append_unchecked(const rows_type& rows) {
    if constexpr (quantized) detail::require_finite_lrkv_rows("LrkvCache::append", rows);
    const Index n = rows.shared_keys.rows();
    grow_for(tokens() + n);
    for (Index t = 0; t < n; ++t) {
      append_token(rows.shared_keys.row(t), rows.residual_keys.row(t), rows.rope_keys.row(t),
                   rows.shared_values.row(t), rows.residual_values.row(t), rows.key_rms.row(t));
    }
  }

  // Grows geometrically to hold `needed` tokens. Strong exception guarantee.
  void grow_for(Index needed) {
    if (needed > capacity()) reserve(detail::grown_capacity(capacity(), needed));
  }

  // Writes one token (after grow_for) and counts it; never throws.
  template <class A, class B, class C, class D, class E, class F>
  void append_token(const A& shared_key, const B& residual_key, const C& rope_key,
                    const D& shared_value, const E& residual_value, const F& key_rms) noexcept {
    const Index t = tokens();
    if constexpr (quantized) {
      detail::write_quantized_lrkv_token<S>(config_, keys_.row(0, t), values_.row(0, t),
                                            rope_.row(0, t), shared_key, residual_key, rope_key,
                                            shared_value, residual_value);
    } else {
      const Index dh = config_.head_dim;
      const Index hr = config_.n_heads * config_.rank;
      S* k = keys_.row(0, t);
      for (Index j = 0; j < dh; ++j) k[j] = static_cast<S>(shared_key(j));
      for (Index j = 0; j < hr; ++j) k[dh + j] = static_cast<S>(residual_key(j));
      for (Index j = 0; j < config_.decoupled_dim(); ++j)
        k[dh + hr + j] = static_cast<S>(rope_key(j));
      S* v = values_.row(0, t);
      for (Index j = 0; j < dh; ++j) v[j] = static_cast<S>(shared_value(j));
      for (Index j = 0; j < hr; ++j) v[dh + j] = static_cast<S>(residual_value(j));
    }
    norm_type* n = norms_.row(0, t);
    for (Index j = 0; j < norms_.width(); ++j) n[j] = static_cast<norm_type>(key_rms(j));
    keys_.commit(1);
    values_.commit(1);
    norms_.commit(1);
    rope_.commit(1);
  }

  static const LrkvConfig& validated(const LrkvConfig& config) {
    config.validate();
    return config;
  }
  using RowBuffer = detail::TokenBuffer<element_type>;

  // Columns [first_col, first_col + cols) of the key or value rows, a part of them
  // (quantized: the part's width in values, at element offset first_col).
  auto part(const RowBuffer& buffer, Index first_col, Index cols) const {
    if constexpr (quantized) {
      RowMatrix<T> out(buffer.tokens(), cols);
      for (Index t = 0; t < buffer.tokens(); ++t) {
        detail::StorageTraits<S>::dequantize(buffer.row(0, t) + first_col, cols, 0, cols,
                                             out.row(t).data());
      }
      return out;
    } else {
      // An unallocated buffer has no data pointer to offset (UB even with 0 rows).
      const S* base = buffer.capacity() > 0 ? buffer.row(0, 0) + first_col : nullptr;
      return Map(base, buffer.tokens(), cols, Eigen::OuterStride<>(buffer.row_stride()));
    }
  }
  // Heads [h, h + count) of the key or value latents, tokens x count*r.
  auto residual(const RowBuffer& buffer, Index h, Index count) const {
    const Index r = config_.rank;
    if constexpr (quantized) {
      RowMatrix<T> out(buffer.tokens(), count * r);
      for (Index i = 0; i < count; ++i) {
        out.middleCols(i * r, r) = part(buffer, Layout::residual_offset(config_, h + i), r);
      }
      return out;
    } else {
      return part(buffer, config_.head_dim + h * r, count * r);
    }
  }
  void truncate_unchecked(Index n) noexcept {
    keys_.set_tokens(n);
    values_.set_tokens(n);
    norms_.set_tokens(n);
    rope_.set_tokens(n);
  }

  LrkvConfig config_;
  RowBuffer keys_;
  RowBuffer values_;
  detail::TokenBuffer<norm_type> norms_;
  detail::TokenBuffer<Eigen::bfloat16> rope_;  // quantized S, decoupled: k~_R (else 0 wide)
};

static_assert(detail::check_kv_cache<LrkvCache<float>>());
static_assert(detail::check_kv_cache<LrkvCache<double, float>>());
static_assert(detail::check_kv_cache<LrkvCache<float, BlockQuantized<Dtype::int8, 128>>>());
static_assert(detail::check_kv_cache<LrkvCache<float, BlockQuantized<Dtype::fp8_e4m3, 32>>>());

}  // namespace kvattn
