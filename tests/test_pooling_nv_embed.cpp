// NV-Embed's released-model latent attention layer against plain loops written here.
#include <catch2/catch.hpp>
#include <cmath>

#include "kvattn/pooling/nv_embed_pooling.hpp"
#include "test_util.hpp"

using namespace kvattn;
using M = RowMatrix<double>;

namespace {

M mm(const M& a, const M& b) {  // triple loop, no Eigen product
  M c = M::Zero(a.rows(), b.cols());
  for (Index i = 0; i < a.rows(); ++i)
    for (Index k = 0; k < a.cols(); ++k)
      for (Index j = 0; j < b.cols(); ++j) c(i, j) += a(i, k) * b(k, j);
  return c;
}

M ln(const M& x, const RowVector<double>& g, const RowVector<double>& b, double eps) {
  M y(x.rows(), x.cols());
  for (Index i = 0; i < x.rows(); ++i) {
    double mean = 0, var = 0;
    for (Index j = 0; j < x.cols(); ++j) mean += x(i, j) / double(x.cols());
    for (Index j = 0; j < x.cols(); ++j)
      var += (x(i, j) - mean) * (x(i, j) - mean) / double(x.cols());
    for (Index j = 0; j < x.cols(); ++j)
      y(i, j) = (x(i, j) - mean) / std::sqrt(var + eps) * g(j) + b(j);
  }
  return y;
}

RowVector<double> loop_pool(const NvEmbedPoolingConfig& c, const NvEmbedPoolingWeights<double>& w,
                            const M& x, const std::vector<bool>& keep) {
  const Index H = c.n_heads, dk = c.head_dim > 0 ? c.head_dim : c.d_model / H,
              m = c.ff_mult * c.d_model;
  const double s = c.softmax_scale > 0 ? c.softmax_scale : 1.0 / std::sqrt(double(dk));
  const M q = mm(ln(x, w.norm_x_gain, w.norm_x_bias, c.layer_norm_eps), w.w_q);
  const M dn = ln(w.dictionary, w.norm_d_gain, w.norm_d_bias, c.layer_norm_eps);
  const M k = mm(dn, w.w_k), v = mm(dn, w.w_v);
  M o = M::Zero(x.rows(), H * dk);
  for (Index i = 0; i < x.rows(); ++i) {
    for (Index h = 0; h < H; ++h) {
      std::vector<double> p(static_cast<std::size_t>(c.n_latents));
      double mx = -1e300, sum = 0;
      for (Index j = 0; j < c.n_latents; ++j) {
        double dot = 0;
        for (Index a = 0; a < dk; ++a) dot += q(i, h * dk + a) * k(j, h * dk + a);
        mx = std::max(mx, p[j] = s * dot);
      }
      for (auto& e : p) sum += (e = std::exp(e - mx));
      for (Index j = 0; j < c.n_latents; ++j)
        for (Index a = 0; a < dk; ++a) o(i, h * dk + a) += p[j] / sum * v(j, h * dk + a);
    }
  }
  const M h1 = mm(o, w.w_o) + x;
  M z = mm(ln(h1, w.norm_f_gain, w.norm_f_bias, c.layer_norm_eps), w.w_1);
  M gated(x.rows(), m);
  for (Index i = 0; i < x.rows(); ++i) {
    for (Index a = 0; a < m; ++a) {
      const double val = z(i, a) + w.b_1(a), gate = z(i, m + a) + w.b_1(m + a);
      gated(i, a) = val * 0.5 * gate * (1 + std::erf(gate / std::sqrt(2.0)));
    }
  }
  const M h2 = mm(gated, w.w_2) + h1;
  RowVector<double> e = RowVector<double>::Zero(c.d_model);
  double n = 0;
  for (Index i = 0; i < x.rows(); ++i) {
    if (!keep[i]) continue;
    n += 1;
    for (Index j = 0; j < c.d_model; ++j) e(j) += h2(i, j) + w.b_2(j);
  }
  e /= n;
  if (c.normalize_output) e /= std::sqrt(e.cwiseProduct(e).sum());
  return e;
}

}  // namespace

TEST_CASE("NV-Embed released layer equals plain loops", "[pooling]") {
  struct Case {
    Index L, d, r, H, dk, mult;
    bool normalize;
  };
  for (const Case k : {Case{1, 4, 1, 1, 0, 1, true}, Case{7, 12, 5, 3, 0, 2, true},
                       Case{11, 10, 9, 2, 7, 4, false}}) {
    CAPTURE(k.L, k.d, k.r, k.H, k.dk, k.mult, k.normalize);
    NvEmbedPoolingConfig c;
    c.d_model = k.d;
    c.n_latents = k.r;
    c.n_heads = k.H;
    c.head_dim = k.dk;
    c.ff_mult = k.mult;
    c.normalize_output = k.normalize;
    const auto layer = NvEmbedPooling<double>::random(c, 40 + k.L);
    const M x = test::random_input<double>(k.L, k.d, 3 + k.L);
    std::vector<bool> keep(static_cast<std::size_t>(k.L), true);
    if (k.L > 2) keep[0] = keep[1] = false;  // an instruction prefix
    const RowVector<double> want = loop_pool(c, layer.weights(), x, keep);
    CHECK(test::relative_error(layer.pool(x, keep), want) < 1e-12);
    if (k.normalize) CHECK(layer.pool(x).norm() == Approx(1.0).epsilon(1e-14));
  }
}

TEST_CASE("NV-Embed released layer errors", "[pooling][reliability]") {
  NvEmbedPoolingConfig c;
  c.d_model = 6;
  c.n_latents = 3;
  c.n_heads = 4;
  CHECK_THROWS_WITH(c.validate(),
                    Catch::Matchers::Contains("d_model (6) must be divisible by n_heads (4)"));
  c.n_heads = 2;
  const auto layer = NvEmbedPooling<double>::random(c, 1);
  CHECK_THROWS_AS(layer.pool(M(0, 6)), pooling_error);
  CHECK_THROWS_AS(layer.pool(M::Zero(3, 6), TokenMask(3, false)), pooling_error);
  CHECK_THROWS_WITH(layer.pool(M::Zero(3, 5)), Catch::Matchers::Contains("expected (any x 6)"));
  auto bad = layer.weights();
  bad.w_k.resize(6, 4);
  CHECK_THROWS_WITH(NvEmbedPooling<double>(c, bad),
                    Catch::Matchers::Contains("w_k has shape (6 x 4), expected (6 x 6)"));
}
