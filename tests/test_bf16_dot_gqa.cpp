// DecodeArithmetic::bf16_dot on the GQA family (MHA, GQA, MQA): decode, attend and
// decode_batch over bf16 caches (contiguous, paged, a shared prefix) against the double
// reference on the stored rows, to the accuracy docs/api.md states. Built with the
// default flags (no AVX512-BF16: the setting must change nothing) and at the avx512bf16
// level (tests/CMakeLists.txt), where the kernels run. The kernels themselves are
// checked against double loops in test_bf16_dot.cpp.
#include "alloc_counter.hpp"  // first: replaces operator new, arms Eigen's malloc guard

#include <catch2/catch.hpp>

#include <cstdint>
#include <span>
#include <vector>

#include "attend_util.hpp"
#include "bf16_dot_util.hpp"
#include "kvattn/attention/gqa.hpp"
#include "kvattn/core/simd.hpp"
#include "kvattn/reference/gqa.hpp"
#include "test_util.hpp"

using namespace kvattn;
using namespace kvattn::test;

namespace {

using bf16 = Eigen::bfloat16;
using MatF = RowMatrix<float>;
using MatD = RowMatrix<double>;

GqaConfig small_gqa(Index n_heads, Index n_kv_heads, Index head_dim) {
  GqaConfig c = gqa_config(32, n_heads, head_dim, n_kv_heads);
  c.rope = {RopeLayout::half_split, 10000.0, 5};
  return c;
}

// The family's shapes through the kernels' branches: GQA with groups of 4 (the score's
// 4-row blocks, the values in 4 rows x 2 chunks) and of 3, a head width that is not whole
// chunks of 32 (the score's masked tail; the values summed widened), MQA's 16 rows (the
// outer-product score, the values by the dot kernel), and MHA, which ignores the setting
// (one row per group: docs/api.md).
std::vector<GqaConfig> family() {
  return {small_gqa(3, 3, 32), small_gqa(8, 2, 64), small_gqa(6, 2, 32), small_gqa(4, 2, 48),
          small_gqa(16, 1, 32)};
}

// The rows a cache stores (RoPE applied, rounded to its storage type), in double.
template <class Cache>
GqaCache<double> stored_rows(const GqaConfig& c, const Cache& cache) {
  const Index n = cache.tokens(), dh = c.head_dim;
  MatD keys(n, c.kv_width()), values(n, c.kv_width());
  for (Index t = 0; t < n; ++t) {
    for (Index g = 0; g < c.n_kv_heads; ++g) {
      for (Index j = 0; j < dh; ++j) {
        keys(t, g * dh + j) = static_cast<float>(cache.key_row(g, t)[j]);
        values(t, g * dh + j) = static_cast<float>(cache.value_row(g, t)[j]);
      }
    }
  }
  GqaCache<double> stored(c);
  stored.append(keys, values);
  return stored;
}

}  // namespace

TEST_CASE("GQA-family layers decode a bf16 cache with bf16 dot products to the stated accuracy",
          "[bf16_dot][gqa]") {
  for (const GqaConfig& c : family()) {
    const auto layer = GqaLayer<float>::random(c, 60 + c.n_heads);
    auto dot_layer = layer;
    CHECK(dot_layer.decode_arithmetic() == DecodeArithmetic::fp32);
    dot_layer.set_decode_arithmetic(DecodeArithmetic::bf16_dot);
    CHECK(dot_layer.decode_arithmetic() == DecodeArithmetic::bf16_dot);
    const auto dlayer = to_double(layer);
    // 9000: with two threads MQA's one group is split into ranges (flash-decoding), whose
    // partial states are merged in the dot kernel's column order.
    for (const Index length : {1, 7, 2000, 9000}) {
      const MatF keys = random_input<float>(length, c.kv_width(), length + 1);
      const MatF values = random_input<float>(length, c.kv_width(), length + 2);
      auto narrow = layer.template make_cache<bf16>();
      narrow.append(keys, values);
      auto full = layer.make_cache();
      full.append(keys, values);
      const MatF query = random_input<float>(1, c.query_width(), length + 3);
      const MatD want =
          reference::decode_step(dlayer, stored_rows(c, narrow), query.cast<double>());
      for (const Threads threads : {Threads{1}, Threads{2}}) {
        RowVector<float> plain(layer.heads_width()), dot(layer.heads_width()),
            dot_full(layer.heads_width()), plain_full(layer.heads_width());
        layer.attend(query, narrow, plain, threads);
        dot_layer.attend(query, narrow, dot, threads);
        layer.attend(query, full, plain_full, threads);
        dot_layer.attend(query, full, dot_full, threads);
        const double plain_error = relative_error(plain, want);
        const double dot_error = relative_error(dot, want);
        // attend_states takes the same step: its states, normalized, are the heads.
        SoftmaxStates<float> states;
        auto ws = dot_layer.make_workspace(threads);
        dot_layer.attend_states(query, length - 1, narrow, states, ws, threads);
        MatF normalized = states.acc;
        for (Index h = 0; h < c.n_heads; ++h) normalized.row(h) /= states.sum(h);
        const double states_error =
            relative_error(normalized.reshaped<Eigen::RowMajor>().transpose(), want);
        if (length > 1) {
          check_bf16_dot_error(states_error, bf16_dot_available() && c.group_size() >= 2);
        } else {
          CHECK(states_error <= kBf16DotTolerance);
        }
        CAPTURE(c.n_heads, c.n_kv_heads, c.head_dim, length, threads.count, plain_error, dot_error);
        CHECK(plain_error <= kFloatTolerance);  // the default stays float arithmetic
        CHECK(dot_full == plain_full);          // float caches ignore the setting
        if (bf16_dot_available() && c.group_size() >= 2) {
          CHECK(dot_error <= kBf16DotTolerance);
          // The weights were rounded (and the query, but for MQA's outer-product score),
          // so the kernels ran; one token has weight 1 whatever its logit.
          if (length > 1) CHECK(dot_error >= 1e-5);
        } else {
          CHECK(dot == plain);  // without the instruction, or for MHA, the same code runs
        }
      }
    }
  }
}

TEST_CASE("GQA's bf16 dot products work on a paged bf16 cache and in decode_batch",
          "[bf16_dot][gqa][paged][batch]") {
  const GqaConfig c = small_gqa(8, 2, 64);
  auto layer = GqaLayer<float>::random(c, 80);
  layer.set_decode_arithmetic(DecodeArithmetic::bf16_dot);
  const auto dlayer = to_double(layer);
  // Pages of 48 tokens; the prefix unit of decode_batch scores every sequence's rows of a
  // group at once (16 rows: the outer-product score, the values by the dot kernel).
  check_bf16_dot_paged_and_batch(
      layer, PagedGqaCache<float, bf16>(c, make_gqa_page_pool<bf16>(c, 48, 128)),
      [&](const PagedGqaCache<float, bf16>& cache, const MatD& query) -> MatD {
        return reference::decode_step(dlayer, stored_rows(c, cache), query);
      });
}

TEST_CASE("GQA's bf16 dot products allocate nothing after a warm-up", "[bf16_dot][gqa][alloc]") {
  const GqaConfig c = small_gqa(8, 2, 64);
  auto layer = GqaLayer<float>::random(c, 84);
  layer.set_decode_arithmetic(DecodeArithmetic::bf16_dot);
  check_bf16_dot_steps_allocate_nothing(
      layer,
      [&](GqaCache<float, bf16>& cache, Index length, std::uint64_t seed) {
        cache.append(random_input<float>(length, c.kv_width(), seed),
                     random_input<float>(length, c.kv_width(), seed + 1));
      },
      85);
}
