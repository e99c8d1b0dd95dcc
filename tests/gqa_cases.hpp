// Random GQA-family configurations for the equivalence tests.
#pragma once

#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvattn/config/gqa_config.hpp"

namespace kvattn::test {

struct GqaCase {
  GqaConfig config;
  Index length = 1;  // tokens in the whole sequence
  Index prompt = 1;  // of which prefilled at once; the rest is decoded token by token
  std::uint64_t seed = 0;

  std::string describe() const {
    std::ostringstream s;
    s << "d_model " << config.d_model << ", H " << config.n_heads << ", n_kv " << config.n_kv_heads
      << ", d_h " << config.head_dim << ", bias " << config.qkv_bias << ", rope "
      << static_cast<int>(config.rope.layout) << " offset " << config.rope.position_offset << ", L "
      << length << ", prompt " << prompt << ", seed " << seed;
    return s.str();
  }
};

/// `count` reproducible random cases: H up to 16, every divisor as n_kv (cycled),
/// d_h in {8, 16, 32, 59, 64, 128}, d_model not always H * d_h, L from 1 to 512,
/// RoPE off / half-split / interleaved with a position offset, biases on and off.
/// Long sequences get narrow layers so the double reference stays quick.
inline std::vector<GqaCase> random_gqa_cases(int count, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto uniform = [&rng](Index lo, Index hi) {
    return std::uniform_int_distribution<Index>(lo, hi)(rng);
  };
  const Index head_dims[] = {8, 16, 32, 59, 64, 128};
  std::vector<GqaCase> cases;
  for (int i = 0; i < count; ++i) {
    GqaCase c;
    c.seed = seed * 1000 + static_cast<std::uint64_t>(i);
    const bool long_sequence = i % 4 == 3;
    c.length = long_sequence ? uniform(65, 512) : uniform(1, 64);
    if (i == 0) c.length = 1;
    if (i == 1) c.length = 512;
    Index& heads = c.config.n_heads;
    heads = uniform(1, 16);
    c.config.head_dim = head_dims[uniform(0, 5)];
    if (long_sequence) {
      while (heads * c.config.head_dim > 256) {
        heads > 1 ? heads /= 2 : c.config.head_dim = 16;
      }
    }
    std::vector<Index> divisors;
    for (Index g = 1; g <= heads; ++g) {
      if (heads % g == 0) divisors.push_back(g);
    }
    c.config.n_kv_heads = divisors[static_cast<std::size_t>(i) % divisors.size()];
    c.config.d_model =
        i % 3 == 0 ? heads * c.config.head_dim : uniform(4, 96);  // not always H * d_h
    c.config.qkv_bias = i % 2 == 1;
    const bool even = c.config.head_dim % 2 == 0;
    const int rope = even ? i % 3 : 0;
    c.config.rope.layout = rope == 0   ? RopeLayout::none
                           : rope == 1 ? RopeLayout::half_split
                                       : RopeLayout::interleaved;
    c.config.rope.theta = i % 2 == 0 ? 10000.0 : 500000.0;
    c.config.rope.position_offset = i % 5 == 0 ? 0 : uniform(1, 3000);
    c.prompt = uniform(1, c.length);
    cases.push_back(c);
  }
  return cases;
}

}  // namespace kvattn::test
