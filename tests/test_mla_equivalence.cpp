// [equivalence][mla]: absorbed decode and both prefill formulations equal the
// expanded reference ("reconstruct, then attend") on the whole sequence.
#include <catch2/catch.hpp>

#include "kvattn/attention/mla.hpp"
#include "kvattn/reference/mla.hpp"
#include "test_mla_cases.hpp"
#include "test_util.hpp"

using namespace kvattn;
using kvattn::test::relative_error;

namespace {

// Tolerances of issue 3 on the normwise relative error against the double reference.
template <class T>
constexpr double mla_tolerance() {
  return sizeof(T) == sizeof(double) ? 1e-10 : 1e-4;
}

template <class T>
void check_case(const kvattn::test::MlaCase& c) {
  INFO(c.describe());
  const auto weights = MlaWeights<T>::random(c.config, c.seed);
  const MlaLayer<T> layer(c.config, weights);
  const MlaLayer<double> reference_layer(c.config, weights.template cast<double>());
  const RowMatrix<T> x = kvattn::test::random_input<T>(c.length, c.config.d_model, c.seed + 7);
  const RowMatrix<double> expected = reference::forward(reference_layer, x.template cast<double>());
  constexpr double tol = mla_tolerance<T>();

  // Prefill of the prompt, then absorbed decodes, equal the reference on every token.
  auto cache = layer.make_cache();
  const RowMatrix<T> y = kvattn::test::prefill_then_decode(layer, x, c.prompt, cache);
  const double error = relative_error(y, expected);
  INFO("prefill+decode error " << error << ", max abs "
                               << kvattn::test::max_abs_error(y, expected));
  CHECK(error <= tol);
  CHECK(cache.tokens() == c.length);

  // Decode of every token (absorbed) alone, from an empty cache.
  auto decode_cache = layer.make_cache();
  const RowMatrix<T> decoded = kvattn::test::prefill_then_decode(layer, x, 0, decode_cache);
  INFO("decode-only error " << relative_error(decoded, expected));
  CHECK(relative_error(decoded, expected) <= tol);

  // Both prefill formulations, at once, equal the reference.
  for (const MlaPrefill mode : {MlaPrefill::expanded, MlaPrefill::absorbed}) {
    auto once_cache = layer.make_cache();
    const RowMatrix<T> once = layer.prefill(x, once_cache, {}, mode);
    INFO("prefill mode " << static_cast<int>(mode) << " error " << relative_error(once, expected));
    CHECK(relative_error(once, expected) <= tol);
  }

  // Prefill in random chunks, alternating formulations, equals the reference.
  auto chunked_cache = layer.make_cache();
  RowMatrix<T> chunked(c.length, c.config.d_model);
  std::mt19937_64 rng(c.seed);
  int chunk = 0;
  for (Index start = 0; start < c.length; ++chunk) {
    const Index n = std::uniform_int_distribution<Index>(1, c.length - start)(rng);
    const MlaPrefill mode = chunk % 3 == 0   ? MlaPrefill::automatic
                            : chunk % 3 == 1 ? MlaPrefill::absorbed
                                             : MlaPrefill::expanded;
    chunked.middleRows(start, n) = layer.prefill(x.middleRows(start, n), chunked_cache, {}, mode);
    start += n;
  }
  INFO("chunked prefill error " << relative_error(chunked, expected));
  CHECK(relative_error(chunked, expected) <= tol);

  // Decode after truncate(n) equals the reference of the shorter sequence.
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

TEST_CASE("MLA: absorbed decode and both prefills equal the expanded reference in double",
          "[equivalence][mla]") {
  const auto cases = kvattn::test::random_mla_cases(60, 3);
  REQUIRE(cases.size() >= 50);
  for (const auto& c : cases) check_case<double>(c);
}

TEST_CASE("MLA: absorbed decode and both prefills in float equal the double reference",
          "[equivalence][mla]") {
  const auto cases = kvattn::test::random_mla_cases(60, 4);
  REQUIRE(cases.size() >= 50);
  for (const auto& c : cases) check_case<float>(c);
}

TEST_CASE("MLA: the random cases cover every required variant", "[equivalence][mla]") {
  int compressed = 0, plain = 0, normed = 0, unnormed = 0, dv_differs = 0, half = 0,
      interleaved = 0, no_rope = 0, yarn = 0, decode_only = 0;
  Index shortest = 1 << 20, longest = 0;
  for (const auto& k : kvattn::test::random_mla_cases(60, 3)) {
    const MlaConfig& c = k.config;
    (c.q_rank > 0 ? compressed : plain)++;
    (c.kv_norm && c.q_norm ? normed : unnormed)++;
    dv_differs += c.v_dim != c.qk_nope_dim;
    half += c.rope.layout == RopeLayout::half_split;
    interleaved += c.rope.layout == RopeLayout::interleaved;
    no_rope += c.rope.layout == RopeLayout::none;
    yarn += c.yarn.enabled;
    decode_only += k.prompt == 0;
    shortest = std::min(shortest, k.length);
    longest = std::max(longest, k.length);
  }
  CHECK(compressed > 0);
  CHECK(plain > 0);
  CHECK(normed > 0);
  CHECK(unnormed > 0);
  CHECK(dv_differs > 0);
  CHECK(half > 0);
  CHECK(interleaved > 0);
  CHECK(no_rope > 0);
  CHECK(yarn > 0);
  CHECK(decode_only > 0);
  CHECK(shortest == 1);
  CHECK(longest == 512);
}
