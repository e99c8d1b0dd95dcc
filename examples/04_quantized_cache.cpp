// docs/api.md § Quantized storage: the same sequence decoded through caches of every
// storage format, int8 and fp8 e4m3 (one fp32 scale per block of 128, and per block of 32)
// beside bf16, for MHA, GQA, MQA, MLA and LRKV layers. For each format the program prints
// the cache's bytes per token (scales included, equal to the analysis module's
// prediction, which it checks) and the error of the outputs against the same decode
// through an fp32 cache: normwise, ||out - out_fp32|| / ||out_fp32||, the largest and the
// mean over the steps. Inputs are N(0, 1); the layers' weights are random (::random).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "kvattn/kvattn.hpp"

namespace {

using namespace kvattn;

struct Errors {
  double max = 0.0, mean = 0.0;
};

// Prefill `prompt` tokens, then decode `steps` more, into an S cache and an fp32 cache.
template <class S, class Layer>
Errors decode_errors(const Layer& layer, const RowMatrix<float>& x, Index prompt,
                     std::size_t& bytes_per_token) {
  auto cache = layer.template make_cache<S>();
  auto full = layer.make_cache();
  layer.prefill(x.topRows(prompt), cache, Threads{1});
  layer.prefill(x.topRows(prompt), full, Threads{1});
  auto workspace = layer.make_workspace(Threads{1});
  RowVector<float> out(layer.config().d_model), out_full(layer.config().d_model);
  Errors errors;
  const Index steps = x.rows() - prompt;
  for (Index t = prompt; t < x.rows(); ++t) {
    layer.decode(x.row(t), cache, out, workspace, Threads{1});
    layer.decode(x.row(t), full, out_full, workspace, Threads{1});
    const double error = static_cast<double>((out - out_full).norm() / out_full.norm());
    errors.max = std::max(errors.max, error);
    errors.mean += error / static_cast<double>(steps);
  }
  bytes_per_token = cache.bytes() / static_cast<std::size_t>(cache.tokens());
  const auto predicted = analysis::bytes_per_token_per_layer(analysis::cache_layout(layer.config()),
                                                             analysis::storage_of<S>());
  if (static_cast<Index>(bytes_per_token) != predicted) {
    std::fprintf(stderr, "bytes per token %zu differ from the analysis's %lld\n", bytes_per_token,
                 static_cast<long long>(predicted));
    std::exit(1);
  }
  return errors;
}

template <class S, class Layer>
void row(const char* format, const Layer& layer, const RowMatrix<float>& x, Index prompt) {
  std::size_t bytes = 0;
  const Errors e = decode_errors<S>(layer, x, prompt, bytes);
  std::printf("  %-14s %6zu bytes/token   error vs fp32: max %.2e  mean %.2e\n", format, bytes,
              e.max, e.mean);
}

// Every format for one layer.
template <class Layer>
void table(const char* name, const Layer& layer) {
  constexpr Index kPrompt = 384, kSteps = 16;
  std::mt19937_64 rng(11);
  const RowMatrix<float> x = random_normal<float>(kPrompt + kSteps, layer.config().d_model, rng);
  std::printf("%s, %lld prompt tokens, %lld decoded:\n", name, static_cast<long long>(kPrompt),
              static_cast<long long>(kSteps));
  std::size_t fp32_bytes = 0;
  decode_errors<float>(layer, x, kPrompt, fp32_bytes);
  std::printf("  %-14s %6zu bytes/token\n", "fp32", fp32_bytes);
  row<Eigen::bfloat16>("bf16", layer, x, kPrompt);
  row<Int8<128>>("int8/128", layer, x, kPrompt);
  row<Int8<32>>("int8/32", layer, x, kPrompt);
  row<Fp8E4M3<128>>("fp8_e4m3/128", layer, x, kPrompt);
  row<Fp8E4M3<32>>("fp8_e4m3/32", layer, x, kPrompt);
}

}  // namespace

int main() {
  const RopeConfig rope{RopeLayout::half_split, 10000.0, 0};
  table("MHA (4 heads of 128)", GqaLayer<float>::random(mha_config(512, 4, 128, rope), 3));
  table("GQA (8 heads of 128, 2 KV heads)",
        GqaLayer<float>::random(gqa_config(1024, 8, 128, 2, rope), 3));
  table("MQA (8 heads of 128)", GqaLayer<float>::random(mqa_config(1024, 8, 128, rope), 3));
  // MLA at DeepSeek-V2-Lite's attention widths: the latent (512) quantized, the rope key
  // (64) in bf16 (DeepSeek's fp8 layout at fp8_e4m3/128).
  MlaConfig mla;
  mla.d_model = 512;
  mla.n_heads = 4;
  mla.kv_rank = 512;
  mla.qk_nope_dim = 128;
  mla.rope_dim = 64;
  mla.v_dim = 128;
  mla.rope = rope;
  table("MLA (4 heads, d_c 512, d_R 64)", MlaLayer<float>::random(mla, 3));
  // LRKV at the paper's ratio r ~ 0.42 d_h, decoupled rope key (in bf16 when quantized).
  LrkvConfig lrkv{512, 4, 128, 54, LrkvRopeMode::decoupled, rope, 32};
  table("LRKV (4 heads of 128, r 54, d_R 32)", LrkvLayer<float>::random(lrkv, 3));
  return 0;
}
