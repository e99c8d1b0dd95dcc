// Decode benchmarks of the GQA family (a first, small set; see docs/benchmarks.md
// once it exists).
//
//   decode/gqa/L:<L>/T:1           GqaLayer::decode, the factored path: one new token
//                                  over a cache of L tokens (projections included).
//   decode_expanded/gqa/L:<L>/T:1  kvattn::reference::forward on the same L + 1
//                                  tokens: materializes every query head's K and V
//                                  and recomputes the sequence densely, which is what
//                                  decoding costs without a factored cache.
//
// Bytes processed is the KV data a step reads: the cache, 2 * n_kv * d_h elements per
// token, for the factored path; the expanded per-head K and V, 2 * H * d_h elements
// per token, for the reference.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>

#include <kvattn/kvattn.hpp>
#include <kvattn/reference/gqa.hpp>

namespace {

using kvattn::Index;

// A Llama-like layer scaled down (H = 16, n_kv = 4, d_h = 64) so a run takes seconds.
const kvattn::GqaConfig kConfig = kvattn::gqa_config(1024, 16, 64, 4);

void decode_gqa(benchmark::State& state) {
  const Index length = state.range(0);
  const auto layer = kvattn::GqaLayer<float>::random(kConfig, 1);
  std::mt19937_64 rng(2);

  // Fill the cache with raw K/V rows (append), not a quadratic prefill.
  auto cache = layer.make_cache(length + 1);
  const Index kv_width = kConfig.n_kv_heads * kConfig.head_dim;
  cache.append(kvattn::random_normal<float>(length, kv_width, rng),
               kvattn::random_normal<float>(length, kv_width, rng));

  const kvattn::RowVector<float> x = kvattn::random_normal<float>(1, kConfig.d_model, rng);
  kvattn::RowVector<float> out(kConfig.d_model);
  for (auto _ : state) {
    layer.decode(x, cache, out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
    cache.truncate(length);  // roll back, so every step sees L cached tokens
  }
  const auto bytes_per_step = static_cast<std::int64_t>(cache.elements_per_token()) * (length + 1) *
                              static_cast<std::int64_t>(sizeof(float));
  state.SetBytesProcessed(state.iterations() * bytes_per_step);
}

void decode_expanded_gqa(benchmark::State& state) {
  const Index length = state.range(0);
  const auto layer = kvattn::GqaLayer<float>::random(kConfig, 1);
  std::mt19937_64 rng(2);
  const kvattn::RowMatrix<float> x = kvattn::random_normal<float>(length + 1, kConfig.d_model, rng);
  for (auto _ : state) {
    const kvattn::RowMatrix<float> y = kvattn::reference::forward(layer, x);
    benchmark::DoNotOptimize(y.data());
  }
  const auto bytes_per_step = static_cast<std::int64_t>(2 * kConfig.n_heads * kConfig.head_dim) *
                              (length + 1) * static_cast<std::int64_t>(sizeof(float));
  state.SetBytesProcessed(state.iterations() * bytes_per_step);
}

}  // namespace

BENCHMARK(decode_gqa)
    ->Name("decode/gqa")
    ->ArgNames({"L", "T"})
    ->Args({64, 1})
    ->Args({256, 1})
    ->Args({1024, 1})
    ->Args({4096, 1});
BENCHMARK(decode_expanded_gqa)
    ->Name("decode_expanded/gqa")
    ->ArgNames({"L", "T"})
    ->Args({64, 1})
    ->Args({256, 1});
