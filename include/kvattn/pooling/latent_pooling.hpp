// NV-Embed's latent attention pooling layer (seed 002, Chapter 5).
//
// A trained dictionary D (r x d) serves as both keys and values: one matrix in
// memory, K = V = D. Every token (a query) cross-attends to the dictionary, H heads
// each on its own width-d/H slice of tokens and dictionary:
//   P_h = softmax(scale * X_h D_h^T)          L x r, rows sum to 1
//   O   = [P_1 D_1 | ... | P_H D_H]           L x d
// then an MLP, Y = GELU(O W_1 + b_1) W_2 + b_2, and the mean of Y over the kept
// tokens is the embedding. With one head, scale 1, X = [[2,0],[0,2]] and D = I the
// rows of P are [0.8808, 0.1192] and [0.1192, 0.8808] and mean(O) = [0.5, 0.5]
// (the seed's toy example).
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>

#include "kvattn/config/rules.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/random.hpp"
#include "kvattn/core/softmax.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/pooling/token_mask.hpp"

namespace kvattn {

/// Shape and options of a latent attention pooling layer.
struct LatentPoolingConfig {
  Index d_model = 0;           // d, width of tokens and of dictionary entries (NV-Embed: 4096)
  Index n_latents = 0;         // r, dictionary entries (NV-Embed: 512)
  Index n_heads = 1;           // H, cross-attention heads; divides d (NV-Embed: 8)
  Index mlp_hidden = 0;        // hidden width of the MLP; 0 means d
  bool mlp = true;             // apply the MLP (linear, GELU, linear) after the attention
  double softmax_scale = 0.0;  // 0 means 1/sqrt(d/H); 1 is the seed's unscaled toy

  /// Width of one head's slice, d / H.
  Index head_dim() const { return d_model / n_heads; }
  /// The MLP's hidden width: mlp_hidden, or d when it is 0.
  Index hidden() const { return mlp_hidden > 0 ? mlp_hidden : d_model; }
  /// The scale applied to token . entry: softmax_scale, or 1/sqrt(d/H) when it is 0.
  double scale() const { return detail::softmax_scale_or_default(softmax_scale, head_dim()); }
  /// Trainable numbers in the dictionary, r * d (NV-Embed: 2,097,152).
  Index dictionary_parameters() const { return n_latents * d_model; }

  void validate() const {
    constexpr const char* where = "LatentPoolingConfig";
    detail::require(d_model >= 1, where, "d_model", d_model, "must be >= 1");
    detail::require(n_latents >= 1, where, "n_latents", n_latents, "must be >= 1");
    detail::require(n_heads >= 1, where, "n_heads", n_heads, "must be >= 1");
    detail::require(mlp_hidden >= 0, where, "mlp_hidden", mlp_hidden,
                    "must be >= 0 (0 means d_model)");
    if (d_model % n_heads != 0) {
      throw config_error(std::string(where) + ": d_model (" + std::to_string(d_model) +
                         ") must be divisible by n_heads (" + std::to_string(n_heads) +
                         "); each head attends on a d_model / n_heads slice");
    }
    if (!(softmax_scale >= 0.0) || !std::isfinite(softmax_scale)) {
      throw config_error(std::string(where) + ": softmax_scale (" + std::to_string(softmax_scale) +
                         ") must be finite and >= 0 (0 selects 1/sqrt(d_model / n_heads))");
    }
  }

  bool operator==(const LatentPoolingConfig&) const = default;
};

/// Trainable weights (`in x out`, Y = X * W). The dictionary is the only key and the
/// only value matrix: K = V is one r x d matrix, not two copies.
template <class T>
struct LatentPoolingWeights {
  RowMatrix<T> dictionary;  // r x d, keys and values (K = V)
  RowMatrix<T> w_1;         // d x m, first MLP layer      (mlp; m = hidden())
  RowVector<T> b_1;         // 1 x m                       (mlp)
  RowMatrix<T> w_2;         // m x d, second MLP layer     (mlp)
  RowVector<T> b_2;         // 1 x d                       (mlp)

  /// Dictionary entries from N(0, 1) (unit-scale rows, like the tokens they match);
  /// MLP weights from N(0, 1/fan_in), biases from N(0, 0.1^2).
  static LatentPoolingWeights random(const LatentPoolingConfig& config, std::uint64_t seed) {
    config.validate();
    std::mt19937_64 rng(seed);
    LatentPoolingWeights w;
    w.dictionary = random_normal<T>(config.n_latents, config.d_model, rng);
    if (config.mlp) {
      w.w_1 = random_weight<T>(config.d_model, config.hidden(), rng);
      w.b_1 = random_normal<T>(1, config.hidden(), rng, 0.1);
      w.w_2 = random_weight<T>(config.hidden(), config.d_model, rng);
      w.b_2 = random_normal<T>(1, config.d_model, rng, 0.1);
    }
    return w;
  }

  /// Throws shape_error unless every matrix matches `config`.
  void check(const LatentPoolingConfig& config) const {
    constexpr const char* where = "LatentPoolingWeights";
    detail::check_shape(where, "dictionary", dictionary, config.n_latents, config.d_model);
    const Index m = config.mlp ? config.hidden() : 0;
    const Index d = config.mlp ? config.d_model : 0;
    detail::check_shape(where, "w_1", w_1, d, m);
    detail::check_shape(where, "b_1", b_1, m == 0 ? -1 : 1, m);
    detail::check_shape(where, "w_2", w_2, m, d);
    detail::check_shape(where, "b_2", b_2, d == 0 ? -1 : 1, d);
  }
};

/// GELU, exact form x * Phi(x) = x/2 * (1 + erf(x / sqrt 2)) (PyTorch's nn.GELU()).
template <class T>
T gelu(T x) {
  return static_cast<T>(0.5) * x * (T(1) + std::erf(x / std::sqrt(T(2))));
}

/// The latent attention pooling layer. Immutable after construction.
template <class T>
class LatentPooling {
 public:
  using scalar_type = T;

  /// Validates the config and the weights' shapes (config_error / shape_error).
  LatentPooling(const LatentPoolingConfig& config, LatentPoolingWeights<T> weights)
      : config_(config), weights_(std::move(weights)) {
    config_.validate();
    weights_.check(config_);
  }

  /// A layer with LatentPoolingWeights<T>::random(config, seed).
  static LatentPooling random(const LatentPoolingConfig& config, std::uint64_t seed) {
    return LatentPooling(config, LatentPoolingWeights<T>::random(config, seed));
  }

  const LatentPoolingConfig& config() const { return config_; }
  const LatentPoolingWeights<T>& weights() const { return weights_; }

  /// Head h's keys and values: the same r x d/H slice of the one dictionary.
  auto keys(Index head) const {
    check_head(head, "LatentPooling::keys");
    return weights_.dictionary.middleCols(head * config_.head_dim(), config_.head_dim());
  }
  auto values(Index head) const { return keys(head); }

  /// Head h's attention of every token over the dictionary, P_h (L x r, rows sum to 1).
  ///   x  L x d, L >= 1
  RowMatrix<T> attention_weights(const ConstMatrixRef<std::type_identity_t<T>>& x,
                                 Index head) const {
    detail::check_pool_input("LatentPooling::attention_weights", x, config_.d_model, {});
    check_head(head, "LatentPooling::attention_weights");
    return probabilities(x, head);
  }

  /// The cross-attention output O = [P_1 D_1 | ... | P_H D_H] (L x d), before the MLP.
  RowMatrix<T> cross_attention(const ConstMatrixRef<std::type_identity_t<T>>& x) const {
    detail::check_pool_input("LatentPooling::cross_attention", x, config_.d_model, {});
    return attend(x);
  }

  /// Per-token outputs Y (L x d): the cross-attention followed by the MLP (when enabled).
  RowMatrix<T> token_outputs(const ConstMatrixRef<std::type_identity_t<T>>& x) const {
    detail::check_pool_input("LatentPooling::token_outputs", x, config_.d_model, {});
    return mlp(attend(x));
  }

  /// The embedding: the mean of Y over the kept tokens. Returns 1 x d.
  ///   x     L x d, L >= 1
  ///   mask  L flags (true: pooled), or empty for every token; masked tokens are not
  ///         averaged in. (They cannot shape the others here: the layer is per-token.)
  RowVector<T> pool(const ConstMatrixRef<std::type_identity_t<T>>& x,
                    const TokenMask& mask = {}) const {
    return token_contributions(x, mask).colwise().sum();
  }

  /// Each token's term in the pooled sum: row i is Y_i / |M| for kept tokens and 0
  /// otherwise, so the rows add up to pool(x, mask). Returns L x d.
  RowMatrix<T> token_contributions(const ConstMatrixRef<std::type_identity_t<T>>& x,
                                   const TokenMask& mask = {}) const {
    const Index count = detail::check_pool_input("LatentPooling::pool", x, config_.d_model, mask);
    RowMatrix<T> y = mlp(attend(x));
    for (Index i = 0; i < x.rows(); ++i) {
      if (detail::kept(mask, i)) {
        y.row(i) /= static_cast<T>(count);
      } else {
        y.row(i).setZero();
      }
    }
    return y;
  }

  /// Dictionary usage of a document: row h is head h's attention mass summed over
  /// the kept tokens, per dictionary entry (H x r; each row sums to |M|).
  RowMatrix<T> dictionary_usage(const ConstMatrixRef<std::type_identity_t<T>>& x,
                                const TokenMask& mask = {}) const {
    detail::check_pool_input("LatentPooling::dictionary_usage", x, config_.d_model, mask);
    RowMatrix<T> usage = RowMatrix<T>::Zero(config_.n_heads, config_.n_latents);
    for (Index h = 0; h < config_.n_heads; ++h) {
      const RowMatrix<T> p = probabilities(x, h);
      for (Index i = 0; i < x.rows(); ++i) {
        if (detail::kept(mask, i)) usage.row(h) += p.row(i);
      }
    }
    return usage;
  }

 private:
  void check_head(Index head, const char* where) const {
    detail::require(head >= 0 && head < config_.n_heads, where, "head", head,
                    "must be in [0, n_heads = " + std::to_string(config_.n_heads) + ")");
  }

  RowMatrix<T> probabilities(const ConstMatrixRef<T>& x, Index head) const {
    const Index dh = config_.head_dim();
    RowMatrix<T> p =
        static_cast<T>(config_.scale()) * (x.middleCols(head * dh, dh) * keys(head).transpose());
    softmax_rows_inplace(p);
    return p;
  }

  RowMatrix<T> attend(const ConstMatrixRef<T>& x) const {
    const Index dh = config_.head_dim();
    RowMatrix<T> out(x.rows(), config_.d_model);
    for (Index h = 0; h < config_.n_heads; ++h) {
      out.middleCols(h * dh, dh) = probabilities(x, h) * values(h);
    }
    return out;
  }

  RowMatrix<T> mlp(RowMatrix<T> o) const {
    if (!config_.mlp) return o;
    RowMatrix<T> hidden = o * weights_.w_1;
    hidden.rowwise() += weights_.b_1;
    hidden = hidden.unaryExpr([](T v) { return gelu(v); });
    RowMatrix<T> y = hidden * weights_.w_2;
    y.rowwise() += weights_.b_2;
    return y;
  }

  LatentPoolingConfig config_;
  LatentPoolingWeights<T> weights_;
};

}  // namespace kvattn
