// LRKV (factored decode) as a benchmark mechanism (see bench_drivers.hpp).
#pragma once

#include <memory>
#include <random>
#include <string>

#include <kvattn/analysis/decode_cost.hpp>

#include <kvattn/attention/lrkv.hpp>

#include "bench_util.hpp"
#include "naive.hpp"

namespace kvb {

struct LrkvMech {
  using Layer = kvattn::LrkvLayer<float>;
  template <class S>
  using Cache = kvattn::LrkvCache<float, S>;
  template <class S>
  using PagedCache = kvattn::PagedLrkvCache<float, S>;
  struct Pool {
    Mat shared_keys, shared_values;      // rows x d_h
    Mat residual_keys, residual_values;  // rows x H*r
    Mat rope_keys;                       // rows x d_R (decoupled only)
    Mat key_rms;                         // rows x H (key_norm only)
  };

  using Naive = NaiveLrkv;

  std::string name;
  kvattn::LrkvConfig config;
  // The layer's DecodeArithmetic (decode_bf16dot/ rows: bf16_dot).
  kvattn::DecodeArithmetic arithmetic = kvattn::DecodeArithmetic::fp32;

  bool has_naive() const { return NaiveLrkv::supports(config); }
  /// The key and value rows every head reads (shared part and its residual slice, in
  /// rows of 2 (d_h + H r) elements): the whole cache but the key RMS.
  double block_bytes(Index L, std::size_t storage) const {
    return static_cast<double>(L) * 2.0 * (dh() + H() * r()) * static_cast<double>(storage);
  }
  Layer make_layer() const {
    Layer layer = Layer::random(config, 1);
    layer.set_decode_arithmetic(arithmetic);
    return layer;
  }
  template <class S>
  std::shared_ptr<kvattn::PagePool> make_page_pool(Index page_tokens, Index pages) const {
    return kvattn::make_lrkv_page_pool<S>(config, page_tokens, pages);
  }
  Index d_model() const { return config.d_model; }
  Index query_width() const { return config.n_heads * (config.head_dim + config.decoupled_dim()); }
  Index heads_width() const { return config.n_heads * config.head_dim; }
  double H() const { return static_cast<double>(config.n_heads); }
  double dh() const { return static_cast<double>(config.head_dim); }
  double r() const { return static_cast<double>(config.rank); }
  double dr() const { return static_cast<double>(config.decoupled_dim()); }
  double d() const { return static_cast<double>(config.d_model); }

  Pool make_pool(std::mt19937_64& rng, Index rows) const {
    const Index hr = config.n_heads * config.rank;
    Pool pool;
    pool.shared_keys = kvattn::random_normal<float>(rows, config.head_dim, rng);
    pool.shared_values = kvattn::random_normal<float>(rows, config.head_dim, rng);
    pool.residual_keys = kvattn::random_normal<float>(rows, hr, rng);
    pool.residual_values = kvattn::random_normal<float>(rows, hr, rng);
    pool.rope_keys = kvattn::random_normal<float>(rows, config.decoupled_dim(), rng);
    // A key RMS near 1, positive.
    const Index norms = config.key_norm ? config.n_heads : 0;
    pool.key_rms =
        (kvattn::random_normal<float>(rows, norms, rng, 0.1).array().abs() + 1.0f).matrix();
    return pool;
  }
  /// Appends the pool's rows cyclically until `cache` (contiguous or paged) holds L tokens.
  template <class C>
  void fill(C& cache, Index L, const Pool& pool) const {
    while (cache.sequence_length() < L) {
      const Index n = std::min(pool.shared_keys.rows(), L - cache.sequence_length());
      cache.append({pool.shared_keys.topRows(n), pool.shared_values.topRows(n),
                    pool.residual_keys.topRows(n), pool.residual_values.topRows(n),
                    pool.rope_keys.topRows(n), pool.key_rms.topRows(n)});
    }
  }
  /// The key rows [k~_s | r~_1..r~_H | k~_R], the value rows [v_s | r^V_1..r^V_H] and the
  /// key RMS (key_norm): 2 (d_h + H r) + d_R (+ H) elements per token.
  template <class S>
  void add_cache(ReadSet& set, const Cache<S>& cache) const {
    const auto tokens = static_cast<std::size_t>(cache.tokens());
    const auto hr = static_cast<std::size_t>(config.n_heads * config.rank);
    const auto dh_ = static_cast<std::size_t>(config.head_dim);
    const auto key_width = dh_ + hr + static_cast<std::size_t>(config.decoupled_dim());
    if constexpr (kvattn::detail::is_quantized_storage<S>) {  // codes + scales; bf16 rope apart
      set.add(cache.key_row(0), tokens * static_cast<std::size_t>(cache.key_row_stride()));
      set.add(cache.value_row(0), tokens * static_cast<std::size_t>(cache.value_row_stride()));
      if (config.decoupled_dim() > 0) {
        set.add(cache.rope_row(0), tokens * static_cast<std::size_t>(config.decoupled_dim()) *
                                       sizeof(typename Cache<S>::rope_type));
      }
    } else {
      set.add(cache.key_row(0), tokens * key_width * sizeof(S));
      set.add(cache.value_row(0), tokens * (dh_ + hr) * sizeof(S));
    }
    set.add(cache.rms_row(0), static_cast<std::size_t>(cache.key_rms().size()) *
                                  sizeof(typename Cache<S>::norm_type));
  }
  /// The factored step reads B^K (q~_h = q_h B_h^K) and B^V (o_h += (a_h R_h^V) B_h^V^T).
  void add_attend_weights(ReadSet& set, const Layer& layer) const {
    set.add_dense(layer.weights().basis_k);
    set.add_dense(layer.weights().basis_v);
  }
  void add_layer_weights(ReadSet& set, const Layer& layer) const {
    const auto& w = layer.weights();
    set.add_dense(w.w_q);
    set.add_dense(w.w_k_shared);
    set.add_dense(w.w_v_shared);
    set.add_dense(w.u_k);
    set.add_dense(w.u_v);
    set.add_dense(w.basis_k);
    set.add_dense(w.basis_v);
    set.add_dense(w.w_o);
    set.add_dense(w.w_qr);
    set.add_dense(w.w_kr);
    set.add_dense(w.key_norm_gain);
  }

  // Factored step (seed 000, Eqs. 6-7): per head q~_h = q_h B_h^K (2 d_h r) and
  // (a_h R_h^V) B_h^V^T (2 r d_h); per head and token q_h . k~_s,t (2 d_h) +
  // q~_h . r~_h,t (2 r) and a (v_s,t | r^V_h,t) (2 d_h + 2 r) (+ q^R . k~_R: 2 d_R).
  double attend_flops(Index L) const { return analysis_cost<float>(L).flops; }
  // The analysis module's bytes and FLOPs of the step (analysis/decode_cost.hpp): the
  // library's prediction, which the report sets beside the measurement.
  template <class S>
  kvattn::analysis::StepCost analysis_cost(Index L) const {
    return kvattn::analysis::attend_cost(config, L, kvattn::analysis::storage_of<S>());
  }
  // Expanded step (reference::decode_step): per head and token the residual key and value
  // R B^T (2 r d_h each), the value sum v_s + ... (d_h) and, without a rotated shared
  // channel, the key sum (d_h); then q.k at the model's width (d_h; 2 d_h for shared;
  // d_h + d_R for decoupled) and a * v (2 d_h).
  double expanded_flops(Index L) const {
    const bool shared = config.rope_mode == kvattn::LrkvRopeMode::shared;
    const double qk_width = shared ? 2.0 * dh() : dh() + dr();
    const double sums = shared ? dh() : 2.0 * dh();
    return static_cast<double>(L) * H() * (4.0 * r() * dh() + sums + 2.0 * qk_width + 2.0 * dh());
  }
  // Per token: x W_Q, x W_shared^K, x W_shared^V, x U^K, x U^V (x W_QR, x W_KR when
  // decoupled) and o W_O.
  double projection_flops() const {
    return 2.0 * d() * (H() * dh() + 2.0 * dh() + 2.0 * H() * r() + H() * dr() + dr()) +
           2.0 * H() * dh() * d();
  }
  double layer_flops(Index L) const { return projection_flops() + attend_flops(L + 1); }
  // Projections and the per-token latent query / B^V products of L tokens, then the
  // factored causal attention over L (L + 1) / 2 pairs.
  double prefill_flops(const Layer&, Index L) const {
    const double l = static_cast<double>(L);
    const double pairs = l * (l + 1.0) / 2.0;
    return l * (projection_flops() + 4.0 * H() * dh() * r()) +
           pairs * H() * (4.0 * dh() + 4.0 * r() + 2.0 * dr());
  }
};

/// d 4096, 32 heads, d_h 128, rank 54, RoPE on the shared channel (rope_mode shared,
/// half-split, theta 10000), no key norm.
inline LrkvMech lrkv_mech() {
  kvattn::LrkvConfig c;
  c.d_model = 4096;
  c.n_heads = 32;
  c.head_dim = 128;
  c.rank = 54;
  c.rope_mode = kvattn::LrkvRopeMode::shared;
  c.rope = {kvattn::RopeLayout::half_split, 10000.0, 0};
  c.key_norm = false;
  return {"lrkv", c};
}

}  // namespace kvb
