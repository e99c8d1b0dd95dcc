// Laws of LRKV (seed 000): r = 0 is MQA, full rank with W_shared = 0 is MHA, the paper's
// initialization, and the K/V parameter count of Eq. 10. Expected values come from the
// GQA family's own layer and from hand formulas.
#include <catch2/catch.hpp>

#include <array>
#include <random>

#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/lrkv_from_mha.hpp"
#include "kvattn/reference/gqa.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "test_lrkv_util.hpp"
#include "test_util.hpp"

using namespace kvattn;

namespace {

// GQA-family prefill of `prompt` rows then decodes, as run_factored does for LRKV.
RowMatrix<double> run_gqa(const GqaLayer<double>& layer, const RowMatrix<double>& x, Index prompt) {
  auto cache = layer.make_cache();
  RowMatrix<double> out(x.rows(), layer.config().d_model);
  if (prompt > 0) out.topRows(prompt) = layer.prefill(x.topRows(prompt), cache);
  for (Index i = prompt; i < x.rows(); ++i) out.row(i) = layer.decode(x.row(i), cache);
  return out;
}

}  // namespace

TEST_CASE("LRKV with r = 0 is MQA built from the shared weights", "[equivalence][lrkv][mqa]") {
  // none -> MQA without RoPE; shared, commuting and full -> MQA with the same RoPE (with
  // r = 0 the whole key is the shared key, so all three rotate it the same way).
  std::mt19937_64 rng(3);
  for (const LrkvRopeMode mode :
       {LrkvRopeMode::none, LrkvRopeMode::shared, LrkvRopeMode::commuting, LrkvRopeMode::full}) {
    for (int draw = 0; draw < 3; ++draw) {
      LrkvConfig config = test::random_lrkv_config(rng, mode, false);
      config.rank = 0;
      const auto lrkv = LrkvLayer<double>::random(config, 10 + static_cast<std::uint64_t>(draw));
      const auto& w = lrkv.weights();
      const GqaConfig mqa =
          mqa_config(config.d_model, config.n_heads, config.head_dim, config.rope);
      const GqaLayer<double> mqa_layer(mqa, {w.w_q, w.w_k_shared, w.w_v_shared, w.w_o, {}, {}, {}, {}});
      const RowMatrix<double> x = test::random_input<double>(17, config.d_model, 5);
      const RowMatrix<double> expected = run_gqa(mqa_layer, x, 6);
      INFO(test::describe_case(config));
      CHECK(test::relative_error(reference::forward(lrkv, x), expected) <= 1e-10);
      if (config.factored_exact()) {
        const double err = test::relative_error(test::run_factored(lrkv, x, 6), expected);
        CAPTURE(err);
        CHECK(err <= 1e-10);
      }
    }
  }
}

TEST_CASE("The MHA-weights constructor reproduces MHA at full rank", "[equivalence][lrkv][mha]") {
  for (const RopeLayout layout :
       {RopeLayout::none, RopeLayout::half_split, RopeLayout::interleaved}) {
    for (const Index dh : {4, 6, 16}) {
      const GqaConfig config = mha_config(20, 3, dh, {layout, 10000.0, 7});
      const auto mha = GqaLayer<double>::random(config, static_cast<std::uint64_t>(dh));
      const auto lrkv = lrkv_from_mha(mha);
      CHECK(lrkv.config().rank == dh);
      CHECK(lrkv.config().rope_mode ==
            (layout == RopeLayout::none ? LrkvRopeMode::none : LrkvRopeMode::commuting));
      CHECK(lrkv.weights().w_k_shared.norm() == 0.0);
      // U_h (B_h)^T = W_h for keys and values, head by head.
      for (Index h = 0; h < 3; ++h) {
        const auto cols = [&](const RowMatrix<double>& m) { return m.middleCols(h * dh, dh); };
        CHECK((cols(lrkv.weights().u_k) * cols(lrkv.weights().basis_k).transpose() -
               cols(mha.weights().w_k))
                  .norm() == 0.0);
        CHECK((cols(lrkv.weights().u_v) * cols(lrkv.weights().basis_v).transpose() -
               cols(mha.weights().w_v))
                  .norm() == 0.0);
      }
      const RowMatrix<double> x = test::random_input<double>(21, 20, 8);
      const RowMatrix<double> expected = run_gqa(mha, x, 9);
      const double err = test::relative_error(test::run_factored(lrkv, x, 9), expected);
      const double err_ref = test::relative_error(reference::forward(lrkv, x), expected);
      CAPTURE(dh, static_cast<int>(layout), err, err_ref);
      CHECK(err <= 1e-10);
      CHECK(err_ref <= 1e-10);
    }
  }
}

TEST_CASE("Residuals start at 0.1 ||W_shared||_F, as the paper initializes", "[lrkv]") {
  std::mt19937_64 rng(6);
  for (const LrkvRopeMode mode : {LrkvRopeMode::none, LrkvRopeMode::commuting}) {
    LrkvConfig config = test::random_lrkv_config(rng, mode, false);
    config.rank = 2;
    const auto w = LrkvWeights<double>::random(config, 1);
    for (Index h = 0; h < config.n_heads; ++h) {
      const auto r = config.rank;
      const double k =
          (w.u_k.middleCols(h * r, r) * w.basis_k.middleCols(h * r, r).transpose()).norm();
      const double v =
          (w.u_v.middleCols(h * r, r) * w.basis_v.middleCols(h * r, r).transpose()).norm();
      CHECK(k == Approx(0.1 * w.w_k_shared.norm()).epsilon(1e-12));
      CHECK(v == Approx(0.1 * w.w_v_shared.norm()).epsilon(1e-12));
    }
  }
}

TEST_CASE("K/V parameters: 2 d d_h + 2 H r (d + d_h) against MHA's 2 H d d_h", "[lrkv]") {
  for (const auto& [d, H, dh, r] : {std::array<Index, 4>{48, 6, 8, 3}, {4096, 32, 128, 54}}) {
    const LrkvConfig config{d, H, dh, r};
    // Count the entries of the real matrices of K and V (seed 000, Eq. 10).
    LrkvWeights<float> w;
    if (d < 1000) {
      w = LrkvWeights<float>::random(config, 1);
    } else {  // the paper's 6.3B attention shape: shapes only, no random draws
      w.w_k_shared.resize(d, dh);
      w.w_v_shared.resize(d, dh);
      w.u_k.resize(d, H * r);
      w.u_v.resize(d, H * r);
      w.basis_k.resize(dh, H * r);
      w.basis_v.resize(dh, H * r);
    }
    const Index counted = w.w_k_shared.size() + w.w_v_shared.size() + w.u_k.size() + w.u_v.size() +
                          w.basis_k.size() + w.basis_v.size();
    CHECK(counted == 2 * d * dh + 2 * H * r * (d + dh));
    if (d == 4096) {
      CHECK(counted == 1048576 + 14598144);  // 2*4096*128 + 2*32*54*4224
      CHECK(2 * H * d * dh == 33554432);     // MHA's K/V
    }
  }
}
