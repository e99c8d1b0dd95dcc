// [threads]: attend() and decode() with kvattn::Threads (groups spread over threads, and
// the sequence split across threads with an exact merge of the partial softmax states)
// for MHA, GQA, MQA, MLA and LRKV agree with the expanded reference decode step
// computed in double on the same cache contents, at lengths below and above the split
// threshold; Threads{2} agrees with Threads{1}; bad thread counts, empty caches and
// wrong shapes throw; a NaN query or a +inf logit poisons exactly its head.
//
// Caches are filled with random rows by the raw append (a prefill would be quadratic
// at these lengths); the reference reads the same stored rows widened to double, so
// the only differences are the kernels' float arithmetic.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "attend_util.hpp"
#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"
#include "kvattn/core/threads.hpp"
#include "kvattn/reference/gqa.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "kvattn/reference/mla.hpp"
#include "test_util.hpp"

using namespace kvattn;
using kvattn::test::heads_width;
using kvattn::test::project_query;
using kvattn::test::query_width;
using kvattn::test::random_input;
using kvattn::test::relative_error;
using kvattn::test::to_double;

namespace {

using MatF = RowMatrix<float>;
using MatD = RowMatrix<double>;

// Tolerance of a float attend/decode against the double reference (normwise relative).
// Float's unit roundoff is u = 2^-24 ~ 6e-8. A logit is a dot product of <= 144 terms
// (MLA's d_c + d_R), off by ~sqrt(144) u sum|q_i k_i| ~ 1e-6 absolute for these O(1)
// scaled logits, hence ~1e-6 relative on each softmax weight; the weighted sum over up
// to 2000 tokens (blocked partial sums per tile, one rescale per tile) adds rounding
// growing like sqrt(L) u ~ 3e-6; the absorptions through W_UK / W_UV and W_O add ~1e-6.
// 1e-5, as for every float path of the suite (test_util.hpp), is above that estimate.
// Measured here: attend 1.2e-6, decode 1.3e-6 (max over all configs, lengths, threads).
constexpr double kTolerance = 1e-5;
// Threads{n} against Threads{1}: the same float operations up to the order of the sum
// over splits (the merge rescales partial sums by exp(m_s - m)), so the two differ by a
// few roundings of the result, not by more than either differs from the reference.
// Measured: 1.3e-6 (0 where the plan does not split).
constexpr double kThreadsTolerance = 1e-5;

const Threads kThreadCounts[] = {Threads{1}, Threads{2}, Threads{3}, Threads::all()};

// ---- Per mechanism: fill a cache with random rows, copy its contents into a double
// cache (exact: float -> double widening), and the projected query of an input x.

template <class S>
void fill(GqaCache<float, S>& cache, const MatF& keys, const MatF& values) {
  cache.append(keys, values);
}

template <class S>
void fill_random(GqaCache<float, S>& cache, Index n, std::uint64_t seed) {
  const Index w = cache.config().n_kv_heads * cache.config().head_dim;
  cache.append(random_input<float>(n, w, seed), random_input<float>(n, w, seed + 1));
}

template <class S>
void fill_random(MlaCache<float, S>& cache, Index n, std::uint64_t seed) {
  const MlaConfig& c = cache.config();
  cache.append(random_input<float>(n, c.kv_rank, seed),
               random_input<float>(n, c.rope_dim, seed + 1));
}

template <class S>
void fill_random(LrkvCache<float, S>& cache, Index n, std::uint64_t seed) {
  const LrkvConfig& c = cache.config();
  const Index hr = c.n_heads * c.rank;
  std::mt19937_64 rng(seed + 5);
  std::uniform_real_distribution<float> rho(0.5f, 1.5f);  // key RMS, > 0
  MatF key_rms(n, c.key_norm ? c.n_heads : 0);
  for (Index i = 0; i < key_rms.size(); ++i) key_rms.data()[i] = rho(rng);
  const MatF sk = random_input<float>(n, c.head_dim, seed);
  const MatF sv = random_input<float>(n, c.head_dim, seed + 1);
  const MatF rk = random_input<float>(n, hr, seed + 2);
  const MatF rv = random_input<float>(n, hr, seed + 3);
  const MatF kr = random_input<float>(n, c.decoupled_dim(), seed + 4);
  cache.append({sk, sv, rk, rv, kr, key_rms});
}

template <class S>
GqaCache<double> widen(const GqaCache<float, S>& cache) {
  const GqaConfig& c = cache.config();
  const Index dh = c.head_dim;
  MatD keys(cache.tokens(), c.n_kv_heads * dh), values(cache.tokens(), c.n_kv_heads * dh);
  for (Index g = 0; g < c.n_kv_heads; ++g) {
    keys.middleCols(g * dh, dh) = cache.keys(g).template cast<float>().template cast<double>();
    values.middleCols(g * dh, dh) = cache.values(g).template cast<float>().template cast<double>();
  }
  GqaCache<double> wide(c);
  wide.append(keys, values);
  return wide;
}

template <class S>
MlaCache<double> widen(const MlaCache<float, S>& cache) {
  MlaCache<double> wide(cache.config());
  const MatD latent = cache.latent().template cast<float>().template cast<double>();
  const MatD rope = cache.rope_keys().template cast<float>().template cast<double>();
  wide.append(latent, rope);
  return wide;
}

template <class S>
LrkvCache<double> widen(const LrkvCache<float, S>& cache) {
  auto d = [](const auto& m) -> MatD { return m.template cast<float>().template cast<double>(); };
  const MatD sk = d(cache.shared_keys()), sv = d(cache.shared_values());
  const MatD rk = d(cache.residual_keys()), rv = d(cache.residual_values());
  const MatD kr = d(cache.rope_keys()), rms = d(cache.key_rms());
  LrkvCache<double> wide(cache.config());
  wide.append({sk, sv, rk, rv, kr, rms});
  return wide;
}

Index head_dim_out(const GqaConfig& c) { return c.head_dim; }
Index head_dim_out(const MlaConfig& c) { return c.v_dim; }
Index head_dim_out(const LrkvConfig& c) { return c.head_dim; }

// attend and decode at every thread count against the double reference, on a cache of
// `length` random tokens (attend: the newest of them; decode: one more token).
template <class Layer>
void check_against_reference(const Layer& layer, Index length, std::uint64_t seed) {
  const auto& c = layer.config();
  const auto dlayer = to_double(layer);
  auto cache = layer.make_cache(length + 1);
  fill_random(cache, length, seed);
  const MatF query = random_input<float>(1, query_width(c), seed + 10);
  const MatD want_heads = reference::decode_step(dlayer, widen(cache), query.cast<double>());

  const RowVector<float> x = random_input<float>(1, c.d_model, seed + 11);
  // decode's reference: on the cache Threads{1}'s decode left (the other thread counts
  // append the same row, up to rounding in the projections).
  MatD want_out;
  RowVector<float> heads_t1, out_t1;
  for (const Threads threads : kThreadCounts) {
    CAPTURE(length, threads.count, threads.resolved());
    RowVector<float> heads(heads_width(c));
    layer.attend(query, cache, heads, threads);
    REQUIRE(cache.tokens() == length);  // attend does not modify the cache
    const double attend_error = relative_error(heads, want_heads);
    CAPTURE(attend_error);
    CHECK(attend_error <= kTolerance);

    auto decoded = cache;  // a fork: decode appends x's token
    RowVector<float> out(c.d_model);
    layer.decode(x, decoded, out, threads);
    REQUIRE(decoded.tokens() == length + 1);
    if (threads.count == 1) {
      const MatD q = project_query(dlayer, x.cast<double>());
      want_out = reference::decode_step(dlayer, widen(decoded), q) * dlayer.weights().w_o;
      heads_t1 = heads;
      out_t1 = out;
    }
    const double decode_error = relative_error(out, want_out);
    CAPTURE(decode_error);
    CHECK(decode_error <= kTolerance);
    const double heads_vs_t1 = relative_error(heads, heads_t1);
    const double out_vs_t1 = relative_error(out, out_t1);
    CAPTURE(heads_vs_t1, out_vs_t1);
    CHECK(heads_vs_t1 <= kThreadsTolerance);
    CHECK(out_vs_t1 <= kThreadsTolerance);
  }
}

// Lengths below the split threshold (1, 5) and above it: plan_split cuts the sequence
// into ranges of >= 4 split granules, or of 2 where 4 would leave a thread idle, so with
// 2 threads and one group a length splits from 4 granules (detail::split_granule: GQA
// d_h 64 -> 256 tokens of its 2048-token tiles, LRKV 16, MLA below 112). 300 splits for
// LRKV only; 2000 for every one-group layer, MQA's into ranges of 2 granules.
const Index kLengths[] = {1, 5, 300, 2000};

MlaConfig small_mla() {
  MlaConfig c;
  c.d_model = 48;
  c.n_heads = 4;
  c.kv_rank = 128;  // a 576-byte row keeps the tile at 112 tokens, so L = 2000 splits
  c.q_rank = 24;
  c.q_norm = true;
  c.qk_nope_dim = 16;
  c.rope_dim = 16;
  c.v_dim = 12;
  c.rope = {RopeLayout::interleaved, 10000.0, 3};
  return c;
}

LrkvConfig small_lrkv(LrkvRopeMode mode, bool key_norm) {
  LrkvConfig c{48, 6, 32, 8, mode};
  if (mode != LrkvRopeMode::none) c.rope = {RopeLayout::half_split, 10000.0, 2};
  c.key_norm = key_norm;
  return c;
}

void warn_without_openmp() {
  if (!have_openmp) WARN("kvattn::have_openmp is false: every Threads count runs on one thread");
}

}  // namespace

TEST_CASE("GQA family attend/decode at 1, 2, 3 and all threads equal the reference", "[threads]") {
  warn_without_openmp();
  const RopeConfig rope{RopeLayout::half_split, 10000.0, 7};
  GqaConfig biased = gqa_config(64, 16, 64, 2, rope);
  biased.qkv_bias = true;
  const GqaConfig configs[] = {mha_config(64, 8, 64, rope), gqa_config(64, 8, 64, 2, rope), biased,
                               gqa_config(64, 16, 64, 8, rope), mqa_config(64, 16, 64, rope)};
  std::uint64_t seed = 100;
  for (const GqaConfig& config : configs) {
    const auto layer = GqaLayer<float>::random(config, seed);
    if (config.n_kv_heads == 1) {  // MQA: the longest length does exercise the split
      CHECK(detail::plan_split(1, config.n_heads, config.head_dim, kLengths[3], layer.decode_tile(),
                               0, 2)
                .splits >= 2);
    }
    for (const Index length : kLengths) {
      CAPTURE(config.n_heads, config.n_kv_heads, config.qkv_bias);
      check_against_reference(layer, length, seed + static_cast<std::uint64_t>(length));
    }
    ++seed;
  }
}

TEST_CASE("MLA attend/decode at 1, 2, 3 and all threads equal the reference", "[threads]") {
  warn_without_openmp();
  const auto layer = MlaLayer<float>::random(small_mla(), 200);
  // The chosen length does exercise the sequence split at 2 and 3 threads.
  const MlaConfig& c = layer.config();
  CHECK(detail::plan_split(1, c.n_heads, c.kv_rank, 2000, layer.decode_tile(), 0, 2).splits >= 2);
  CHECK(detail::plan_split(1, c.n_heads, c.kv_rank, 2000, layer.decode_tile(), 0, 3).splits >= 3);
  for (const Index length : kLengths) check_against_reference(layer, length, 210 + length);
}

TEST_CASE("LRKV attend/decode at 1, 2, 3 and all threads equal the reference", "[threads]") {
  warn_without_openmp();
  std::uint64_t seed = 300;
  for (const auto mode : {LrkvRopeMode::none, LrkvRopeMode::shared}) {
    for (const bool key_norm : {false, true}) {
      // Large residuals (0.7), so that a wrong residual path shows.
      const auto layer = LrkvLayer<float>::random(small_lrkv(mode, key_norm), seed, 0.7);
      for (const Index length : kLengths) {
        CAPTURE(to_string(mode), key_norm);
        check_against_reference(layer, length, seed + static_cast<std::uint64_t>(length));
      }
      ++seed;
    }
  }
}

namespace {

// The windows, sinks, sink logits and soft-caps of the split test below: a window long
// enough to split (its tokens >= 4 split granules at 2 threads), so a split can end
// inside the sink tokens or start inside the window, and the sink logit must enter once
// after the merge.
template <class Config>
std::vector<Config> with_spans(Config c, Index window) {
  std::vector<Config> out;
  Config logits = c;
  logits.sink_logits = true;
  logits.logit_softcap = 1.5;
  out.push_back(logits);
  Config windowed = c;
  windowed.window = window;
  windowed.sink_tokens = 7;
  out.push_back(windowed);
  windowed.sink_logits = true;
  windowed.logit_softcap = 0.8;
  out.push_back(windowed);
  return out;
}

}  // namespace

TEST_CASE("windows, sinks, sink logits and soft-caps over a split sequence equal the reference",
          "[threads][window]") {
  warn_without_openmp();
  const RopeConfig rope{RopeLayout::half_split, 10000.0, 7};
  std::uint64_t seed = 400;
  for (const GqaConfig& config :
       with_spans(mha_config(64, 2, 64, rope), 1500)) {  // 2 groups: 2 threads split too
    CAPTURE(config.window, config.sink_tokens, config.sink_logits, config.logit_softcap);
    const auto layer = GqaLayer<float>::random(config, seed++);
    for (const Index length : {Index{5}, Index{2000}}) check_against_reference(layer, length, seed);
  }
  // One group: 2 threads split a window of 4500 (and all 5000 tokens).
  for (const GqaConfig& config : with_spans(mqa_config(64, 4, 64, rope), 4500)) {
    CAPTURE(config.window, config.sink_tokens, config.sink_logits, config.logit_softcap);
    const auto layer = GqaLayer<float>::random(config, seed++);
    CHECK(detail::plan_split(1, 4, 64, 5000, layer.decode_tile(), 0, 2,
                             detail::AttentionSpan::of(config))
              .splits >= 2);
    check_against_reference(layer, 5000, seed);
  }
  for (const MlaConfig& config : with_spans(small_mla(), 1500)) {
    CAPTURE(config.window, config.sink_tokens, config.sink_logits, config.logit_softcap);
    const auto layer = MlaLayer<float>::random(config, seed++);
    CHECK(detail::plan_split(1, config.n_heads, config.kv_rank, 2000, layer.decode_tile(), 0, 3,
                             detail::AttentionSpan::of(config))
              .splits >= 3);
    check_against_reference(layer, 2000, seed);
  }
  for (const LrkvConfig& config : with_spans(small_lrkv(LrkvRopeMode::shared, true), 300)) {
    CAPTURE(config.window, config.sink_tokens, config.sink_logits, config.logit_softcap);
    const auto layer = LrkvLayer<float>::random(config, seed++, 0.7);
    for (const Index length : {Index{5}, Index{2000}}) check_against_reference(layer, length, seed);
  }
}

namespace {

// Bad thread counts, empty caches and wrong shapes throw, naming the argument, and a
// throwing decode leaves the cache as it was.
template <class Layer>
void check_errors(const Layer& layer) {
  const auto& c = layer.config();
  auto cache = layer.make_cache();
  RowVector<float> heads(heads_width(c));
  const MatF query = random_input<float>(1, query_width(c), 1);
  CHECK_THROWS_AS(layer.attend(query, cache, heads, Threads{1}), shape_error);  // empty
  CHECK_THROWS_AS(layer.attend(query, cache, heads, Threads{2}), shape_error);
  fill_random(cache, 3, 2);
  CHECK_THROWS_AS(layer.attend(query, cache, heads, Threads{-1}), config_error);
  const RowVector<float> x = random_input<float>(1, c.d_model, 3);
  RowVector<float> out(c.d_model);
  CHECK_THROWS_AS(layer.decode(x, cache, out, Threads{-1}), config_error);
  CHECK(cache.tokens() == 3);
  CHECK_THROWS_WITH(layer.decode(x, cache, out, Threads{-3}), Catch::Contains("Threads"));

  const MatF wide_query = random_input<float>(1, query_width(c) + 1, 4);
  const MatF two_queries = random_input<float>(2, query_width(c), 5);
  CHECK_THROWS_AS(layer.attend(wide_query, cache, heads, Threads{2}), shape_error);
  CHECK_THROWS_WITH(layer.attend(wide_query, cache, heads, Threads{2}), Catch::Contains("query"));
  CHECK_THROWS_AS(layer.attend(two_queries, cache, heads, Threads{1}), shape_error);
  RowVector<float> narrow_heads(heads_width(c) - 1);
  CHECK_THROWS_AS(layer.attend(query, cache, narrow_heads, Threads{2}), shape_error);
  CHECK_THROWS_WITH(layer.attend(query, cache, narrow_heads, Threads{2}), Catch::Contains("heads"));
  CHECK(cache.tokens() == 3);
  CHECK_NOTHROW(layer.attend(query, cache, heads, Threads{2}));
}

}  // namespace

TEST_CASE("attend/decode reject bad thread counts, empty caches and wrong shapes", "[threads]") {
  check_errors(GqaLayer<float>::random(gqa_config(16, 4, 8, 2), 1));
  check_errors(MlaLayer<float>::random(small_mla(), 2));
  check_errors(LrkvLayer<float>::random(small_lrkv(LrkvRopeMode::shared, true), 3));
  CHECK_THROWS_AS(Threads{-1}.resolved(), config_error);
  CHECK(Threads{1}.resolved() == 1);
  if (have_openmp) CHECK(Threads{3}.resolved() == 3);
  CHECK(Threads::all().resolved() >= 1);
}

namespace {

bool all_nan(const RowVector<float>& v) { return v.array().isNaN().all(); }

// `heads` from attend: head `bad` is all NaN; every other head is finite and equals
// the double reference's head.
template <class Config>
void check_poisoned_head(const Config& c, const RowVector<float>& heads, const MatD& want,
                         Index bad) {
  const Index w = head_dim_out(c);
  for (Index h = 0; h < c.n_heads; ++h) {
    CAPTURE(h, bad);
    const RowVector<float> got = heads.segment(h * w, w);
    if (h == bad) {
      CHECK(all_nan(got));
    } else {
      CHECK(got.allFinite());
      CHECK(relative_error(got, want.middleCols(h * w, w)) <= kTolerance);
    }
  }
}

// A NaN in head `bad`'s query: that head's output is all NaN, the others unharmed.
template <class Layer>
void check_nan_query(const Layer& layer, Index length, Index bad, Index element) {
  const auto& c = layer.config();
  const auto dlayer = to_double(layer);
  auto cache = layer.make_cache();
  fill_random(cache, length, 40);
  MatF query = random_input<float>(1, query_width(c), 41);
  query(0, element) = std::numeric_limits<float>::quiet_NaN();
  const MatD want = reference::decode_step(dlayer, widen(cache), query.cast<double>());
  for (const Threads threads : {Threads{1}, Threads{2}, Threads{3}}) {
    CAPTURE(length, threads.count);
    RowVector<float> heads(heads_width(c));
    layer.attend(query, cache, heads, threads);
    check_poisoned_head(c, heads, want, bad);
  }
}

}  // namespace

TEST_CASE("A NaN in one head's query makes that head's output NaN at every thread count",
          "[threads]") {
  const RopeConfig rope{RopeLayout::half_split, 10000.0, 0};
  for (const Index length : {5, 1100}) {
    // GQA: head 5 (group 1); MQA: one group of 8, so 2 threads split the sequence.
    check_nan_query(GqaLayer<float>::random(gqa_config(64, 8, 64, 2, rope), 1), length, 5,
                    5 * 64 + 3);
    check_nan_query(GqaLayer<float>::random(mqa_config(64, 8, 64, rope), 2), length, 5,
                    5 * 64 + 40);
    // MLA: a content element of head 1 (absorbed through W_UK into all of its row).
    check_nan_query(MlaLayer<float>::random(small_mla(), 3), length, 1, 1 * 32 + 2);
    // LRKV: head 2's query reaches the shared and the residual logits.
    check_nan_query(LrkvLayer<float>::random(small_lrkv(LrkvRopeMode::shared, true), 4), length, 2,
                    2 * 32 + 7);
  }
}

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// A cached key with a +inf element at token `j`, and a query that multiplies it by +1
// for head 0 (a +inf logit: head 0 must come out all NaN) and by -1 for every other
// head (a -inf logit: that token gets weight 0, the head stays finite). RoPE is off so
// the signs are exactly those of the query elements.
template <class Layer>
void check_inf_logit(const Layer& layer, Index length, Index j) {
  const auto& c = layer.config();
  const auto dlayer = to_double(layer);
  auto cache = layer.make_cache();
  MatF query = random_input<float>(1, query_width(c), 51);
  Index column = 0;  // the query element that meets the +inf key element, head 0
  Index stride = 0;  // the same element of the next head
  if constexpr (std::is_same_v<Layer, GqaLayer<float>>) {
    const Index w = c.n_kv_heads * c.head_dim;
    MatF keys = random_input<float>(length, w, 52);
    keys(j, 0) = kInf;  // KV head 0, which head 0's group reads
    fill(cache, keys, random_input<float>(length, w, 53));
    stride = c.head_dim;
  } else if constexpr (std::is_same_v<Layer, MlaLayer<float>>) {
    MatF rope_keys = random_input<float>(length, c.rope_dim, 52);
    rope_keys(j, 0) = kInf;  // the rope key is shared by every head
    cache.append(random_input<float>(length, c.kv_rank, 53), rope_keys);
    column = c.qk_nope_dim;
    stride = c.qk_head_dim();
  } else {
    MatF shared_keys = random_input<float>(length, c.head_dim, 52);
    shared_keys(j, 0) = kInf;  // the shared key is read by every head
    const Index hr = c.n_heads * c.rank;
    cache.append({shared_keys, random_input<float>(length, c.head_dim, 53),
                  random_input<float>(length, hr, 54), random_input<float>(length, hr, 55),
                  MatF(length, 0), MatF(length, 0)});
    stride = c.head_dim;
  }
  for (Index h = 0; h < c.n_heads; ++h) query(0, column + h * stride) = h == 0 ? 1.0f : -1.0f;
  // GQA: heads of other groups read another KV head, whose logits stay finite.
  const MatD want = reference::decode_step(dlayer, widen(cache), query.cast<double>());
  for (const Threads threads : {Threads{1}, Threads{2}, Threads{3}}) {
    CAPTURE(length, j, threads.count);
    RowVector<float> heads(heads_width(c));
    layer.attend(query, cache, heads, threads);
    check_poisoned_head(c, heads, want, 0);
  }
}

}  // namespace

TEST_CASE("A +inf logit makes its head's output NaN at every thread count", "[threads]") {
  MlaConfig mla = small_mla();
  mla.rope.layout = RopeLayout::none;  // rope_dim stays: an unrotated shared key channel
  const auto mha = GqaLayer<float>::random(mha_config(64, 4, 64), 1);
  const auto gqa = GqaLayer<float>::random(gqa_config(64, 8, 64, 2), 2);
  const auto mqa = GqaLayer<float>::random(mqa_config(64, 8, 64), 3);
  const auto mla_layer = MlaLayer<float>::random(mla, 4);
  const auto lrkv = LrkvLayer<float>::random(small_lrkv(LrkvRopeMode::none, false), 5);
  // 1100 tokens: 2 threads split every one-group sequence here (MQA's tile is 128 tokens,
  // MLA's 112, LRKV's 16), in ranges of 550.
  const Index length = 1100;
  // The first token, one inside a later tile of the second split, and the newest.
  for (const Index j : {Index{0}, Index{700}, length - 1}) {
    check_inf_logit(mha, length, j);
    check_inf_logit(gqa, length, j);
    check_inf_logit(mqa, length, j);
    check_inf_logit(mla_layer, length, j);
    check_inf_logit(lrkv, length, j);
  }
}
