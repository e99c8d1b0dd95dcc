// Prefill benchmarks: layer.prefill(x, cache, threads) of L tokens on a cleared cache
// (projections, cache append, tiled causal attention, W_O) for MHA, GQA, MQA, MLA
// (V2-Lite shape, the formulation prefill picks automatically) and LRKV.
#include "bench_drivers.hpp"
#include "mech_gqa.hpp"
#include "mech_lrkv.hpp"
#include "mech_mla.hpp"

namespace kvb {

void register_prefill() {
  const std::vector<int> threads = thread_counts();
  const std::vector<Index> lengths = {512, 2048, 8192};
  add_prefill(mha_mech(), lengths, threads);
  add_prefill(gqa_mech(), lengths, threads);
  add_prefill(mqa_mech(), lengths, threads);
  add_prefill(mla_mech(), lengths, threads);
  add_prefill(lrkv_mech(), lengths, threads);
}

}  // namespace kvb
