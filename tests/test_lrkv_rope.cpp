// [rope][lrkv]: which RoPE placements LRKV can compute from its cache, and which not.
//   * the seed's backup-slide counterexample, and for a random B_h no latent map at all
//     (rotation or otherwise) matches full RoPE;
//   * rope_mode full is refused by the factored path, computed by the reference;
//   * rope_mode commuting is full RoPE, exactly, in factored form;
//   * logits depend only on relative positions; both layouts agree after a permutation.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>

#include <Eigen/QR>

#include "kvattn/attention/lrkv.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "test_lrkv_util.hpp"
#include "test_util.hpp"

using namespace kvattn;
using Catch::Matchers::Contains;

namespace {

using Matrix = Eigen::MatrixXd;  // column-major, as the seed writes B_h (d_h x r)

// P_t as a d x d matrix: column j is the core RoPE applied to the unit vector e_j.
Matrix rope_matrix(const Rope& rope, double position) {
  const Index d = rope.dim();
  Matrix p(d, d);
  for (Index j = 0; j < d; ++j) {
    RowVector<double> e = RowVector<double>::Zero(d);
    e(j) = 1.0;
    rope.rotate(e, position);
    p.col(j) = e.transpose();
  }
  return p;
}

// min over any r x r map X of ||P B - B X||_F / ||P B||_F (least squares).
double best_latent_residual(const Matrix& p, const Matrix& b) {
  const Matrix target = p * b;
  const Matrix x = b.colPivHouseholderQr().solve(target);
  return (target - b * x).norm() / target.norm();
}

}  // namespace

TEST_CASE("Backup-slide counterexample: a rotation leaves the residual subspace", "[rope][lrkv]") {
  // B = [1; 0], P = [[0, -1], [1, 0]] (a quarter turn), PB = [0; 1] (seed 000, backup).
  const Rope quarter_turn(RopeLayout::interleaved, {1.0});  // one plane, angle = position
  const double pi = 3.14159265358979323846;
  const Matrix p = rope_matrix(quarter_turn, pi / 2);
  Matrix b(2, 1);
  b << 1.0, 0.0;
  const Matrix pb = p * b;
  CHECK(std::abs(pb(0, 0)) <= 1e-15);
  CHECK(std::abs(pb(1, 0) - 1.0) <= 1e-15);
  // B c = [c; 0] for every scalar c, so ||B c - P B|| >= |PB_2| = 1 for all c.
  for (double c = -3.0; c <= 3.0; c += 0.125) {
    Matrix bc = b * c;
    CAPTURE(c);
    CHECK((bc - pb).norm() >= 1.0 - 1e-15);
  }
  CHECK(best_latent_residual(p, b) == Approx(1.0).epsilon(1e-14));
}

TEST_CASE("For a random B_h no latent map matches full RoPE; for a commuting B_h one does",
          "[rope][lrkv]") {
  std::mt19937_64 rng(4);
  for (const RopeLayout layout : {RopeLayout::half_split, RopeLayout::interleaved}) {
    for (const Index rank : {2, 4, 6}) {
      const Index dh = 8;
      const Rope rope({layout, 100.0, 0}, dh);
      const Matrix b = random_normal<double>(dh, rank, rng);
      // The commuting B of a layer of the same shape.
      LrkvConfig config{16, 1, dh, rank, LrkvRopeMode::commuting, {layout, 100.0, 0}};
      const auto layer = LrkvLayer<double>::random(config, 9);
      const Matrix b_commuting = layer.weights().basis_k;
      for (const double position : {1.0, 7.0, 100.0}) {
        const Matrix p = rope_matrix(rope, position);
        const double random_residual = best_latent_residual(p, b);
        const double commuting_residual = best_latent_residual(p, b_commuting);
        CAPTURE(rank, position, random_residual, commuting_residual);
        // A generic r-dim subspace of R^8 (r < 8) is not RoPE-invariant: a large residual.
        CHECK(random_residual > 0.05);
        CHECK(commuting_residual <= 1e-13);
        // And the latent map is the layer's P~_t: P_t B = B P~_t column by column.
        Matrix b_rotated(dh, rank);
        for (Index j = 0; j < rank; ++j) {
          RowVector<double> e = RowVector<double>::Zero(rank);
          e(j) = 1.0;
          layer.latent_rope().rotate(e, position);
          b_rotated.col(j) = b_commuting * e.transpose();
        }
        CHECK((p * b_commuting - b_rotated).norm() <= 1e-13 * b_commuting.norm());
      }
      // At position 0 RoPE is the identity and every B passes (the solver is sound).
      CHECK(best_latent_residual(rope_matrix(rope, 0.0), b) <= 1e-13);
    }
  }
}

TEST_CASE("rope_mode full: the factored path refuses, the reference computes", "[rope][lrkv]") {
  LrkvConfig config{12, 2, 8, 4, LrkvRopeMode::full, {RopeLayout::half_split, 10000.0, 3}};
  REQUIRE_NOTHROW(config.validate());
  const auto layer = LrkvLayer<double>::random(config, 2, 0.7);
  const RowMatrix<double> x = test::random_input<double>(6, 12, 3);
  auto cache = layer.make_cache();
  REQUIRE_THROWS_AS(layer.prefill(x, cache), config_error);
  REQUIRE_THROWS_WITH(layer.prefill(x, cache),
                      Contains("rope_mode full") && Contains("commuting") && Contains("P_t B_h"));
  REQUIRE_THROWS_AS(layer.decode(x.row(0), cache), config_error);
  CHECK(cache.tokens() == 0);
  const RowMatrix<double> y = reference::forward(layer, x);
  CHECK(y.allFinite());
  // Full RoPE is a different model from shared RoPE with the same weights.
  LrkvConfig shared = config;
  shared.rope_mode = LrkvRopeMode::shared;
  const LrkvLayer<double> shared_layer(shared, layer.weights());
  CHECK(test::relative_error(reference::forward(shared_layer, x), y) > 1e-3);
}

TEST_CASE("rope_mode commuting in factored form equals the expanded full-RoPE model",
          "[rope][equivalence][lrkv]") {
  std::mt19937_64 rng(12);
  for (int draw = 0; draw < 12; ++draw) {
    const LrkvConfig config = test::random_lrkv_config(rng, LrkvRopeMode::commuting, draw % 2 == 1);
    LrkvConfig full = config;
    full.rope_mode = LrkvRopeMode::full;
    const auto layer =
        LrkvLayer<double>::random(config, 40 + static_cast<std::uint64_t>(draw), 0.7);
    const LrkvLayer<double> full_layer(full, layer.weights());  // same weights, full RoPE
    const Index length = 30;
    const RowMatrix<double> x = test::random_input<double>(length, config.d_model, 50);
    const RowMatrix<double> got = test::run_factored(layer, x, 11);
    const double err = test::relative_error(got, reference::forward(full_layer, x));
    INFO(test::describe_case(config));
    CAPTURE(err);
    CHECK(err <= 1e-10);
  }
}

TEST_CASE("LRKV logits depend only on relative positions", "[rope][lrkv]") {
  // Factored at position offset 1000 equals the reference at offset 0, for every mode
  // that rotates (RoPE angles differ, their differences do not).
  std::mt19937_64 rng(31);
  for (const LrkvRopeMode mode :
       {LrkvRopeMode::shared, LrkvRopeMode::decoupled, LrkvRopeMode::commuting}) {
    LrkvConfig config = test::random_lrkv_config(rng, mode, true);
    config.rope.position_offset = 0;
    LrkvConfig shifted = config;
    shifted.rope.position_offset = 1000;
    const auto layer = LrkvLayer<double>::random(config, 3, 0.7);
    const LrkvLayer<double> shifted_layer(shifted, layer.weights());
    const RowMatrix<double> x = test::random_input<double>(25, config.d_model, 4);
    const double err = test::relative_error(test::run_factored(shifted_layer, x, 10),
                                            reference::forward(layer, x));
    INFO(test::describe_case(config));
    CAPTURE(err);
    CHECK(err <= 1e-10);
  }
}

TEST_CASE("Half-split and interleaved LRKV agree after permuting the weights", "[rope][lrkv]") {
  for (const LrkvRopeMode mode :
       {LrkvRopeMode::shared, LrkvRopeMode::decoupled, LrkvRopeMode::commuting}) {
    LrkvConfig inter{14, 3, 8, 4, mode, {RopeLayout::interleaved, 100.0, 2}};
    if (mode == LrkvRopeMode::decoupled) inter.rope_dim = 6;
    inter.key_norm = true;
    const auto layer = LrkvLayer<double>::random(inter, 21, 0.7);
    // half[j] = interleaved[perm[j]] on every rotated width.
    auto permute_cols = [](const RowMatrix<double>& m, Index width) {
      const auto perm = interleaved_to_half_split(width);
      RowMatrix<double> out = m;
      for (Index block = 0; block < m.cols() / width; ++block) {
        for (Index j = 0; j < width; ++j) {
          out.col(block * width + j) = m.col(block * width + perm[static_cast<std::size_t>(j)]);
        }
      }
      return out;
    };
    LrkvConfig half = inter;
    half.rope.layout = RopeLayout::half_split;
    LrkvWeights<double> w = layer.weights();
    const Index dh = inter.head_dim;
    if (mode == LrkvRopeMode::decoupled) {
      w.w_qr = permute_cols(w.w_qr, inter.rope_dim);
      w.w_kr = permute_cols(w.w_kr, inter.rope_dim);
    } else {
      w.w_q = permute_cols(w.w_q, dh);
      w.w_k_shared = permute_cols(w.w_k_shared, dh);
      w.basis_k = permute_cols(w.basis_k.transpose(), dh).transpose();  // rows of B are d_h dims
      w.key_norm_gain = permute_cols(w.key_norm_gain, dh);
      w.basis_v = permute_cols(w.basis_v.transpose(), dh).transpose();
      w.w_v_shared = permute_cols(w.w_v_shared, dh);
      // Outputs of each head come out permuted too: undo it in W_O's rows.
      w.w_o = permute_cols(w.w_o.transpose(), dh).transpose();
    }
    const LrkvLayer<double> half_layer(half, w);
    const RowMatrix<double> x = test::random_input<double>(20, inter.d_model, 22);
    const double err =
        test::relative_error(test::run_factored(half_layer, x, 9), reference::forward(layer, x));
    CAPTURE(to_string(mode), err);
    CHECK(err <= 1e-10);
  }
}
