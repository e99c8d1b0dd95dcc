// MLA (absorbed decode) as a benchmark mechanism (see bench_drivers.hpp).
#pragma once

#include <memory>
#include <random>
#include <string>

#include <kvattn/analysis/decode_cost.hpp>

#include <kvattn/attention/mla.hpp>

#include "bench_util.hpp"
#include "naive.hpp"

namespace kvb {

struct MlaMech {
  using Layer = kvattn::MlaLayer<float>;
  template <class S>
  using Cache = kvattn::MlaCache<float, S>;
  template <class S>
  using PagedCache = kvattn::PagedMlaCache<float, S>;
  struct Pool {
    Mat latent;     // rows x d_c
    Mat rope_keys;  // rows x d_R
  };

  using Naive = NaiveMla;

  std::string name;
  kvattn::MlaConfig config;
  // The layer's DecodeArithmetic (decode_bf16dot/ rows: bf16_dot).
  kvattn::DecodeArithmetic arithmetic = kvattn::DecodeArithmetic::fp32;

  bool has_naive() const { return true; }
  /// The latent rows [c | k_R] every head reads: L (d_c + d_R) elements.
  double block_bytes(Index L, std::size_t storage) const {
    return static_cast<double>(L) * (dc() + dr()) * static_cast<double>(storage);
  }
  Layer make_layer() const {
    Layer layer = Layer::random(config, 1);
    layer.set_decode_arithmetic(arithmetic);
    return layer;
  }
  template <class S>
  std::shared_ptr<kvattn::PagePool> make_page_pool(Index page_tokens, Index pages) const {
    return kvattn::make_mla_page_pool<S>(config, page_tokens, pages);
  }
  Index d_model() const { return config.d_model; }
  Index query_width() const { return config.query_width(); }
  Index heads_width() const { return config.n_heads * config.v_dim; }
  double H() const { return static_cast<double>(config.n_heads); }
  double dc() const { return static_cast<double>(config.kv_rank); }
  double dr() const { return static_cast<double>(config.rope_dim); }
  double dn() const { return static_cast<double>(config.qk_nope_dim); }
  double dv() const { return static_cast<double>(config.v_dim); }
  double d() const { return static_cast<double>(config.d_model); }

  Pool make_pool(std::mt19937_64& rng, Index rows) const {
    return {kvattn::random_normal<float>(rows, config.kv_rank, rng),
            kvattn::random_normal<float>(rows, config.rope_dim, rng)};
  }
  /// Appends the pool's rows cyclically until `cache` (contiguous or paged) holds L tokens.
  template <class C>
  void fill(C& cache, Index L, const Pool& pool) const {
    while (cache.sequence_length() < L) {
      const Index n = std::min(pool.latent.rows(), L - cache.sequence_length());
      cache.append(pool.latent.topRows(n), pool.rope_keys.topRows(n));
    }
  }
  /// The latent rows [c_kv | k_R]: d_c + d_R elements per token (a quantized cache: the
  /// latents' codes and scales, and the bf16 rope keys beside them).
  template <class S>
  void add_cache(ReadSet& set, const Cache<S>& cache) const {
    if constexpr (Cache<S>::quantized) {
      const auto tokens = static_cast<std::size_t>(cache.tokens());
      set.add(cache.latent_row(0), tokens * static_cast<std::size_t>(cache.latent_stride()));
      set.add(cache.rope_row(0), tokens * static_cast<std::size_t>(cache.rope_stride()) *
                                     sizeof(typename Cache<S>::rope_storage));
    } else {
      set.add_dense(cache.rows());
    }
  }
  /// The absorbed step reads W_UK (q~_h = q_h^nope W_UK_h^T) and W_UV (o_h = o-bar_h W_UV_h).
  void add_attend_weights(ReadSet& set, const Layer& layer) const {
    set.add_dense(layer.weights().w_uk);
    set.add_dense(layer.weights().w_uv);
  }
  void add_layer_weights(ReadSet& set, const Layer& layer) const {
    const auto& w = layer.weights();
    set.add_dense(w.w_dq);
    set.add_dense(w.q_norm_gain);
    set.add_dense(w.w_uq);
    set.add_dense(w.w_q);
    set.add_dense(w.w_dkv);
    set.add_dense(w.kv_norm_gain);
    set.add_dense(w.w_kr);
    set.add_dense(w.w_uk);
    set.add_dense(w.w_uv);
    set.add_dense(w.w_o);
  }

  // Absorbed step: q~_h = q_h^nope W_UK_h^T (2 H d_nope d_c), per head and token the
  // logit [q~_h | q_h^R] . [c_t | k_R,t] (2 (d_c + d_R)) and the latent accumulation
  // a c_t (2 d_c), then o_h = o-bar_h W_UV_h (2 H d_c d_v).
  double attend_flops(Index L) const { return analysis_cost<float>(L).flops; }
  // The analysis module's bytes and FLOPs of the step (analysis/decode_cost.hpp): the
  // library's prediction, which the report sets beside the measurement.
  template <class S>
  kvattn::analysis::StepCost analysis_cost(Index L) const {
    return kvattn::analysis::attend_cost(config, L, kvattn::analysis::storage_of<S>());
  }
  // Expanded step: K_h^nope = C W_UK_h and V_h = C W_UV_h for every token and head
  // (2 L H d_c (d_nope + d_v)), then per head and token q.k at width d_nope + d_R and
  // a * v at width d_v.
  double expanded_flops(Index L) const {
    const double l = static_cast<double>(L);
    return 2.0 * l * H() * dc() * (dn() + dv()) + l * H() * (2.0 * (dn() + dr()) + 2.0 * dv());
  }
  // Per token: the query projection (through the query latent when q_rank > 0),
  // x W_DKV, x W_KR and o W_O (RMSNorms and RoPE not counted).
  double projection_flops() const {
    const double qd = dn() + dr();
    const double q_rank = static_cast<double>(config.q_rank);
    const double query =
        config.q_rank > 0 ? 2.0 * d() * q_rank + 2.0 * q_rank * H() * qd : 2.0 * d() * H() * qd;
    return query + 2.0 * d() * dc() + 2.0 * d() * dr() + 2.0 * H() * dv() * d();
  }
  double layer_flops(Index L) const { return projection_flops() + attend_flops(L + 1); }
  // Projections of L tokens, then the formulation prefill picks (automatic): expanded
  // (up-project every token, attend at width d_nope + d_R + d_v) or absorbed (absorb
  // every query, attend at width 2 d_c + d_R), over L (L + 1) / 2 causal pairs.
  double prefill_flops(const Layer& layer, Index L) const {
    const double l = static_cast<double>(L);
    const double pairs = l * (l + 1.0) / 2.0;
    double attention = 0;
    if (layer.prefill_mode(kvattn::MlaPrefill::automatic, 0, L) == kvattn::MlaPrefill::expanded) {
      attention = 2.0 * l * H() * dc() * (dn() + dv()) + pairs * H() * 2.0 * (dn() + dr() + dv());
    } else {
      attention = l * (2.0 * H() * dn() * dc() + 2.0 * H() * dc() * dv()) +
                  pairs * H() * (2.0 * (dc() + dr()) + 2.0 * dc());
    }
    return l * projection_flops() + attention;
  }
};

/// DeepSeek-V2-Lite's attention: d 2048, 16 heads, d_c 512, d_R 64, d_nope 128, d_v 128,
/// no query compression.
inline MlaMech mla_mech() { return {"mla", kvattn::deepseek_v2_lite_config()}; }
/// DeepSeek-V2's: d 5120, 128 heads, d_c' 1536 (query compression), otherwise as Lite.
inline MlaMech mla_v2_mech() { return {"mla_v2", kvattn::deepseek_v2_config()}; }

}  // namespace kvb
