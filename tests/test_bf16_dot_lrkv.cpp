// DecodeArithmetic::bf16_dot on LRKV: decode, attend, attend_states and decode_batch over
// bf16 caches (contiguous, paged, a shared prefix) against the double reference on the
// stored rows, to the accuracy docs/api.md states. Built with the default flags (no
// AVX512-BF16: the setting must change nothing) and at the avx512bf16 level
// (tests/CMakeLists.txt), where the kernels run. The score kernel itself is checked
// against a double loop at the end.
#include "alloc_counter.hpp"  // first: replaces operator new, arms Eigen's malloc guard

#include <catch2/catch.hpp>

#include <cstdint>
#include <span>
#include <vector>

#include "attend_util.hpp"
#include "bf16_dot_util.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/core/simd.hpp"
#include "kvattn/detail/lrkv_kernels.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "test_util.hpp"

using namespace kvattn;
using namespace kvattn::test;

namespace {

using bf16 = Eigen::bfloat16;
using MatF = RowMatrix<float>;
using MatD = RowMatrix<double>;

LrkvConfig small_lrkv(Index n_heads, Index head_dim, Index rank, LrkvRopeMode mode, bool key_norm) {
  LrkvConfig c{48, n_heads, head_dim, rank, mode};
  if (mode != LrkvRopeMode::none) c.rope = {RopeLayout::half_split, 10000.0, 2};
  if (mode == LrkvRopeMode::decoupled) c.rope_dim = 8;
  c.key_norm = key_norm;
  return c;
}

// Through the kernel's branches: one packet of heads (6), two (20: the shared part's
// pair), three (40: a pair and one alone); residual ranks of one masked chunk (8, 20), a
// whole chunk (32) and a chunk and a masked one (54, the benchmark's), none (0); each
// RoPE mode the reference decode step takes (none, shared, decoupled), with and without
// key norms.
std::vector<LrkvConfig> configs() {
  return {small_lrkv(6, 32, 8, LrkvRopeMode::none, false),
          small_lrkv(20, 64, 54, LrkvRopeMode::shared, true),
          small_lrkv(40, 32, 20, LrkvRopeMode::decoupled, false),
          small_lrkv(6, 64, 32, LrkvRopeMode::decoupled, true),
          small_lrkv(20, 32, 0, LrkvRopeMode::shared, false)};
}

// The rows a cache stores (rounded to its storage type), read token by token (a paged
// cache's rows are contiguous per token only), in a double cache.
template <class Cache>
LrkvCache<double> stored_rows(const LrkvConfig& c, const Cache& cache) {
  LrkvCache<double> stored(c);
  const Index n = cache.tokens(), dh = c.head_dim, hr = c.residual_width();
  const Index dr = c.decoupled_dim(), norms = c.key_norm ? c.n_heads : 0;
  MatD a(n, dh), b(n, dh), k(n, hr), v(n, hr), e(n, dr), f(n, norms);
  for (Index t = 0; t < n; ++t) {
    const auto* key = cache.key_row(t);
    const auto* value = cache.value_row(t);
    for (Index j = 0; j < dh; ++j) {
      a(t, j) = static_cast<float>(key[j]);
      b(t, j) = static_cast<float>(value[j]);
    }
    for (Index j = 0; j < hr; ++j) {
      k(t, j) = static_cast<float>(key[dh + j]);
      v(t, j) = static_cast<float>(value[dh + j]);
    }
    for (Index j = 0; j < dr; ++j) e(t, j) = static_cast<float>(key[dh + hr + j]);
    for (Index h = 0; h < norms; ++h) f(t, h) = static_cast<double>(cache.rms_row(t)[h]);
  }
  if (n > 0) stored.append({a, b, k, v, e, f});
  return stored;
}

}  // namespace

TEST_CASE("LRKV decodes a bf16 cache with bf16 dot products to the stated accuracy",
          "[bf16_dot][lrkv]") {
  for (const LrkvConfig& c : configs()) {
    const auto layer = LrkvLayer<float>::random(c, 60 + c.n_heads, 0.7);
    auto dot_layer = layer;
    CHECK(dot_layer.decode_arithmetic() == DecodeArithmetic::fp32);
    dot_layer.set_decode_arithmetic(DecodeArithmetic::bf16_dot);
    CHECK(dot_layer.decode_arithmetic() == DecodeArithmetic::bf16_dot);
    const auto dlayer = to_double(layer);
    // 2000: with two threads the sequence is split into ranges (flash-decoding), whose
    // partial states are merged in the dot kernel's column order.
    for (const Index length : {1, 7, 300, 2000}) {
      auto narrow = layer.template make_cache<bf16>();
      auto full = layer.make_cache();
      layer.prefill(random_input<float>(length, c.d_model, length + 1), narrow);
      layer.prefill(random_input<float>(length, c.d_model, length + 1), full);
      const MatF query = random_input<float>(1, layer.query_width(), length + 3);
      const MatD want =
          reference::decode_step(dlayer, stored_rows(c, narrow), query.cast<double>());
      for (const Threads threads : {Threads{1}, Threads{2}}) {
        RowVector<float> plain(layer.heads_width()), dot(layer.heads_width()),
            dot_full(layer.heads_width()), plain_full(layer.heads_width());
        layer.attend(query, narrow, plain, threads);
        dot_layer.attend(query, narrow, dot, threads);
        layer.attend(query, full, plain_full, threads);
        dot_layer.attend(query, full, dot_full, threads);
        // attend_states takes the same step: its states, normalized, are the heads.
        SoftmaxStates<float> states;
        auto ws = dot_layer.make_workspace(threads);
        dot_layer.attend_states(query, length - 1, narrow, states, ws, threads);
        MatF normalized = states.acc;
        for (Index h = 0; h < c.n_heads; ++h) normalized.row(h) /= states.sum(h);
        const double states_error =
            relative_error(normalized.reshaped<Eigen::RowMajor>().transpose(), want);
        const double plain_error = relative_error(plain, want);
        const double dot_error = relative_error(dot, want);
        CAPTURE(c.n_heads, c.head_dim, c.rank, to_string(c.rope_mode), c.key_norm, length,
                threads.count, plain_error, dot_error, states_error);
        CHECK(plain_error <= kFloatTolerance);  // the default stays float arithmetic
        CHECK(dot_full == plain_full);          // float caches ignore the setting
        if (length > 1) {
          check_bf16_dot_error(states_error, bf16_dot_available());
        } else {
          CHECK(states_error <= (bf16_dot_available() ? kBf16DotTolerance : kFloatTolerance));
        }
        if (bf16_dot_available()) {
          CHECK(dot_error <= kBf16DotTolerance);
          // The query and the weights were rounded, so the kernels ran (a cache of one
          // token shows nothing: its weight is 1 whatever its logit).
          if (length > 1) CHECK(dot_error >= 1e-5);
        } else {
          CHECK(dot == plain);  // without the instruction the same code runs
        }
      }
    }
  }
}

// The setting changes nothing: the same code runs, so the outputs are identical.
template <class S>
void check_ignored(const LrkvConfig& c, std::uint64_t seed) {
  const auto layer = LrkvLayer<float>::random(c, seed, 0.7);
  auto dot_layer = layer;
  dot_layer.set_decode_arithmetic(DecodeArithmetic::bf16_dot);
  auto cache = layer.template make_cache<S>();
  layer.prefill(random_input<float>(300, c.d_model, seed + 1), cache);
  const MatF query = random_input<float>(1, layer.query_width(), seed + 2);
  RowVector<float> plain(layer.heads_width()), dot(layer.heads_width());
  layer.attend(query, cache, plain);
  dot_layer.attend(query, cache, dot);
  CHECK(dot == plain);
}

TEST_CASE(
    "LRKV ignores bf16 dot products where d_h is not whole chunks of 32, and on "
    "quantized caches",
    "[bf16_dot][lrkv]") {
  check_ignored<bf16>(small_lrkv(6, 24, 8, LrkvRopeMode::shared, false), 70);
  check_ignored<Int8<>>(small_lrkv(20, 64, 54, LrkvRopeMode::shared, true), 73);
  check_ignored<Fp8E4M3<>>(small_lrkv(20, 64, 54, LrkvRopeMode::decoupled, false), 76);
}

TEST_CASE("LRKV's bf16 dot products work on a paged bf16 cache and in decode_batch",
          "[bf16_dot][lrkv][paged][batch]") {
  const LrkvConfig c = small_lrkv(20, 64, 54, LrkvRopeMode::shared, true);
  auto layer = LrkvLayer<float>::random(c, 80, 0.7);
  layer.set_decode_arithmetic(DecodeArithmetic::bf16_dot);
  const auto dlayer = to_double(layer);
  // Pages of 24 tokens; the prefix unit of decode_batch scores every sequence's heads in
  // turn on each tile.
  check_bf16_dot_paged_and_batch(
      layer, PagedLrkvCache<float, bf16>(c, make_lrkv_page_pool<bf16>(c, 24, 256)),
      [&](const PagedLrkvCache<float, bf16>& cache, const MatD& query) -> MatD {
        return reference::decode_step(dlayer, stored_rows(c, cache), query);
      });
}

TEST_CASE("LRKV's bf16 dot products allocate nothing after a warm-up", "[bf16_dot][lrkv][alloc]") {
  const LrkvConfig c = small_lrkv(20, 64, 54, LrkvRopeMode::decoupled, true);
  auto layer = LrkvLayer<float>::random(c, 84, 0.7);
  layer.set_decode_arithmetic(DecodeArithmetic::bf16_dot);
  check_bf16_dot_steps_allocate_nothing(
      layer,
      [&](LrkvCache<float, bf16>& cache, Index length, std::uint64_t seed) {
        layer.prefill(random_input<float>(length, c.d_model, seed), cache);
      },
      85);
}

#if KVATTN_HAVE_BF16_DOT
TEST_CASE("lrkv_score_bf16_dot equals a double loop over its bf16 operands",
          "[bf16_dot][lrkv][kernels]") {
  // Heads 6 / 20 / 40 (one, two, three packets), ranks 0 / 20 / 54, 1 ... 37 tokens
  // (whole and partial blocks of 16); the operands are bf16, so the only rounding is the
  // float sums': the logits agree with double to float precision.
  for (const Index H : {6, 20, 40}) {
    for (const Index r : {0, 20, 54}) {
      for (const Index n : {1, 5, 16, 37}) {
        const Index dh = 64, hp = (H + 15) / 16 * 16, stride = dh + H * r + 3;
        const Index latent_stride = (r + 31) / 32 * 32;
        const MatF q = random_input<float>(H, dh, 1000 + H + r + n);
        const MatF ql = random_input<float>(H, r, 2000 + H + r + n);
        const MatF rows_f = random_input<float>(n, stride, 3000 + H + r + n);
        std::vector<bf16> pairs(static_cast<std::size_t>(dh * hp), bf16(0.0f));
        std::vector<bf16> latent(static_cast<std::size_t>(H * latent_stride), bf16(0.0f));
        std::vector<bf16> rows(static_cast<std::size_t>(n * stride));
        for (Index h = 0; h < H; ++h) {
          for (Index j = 0; j < dh; ++j)
            pairs[static_cast<std::size_t>((j / 2 * hp + h) * 2 + j % 2)] = bf16(q(h, j));
          for (Index j = 0; j < r; ++j)
            latent[static_cast<std::size_t>(h * latent_stride + j)] = bf16(ql(h, j));
        }
        for (Index i = 0; i < n * stride; ++i)
          rows[static_cast<std::size_t>(i)] = bf16(rows_f.data()[i]);
        const Index ld = (n + 15) / 16 * 16;
        std::vector<float> logits(static_cast<std::size_t>(H * ld));
        detail::lrkv_score_bf16_dot(pairs.data(), hp, latent.data(), latent_stride, H, dh, r,
                                    rows.data(), stride, n, logits.data(), ld);
        double worst = 0.0;
        for (Index h = 0; h < H; ++h) {
          for (Index t = 0; t < n; ++t) {
            double want = 0.0, magnitude = 0.0;
            for (Index j = 0; j < dh; ++j) {
              const double term =
                  static_cast<double>(static_cast<float>(bf16(q(h, j)))) *
                  static_cast<float>(rows[static_cast<std::size_t>(t * stride + j)]);
              want += term;
              magnitude += std::abs(term);
            }
            for (Index j = 0; j < r; ++j) {
              const double term =
                  static_cast<double>(static_cast<float>(bf16(ql(h, j)))) *
                  static_cast<float>(rows[static_cast<std::size_t>(t * stride + dh + h * r + j)]);
              want += term;
              magnitude += std::abs(term);
            }
            worst = std::max(
                worst, std::abs(logits[static_cast<std::size_t>(h * ld + t)] - want) / magnitude);
          }
        }
        CAPTURE(H, r, n, worst);
        CHECK(worst <= 1e-6);
      }
    }
  }
}
#endif
