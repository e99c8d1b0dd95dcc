// [equivalence][mha][mqa]: MHA and MQA computed by plain loops written here equal
// the GQA layer with n_kv == H and n_kv == 1.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "kvattn/attention/gqa.hpp"
#include "test_util.hpp"

using namespace kvattn;

namespace {

// Half-split RoPE of one head vector by the textbook formula.
void rotate_half_split(std::vector<double>& v, double position, double theta) {
  const std::size_t half = v.size() / 2;
  for (std::size_t i = 0; i < half; ++i) {
    const double angle =
        position * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(v.size()));
    const double a = v[i], b = v[i + half];
    v[i] = a * std::cos(angle) - b * std::sin(angle);
    v[i + half] = a * std::sin(angle) + b * std::cos(angle);
  }
}

// Causal attention with loops only: head h reads KV head kv_head_of(h).
template <class KvHeadOf>
RowMatrix<double> plain_attention(const GqaConfig& c, const GqaWeights<double>& w,
                                  const RowMatrix<double>& x, KvHeadOf kv_head_of) {
  const Index L = x.rows(), d = c.d_model, dh = c.head_dim;
  auto project = [&](const RowMatrix<double>& weight, Index token, Index column0) {
    std::vector<double> out(static_cast<std::size_t>(dh), 0.0);
    for (Index j = 0; j < dh; ++j) {
      for (Index k = 0; k < d; ++k)
        out[static_cast<std::size_t>(j)] += x(token, k) * weight(k, column0 + j);
    }
    if (c.rope.enabled() && &weight != &w.w_v) {
      rotate_half_split(out, static_cast<double>(c.rope.position_offset + token), c.rope.theta);
    }
    return out;
  };
  RowMatrix<double> heads = RowMatrix<double>::Zero(L, c.n_heads * dh);
  for (Index h = 0; h < c.n_heads; ++h) {
    const Index g = kv_head_of(h);
    for (Index i = 0; i < L; ++i) {
      const auto q = project(w.w_q, i, h * dh);
      std::vector<double> weights(static_cast<std::size_t>(i + 1));
      double max_logit = -1e300, sum = 0;
      for (Index t = 0; t <= i; ++t) {
        const auto k = project(w.w_k, t, g * dh);
        double dot = 0;
        for (Index j = 0; j < dh; ++j)
          dot += q[static_cast<std::size_t>(j)] * k[static_cast<std::size_t>(j)];
        weights[static_cast<std::size_t>(t)] = dot / std::sqrt(static_cast<double>(dh));
        max_logit = std::max(max_logit, weights[static_cast<std::size_t>(t)]);
      }
      for (auto& v : weights) sum += (v = std::exp(v - max_logit));
      for (Index t = 0; t <= i; ++t) {
        const auto v = project(w.w_v, t, g * dh);
        for (Index j = 0; j < dh; ++j) {
          heads(i, h * dh + j) +=
              weights[static_cast<std::size_t>(t)] / sum * v[static_cast<std::size_t>(j)];
        }
      }
    }
  }
  RowMatrix<double> y = RowMatrix<double>::Zero(L, d);
  for (Index i = 0; i < L; ++i) {
    for (Index k = 0; k < d; ++k) {
      for (Index j = 0; j < c.n_heads * dh; ++j) y(i, k) += heads(i, j) * w.w_o(j, k);
    }
  }
  return y;
}

void check_against_plain(const GqaConfig& config, Index length, std::uint64_t seed) {
  const auto layer = GqaLayer<double>::random(config, seed);
  const RowMatrix<double> x = kvattn::test::random_input<double>(length, config.d_model, seed);
  auto cache = layer.make_cache();
  const Index prompt = length / 2;
  RowMatrix<double> y(length, config.d_model);
  y.topRows(prompt) = layer.prefill(x.topRows(prompt), cache);
  for (Index t = prompt; t < length; ++t) y.row(t) = layer.decode(x.row(t), cache);
  const Index group = config.n_heads / config.n_kv_heads;
  const RowMatrix<double> expected =
      plain_attention(config, layer.weights(), x, [group](Index h) { return h / group; });
  const double error = kvattn::test::relative_error(y, expected);
  INFO("H " << config.n_heads << ", n_kv " << config.n_kv_heads << ", error " << error);
  CHECK(error <= 1e-12);
}

}  // namespace

TEST_CASE("MHA written as a per-head loop equals GQA with n_kv == H", "[equivalence][mha]") {
  check_against_plain(mha_config(24, 4, 8), 19, 3);
  check_against_plain(mha_config(40, 5, 6, {RopeLayout::half_split, 10000.0, 17}), 23, 4);
}

TEST_CASE("MQA written as a loop over one shared KV head equals GQA with n_kv == 1",
          "[equivalence][mqa]") {
  check_against_plain(mqa_config(24, 6, 8), 21, 5);
  check_against_plain(mqa_config(20, 3, 10, {RopeLayout::half_split, 500000.0, 40}), 17, 6);
}

TEST_CASE("GQA with n_kv in between equals the loop with repeat-interleaved groups",
          "[equivalence][gqa]") {
  check_against_plain(gqa_config(32, 6, 8, 2, {RopeLayout::half_split, 10000.0, 5}), 18, 7);
  check_against_plain(gqa_config(32, 6, 8, 3), 9, 8);
}
