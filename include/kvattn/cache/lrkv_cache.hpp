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
/// T is the compute type of the layer that fills it; S (default T) the storage type.
/// A cache holds tokens only (no kernel scratch): several threads may read one const
/// cache at once; a thread that appends must be the only one using it. Copying forks it.
template <class T, class S = T>
class LrkvCache {
 public:
  static_assert(!detail::is_quantized_storage<S>,
                "kvattn::LrkvCache: block-quantized storage (Int8, Fp8E4M3) is not implemented for "
                "this mechanism yet; GqaCache and PagedGqaCache take it (docs/api.md)");
  using compute_type = T;
  using storage_type = S;
  /// Scalar of the per-head key RMS: at least fp32 whatever S is.
  using norm_type = std::conditional_t<(sizeof(S) > sizeof(float)), S, float>;
  using Map = Eigen::Map<const RowMatrix<S>, Eigen::Unaligned, Eigen::OuterStride<>>;
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
        keys_(1, config.head_dim + config.n_heads * config.rank + config.decoupled_dim()),
        values_(1, config.head_dim + config.n_heads * config.rank),
        norms_(1, config.key_norm ? config.n_heads : 0) {
    if (reserve_tokens > 0) reserve(reserve_tokens);
  }

  const LrkvConfig& config() const { return config_; }
  Index tokens() const { return keys_.tokens(); }
  /// The sequence's length: tokens() (a contiguous cache holds every token, also with a
  /// window; PagedCache drops what the window no longer sees).
  Index sequence_length() const { return keys_.tokens(); }
  Index capacity() const { return keys_.capacity(); }
  /// 2 * (d_h + H * r) + d_R (decoupled) + H (key_norm), from the buffers' widths.
  Index elements_per_token() const {
    return keys_.elements_per_token() + values_.elements_per_token() + norms_.elements_per_token();
  }
  std::size_t bytes() const { return keys_.bytes() + values_.bytes() + norms_.bytes(); }
  std::size_t capacity_bytes() const {
    return keys_.capacity_bytes() + values_.capacity_bytes() + norms_.capacity_bytes();
  }

  /// Makes room for `n` tokens in total; never shrinks. Strong exception guarantee.
  void reserve(Index n) {
    if (n < 0) throw shape_error("LrkvCache::reserve: n (" + std::to_string(n) + ") must be >= 0");
    if (n <= capacity()) return;
    auto keys = keys_.grown(n);
    auto values = values_.grown(n);
    auto norms = norms_.grown(n);
    keys_.swap(keys);
    values_.swap(values);
    norms_.swap(norms);
  }

  void clear() noexcept { truncate_unchecked(0); }

  /// Rolls back to the first n tokens (speculative decoding). Keeps capacity.
  void truncate(Index n) {
    detail::check_truncate("LrkvCache", n, tokens());
    truncate_unchecked(n);
  }

  /// Appends n tokens of raw rows (shapes above). Strong exception guarantee.
  void append(const rows_type& rows) {
    detail::check_lrkv_rows("LrkvCache::append", config_, rows, true);
    append_unchecked(rows);
  }

  /// Cached tokens x d_h: the stored shared keys k~_s / values v_s.
  Map shared_keys() const { return view(keys_, 0, config_.head_dim); }
  Map shared_values() const { return view(values_, 0, config_.head_dim); }
  /// Cached tokens x r: head h's stored key latents r~_h / value latents r^V_h.
  Map residual_keys(Index h) const {
    return view(keys_, config_.head_dim + h * config_.rank, config_.rank);
  }
  Map residual_values(Index h) const {
    return view(values_, config_.head_dim + h * config_.rank, config_.rank);
  }
  /// Cached tokens x (H * r): every head's key / value latents, head h in columns
  /// [h*r, (h+1)*r) (the layout append takes).
  Map residual_keys() const {
    return view(keys_, config_.head_dim, config_.n_heads * config_.rank);
  }
  Map residual_values() const {
    return view(values_, config_.head_dim, config_.n_heads * config_.rank);
  }
  /// Cached tokens x d_R: the stored decoupled rotary keys (decoupled mode).
  Map rope_keys() const {
    return view(keys_, config_.head_dim + config_.n_heads * config_.rank, config_.decoupled_dim());
  }
  /// Cached tokens x H: the key RMS rho_h,t (key_norm), tokens x 0 otherwise.
  NormMap key_rms() const {
    return NormMap(norms_.row(0, 0), tokens(), norms_.width(),
                   Eigen::OuterStride<>(norms_.width()));
  }

  /// Whole stored rows of token t: key row, value row, key RMS row (layout above).
  const S* key_row(Index t) const { return keys_.row(0, t); }
  const S* value_row(Index t) const { return values_.row(0, t); }
  const norm_type* rms_row(Index t) const { return norms_.row(0, t); }

 private:
  friend class LrkvLayer<T>;

  // Appends rows a layer computed (shapes checked by it; a NaN key RMS from a NaN input
  // is kept, so the bad input shows in the output). Strong exception guarantee.
  void append_unchecked(const rows_type& rows) {
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
    norm_type* n = norms_.row(0, t);
    for (Index j = 0; j < norms_.width(); ++j) n[j] = static_cast<norm_type>(key_rms(j));
    keys_.commit(1);
    values_.commit(1);
    norms_.commit(1);
  }

  static const LrkvConfig& validated(const LrkvConfig& config) {
    config.validate();
    return config;
  }
  static Map view(const detail::TokenBuffer<S>& buffer, Index first_col, Index cols) {
    // An unallocated buffer has no data pointer to offset (UB even with 0 rows).
    const S* base = buffer.capacity() > 0 ? buffer.row(0, 0) + first_col : nullptr;
    return Map(base, buffer.tokens(), cols, Eigen::OuterStride<>(buffer.width()));
  }
  void truncate_unchecked(Index n) noexcept {
    keys_.set_tokens(n);
    values_.set_tokens(n);
    norms_.set_tokens(n);
  }

  LrkvConfig config_;
  detail::TokenBuffer<S> keys_;
  detail::TokenBuffer<S> values_;
  detail::TokenBuffer<norm_type> norms_;
};

static_assert(detail::check_kv_cache<LrkvCache<float>>());
static_assert(detail::check_kv_cache<LrkvCache<double, float>>());

}  // namespace kvattn
