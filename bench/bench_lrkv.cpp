// Benchmarks of LRKV (d 4096, 32 heads, d_h 128, rank 54, rope_mode shared):
// decode_naive, decode (factored attend), decode_bf16, decode_bf16dot, layer_decode,
// decode_expanded
// (every head's key and value materialized from the shared rows and latents).
#include "bench_drivers.hpp"
#include "mech_lrkv.hpp"

namespace kvb {

void register_lrkv() {
  const std::vector<int> threads = thread_counts();
  const LrkvMech mech = lrkv_mech();
  add_naive(mech, kDecodeLengths, threads);
  add_decode("decode", mech, kDecodeLengths, threads);
  add_decode<LrkvMech, Eigen::bfloat16>("decode_bf16", mech, {16384, 65536}, threads);
  // The same steps with DecodeArithmetic::bf16_dot (where the build has AVX512-BF16; else
  // the same code as decode_bf16/).
  LrkvMech dot = mech;
  dot.arithmetic = kvattn::DecodeArithmetic::bf16_dot;
  add_decode<LrkvMech, Eigen::bfloat16>("decode_bf16dot", dot, {16384, 65536}, threads);
  add_decode<LrkvMech, kvattn::Int8<128>>("decode_int8", mech, {65536}, threads);
  add_decode<LrkvMech, kvattn::Fp8E4M3<128>>("decode_fp8", mech, {65536}, threads);
  add_layer_decode(mech, kDecodeLengths, threads);
  add_expanded(mech, {1024, 4096});
}

}  // namespace kvb
