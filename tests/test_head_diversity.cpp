// Head diversity (seed 000, bilinear-form space): the centered-rank ceilings, the
// invariance to coupled orthogonal changes, identical heads, and the trace-based Gram
// against explicit d x d operators formed here.
#include <catch2/catch.hpp>
#include <cmath>

#include "kvattn/analysis/head_diversity.hpp"
#include "kvattn/analysis/params.hpp"
#include "test_util.hpp"

using namespace kvattn;

namespace {

// A random orthogonal n x n matrix (QR of a Gaussian matrix).
RowMatrix<double> random_orthogonal(Index n, std::uint64_t seed) {
  const RowMatrix<double> g = test::random_input<double>(n, n, seed);
  return Eigen::HouseholderQR<Eigen::MatrixXd>(g).householderQ() * Eigen::MatrixXd::Identity(n, n);
}

// Gram of the normalized operators, formed explicitly: A_h = Q_h K_h^T (d x d).
RowMatrix<double> explicit_gram(const RowMatrix<double>& q, const RowMatrix<double>& k,
                                Index heads) {
  const Index w = q.cols() / heads;
  std::vector<RowMatrix<double>> ops;
  for (Index h = 0; h < heads; ++h) {
    ops.push_back(q.middleCols(h * w, w) * k.middleCols(h * w, w).transpose());
  }
  RowMatrix<double> g(heads, heads);
  for (Index a = 0; a < heads; ++a) {
    for (Index b = 0; b < heads; ++b) {
      double dot = 0;
      for (Index i = 0; i < ops[a].size(); ++i) dot += ops[a].data()[i] * ops[b].data()[i];
      g(a, b) = dot / (ops[a].norm() * ops[b].norm());
    }
  }
  return g;
}

}  // namespace

TEST_CASE("orthogonal operators: rank H uncentered, H - 1 centered", "[analysis]") {
  for (const Index heads : {1, 2, 6, 18}) {
    CAPTURE(heads);
    const Index dh = 3, d = heads * dh;
    // W_q = W_k = I: head h's operator projects on its own block, so the H operators
    // are mutually orthogonal.
    const GqaConfig c = mha_config(d, heads, dh);
    GqaWeights<double> w;
    w.w_q = w.w_k = w.w_v = w.w_o = RowMatrix<double>::Identity(d, d);
    const auto r = analysis::head_diversity(GqaLayer<double>(c, w));
    CHECK(r.effective_rank == Approx(double(heads)).epsilon(1e-12));
    CHECK(r.centered_effective_rank == Approx(double(heads - 1)).margin(1e-12));
    CHECK(r.effective_rank_percent() == Approx(100.0).epsilon(1e-12));
    if (heads == 6) CHECK(r.centered_effective_rank_percent() == Approx(83.33).margin(0.005));
    if (heads == 18) CHECK(r.centered_effective_rank_percent() == Approx(94.44).margin(0.005));
    CHECK(test::max_abs_error(r.gram, RowMatrix<double>::Identity(heads, heads)) < 1e-15);
  }
}

TEST_CASE("identical heads: rank 1 uncentered, 0 centered", "[analysis]") {
  const Index heads = 5, dh = 4, d = 12;
  const auto base = GqaWeights<double>::random(mha_config(d, heads, dh), 9);
  GqaWeights<double> w = base;
  for (Index h = 1; h < heads; ++h) {
    w.w_q.middleCols(h * dh, dh) = base.w_q.leftCols(dh);
    w.w_k.middleCols(h * dh, dh) = base.w_k.leftCols(dh);
  }
  const auto r = analysis::head_diversity(GqaLayer<double>(mha_config(d, heads, dh), w));
  CHECK(r.effective_rank == Approx(1.0).epsilon(1e-10));
  CHECK(r.centered_effective_rank == 0.0);
  // MQA with identical query slices is the same layer.
  GqaWeights<double> m = w;
  m.w_k = base.w_k.leftCols(dh);
  m.w_v = base.w_v.leftCols(dh);
  CHECK(analysis::head_diversity(GqaLayer<double>(mqa_config(d, heads, dh), m)).effective_rank ==
        Approx(1.0).epsilon(1e-10));
}

TEST_CASE("coupled orthogonal changes leave the metric unchanged", "[analysis]") {
  const Index heads = 4, dh = 5, d = 11;
  const GqaConfig c = mha_config(d, heads, dh);
  const auto w = GqaWeights<double>::random(c, 21);
  const auto before = analysis::head_diversity(GqaLayer<double>(c, w));
  GqaWeights<double> v = w;
  // Per head: Q_h -> Q_h O_h and K_h -> K_h O_h leave A_h itself unchanged.
  for (Index h = 0; h < heads; ++h) {
    const RowMatrix<double> o = random_orthogonal(dh, 100 + h);
    v.w_q.middleCols(h * dh, dh) = w.w_q.middleCols(h * dh, dh) * o;
    v.w_k.middleCols(h * dh, dh) = w.w_k.middleCols(h * dh, dh) * o;
  }
  // In the model space: A_h -> R A_h R^T keeps every Frobenius inner product.
  const RowMatrix<double> rot = random_orthogonal(d, 7);
  v.w_q = rot * v.w_q;
  v.w_k = rot * v.w_k;
  const auto after = analysis::head_diversity(GqaLayer<double>(c, v));
  CHECK(test::max_abs_error(after.gram, before.gram) < 1e-13);
  CHECK(after.effective_rank == Approx(before.effective_rank).epsilon(1e-12));
  CHECK(after.centered_effective_rank == Approx(before.centered_effective_rank).epsilon(1e-12));
  CHECK(before.effective_rank > 1.0);
  CHECK(before.effective_rank <= heads);
  CHECK(before.centered_effective_rank <= heads - 1 + 1e-12);
}

TEST_CASE("trace-based Gram equals the explicit-operator Gram", "[analysis]") {
  SECTION("GQA with shared keys") {
    const GqaConfig c = gqa_config(7, 6, 3, 2);
    const auto layer = GqaLayer<double>::random(c, 5);
    const auto& w = layer.weights();
    RowMatrix<double> keys(7, 18);
    for (Index h = 0; h < 6; ++h) keys.middleCols(h * 3, 3) = w.w_k.middleCols((h / 3) * 3, 3);
    const auto r = analysis::head_diversity(layer);
    CHECK(test::max_abs_error(r.gram, explicit_gram(w.w_q, keys, 6)) < 1e-13);
    // Centered Gram: the Gram of the operators minus their mean, re-derived here.
    const RowMatrix<double> g = explicit_gram(w.w_q, keys, 6);
    RowMatrix<double> centered = g;
    for (Index a = 0; a < 6; ++a) {
      for (Index b = 0; b < 6; ++b) {
        centered(a, b) = g(a, b) - g.row(a).mean() - g.col(b).mean() + g.mean();
      }
    }
    CHECK(test::max_abs_error(r.centered_gram, centered) < 1e-13);
  }
  SECTION("MLA through its absorbed maps") {
    MlaConfig c;
    c.d_model = 9;
    c.n_heads = 3;
    c.kv_rank = 4;
    c.q_rank = 5;
    c.q_norm = true;
    c.qk_nope_dim = 3;
    c.rope_dim = 2;
    c.v_dim = 2;
    const auto layer = MlaLayer<double>::random(c, 8);
    const auto& w = layer.weights();
    // A_h formed as the sum of its content and rope parts, in d x d.
    std::vector<RowMatrix<double>> ops;
    const RowMatrix<double> wq =
        w.w_dq * w.q_norm_gain.asDiagonal() * w.w_uq;  // d x H (d_nope + d_R)
    for (Index h = 0; h < 3; ++h) {
      const RowMatrix<double> kn =
          w.w_dkv * w.kv_norm_gain.asDiagonal() * w.w_uk.middleCols(h * 3, 3);
      ops.push_back(wq.middleCols(h * 5, 3) * kn.transpose() +
                    wq.middleCols(h * 5 + 3, 2) * w.w_kr.transpose());
    }
    const auto r = analysis::head_diversity(layer);
    for (Index a = 0; a < 3; ++a) {
      for (Index b = 0; b < 3; ++b) {
        const double want = ops[a].cwiseProduct(ops[b]).sum() / (ops[a].norm() * ops[b].norm());
        CHECK(r.gram(a, b) == Approx(want).epsilon(1e-12));
      }
    }
  }
  SECTION("LRKV: W_shared + U_h B_h^T") {
    LrkvConfig c;
    c.d_model = 10;
    c.n_heads = 4;
    c.head_dim = 3;
    c.rank = 2;
    const auto layer = LrkvLayer<double>::random(c, 4);
    const auto& w = layer.weights();
    RowMatrix<double> keys(10, 12);
    for (Index h = 0; h < 4; ++h) {
      keys.middleCols(h * 3, 3) =
          w.w_k_shared + w.u_k.middleCols(h * 2, 2) * w.basis_k.middleCols(h * 2, 2).transpose();
    }
    const auto r = analysis::head_diversity(layer);
    CHECK(test::max_abs_error(r.gram, explicit_gram(w.w_q, keys, 4)) < 1e-13);
    // Rank 0 is MQA: the key operator is W_shared for every head.
    LrkvConfig mqa = c;
    mqa.rank = 0;
    const auto shared = LrkvLayer<double>::random(mqa, 4);
    RowMatrix<double> shared_keys(10, 12);
    for (Index h = 0; h < 4; ++h) shared_keys.middleCols(h * 3, 3) = shared.weights().w_k_shared;
    CHECK(test::max_abs_error(analysis::head_diversity(shared).gram,
                              explicit_gram(shared.weights().w_q, shared_keys, 4)) < 1e-13);
  }
}

TEST_CASE("effective rank and errors", "[analysis][reliability]") {
  // Eigenvalues 1, 1, 0, 0: p = 1/2, 1/2 -> rank 2; negative eigenvalues are clamped.
  RowMatrix<double> m = RowMatrix<double>::Zero(4, 4);
  m(0, 0) = m(1, 1) = 3.0;
  m(2, 2) = -1.0;
  CHECK(analysis::effective_rank(m) == Approx(2.0).epsilon(1e-14));
  // Eigenvalues 3, 1: p = 3/4, 1/4 -> exp(-(3/4 ln 3/4 + 1/4 ln 1/4)).
  RowMatrix<double> two(2, 2);
  two << 2, 1, 1, 2;
  const double want = std::exp(-(0.75 * std::log(0.75) + 0.25 * std::log(0.25)));
  CHECK(analysis::effective_rank(two) == Approx(want).epsilon(1e-14));
  CHECK(analysis::effective_rank(RowMatrix<double>::Zero(3, 3)) == 0.0);
  CHECK_THROWS_AS(analysis::effective_rank(RowMatrix<double>::Zero(3, 2)), shape_error);
  const RowMatrix<double> q = test::random_input<double>(6, 8, 1);
  CHECK_THROWS_WITH(analysis::operator_gram(q, q, 3), Catch::Matchers::Contains("(6 x 8)"));
  CHECK_THROWS_AS(analysis::operator_gram(q, q.leftCols(4), 2), shape_error);
  RowMatrix<double> zero = q;
  zero.rightCols(4).setZero();
  CHECK_THROWS_WITH(analysis::head_diversity(q, zero, 2),
                    Catch::Matchers::Contains("head (1) has a zero operator"));
}
