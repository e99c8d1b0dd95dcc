// The main demo: every mechanism at a realistic shape, side by side.
//
// For each mechanism it prefills a random prompt, decodes a few hundred tokens
// through the factored path, and prints what its cache holds per token, the cache's
// total size, the largest normwise error of the factored outputs against the
// expanded reference, and decode throughput (whole layer step, projections included).
//
// Usage: decode_demo [prompt_tokens] [decode_tokens]   (defaults 192 and 320)
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kvattn/kvattn.hpp"
#include "kvattn/reference/gqa.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "kvattn/reference/mla.hpp"

namespace {

using kvattn::Index;
using kvattn::RowMatrix;
using kvattn::RowVector;

struct DemoRow {
  std::string name;
  Index elements_per_token = 0;
  double bytes_per_token = 0;
  std::size_t total_bytes = 0;
  double max_error = 0;  // max over tokens of ||y_t - y_ref_t|| / ||y_ref_t||
  double tokens_per_second = 0;
};

// Runs one mechanism: any kvattn::AttentionLayer with a kvattn::reference::forward
// overload.
template <kvattn::AttentionLayer Layer>
DemoRow run_mechanism(const std::string& name, const Layer& layer, Index prompt, Index steps,
                      std::uint64_t seed) {
  using T = typename Layer::scalar_type;
  const Index d = layer.config().d_model;
  const Index length = prompt + steps;
  std::mt19937_64 rng(seed);
  const RowMatrix<T> x = kvattn::random_normal<T>(length, d, rng);

  auto cache = layer.make_cache(length);
  RowMatrix<T> y(length, d);
  y.topRows(prompt) = layer.prefill(x.topRows(prompt), cache);
  RowVector<T> out(d);
  auto workspace = layer.make_workspace();
  const auto start = std::chrono::steady_clock::now();
  for (Index t = prompt; t < length; ++t) {
    layer.decode(x.row(t), cache, out, workspace);
    y.row(t) = out;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  const RowMatrix<T> expected = kvattn::reference::forward(layer, x);
  double max_error = 0;
  for (Index t = 0; t < length; ++t) {
    const double norm = expected.row(t).template cast<double>().norm();
    const double diff = (y.row(t) - expected.row(t)).template cast<double>().norm();
    max_error = std::max(max_error, norm > 0 ? diff / norm : diff);
  }
  return {name,
          cache.elements_per_token(),
          static_cast<double>(cache.bytes()) / static_cast<double>(cache.tokens()),
          cache.bytes(),
          max_error,
          seconds > 0 ? static_cast<double>(steps) / seconds : 0.0};
}

void print_table(const std::vector<DemoRow>& rows, Index length) {
  std::printf("\n%-22s %14s %14s %16s %14s %12s\n", "mechanism", "elems/token", "bytes/token",
              "cache bytes", "max rel err", "decode tok/s");
  std::printf("%-22s %14s %14s %16s %14s %12s\n", "", "(per layer)", "(storage)",
              ("(" + std::to_string(length) + " tokens)").c_str(), "(vs expanded)", "(layer step)");
  for (const auto& r : rows) {
    std::printf("%-22s %14lld %14.0f %16zu %14.2e %12.1f\n", r.name.c_str(),
                static_cast<long long>(r.elements_per_token), r.bytes_per_token, r.total_bytes,
                r.max_error, r.tokens_per_second);
  }
}

Index argument(int argc, char** argv, int i, Index fallback) {
  if (argc <= i) return fallback;
  const long long value = std::atoll(argv[i]);
  if (value < 1) {
    std::fprintf(stderr, "decode_demo: argument %d (%s) must be a positive token count\n", i,
                 argv[i]);
    std::exit(2);
  }
  return static_cast<Index>(value);
}

}  // namespace

int main(int argc, char** argv) {
  const Index prompt = argument(argc, argv, 1, 192);
  const Index steps = argument(argc, argv, 2, 320);
  const kvattn::RopeConfig rope{kvattn::RopeLayout::half_split, 10000.0, 0};
  std::printf("kvattn %s decode demo: fp32, prompt %lld tokens, then %lld decoded tokens\n",
              kvattn::version, static_cast<long long>(prompt), static_cast<long long>(steps));

  std::vector<DemoRow> rows;
  // d_model 4096, 32 query heads of width 128, as in Llama-2-7B.
  using Gqa = kvattn::GqaLayer<float>;
  rows.push_back(run_mechanism("MHA (32 KV heads)",
                               Gqa::random(kvattn::mha_config(4096, 32, 128, rope), 1), prompt,
                               steps, 11));
  rows.push_back(run_mechanism("GQA (8 KV heads)",
                               Gqa::random(kvattn::gqa_config(4096, 32, 128, 8, rope), 2), prompt,
                               steps, 12));
  rows.push_back(run_mechanism("MQA (1 KV head)",
                               Gqa::random(kvattn::mqa_config(4096, 32, 128, rope), 3), prompt,
                               steps, 13));
  // MLA: DeepSeek-V2-Lite's attention (d_model 2048, 16 heads, d_c 512, no query
  // compression, d_nope 128, d_R 64, d_v 128, interleaved RoPE with YaRN) and
  // DeepSeek-V2's (d_model 5120, 128 heads, d_c' 1536). Decode is absorbed; the
  // reference reconstructs every head's K and V. V2's weights are 149 M parameters,
  // which every decoded token reads, so that row takes a while.
  using Mla = kvattn::MlaLayer<float>;
  rows.push_back(run_mechanism(
      "MLA (V2-Lite, 16 h)", Mla::random(kvattn::deepseek_v2_lite_config(), 4), prompt, steps, 14));
  rows.push_back(run_mechanism("MLA (V2, 128 h)", Mla::random(kvattn::deepseek_v2_config(), 5),
                               prompt, steps, 15));
  // LRKV at the paper's 6.3B attention shape (d_model 4096, 32 heads, d_h 128, r 54):
  // shared K_s, V_s plus per-head rank-54 latents, 2 * (128 + 32 * 54) = 3,712 elements
  // per token, 1/H + r/d_h = 45.3 % of MHA. Decode is associative (seed 000, Eqs. 6-7);
  // the reference materializes every head's K_h, V_h. Rows: RoPE on the shared channel;
  // full RoPE made exact by a commuting B_h^K, with the exact factored key norm (+ H
  // fp32 key RMS per token).
  using Lrkv = kvattn::LrkvLayer<float>;
  kvattn::LrkvConfig lrkv{4096, 32, 128, 54, kvattn::LrkvRopeMode::shared, rope};
  rows.push_back(run_mechanism("LRKV r=54 shared RoPE", Lrkv::random(lrkv, 6), prompt, steps, 16));
  lrkv.rope_mode = kvattn::LrkvRopeMode::commuting;
  lrkv.key_norm = true;
  rows.push_back(run_mechanism("LRKV r=54 commut.+norm", Lrkv::random(lrkv, 7), prompt, steps, 17));

  print_table(rows, prompt + steps);
  return 0;
}
