// LRKV, low-rank key-value attention (seed 000), with associative (factored) decode.
//
// Shapes (rows are tokens; weights `in x out`, Y = X * W):
//   x            L x d                 input hidden states
//   w_q          d x (H * d_h)         W_h^Q, head h in columns [h*d_h, (h+1)*d_h)
//   w_k_shared   d x d_h               W_shared^K        w_v_shared  d x d_h   W_shared^V
//   u_k, u_v     d x (H * r)           U_h^{K,V}, head h in columns [h*r, (h+1)*r)
//   b_k, b_v     d_h x (H * r)         B_h^{K,V} (seed orientation d_h x r), same columns
//   w_o          (H * d_h) x d         output projection
//   w_qr         d x (H * d_R)         W_QR, decoupled RoPE only (else d x 0)
//   w_kr         d x d_R               W_KR, decoupled RoPE only (else d x 0)
//   key_norm_gain 1 x d_h              g, key_norm only (else 1 x 0)
//   output       L x d
//
// The model (seed 000, Eqs. 2-7), for head h, query token i and key token t:
//   k_s,t = x_t W_shared^K,   r_h,t = x_t U_h^K,   k_h,t = k_s,t + r_h,t (B_h^K)^T
//   v_h,t = x_t W_shared^V + (x_t U_h^V)(B_h^V)^T
//   key_norm:  k_h,t <- g (.) k_h,t / rho_h,t,   rho_h,t = sqrt(mean(k_h,t^2) + eps)
//   logits and RoPE as the LrkvRopeMode says; a_h = softmax(scale * logits + mask)
//   o_h = sum_t a_h,t v_h,t,   output = [o_1 ... o_H] W_O
// The factored path never forms k_h,t or v_h,t of a cached token:
//   logit_h,t = (q_h . k~_s,t + q~_h . r~_h,t) / rho_h,t (+ q^R_h . k~_R,t)    (Eq. 6)
//   o_h = a_h V_s + (a_h R_h^V)(B_h^V)^T                                       (Eq. 7)
// with q~_h = (q_h (.) g) B_h^K; docs/lrkv.md derives every mode.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/gqa_config.hpp"
#include "kvattn/attention/lrkv_config.hpp"
#include "kvattn/cache/lrkv_cache.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/random.hpp"
#include "kvattn/core/rms_norm.hpp"
#include "kvattn/core/rope.hpp"
#include "kvattn/core/softmax.hpp"
#include "kvattn/core/threads.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/detail/decode_kernels.hpp"
#include "kvattn/detail/split_attention.hpp"

namespace kvattn {

namespace detail {

inline std::string describe(const LrkvConfig& c) {
  return "{d_model " + std::to_string(c.d_model) + ", n_heads " + std::to_string(c.n_heads) +
         ", head_dim " + std::to_string(c.head_dim) + ", rank " + std::to_string(c.rank) +
         ", rope_mode " + to_string(c.rope_mode) + ", rope_dim " + std::to_string(c.rope_dim) +
         ", key_norm " + (c.key_norm ? "on" : "off") + "}";
}

/// The two dims (a, b) of rotary plane p of a width-`dim` RoPE in `layout`.
inline std::pair<Index, Index> rope_plane_dims(RopeLayout layout, Index dim, Index p) {
  if (layout == RopeLayout::half_split) return {p, p + dim / 2};
  return {2 * p, 2 * p + 1};
}

/// The rotary plane holding dim i.
inline Index rope_plane_of(RopeLayout layout, Index dim, Index i) {
  return layout == RopeLayout::half_split ? i % (dim / 2) : i / 2;
}

/// For rope_mode commuting: the rotary plane that each latent pair (2j, 2j+1) of each
/// head maps into, H * r/2 entries (head-major). Throws config_error unless every
/// pair of B_h^K is a scaled rotation [[c, -s], [s, c]] into one plane (rows a, b of
/// the plane; zero elsewhere), exactly. A pair of zero columns maps to plane 0.
template <class T>
std::vector<Index> lrkv_latent_planes(const LrkvConfig& config, const RowMatrix<T>& b_k) {
  const Index dh = config.head_dim;
  const Index r = config.rank;
  const RopeLayout layout = config.rope.layout;
  std::vector<Index> planes;
  planes.reserve(static_cast<std::size_t>(config.n_heads * r / 2));
  for (Index h = 0; h < config.n_heads; ++h) {
    for (Index j = 0; j < r / 2; ++j) {
      const Index c0 = h * r + 2 * j;
      const Index c1 = c0 + 1;
      Index first = -1;
      for (Index i = 0; i < dh && first < 0; ++i) {
        if (b_k(i, c0) != T(0) || b_k(i, c1) != T(0)) first = i;
      }
      const Index plane = first < 0 ? 0 : rope_plane_of(layout, dh, first);
      const auto [a, b] = rope_plane_dims(layout, dh, plane);
      bool ok = b_k(a, c0) == b_k(b, c1) && b_k(a, c1) == -b_k(b, c0);
      for (Index i = 0; i < dh && ok; ++i) {
        if (i != a && i != b && (b_k(i, c0) != T(0) || b_k(i, c1) != T(0))) ok = false;
      }
      if (!ok) {
        throw config_error(
            "LrkvWeights: rope_mode commuting needs each latent pair of B_h^K to map into one "
            "rotary plane by a scaled rotation [[c, -s], [s, c]] (rows of that plane only), so "
            "that P_t B_h^K = B_h^K P~_t; head " +
            std::to_string(h) + ", latent pair (" + std::to_string(2 * j) + ", " +
            std::to_string(2 * j + 1) + ") (b_k columns " + std::to_string(c0) + ", " +
            std::to_string(c1) +
            ") breaks it. Build B_h^K with rope_plane_dims, or use "
            "rope_mode shared or decoupled");
      }
      planes.push_back(plane);
    }
  }
  return planes;
}

}  // namespace detail

/// The projection weights of an LRKV layer (`in x out`, Y = X * W; shapes above).
template <class T>
struct LrkvWeights {
  RowMatrix<T> w_q;            // W_h^Q, all heads: d x (H * d_h)
  RowMatrix<T> w_k_shared;     // W_shared^K: d x d_h
  RowMatrix<T> w_v_shared;     // W_shared^V: d x d_h
  RowMatrix<T> u_k;            // U_h^K, all heads: d x (H * r)
  RowMatrix<T> u_v;            // U_h^V, all heads: d x (H * r)
  RowMatrix<T> b_k;            // B_h^K, all heads: d_h x (H * r)
  RowMatrix<T> b_v;            // B_h^V, all heads: d_h x (H * r)
  RowMatrix<T> w_o;            // W_O: (H * d_h) x d
  RowMatrix<T> w_qr;           // W_QR: d x (H * d_R), decoupled only (else d x 0)
  RowMatrix<T> w_kr;           // W_KR: d x d_R, decoupled only (else d x 0)
  RowVector<T> key_norm_gain;  // g: 1 x d_h, key_norm only (else 1 x 0)

  /// Seeded weights following the paper's initialization (seed 000, "training" slide):
  /// W_h^Q, W_shared, W_O, W_QR, W_KR and U_h from N(0, 1/fan_in), B_h from N(0, 1/r),
  /// then each U_h rescaled so that ||U_h B_h^T||_F = residual_scale * ||W_shared||_F
  /// exactly (0.1 in the paper). With rope_mode commuting, each latent pair of B_h^K is
  /// a random scaled rotation into its own random rotary plane. The key-norm gain is
  /// exp(N(0, 0.2^2)) per dim (per rotary plane with commuting), so tests see a
  /// non-trivial gain.
  static LrkvWeights random(const LrkvConfig& config, std::uint64_t seed,
                            double residual_scale = 0.1) {
    config.validate();
    if (!(residual_scale >= 0.0) || !std::isfinite(residual_scale)) {
      throw config_error("LrkvWeights::random: residual_scale (" + std::to_string(residual_scale) +
                         ") must be finite and >= 0");
    }
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    const Index d = config.d_model;
    const Index dh = config.head_dim;
    const Index r = config.rank;
    const Index H = config.n_heads;
    const Index dr = config.decoupled_dim();
    LrkvWeights w;
    w.w_q = random_weight<T>(d, H * dh, rng);
    w.w_k_shared = random_weight<T>(d, dh, rng);
    w.w_v_shared = random_weight<T>(d, dh, rng);
    w.u_k = random_weight<T>(d, H * r, rng);
    w.u_v = random_weight<T>(d, H * r, rng);
    const double b_std = r > 0 ? 1.0 / std::sqrt(static_cast<double>(r)) : 0.0;
    if (config.rope_mode == LrkvRopeMode::commuting) {
      w.b_k = RowMatrix<T>::Zero(dh, H * r);
      std::uniform_real_distribution<double> uniform_angle(0.0, 2.0 * 3.14159265358979323846);
      for (Index h = 0; h < H; ++h) {
        std::vector<Index> planes(static_cast<std::size_t>(dh / 2));
        std::iota(planes.begin(), planes.end(), Index{0});
        std::shuffle(planes.begin(), planes.end(), rng);
        for (Index j = 0; j < r / 2; ++j) {
          const auto [a, b] =
              detail::rope_plane_dims(config.rope.layout, dh, planes[static_cast<std::size_t>(j)]);
          const double phi = uniform_angle(rng);
          const double s = std::exp(0.3 * normal(rng));
          const Index c0 = h * r + 2 * j;
          w.b_k(a, c0) = static_cast<T>(s * std::cos(phi));
          w.b_k(b, c0) = static_cast<T>(s * std::sin(phi));
          w.b_k(a, c0 + 1) = -w.b_k(b, c0);
          w.b_k(b, c0 + 1) = w.b_k(a, c0);
        }
      }
    } else {
      w.b_k = random_normal<T>(dh, H * r, rng, b_std);
    }
    w.b_v = random_normal<T>(dh, H * r, rng, b_std);
    w.w_o = random_weight<T>(H * dh, d, rng);
    w.w_qr = dr > 0 ? random_weight<T>(d, H * dr, rng) : RowMatrix<T>(d, 0);
    w.w_kr = dr > 0 ? random_weight<T>(d, dr, rng) : RowMatrix<T>(d, 0);
    if (config.key_norm) {
      w.key_norm_gain.resize(dh);
      if (config.rope_mode == LrkvRopeMode::commuting) {
        for (Index p = 0; p < dh / 2; ++p) {
          const auto [a, b] = detail::rope_plane_dims(config.rope.layout, dh, p);
          w.key_norm_gain(a) = w.key_norm_gain(b) = static_cast<T>(std::exp(0.2 * normal(rng)));
        }
      } else {
        for (Index i = 0; i < dh; ++i)
          w.key_norm_gain(i) = static_cast<T>(std::exp(0.2 * normal(rng)));
      }
    }
    // Residuals start at residual_scale * ||W_shared||_F (seed 000, training slide).
    for (Index h = 0; h < H && r > 0; ++h) {
      rescale_residual(w.u_k, w.b_k, w.w_k_shared, h, r, residual_scale);
      rescale_residual(w.u_v, w.b_v, w.w_v_shared, h, r, residual_scale);
    }
    return w;
  }

  /// The weights that make LRKV at full rank reproduce an MHA layer (seed 000,
  /// "r = d_h: expressive enough for MHA"): W_shared = 0, r = d_h, U_h = W_h, B_h = I.
  /// With RoPE the config (lrkv_config_from_mha) is rope_mode commuting, and B_h^K is the
  /// permutation taking latent pair j to rotary plane j (I for interleaved), with
  /// U_h^K = W_h^K B_h^K, so U_h^K (B_h^K)^T = W_h^K still. Needs n_kv_heads == n_heads
  /// and no biases (config_error otherwise).
  static LrkvWeights from_mha(const GqaConfig& mha, const GqaWeights<T>& weights);

  /// The same weights in another scalar type (e.g. double for a reference).
  template <class U>
  LrkvWeights<U> cast() const {
    return {w_q.template cast<U>(),  w_k_shared.template cast<U>(),   w_v_shared.template cast<U>(),
            u_k.template cast<U>(),  u_v.template cast<U>(),          b_k.template cast<U>(),
            b_v.template cast<U>(),  w_o.template cast<U>(),          w_qr.template cast<U>(),
            w_kr.template cast<U>(), key_norm_gain.template cast<U>()};
  }

  /// Throws shape_error unless every matrix matches `config`, and config_error when
  /// rope_mode commuting's constraints fail (B_h^K's structure; with key_norm, a gain
  /// equal on both dims of each rotary plane, since only then does the diagonal gain
  /// commute with the plane rotations).
  void check(const LrkvConfig& config) const {
    constexpr const char* where = "LrkvWeights";
    const Index d = config.d_model;
    const Index dh = config.head_dim;
    const Index hr = config.n_heads * config.rank;
    const Index dr = config.decoupled_dim();
    detail::check_shape(where, "w_q", w_q, d, config.n_heads * dh);
    detail::check_shape(where, "w_k_shared", w_k_shared, d, dh);
    detail::check_shape(where, "w_v_shared", w_v_shared, d, dh);
    detail::check_shape(where, "u_k", u_k, d, hr);
    detail::check_shape(where, "u_v", u_v, d, hr);
    detail::check_shape(where, "b_k", b_k, dh, hr);
    detail::check_shape(where, "b_v", b_v, dh, hr);
    detail::check_shape(where, "w_o", w_o, config.n_heads * dh, d);
    detail::check_shape(where, "w_qr", w_qr, dr > 0 ? d : -1, config.n_heads * dr);
    detail::check_shape(where, "w_kr", w_kr, dr > 0 ? d : -1, dr);
    detail::check_shape(where, "key_norm_gain", key_norm_gain, config.key_norm ? 1 : -1,
                        config.key_norm ? dh : 0);
    if (config.rope_mode == LrkvRopeMode::commuting) {
      (void)detail::lrkv_latent_planes(config, b_k);
      if (config.key_norm) {
        for (Index p = 0; p < dh / 2; ++p) {
          const auto [a, b] = detail::rope_plane_dims(config.rope.layout, dh, p);
          if (key_norm_gain(a) != key_norm_gain(b)) {
            throw config_error(
                std::string(where) +
                ": rope_mode commuting with key_norm needs key_norm_gain equal "
                "on both dims of each rotary plane (a diagonal gain commutes with a plane "
                "rotation only then); dims " +
                std::to_string(a) + " and " + std::to_string(b) + " have " +
                std::to_string(static_cast<double>(key_norm_gain(a))) + " and " +
                std::to_string(static_cast<double>(key_norm_gain(b))));
          }
        }
      }
    }
  }

 private:
  // U_h *= residual_scale * ||W_shared||_F / ||U_h B_h^T||_F (computed in double).
  static void rescale_residual(RowMatrix<T>& u, const RowMatrix<T>& b, const RowMatrix<T>& w_shared,
                               Index h, Index r, double scale) {
    const Eigen::MatrixXd product = u.middleCols(h * r, r).template cast<double>() *
                                    b.middleCols(h * r, r).template cast<double>().transpose();
    const double norm = product.norm();
    if (norm == 0.0) return;
    const double target = scale * w_shared.template cast<double>().norm();
    u.middleCols(h * r, r) =
        (u.middleCols(h * r, r).template cast<double>() * (target / norm)).template cast<T>();
  }
};

/// The LRKV config whose layer reproduces the MHA layer `mha` at full rank: r = d_h,
/// the same RoPE settings and softmax scale, rope_mode commuting with RoPE (exact full
/// RoPE) and none without. Throws config_error unless mha is MHA without biases.
inline LrkvConfig lrkv_config_from_mha(const GqaConfig& mha) {
  mha.validate();
  if (mha.n_kv_heads != mha.n_heads) {
    throw config_error("lrkv_config_from_mha: n_kv_heads (" + std::to_string(mha.n_kv_heads) +
                       ") must equal n_heads (" + std::to_string(mha.n_heads) +
                       "): only MHA maps onto LRKV at full rank");
  }
  if (mha.qkv_bias) {
    throw config_error("lrkv_config_from_mha: qkv_bias (1) must be false: LRKV has no biases");
  }
  LrkvConfig config;
  config.d_model = mha.d_model;
  config.n_heads = mha.n_heads;
  config.head_dim = mha.head_dim;
  config.rank = mha.head_dim;
  config.rope_mode = mha.rope.enabled() ? LrkvRopeMode::commuting : LrkvRopeMode::none;
  config.rope = mha.rope;
  config.softmax_scale = mha.softmax_scale;
  config.validate();
  return config;
}

template <class T>
LrkvWeights<T> LrkvWeights<T>::from_mha(const GqaConfig& mha, const GqaWeights<T>& weights) {
  const LrkvConfig config = lrkv_config_from_mha(mha);
  weights.check(mha);
  const Index d = config.d_model;
  const Index dh = config.head_dim;
  const Index H = config.n_heads;
  // B_h^K: latent pair j -> rotary plane j (the identity unless half-split RoPE).
  RowMatrix<T> perm = RowMatrix<T>::Identity(dh, dh);
  if (config.rope.layout == RopeLayout::half_split) {
    perm.setZero();
    for (Index j = 0; j < dh / 2; ++j) {
      perm(j, 2 * j) = T(1);
      perm(j + dh / 2, 2 * j + 1) = T(1);
    }
  }
  LrkvWeights w;
  w.w_q = weights.w_q;
  w.w_k_shared = RowMatrix<T>::Zero(d, dh);
  w.w_v_shared = RowMatrix<T>::Zero(d, dh);
  w.u_k.resize(d, H * dh);
  w.u_v = weights.w_v;
  w.b_k.resize(dh, H * dh);
  w.b_v.resize(dh, H * dh);
  for (Index h = 0; h < H; ++h) {
    w.u_k.middleCols(h * dh, dh) =
        weights.w_k.middleCols(h * dh, dh) * perm;  // exact: a permutation
    w.b_k.middleCols(h * dh, dh) = perm;
    w.b_v.middleCols(h * dh, dh).setIdentity();
  }
  w.w_o = weights.w_o;
  w.w_qr = RowMatrix<T>(d, 0);
  w.w_kr = RowMatrix<T>(d, 0);
  return w;
}

/// An LRKV attention layer. Immutable after construction: one layer may be used from
/// several threads at once, each thread decoding its own cache.
template <class T>
class LrkvLayer {
 public:
  using scalar_type = T;
  template <class S = T>
  using cache_type = LrkvCache<T, S>;

  /// Validates the config and the weights (config_error / shape_error). A rope_mode full
  /// layer can be built (reference::forward computes it) but cannot prefill or decode.
  LrkvLayer(const LrkvConfig& config, LrkvWeights<T> weights)
      : config_(config), weights_(std::move(weights)) {
    config_.validate();
    weights_.check(config_);
    if (config_.rotates_shared()) rope_ = Rope(config_.rope, config_.head_dim);
    if (config_.rope_mode == LrkvRopeMode::decoupled) rope_ = Rope(config_.rope, config_.rope_dim);
    if (config_.rope_mode == LrkvRopeMode::commuting) {
      // P~_t: latent pair j of head h turns with the angle of the plane it maps into.
      const std::vector<Index> planes = detail::lrkv_latent_planes(config_, weights_.b_k);
      std::vector<double> inv_freq;
      inv_freq.reserve(planes.size());
      for (const Index p : planes)
        inv_freq.push_back(rope_.inverse_frequencies()[static_cast<std::size_t>(p)]);
      latent_rope_ = Rope(RopeLayout::interleaved, std::move(inv_freq), rope_.amplitude());
    }
    // q~_h = (q_h (.) g) B_h^K = q_h (diag(g) B_h^K): the gain folds into B^K once.
    b_k_gained_ = weights_.b_k;
    if (config_.key_norm) b_k_gained_ = weights_.key_norm_gain.asDiagonal() * weights_.b_k;
    scale_ = static_cast<T>(config_.scale());
  }

  /// A layer with LrkvWeights<T>::random(config, seed, residual_scale).
  static LrkvLayer random(const LrkvConfig& config, std::uint64_t seed,
                          double residual_scale = 0.1) {
    return LrkvLayer(config, LrkvWeights<T>::random(config, seed, residual_scale));
  }

  /// The full-rank LRKV layer that computes the same function as the MHA layer `mha`
  /// (see LrkvWeights::from_mha).
  static LrkvLayer from_mha(const GqaLayer<T>& mha) {
    return LrkvLayer(lrkv_config_from_mha(mha.config()),
                     LrkvWeights<T>::from_mha(mha.config(), mha.weights()));
  }

  const LrkvConfig& config() const { return config_; }
  const LrkvWeights<T>& weights() const { return weights_; }
  /// P_t: width d_h (shared / full / commuting), d_R (decoupled), disabled (none).
  const Rope& rope() const { return rope_; }
  /// P~_t over all heads' key latents (width H * r), commuting only; disabled otherwise.
  const Rope& latent_rope() const { return latent_rope_; }
  /// The scale multiplying the logits before the softmax.
  T softmax_scale() const { return scale_; }

  /// An empty cache for this layer, with room for `reserve_tokens`.
  template <class S = T>
  LrkvCache<T, S> make_cache(Index reserve_tokens = 0) const {
    return LrkvCache<T, S>(config_, reserve_tokens);
  }

  /// Causal prefill of L new tokens x (L x d) after the cache's tokens: appends their
  /// shared features and latents and returns the L x d output. Factored and tiled
  /// (online softmax over key tiles), so memory is O(L * (d + H * r) + tile^2). With
  /// threads, the projections are split by output column and the attention by query
  /// tile.
  template <class S>
  RowMatrix<T> prefill(const ConstMatrixRef<T>& x, LrkvCache<T, S>& cache,
                       Threads threads = {}) const {
    constexpr const char* where = "LrkvLayer::prefill";
    check_factored(where);
    check_cache(cache, where);
    detail::check_shape(where, "x", x, -1, config_.d_model);
    const int thread_count = threads.resolved();
    const Index n = x.rows();
    const Index past = cache.tokens();
    const Index dh = config_.head_dim;
    const Index hr = config_.n_heads * config_.rank;
    const Index dr = config_.decoupled_dim();
    RowMatrix<T> key(n, key_width()), value(n, dh + hr), query, query_latent(n, hr), query_rope;
    RowMatrix<T> rms(n, config_.key_norm ? config_.n_heads : 0);
    RowVector<T> scratch(dh);
    key.leftCols(dh).noalias() = x * weights_.w_k_shared;
    detail::parallel_product(x, weights_.u_k, key.middleCols(dh, hr), thread_count);
    key.rightCols(dr).noalias() = x * weights_.w_kr;
    value.leftCols(dh).noalias() = x * weights_.w_v_shared;
    detail::parallel_product(x, weights_.u_v, value.rightCols(hr), thread_count);
    query.resize(n, weights_.w_q.cols());
    detail::parallel_product(x, weights_.w_q, query, thread_count);
    query_rope.noalias() = x * weights_.w_qr;
    for (Index i = 0; i < n; ++i) {
      const double position = static_cast<double>(config_.rope.position_offset + past + i);
      finish_token(position, key.row(i).data(), query.row(i).data(), query_latent.row(i).data(),
                   query_rope.row(i).data(), rms.row(i).data(), scratch.data());
    }
    cache.append({key.leftCols(dh), value.leftCols(dh), key.middleCols(dh, hr), value.rightCols(hr),
                  key.rightCols(dr), rms});  // strong guarantee
    RowMatrix<T> heads(n, config_.n_heads * dh);
    attend_tiled(query, query_latent, query_rope, cache, past, heads, thread_count);
    RowMatrix<T> out(n, config_.d_model);
    detail::parallel_product(heads, weights_.w_o, out, thread_count);
    return out;
  }

  /// One new token x (1 x d) through the associative path (seed 000, Eqs. 6-7): appends
  /// its row, attends over the whole cache (see attend) and writes the 1 x d output into
  /// `out`. Allocates nothing once the cache has capacity and has decoded at this
  /// thread count.
  ///
  /// x and out are taken as matrices so that a wrongly shaped argument (say 2 x d)
  /// reaches the shape check instead of failing inside Eigen's conversion.
  template <class S>
  void decode(const ConstMatrixRef<T>& x, LrkvCache<T, S>& cache, MatrixRef<T> out,
              Threads threads = {}) const {
    constexpr const char* where = "LrkvLayer::decode";
    check_factored(where);
    check_cache(cache, where);
    detail::check_shape(where, "x", x, 1, config_.d_model);
    detail::check_shape(where, "out", out, 1, config_.d_model);
    const int thread_count = threads.resolved();
    auto& ws = cache.workspace();
    cache.ensure_capacity(cache.tokens() + 1);
    const auto plan = prepare(ws, cache.tokens() + 1, thread_count);
    // Everything that may throw is done; from here the step cannot fail.
    const Index dh = config_.head_dim;
    const Index hr = config_.n_heads * config_.rank;
    const Index dr = config_.decoupled_dim();
    ws.key.head(dh).noalias() = x.row(0) * weights_.w_k_shared;
    detail::parallel_product(x, weights_.u_k, ws.key.segment(dh, hr), thread_count);
    ws.key.tail(dr).noalias() = x.row(0) * weights_.w_kr;
    ws.value.head(dh).noalias() = x.row(0) * weights_.w_v_shared;
    detail::parallel_product(x, weights_.u_v, ws.value.tail(hr), thread_count);
    detail::parallel_product(x, weights_.w_q, ws.query, thread_count);
    ws.query_rope.noalias() = x.row(0) * weights_.w_qr;
    const double position = static_cast<double>(config_.rope.position_offset + cache.tokens());
    finish_key(position, ws.key.data(), ws.rms.data(), ws.scratch.data());
    cache.write_token(ws.key.head(dh), ws.key.segment(dh, hr), ws.key.tail(dr), ws.value.head(dh),
                      ws.value.tail(hr), ws.rms);
    attend_prepared(cache, ws, plan, ws.heads.data(), thread_count);
    detail::parallel_product(ws.heads, weights_.w_o, out, thread_count);
  }

  /// Convenience overload returning the 1 x d output (allocates the result).
  template <class S>
  RowVector<T> decode(const ConstMatrixRef<T>& x, LrkvCache<T, S>& cache,
                      Threads threads = {}) const {
    RowVector<T> out(config_.d_model);
    decode(x, cache, out, threads);
    return out;
  }

  /// The attention step alone, for the newest cached token (index tokens() - 1):
  /// `query` (1 x H*(d_h + d_R)) is that token's projected query [x W_Q | x W_QR]
  /// (the W_QR part only with rope_mode decoupled, else 1 x H*d_h), before RoPE;
  /// `heads` (1 x H*d_h) receives the per-head outputs o_h, before W_O. The latent
  /// query q~_h = (q_h (.) g) B_h^K and the final (a_h R_h^V)(B_h^V)^T are part of the
  /// step. The cache is not modified.
  ///
  /// The associative step (Eqs. 6-7): each tile of cached rows is scored by every head,
  /// q_h . k~_s,t for all heads at once against the shared key, plus each head's
  /// latent q~_h . r~_h,t (/ rho_h,t with key norm, + q^R_h . k~_R,t when decoupled);
  /// the tile's values accumulate a_h V_s and a_h R_h^V under an online softmax. No
  /// per-head key or value of a cached token is formed, and each cached element is read
  /// once per step. With threads, the sequence is split across them and the partial
  /// softmax states merged exactly (flash-decoding).
  template <class S>
  void attend(const ConstMatrixRef<T>& query, LrkvCache<T, S>& cache, MatrixRef<T> heads,
              Threads threads = {}) const {
    constexpr const char* where = "LrkvLayer::attend";
    check_factored(where);
    check_cache(cache, where);
    const Index H = config_.n_heads;
    const Index dh = config_.head_dim;
    const Index q_width = H * (dh + config_.decoupled_dim());
    detail::check_shape(where, "query", query, 1, q_width);
    detail::check_shape(where, "heads", heads, 1, H * dh);
    detail::require_tokens(where, cache.tokens());
    const int thread_count = threads.resolved();
    auto& ws = cache.workspace();
    const auto plan = prepare(ws, cache.tokens(), thread_count);
    ws.query = query.row(0).head(H * dh);
    ws.query_rope = query.row(0).tail(H * config_.decoupled_dim());
    attend_prepared(cache, ws, plan, heads.data(), thread_count);
  }

 private:
  Index key_width() const {
    return config_.head_dim + config_.n_heads * config_.rank + config_.decoupled_dim();
  }

  void check_factored(const char* where) const {
    if (config_.factored_exact()) return;
    throw config_error(
        std::string(where) +
        ": rope_mode full cannot be computed from the LRKV cache. RoPE on the whole key "
        "rotates the residual B_h^K r_h,t, and P_t B_h^K = B_h^K P~_t has no solution P~_t for "
        "a general B_h^K (seed 000, backup slide: B = [1; 0], P = [[0, -1], [1, 0]], PB = [0; 1] "
        "is not B c for any c), so the rotated key cannot be formed from the cached latent "
        "without expanding it. Use rope_mode commuting (B_h^K built from scaled rotations into "
        "rotary planes; exact full RoPE), shared or decoupled, or reference::forward for the "
        "expanded full-RoPE model");
  }

  template <class S>
  void check_cache(const LrkvCache<T, S>& cache, const char* where) const {
    if (!(cache.config() == config_)) {
      throw config_error(std::string(where) + ": the cache was made for config " +
                         detail::describe(cache.config()) +
                         " (or other RoPE/key-norm settings), the layer has " +
                         detail::describe(config_));
    }
  }

  // Completes one token whose raw projections are in place (finish_key, then
  // finish_query):
  //   key   [k_s | r_1 ... r_H | k_R]  (x W_shared^K, x U^K, x W_KR)  -> the stored row
  //   query q (x W^Q), query_rope q^R (x W_QR)                       -> scaled, rotated
  //   query_latent <- scale * (q_h (.) g) B_h^K;  rms <- rho_h (key_norm)
  // `scratch` holds d_h scalars. No allocation.
  void finish_token(double position, T* key, T* query, T* query_latent, T* query_rope, T* rms,
                    T* scratch) const {
    finish_key(position, key, rms, scratch);
    finish_query(position, query, query_latent, query_rope);
  }

  void finish_key(double position, T* key, T* rms, T* scratch) const {
    using RowMap = Eigen::Map<RowVector<T>>;
    const Index dh = config_.head_dim;
    const Index r = config_.rank;
    const Index H = config_.n_heads;
    const Index hr = H * r;
    RowMap shared_key(key, dh);
    if (config_.key_norm) {
      // rho_h from the new token's materialized key k_s + r_h (B_h^K)^T, before gain/RoPE.
      RowMap full_key(scratch, dh);
      for (Index h = 0; h < H; ++h) {
        full_key = shared_key;
        if (r > 0) {
          full_key.noalias() +=
              RowMap(key + dh + h * r, r) * weights_.b_k.middleCols(h * r, r).transpose();
        }
        rms[h] = rms_of(scratch, dh);
      }
      shared_key = shared_key.cwiseProduct(weights_.key_norm_gain);
    }
    if (config_.rotates_shared()) rope_.rotate(key, position);
    if (config_.rope_mode == LrkvRopeMode::commuting) latent_rope_.rotate(key + dh, position);
    if (config_.rope_mode == LrkvRopeMode::decoupled) rope_.rotate(key + dh + hr, position);
  }

  void finish_query(double position, T* query, T* query_latent, T* query_rope) const {
    using RowMap = Eigen::Map<RowVector<T>>;
    const Index dh = config_.head_dim;
    const Index r = config_.rank;
    const Index H = config_.n_heads;
    const Index hr = H * r;
    // The residual query uses the rotated query only when the residual key is rotated.
    if (config_.rope_mode == LrkvRopeMode::commuting) rope_.rotate(query, position, H, dh);
    for (Index h = 0; h < H && r > 0; ++h) {
      RowMap(query_latent + h * r, r).noalias() =
          RowMap(query + h * dh, dh) * b_k_gained_.middleCols(h * r, r);
    }
    if (config_.rope_mode == LrkvRopeMode::shared) rope_.rotate(query, position, H, dh);
    if (config_.rope_mode == LrkvRopeMode::decoupled) {
      rope_.rotate(query_rope, position, H, config_.rope_dim);
    }
    RowMap(query, H * dh) *= scale_;
    RowMap(query_latent, hr) *= scale_;
    RowMap(query_rope, H * config_.decoupled_dim()) *= scale_;
  }

  T rms_of(const T* x, Index n) const { return rms(x, n, config_.key_norm_epsilon); }

  // Tokens per decode tile: a cached row is (d_h + H r) wide twice over, so a few
  // rows already fill L1; 16 keep the tile in L2 while every head reads its slices.
  static constexpr Index kDecodeTile = 16;

  // Sizes the workspace for a step over `length` tokens; may allocate and throw.
  template <class Workspace>
  detail::SplitPlan prepare(Workspace& ws, Index length, int threads) const {
    const Index H = config_.n_heads;
    const Index dh = config_.head_dim;
    const Index hr = H * config_.rank;
    auto fit = [](RowVector<T>& v, Index n) { detail::reshape(v, n); };
    fit(ws.query, H * dh);
    fit(ws.query_transposed, H * dh);
    fit(ws.query_latent, hr);
    fit(ws.query_rope, H * config_.decoupled_dim());
    fit(ws.key, key_width());
    fit(ws.value, dh + hr);
    fit(ws.rms, config_.key_norm ? H : 0);
    fit(ws.scratch, dh);
    fit(ws.heads, H * dh);
    detail::reshape(ws.acc, H, dh + config_.rank);
    const auto plan = detail::plan_split(1, H, dh + config_.rank, length, kDecodeTile, 0, threads);
    ws.split.fit(plan);
    return plan;
  }

  // Every head against a tile of cached rows (one group: all heads share the rows).
  // Accumulator row h is [a_h V_s (d_h) | a_h R_h^V (r)].
  template <class S>
  struct DecodeOps {
    const LrkvCache<T, S>& cache;
    const T* query;             // H x d_h        scaled (and rotated as the mode says)
    const T* query_transposed;  // d_h x H
    const T* query_latent;      // H x r          scaled
    const T* query_rope;        // H x d_R        scaled, rotated (decoupled)
    Index heads, head_dim, rank, rope_dim, key_width, value_width;
    bool key_norm;

    void score(Index, Index first, Index n, T* logits, T*) const {
      const S* rows = cache.key_row(first);
      const Index ahead = std::min(n, cache.tokens() - first - n);
      if (ahead > 0) {  // the next tile's rows, while this one computes
        detail::prefetch_rows(cache.key_row(first + n), key_width, ahead, key_width);
        detail::prefetch_rows(cache.value_row(first + n), value_width, ahead, value_width);
      }
      detail::score(query, query_transposed, heads, head_dim, rows, key_width, n, logits, heads,
                    false);
      for (Index h = 0; h < heads && rank > 0; ++h) {
        detail::score_dot(query_latent + h * rank, rank, 1, rank, rows + head_dim + h * rank,
                          key_width, n, logits + h, heads, true);
      }
      if (key_norm) {
        for (Index t = 0; t < n; ++t) {
          const auto* rho = cache.rms_row(first + t);
          for (Index h = 0; h < heads; ++h) logits[t * heads + h] /= static_cast<T>(rho[h]);
        }
      }
      if (rope_dim > 0) {
        detail::score_dot(query_rope, rope_dim, heads, rope_dim, rows + head_dim + heads * rank,
                          key_width, n, logits, heads, true);
      }
    }

    void accumulate(Index, Index first, Index n, const T* weights, T* acc, T*) const {
      const S* rows = cache.value_row(first);
      const Index acc_stride = head_dim + rank;
      detail::accumulate(weights, heads, heads, rows, value_width, head_dim, n, acc, acc_stride);
      for (Index h = 0; h < heads && rank > 0; ++h) {
        detail::accumulate(weights + h, heads, 1, rows + head_dim + h * rank, value_width, rank, n,
                           acc + h * acc_stride + head_dim, acc_stride);
      }
    }
  };

  // The associative step for the newest token; ws.query / ws.query_rope hold its raw
  // projected query. Never throws: prepare() has sized everything.
  template <class S, class Workspace>
  void attend_prepared(const LrkvCache<T, S>& cache, Workspace& ws, const detail::SplitPlan& plan,
                       T* heads, int threads) const {
    const Index H = config_.n_heads;
    const Index dh = config_.head_dim;
    const Index r = config_.rank;
    const double position = static_cast<double>(config_.rope.position_offset + cache.tokens() - 1);
    finish_query(position, ws.query.data(), ws.query_latent.data(), ws.query_rope.data());
    Eigen::Map<RowMatrix<T>>(ws.query_transposed.data(), dh, H) =
        Eigen::Map<const RowMatrix<T>>(ws.query.data(), H, dh).transpose();
    const DecodeOps<S> ops{cache,
                           ws.query.data(),
                           ws.query_transposed.data(),
                           ws.query_latent.data(),
                           ws.query_rope.data(),
                           H,
                           dh,
                           r,
                           config_.decoupled_dim(),
                           key_width(),
                           dh + H * r,
                           config_.key_norm};
    detail::split_attention(plan, ws.split, ops, ws.acc.data());
    // o_h = a_h V_s + (a_h R_h^V)(B_h^V)^T: one r x d_h product per head, independent of L.
    detail::parallel_for(H, threads, [&](Index h) {
      auto out = Eigen::Map<RowVector<T>>(heads + h * dh, dh);
      out = ws.acc.row(h).head(dh);
      if (r > 0) {
        out.noalias() += ws.acc.row(h).tail(r) * weights_.b_v.middleCols(h * r, r).transpose();
      }
    });
  }

  // Flash-attention style causal factored attention of the L new tokens (at cache
  // indices past ... past+L-1) over the cache, per head: query tiles x key tiles with
  // a running maximum, normalizer and two accumulators (shared d_h, latent r).
  template <class S>
  void attend_tiled(const RowMatrix<T>& query, const RowMatrix<T>& query_latent,
                    const RowMatrix<T>& query_rope, const LrkvCache<T, S>& cache, Index past,
                    RowMatrix<T>& heads, int threads) const {
    constexpr Index tile = 64;
    constexpr T neg_inf = -std::numeric_limits<T>::infinity();
    const Index length = query.rows();
    const Index dh = config_.head_dim;
    const Index r = config_.rank;
    const Index dr = config_.decoupled_dim();
    const auto shared_keys = cache.shared_keys();
    const auto shared_values = cache.shared_values();
    const auto rope_keys = cache.rope_keys();
    const auto key_rms = cache.key_rms();
    // Query tiles are independent (each keeps its own online-softmax state), so
    // threads take whole query tiles, each with its own scratch.
    const Index query_tiles = (length + tile - 1) / tile;
    detail::parallel_for(query_tiles, threads, [&](Index query_tile) {
      const Index q0 = query_tile * tile;
      RowMatrix<T> scores(tile, tile);
      RowMatrix<T> acc(tile, dh), latent_acc(tile, r);
      RowVector<T> running_max(tile), normalizer(tile), rescale(tile);
      const Index q_rows = std::min(tile, length - q0);
      const Index key_end = past + q0 + q_rows;  // keys visible to the tile's last row
      for (Index h = 0; h < config_.n_heads; ++h) {
        const auto residual_keys = cache.residual_keys(h);
        const auto residual_values = cache.residual_values(h);
        const auto q_tile = query.block(q0, h * dh, q_rows, dh);
        const auto ql_tile = query_latent.block(q0, h * r, q_rows, r);
        const auto qr_tile = query_rope.block(q0, h * dr, q_rows, dr);
        acc.topRows(q_rows).setZero();
        latent_acc.topRows(q_rows).setZero();
        running_max.head(q_rows).setConstant(neg_inf);
        normalizer.head(q_rows).setZero();
        for (Index k0 = 0; k0 < key_end; k0 += tile) {
          const Index k_rows = std::min(tile, key_end - k0);
          auto s = scores.topLeftCorner(q_rows, k_rows);
          s.noalias() = q_tile * shared_keys.middleRows(k0, k_rows).template cast<T>().transpose();
          if (r > 0) {
            s.noalias() +=
                ql_tile * residual_keys.middleRows(k0, k_rows).template cast<T>().transpose();
          }
          if (config_.key_norm) {
            for (Index c = 0; c < k_rows; ++c) s.col(c) /= static_cast<T>(key_rms(k0 + c, h));
          }
          if (dr > 0) {
            s.noalias() +=
                qr_tile * rope_keys.middleRows(k0, k_rows).template cast<T>().transpose();
          }
          for (Index row = 0; row < q_rows; ++row) {
            const Index visible = past + q0 + row - k0 + 1;  // keys k0 ... past+q0+row
            T row_max = neg_inf;
            for (Index c = 0; c < k_rows; ++c) {
              if (c < visible) {
                row_max = std::max(row_max, s(row, c));
              } else {
                s(row, c) = neg_inf;
              }
            }
            const T new_max = std::max(running_max(row), row_max);
            if (new_max == neg_inf) {  // no visible key in this tile yet
              rescale(row) = T(1);
              s.row(row).setZero();
              continue;
            }
            rescale(row) = std::exp(running_max(row) - new_max);  // exp(-inf) = 0
            T row_sum = 0;
            for (Index c = 0; c < k_rows; ++c) {
              s(row, c) = std::exp(s(row, c) - new_max);
              row_sum += s(row, c);
            }
            normalizer(row) = normalizer(row) * rescale(row) + row_sum;
            running_max(row) = new_max;
          }
          acc.topRows(q_rows) = rescale.head(q_rows).asDiagonal() * acc.topRows(q_rows);
          latent_acc.topRows(q_rows) =
              rescale.head(q_rows).asDiagonal() * latent_acc.topRows(q_rows);
          if (k0 + k_rows <= past + q0 + 1) {  // every key of the tile is visible to every row
            acc.topRows(q_rows).noalias() +=
                s * shared_values.middleRows(k0, k_rows).template cast<T>();
            if (r > 0) {
              latent_acc.topRows(q_rows).noalias() +=
                  s * residual_values.middleRows(k0, k_rows).template cast<T>();
            }
          } else {
            // On the diagonal, row `row` reads only its visible values: a masked weight
            // is 0, but 0 * (a NaN in a later token's value) would still leak into it.
            for (Index row = 0; row < q_rows; ++row) {
              const Index visible = std::min(k_rows, past + q0 + row - k0 + 1);
              if (visible <= 0) continue;
              acc.row(row).noalias() += s.row(row).head(visible) *
                                        shared_values.middleRows(k0, visible).template cast<T>();
              if (r > 0) {
                latent_acc.row(row).noalias() +=
                    s.row(row).head(visible) *
                    residual_values.middleRows(k0, visible).template cast<T>();
              }
            }
          }
        }
        // o_h = (a_h V_s + (a_h R_h^V)(B_h^V)^T) / normalizer; each query sees itself.
        if (r > 0) {
          acc.topRows(q_rows).noalias() +=
              latent_acc.topRows(q_rows) * weights_.b_v.middleCols(h * r, r).transpose();
        }
        heads.block(q0, h * dh, q_rows, dh) =
            normalizer.head(q_rows).cwiseInverse().asDiagonal() * acc.topRows(q_rows);
      }
    });
  }

  LrkvConfig config_;
  LrkvWeights<T> weights_;
  Rope rope_;
  Rope latent_rope_;
  RowMatrix<T> b_k_gained_;  // diag(g) B^K (B^K without key_norm)
  T scale_ = T(1);
};

}  // namespace kvattn
