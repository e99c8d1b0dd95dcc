// The causal mask's visible share of the query-key grid (analysis/visibility.hpp), the
// bidirectional (encoder) forward of every mechanism, reference::forward(layer, x,
// Mask::bidirectional()) for GQA, MLA (with and without q_rank) and LRKV (every rope
// mode, with and without key norm), and self-attention pooling
// (pooling/self_attention_pool.hpp: a bidirectional layer, then the mean over kept
// tokens) over each, all against plain computations written out here as loops.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "kvattn/analysis/visibility.hpp"
#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"
#include "kvattn/core/mask.hpp"
#include "kvattn/pooling/self_attention_pool.hpp"
#include "kvattn/reference/gqa.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "kvattn/reference/mla.hpp"
#include "test_lrkv_util.hpp"
#include "test_util.hpp"

using namespace kvattn;

TEST_CASE("causal visible fraction is 1/2 + 1/(2N)", "[analysis]") {
  using analysis::causal_visible_cells;
  using analysis::causal_visible_fraction;
  CHECK(causal_visible_fraction(10) == 0.55);  // 55 of 100 cells
  CHECK(causal_visible_cells(10) == 55);
  CHECK(causal_visible_fraction(1) == 1.0);
  for (const Index n : {1, 2, 7, 10, 33}) {
    Index visible = 0;  // counted from the mask itself
    for (Index i = 0; i < n; ++i) {
      for (Index j = 0; j < n; ++j) visible += Mask::causal().visible(i, j) ? 1 : 0;
    }
    CHECK(causal_visible_cells(n) == visible);
    CHECK(causal_visible_fraction(n) == Approx(double(visible) / double(n * n)).epsilon(1e-15));
  }
  CHECK_THROWS_AS(causal_visible_fraction(0), config_error);
  static_assert(causal_visible_cells(10) == 55);
}

TEST_CASE("causal visible cells are exact up to the 64-bit limit and refuse beyond it",
          "[analysis][reliability]") {
  using analysis::causal_visible_cells;
  // The largest n whose n (n + 1) / 2 fits: (2^32 - 1) 2^32 / 2 = 2^63 - 2^31.
  CHECK(causal_visible_cells(4294967295LL) == 4294967295LL * 2147483648LL);
  // 2^32 gives 2^31 (2^32 + 1) = 2^63 + 2^31 cells: refused (it used to wrap to 2^31).
  CHECK_THROWS_AS(causal_visible_cells(Index{1} << 32), kvattn::overflow_error);
  CHECK_THROWS_AS(causal_visible_cells(Index{1} << 33), kvattn::overflow_error);
  CHECK_THROWS_AS(causal_visible_cells(std::numeric_limits<Index>::max()), std::overflow_error);
}

namespace {

using Mat = RowMatrix<double>;

// The plain computations below use kvattn for the projections x W only (Eigen
// products); RoPE, RMSNorm, key norm, the logits and the softmax are loops written here
// from the formulas in docs/math.md, docs/mla.md and docs/lrkv.md.

// Rotates v[0 .. dim) at `position` in place: plane i (dims (i, i + dim/2) half-split,
// (2i, 2i + 1) interleaved) turns by position * theta^(-2i/dim).
void rotate(double* v, Index dim, const RopeConfig& rope, double position) {
  if (rope.layout == RopeLayout::none) return;
  for (Index i = 0; i < dim / 2; ++i) {
    const double angle = position * std::pow(rope.theta, -2.0 * double(i) / double(dim));
    const Index a = rope.layout == RopeLayout::half_split ? i : 2 * i;
    const Index b = rope.layout == RopeLayout::half_split ? i + dim / 2 : 2 * i + 1;
    const double x = v[a], y = v[b];
    v[a] = x * std::cos(angle) - y * std::sin(angle);
    v[b] = x * std::sin(angle) + y * std::cos(angle);
  }
}

// Columns [first, first + dim) of every row i rotated at rope.position_offset + i.
void rotate_rows(Mat& m, Index first, Index dim, const RopeConfig& rope) {
  for (Index i = 0; i < m.rows(); ++i) {
    rotate(m.row(i).data() + first, dim, rope, double(rope.position_offset + i));
  }
}

// Every row x <- x / sqrt(mean(x^2) + eps) * gain.
void rms_norm_rows(Mat& m, const RowVector<double>& gain, double eps) {
  for (Index i = 0; i < m.rows(); ++i) {
    double squares = 0;
    for (Index j = 0; j < m.cols(); ++j) squares += m(i, j) * m(i, j);
    const double rms = std::sqrt(squares / double(m.cols()) + eps);
    for (Index j = 0; j < m.cols(); ++j) m(i, j) = m(i, j) / rms * gain(j);
  }
}

// out(i, :) = sum_j softmax_j(logit(i, j)) v(j, :) over every j (bidirectional).
template <class Logit>
void attend_all(Index L, const Logit& logit, const Mat& v, Mat& out, Index first_col) {
  std::vector<double> weights(static_cast<std::size_t>(L));
  for (Index i = 0; i < L; ++i) {
    double max_logit = -std::numeric_limits<double>::infinity();
    for (Index j = 0; j < L; ++j) {
      weights[std::size_t(j)] = logit(i, j);
      max_logit = std::max(max_logit, weights[std::size_t(j)]);
    }
    double sum = 0;
    for (auto& w : weights) sum += (w = std::exp(w - max_logit));
    for (Index j = 0; j < L; ++j) {
      for (Index e = 0; e < v.cols(); ++e) {
        out(i, first_col + e) += weights[std::size_t(j)] / sum * v(j, e);
      }
    }
  }
}

double dot(const Mat& a, Index i, Index a0, const Mat& b, Index j, Index b0, Index n) {
  double sum = 0;
  for (Index e = 0; e < n; ++e) sum += a(i, a0 + e) * b(j, b0 + e);
  return sum;
}

// Bidirectional GQA attention written as loops (biases and RoPE included): query head h
// sees every key of KV head h / group_size.
Mat plain_bidirectional(const GqaLayer<double>& layer, const Mat& x) {
  const GqaConfig& c = layer.config();
  const auto& w = layer.weights();
  Mat q = x * w.w_q, k = x * w.w_k, v = x * w.w_v;
  if (c.qkv_bias) {
    q.rowwise() += w.bias_q;
    k.rowwise() += w.bias_k;
    v.rowwise() += w.bias_v;
  }
  const Index L = x.rows(), dh = c.head_dim;
  for (Index h = 0; h < c.n_heads; ++h) rotate_rows(q, h * dh, dh, c.rope);
  for (Index g = 0; g < c.n_kv_heads; ++g) rotate_rows(k, g * dh, dh, c.rope);
  Mat heads = Mat::Zero(L, c.n_heads * dh);
  for (Index h = 0; h < c.n_heads; ++h) {
    const Index g = h / (c.n_heads / c.n_kv_heads);
    const Mat v_g = v.middleCols(g * dh, dh);
    attend_all(
        L, [&](Index i, Index j) { return dot(q, i, h * dh, k, j, g * dh, dh) / std::sqrt(dh); },
        v_g, heads, h * dh);
  }
  return heads * w.w_o;
}

// Bidirectional MLA written as loops: every head's key [c_j W_UK_h | P_j k_R,j] and value
// c_j W_UV_h rebuilt from the (RMS-normalized) latent, scale 1/sqrt(d_nope + d_R).
Mat plain_bidirectional(const MlaLayer<double>& layer, const Mat& x) {
  const MlaConfig& c = layer.config();
  const auto& w = layer.weights();
  const Index L = x.rows(), dn = c.qk_nope_dim, dr = c.rope_dim, dv = c.v_dim;
  const Index qd = dn + dr;
  Mat q;
  if (c.q_rank > 0) {
    Mat c_q = x * w.w_dq;
    if (c.q_norm) rms_norm_rows(c_q, w.q_norm_gain, c.norm_epsilon);
    q = c_q * w.w_uq;
  } else {
    q = x * w.w_q;
  }
  Mat latent = x * w.w_dkv;
  if (c.kv_norm) rms_norm_rows(latent, w.kv_norm_gain, c.norm_epsilon);
  Mat rope_keys = x * w.w_kr;
  rotate_rows(rope_keys, 0, dr, c.rope);
  for (Index h = 0; h < c.n_heads; ++h) rotate_rows(q, h * qd + dn, dr, c.rope);
  Mat heads = Mat::Zero(L, c.n_heads * dv);
  for (Index h = 0; h < c.n_heads; ++h) {
    Mat key_nope = Mat::Zero(L, dn), value = Mat::Zero(L, dv);
    for (Index j = 0; j < L; ++j) {
      for (Index a = 0; a < c.kv_rank; ++a) {
        for (Index e = 0; e < dn; ++e) key_nope(j, e) += latent(j, a) * w.w_uk(a, h * dn + e);
        for (Index e = 0; e < dv; ++e) value(j, e) += latent(j, a) * w.w_uv(a, h * dv + e);
      }
    }
    attend_all(
        L,
        [&](Index i, Index j) {
          return (dot(q, i, h * qd, key_nope, j, 0, dn) +
                  dot(q, i, h * qd + dn, rope_keys, j, 0, dr)) /
                 std::sqrt(double(qd));
        },
        value, heads, h * dv);
  }
  return heads * w.w_o;
}

// Bidirectional LRKV written as loops (seed 000, Eqs. 4-5): head h's key is the shared
// key s_j = x_j W_shared^K plus its residual r_j = (x_j U_h^K) (B_h^K)^T, both divided by
// rho = sqrt(mean((s_j + r_j)^2) + eps) and multiplied by g under key norm; the value is
// likewise. The logit of query i against key j, per rope mode (P_i rotates at position i):
//   none        q_i . (s_j + r_j)
//   full,       P_i q_i . P_j (s_j + r_j)
//   commuting
//   shared      P_i q_i . P_j s_j + q_i . r_j
//   decoupled   q_i . (s_j + r_j) + P_i q^R_i . P_j k^R_j
// scaled by 1/sqrt(d_h + d_R) (d_R only when decoupled).
Mat plain_bidirectional(const LrkvLayer<double>& layer, const Mat& x) {
  const LrkvConfig& c = layer.config();
  const auto& w = layer.weights();
  const Index L = x.rows(), dh = c.head_dim, r = c.rank;
  const bool decoupled = c.rope_mode == LrkvRopeMode::decoupled;
  const Index dr = decoupled ? c.rope_dim : 0;
  const double scale = 1.0 / std::sqrt(double(dh + dr));
  Mat rope_keys;
  if (decoupled) {
    rope_keys = x * w.w_kr;
    rotate_rows(rope_keys, 0, dr, c.rope);
  }
  Mat heads = Mat::Zero(L, c.n_heads * dh);
  for (Index h = 0; h < c.n_heads; ++h) {
    const Mat q = x * w.w_q.middleCols(h * dh, dh);
    Mat shared = x * w.w_k_shared, value = x * w.w_v_shared;
    Mat residual = Mat::Zero(L, dh);
    const Mat latent_k = x * w.u_k.middleCols(h * r, r), latent_v = x * w.u_v.middleCols(h * r, r);
    for (Index j = 0; j < L; ++j) {
      for (Index e = 0; e < dh; ++e) {
        for (Index a = 0; a < r; ++a) {
          residual(j, e) += latent_k(j, a) * w.basis_k(e, h * r + a);
          value(j, e) += latent_v(j, a) * w.basis_v(e, h * r + a);
        }
      }
    }
    if (c.key_norm) {
      for (Index j = 0; j < L; ++j) {
        double squares = 0;
        for (Index e = 0; e < dh; ++e) squares += std::pow(shared(j, e) + residual(j, e), 2);
        const double rho = std::sqrt(squares / double(dh) + c.key_norm_epsilon);
        for (Index e = 0; e < dh; ++e) {
          shared(j, e) *= w.key_norm_gain(e) / rho;
          residual(j, e) *= w.key_norm_gain(e) / rho;
        }
      }
    }
    const Mat full_key = shared + residual;
    Mat q_rot = q, shared_rot = shared, full_rot = full_key, q_rope;
    rotate_rows(q_rot, 0, dh, c.rope);
    rotate_rows(shared_rot, 0, dh, c.rope);
    rotate_rows(full_rot, 0, dh, c.rope);
    if (decoupled) {
      q_rope = x * w.w_qr.middleCols(h * dr, dr);
      rotate_rows(q_rope, 0, dr, c.rope);
    }
    auto logit = [&](Index i, Index j) {
      double z = 0;
      switch (c.rope_mode) {
        case LrkvRopeMode::none:
          z = dot(q, i, 0, full_key, j, 0, dh);
          break;
        case LrkvRopeMode::full:
        case LrkvRopeMode::commuting:
          z = dot(q_rot, i, 0, full_rot, j, 0, dh);
          break;
        case LrkvRopeMode::shared:
          z = dot(q_rot, i, 0, shared_rot, j, 0, dh) + dot(q, i, 0, residual, j, 0, dh);
          break;
        case LrkvRopeMode::decoupled:
          z = dot(q, i, 0, full_key, j, 0, dh) + dot(q_rope, i, 0, rope_keys, j, 0, dr);
          break;
      }
      return z * scale;
    };
    attend_all(L, logit, value, heads, h * dh);
  }
  return heads * w.w_o;
}

// The mean of rows [first, L) of y, as a loop.
RowVector<double> mean_from(const Mat& y, Index first) {
  RowVector<double> mean = RowVector<double>::Zero(y.cols());
  for (Index i = first; i < y.rows(); ++i) mean += y.row(i) / double(y.rows() - first);
  return mean;
}

MlaConfig small_mla(Index q_rank, bool kv_norm, RopeLayout layout) {
  MlaConfig c;
  c.d_model = 16;
  c.n_heads = 3;
  c.kv_rank = 6;
  c.q_rank = q_rank;
  c.q_norm = q_rank > 0;
  c.kv_norm = kv_norm;
  c.qk_nope_dim = 4;
  c.rope_dim = 4;
  c.v_dim = 5;
  c.rope = {layout, 10000.0, 2};
  return c;
}

}  // namespace

TEST_CASE("GQA-family bidirectional reference equals the loops", "[encode][gqa]") {
  const RopeConfig rope{RopeLayout::interleaved, 50.0, 3};
  for (GqaConfig c :
       {mha_config(12, 3, 4), gqa_config(10, 6, 4, 2, rope), mqa_config(9, 5, 6, rope)}) {
    c.qkv_bias = c.n_kv_heads == 2;
    CAPTURE(c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.qkv_bias);
    const auto layer = GqaLayer<double>::random(c, 11);
    for (const Index length : {1, 2, 13}) {
      CAPTURE(length);
      const Mat x = test::random_input<double>(length, c.d_model, 5 + std::uint64_t(length));
      const Mat want = plain_bidirectional(layer, x);
      const Mat got = reference::forward(layer, x, Mask::bidirectional());
      INFO("max abs error " << test::max_abs_error(got, want));
      CHECK(test::relative_error(got, want) < 1e-13);
      if (length > 1) {  // not the causal forward
        CHECK(test::relative_error(reference::forward(layer, x), want) > 1e-3);
      }
    }
  }
}

TEST_CASE("MLA bidirectional reference equals the loops, with and without q_rank",
          "[encode][mla]") {
  for (const Index q_rank : {0, 7}) {
    for (const bool kv_norm : {true, false}) {
      for (const RopeLayout layout : {RopeLayout::interleaved, RopeLayout::half_split}) {
        const MlaConfig c = small_mla(q_rank, kv_norm, layout);
        CAPTURE(q_rank, kv_norm, layout == RopeLayout::interleaved);
        const auto layer = MlaLayer<double>::random(c, 3);
        for (const Index length : {1, 11}) {
          CAPTURE(length);
          const Mat x = test::random_input<double>(length, c.d_model, 4);
          const Mat want = plain_bidirectional(layer, x);
          const Mat got = reference::forward(layer, x, Mask::bidirectional());
          INFO("max abs error " << test::max_abs_error(got, want));
          CHECK(test::relative_error(got, want) < 1e-13);
          if (length > 1) CHECK(test::relative_error(reference::forward(layer, x), want) > 1e-3);
        }
      }
    }
  }
}

TEST_CASE("LRKV bidirectional reference equals the loops in every rope mode", "[encode][lrkv]") {
  std::mt19937_64 rng(77);
  for (const LrkvRopeMode mode : {LrkvRopeMode::none, LrkvRopeMode::shared, LrkvRopeMode::decoupled,
                                  LrkvRopeMode::full, LrkvRopeMode::commuting}) {
    for (const bool key_norm : {false, true}) {
      for (int trial = 0; trial < 3; ++trial) {
        const LrkvConfig c = test::random_lrkv_config(rng, mode, key_norm);
        INFO(test::describe_case(c));
        const auto layer = LrkvLayer<double>::random(c, 9 + std::uint64_t(trial), 0.7);
        const Mat x = test::random_input<double>(10, c.d_model, 8);
        const Mat want = plain_bidirectional(layer, x);
        const Mat got = reference::forward(layer, x, Mask::bidirectional());
        INFO("max abs error " << test::max_abs_error(got, want));
        CHECK(test::relative_error(got, want) < 1e-12);
        CHECK(test::relative_error(reference::forward(layer, x), want) > 1e-6);
      }
    }
  }
}

TEST_CASE("self-attention pooling over MLA and LRKV layers is the loops' mean",
          "[pooling][mla][lrkv]") {
  const Mat x16 = test::random_input<double>(9, 16, 21);
  for (const Index q_rank : {0, 7}) {
    CAPTURE(q_rank);
    const auto mla = MlaLayer<double>::random(small_mla(q_rank, true, RopeLayout::half_split), 5);
    const Mat full = plain_bidirectional(mla, x16);
    CHECK(test::relative_error(self_attention_pool(mla, x16), mean_from(full, 0)) < 1e-13);
    CHECK(test::relative_error(self_attention_pool(mla, x16, skip_prefix(9, 3)),
                               mean_from(full, 3)) < 1e-13);
  }
  std::mt19937_64 rng(5);
  for (const LrkvRopeMode mode : {LrkvRopeMode::shared, LrkvRopeMode::decoupled}) {
    LrkvConfig c = test::random_lrkv_config(rng, mode, true);
    c.d_model = 16;
    INFO(test::describe_case(c));
    const auto lrkv = LrkvLayer<double>::random(c, 6, 0.7);
    const Mat full = plain_bidirectional(lrkv, x16);
    CHECK(test::relative_error(self_attention_pool(lrkv, x16), mean_from(full, 0)) < 1e-12);
    CHECK(test::relative_error(self_attention_pool(lrkv, x16, skip_prefix(9, 4)),
                               mean_from(full, 4)) < 1e-12);
  }
  const Mat wide(3, 17);
  CHECK_THROWS_WITH(
      self_attention_pool(MlaLayer<double>::random(small_mla(0, true, RopeLayout::interleaved), 1),
                          wide),
      Catch::Matchers::Contains("expected (any x 16)"));
}

TEST_CASE("self-attention pooling is the bidirectional layer, then the mean", "[pooling]") {
  const auto layer = GqaLayer<double>::random(gqa_config(8, 4, 3, 2), 2);
  const RowMatrix<double> x = test::random_input<double>(7, 8, 3);
  const RowMatrix<double> full = plain_bidirectional(layer, x);
  // Mean over tokens 2..6 written out; tokens 0, 1 (an instruction) still shape them.
  RowVector<double> want = RowVector<double>::Zero(8);
  for (Index i = 2; i < 7; ++i) want += full.row(i) / 5.0;
  CHECK(test::relative_error(self_attention_pool(layer, x, skip_prefix(7, 2)), want) < 1e-13);
  CHECK(test::relative_error(self_attention_pool(layer, x),
                             RowVector<double>(full.colwise().mean())) < 1e-13);
  const RowMatrix<double> empty(0, 8);
  CHECK_THROWS_AS(self_attention_pool(layer, empty), pooling_error);
  CHECK_THROWS_AS(self_attention_pool(layer, x, TokenMask(7, false)), pooling_error);
  const RowMatrix<double> wide(3, 9);
  CHECK_THROWS_WITH(self_attention_pool(layer, wide),
                    Catch::Matchers::Contains("expected (any x 8)"));
}
