// A user's program: Llama-3-8B's attention from its config.json (with kvattn::hf_config),
// or from a config written in code (plain kvattn::kvattn, no nlohmann_json). Either way
// the cache holds 2 * 8 KV heads * 128 * 32 layers = 65,536 elements per token.
#include <cstdio>

#include <kvattn/analysis/cache_size.hpp>
#if KVATTN_CONSUMER_HF
#include <kvattn/analysis/hf_config.hpp>
#endif

int main() {
#if KVATTN_CONSUMER_HF
  const auto model = kvattn::analysis::parse_hf_config(
      R"({"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
          "num_hidden_layers": 32, "torch_dtype": "bfloat16"})");
  const auto elements = kvattn::analysis::elements_per_token(*model.gqa, model.layers());
#else
  const auto elements =
      kvattn::analysis::elements_per_token(kvattn::gqa_config(4096, 32, 128, 8), 32);
#endif
  std::printf("%ld elements per token\n", static_cast<long>(elements));
  return elements == 65'536 ? 0 : 1;
}
