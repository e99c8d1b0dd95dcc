// Pooling: the seed's toy example (seed 002, Chapter 5), multi-head latent pooling
// against plain loops written here, mean / last-token pooling, masks, and errors.
#include <catch2/catch.hpp>
#include <cmath>
#include <vector>

#include "kvattn/pooling/latent_pooling.hpp"
#include "kvattn/pooling/simple_pooling.hpp"
#include "test_util.hpp"

using namespace kvattn;

// Both the type and the message of the exception.
#define CHECK_THROWS_TYPE_WITH(expr, type, text) \
  CHECK_THROWS_AS(expr, type);                   \
  CHECK_THROWS_WITH(expr, Catch::Matchers::Contains(text))

namespace {

LatentPooling<double> toy_layer() {
  LatentPoolingConfig c;
  c.d_model = 2;
  c.n_latents = 2;
  c.n_heads = 1;
  c.mlp = false;
  c.softmax_scale = 1.0;  // the seed's toy is unscaled
  LatentPoolingWeights<double> w;
  w.dictionary = RowMatrix<double>::Identity(2, 2);
  return LatentPooling<double>(c, w);
}

RowMatrix<double> toy_tokens() {
  RowMatrix<double> x(2, 2);
  x << 2, 0, 0, 2;
  return x;
}

// Latent pooling computed with scalar loops only: per head, logits, softmax, mix,
// then the MLP with an erf GELU, then the mean over kept tokens.
std::vector<double> loop_pool(const LatentPoolingConfig& c, const LatentPoolingWeights<double>& w,
                              const RowMatrix<double>& x, const std::vector<bool>& keep) {
  const Index L = x.rows(), d = c.d_model, r = c.n_latents, H = c.n_heads, dh = d / H;
  const double scale = c.softmax_scale > 0 ? c.softmax_scale : 1.0 / std::sqrt(double(dh));
  std::vector<double> pooled(static_cast<std::size_t>(d), 0.0);
  double kept = 0;
  for (Index i = 0; i < L; ++i) kept += keep[i] ? 1 : 0;
  for (Index i = 0; i < L; ++i) {
    if (!keep[i]) continue;
    std::vector<double> o(static_cast<std::size_t>(d), 0.0);
    for (Index h = 0; h < H; ++h) {
      std::vector<double> s(static_cast<std::size_t>(r));
      double mx = -1e300, sum = 0;
      for (Index j = 0; j < r; ++j) {
        double dot = 0;
        for (Index k = 0; k < dh; ++k) dot += x(i, h * dh + k) * w.dictionary(j, h * dh + k);
        s[j] = scale * dot;
        mx = std::max(mx, s[j]);
      }
      for (Index j = 0; j < r; ++j) sum += (s[j] = std::exp(s[j] - mx));
      for (Index j = 0; j < r; ++j) {
        for (Index k = 0; k < dh; ++k) o[h * dh + k] += s[j] / sum * w.dictionary(j, h * dh + k);
      }
    }
    const Index m = c.mlp_hidden > 0 ? c.mlp_hidden : d;
    std::vector<double> hid(static_cast<std::size_t>(m));
    for (Index a = 0; a < m; ++a) {
      double v = w.b_1(a);
      for (Index k = 0; k < d; ++k) v += o[k] * w.w_1(k, a);
      hid[a] = 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0)));
    }
    for (Index k = 0; k < d; ++k) {
      double v = w.b_2(k);
      for (Index a = 0; a < m; ++a) v += hid[a] * w.w_2(a, k);
      pooled[k] += v / kept;
    }
  }
  return pooled;
}

}  // namespace

TEST_CASE("seed toy: softmax rows 0.8808/0.1192 and mean pool [0.5, 0.5]", "[pooling]") {
  const LatentPooling<double> layer = toy_layer();
  const RowMatrix<double> x = toy_tokens();
  const double big = std::exp(2.0) / (std::exp(2.0) + 1.0);  // e^2/(e^2+1)
  REQUIRE(big == Approx(0.8808).margin(5e-5));
  const RowMatrix<double> p = layer.attention_weights(x, 0);
  CHECK(p(0, 0) == Approx(big).epsilon(1e-14));
  CHECK(p(0, 1) == Approx(1 - big).epsilon(1e-14));
  CHECK(p(1, 0) == Approx(1 - big).epsilon(1e-14));
  CHECK(p(1, 1) == Approx(big).epsilon(1e-14));
  // V = K = I, so each output row is its softmax row.
  const RowMatrix<double> o = layer.cross_attention(x);
  CHECK(test::max_abs_error(o, p) < 1e-15);
  const RowVector<double> pooled = layer.pool(x);
  CHECK(pooled(0) == Approx(0.5).epsilon(1e-14));
  CHECK(pooled(1) == Approx(0.5).epsilon(1e-14));
  // Dictionary usage: each entry receives 0.8808 + 0.1192 = 1 over the two tokens.
  const RowMatrix<double> usage = layer.dictionary_usage(x);
  CHECK(usage(0, 0) == Approx(1.0).epsilon(1e-14));
  CHECK(usage(0, 1) == Approx(1.0).epsilon(1e-14));
  // The default scale is 1/sqrt(d/H) = 1/sqrt(2): logits 2/sqrt(2) = sqrt(2) and 0.
  LatentPoolingConfig scaled = layer.config();
  scaled.softmax_scale = 0.0;
  const LatentPooling<double> default_layer(scaled, layer.weights());
  const double e = std::exp(std::sqrt(2.0));
  CHECK(default_layer.attention_weights(x, 0)(0, 0) == Approx(e / (e + 1)).epsilon(1e-14));
}

TEST_CASE("seed toy split into two heads of width 2", "[pooling]") {
  // Tokens and dictionary of width 4 whose two halves are the toy's: each head sees
  // only its slice, so both heads reproduce the toy softmax.
  LatentPoolingConfig c{4, 2, 2, 0, false, 1.0};
  LatentPoolingWeights<double> w;
  w.dictionary.resize(2, 4);
  w.dictionary << 1, 0, 1, 0, 0, 1, 0, 1;
  const LatentPooling<double> layer(c, w);
  RowMatrix<double> x(2, 4);
  x << 2, 0, 2, 0, 0, 2, 0, 2;
  const double big = std::exp(2.0) / (std::exp(2.0) + 1.0);
  for (Index h = 0; h < 2; ++h) {
    CHECK(layer.attention_weights(x, h)(0, 0) == Approx(big).epsilon(1e-14));
    CHECK(layer.attention_weights(x, h)(1, 1) == Approx(big).epsilon(1e-14));
  }
  const RowVector<double> pooled = layer.pool(x);
  for (Index k = 0; k < 4; ++k) CHECK(pooled(k) == Approx(0.5).epsilon(1e-14));
}

TEST_CASE("multi-head latent pooling equals plain loops", "[pooling]") {
  struct Case {
    Index L, d, r, H, m;
    double scale;
  };
  for (const Case k :
       {Case{1, 6, 1, 1, 0, 0.0}, Case{7, 12, 5, 3, 0, 0.0}, Case{13, 10, 11, 5, 7, 0.0},
        Case{5, 8, 3, 4, 0, 1.0}, Case{9, 15, 17, 3, 4, 0.3}}) {
    CAPTURE(k.L, k.d, k.r, k.H, k.m, k.scale);
    LatentPoolingConfig c{k.d, k.r, k.H, k.m, true, k.scale};
    const auto layer = LatentPooling<double>::random(c, 1000 + k.L);
    const RowMatrix<double> x = test::random_input<double>(k.L, k.d, 7 + k.d);
    std::vector<bool> keep(static_cast<std::size_t>(k.L), true);
    for (Index i = 0; i < k.L; i += 3) keep[i] = (k.L == 1);  // drop every third token
    for (const auto& mask : {keep, std::vector<bool>(static_cast<std::size_t>(k.L), true)}) {
      const std::vector<double> want = loop_pool(c, layer.weights(), x, mask);
      const RowVector<double> expected = Eigen::Map<const RowVector<double>>(want.data(), k.d);
      const RowVector<double> got = layer.pool(x, mask);
      CAPTURE(test::max_abs_error(got, expected));
      CHECK(test::relative_error(got, expected) < 1e-13);
      // Float compute against the double loops.
      const auto layer_f = LatentPooling<float>(
          c, {layer.weights().dictionary.cast<float>(), layer.weights().w_1.cast<float>(),
              layer.weights().b_1.cast<float>(), layer.weights().w_2.cast<float>(),
              layer.weights().b_2.cast<float>()});
      const RowMatrix<float> xf = x.cast<float>();
      CHECK(test::relative_error(layer_f.pool(xf, mask), expected) < 1e-5);
      // Token contributions add up to the pooled vector; dropped tokens contribute 0.
      const RowMatrix<double> terms = layer.token_contributions(x, mask);
      CHECK(test::relative_error(RowVector<double>(terms.colwise().sum()), expected) < 1e-13);
      for (Index i = 0; i < k.L; ++i) {
        if (!mask[i]) CHECK(terms.row(i).norm() == 0.0);
      }
      // Dictionary usage: each head's row sums to the number of kept tokens.
      const RowMatrix<double> usage = layer.dictionary_usage(x, mask);
      double kept = 0;
      for (bool b : mask) kept += b ? 1 : 0;
      for (Index h = 0; h < k.H; ++h) CHECK(usage.row(h).sum() == Approx(kept).epsilon(1e-13));
    }
  }
}

TEST_CASE("K = V is one dictionary matrix in memory", "[pooling]") {
  const auto layer = LatentPooling<double>::random({8, 4, 2, 0, true, 0.0}, 3);
  for (Index h = 0; h < 2; ++h) {
    CHECK(layer.keys(h).data() == layer.values(h).data());
    CHECK(layer.keys(h).data() == layer.weights().dictionary.data() + h * 4);
  }
  // NV-Embed's dictionary: 512 x 4096 = 2,097,152 parameters (seed 002, Chapter 5).
  CHECK(LatentPoolingConfig{4096, 512, 8, 0, true, 0.0}.dictionary_parameters() == 2097152);
}

TEST_CASE("mean and last-token pooling with masks", "[pooling]") {
  RowMatrix<double> x(4, 2);
  x << 1, 2, 3, 4, 5, 6, 7, 8;
  const RowVector<double> mean = mean_pool<double>(x);
  CHECK(mean(0) == 4.0);
  CHECK(mean(1) == 5.0);
  const RowVector<double> tail = mean_pool<double>(x, skip_prefix(4, 2));  // rows 2, 3
  CHECK(tail(0) == 6.0);
  CHECK(tail(1) == 7.0);
  CHECK(last_token_pool<double>(x)(0) == 7.0);
  const TokenMask no_eos{true, true, false, false};
  CHECK(last_token_index<double>(x, no_eos) == 1);
  CHECK(last_token_pool<double>(x, no_eos)(1) == 4.0);
  const RowVector<double> w = mean_pool_weights<double>(x, TokenMask{true, false, true, true});
  CHECK(w(0) == Approx(1.0 / 3));
  CHECK(w(1) == 0.0);
  CHECK(test::relative_error(RowVector<double>(w * x),
                             mean_pool<double>(x, {true, false, true, true})) < 1e-15);
  const RowVector<double> e = last_token_weights<double>(x);
  CHECK(e(3) == 1.0);
  CHECK(e.sum() == 1.0);
  RowMatrix<double> terms(2, 2);
  terms << 3, 4, 0, 5;  // norms 5 and 5
  CHECK(contribution_shares<double>(terms)(0) == 0.5);
}

TEST_CASE("pooling errors name what is wrong", "[pooling][reliability]") {
  const auto layer = LatentPooling<double>::random({6, 3, 2, 0, true, 0.0}, 1);
  const RowMatrix<double> x = test::random_input<double>(4, 6, 2);
  const RowMatrix<double> empty(0, 6);
  CHECK_THROWS_TYPE_WITH(layer.pool(empty), pooling_error, "no tokens (0 x 6)");
  CHECK_THROWS_AS(mean_pool<double>(empty), pooling_error);
  CHECK_THROWS_AS(last_token_pool<double>(empty), pooling_error);
  CHECK_THROWS_TYPE_WITH(layer.pool(x, TokenMask(4, false)), pooling_error,
                         "mask drops all 4 tokens");
  CHECK_THROWS_AS(mean_pool<double>(x, TokenMask(4, false)), pooling_error);
  CHECK_THROWS_TYPE_WITH(layer.pool(x, TokenMask(3, true)), shape_error,
                         "mask has 3 entries, expected 4");
  const RowMatrix<double> wide = test::random_input<double>(4, 5, 2);
  CHECK_THROWS_TYPE_WITH(layer.pool(wide), shape_error, "x has shape (4 x 5), expected (any x 6)");
  CHECK_THROWS_AS(layer.cross_attention(wide), shape_error);
  CHECK_THROWS_AS(layer.dictionary_usage(wide), shape_error);
  CHECK_THROWS_TYPE_WITH(layer.attention_weights(x, 2), config_error,
                         "head (2) must be in [0, n_heads = 2)");
  CHECK_THROWS_TYPE_WITH((LatentPoolingConfig{6, 3, 4, 0, true, 0.0}.validate()), config_error,
                         "d_model (6) must be divisible by n_heads (4)");
  CHECK_THROWS_AS((LatentPoolingConfig{6, 0, 1, 0, true, 0.0}.validate()), config_error);
  CHECK_THROWS_AS((LatentPoolingConfig{6, 3, 1, 0, true, -1.0}.validate()), config_error);
  LatentPoolingWeights<double> bad = layer.weights();
  bad.dictionary.resize(3, 5);
  CHECK_THROWS_TYPE_WITH(LatentPooling<double>(layer.config(), bad), shape_error,
                         "dictionary has shape (3 x 5), expected (3 x 6)");
}
