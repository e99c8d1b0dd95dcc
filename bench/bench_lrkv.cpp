// Benchmarks of LRKV (d 4096, 32 heads, d_h 128, rank 54, rope_mode shared):
// decode_naive, decode (factored attend), decode_bf16, layer_decode, decode_expanded
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
  add_decode<LrkvMech, kvattn::Int8<128>>("decode_int8", mech, {65536}, threads);
  add_decode<LrkvMech, kvattn::Fp8E4M3<128>>("decode_fp8", mech, {65536}, threads);
  add_layer_decode(mech, kDecodeLengths, threads);
  add_expanded(mech, {1024, 4096});
}

}  // namespace kvb
