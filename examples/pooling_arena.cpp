// The pooling arena (seed 002, Chapter 7) in the terminal:
//   1. which keys each of 10 tokens sees under a causal and a bidirectional mask;
//   2. how much each token of one random document weighs in <EOS>, mean and
//      latent-dictionary pooling (after a bidirectional encoder layer);
//   3. the head diversity (seed 000) of randomly initialized MHA, GQA, MQA, MLA, LRKV.
#include <algorithm>
#include <cstdio>
#include <string>

#include "kvattn/kvattn.hpp"
#include "kvattn/reference/gqa.hpp"

using namespace kvattn;

namespace {

void print_grid(const char* title, const Mask& mask, Index n) {
  Index visible = 0;
  std::printf("%s (row = query, column = key, # = visible)\n", title);
  for (Index i = 0; i < n; ++i) {
    std::printf("  t%-2ld ", static_cast<long>(i));
    for (Index j = 0; j < n; ++j) {
      const bool v = mask.visible(i, j);
      visible += v ? 1 : 0;
      std::printf("%c ", v ? '#' : '.');
    }
    std::printf("\n");
  }
  std::printf("  visible: %ld of %ld cells (%.0f%%)\n\n", static_cast<long>(visible),
              static_cast<long>(n * n), 100.0 * double(visible) / double(n * n));
}

std::string bar(double share, double full_scale) {
  const int width = static_cast<int>(share / full_scale * 12.0 + 0.5);
  return std::string(static_cast<std::size_t>(width), '#');
}

void print_diversity(const char* name, const analysis::HeadDiversity& r) {
  std::printf("  %-28s %6.2f  %6.1f%%   %6.2f  %6.1f%%   %6.2f%%\n", name, r.effective_rank,
              r.effective_rank_percent(), r.centered_effective_rank,
              r.centered_effective_rank_percent(), 100.0 * double(r.n_heads - 1) / r.n_heads);
}

}  // namespace

int main() {
  // 1. Visibility grids: causal keeps 1/2 + 1/(2N) of the cells, 55 of 100 at N = 10.
  constexpr Index n = 10;
  print_grid("Causal mask, 10 tokens", Mask::causal(), n);
  print_grid("Bidirectional mask, 10 tokens", Mask::bidirectional(), n);
  std::printf("causal_visible_fraction(10) = %.2f\n\n", analysis::causal_visible_fraction(n));

  // 2. One random document: 10 tokens of width 32 through one bidirectional MHA layer,
  //    then each pooling rule's weight per token.
  constexpr Index d = 32;
  const auto encoder = GqaLayer<double>::random(mha_config(d, 4, 8), 1);
  std::mt19937_64 rng(2024);
  const RowMatrix<double> tokens = random_normal<double>(n, d, rng);
  const RowMatrix<double> hidden = reference::forward(encoder, tokens, Mask::bidirectional());
  const auto pooler = LatentPooling<double>::random({d, 16, 4, 0, true, 0.0}, 7);
  const RowVector<double> eos = last_token_weights<double>(hidden);
  const RowVector<double> mean = mean_pool_weights<double>(hidden);
  const RowVector<double> latent = contribution_shares<double>(pooler.token_contributions(hidden));
  std::printf("Per-token weight in the pooled vector (one random document, bidirectional)\n");
  std::printf(
      "  (latent: share of ||token term|| in the pooled sum; bars: 12 chars = 0.15,\n"
      "   the <EOS> bar clipped at 16)\n");
  std::printf("  tok   <EOS>                  mean                   latent\n");
  for (Index i = 0; i < n; ++i) {
    std::printf("  t%-2ld  %5.3f %-16s %5.3f %-16s %5.3f %s\n", static_cast<long>(i), eos(i),
                bar(std::min(eos(i), 0.2), 0.15).c_str(), mean(i), bar(mean(i), 0.15).c_str(),
                latent(i), bar(latent(i), 0.15).c_str());
  }
  const RowMatrix<double> usage = pooler.dictionary_usage(hidden);
  const RowVector<double> total = usage.colwise().sum() / double(usage.rows());
  Index top = 0;
  total.maxCoeff(&top);
  std::printf("  dictionary usage (mass per entry, mean over 4 heads; 10 tokens in all):\n  ");
  for (Index j = 0; j < total.size(); ++j) std::printf("%.2f ", total(j));
  std::printf("\n  most used entry: %ld\n\n", static_cast<long>(top));

  // 3. Head diversity of random layers, d = 256, H = 8.
  std::printf("Head diversity of random layers (d 256, H 8; operators W_h^Q W_h^K^T)\n");
  std::printf("  %-28s %6s  %7s   %6s  %7s   %s\n", "layer", "rank", "of H", "cntrd", "of H",
              "ceiling");
  print_diversity("MHA (d_h 32)",
                  analysis::head_diversity(GqaLayer<double>::random(mha_config(256, 8, 32), 1)));
  print_diversity("GQA (d_h 32, 2 KV heads)",
                  analysis::head_diversity(GqaLayer<double>::random(gqa_config(256, 8, 32, 2), 1)));
  print_diversity("MQA (d_h 32)",
                  analysis::head_diversity(GqaLayer<double>::random(mqa_config(256, 8, 32), 1)));
  MlaConfig mla;
  mla.d_model = 256;
  mla.n_heads = 8;
  mla.kv_rank = 64;
  mla.qk_nope_dim = 32;
  mla.rope_dim = 16;
  mla.v_dim = 32;
  print_diversity("MLA (d_c 64, d_R 16)",
                  analysis::head_diversity(MlaLayer<double>::random(mla, 1)));
  for (const Index rank : {0, 8, 32}) {
    LrkvConfig lrkv;
    lrkv.d_model = 256;
    lrkv.n_heads = 8;
    lrkv.head_dim = 32;
    lrkv.rank = rank;
    const std::string name = "LRKV (r " + std::to_string(rank) + ", residual 0.1)";
    print_diversity(name.c_str(), analysis::head_diversity(LrkvLayer<double>::random(lrkv, 1)));
  }
  return 0;
}
