// The weights of an LRKV layer (seed 000, Eqs. 2-3): their layout, seeded
// initialization, shape checks and the structure rope_mode commuting needs.
//
// Shapes (weights `in x out`, Y = X * W):
//   w_q          d x (H * d_h)         W_h^Q, head h in columns [h*d_h, (h+1)*d_h)
//   w_k_shared   d x d_h               W_shared^K        w_v_shared  d x d_h   W_shared^V
//   u_k, u_v     d x (H * r)           U_h^{K,V}, head h in columns [h*r, (h+1)*r)
//   basis_k,     d_h x (H * r)         B_h^{K,V} (seed orientation d_h x r), same columns:
//   basis_v                            head h's residual key is r_h,t (B_h^K)^T
//   w_o          (H * d_h) x d         output projection
//   w_qr         d x (H * d_R)         W_QR, decoupled RoPE only (else d x 0)
//   w_kr         d x d_R               W_KR, decoupled RoPE only (else d x 0)
//   key_norm_gain 1 x d_h              g, key_norm only (else 1 x 0)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kvattn/config/lrkv_config.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/random.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn {

namespace detail {

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
std::vector<Index> lrkv_latent_planes(const LrkvConfig& config, const RowMatrix<T>& basis_k) {
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
        if (basis_k(i, c0) != T(0) || basis_k(i, c1) != T(0)) first = i;
      }
      const Index plane = first < 0 ? 0 : rope_plane_of(layout, dh, first);
      const auto [a, b] = rope_plane_dims(layout, dh, plane);
      bool ok = basis_k(a, c0) == basis_k(b, c1) && basis_k(a, c1) == -basis_k(b, c0);
      for (Index i = 0; i < dh && ok; ++i) {
        if (i != a && i != b && (basis_k(i, c0) != T(0) || basis_k(i, c1) != T(0))) ok = false;
      }
      if (!ok) {
        throw config_error(
            "LrkvWeights: rope_mode commuting needs each latent pair of B_h^K to map into one "
            "rotary plane by a scaled rotation [[c, -s], [s, c]] (rows of that plane only), so "
            "that P_t B_h^K = B_h^K P~_t; head " +
            std::to_string(h) + ", latent pair (" + std::to_string(2 * j) + ", " +
            std::to_string(2 * j + 1) + ") (basis_k columns " + std::to_string(c0) + ", " +
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
  RowMatrix<T> basis_k;        // B_h^K, all heads: d_h x (H * r)
  RowMatrix<T> basis_v;        // B_h^V, all heads: d_h x (H * r)
  RowMatrix<T> w_o;            // W_O: (H * d_h) x d
  RowMatrix<T> w_qr;           // W_QR: d x (H * d_R), decoupled only (else d x 0)
  RowMatrix<T> w_kr;           // W_KR: d x d_R, decoupled only (else d x 0)
  RowVector<T> key_norm_gain;  // g: 1 x d_h, key_norm only (else 1 x 0)
  RowVector<T> sinks;          // 1 x H, the per-head sink logits (sink_logits only, else empty)

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
      w.basis_k = RowMatrix<T>::Zero(dh, H * r);
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
          w.basis_k(a, c0) = static_cast<T>(s * std::cos(phi));
          w.basis_k(b, c0) = static_cast<T>(s * std::sin(phi));
          w.basis_k(a, c0 + 1) = -w.basis_k(b, c0);
          w.basis_k(b, c0 + 1) = w.basis_k(a, c0);
        }
      }
    } else {
      w.basis_k = random_normal<T>(dh, H * r, rng, b_std);
    }
    w.basis_v = random_normal<T>(dh, H * r, rng, b_std);
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
      rescale_residual(w.u_k, w.basis_k, w.w_k_shared, h, r, residual_scale);
      rescale_residual(w.u_v, w.basis_v, w.w_v_shared, h, r, residual_scale);
    }
    // Drawn last, so a config without sink logits keeps the weights it always had.
    if (config.sink_logits) w.sinks = random_normal<T>(1, config.n_heads, rng);
    return w;
  }

  /// The same weights in another scalar type (e.g. double for a reference).
  template <class U>
  LrkvWeights<U> cast() const {
    return {
        w_q.template cast<U>(),     w_k_shared.template cast<U>(),    w_v_shared.template cast<U>(),
        u_k.template cast<U>(),     u_v.template cast<U>(),           basis_k.template cast<U>(),
        basis_v.template cast<U>(), w_o.template cast<U>(),           w_qr.template cast<U>(),
        w_kr.template cast<U>(),    key_norm_gain.template cast<U>(), sinks.template cast<U>()};
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
    detail::check_shape(where, "basis_k", basis_k, dh, hr);
    detail::check_shape(where, "basis_v", basis_v, dh, hr);
    detail::check_shape(where, "w_o", w_o, config.n_heads * dh, d);
    detail::check_shape(where, "w_qr", w_qr, dr > 0 ? d : -1, config.n_heads * dr);
    detail::check_shape(where, "w_kr", w_kr, dr > 0 ? d : -1, dr);
    detail::check_shape(where, "key_norm_gain", key_norm_gain, config.key_norm ? 1 : -1,
                        config.key_norm ? dh : 0);
    detail::check_shape(where, "sinks", sinks, config.sink_logits ? 1 : -1,
                        config.sink_logits ? config.n_heads : 0);
    if (config.rope_mode == LrkvRopeMode::commuting) {
      (void)detail::lrkv_latent_planes(config, basis_k);
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

}  // namespace kvattn
