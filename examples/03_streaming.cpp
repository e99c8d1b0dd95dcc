// docs/serving.md § Windows: a long generation (32,768 tokens) through a Mistral-style
// sliding-window layer with StreamingLLM sink tokens and GPT-OSS sink logits, in a paged
// cache that keeps the sink tokens and the last `window` tokens and gives every other
// page back to its pool. Memory stays constant however long the sequence runs: the
// program prints, as it goes, the tokens held, the cache's bytes, the pool's pages in use
// and the time per token (of two decodes: the bounded cache's, and an unbounded
// contiguous cache's kept for the check); then it checks the last token's output against
// the expanded reference step (reference::decode_step with the layer's window, sinks and
// sink logits).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#include "kvattn/kvattn.hpp"
#include "kvattn/reference/gqa.hpp"

int main() {
  using namespace kvattn;
  using Clock = std::chrono::steady_clock;
  // 8 query heads of width 32 sharing 2 KV heads; a window of 512 tokens plus 4 sinks.
  GqaConfig config = gqa_config(256, 8, 32, 2, {RopeLayout::half_split, 10000.0, 0});
  config.window = 512;
  config.sink_tokens = 4;
  config.sink_logits = true;
  const auto layer = GqaLayer<float>::random(config, /*seed=*/42);
  constexpr Index kTokens = 32768, kReport = 4096, kPageTokens = 32;
  const Threads threads{2};

  // Pages for the sink tokens' page, the window's (one more when it is not page-aligned)
  // and the one a new token opens before the oldest goes back: 1 + 16 + 1 + 1.
  auto pool = make_gqa_page_pool<float>(config, kPageTokens, /*max_pages=*/19);
  PagedGqaCache<float> cache(config, pool);
  // For the check at the end: a contiguous cache, which keeps every token.
  GqaCache<float> unbounded = layer.make_cache();
  auto workspace = layer.make_workspace(threads);
  std::mt19937_64 rng(7);
  // Inputs of a real model would be the previous token's embedding; random rows here.
  const RowMatrix<float> inputs = random_normal<float>(kTokens, config.d_model, rng);
  RowMatrix<float> outputs(kTokens, config.d_model);

  std::printf("window %lld + %lld sink tokens, pages of %lld tokens, pool of %lld pages\n",
              static_cast<long long>(config.window), static_cast<long long>(config.sink_tokens),
              static_cast<long long>(kPageTokens), static_cast<long long>(pool->max_pages()));
  std::printf("%10s %8s %12s %8s %12s\n", "position", "held", "cache bytes", "pages", "us / token");
  RowVector<float> same(config.d_model);
  double most_apart = 0;  // the bounded and unbounded caches' outputs, relative
  auto last = Clock::now();
  for (Index t = 0; t < kTokens; ++t) {
    layer.decode(inputs.row(t), cache, outputs.row(t), workspace, threads);
    layer.decode(inputs.row(t), unbounded, same, workspace, threads);
    most_apart =
        std::max(most_apart, static_cast<double>((outputs.row(t) - same).norm() / same.norm()));
    if ((t + 1) % kReport == 0) {
      const double us =
          std::chrono::duration<double, std::micro>(Clock::now() - last).count() / kReport;
      std::printf("%10lld %8lld %12zu %8lld %12.1f\n",
                  static_cast<long long>(cache.sequence_length()),
                  static_cast<long long>(cache.tokens()), cache.bytes(),
                  static_cast<long long>(pool->pages_in_use()), us);
      last = Clock::now();
    }
  }

  // The last token's step the expanded way: reference::decode_step over the unbounded
  // cache, which kept every token (and grew with them), with the layer's own window,
  // sink tokens and sink logits.
  const RowMatrix<float> query = inputs.bottomRows(1) * layer.weights().w_q;
  const RowMatrix<float> want =
      reference::decode_step(layer, unbounded, query) * layer.weights().w_o;
  const double error = (outputs.bottomRows(1) - want).norm() / want.norm();
  std::printf("unbounded cache: %zu bytes for the same %lld tokens\n", unbounded.bytes(),
              static_cast<long long>(unbounded.tokens()));
  std::printf("bounded against unbounded cache, every output: relative difference <= %.1e\n",
              most_apart);
  std::printf("last output against the expanded reference: relative error %.1e\n", error);
  return error < 1e-5 && most_apart < 1e-5 ? 0 : 1;
}
