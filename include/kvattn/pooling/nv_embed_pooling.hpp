// The latent attention layer in the richer form of NV-Embed's released model
// (seed 002, Chapter 5 describes the plain form, latent_pooling.hpp):
//   Xn = LN_x(X), Dn = LN_d(D)                       LayerNorm of tokens and dictionary
//   o_h = softmax(s (Xn W_h^Q)(Dn W_h^K)^T) (Dn W_h^V)  keys and values: two projections
//                                                    of the one dictionary D (r x d)
//   H1 = [o_1 ... o_H] W_O + X                       output projection, residual
//   H2 = GEGLU-FF(LN_f(H1)) + H1                     FF(z) = (a .* GELU(g)) W_2 + b_2,
//                                                    [a | g] = z W_1 + b_1
//   e  = masked mean of H2, then e / ||e||_2 (when normalize_output)
// Attention projections have no bias; the feed-forward's linears do (PyTorch defaults).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <type_traits>

#include "kvattn/config/rules.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/random.hpp"
#include "kvattn/core/softmax.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/pooling/latent_pooling.hpp"
#include "kvattn/pooling/token_mask.hpp"

namespace kvattn {

/// Shape and options of the released-model form of NV-Embed's latent attention layer.
struct NvEmbedPoolingConfig {
  Index d_model = 0;             // d, token and dictionary width
  Index n_latents = 0;           // r, dictionary entries (NV-Embed: 512)
  Index n_heads = 1;             // H, cross-attention heads (NV-Embed: 8)
  Index head_dim = 0;            // d_k, per-head width of the projections; 0 means d / H
  Index ff_mult = 4;             // feed-forward hidden width is ff_mult * d
  double layer_norm_eps = 1e-5;  // epsilon of the three LayerNorms
  bool normalize_output = true;  // L2-normalize the pooled vector
  double softmax_scale = 0.0;    // 0 means 1/sqrt(d_k)

  Index key_dim() const { return head_dim > 0 ? head_dim : d_model / n_heads; }
  Index inner_dim() const { return n_heads * key_dim(); }
  Index ff_hidden() const { return ff_mult * d_model; }
  double scale() const { return detail::softmax_scale_or_default(softmax_scale, key_dim()); }

  void validate() const {
    constexpr const char* where = "NvEmbedPoolingConfig";
    detail::require(d_model >= 1, where, "d_model", d_model, "must be >= 1");
    detail::require(n_latents >= 1, where, "n_latents", n_latents, "must be >= 1");
    detail::require(n_heads >= 1, where, "n_heads", n_heads, "must be >= 1");
    detail::require(head_dim >= 0, where, "head_dim", head_dim, "must be >= 0 (0 means d / H)");
    detail::require(ff_mult >= 1, where, "ff_mult", ff_mult, "must be >= 1");
    constexpr Index max = std::numeric_limits<Index>::max();
    detail::require(ff_mult <= max / d_model, where, "ff_mult", ff_mult,
                    "times d_model must fit in a signed 64-bit integer");
    detail::require(head_dim <= max / n_heads, where, "head_dim", head_dim,
                    "times n_heads must fit in a signed 64-bit integer");
    if (head_dim == 0 && d_model % n_heads != 0) {
      throw config_error(std::string(where) + ": d_model (" + std::to_string(d_model) +
                         ") must be divisible by n_heads (" + std::to_string(n_heads) +
                         ") when head_dim is 0; or set head_dim");
    }
    if (!(layer_norm_eps > 0.0) || !std::isfinite(layer_norm_eps)) {
      throw config_error(std::string(where) + ": layer_norm_eps (" +
                         std::to_string(layer_norm_eps) + ") must be finite and > 0");
    }
    if (!(softmax_scale >= 0.0) || !std::isfinite(softmax_scale)) {
      throw config_error(std::string(where) + ": softmax_scale (" + std::to_string(softmax_scale) +
                         ") must be finite and >= 0 (0 selects 1/sqrt(head_dim))");
    }
  }
};

/// Weights (`in x out`, Y = X * W) of NvEmbedPooling.
template <class T>
struct NvEmbedPoolingWeights {
  RowMatrix<T> dictionary;                // D: r x d, the one latent array
  RowVector<T> norm_x_gain, norm_x_bias;  // LN_x: 1 x d each
  RowVector<T> norm_d_gain, norm_d_bias;  // LN_d: 1 x d each
  RowMatrix<T> w_q, w_k, w_v;             // d x (H * d_k) each
  RowMatrix<T> w_o;                       // (H * d_k) x d
  RowVector<T> norm_f_gain, norm_f_bias;  // LN_f: 1 x d each
  RowMatrix<T> w_1;                       // d x (2 * m), m = ff_mult * d: [a | gate]
  RowVector<T> b_1;                       // 1 x (2 * m)
  RowMatrix<T> w_2;                       // m x d
  RowVector<T> b_2;                       // 1 x d

  /// Dictionary from N(0, 1) (torch.randn, as the released model); LayerNorm gains
  /// 1 + N(0, 0.1^2) and biases N(0, 0.1^2); linears N(0, 1/fan_in), FF biases N(0, 0.1^2).
  static NvEmbedPoolingWeights random(const NvEmbedPoolingConfig& c, std::uint64_t seed) {
    c.validate();
    std::mt19937_64 rng(seed);
    const Index d = c.d_model, inner = c.inner_dim(), m = c.ff_hidden();
    auto gain = [&] {
      return RowVector<T>((random_normal<T>(1, d, rng, 0.1).array() + T(1)).matrix());
    };
    auto bias = [&](Index n) { return RowVector<T>(random_normal<T>(1, n, rng, 0.1)); };
    NvEmbedPoolingWeights w;
    w.dictionary = random_normal<T>(c.n_latents, d, rng);
    w.norm_x_gain = gain();
    w.norm_x_bias = bias(d);
    w.norm_d_gain = gain();
    w.norm_d_bias = bias(d);
    w.w_q = random_weight<T>(d, inner, rng);
    w.w_k = random_weight<T>(d, inner, rng);
    w.w_v = random_weight<T>(d, inner, rng);
    w.w_o = random_weight<T>(inner, d, rng);
    w.norm_f_gain = gain();
    w.norm_f_bias = bias(d);
    w.w_1 = random_weight<T>(d, 2 * m, rng);
    w.b_1 = bias(2 * m);
    w.w_2 = random_weight<T>(m, d, rng);
    w.b_2 = bias(d);
    return w;
  }

  /// Throws shape_error unless every matrix matches `c`.
  void check(const NvEmbedPoolingConfig& c) const {
    constexpr const char* where = "NvEmbedPoolingWeights";
    const Index d = c.d_model, inner = c.inner_dim(), m = c.ff_hidden();
    detail::check_shape(where, "dictionary", dictionary, c.n_latents, d);
    for (const auto* v : {&norm_x_gain, &norm_x_bias, &norm_d_gain, &norm_d_bias, &norm_f_gain,
                          &norm_f_bias, &b_2}) {
      detail::check_shape(where, "a LayerNorm gain/bias or b_2", *v, 1, d);
    }
    detail::check_shape(where, "w_q", w_q, d, inner);
    detail::check_shape(where, "w_k", w_k, d, inner);
    detail::check_shape(where, "w_v", w_v, d, inner);
    detail::check_shape(where, "w_o", w_o, inner, d);
    detail::check_shape(where, "w_1", w_1, d, 2 * m);
    detail::check_shape(where, "b_1", b_1, 1, 2 * m);
    detail::check_shape(where, "w_2", w_2, m, d);
  }
};

namespace detail {

/// LayerNorm of every row: (x - mean) / sqrt(var + eps) .* gain + bias (biased variance).
template <class T>
RowMatrix<T> layer_norm_rows(const ConstMatrixRef<T>& x, const RowVector<T>& gain,
                             const RowVector<T>& bias, double eps) {
  RowMatrix<T> out(x.rows(), x.cols());
  for (Index i = 0; i < x.rows(); ++i) {
    const T mean = x.row(i).mean();
    const RowVector<T> centered = x.row(i).array() - mean;
    const T inv =
        T(1) / std::sqrt(centered.squaredNorm() / static_cast<T>(x.cols()) + static_cast<T>(eps));
    out.row(i) = (centered * inv).cwiseProduct(gain) + bias;
  }
  return out;
}

}  // namespace detail

/// NV-Embed's latent attention layer as released. Immutable after construction.
template <class T>
class NvEmbedPooling {
 public:
  using scalar_type = T;

  NvEmbedPooling(const NvEmbedPoolingConfig& config, NvEmbedPoolingWeights<T> weights)
      : config_(config), weights_(std::move(weights)) {
    config_.validate();
    weights_.check(config_);
  }

  static NvEmbedPooling random(const NvEmbedPoolingConfig& config, std::uint64_t seed) {
    return NvEmbedPooling(config, NvEmbedPoolingWeights<T>::random(config, seed));
  }

  const NvEmbedPoolingConfig& config() const { return config_; }
  const NvEmbedPoolingWeights<T>& weights() const { return weights_; }

  /// Per-token outputs H2 (L x d), before pooling. x: L x d, L >= 1.
  RowMatrix<T> token_outputs(const ConstMatrixRef<std::type_identity_t<T>>& x) const {
    detail::check_pool_input("NvEmbedPooling::token_outputs", x, config_.d_model, {});
    return forward(x);
  }

  /// The embedding: masked mean of H2, L2-normalized when normalize_output. 1 x d.
  RowVector<T> pool(const ConstMatrixRef<std::type_identity_t<T>>& x,
                    const TokenMask& mask = {}) const {
    const Index count = detail::check_pool_input("NvEmbedPooling::pool", x, config_.d_model, mask);
    const RowMatrix<T> y = forward(x);
    RowVector<T> sum = RowVector<T>::Zero(config_.d_model);
    for (Index i = 0; i < x.rows(); ++i) {
      if (detail::kept(mask, i)) sum += y.row(i);
    }
    sum /= static_cast<T>(count);
    if (config_.normalize_output) {
      const T norm = sum.norm();
      if (norm > T(0)) sum /= norm;  // F.normalize leaves a zero vector at zero
    }
    return sum;
  }

 private:
  RowMatrix<T> forward(const ConstMatrixRef<T>& x) const {
    const NvEmbedPoolingWeights<T>& w = weights_;
    const double eps = config_.layer_norm_eps;
    const Index dk = config_.key_dim(), m = config_.ff_hidden();
    const RowMatrix<T> xn = detail::layer_norm_rows<T>(x, w.norm_x_gain, w.norm_x_bias, eps);
    const RowMatrix<T> dn =
        detail::layer_norm_rows<T>(w.dictionary, w.norm_d_gain, w.norm_d_bias, eps);
    const RowMatrix<T> q = xn * w.w_q, k = dn * w.w_k, v = dn * w.w_v;
    RowMatrix<T> heads(x.rows(), config_.inner_dim());
    for (Index h = 0; h < config_.n_heads; ++h) {
      RowMatrix<T> p = static_cast<T>(config_.scale()) *
                       (q.middleCols(h * dk, dk) * k.middleCols(h * dk, dk).transpose());
      softmax_rows_inplace(p);
      heads.middleCols(h * dk, dk) = p * v.middleCols(h * dk, dk);
    }
    const RowMatrix<T> h1 = heads * w.w_o + x;
    RowMatrix<T> z = detail::layer_norm_rows<T>(h1, w.norm_f_gain, w.norm_f_bias, eps) * w.w_1;
    z.rowwise() += w.b_1;
    const RowMatrix<T> gated =
        z.leftCols(m).cwiseProduct(z.rightCols(m).unaryExpr([](T g) { return gelu(g); }));
    RowMatrix<T> h2 = gated * w.w_2 + h1;
    h2.rowwise() += w.b_2;
    return h2;
  }

  NvEmbedPoolingConfig config_;
  NvEmbedPoolingWeights<T> weights_;
};

}  // namespace kvattn
