// Random MLA configurations and helpers shared by the MLA tests.
#pragma once

#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvattn/attention/mla.hpp"
#include "kvattn/config/mla_config.hpp"

namespace kvattn::test {

struct MlaCase {
  MlaConfig config;
  Index length = 1;  // tokens in the whole sequence
  Index prompt = 1;  // of which prefilled at once (0 ... length); the rest is decoded
  std::uint64_t seed = 0;

  std::string describe() const {
    const MlaConfig& c = config;
    std::ostringstream s;
    s << "d_model " << c.d_model << ", H " << c.n_heads << ", d_c " << c.kv_rank << ", d_c' "
      << c.q_rank << ", d_nope " << c.qk_nope_dim << ", d_R " << c.rope_dim << ", d_v " << c.v_dim
      << ", q_norm " << c.q_norm << ", kv_norm " << c.kv_norm << ", rope "
      << static_cast<int>(c.rope.layout) << " theta " << c.rope.theta << " offset "
      << c.rope.position_offset << ", yarn " << c.yarn.enabled << " (factor " << c.yarn.factor
      << ", original " << c.yarn.original_max_position << ", mscale " << c.yarn.mscale << "/"
      << c.yarn.mscale_all_dim << "), L " << length << ", prompt " << prompt << ", seed " << seed;
    return s.str();
  }
};

/// `count` reproducible random cases: with and without query compression, with and
/// without latent norms, d_v != d_nope, RoPE off / half-split / interleaved with a
/// position offset, YaRN on/off (with a short original context so positions run past
/// it), d_R = 0 sometimes, L from 1 to 512 and prompts from 0 (decode only) to L.
/// Long sequences get narrow layers so the double reference stays quick.
inline std::vector<MlaCase> random_mla_cases(int count, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto uniform = [&rng](Index lo, Index hi) {
    return std::uniform_int_distribution<Index>(lo, hi)(rng);
  };
  auto real = [&rng](double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(rng);
  };
  std::vector<MlaCase> cases;
  for (int i = 0; i < count; ++i) {
    MlaCase k;
    MlaConfig& c = k.config;
    k.seed = seed * 1000 + static_cast<std::uint64_t>(i);
    const bool long_sequence = i % 4 == 3;
    k.length = long_sequence ? uniform(65, 512) : uniform(1, 64);
    if (i == 0) k.length = 1;
    if (i == 1) k.length = 512;
    c.n_heads = long_sequence ? uniform(1, 4) : uniform(1, 8);
    c.kv_rank = long_sequence ? uniform(2, 24) : uniform(1, 48);
    c.q_rank = i % 2 == 0 ? 0 : uniform(1, 40);
    c.qk_nope_dim = uniform(1, long_sequence ? 16 : 24);
    c.v_dim = i % 3 == 0 ? c.qk_nope_dim : uniform(1, 24);  // d_v != d_nope mostly
    c.d_model = uniform(3, 64);
    c.q_norm = c.q_rank > 0 && i % 4 != 1;
    c.kv_norm = i % 5 != 2;
    const int rope = i % 3;
    c.rope.layout = rope == 0   ? RopeLayout::none
                    : rope == 1 ? RopeLayout::half_split
                                : RopeLayout::interleaved;
    c.rope_dim = rope == 0 ? (i % 2 == 0 ? 0 : uniform(1, 7)) : 2 * uniform(1, 8);
    c.rope.theta = i % 2 == 0 ? 10000.0 : 500000.0;
    c.rope.position_offset = i % 5 == 0 ? 0 : uniform(1, 3000);
    if (rope != 0 && i % 4 != 2) {
      c.yarn.enabled = true;
      c.yarn.factor = real(1.0, 40.0);
      c.yarn.original_max_position = uniform(16, 512);
      c.yarn.beta_fast = 32.0;
      c.yarn.beta_slow = 1.0;
      c.yarn.mscale = real(0.0, 1.2);
      c.yarn.mscale_all_dim = i % 3 == 1 ? 0.0 : real(0.0, 1.2);
    }
    k.prompt = i % 7 == 5 ? 0 : uniform(1, k.length);
    cases.push_back(k);
  }
  return cases;
}

/// Prefill of x's first `prompt` rows, then one decode per remaining row, stacked L x d.
template <class T, class S>
RowMatrix<T> prefill_then_decode(const MlaLayer<T>& layer, const RowMatrix<T>& x, Index prompt,
                                 MlaCache<T, S>& cache) {
  RowMatrix<T> y(x.rows(), layer.config().d_model);
  y.topRows(prompt) = layer.prefill(x.topRows(prompt), cache);
  RowVector<T> out(layer.config().d_model);
  for (Index t = prompt; t < x.rows(); ++t) {
    layer.decode(x.row(t), cache, out);
    y.row(t) = out;
  }
  return y;
}

}  // namespace kvattn::test
