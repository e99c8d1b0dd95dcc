// docs/api.md's usage example: a GQA layer, a prompt, a few decoded tokens.
#include <cstdio>

#include "kvattn/kvattn.hpp"
#include "kvattn/reference/gqa.hpp"

int main() {
  using namespace kvattn;
  // 8 query heads of width 16 sharing 2 KV heads, half-split RoPE.
  const GqaConfig config = gqa_config(128, 8, 16, 2, {RopeLayout::half_split, 10000.0, 0});
  const auto layer = GqaLayer<float>::random(config, /*seed=*/42);

  std::mt19937_64 rng(7);
  const RowMatrix<float> x = random_normal<float>(40, config.d_model, rng);  // 40 tokens

  auto cache = layer.make_cache(/*reserve_tokens=*/64);
  RowMatrix<float> y(40, config.d_model);
  y.topRows(32) = layer.prefill(x.topRows(32), cache);  // causal prefill of the prompt
  RowVector<float> out(config.d_model);
  auto workspace = layer.make_workspace();  // decode's scratch: with it, no allocation
  for (Index t = 32; t < 40; ++t) {         // one token at a time through the factored path
    layer.decode(x.row(t), cache, out, workspace);
    y.row(t) = out;
  }

  const RowMatrix<float> expected = reference::forward(layer, x);  // expanded reference
  const double error = (y - expected).norm() / expected.norm();
  std::printf("cached tokens %lld, %lld elements and %zu bytes per token, error %.1e\n",
              static_cast<long long>(cache.tokens()),
              static_cast<long long>(cache.elements_per_token()), cache.bytes() / 40, error);
  return error < 1e-5 ? 0 : 1;
}
