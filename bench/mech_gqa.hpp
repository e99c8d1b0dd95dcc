// The GQA family (MHA, GQA, MQA) as a benchmark mechanism (see bench_drivers.hpp).
#pragma once

#include <memory>
#include <random>
#include <string>

#include <kvattn/analysis/decode_cost.hpp>

#include <kvattn/attention/gqa.hpp>

#include "bench_util.hpp"
#include "naive.hpp"

namespace kvb {

struct GqaMech {
  using Layer = kvattn::GqaLayer<float>;
  template <class S>
  using Cache = kvattn::GqaCache<float, S>;
  template <class S>
  using PagedCache = kvattn::PagedGqaCache<float, S>;
  struct Pool {
    Mat keys, values;  // rows x n_kv*d_h
  };

  using Naive = NaiveGqa;

  std::string name;
  kvattn::GqaConfig config;
  // The layer's DecodeArithmetic (decode_bf16dot/ rows: bf16_dot).
  kvattn::DecodeArithmetic arithmetic = kvattn::DecodeArithmetic::fp32;

  bool has_naive() const { return true; }
  /// One KV group's keys and values: 2 L d_h elements.
  double block_bytes(Index L, std::size_t storage) const {
    return 2.0 * static_cast<double>(L) * dh() * static_cast<double>(storage);
  }
  Layer make_layer() const {
    Layer layer = Layer::random(config, 1);
    layer.set_decode_arithmetic(arithmetic);
    return layer;
  }
  template <class S>
  std::shared_ptr<kvattn::PagePool> make_page_pool(Index page_tokens, Index pages) const {
    return kvattn::make_gqa_page_pool<S>(config, page_tokens, pages);
  }
  Index d_model() const { return config.d_model; }
  Index query_width() const { return config.n_heads * config.head_dim; }
  Index heads_width() const { return config.n_heads * config.head_dim; }
  double H() const { return static_cast<double>(config.n_heads); }
  double dh() const { return static_cast<double>(config.head_dim); }
  double kv_width() const { return static_cast<double>(config.n_kv_heads * config.head_dim); }
  double d() const { return static_cast<double>(config.d_model); }

  Pool make_pool(std::mt19937_64& rng, Index rows) const {
    const Index width = config.n_kv_heads * config.head_dim;
    return {kvattn::random_normal<float>(rows, width, rng),
            kvattn::random_normal<float>(rows, width, rng)};
  }
  /// Appends the pool's rows cyclically until `cache` (contiguous or paged) holds L tokens.
  template <class C>
  void fill(C& cache, Index L, const Pool& pool) const {
    while (cache.sequence_length() < L) {
      const Index n = std::min(pool.keys.rows(), L - cache.sequence_length());
      cache.append(pool.keys.topRows(n), pool.values.topRows(n));
    }
  }
  /// Every KV head's key and value rows: 2 * n_kv rows per token (a quantized row with
  /// its block scales).
  template <class S>
  void add_cache(ReadSet& set, const Cache<S>& cache) const {
    using Element = typename Cache<S>::element_type;
    const auto bytes =
        static_cast<std::size_t>(cache.tokens() * cache.row_stride()) * sizeof(Element);
    for (Index g = 0; g < config.n_kv_heads; ++g) {
      set.add(cache.key_row(g, 0), bytes);
      set.add(cache.value_row(g, 0), bytes);
    }
  }
  /// attend reads no weight (the query comes projected).
  void add_attend_weights(ReadSet&, const Layer&) const {}
  void add_layer_weights(ReadSet& set, const Layer& layer) const {
    const auto& w = layer.weights();
    set.add_dense(w.w_q);
    set.add_dense(w.w_k);
    set.add_dense(w.w_v);
    set.add_dense(w.w_o);
    set.add_dense(w.bias_q);
    set.add_dense(w.bias_k);
    set.add_dense(w.bias_v);
  }

  // Per query head and cached token: q.k (d_h multiply-adds) and a * v (d_h
  // multiply-adds): 4 H L d_h. The softmax's H L exponentials are not counted.
  double attend_flops(Index L) const { return analysis_cost<float>(L).flops; }
  // The analysis module's bytes and FLOPs of the step (analysis/decode_cost.hpp): the
  // library's prediction, which the report sets beside the measurement.
  template <class S>
  kvattn::analysis::StepCost analysis_cost(Index L) const {
    return kvattn::analysis::attend_cost(config, L, kvattn::analysis::storage_of<S>());
  }
  // The reference materializes each head's K and V (copies, no arithmetic), then does
  // the same products.
  double expanded_flops(Index L) const { return attend_flops(L); }
  // x W_Q, x W_K, x W_V, o W_O (2 flops per weight), then attention over L + 1 tokens.
  double projection_flops() const {
    return 2.0 * (d() * (H() * dh() + 2.0 * kv_width()) + H() * dh() * d());
  }
  double layer_flops(Index L) const { return projection_flops() + attend_flops(L + 1); }
  // Projections of L tokens, then causal attention: L (L + 1) / 2 query/key pairs.
  double prefill_flops(const Layer&, Index L) const {
    const double l = static_cast<double>(L);
    return l * projection_flops() + 4.0 * H() * dh() * l * (l + 1.0) / 2.0;
  }
};

inline GqaMech mha_mech() { return {"mha", kvattn::mha_config(4096, 32, 128)}; }
inline GqaMech gqa_mech() { return {"gqa", kvattn::gqa_config(4096, 32, 128, 8)}; }
inline GqaMech mqa_mech() { return {"mqa", kvattn::mqa_config(4096, 32, 128)}; }

}  // namespace kvb
