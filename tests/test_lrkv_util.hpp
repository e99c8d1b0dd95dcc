// Helpers shared by the LRKV tests: random configurations and a prefill + decode run.
#pragma once

#include <cstdint>
#include <random>
#include <sstream>
#include <string>

#include "kvattn/attention/lrkv.hpp"
#include "test_util.hpp"

namespace kvattn::test {

/// A random small LRKV config in `mode` (r anywhere in 0 ... d_h, even for commuting).
inline LrkvConfig random_lrkv_config(std::mt19937_64& rng, LrkvRopeMode mode, bool key_norm) {
  auto pick = [&](Index lo, Index hi) { return std::uniform_int_distribution<Index>(lo, hi)(rng); };
  LrkvConfig c;
  c.n_heads = pick(1, 6);
  const bool even =
      mode == LrkvRopeMode::shared || mode == LrkvRopeMode::full || mode == LrkvRopeMode::commuting;
  c.head_dim = even ? 2 * pick(1, 8) : pick(1, 12);
  c.d_model = pick(1, 40);
  c.rank = pick(0, c.head_dim);
  if (mode == LrkvRopeMode::commuting) c.rank -= c.rank % 2;
  c.rope_mode = mode;
  if (mode != LrkvRopeMode::none) {
    c.rope.layout = pick(0, 1) == 0 ? RopeLayout::half_split : RopeLayout::interleaved;
    c.rope.theta = pick(0, 1) == 0 ? 10000.0 : 50.0;  // 50: fast-turning planes
    c.rope.position_offset = pick(0, 40);
  }
  if (mode == LrkvRopeMode::decoupled) c.rope_dim = 2 * pick(1, 4);
  c.key_norm = key_norm;
  return c;
}

inline std::string describe_case(const LrkvConfig& c) {
  std::ostringstream out;
  out << "d_model " << c.d_model << ", H " << c.n_heads << ", d_h " << c.head_dim << ", r "
      << c.rank << ", rope_mode " << to_string(c.rope_mode) << ", layout "
      << (c.rope.layout == RopeLayout::half_split
              ? "half_split"
              : (c.rope.layout == RopeLayout::interleaved ? "interleaved" : "none"))
      << ", theta " << c.rope.theta << ", offset " << c.rope.position_offset << ", d_R "
      << c.rope_dim << ", key_norm " << c.key_norm;
  return out.str();
}

/// Prefill of the first `prompt` rows of x, then one decode per remaining row; returns
/// every output row (L x d), as the factored path computes it.
template <class T, class S = T>
RowMatrix<T> run_factored(const LrkvLayer<T>& layer, const RowMatrix<T>& x, Index prompt) {
  auto cache = layer.template make_cache<S>();
  RowMatrix<T> out(x.rows(), layer.config().d_model);
  if (prompt > 0) out.topRows(prompt) = layer.prefill(x.topRows(prompt), cache);
  for (Index i = prompt; i < x.rows(); ++i) out.row(i) = layer.decode(x.row(i), cache);
  return out;
}

}  // namespace kvattn::test
