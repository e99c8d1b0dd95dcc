// Head diversity in bilinear-form space (seed 000, "Head diversity is measured in
// bilinear-form space" and "LRKV approaches the centered-rank ceiling").
//
// Head h scores token pairs with the bilinear form x_i^T A_h x_j, A_h = W_h^Q (W_h^K)^T
// (d x d). Two heads are alike when their operators point the same way, so the
// diversity of a layer is read from the Gram matrix of the Frobenius-normalized
// operators,
//   G_hg = <A_h, A_g>_F / (||A_h||_F ||A_g||_F),
// and its centered form J G J (J = I - 11^T/H, the Gram of the operators minus their
// mean). The effective rank of a PSD matrix with eigenvalues l_i >= 0 (clamped at 0)
// is exp(-sum p_i ln p_i), p_i = l_i / sum l. H mutually orthogonal operators give
// rank H uncentered and H - 1 centered: the centered ceiling (H-1)/H is 83.33% for
// H = 6 and 94.44% for H = 18.
//
// The Gram entries come from traces of d_k x d_k products,
//   <A_h, A_g>_F = tr((W_h^Q^T W_g^Q) (W_g^K^T W_h^K)),
// so no d x d operator is ever formed (at d = 4096, H = 32 they would take 2 GB).
//
// Scope: the operators are the layer's content scores at relative position 0. RoPE's
// position-dependent rotation, RMSNorm's per-token 1/rms and biases are not part of
// A_h; RMSNorm gains are (they are fixed diagonal maps).
#pragma once

#include <cmath>
#include <limits>
#include <string>

#include <Eigen/Eigenvalues>

#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn::analysis {

/// The diversity of a layer's H head operators.
struct HeadDiversity {
  Index n_heads = 0;                     // H
  RowMatrix<double> gram;                // H x H, G of the normalized operators (unit diagonal)
  RowMatrix<double> centered_gram;       // H x H, J G J
  double effective_rank = 0.0;           // of G, in [1, H]
  double centered_effective_rank = 0.0;  // of J G J, in [0, H - 1] (0: identical heads)

  /// effective_rank / H in percent.
  double effective_rank_percent() const { return 100.0 * effective_rank / n_heads; }
  /// centered_effective_rank / H in percent; at most 100 (H - 1) / H.
  double centered_effective_rank_percent() const {
    return 100.0 * centered_effective_rank / n_heads;
  }
};

/// exp(-sum p_i ln p_i) over the eigenvalues l_i of a symmetric matrix (n x n), clamped
/// at 0, with p_i = l_i / sum l and 0 ln 0 = 0. Returns 0 when every eigenvalue is 0, and
/// NaN when the matrix holds a NaN or an infinity (a bad input shows; it never reads as
/// rank 0).
inline double effective_rank(const RowMatrix<double>& symmetric) {
  kvattn::detail::check_shape("analysis::effective_rank", "matrix", symmetric, symmetric.cols(),
                              -1);
  if (symmetric.rows() == 0) return 0.0;
  if (!symmetric.allFinite()) return std::numeric_limits<double>::quiet_NaN();
  const Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> solver(symmetric, Eigen::EigenvaluesOnly);
  const Eigen::VectorXd lambda = solver.eigenvalues().cwiseMax(0.0);
  const double total = lambda.sum();
  // Round-off leaves eigenvalues of order eps * ||M|| where the exact value is 0;
  // below that floor they count as 0 (an all-zero matrix has rank 0).
  const double floor = 1e-12 * std::max(1.0, symmetric.cwiseAbs().maxCoeff()) *
                       static_cast<double>(symmetric.rows());
  if (!(total > floor)) return 0.0;
  double entropy = 0.0;
  for (Index i = 0; i < lambda.size(); ++i) {
    const double p = lambda(i) / total;
    if (p > 0.0) entropy -= p * std::log(p);
  }
  return std::exp(entropy);
}

/// Unnormalized Gram <A_h, A_g>_F (H x H) of the operators A_h = Q_h K_h^T, where
/// Q_h = query_maps.middleCols(h k, k) and K_h = key_maps.middleCols(h k, k):
///   query_maps  d x (H * k)
///   key_maps    d x (H * k)
/// Computed as sum((Q_h^T Q_g) .* (K_h^T K_g)) = tr((Q_h^T Q_g)(K_g^T K_h)).
inline RowMatrix<double> operator_gram(const ConstMatrixRef<double>& query_maps,
                                       const ConstMatrixRef<double>& key_maps, Index n_heads) {
  constexpr const char* where = "analysis::operator_gram";
  kvattn::detail::require(n_heads >= 1, where, "n_heads", n_heads, "must be >= 1");
  if (query_maps.cols() % n_heads != 0) {
    throw shape_error(std::string(where) + ": query_maps has shape " +
                      kvattn::detail::shape_text(query_maps.rows(), query_maps.cols()) +
                      ", expected (d x H * k) with H = " + std::to_string(n_heads));
  }
  kvattn::detail::check_shape(where, "key_maps", key_maps, query_maps.rows(), query_maps.cols());
  const Index k = query_maps.cols() / n_heads;
  const RowMatrix<double> qq = query_maps.transpose() * query_maps;  // (Hk) x (Hk)
  const RowMatrix<double> kk = key_maps.transpose() * key_maps;
  RowMatrix<double> gram(n_heads, n_heads);
  for (Index h = 0; h < n_heads; ++h) {
    for (Index g = h; g < n_heads; ++g) {
      const double value =
          qq.block(h * k, g * k, k, k).cwiseProduct(kk.block(h * k, g * k, k, k)).sum();
      gram(h, g) = value;
      gram(g, h) = value;
    }
  }
  return gram;
}

/// The diversity of H heads given their query and key maps (shapes as operator_gram).
/// Throws config_error when a head's operator is zero (it has no direction) or not
/// finite (a NaN or an infinity in the weights).
inline HeadDiversity head_diversity(const ConstMatrixRef<double>& query_maps,
                                    const ConstMatrixRef<double>& key_maps, Index n_heads) {
  const RowMatrix<double> raw = operator_gram(query_maps, key_maps, n_heads);
  Eigen::VectorXd norm = raw.diagonal().cwiseMax(0.0).cwiseSqrt();
  for (Index h = 0; h < n_heads; ++h) {  // a NaN weight shows, never as "zero operator"
    if (!std::isfinite(raw(h, h))) {
      throw config_error("analysis::head_diversity: head " + std::to_string(h) +
                         "'s operator W_h^Q W_h^K^T is not finite (squared norm " +
                         std::to_string(raw(h, h)) + "): the weights hold a NaN or an infinity");
    }
  }
  for (Index h = 0; h < n_heads; ++h) {
    kvattn::detail::require(norm(h) > 0.0, "analysis::head_diversity", "head", h,
                            "has a zero operator W_h^Q W_h^K^T; it has no direction to compare");
  }
  HeadDiversity result;
  result.n_heads = n_heads;
  result.gram = raw.array() / (norm * norm.transpose()).array();
  const RowMatrix<double> j =
      RowMatrix<double>::Identity(n_heads, n_heads).array() - 1.0 / static_cast<double>(n_heads);
  result.centered_gram = j * result.gram * j;
  result.effective_rank = effective_rank(result.gram);
  result.centered_effective_rank = effective_rank(result.centered_gram);
  return result;
}

/// MHA / GQA / MQA: A_h = W_h^Q (W_{g(h)}^K)^T, g(h) = h / (H / n_kv).
template <class T>
HeadDiversity head_diversity(const GqaLayer<T>& layer) {
  const GqaConfig& c = layer.config();
  const GqaWeights<T>& w = layer.weights();
  const Index dh = c.head_dim;
  RowMatrix<double> keys(c.d_model, c.n_heads * dh);
  for (Index h = 0; h < c.n_heads; ++h) {
    keys.middleCols(h * dh, dh) =
        w.w_k.middleCols((h / c.group_size()) * dh, dh).template cast<double>();
  }
  return head_diversity(w.w_q.template cast<double>(), keys, c.n_heads);
}

/// MLA through its absorbed maps: A_h = W_h^{Q,nope} (W^DKV diag(g) W_h^UK)^T +
/// W_h^{Q,R} (W^KR)^T, with W^Q = W^DQ diag(g_q) W^UQ when queries are compressed.
template <class T>
HeadDiversity head_diversity(const MlaLayer<T>& layer) {
  const MlaConfig& c = layer.config();
  const MlaWeights<T>& w = layer.weights();
  const Index dn = c.qk_nope_dim, dr = c.rope_dim, qd = c.qk_head_dim();
  RowMatrix<double> wq;
  if (c.q_rank > 0) {
    RowMatrix<double> down = w.w_dq.template cast<double>();
    if (c.q_norm) down = down * w.q_norm_gain.template cast<double>().asDiagonal();
    wq = down * w.w_uq.template cast<double>();
  } else {
    wq = w.w_q.template cast<double>();
  }
  RowMatrix<double> dkv = w.w_dkv.template cast<double>();
  if (c.kv_norm) dkv = dkv * w.kv_norm_gain.template cast<double>().asDiagonal();
  const RowMatrix<double> k_nope = dkv * w.w_uk.template cast<double>();  // d x H d_nope
  RowMatrix<double> keys(c.d_model, c.n_heads * qd);
  for (Index h = 0; h < c.n_heads; ++h) {
    keys.middleCols(h * qd, dn) = k_nope.middleCols(h * dn, dn);
    keys.middleCols(h * qd + dn, dr) = w.w_kr.template cast<double>();
  }
  return head_diversity(wq, keys, c.n_heads);
}

/// LRKV: A_h = W_h^Q (W_shared^K + U_h^K B_h^K^T)^T (times the key-norm gain g when
/// key_norm is on), plus W_h^QR (W^KR)^T with a decoupled rope channel.
template <class T>
HeadDiversity head_diversity(const LrkvLayer<T>& layer) {
  const LrkvConfig& c = layer.config();
  const LrkvWeights<T>& w = layer.weights();
  const Index dh = c.head_dim, r = c.rank, dr = c.decoupled_dim(), k = dh + dr;
  RowMatrix<double> queries(c.d_model, c.n_heads * k);
  RowMatrix<double> keys(c.d_model, c.n_heads * k);
  for (Index h = 0; h < c.n_heads; ++h) {
    RowMatrix<double> key = w.w_k_shared.template cast<double>();
    if (r > 0) {
      key += w.u_k.middleCols(h * r, r).template cast<double>() *
             w.basis_k.middleCols(h * r, r).template cast<double>().transpose();
    }
    if (c.key_norm) key = key * w.key_norm_gain.template cast<double>().asDiagonal();
    queries.middleCols(h * k, dh) = w.w_q.middleCols(h * dh, dh).template cast<double>();
    keys.middleCols(h * k, dh) = key;
    if (dr > 0) {
      queries.middleCols(h * k + dh, dr) = w.w_qr.middleCols(h * dr, dr).template cast<double>();
      keys.middleCols(h * k + dh, dr) = w.w_kr.template cast<double>();
    }
  }
  return head_diversity(queries, keys, c.n_heads);
}

}  // namespace kvattn::analysis
