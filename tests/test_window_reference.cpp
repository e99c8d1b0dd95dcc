// [window][reference]: sliding windows with sink tokens, soft-capped logits and sink
// logits in the expanded reference, each against the formula written out as loops; the
// config rules (the factored layers against the reference: test_window_layers.cpp).
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <vector>

#include "kvattn/reference/dense_attention.hpp"
#include "kvattn/reference/gqa.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "kvattn/reference/mla.hpp"
#include "test_util.hpp"

using namespace kvattn;
using Mat = RowMatrix<double>;

namespace {

// One head's attention written out: query i at position i sees key j when `visible`,
// logits scale q.k shaped by `softcap`, a sink logit joining the denominator.
Mat plain_attention(const Mat& q, const Mat& k, const Mat& v, double scale,
                    const std::function<bool(Index, Index)>& visible, double softcap,
                    std::optional<double> sink) {
  Mat out = Mat::Zero(q.rows(), v.cols());
  for (Index i = 0; i < q.rows(); ++i) {
    std::vector<double> e(static_cast<std::size_t>(k.rows()), 0.0);
    double denominator = sink ? std::exp(*sink) : 0.0;
    for (Index j = 0; j < k.rows(); ++j) {
      if (!visible(i, j)) continue;
      double s = scale * q.row(i).dot(k.row(j));
      if (softcap > 0) s = softcap * std::tanh(s / softcap);
      e[std::size_t(j)] = std::exp(s);
      denominator += e[std::size_t(j)];
    }
    for (Index j = 0; j < k.rows(); ++j) out.row(i) += e[std::size_t(j)] / denominator * v.row(j);
  }
  return out;
}

}  // namespace

TEST_CASE("the window keeps the last W keys and the first k sink keys", "[window][mask]") {
  const Mask m = Mask::sliding_window(3, 2);
  // Query 7 sees 5, 6, 7 (window) and 0, 1 (sinks); query 1 sees 0 and 1.
  for (Index j = 0; j < 10; ++j) CHECK(m.visible(7, j) == (j == 0 || j == 1 || (j >= 5 && j <= 7)));
  for (Index j = 0; j < 4; ++j) CHECK(m.visible(1, j) == (j <= 1));
  CHECK(Mask::of_layer(0, 0) == Mask::causal());
  CHECK(Mask::of_layer(4, 1) == Mask::sliding_window(4, 1));
  CHECK_THROWS_AS(Mask::sliding_window(3, -1), config_error);
}

TEST_CASE("reference attention: window, sinks, soft-cap and sink logit, alone and together",
          "[window][reference]") {
  const Mat q = test::random_input<double>(9, 4, 1) * 3.0;  // large logits: the cap matters
  const Mat k = test::random_input<double>(9, 4, 2);
  const Mat v = test::random_input<double>(9, 5, 3);
  const double scale = 0.5;
  const Mask window = Mask::sliding_window(3, 2);
  auto window_visible = [&](Index i, Index j) { return window.visible(i, j); };
  auto causal = [](Index i, Index j) { return j <= i; };
  struct Case {
    Mask mask;
    std::function<bool(Index, Index)> visible;
    double softcap;
    std::optional<double> sink;
  };
  for (const Case& c :
       {Case{Mask::causal(), causal, 0.0, std::nullopt},
        Case{window, window_visible, 0.0, std::nullopt},
        Case{Mask::causal(), causal, 1.5, std::nullopt}, Case{Mask::causal(), causal, 0.0, 0.7},
        Case{window, window_visible, 2.0, -0.3}}) {
    CAPTURE(c.softcap, c.sink.value_or(-1e9), c.mask.window);
    const Mat got = reference::attention<double>(q, k, v, scale, c.mask, 0, {c.softcap, c.sink});
    CHECK(test::relative_error(got, plain_attention(q, k, v, scale, c.visible, c.softcap, c.sink)) <
          1e-14);
  }
  // Keys at explicit positions (a cache that no longer holds every token): keys at
  // positions 0, 1, 6, 7, 8 for a query at position 8 with window 3 and 2 sinks.
  const std::vector<Index> positions = {0, 1, 6, 7, 8};
  const Mat got = reference::attention<double>(q.bottomRows(1), k.topRows(5), v.topRows(5), scale,
                                               window, 8, {}, positions);
  const Mat want = plain_attention(
      q.bottomRows(1), k.topRows(5), v.topRows(5), scale, [](Index, Index) { return true; }, 0.0,
      std::nullopt);
  CHECK(test::relative_error(got, want) < 1e-14);
}

TEST_CASE("the configs validate the window fields", "[window][reliability]") {
  GqaConfig g = gqa_config(16, 4, 4, 2);
  g.window = -1;
  CHECK_THROWS_WITH(g.validate(), Catch::Contains("window (-1) must be >= 0"));
  g.window = 0;
  g.sink_tokens = 4;
  CHECK_THROWS_WITH(g.validate(), Catch::Contains("sink_tokens (4) needs a window"));
  g.window = 8;
  CHECK_NOTHROW(g.validate());
  g.logit_softcap = -1.0;
  CHECK_THROWS_WITH(g.validate(), Catch::Contains("logit_softcap"));
  MlaConfig m = deepseek_v2_lite_config();
  m.logit_softcap = std::numeric_limits<double>::infinity();
  CHECK_THROWS_AS(m.validate(), config_error);
  LrkvConfig l{16, 4, 4, 2};
  l.sink_tokens = 1;
  CHECK_THROWS_AS(l.validate(), config_error);
}

TEST_CASE("the reference forward uses the layer's own window, cap and sinks by default",
          "[window][reference]") {
  GqaConfig c = gqa_config(16, 4, 4, 2);
  c.window = 3;
  c.sink_tokens = 1;
  c.sink_logits = true;
  c.logit_softcap = 5.0;
  const auto layer = GqaLayer<double>::random(c, 4);
  REQUIRE(layer.weights().sinks.cols() == 4);
  const Mat x = test::random_input<double>(8, 16, 5);
  const Mat by_default = reference::forward(layer, x);
  CHECK(test::relative_error(by_default,
                             reference::forward(layer, x, Mask::sliding_window(3, 1))) == 0.0);
  // Not the plain causal model (the window and sinks change it).
  GqaConfig plain = c;
  plain.window = plain.sink_tokens = 0;
  plain.sink_logits = false;
  plain.logit_softcap = 0;
  GqaWeights<double> w = layer.weights();
  w.sinks.resize(0);
  CHECK(test::relative_error(by_default, reference::forward(GqaLayer<double>(plain, w), x)) > 1e-3);
  // The factored prefill computes the same model.
  auto cache = layer.make_cache();
  CHECK(test::relative_error(layer.prefill(x, cache), by_default) <= 1e-12);
}
