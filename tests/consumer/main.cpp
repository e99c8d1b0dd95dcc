// A user's program: includes the umbrella header, builds a small GQA layer,
// prefills a prompt, decodes a few tokens and checks that every output is finite.
#include <cstdio>
#include <random>

#include <kvattn/kvattn.hpp>

int main() {
  const kvattn::GqaConfig config = kvattn::gqa_config(64, 4, 16, 2);
  const auto layer = kvattn::GqaLayer<float>::random(config, 1);
  auto cache = layer.make_cache();

  std::mt19937_64 rng(2);
  const kvattn::RowMatrix<float> prompt = kvattn::random_normal<float>(8, config.d_model, rng);
  const kvattn::RowMatrix<float> prefilled = layer.prefill(prompt, cache);
  bool finite = prefilled.allFinite();

  kvattn::RowVector<float> out(config.d_model);
  for (int step = 0; step < 4; ++step) {
    const kvattn::RowVector<float> token = kvattn::random_normal<float>(1, config.d_model, rng);
    layer.decode(token, cache, out);
    finite = finite && out.allFinite();
  }

  std::printf("kvattn %s: %ld tokens cached, %zu bytes, outputs %s\n", kvattn::version,
              static_cast<long>(cache.tokens()), cache.bytes(), finite ? "finite" : "NOT finite");
  return finite && cache.tokens() == 12 ? 0 : 1;
}
