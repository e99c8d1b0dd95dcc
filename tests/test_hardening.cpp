// Hostile input to the library (issue 12's findings, each reproduced on the old code):
// dimensions whose products overflow 64 bits, unbounded Threads, the budget solvers at
// the 64-bit limit, RoPE widths checked before anything is allocated, NaN weights in
// the head-diversity analysis, and key RMS values an LRKV cache cannot divide by. Each
// expected value is derived by hand in the comment beside it.
#include <catch2/catch.hpp>

#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "kvattn/analysis/budget.hpp"
#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/analysis/decode_cost.hpp"
#include "kvattn/analysis/head_diversity.hpp"
#include "kvattn/attention/attend_states.hpp"
#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"
#include "kvattn/core/quantized.hpp"
#include "kvattn/core/rope.hpp"
#include "kvattn/core/softmax_states.hpp"
#include "kvattn/core/yarn.hpp"
#include "kvattn/pooling/nv_embed_pooling.hpp"
#include "test_util.hpp"

using namespace kvattn;
using Catch::Matchers::Contains;

namespace {

constexpr Index k32 = Index{1} << 32;
constexpr Index k62 = Index{1} << 62;

/// Every call that takes a Threads (prefill, decode and attend with and without a
/// workspace, MLA's prefill in each mode, make_workspace) refuses counts outside
/// [0, kMax] with a config_error before any work: the cache, exactly full so that one
/// more token would grow it, keeps its tokens, capacity and bytes. The same calls with
/// Threads{2} then succeed, so the error is the count's.
template <class Layer>
void check_threads_bound(const Layer& layer) {
  using T = typename Layer::scalar_type;
  const Index d = layer.config().d_model;
  auto cache = layer.make_cache();
  while (cache.tokens() < 16 || cache.tokens() < cache.capacity()) {
    layer.prefill(test::random_input<T>(1, d, 40 + static_cast<std::uint64_t>(cache.tokens())),
                  cache, Threads{1});
  }
  REQUIRE(cache.tokens() == cache.capacity());
  const Index tokens = cache.tokens(), capacity = cache.capacity();
  const std::size_t bytes = cache.bytes();
  const RowMatrix<T> x = test::random_input<T>(5, d, 2);
  const RowMatrix<T> query = test::random_input<T>(1, layer.query_width(), 3);
  RowMatrix<T> out(1, d);
  RowMatrix<T> heads(1, layer.heads_width());
  auto ws = layer.make_workspace(Threads{1});
  const auto each_call = [&](Threads threads, auto&& expect) {
    expect("prefill", [&] { layer.prefill(x, cache, threads); });
    if constexpr (requires { layer.prefill(x, cache, threads, MlaPrefill::expanded); }) {
      for (const MlaPrefill mode :
           {MlaPrefill::automatic, MlaPrefill::expanded, MlaPrefill::absorbed}) {
        expect("prefill (MLA mode " + std::to_string(static_cast<int>(mode)) + ")",
               [&] { layer.prefill(x, cache, threads, mode); });
      }
    }
    expect("decode", [&] { layer.decode(x.topRows(1), cache, out, threads); });
    expect("decode with a workspace", [&] { layer.decode(x.topRows(1), cache, out, ws, threads); });
    expect("attend", [&] { layer.attend(query, cache, heads, threads); });
    expect("attend with a workspace", [&] { layer.attend(query, cache, heads, ws, threads); });
    expect("make_workspace", [&] { (void)layer.make_workspace(threads); });
  };
  for (const int count : {INT_MAX, Threads::kMax + 1, 100000, -1, INT_MIN}) {
    each_call(Threads{count}, [&](const std::string& call, auto&& run) {
      INFO(call << " with Threads{" << count << "}");
      CHECK_THROWS_WITH(run(), Contains("Threads: count (" + std::to_string(count) + ")"));
      CHECK_THROWS_AS(run(), config_error);
      CHECK(cache.tokens() == tokens);
      CHECK(cache.capacity() == capacity);
      CHECK(cache.bytes() == bytes);
    });
  }
  // Valid: each call runs (the prefills and decodes grow the cache).
  each_call(Threads{2}, [&](const std::string& call, auto&& run) {
    INFO(call << " with Threads{2}");
    CHECK_NOTHROW(run());
  });
  CHECK(cache.tokens() > tokens);
}

}  // namespace

TEST_CASE("GQA dimensions whose products overflow are a config_error naming the fields",
          "[reliability][gqa]") {
  // H d_h = 2^64 wraps to 0: the old validate() passed, the layer got a 1 x 0 w_q and
  // append segfaulted.
  const GqaConfig huge = gqa_config(1, k32, k32, k32);
  CHECK_THROWS_MATCHES(huge.validate(), config_error,
                       Catch::Matchers::Message(
                           "GqaConfig: query width n_heads x head_dim (4294967296 x 4294967296) "
                           "does not fit in a signed 64-bit size in bytes; the dimensions are "
                           "too large"));
  CHECK_THROWS_AS(GqaLayer<float>::random(huge, 1), config_error);
  CHECK_THROWS_AS(GqaCache<float>(huge), config_error);
  // 2^62 x 1 fits as a count but not in bytes of an 8-byte scalar (2^65).
  CHECK_THROWS_WITH(gqa_config(1, k62, 1, k62).validate(), Contains("n_heads x head_dim"));
  // d_model x H d_h = 2^31 x 2^31 = 2^62 elements, 2^65 bytes: the weight is refused.
  CHECK_THROWS_WITH(gqa_config(Index{1} << 31, 1, Index{1} << 31, 1).validate(),
                    Contains("w_q elements d_model x (n_heads x head_dim)"));
  // The largest sizes that fit stay valid: 2 n_kv d_h = 2^59 elements is 2^62 bytes.
  CHECK_NOTHROW(gqa_config(1, Index{1} << 58, 1, Index{1} << 58).validate());
}

TEST_CASE("MLA dimensions whose products overflow are a config_error naming the fields",
          "[reliability][mla]") {
  MlaConfig c;
  c.d_model = 1;
  c.n_heads = 1;
  c.kv_rank = 1;
  c.qk_nope_dim = 1;
  c.v_dim = 1;
  // kv_rank + rope_dim = 2^63 - 1 + 1 overflows: the old cache reported INT64_MIN
  // elements per token.
  c.kv_rank = std::numeric_limits<Index>::max();
  c.rope_dim = 2;
  CHECK_THROWS_WITH(c.validate(), Contains("elements per token kv_rank + rope_dim"));
  CHECK_THROWS_AS(MlaCache<float>(c), config_error);
  c.kv_rank = 1;
  c.rope_dim = 0;
  // H (d_nope + d_R) = 2^32 x 2^32 wraps: the query width.
  c.n_heads = k32;
  c.qk_nope_dim = k32;
  CHECK_THROWS_WITH(c.validate(), Contains("query width n_heads x (qk_nope_dim + rope_dim)"));
  c.n_heads = 1;
  c.qk_nope_dim = 1;
  c.kv_rank = k62;  // 2^62 elements per token: 2^65 bytes
  CHECK_THROWS_AS(c.validate(), config_error);
  CHECK_THROWS_AS(MlaLayer<float>::random(c, 1), config_error);
}

TEST_CASE("LRKV dimensions whose products overflow are a config_error naming the fields",
          "[reliability][lrkv]") {
  // H r = 2^32 x 2^32 wraps: the old cache width (d_h + H r) overflowed.
  LrkvConfig c{1, k32, k32, k32};
  CHECK_THROWS_WITH(c.validate(), Contains("n_heads x head_dim"));
  c = LrkvConfig{1, k62, 1, 1};  // H r = 2^62 fits, but not in bytes
  CHECK_THROWS_WITH(c.validate(), Contains("n_heads x head_dim"));
  c = LrkvConfig{1, Index{1} << 40, 1 << 20, 1 << 20};  // H d_h = 2^60: 2^63 bytes
  CHECK_THROWS_AS(c.validate(), config_error);
  CHECK_THROWS_AS(LrkvCache<float>(c), config_error);
  CHECK_THROWS_AS(LrkvLayer<float>::random(c, 1), config_error);
}

TEST_CASE("Threads above the documented maximum are a config_error, before any work",
          "[reliability][threads]") {
  // Threads{INT_MAX} made libgomp end the process ("Out of memory allocating ...").
  CHECK_THROWS_MATCHES(Threads{INT_MAX}.resolved(), config_error,
                       Catch::Matchers::Message("Threads: count (2147483647) must be in [1, "
                                                "256], or 0 for all available threads"));
  CHECK_THROWS_AS(Threads{Threads::kMax + 1}.resolved(), config_error);
  CHECK_NOTHROW(Threads{Threads::kMax}.resolved());
  CHECK(Threads::all().resolved() >= 1);
  CHECK(Threads::all().resolved() <= Threads::kMax);
  SECTION("GQA") { check_threads_bound(GqaLayer<float>::random(gqa_config(16, 4, 4, 2), 1)); }
  SECTION("MLA") {
    MlaConfig c;
    c.d_model = 20;
    c.n_heads = 3;
    c.kv_rank = 12;
    c.q_rank = 8;
    c.q_norm = true;
    c.qk_nope_dim = 6;
    c.rope_dim = 4;
    c.v_dim = 5;
    c.rope = {RopeLayout::interleaved, 10000.0, 2};
    check_threads_bound(MlaLayer<float>::random(c, 1));
  }
  SECTION("LRKV") { check_threads_bound(LrkvLayer<float>::random(LrkvConfig{16, 4, 8, 2}, 1)); }
}

TEST_CASE("budget solvers at the 64-bit limit answer instead of overflowing",
          "[reliability][analysis]") {
  using namespace analysis;
  // max_kv_rank(v2, 1 layer, INT64_MAX elements, step 1): every d_c fits the budget, so
  // the answer is the largest d_c that validate() accepts. W_UK has d_c x (H d_nope) =
  // d_c x 2^14 elements, 8 bytes each: d_c <= (2^63 - 1) / 2^17, i.e. 2^46 - 1 (W_UV the
  // same; W_DKV's d x d_c = 5120 d_c and the cache's d_c + 64 allow more).
  CHECK(max_kv_rank(deepseek_v2_config(), 1, {std::numeric_limits<Index>::max()}, {}, 1) ==
        (Index{1} << 46) - 1);
  // H = 2^58 heads of width 1 (the largest power of two whose 2 H d_h fits in bytes):
  // with the budget of MHA itself the answer is H; with 2^40 elements per token,
  // 2 n_kv <= 2^40 gives n_kv <= 2^39, a divisor of 2^58.
  GqaConfig wide = gqa_config(1, Index{1} << 58, 1, 1);
  CHECK(max_kv_heads(wide, 1, {std::numeric_limits<Index>::max()}) == Index{1} << 58);
  CHECK(max_kv_heads(wide, 1, {Index{1} << 40}) == Index{1} << 39);
  // A prime H = 2^31 - 1: only 1 and H divide it.
  wide.n_heads = 2147483647;
  CHECK(max_kv_heads(wide, 1, {2 * 2147483646LL}) == 1);
  CHECK(max_kv_heads(wide, 1, {2 * 2147483647LL}) == 2147483647);
  // H = 2^62 itself is not a valid layer (its w_q alone is 2^65 bytes of doubles).
  CHECK_THROWS_AS(max_kv_heads(gqa_config(1, k62, 1, 1), 1, {k62}), config_error);
  // Largest divisors of small numbers, against a plain loop.
  for (Index n = 1; n <= 200; ++n) {
    for (Index limit = 1; limit <= n; limit += 7) {
      Index want = 1;
      for (Index d = 1; d <= limit; ++d) want = n % d == 0 ? d : want;
      CAPTURE(n, limit);
      CHECK(analysis::detail::largest_divisor_at_most(n, limit) == want);
    }
  }
}

TEST_CASE("RoPE widths are checked before the frequencies are built", "[reliability][rope]") {
  // Rope({half_split}, -4) threw std::length_error ("cannot create std::vector larger
  // than max_size()") because the frequencies were built first.
  CHECK_THROWS_MATCHES(Rope({RopeLayout::half_split, 10000.0, 0}, -4), config_error,
                       Catch::Matchers::Message("Rope: rotary width (-4) must be even and > 0"));
  CHECK_THROWS_AS(Rope({RopeLayout::interleaved, 10000.0, 0}, 7), config_error);
  CHECK_THROWS_AS(rope_inverse_frequencies(-2, 10000.0), config_error);
  CHECK_THROWS_AS(rope_inverse_frequencies(4, 0.5), config_error);
  CHECK_THROWS_AS(make_rope({RopeLayout::half_split, 10000.0, 0}, -4, YarnConfig{true, 2.0}),
                  config_error);
  CHECK(Rope({RopeLayout::half_split, 10000.0, 0}, 4).dim() == 4);
  CHECK_FALSE(Rope({}, -4).enabled());  // no rotation: the width is not used
  // Positions are exact in double up to 2^53; a larger offset is refused.
  CHECK_THROWS_AS(
      gqa_config(8, 2, 4, 2, {RopeLayout::half_split, 10000.0, (Index{1} << 53) + 1}).validate(),
      config_error);
}

TEST_CASE("head diversity shows a NaN weight instead of hiding it", "[reliability][analysis]") {
  using namespace analysis;
  // effective_rank of a matrix with a NaN returned 0 (as if every eigenvalue were 0).
  RowMatrix<double> m = RowMatrix<double>::Identity(3, 3);
  CHECK(effective_rank(m) == Approx(3.0).epsilon(1e-12));
  m(1, 2) = m(2, 1) = std::numeric_limits<double>::quiet_NaN();
  CHECK(std::isnan(effective_rank(m)));
  m(1, 2) = m(2, 1) = std::numeric_limits<double>::infinity();
  CHECK(std::isnan(effective_rank(m)));
  CHECK(effective_rank(RowMatrix<double>::Zero(3, 3)) == 0.0);
  // head_diversity with a NaN weight said "head has a zero operator".
  GqaWeights<double> w = GqaWeights<double>::random(mha_config(8, 2, 4), 1);
  w.w_q(3, 5) = std::numeric_limits<double>::quiet_NaN();  // column 5: head 1
  const GqaLayer<double> layer(mha_config(8, 2, 4), w);
  CHECK_THROWS_AS(head_diversity(layer), config_error);
  CHECK_THROWS_WITH(head_diversity(layer),
                    Contains("head 1's operator") && Contains("NaN or an infinity"));
}

TEST_CASE("an LRKV cache refuses a key RMS it cannot divide by", "[reliability][lrkv]") {
  LrkvConfig c{8, 2, 4, 2};
  c.key_norm = true;
  LrkvCache<double> cache(c);
  const RowMatrix<double> shared = RowMatrix<double>::Ones(1, 4),
                          latent = RowMatrix<double>::Ones(1, 4);
  const RowMatrix<double> none(1, 0);
  for (const double bad : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN(),
                           std::numeric_limits<double>::infinity()}) {
    CAPTURE(bad);
    RowMatrix<double> rms = RowMatrix<double>::Ones(1, 2);
    rms(0, 1) = bad;
    CHECK_THROWS_WITH(cache.append({shared, shared, latent, latent, none, rms}),
                      Contains("key_rms(0, 1)") && Contains("expected a finite key RMS > 0"));
    CHECK(cache.tokens() == 0);
  }
  CHECK_NOTHROW(
      cache.append({shared, shared, latent, latent, none, RowMatrix<double>::Ones(1, 2)}));
  CHECK(cache.tokens() == 1);
}

// Public calls found unchecked in a review (2026-12-07): each read out of bounds or
// overflowed on the input below, or threw a standard exception instead of kvattn's.
TEST_CASE("cache views refuse a head or a row range the cache does not hold",
          "[reliability][cache]") {
  const GqaConfig gqa = gqa_config(8, 4, 2, 2);  // 4 query heads of width 2, 2 KV heads
  GqaCache<double> cache(gqa);
  cache.append(RowMatrix<double>::Ones(3, 4), RowMatrix<double>::Ones(3, 4));
  for (const Index g : {Index{-1}, Index{2}}) {
    CAPTURE(g);
    CHECK_THROWS_WITH(cache.keys(g),
                      Contains("GqaCache::keys") &&
                          Contains("KV head g (" + std::to_string(g) + ") must be in [0, 2)"));
    CHECK_THROWS_AS(cache.values(g), shape_error);
  }
  CHECK(cache.keys(1).rows() == 3);
  GqaCache<float, Int8<2>> quantized(gqa);
  quantized.append(RowMatrix<float>::Ones(1, 4), RowMatrix<float>::Ones(1, 4));
  CHECK_THROWS_AS(quantized.keys(5), shape_error);
  CHECK_THROWS_AS(quantized.values(-1), shape_error);

  LrkvCache<double> lrkv(LrkvConfig{8, 2, 4, 2});
  CHECK_THROWS_WITH(lrkv.residual_keys(2), Contains("head h (2) must be in [0, 2)"));
  CHECK_THROWS_AS(lrkv.residual_values(-1), shape_error);
  CHECK(lrkv.residual_keys(1).cols() == 2);

  MlaConfig mla;
  mla.d_model = 8;
  mla.n_heads = 2;
  mla.kv_rank = 4;
  mla.qk_nope_dim = 2;
  mla.rope_dim = 2;
  mla.v_dim = 2;
  mla.rope.layout = RopeLayout::interleaved;
  MlaCache<double> latents(mla);
  RowMatrix<double> rows(3, 6);
  for (Index i = 0; i < rows.size(); ++i) rows.data()[i] = static_cast<double>(i);
  latents.append(rows.leftCols(4), rows.rightCols(2));
  for (const auto& [first, count] :
       {std::pair<Index, Index>{0, 4}, {-1, 1}, {1, -1}, {3, 1}, {2, 2}}) {
    CAPTURE(first, count);
    CHECK_THROWS_WITH(latents.rows(first, count),
                      Contains("MlaCache::rows") && Contains("3 cached rows"));
  }
  CHECK(RowMatrix<double>(latents.rows(1, 2)) == rows.bottomRows(2));
  CHECK(latents.rows(1, 0).rows() == 0);

  // A negative reservation, refused by reserve(), was taken as none by the constructors.
  CHECK_THROWS_AS(GqaCache<double>(gqa, -5), shape_error);
  CHECK_THROWS_AS(LrkvCache<double>(LrkvConfig{8, 2, 4, 2}, -5), shape_error);
  CHECK_THROWS_AS(MlaCache<double>(mla, -5), shape_error);
}

TEST_CASE("RoPE helpers check the widths and settings they are given", "[reliability][rope]") {
  const Rope rope(RopeConfig{RopeLayout::half_split, 10000.0, 0}, 4);
  RowVector<double> narrow = RowVector<double>::Ones(2);
  CHECK_THROWS_WITH(rope.rotate(narrow, 1.0), Contains("Rope::rotate") && Contains("2 entries") &&
                                                  Contains("rotary width 4"));
  CHECK(narrow == RowVector<double>::Ones(2));
  RowVector<double> v(4);
  v << 1.0, 0.0, 0.0, 0.0;
  rope.rotate(v, 1.0);  // plane (0, 2) turned by angle 1 * theta^0 = 1
  CHECK(v(0) == Approx(std::cos(1.0)).epsilon(1e-15));
  CHECK(v(2) == Approx(std::sin(1.0)).epsilon(1e-15));
  // A disabled Rope leaves any vector as it is.
  RowVector<double> any = RowVector<double>::Ones(3);
  Rope(RopeConfig{}, 4).rotate(any, 1.0);
  CHECK(any == RowVector<double>::Ones(3));

  // interleaved_to_half_split(-1) threw std::length_error; (5) returned 0 2 1 3 0.
  for (const Index dim : {Index{-1}, Index{0}, Index{5}}) {
    CAPTURE(dim);
    CHECK_THROWS_WITH(interleaved_to_half_split(dim),
                      Contains("rotary width (" + std::to_string(dim) + ")"));
  }
  CHECK(interleaved_to_half_split(4) == std::vector<Index>{0, 2, 1, 3});

  // make_rope with YaRN never validated the YaRN settings: a factor of -1 gave negative
  // inverse frequencies.
  YarnConfig yarn;
  yarn.enabled = true;
  yarn.factor = -1.0;
  CHECK_THROWS_AS(make_rope(RopeConfig{RopeLayout::interleaved, 10000.0, 0}, 8, yarn),
                  config_error);
}

TEST_CASE("softmax states whose members disagree are a shape_error", "[reliability][states]") {
  SoftmaxStates<double> states(2, 3);
  states.max << 0.0, 0.0;
  states.sum << 1.0, 2.0;
  states.acc.setOnes();
  SoftmaxStates<double> short_sum = states;
  short_sum.sum.resize(0);
  SoftmaxStates<double> no_acc = states;
  no_acc.acc.resize(0, 3);
  RowMatrix<double> out(2, 3);
  for (SoftmaxStates<double>* bad : {&short_sum, &no_acc}) {
    CHECK_THROWS_WITH(finish_states(*bad, out),
                      Contains("finish_states") && Contains("must agree"));
    RowVector<double> sinks = RowVector<double>::Zero(2);
    CHECK_THROWS_AS(add_sink_logits(sinks, *bad), shape_error);
    CHECK_THROWS_AS(merge_states(*bad, states), shape_error);
  }
  finish_states(states, out);  // acc / sum: 1 and 1/2
  CHECK(out(0, 0) == 1.0);
  CHECK(out(1, 2) == 0.5);
}

TEST_CASE("the decode cost and cache layouts refuse lengths and fields they cannot count",
          "[reliability][analysis]") {
  using namespace analysis;
  const GqaConfig gqa = gqa_config(8, 4, 2, 2);
  // length + 1 overflowed for INT64_MAX and the error then named a negative length.
  CHECK_THROWS_WITH(decode_cost(gqa, std::numeric_limits<Index>::max()),
                    Contains("length (" + std::to_string(std::numeric_limits<Index>::max()) + ")"));
  // A weight_bytes below 1 was taken as given (-4 gave MLA a negative byte count).
  CHECK_THROWS_WITH(attend_cost(LrkvConfig{8, 2, 4, 2}, 16, {}, 0), Contains("weight_bytes (0)"));
  CHECK_THROWS_AS(decode_cost(gqa, 16, {}, -4), config_error);
  // 2 KV heads x (K, V) x 2 wide, fp32, one step over 10 cached tokens: 10 * 8 * 4 bytes.
  CHECK(attend_cost(gqa, 10, CacheStorage{Dtype::fp32}).bytes == 320.0);
  // A hand-built layout with a negative field gave overflow_error or a negative count.
  CacheLayout layout;
  layout.main = {-1, 4};
  CHECK_THROWS_WITH(layout.elements(), Contains("rows' count (-1)"));
  layout.main = {2, 4};
  layout.norms = -1;
  CHECK_THROWS_WITH(layout.elements(), Contains("norms (-1)"));
  layout.norms = 1;
  CHECK(layout.elements() == 9);
}

TEST_CASE("NV-Embed pooling refuses widths whose products overflow", "[reliability][pooling]") {
  NvEmbedPoolingConfig c;
  c.d_model = 2;
  c.n_latents = 4;
  c.n_heads = 2;
  c.ff_mult = k62;  // ff_hidden = 2^63 overflowed; the layer was built with a wrong shape
  CHECK_THROWS_WITH(c.validate(), Contains("ff_mult") && Contains("d_model"));
  c.ff_mult = 4;
  c.head_dim = k62;  // inner_dim = 2 * 2^62
  CHECK_THROWS_WITH(c.validate(), Contains("head_dim") && Contains("n_heads"));
  c.head_dim = 0;
  CHECK_NOTHROW(c.validate());
}
