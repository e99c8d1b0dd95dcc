// docs/serving.md's serving loop: one prompt prefilled into a paged cache, 8 sequences
// forked from it (sharing its pages), each generating its own continuation through one
// decode_batch call per step that reads the shared prompt once for all 8 (cascade
// attention), and one sequence rolled back as a rejected speculative draft. Prints the
// pages in use, the memory sharing saves and the tokens per second, and checks every
// sequence's outputs against the expanded reference run on that sequence alone.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <span>
#include <vector>

#include "kvattn/kvattn.hpp"
#include "kvattn/reference/gqa.hpp"

int main() {
  using namespace kvattn;
  using Clock = std::chrono::steady_clock;
  // 8 query heads of width 32 sharing 2 KV heads, half-split RoPE.
  const GqaConfig config = gqa_config(256, 8, 32, 2, {RopeLayout::half_split, 10000.0, 0});
  const auto layer = GqaLayer<float>::random(config, /*seed=*/42);
  constexpr Index kPrompt = 500, kSteps = 40, kPageTokens = 32;
  constexpr int kSequences = 8, kRolledBack = 3;
  constexpr Index kRejected = 6;  // draft tokens sequence 3 rolls back at step 20
  const Threads threads{2};

  auto pool = make_gqa_page_pool<float>(config, kPageTokens, /*max_pages=*/1024);
  std::mt19937_64 rng(7);
  const RowMatrix<float> prompt = random_normal<float>(kPrompt, config.d_model, rng);

  // Each sequence's inputs and the outputs decode gave for them, for the final check.
  std::vector<RowMatrix<float>> inputs(kSequences,
                                       RowMatrix<float>(kPrompt + kSteps, config.d_model));
  std::vector<RowMatrix<float>> outputs(kSequences,
                                        RowMatrix<float>(kPrompt + kSteps, config.d_model));
  std::vector<PagedGqaCache<float>> sequences;
  {
    PagedGqaCache<float> prompt_cache(config, pool);
    const RowMatrix<float> prompt_out = layer.prefill(prompt, prompt_cache, threads);
    std::printf("prompt of %lld tokens: %lld pages of %lld tokens in use\n",
                static_cast<long long>(kPrompt), static_cast<long long>(pool->pages_in_use()),
                static_cast<long long>(kPageTokens));
    for (int s = 0; s < kSequences; ++s) {
      sequences.push_back(prompt_cache);  // a fork: shares every page
      inputs[s].topRows(kPrompt) = prompt;
      outputs[s].topRows(kPrompt) = prompt_out;
    }
  }  // the prompt's own cache goes; its pages stay, held by the forks
  std::printf("%d forks: %lld pages in use (forks share the prompt's)\n", kSequences,
              static_cast<long long>(pool->pages_in_use()));

  std::vector<PagedGqaCache<float>*> caches;
  for (auto& s : sequences) caches.push_back(&s);
  RowMatrix<float> x(kSequences, config.d_model), out(kSequences, config.d_model);
  // Each sequence's first new token differs; later ones follow from its own outputs.
  x = random_normal<float>(kSequences, config.d_model, rng);
  auto workspace = layer.make_workspace(threads);
  std::vector<Index> length(kSequences, kPrompt);
  std::normal_distribution<float> noise(0.0f, 0.1f);
  double decode_seconds = 0;
  Index generated = 0;
  for (Index step = 0; step < kSteps; ++step) {
    const auto start = Clock::now();
    layer.decode_batch(x, std::span<PagedGqaCache<float>* const>(caches), out, workspace, threads,
                       BatchOptions{.shared_prefix = kPrompt});
    decode_seconds += std::chrono::duration<double>(Clock::now() - start).count();
    generated += kSequences;
    for (int s = 0; s < kSequences; ++s) {
      inputs[s].row(length[s]) = x.row(s);
      outputs[s].row(length[s]) = out.row(s);
      ++length[s];
    }
    if (step == 20) {  // a draft of kRejected tokens rejected: roll sequence 3 back
      length[kRolledBack] -= kRejected;
      sequences[kRolledBack].truncate(length[kRolledBack]);
    }
    // "Generation": the next input is the output, rescaled to unit RMS, plus noise.
    for (int s = 0; s < kSequences; ++s) {
      const float rms = out.row(s).norm() / std::sqrt(static_cast<float>(config.d_model));
      for (Index j = 0; j < config.d_model; ++j) x(s, j) = out(s, j) / rms + noise(rng);
    }
  }

  std::size_t unshared = 0;  // what 8 caches of their own would hold
  for (const auto& s : sequences) unshared += s.bytes();
  const std::size_t in_use = pool->bytes_in_use();
  std::printf(
      "after %lld steps: %lld pages in use, %.2f MiB; unshared caches would hold "
      "%.2f MiB (sharing saves %.0f%%)\n",
      static_cast<long long>(kSteps), static_cast<long long>(pool->pages_in_use()),
      in_use / 1048576.0, unshared / 1048576.0,
      100.0 * (1.0 - static_cast<double>(in_use) / static_cast<double>(unshared)));
  std::printf("sequence %d rolled back %lld tokens: %lld tokens, the others %lld\n", kRolledBack,
              static_cast<long long>(kRejected),
              static_cast<long long>(sequences[kRolledBack].tokens()),
              static_cast<long long>(sequences[0].tokens()));
  std::printf("decode_batch: %.0f tokens per second (%d sequences, 2 threads)\n",
              static_cast<double>(generated) / decode_seconds, kSequences);

  // Each sequence alone through the expanded reference: its prompt and its own tokens.
  double worst = 0;
  for (int s = 0; s < kSequences; ++s) {
    const RowMatrix<float> expected = reference::forward(layer, inputs[s].topRows(length[s]));
    const double error = (outputs[s].topRows(length[s]) - expected).norm() / expected.norm();
    worst = std::max(worst, error);
  }
  std::printf("largest relative error against the reference: %.1e\n", worst);
  return worst < 1e-5 ? 0 : 1;
}
