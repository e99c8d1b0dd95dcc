// Benchmarks of the GQA family (MHA, GQA with 8 KV heads, MQA; d 4096, 32 heads,
// d_h 128, no RoPE): decode_naive, decode, decode_bf16, decode_bf16dot, decode_int8,
// decode_fp8, layer_decode, decode_expanded.
#include "bench_drivers.hpp"
#include "mech_gqa.hpp"

namespace kvb {

void register_gqa() {
  const std::vector<int> threads = thread_counts();
  const GqaMech mechs[] = {mha_mech(), gqa_mech(), mqa_mech()};
  for (const auto& m : mechs) {
    add_naive(m, kDecodeLengths, threads);
    add_decode("decode", m, kDecodeLengths, threads);
  }
  add_decode<GqaMech, Eigen::bfloat16>("decode_bf16", mha_mech(), {4096, 16384, 65536}, threads);
  add_decode<GqaMech, Eigen::bfloat16>("decode_bf16", gqa_mech(), {16384, 65536}, threads);
  add_decode<GqaMech, Eigen::bfloat16>("decode_bf16", mqa_mech(), {16384, 65536}, threads);
  // The same steps with DecodeArithmetic::bf16_dot (where the build has AVX512-BF16; else
  // the same code as decode_bf16/). Not MHA, whose layer ignores it (one query row per
  // group).
  for (GqaMech m : {gqa_mech(), mqa_mech()}) {
    m.arithmetic = kvattn::DecodeArithmetic::bf16_dot;
    add_decode<GqaMech, Eigen::bfloat16>("decode_bf16dot", m, {16384, 65536}, threads);
  }
  // After decode_bf16/ (their vs_bf16 reads its times): one fp32 scale per 128-element row.
  for (const auto& m : mechs) {
    add_decode<GqaMech, kvattn::Int8<128>>("decode_int8", m, {65536}, threads);
    add_decode<GqaMech, kvattn::Fp8E4M3<128>>("decode_fp8", m, {65536}, threads);
  }
  for (const auto& m : mechs) add_layer_decode(m, kDecodeLengths, threads);
  for (const auto& m : mechs) add_expanded(m, {1024, 4096});
}

}  // namespace kvb
