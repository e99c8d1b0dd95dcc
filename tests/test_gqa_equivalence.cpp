// [equivalence][gqa]: the factored prefill/decode path equals the expanded reference.
#include <catch2/catch.hpp>

#include "gqa_cases.hpp"
#include "kvattn/attention/gqa.hpp"
#include "kvattn/reference/gqa.hpp"
#include "test_util.hpp"

using namespace kvattn;
using kvattn::test::relative_error;

namespace {

// Prefill of the prompt, then one decode per remaining token, stacked as L x d.
template <class T>
RowMatrix<T> prefill_then_decode(const GqaLayer<T>& layer, const RowMatrix<T>& x, Index prompt,
                                 GqaCache<T>& cache) {
  RowMatrix<T> y(x.rows(), x.cols() == 0 ? 0 : layer.config().d_model);
  y.topRows(prompt) = layer.prefill(x.topRows(prompt), cache);
  RowVector<T> out(layer.config().d_model);
  for (Index t = prompt; t < x.rows(); ++t) {
    layer.decode(x.row(t), cache, out);
    y.row(t) = out;
  }
  return y;
}

template <class T>
void check_case(const kvattn::test::GqaCase& c) {
  INFO(c.describe());
  const auto weights = GqaWeights<T>::random(c.config, c.seed);
  const GqaLayer<T> layer(c.config, weights);
  const GqaLayer<double> reference_layer(c.config, weights.template cast<double>());
  const RowMatrix<T> x = kvattn::test::random_input<T>(c.length, c.config.d_model, c.seed + 7);
  const RowMatrix<double> expected = reference::forward(reference_layer, x.template cast<double>());
  constexpr double tol = kvattn::test::tolerance<T>();

  // Prefill + decodes equal the expanded reference on the whole sequence.
  auto cache = layer.make_cache();
  const RowMatrix<T> y = prefill_then_decode(layer, x, c.prompt, cache);
  const double error = relative_error(y, expected);
  INFO("prefill+decode error " << error << ", max abs "
                               << kvattn::test::max_abs_error(y, expected));
  CHECK(error <= tol);
  CHECK(cache.tokens() == c.length);

  // Prefill in chunks equals prefill at once.
  auto chunked_cache = layer.make_cache();
  RowMatrix<T> chunked(c.length, c.config.d_model);
  std::mt19937_64 rng(c.seed);
  for (Index start = 0; start < c.length;) {
    const Index n = std::uniform_int_distribution<Index>(1, c.length - start)(rng);
    chunked.middleRows(start, n) = layer.prefill(x.middleRows(start, n), chunked_cache);
    start += n;
  }
  auto once_cache = layer.make_cache();
  const RowMatrix<T> once = layer.prefill(x, once_cache);
  INFO("chunked vs once " << relative_error(chunked, once) << ", once vs reference "
                          << relative_error(once, expected));
  CHECK(relative_error(chunked, once) <= tol);
  CHECK(relative_error(once, expected) <= tol);

  // Decode after truncate(n) equals decode of the shorter sequence.
  const Index keep = std::uniform_int_distribution<Index>(0, c.length - 1)(rng);
  cache.truncate(keep);
  const RowMatrix<T> next = kvattn::test::random_input<T>(1, c.config.d_model, c.seed + 11);
  const RowVector<T> after_truncate = layer.decode(next.row(0), cache);
  RowMatrix<double> shorter(keep + 1, c.config.d_model);
  shorter.topRows(keep) = x.topRows(keep).template cast<double>();
  shorter.row(keep) = next.row(0).template cast<double>();
  const RowMatrix<double> shorter_expected = reference::forward(reference_layer, shorter);
  INFO("truncate(" << keep << ") then decode error "
                   << relative_error(after_truncate, shorter_expected.row(keep)));
  CHECK(relative_error(after_truncate, shorter_expected.row(keep)) <= tol);
}

}  // namespace

TEST_CASE("GQA family: factored paths equal the expanded reference in double",
          "[equivalence][gqa]") {
  for (const auto& c : kvattn::test::random_gqa_cases(56, 1)) check_case<double>(c);
}

TEST_CASE("GQA family: factored paths in float equal the double reference", "[equivalence][gqa]") {
  for (const auto& c : kvattn::test::random_gqa_cases(56, 2)) check_case<float>(c);
}
