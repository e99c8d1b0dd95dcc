// Small layer configs shared by the window tests (test_window_layers.cpp,
// test_window_cache.cpp): narrow enough that the double reference is quick over
// sequences many windows long, with RoPE at an offset so positions matter.
#pragma once

#include "kvattn/config/gqa_config.hpp"
#include "kvattn/config/lrkv_config.hpp"
#include "kvattn/config/mla_config.hpp"

namespace kvattn::test {

inline GqaConfig window_gqa_case(Index n_kv = 2) {
  return gqa_config(24, 4, 8, n_kv, RopeConfig{RopeLayout::half_split, 10000.0, 5});
}

inline MlaConfig window_mla_case() {
  MlaConfig c;
  c.d_model = 24;
  c.n_heads = 3;
  c.kv_rank = 10;
  c.q_rank = 12;
  c.qk_nope_dim = 6;
  c.rope_dim = 4;
  c.v_dim = 5;
  c.rope = {RopeLayout::interleaved, 10000.0, 2};
  return c;
}

inline LrkvConfig window_lrkv_case() {
  LrkvConfig c{24, 3, 8, 3, LrkvRopeMode::shared};
  c.rope = {RopeLayout::half_split, 10000.0, 1};
  c.key_norm = true;
  return c;
}

}  // namespace kvattn::test
