// [analysis]: the bytes and FLOPs of a decode step and its roofline time
// (analysis/decode_cost.hpp), each against a number worked out by hand beside it.
#include <catch2/catch.hpp>

#include <limits>

#include "kvattn/analysis/decode_cost.hpp"

using namespace kvattn;
using namespace kvattn::analysis;

namespace {
constexpr CacheStorage fp32 = plain_storage(Dtype::fp32);
constexpr CacheStorage bf16 = plain_storage(Dtype::bf16);
}  // namespace

TEST_CASE("MHA's attention step reads its cache once", "[analysis]") {
  // 32 heads x 128, L = 65536, fp32: 65536 x (2 x 32 x 128 x 4 = 32768) bytes =
  // 2,147,483,648; 4 x 32 x 65536 x 128 = 1,073,741,824 FLOPs.
  constexpr StepCost mha = attend_cost(mha_config(4096, 32, 128), 65536, fp32);
  static_assert(mha.bytes == 2147483648.0 && mha.flops == 1073741824.0);
  CHECK(attend_cost(mha_config(4096, 32, 128), 65536, bf16).bytes == 1073741824.0);
  // At 10 GB/s and 100 GFLOP/s: 0.2147 s for the bytes, 0.0107 s for the FLOPs.
  const Machine machine{10e9, 100e9};
  CHECK(roofline_seconds(mha, machine) == Approx(0.2147483648).epsilon(1e-15));
  CHECK(memory_bound(mha, machine));
  // GQA with 8 KV heads reads a quarter of the bytes for the same FLOPs.
  const StepCost gqa = attend_cost(gqa_config(4096, 32, 128, 8), 65536, fp32);
  CHECK(gqa.bytes == 536870912.0);
  CHECK(gqa.flops == 1073741824.0);
}

TEST_CASE("MLA's step reads the latent rows and the absorbed weights", "[analysis]") {
  // DeepSeek-V2-Lite (H 16, d_c 512, d_R 64, d_nope 128, d_v 128), fp32, L = 1024:
  // rows 1024 x 576 x 4 = 2,359,296 bytes; W_UK and W_UV 512 x 16 x 256 = 2,097,152
  // weights, 8,388,608 bytes; FLOPs 2 x 2,097,152 + 1024 x 16 x (2 x 576 + 2 x 512)
  // = 4,194,304 + 35,651,584.
  const StepCost mla = attend_cost(deepseek_v2_lite_config(), 1024, fp32);
  CHECK(mla.bytes == 2359296.0 + 8388608.0);
  CHECK(mla.flops == 4194304.0 + 35651584.0);
  // At 10 GB/s and 100 GFLOP/s: 1.07 ms of bytes, 0.40 ms of FLOPs: memory-bound; at
  // 10 GFLOP/s compute-bound.
  CHECK(memory_bound(mla, {10e9, 100e9}));
  CHECK_FALSE(memory_bound(mla, {10e9, 10e9}));
  CHECK(roofline_seconds(mla, {10e9, 10e9}) == Approx(39845888.0 / 10e9).epsilon(1e-15));
}

TEST_CASE("LRKV's step reads the shared and latent rows and the bases", "[analysis]") {
  // H 32, d_h 128, r 54, shared RoPE, fp32, L = 1000: a token is 2 (128 + 32 x 54) = 3712
  // elements, 14,848 bytes; the bases B^K, B^V 2 x 128 x 32 x 54 = 442,368 weights.
  LrkvConfig c{4096, 32, 128, 54, LrkvRopeMode::shared, {RopeLayout::half_split, 10000.0, 0}};
  const StepCost lrkv = attend_cost(c, 1000, fp32);
  CHECK(lrkv.bytes == 14848000.0 + 442368.0 * 4);
  // 1000 x 32 x (4 x 128 + 4 x 54) + 2 x 442,368.
  CHECK(lrkv.flops == 1000.0 * 32 * 728 + 884736.0);
  // Decoupled RoPE (d_R 16) adds d_R per token to the cache and 2 H d_R FLOPs per token.
  c.rope_mode = LrkvRopeMode::decoupled;
  c.rope_dim = 16;
  const StepCost decoupled = attend_cost(c, 1000, fp32);
  CHECK(decoupled.bytes == lrkv.bytes + 1000.0 * 16 * 4);
  CHECK(decoupled.flops == lrkv.flops + 1000.0 * 32 * 2 * 16);
}

TEST_CASE("a whole layer step adds every weight once", "[analysis]") {
  // gqa_config(64, 4, 16, 2), L = 10: attention over 11 tokens, 11 x 2 x 2 x 16 x 4 =
  // 2,816 bytes and 4 x 4 x 11 x 16 = 2,816 FLOPs; weights W_Q 64 x 64, W_K and W_V
  // 64 x 32 each, W_O 64 x 64: 12,288, i.e. 49,152 bytes and 24,576 FLOPs.
  const StepCost step = decode_cost(gqa_config(64, 4, 16, 2), 10, fp32);
  CHECK(step.bytes == 2816.0 + 49152.0);
  CHECK(step.flops == 2816.0 + 24576.0);
}

TEST_CASE("a machine needs positive, finite limits", "[analysis][reliability]") {
  const StepCost step{1.0, 1.0};
  CHECK_THROWS_AS(roofline_seconds(step, {0.0, 1.0}), config_error);
  CHECK_THROWS_AS(roofline_seconds(step, {1.0, -1.0}), config_error);
  CHECK_THROWS_AS(memory_bound(step, {1.0, std::numeric_limits<double>::infinity()}), config_error);
  CHECK_THROWS_AS(attend_cost(mha_config(8, 2, 4), -1), config_error);
}
