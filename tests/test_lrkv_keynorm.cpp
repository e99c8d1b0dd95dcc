// [equivalence][lrkv] for the key norm: RMSNorm of each head's full key, exact in
// factored form through one cached RMS per head per token. The model is also written
// here as plain scalar loops (its own RoPE, its own softmax), independent of both the
// expanded reference and the factored path, and checked against both.
#include <catch2/catch.hpp>

#include <cmath>
#include <type_traits>
#include <vector>

#include "kvattn/attention/lrkv.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "test_lrkv_util.hpp"
#include "test_util.hpp"

using namespace kvattn;
using Catch::Matchers::Contains;

static_assert(std::is_same_v<LrkvCache<float>::norm_type, float>);
static_assert(std::is_same_v<LrkvCache<double, float>::norm_type, float>);
static_assert(std::is_same_v<LrkvCache<double>::norm_type, double>);

namespace {

using Vec = std::vector<double>;

double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// RoPE written out: plane i turns by position * theta^(-2i/n).
Vec rotate(Vec v, double position, RopeLayout layout, double theta) {
  const std::size_t n = v.size();
  for (std::size_t i = 0; i < n / 2; ++i) {
    const double angle =
        position * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(n));
    const std::size_t a = layout == RopeLayout::half_split ? i : 2 * i;
    const std::size_t b = layout == RopeLayout::half_split ? i + n / 2 : 2 * i + 1;
    const double x = v[a], y = v[b];
    v[a] = x * std::cos(angle) - y * std::sin(angle);
    v[b] = x * std::sin(angle) + y * std::cos(angle);
  }
  return v;
}

// x_t W[:, first ... first+width) as a vector.
Vec project(const RowMatrix<double>& x, Index t, const RowMatrix<double>& w, Index first,
            Index width) {
  Vec out(static_cast<std::size_t>(width), 0.0);
  for (Index j = 0; j < width; ++j) {
    for (Index m = 0; m < x.cols(); ++m)
      out[static_cast<std::size_t>(j)] += x(t, m) * w(m, first + j);
  }
  return out;
}

// B[:, first ... first+r) z, a d_h vector.
Vec expand(const RowMatrix<double>& b, Index first, const Vec& z) {
  Vec out(static_cast<std::size_t>(b.rows()), 0.0);
  for (Index j = 0; j < b.rows(); ++j) {
    for (std::size_t l = 0; l < z.size(); ++l) {
      out[static_cast<std::size_t>(j)] += b(j, first + static_cast<Index>(l)) * z[l];
    }
  }
  return out;
}

// The LRKV model of seed 000 plus issue 4's RoPE modes and key norm, as plain loops.
RowMatrix<double> plain_model(const LrkvConfig& c, const LrkvWeights<double>& w,
                              const RowMatrix<double>& x) {
  const Index L = x.rows(), dh = c.head_dim, r = c.rank, dr = c.rope_dim;
  const double scale =
      1.0 / std::sqrt(static_cast<double>(dh + (c.rope_mode == LrkvRopeMode::decoupled ? dr : 0)));
  auto pos = [&](Index i) { return static_cast<double>(c.rope.position_offset + i); };
  auto rot = [&](const Vec& v, Index i) { return rotate(v, pos(i), c.rope.layout, c.rope.theta); };
  RowMatrix<double> out = RowMatrix<double>::Zero(L, c.d_model);
  for (Index h = 0; h < c.n_heads; ++h) {
    for (Index i = 0; i < L; ++i) {
      const Vec q = project(x, i, w.w_q, h * dh, dh);
      Vec logits;
      for (Index t = 0; t <= i; ++t) {
        Vec ks = project(x, t, w.w_k_shared, 0, dh);
        Vec kr = expand(w.basis_k, h * r, project(x, t, w.u_k, h * r, r));
        if (c.key_norm) {
          double sum = 0;
          for (Index j = 0; j < dh; ++j) sum += std::pow(ks[j] + kr[j], 2);
          const double rho = std::sqrt(sum / static_cast<double>(dh) + c.key_norm_epsilon);
          for (Index j = 0; j < dh; ++j) {
            ks[j] = w.key_norm_gain(j) * ks[j] / rho;
            kr[j] = w.key_norm_gain(j) * kr[j] / rho;
          }
        }
        Vec k(static_cast<std::size_t>(dh));
        for (Index j = 0; j < dh; ++j) k[j] = ks[j] + kr[j];
        double logit = 0;
        switch (c.rope_mode) {
          case LrkvRopeMode::none:
            logit = dot(q, k);
            break;
          case LrkvRopeMode::full:
          case LrkvRopeMode::commuting:
            logit = dot(rot(q, i), rot(k, t));
            break;
          case LrkvRopeMode::shared:
            logit = dot(rot(q, i), rot(ks, t)) + dot(q, kr);
            break;
          case LrkvRopeMode::decoupled:
            logit = dot(q, k) + dot(rot(project(x, i, w.w_qr, h * dr, dr), i),
                                    rot(project(x, t, w.w_kr, 0, dr), t));
            break;
        }
        logits.push_back(scale * logit);
      }
      double top = logits[0];
      for (const double l : logits) top = std::max(top, l);
      double total = 0;
      for (double& l : logits) total += (l = std::exp(l - top));
      Vec o(static_cast<std::size_t>(dh), 0.0);
      for (Index t = 0; t <= i; ++t) {
        const Vec vs = project(x, t, w.w_v_shared, 0, dh);
        const Vec vr = expand(w.basis_v, h * r, project(x, t, w.u_v, h * r, r));
        for (Index j = 0; j < dh; ++j) o[j] += logits[t] / total * (vs[j] + vr[j]);
      }
      for (Index n = 0; n < c.d_model; ++n) {
        for (Index j = 0; j < dh; ++j) out(i, n) += o[j] * w.w_o(h * dh + j, n);
      }
    }
  }
  return out;
}

}  // namespace

TEST_CASE("Plain-loop LRKV model equals the reference and the factored path",
          "[equivalence][lrkv]") {
  for (const LrkvRopeMode mode : {LrkvRopeMode::none, LrkvRopeMode::shared, LrkvRopeMode::decoupled,
                                  LrkvRopeMode::commuting, LrkvRopeMode::full}) {
    for (const bool key_norm : {true, false}) {
      for (const RopeLayout layout : {RopeLayout::half_split, RopeLayout::interleaved}) {
        LrkvConfig c{7, 2, 6, 2, mode};
        if (mode != LrkvRopeMode::none) c.rope = {layout, 30.0, 5};
        if (mode == LrkvRopeMode::decoupled) c.rope_dim = 4;
        c.key_norm = key_norm;
        const auto layer = LrkvLayer<double>::random(c, 17, 0.7);
        const RowMatrix<double> x = test::random_input<double>(9, c.d_model, 18);
        const RowMatrix<double> expected = plain_model(c, layer.weights(), x);
        INFO(test::describe_case(c));
        const double err_ref = test::relative_error(reference::forward(layer, x), expected);
        CAPTURE(err_ref);
        CHECK(err_ref <= 1e-12);
        if (c.factored_exact()) {
          const double err = test::relative_error(test::run_factored(layer, x, 4), expected);
          CAPTURE(err);
          CHECK(err <= 1e-12);
        }
        if (mode == LrkvRopeMode::none) break;  // the layout is unused
      }
    }
  }
}

TEST_CASE("The cache holds each head's key RMS of the materialized new key, in >= fp32",
          "[equivalence][lrkv]") {
  LrkvConfig c{9, 3, 8, 3, LrkvRopeMode::shared, {RopeLayout::interleaved, 10000.0, 0}};
  c.key_norm = true;
  const auto layer_d = LrkvLayer<double>::random(c, 2, 0.7);
  const LrkvLayer<float> layer_f(c, layer_d.weights().cast<float>());
  const RowMatrix<double> x = test::random_input<double>(11, c.d_model, 3);
  auto cache_d = layer_d.make_cache();
  auto cache_f = layer_f.make_cache();
  layer_d.prefill(x.topRows(6), cache_d);
  layer_f.prefill(x.topRows(6).cast<float>(), cache_f);
  for (Index t = 6; t < 11; ++t) {
    layer_d.decode(x.row(t), cache_d);
    layer_f.decode(x.row(t).cast<float>(), cache_f);
  }
  const auto& w = layer_d.weights();
  for (Index t = 0; t < 11; ++t) {
    for (Index h = 0; h < c.n_heads; ++h) {
      const Vec ks = project(x, t, w.w_k_shared, 0, c.head_dim);
      const Vec kr = expand(w.basis_k, h * c.rank, project(x, t, w.u_k, h * c.rank, c.rank));
      double sum = 0;
      for (Index j = 0; j < c.head_dim; ++j) sum += std::pow(ks[j] + kr[j], 2);
      const double rho = std::sqrt(sum / static_cast<double>(c.head_dim) + c.key_norm_epsilon);
      CAPTURE(t, h, rho);
      CHECK(std::abs(cache_d.key_rms()(t, h) - rho) <= 1e-14 * rho);
      CHECK(std::abs(static_cast<double>(cache_f.key_rms()(t, h)) - rho) <= 1e-6 * rho);
    }
  }
  // H fp32 scalars per token are part of the cache, and of its byte count.
  CHECK(cache_f.elements_per_token() == 2 * (8 + 3 * 3) + 3);
  CHECK(cache_f.bytes() == 11u * (2u * (8u + 3u * 3u) * sizeof(float) + 3u * sizeof(float)));
  LrkvCache<double, float> narrow(c);
  CHECK(narrow.elements_per_token() == 2 * (8 + 3 * 3) + 3);
}

TEST_CASE("Commuting RoPE with key norm needs a gain equal on both dims of each plane",
          "[equivalence][lrkv]") {
  for (const RopeLayout layout : {RopeLayout::half_split, RopeLayout::interleaved}) {
    LrkvConfig c{8, 2, 8, 4, LrkvRopeMode::commuting, {layout, 10000.0, 0}};
    c.key_norm = true;
    auto weights = LrkvWeights<double>::random(c, 4);
    REQUIRE_NOTHROW(LrkvLayer<double>(c, weights));
    const auto [a, b] = detail::rope_plane_dims(layout, 8, 2);
    weights.key_norm_gain(b) = weights.key_norm_gain(a) * 1.5;
    REQUIRE_THROWS_AS(LrkvLayer<double>(c, weights), config_error);
    REQUIRE_THROWS_WITH(LrkvLayer<double>(c, weights),
                        Contains("key_norm_gain") && Contains("rotary plane"));
    // Other modes take any gain.
    c.rope_mode = LrkvRopeMode::shared;
    weights = LrkvWeights<double>::random(c, 4);
    weights.key_norm_gain(b) = weights.key_norm_gain(a) * 1.5;
    REQUIRE_NOTHROW(LrkvLayer<double>(c, weights));
  }
}
