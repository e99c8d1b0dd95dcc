// Layers for the MPI tests (test_context_parallel, test_head_parallel): 12 query heads,
// so that 1, 2, 3 and 4 ranks all divide them, and every option that changes how a
// shard's part enters the result (biases, sink logits, soft-cap, RoPE offsets, YaRN-free
// rope in MLA, LRKV's decoupled rope and key norm).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"

namespace kvattn::test {

inline int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

inline int world_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

inline GqaConfig mpi_gqa_config(Index kv_heads, bool sinks) {
  GqaConfig c;
  c.d_model = 20;
  c.n_heads = 12;
  c.n_kv_heads = kv_heads;
  c.head_dim = 6;
  c.qkv_bias = true;
  c.rope.layout = RopeLayout::half_split;
  c.rope.position_offset = 7;
  c.sink_logits = sinks;
  c.logit_softcap = sinks ? 0.0 : 4.0;
  return c;
}

inline MlaConfig mpi_mla_config() {
  MlaConfig c;
  c.d_model = 16;
  c.n_heads = 12;
  c.kv_rank = 10;
  c.q_rank = 8;
  c.q_norm = true;
  c.kv_norm = true;
  c.qk_nope_dim = 4;
  c.rope_dim = 4;
  c.v_dim = 3;
  c.rope.layout = RopeLayout::interleaved;
  c.sink_logits = true;
  return c;
}

inline LrkvConfig mpi_lrkv_config() {
  LrkvConfig c;
  c.d_model = 16;
  c.n_heads = 12;
  c.head_dim = 4;
  c.rank = 2;
  c.rope_mode = LrkvRopeMode::decoupled;
  c.rope.layout = RopeLayout::half_split;
  c.rope.position_offset = 2;
  c.rope_dim = 2;
  c.key_norm = true;
  return c;
}

}  // namespace kvattn::test
