// [kernels]: the decode kernels (detail/decode_kernels.hpp, detail/packet_ops.hpp,
// detail/transposed_score.hpp with MLA's 16 and 32 heads in AVX-512 builds) and
// the split online-softmax driver (detail/split_attention.hpp) against plain loops in
// double, at awkward sizes (1, 3, 54, 59, 111, 127, 129: below a packet, tails of every
// length, several register blocks), with shared and per-row (segmented) columns, fp32
// and bf16 storage; and the driver's NaN / +inf / -inf rules. Also the batch product
// (detail/batch_product.hpp) that projects a decode_batch's few rows.
//
// The same file is built once more per instruction-set level (test_decode_kernels_avx2
// with -mavx2 -mfma, test_decode_kernels_avx512 with -march=x86-64-v4): such a binary
// exits as skipped on a CPU without its level (tests/cpu_guard.cpp).
#include <catch2/catch.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"
#include "kvattn/core/simd.hpp"
#include "kvattn/core/threads.hpp"
#include "kvattn/detail/batch_product.hpp"
#include "kvattn/detail/decode_kernels.hpp"
#include "kvattn/detail/lrkv_kernels.hpp"
#include "kvattn/detail/split_attention.hpp"
#include "kvattn/detail/transposed_score.hpp"
#include "kvattn/reference/gqa.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "kvattn/reference/mla.hpp"
#include "paged_util.hpp"
#include "test_util.hpp"

using namespace kvattn;

namespace {

constexpr Index kSizes[] = {1, 3, 8, 54, 59, 111, 127, 129};

template <class S>
std::vector<S> random_values(Index n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<S> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = static_cast<S>(normal(rng));
  return v;
}

// |got - want| within a float rounding bound of a sum of `terms` products of size `scale`.
bool close(double got, double want, Index terms, double scale) {
  const double bound = 4e-7 * static_cast<double>(terms + 1) * scale + 1e-30;
  return std::abs(got - want) <= bound;
}

template <class S>
void check_score(Index G, Index dk, Index n, bool segmented, bool add) {
  const Index seg = segmented ? dk + 3 : 0;  // per-row slices with a gap between them
  const Index k_stride = (segmented ? G * seg : dk) + 5;
  const Index ld = n + 2;
  const auto q = random_values<float>(G * dk, 1 + static_cast<std::uint64_t>(G * dk));
  const auto k = random_values<S>(n * k_stride, 2 + static_cast<std::uint64_t>(n));
  auto logits = random_values<float>(G * ld, 3);
  const auto before = logits;
  detail::score_rows(q.data(), dk, G, dk, k.data(), k_stride, seg, n, logits.data(), ld, add);
  for (Index i = 0; i < G; ++i) {
    for (Index t = 0; t < n; ++t) {
      double want = add ? before[static_cast<std::size_t>(i * ld + t)] : 0.0;
      double scale = std::abs(want);
      for (Index j = 0; j < dk; ++j) {
        const double p = static_cast<double>(q[static_cast<std::size_t>(i * dk + j)]) *
                         static_cast<double>(static_cast<float>(
                             k[static_cast<std::size_t>(t * k_stride + i * seg + j)]));
        want += p;
        scale += std::abs(p);
      }
      const double got = logits[static_cast<std::size_t>(i * ld + t)];
      if (!close(got, want, dk, scale)) {
        CAPTURE(G, dk, n, segmented, add, i, t, got, want);
        FAIL("score_rows differs from the plain loop");
      }
    }
    // The padding past the tile is not written.
    for (Index t = n; t < ld; ++t) {
      REQUIRE(logits[static_cast<std::size_t>(i * ld + t)] ==
              before[static_cast<std::size_t>(i * ld + t)]);
    }
  }
}

// `paired`: the rows read in pairs (bf16, dv whole pair blocks, not segmented), the
// accumulator rows put in paired order before and back in order after.
template <class S>
void check_accumulate(Index G, Index dv, Index n, bool segmented, Index token_block,
                      bool paired = false) {
  const Index seg = segmented ? dv + 2 : 0;
  const Index v_stride = (segmented ? G * seg : dv) + 3;
  const Index ld = n + 1;
  const Index acc_stride = dv + 4;
  const auto w = random_values<float>(G * ld, 4 + static_cast<std::uint64_t>(G));
  const auto v = random_values<S>(n * v_stride, 5 + static_cast<std::uint64_t>(dv));
  auto acc = random_values<float>(G * acc_stride, 6);
  const auto before = acc;
  if (paired) {
    for (Index i = 0; i < G; ++i) detail::to_paired(acc.data() + i * acc_stride, dv);
  }
  detail::accumulate_rows(w.data(), ld, G, v.data(), v_stride, seg, dv, n, acc.data(), acc_stride,
                          token_block, nullptr, paired);
  if (paired) {
    for (Index i = 0; i < G; ++i) detail::from_paired(acc.data() + i * acc_stride, dv);
  }
  for (Index i = 0; i < G; ++i) {
    for (Index j = 0; j < acc_stride; ++j) {
      const auto at = static_cast<std::size_t>(i * acc_stride + j);
      if (j >= dv) {  // columns past dv are not touched
        REQUIRE(acc[at] == before[at]);
        continue;
      }
      double want = before[at];
      double scale = std::abs(want);
      for (Index t = 0; t < n; ++t) {
        const double p = static_cast<double>(w[static_cast<std::size_t>(i * ld + t)]) *
                         static_cast<double>(static_cast<float>(
                             v[static_cast<std::size_t>(t * v_stride + i * seg + j)]));
        want += p;
        scale += std::abs(p);
      }
      if (!close(acc[at], want, n, scale)) {
        CAPTURE(G, dv, n, segmented, token_block, paired, i, j, acc[at], want);
        FAIL("accumulate_rows differs from the plain loop");
      }
    }
  }
}

}  // namespace

TEST_CASE("simd_level names the instruction set the kernels use", "[kernels]") {
  const std::string level = simd_level();
  INFO("simd_level() = " << level << ", packet of " << detail::packet_size<float> << " floats");
  CHECK((level == "avx512" || level == "avx2+fma" || level == "avx" || level == "sse2" ||
         level == "neon" || level == "scalar"));
#if defined(__AVX512F__)
  CHECK(level == "avx512");
  CHECK(detail::packet_size<float> == 16);
#elif defined(__AVX2__) && defined(__FMA__)
  CHECK(level == "avx2+fma");
  CHECK(detail::packet_size<float> == 8);
#endif
}

// Up to 4 rows may take the by-token kernel (kernels::score_by_token: fp32 2-4 rows and
// bf16 1-4 rows with 16 registers, one bf16 row with 32), 5 and 32 the register blocks;
// with and without `add` on each.
TEST_CASE("score_rows equals a plain loop at awkward sizes", "[kernels]") {
  for (const Index dk : kSizes) {
    for (const Index G : {1, 2, 3, 4, 5, 32}) {
      for (const Index n : {1, 7, 13, 40}) {
        for (const bool segmented : {false, true}) {
          check_score<float>(G, dk, n, segmented, false);
        }
      }
      check_score<float>(G, dk, 29, false, true);
      check_score<float>(G, dk, 29, true, true);
      check_score<Eigen::bfloat16>(G, dk, 29, false, false);
      check_score<Eigen::bfloat16>(G, dk, 29, false, true);
      check_score<Eigen::bfloat16>(G, dk, 29, true, true);
    }
  }
}

// Many rows against widths that are whole packets: on AVX-512 the outer-product score
// (transposed chunks of 32 tokens, rows in blocks of 8), partial chunks and blocks
// included; elsewhere the dot-product blocks again.
TEST_CASE("score_rows of many query rows equals a plain loop", "[kernels]") {
  for (const Index dk : {16, 64, 128, 256, 272}) {
    for (const Index G : {8, 9, 16, 32, 35}) {
      for (const Index n : {1, 7, 31, 32, 33, 70}) {
        check_score<float>(G, dk, n, false, false);
        check_score<float>(G, dk, n, false, true);
        check_score<Eigen::bfloat16>(G, dk, n, false, false);
      }
    }
  }
}

// LRKV's own score kernel (shared part with the heads in the lanes, residual slices
// reduced P heads at a time, then transposed): logits of head h at token t = q_h .
// k~_s,t + q~_h . r~_h,t, against a plain loop in double. Widths and head counts around
// the packet sizes, ranks with and without an overlapping last packet.
template <class S>
void check_lrkv_score(Index H, Index dh, Index r, Index n) {
  constexpr Index P = detail::packet_size<float>;
  if (r < P) return;  // lrkv_score's precondition (the layer uses score_rows below it)
  const Index hp = (H + P - 1) / P * P;
  const Index stride = dh + H * r + 3;
  const Index ld = (n + P - 1) / P * P;
  const auto q = random_values<float>(H * dh, 11 + static_cast<std::uint64_t>(H * dh));
  const auto q_latent = random_values<float>(H * r, 12 + static_cast<std::uint64_t>(r));
  const auto rows = random_values<S>(n * stride, 13 + static_cast<std::uint64_t>(n));
  std::vector<float> query_t(static_cast<std::size_t>(dh * hp), 0.0f);
  for (Index h = 0; h < H; ++h) {
    for (Index j = 0; j < dh; ++j) {
      query_t[static_cast<std::size_t>(j * hp + h)] = q[static_cast<std::size_t>(h * dh + j)];
    }
  }
  std::vector<float> logits(static_cast<std::size_t>(H * ld), 0.0f);
  detail::lrkv_score(query_t.data(), hp, q_latent.data(), H, dh, r, rows.data(), stride, n,
                     logits.data(), ld);
  auto element = [&](Index t, Index c) {
    return static_cast<double>(static_cast<float>(rows[static_cast<std::size_t>(t * stride + c)]));
  };
  for (Index h = 0; h < H; ++h) {
    for (Index t = 0; t < n; ++t) {
      double want = 0.0, scale = 0.0;
      for (Index j = 0; j < dh; ++j) {
        const double p =
            static_cast<double>(q[static_cast<std::size_t>(h * dh + j)]) * element(t, j);
        want += p;
        scale += std::abs(p);
      }
      for (Index j = 0; j < r; ++j) {
        const double p = static_cast<double>(q_latent[static_cast<std::size_t>(h * r + j)]) *
                         element(t, dh + h * r + j);
        want += p;
        scale += std::abs(p);
      }
      const double got = logits[static_cast<std::size_t>(h * ld + t)];
      CAPTURE(H, dh, r, n, h, t, got, want);
      REQUIRE(close(got, want, dh + r, scale));
    }
  }
}

TEST_CASE("lrkv_score equals a plain loop", "[kernels][lrkv]") {
  for (const Index H : {1, 5, 16, 17, 32, 40}) {
    for (const Index dh : {3, 16, 128}) {
      for (const Index r : {8, 16, 54, 70}) {
        for (const Index n : {1, 7, 16, 17, 40}) check_lrkv_score<float>(H, dh, r, n);
        check_lrkv_score<Eigen::bfloat16>(H, dh, r, 23);
      }
    }
  }
}

TEST_CASE("score_rows with a second, per-row dot product (LRKV's residual)", "[kernels]") {
  for (const Index dk : {3, 128}) {
    for (const Index dk2 : {1, 54, 59}) {
      for (const Index G : {1, 3, 32}) {
        const Index n = 17, seg2 = dk2 + 1, k_stride = dk + G * seg2 + 2, ld = n + 1;
        const auto q = random_values<float>(G * dk, 31);
        const auto q2 = random_values<float>(G * dk2, 32);
        const auto k = random_values<float>(n * k_stride, 33);
        std::vector<float> got(static_cast<std::size_t>(G * ld), 7.0f);
        std::vector<float> want = got;
        const detail::SecondDot<float> second{q2.data(), dk2, dk2, dk, seg2};
        detail::Prefetcher prefetch(k.data(), n * k_stride * Index{sizeof(float)});
        detail::score_rows(q.data(), dk, G, dk, k.data(), k_stride, 0, n, got.data(), ld, false,
                           &prefetch, &second);
        constexpr Index P = detail::packet_size<float>;
        if (dk >= P && dk2 >= P) {
          // The kernel's prefetch plan counts the steps it takes, the second dot's too: a
          // one-line range planned over S steps is issued at step S, so a step fewer
          // leaves it unissued (finish() is the caller's, not the kernel's). A kernel
          // that took more steps than it planned would pass: this checks the plan
          // covers no steps the kernel never takes.
          std::vector<char> range(detail::Prefetcher::kLine);
          detail::Prefetcher planned(range.data(), detail::Prefetcher::kLine);
          std::vector<float> logits(static_cast<std::size_t>(G * ld));
          detail::kernels::score_rows<float, float, detail::kernels::kShared>(
              q.data(), dk, G, dk, k.data(), k_stride, 0, n, logits.data(), ld, false, &planned,
              &second);
          CHECK(planned.next == planned.end);
        }
        detail::score_rows(q.data(), dk, G, dk, k.data(), k_stride, 0, n, want.data(), ld, false);
        detail::score_rows(q2.data(), dk2, G, dk2, k.data() + dk, k_stride, seg2, n, want.data(),
                           ld, true);
        for (std::size_t i = 0; i < got.size(); ++i) {
          CAPTURE(dk, dk2, G, i);
          REQUIRE(got[i] == Approx(want[i]).epsilon(1e-5).margin(1e-5));
        }
      }
    }
  }
}

TEST_CASE("bf16 rows read in pairs: paired queries and accumulators", "[kernels]") {
  // Only where the build has a paired path (paired_rows): the score and the accumulate on
  // AVX2 and AVX-512; elsewhere the kernels never see paired operands. Widths must be
  // whole pair blocks (16 or 32 elements).
  if (!detail::paired_rows<float, Eigen::bfloat16>(detail::kPairBlock)) {
    WARN("no paired bf16 path in this build (" << simd_level() << ")");
    return;
  }
  for (const Index width : {16, 32, 64, 96, 128, 160, 576}) {
    if (!detail::paired_rows<float, Eigen::bfloat16>(width)) continue;
#if defined(EIGEN_VECTORIZE_AVX512)
    CHECK(detail::kernels::paired_rows4_by_token<float, Eigen::bfloat16>(4, width) ==
          (width <= 128));
#endif
    // G = 4, 8: whole 4-row blocks (AVX-512's 4 x 4 paired block; 4 rows up to 128 wide
    // are scored by token there, kernels::paired_rows4_by_token); 3, 5, 6: a 2- or
    // 1-row block after them; 16: many blocks. With 16 registers G = 1 ... 4 are scored
    // by token (kernels::score_by_token).
    for (const Index G : {1, 2, 3, 4, 5, 6, 8, 16}) {
      const Index n = 29, ld = n + 3, stride = width + 16;
      const auto q = random_values<float>(G * width, 51);
      const auto k = random_values<Eigen::bfloat16>(n * stride, 52);
      // Score: paired queries against the rows give q_i . k_t, summed in double here
      // (with `add`, onto the -7 already there).
      auto q_paired = q;
      for (Index i = 0; i < G; ++i) detail::to_paired(q_paired.data() + i * width, width);
      for (const bool add : {false, true}) {
        std::vector<float> got(static_cast<std::size_t>(G * ld), -7.0f);
        detail::score_rows(q_paired.data(), width, G, width, k.data(), stride, 0, n, got.data(), ld,
                           add, nullptr, nullptr, true);
        for (Index i = 0; i < G; ++i) {
          for (Index t = 0; t < n; ++t) {
            double want = add ? -7.0 : 0.0, scale = std::abs(want);
            for (Index j = 0; j < width; ++j) {
              const double term = double{q[static_cast<std::size_t>(i * width + j)]} *
                                  static_cast<double>(k[static_cast<std::size_t>(t * stride + j)]);
              want += term;
              scale += std::abs(term);
            }
            CAPTURE(width, G, add, i, t);
            REQUIRE(close(got[static_cast<std::size_t>(i * ld + t)], want, width, scale));
          }
          // The padding past the tile is not written.
          for (Index t = n; t < ld; ++t) {
            REQUIRE(got[static_cast<std::size_t>(i * ld + t)] == -7.0f);
          }
        }
      }
      // Accumulate: a paired accumulator, put back in order, against the plain loop.
      for (const Index block : {Index{0}, Index{16}}) {
        check_accumulate<Eigen::bfloat16>(G, width, n, false, block, true);
      }
    }
  }
}

TEST_CASE("to_paired puts each pair block's even elements first; from_paired undoes it",
          "[kernels]") {
  const Index block = detail::kPairBlock, width = 2 * block;
  std::vector<float> row(static_cast<std::size_t>(width));
  for (Index j = 0; j < width; ++j) row[static_cast<std::size_t>(j)] = static_cast<float>(j);
  auto paired = row;
  detail::to_paired(paired.data(), width);
  for (Index j = 0; j < width; ++j) {
    const Index first = j / block * block, at = j - first, half = block / 2;
    const Index from = first + (at < half ? 2 * at : 2 * (at - half) + 1);
    CAPTURE(j);
    REQUIRE(paired[static_cast<std::size_t>(j)] == static_cast<float>(from));
  }
  detail::from_paired(paired.data(), width);
  REQUIRE(paired == row);
}

// bf16 values of 4 rows take 2-row blocks of the whole width on AVX-512 where the row
// needs 5 to 8 packets (accumulate_rows decides: dv = 111, 127 here), 4-row blocks
// elsewhere.
TEST_CASE("accumulate_rows equals a plain loop at awkward sizes", "[kernels]") {
  for (const Index dv : kSizes) {
    for (const Index G : {1, 2, 3, 4, 5, 32}) {
      for (const Index n : {1, 7, 40}) {
        for (const Index block : {Index{0}, Index{5}, Index{16}}) {
          check_accumulate<float>(G, dv, n, false, block);
        }
        check_accumulate<float>(G, dv, n, true, 16);
      }
      check_accumulate<Eigen::bfloat16>(G, dv, 23, false, 16);
      check_accumulate<Eigen::bfloat16>(G, dv, 7, false, 0);
      check_accumulate<Eigen::bfloat16>(G, dv, 23, true, 0);
    }
  }
}

// Float value rows of kEightRowsWidth and wider shared by 8 or more rows take 8-row register
// blocks in the AVX-512 build of this test (others: 4 rows); the rows left over 4, 2 and 1
// at a time. Widths with a tail packet alone in its block (300) and beside a full one (280),
// token blocks shorter than the tile. bf16 rows keep 4-row blocks (the same check).
TEST_CASE("accumulate_rows of many rows over wide value rows", "[kernels]") {
#if defined(EIGEN_VECTORIZE_AVX512)
  CHECK(detail::kernels::accumulate_block_rows(8, true) == 8);
#endif
  for (const Index dv : {Index{256}, Index{280}, Index{300}, Index{512}}) {
    for (const Index G : {8, 11, 15, 16, 19}) {
      for (const Index n : {1, 7, 40}) {
        for (const Index block : {Index{0}, Index{5}}) {
          check_accumulate<float>(G, dv, n, false, block);
        }
      }
    }
    check_accumulate<Eigen::bfloat16>(16, dv, 23, false, 0);
  }
}

// Four rows over widths of whole packets: on AVX-512 the by-token kernels
// (rows4_by_token; 3 of 4 query rows held in registers at 7 and 8 packets, all 4 below;
// 6 accumulator packets per row held, the rest in the accumulator rows), and beside them
// 3 and 5 rows, which keep the register blocks; elsewhere the blocks for all.
TEST_CASE("score_rows and accumulate_rows of 4 rows over whole packets", "[kernels]") {
  constexpr Index P = detail::packet_size<float>;
  for (Index D = 1; D <= 9; ++D) {
    const Index width = D * P;
#if defined(EIGEN_VECTORIZE_AVX512)
    CHECK(detail::kernels::rows4_by_token<float, float>(4, width) == (D <= 8));
    CHECK_FALSE(detail::kernels::rows4_by_token<float, Eigen::bfloat16>(4, width));
#endif
    for (const Index G : {3, 4, 5}) {
      for (const Index n : {1, 2, 7, 40, 100}) {
        check_score<float>(G, width, n, false, false);
        check_score<float>(G, width, n, false, true);
        check_accumulate<float>(G, width, n, false, 0);
        check_accumulate<float>(G, width, n, false, 16);
      }
    }
  }
}

TEST_CASE("Prefetcher walks its first range, then its second, within the plan", "[kernels]") {
  // Prefetches are hints (no observable effect), so the walk is checked on the state.
  std::vector<char> first(1000), second(300);
  detail::Prefetcher p(first.data(), 1000, second.data(), 300);
  p.plan(7);  // 16 + 5 lines: 3 a step
  for (int step = 0; step < 7; ++step) {
    const bool in_first = p.next >= first.data() && p.next <= first.data() + 1000;
    const bool in_second = p.next >= second.data() && p.next <= second.data() + 300 + 63;
    CHECK((in_first || in_second));
    p.step();
  }
  CHECK(p.next >= p.end);  // both ranges issued by the planned steps
  CHECK(p.next >= second.data());
  // An empty first range starts on the second; no range at all issues nothing.
  const detail::Prefetcher only_second(nullptr, 0, second.data(), 300);
  CHECK(only_second.next == second.data());
  detail::Prefetcher none;
  none.plan(4);
  none.step();
  none.finish();
  CHECK(none.next == none.end);
}

TEST_CASE("Lane sums, overlapped tails and the softmax exponential", "[kernels]") {
  using P = detail::Packet<float>;
  constexpr Index N = detail::packet_size<float>;
  namespace ei = Eigen::internal;
  alignas(64) float lanes[N * N];
  // Row k's sum grows with k (by 4 k at N = 16), so lanes put in the wrong order show.
  for (Index i = 0; i < N * N; ++i) {
    lanes[i] = static_cast<float>(i % 7) - 2.5f + 0.25f * static_cast<float>(i / N);
  }
  P acc[N];
  for (Index k = 0; k < N; ++k) acc[k] = ei::pload<P>(lanes + k * N);
  alignas(64) float sums[N];
  ei::pstore(sums, detail::sum_lanes<float>(acc));
  for (Index k = 0; k < N; ++k) {
    float want = 0;
    for (Index l = 0; l < N; ++l) want += lanes[k * N + l];
    CHECK(sums[k] == Approx(want));
  }
  // zero_first clears exactly the first `skip` lanes (bits, so +inf becomes +0).
  alignas(64) float x[N];
  for (Index i = 0; i < N; ++i) x[i] = std::numeric_limits<float>::infinity();
  for (Index skip = 0; skip < N; ++skip) {
    alignas(64) float out[N];
    ei::pstore(out, detail::zero_first<float>(ei::pload<P>(x), skip));
    for (Index i = 0; i < N; ++i) CHECK(out[i] == (i < skip ? 0.0f : x[i]));
  }
  // exp(-inf) and anything below the normal range is exactly 0; NaN stays NaN.
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(detail::softmax_exp(-inf) == 0.0f);
  CHECK(detail::softmax_exp(-100.0f) == 0.0f);
  CHECK(std::isnan(detail::softmax_exp(std::numeric_limits<float>::quiet_NaN())));
  alignas(64) float in[N], out[N];
  for (Index i = 0; i < N; ++i) in[i] = i == 0 ? -inf : -0.37f * static_cast<float>(i);
  ei::pstore(out, detail::softmax_exp<float>(ei::pload<P>(in)));
  for (Index i = 0; i < N; ++i) CHECK(out[i] == Approx(std::exp(in[i])).margin(0));
}

namespace {

// Dense ops for the driver: `rows` query rows per group against keys/values of width d.
struct DenseOps {
  const std::vector<float>& q;  // groups*rows x d
  const std::vector<float>& k;  // groups x L x d
  const std::vector<float>& v;  // groups x L x d
  Index rows, d, L;
  void score(Index g, Index first, Index n, float* logits, Index ld, float* /*spare*/) const {
    detail::score_rows(q.data() + g * rows * d, d, rows, d, k.data() + (g * L + first) * d, d, 0, n,
                       logits, ld, false);
  }
  void accumulate(Index g, Index first, Index n, const float* w, Index ld, float* acc,
                  float* /*spare*/) const {
    detail::accumulate_rows(w, ld, rows, v.data() + (g * L + first) * d, d, 0, d, n, acc, d, 16);
  }
};

// softmax(q K^T) V per row in double; NaN where a logit is NaN or +inf.
std::vector<double> reference(const std::vector<float>& q, const std::vector<float>& k,
                              const std::vector<float>& v, Index groups, Index rows, Index d,
                              Index L) {
  std::vector<double> out(static_cast<std::size_t>(groups * rows * d), 0.0);
  for (Index g = 0; g < groups; ++g) {
    for (Index i = 0; i < rows; ++i) {
      std::vector<double> s(static_cast<std::size_t>(L));
      double max = -std::numeric_limits<double>::infinity();
      bool poisoned = false;
      for (Index t = 0; t < L; ++t) {
        double x = 0;
        for (Index j = 0; j < d; ++j) {
          x += static_cast<double>(q[static_cast<std::size_t>((g * rows + i) * d + j)]) *
               k[static_cast<std::size_t>((g * L + t) * d + j)];
        }
        s[static_cast<std::size_t>(t)] = x;
        if (std::isnan(x) || x == std::numeric_limits<double>::infinity()) poisoned = true;
        max = std::max(max, x);
      }
      double* o = out.data() + (g * rows + i) * d;
      if (poisoned) {
        for (Index j = 0; j < d; ++j) o[j] = std::numeric_limits<double>::quiet_NaN();
        continue;
      }
      if (max == -std::numeric_limits<double>::infinity()) continue;  // nothing visible: 0
      double sum = 0;
      for (Index t = 0; t < L; ++t) {
        const double p = std::exp(s[static_cast<std::size_t>(t)] - max);
        sum += p;
        for (Index j = 0; j < d; ++j) o[j] += p * v[static_cast<std::size_t>((g * L + t) * d + j)];
      }
      for (Index j = 0; j < d; ++j) o[j] /= sum;
    }
  }
  return out;
}

void check_driver(Index groups, Index rows, Index d, Index L, Index tile, int threads,
                  const std::vector<float>& q, const std::vector<float>& k,
                  const std::vector<float>& v) {
  const auto plan = detail::plan_split(groups, rows, d, L, tile, 0, threads);
  detail::SplitScratch<float> scratch;
  scratch.fit(plan);
  std::vector<float> out(static_cast<std::size_t>(groups * rows * d));
  detail::split_attention(plan, scratch, DenseOps{q, k, v, rows, d, L}, out.data());
  const auto want = reference(q, k, v, groups, rows, d, L);
  for (std::size_t i = 0; i < out.size(); ++i) {
    CAPTURE(groups, rows, d, L, tile, threads, plan.splits, i, out[i], want[i]);
    if (std::isnan(want[i])) {
      REQUIRE(std::isnan(out[i]));
    } else {
      REQUIRE(std::abs(out[i] - want[i]) <= 1e-5 * (1.0 + std::abs(want[i])));
    }
  }
}

}  // namespace

TEST_CASE("split_attention equals softmax(q K^T) V, split or not", "[kernels]") {
  for (const Index rows : {1, 3, 4}) {
    for (const Index d : {3, 54, 129}) {
      for (const Index L : {1, 13, 300}) {
        const Index groups = 2;
        const auto q = random_values<float>(groups * rows * d, 11);
        const auto k = random_values<float>(groups * L * d, 12);
        const auto v = random_values<float>(groups * L * d, 13);
        check_driver(groups, rows, d, L, 16, 1, q, k, v);
        check_driver(groups, rows, d, L, 8, 3, q, k, v);  // splits the sequence
      }
    }
  }
}

// The units go to the threads in equal static blocks, so plan_split keeps their count a
// multiple of the threads where the length allows. Tile 256: one split per 1024 visible
// tokens at most (four granules), or per 512 (two) where that would leave a thread
// without a unit, 4 ranges per thread at most.
TEST_CASE("plan_split makes the units a multiple of the threads where it can", "[kernels]") {
  // splits, by hand: 1 when groups >= threads; else, with n = length / 1024, or length /
  // 512 when groups * n < threads: min(4 * ceil(threads / groups), max(n, 1)), rounded
  // down to a multiple of threads / gcd(groups, threads) when it is at least that.
  struct Case {
    Index groups;
    int threads;
    Index length;
    Index splits;
  };
  for (const Case c :
       {Case{1, 2, 3072, 2}, Case{1, 2, 5120, 4}, Case{1, 2, 65536, 8}, Case{1, 2, 1024, 2},
        Case{1, 2, 1023, 1}, Case{1, 2, 511, 1}, Case{1, 2, 1536, 2}, Case{1, 4, 2048, 4},
        Case{1, 3, 5120, 3}, Case{1, 3, 2048, 3}, Case{2, 4, 3072, 2}, Case{3, 4, 6144, 4},
        Case{3, 4, 20480, 8}, Case{2, 2, 65536, 1}}) {
    CAPTURE(c.groups, c.threads, c.length);
    CHECK(detail::plan_split(c.groups, 1, 8, c.length, 256, 0, c.threads).splits == c.splits);
  }
}

TEST_CASE("split_attention: a NaN or +inf logit poisons its row, -inf weighs 0", "[kernels]") {
  const Index rows = 3, d = 13, L = 70, groups = 1;
  const float inf = std::numeric_limits<float>::infinity();
  auto q = random_values<float>(rows * d, 21);
  auto k = random_values<float>(L * d, 22);
  const auto v = random_values<float>(L * d, 23);
  // Row 0: a NaN query element (every logit NaN). Token 40: key element 0 is +inf;
  // row 1's query element 0 is > 0 (+inf logit: poisoned), row 2's < 0 (-inf: weight 0).
  q[0] = std::numeric_limits<float>::quiet_NaN();
  k[40 * d] = inf;
  q[1 * d] = 0.5f;
  q[2 * d] = -0.5f;
  for (const int threads : {1, 2, 3}) {
    for (const Index tile : {8, 64}) check_driver(groups, rows, d, L, tile, threads, q, k, v);
  }
  // Every logit -inf: nothing visible, the zero vector (as softmax over no keys).
  // (Query element 0 is -inf, every key element 1: each logit is -inf + 0 + ... + 0.)
  const std::vector<float> ones(static_cast<std::size_t>(L * d), 1.0f);
  std::vector<float> qneg(static_cast<std::size_t>(rows * d), 0.0f);
  for (Index i = 0; i < rows; ++i) qneg[static_cast<std::size_t>(i * d)] = -inf;
  check_driver(groups, rows, d, L, 16, 2, qneg, ones, v);
}

TEST_CASE("Prefetcher stays inside its range and spreads it over the planned steps", "[kernels]") {
  std::vector<char> buffer(10000);
  detail::Prefetcher p(buffer.data(), 1000);
  p.plan(4);
  CHECK(p.lines_per_step == 4);  // 16 lines over 4 steps
  for (int i = 0; i < 3; ++i) p.step();
  CHECK(p.next == buffer.data() + 12 * 64);
  p.step();
  p.step();
  CHECK(p.next >= p.end);
  detail::Prefetcher few(buffer.data(), 128);  // 2 lines over 10 steps: one every 5
  few.plan(10);
  CHECK(few.period == 5);
  for (int i = 0; i < 4; ++i) few.step();
  CHECK(few.next == buffer.data());
  few.step();
  CHECK(few.next == buffer.data() + 64);
  detail::Prefetcher none(buffer.data(), 0);
  none.plan(3);
  none.step();
  none.finish();
  CHECK(none.next == none.end);
}

TEST_CASE(
    "Prefetcher touches each page a page lead ahead of its lines, within its range or touch_past "
    "beyond it",
    "[kernels]") {
  // `page` is the next 4 KiB boundary still to touch, as an offset from an aligned buffer.
  static_assert(detail::Prefetcher::kPage == 4096 && detail::Prefetcher::kPageLead == 8192);
  alignas(4096) static std::array<char, 65536> buffer{};
  const auto offset = [](const detail::Prefetcher& p) {
    return static_cast<Index>(p.page - reinterpret_cast<std::uintptr_t>(buffer.data()));
  };
  detail::Prefetcher p(buffer.data() + 100, 40000);  // to 40100
  p.touch = true;
  p.plan(625);  // a line a step
  p.step();     // the line at 100; next 164: touches 4096 and 8192 (< 164 + 8192)
  CHECK(offset(p) == 12288);
  for (int i = 1; i < 100; ++i) p.step();  // next 6500: up to 14692, so 12288 too
  CHECK(offset(p) == 16384);
  for (int i = 100; i < 624; ++i) p.step();  // next 40036: the range's end (40100) binds
  CHECK(offset(p) == 40960);                 // 36864 the last touched
  // Allowed 5000 bytes past the end (touch_past): 40960 and 45056 too (< 40100 + 5000).
  detail::Prefetcher past(buffer.data() + 100, 40000);
  past.touch = true;
  past.touch_past = 5000;
  past.plan(625);
  for (int i = 0; i < 624; ++i) past.step();
  CHECK(offset(past) == 49152);
  // A second range starts its touches over from its own lines: 4096 bytes, from 50000.
  detail::Prefetcher two(buffer.data() + 100, 256, buffer.data() + 50000, 4096);
  two.touch = true;
  two.plan(68);                            // 4 + 64 lines, one a step
  for (int i = 0; i < 5; ++i) two.step();  // the first range, then one line at 50000
  CHECK(two.next == buffer.data() + 50064);
  CHECK(offset(two) == 57344);  // 53248 touched (< 54096, its end), 57344 past it
  // Without `touch` (the default) no page is touched.
  detail::Prefetcher lines_only(buffer.data() + 100, 40000);
  lines_only.plan(625);
  for (int i = 0; i < 100; ++i) lines_only.step();
  CHECK(lines_only.page == 0);
  CHECK(lines_only.next == buffer.data() + 6500);
}

namespace {

// batch_product (x W for a few rows) against a plain loop in double, every element, with
// strides wider than the rows; and detail::parallel_product, which sends 2-64 rows to it,
// over row-major blocks and two threads.
template <class T>
void check_batch_product(Index B, Index d, Index n) {
  const Index ldx = d + 3, ldw = n + 5, ldo = n + 2;
  const auto x = random_values<T>(B * ldx, 11 + static_cast<std::uint64_t>(B));
  const auto w = random_values<T>(std::max<Index>(d, 1) * ldw, 12 + static_cast<std::uint64_t>(n));
  auto out = random_values<T>(B * ldo, 13);  // garbage: every element must be written
  const auto before = out;
  detail::batch_product(x.data(), ldx, B, d, w.data(), ldw, n, out.data(), ldo);
  const double eps = std::numeric_limits<T>::epsilon();
  for (Index b = 0; b < B; ++b) {
    for (Index j = 0; j < ldo; ++j) {
      const double got = out[static_cast<std::size_t>(b * ldo + j)];
      if (j >= n) {  // the padding past n is not written
        CHECK(got == before[static_cast<std::size_t>(b * ldo + j)]);
        continue;
      }
      double want = 0.0, scale = 0.0;
      for (Index k = 0; k < d; ++k) {
        const double p = static_cast<double>(x[static_cast<std::size_t>(b * ldx + k)]) *
                         static_cast<double>(w[static_cast<std::size_t>(k * ldw + j)]);
        want += p;
        scale += std::abs(p);
      }
      if (std::abs(got - want) > 4 * eps * static_cast<double>(d + 1) * scale + 1e-300) {
        CAPTURE(B, d, n, b, j, got, want);
        FAIL("batch_product differs from the plain loop");
      }
    }
  }
}

}  // namespace

TEST_CASE("batch_product equals a plain loop", "[kernels][batch_product]") {
  // Rows: 1 to 9 (register blocks of 4 or 8 and every remainder), 17 and 64 (the most it
  // takes); depths around its chunks (8 and 64 rows) and 0 (an empty sum); columns below
  // a packet, with tails, and past the column panels (64 rows: a panel of 96 to 128 columns, by
  // ISA).
  for (const Index B : {1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 64}) {
    for (const Index d : {0, 1, 7, 9, 65, 130}) {
      for (const Index n : {3, 16, 37, 64, 200, 531}) {
        check_batch_product<float>(B, d, n);
      }
    }
  }
  check_batch_product<double>(5, 65, 37);
  check_batch_product<double>(17, 9, 200);
  // parallel_product: columns split over two threads, each half a row-major block.
  const RowMatrix<float> x = test::random_input<float>(6, 70, 21);
  const RowMatrix<float> w = test::random_input<float>(70, 300, 22);
  RowMatrix<float> out(6, 300);
  detail::parallel_product(x, w, out, 2);
  const Eigen::MatrixXd want = x.cast<double>() * w.cast<double>();
  CHECK((out.cast<double>() - want).cwiseAbs().maxCoeff() <= 1e-4 * want.cwiseAbs().maxCoeff());
}

namespace {

// attend through each mechanism's decode ops equals the reference step on the same
// cache (the rows as stored, widened): float compute, so a float tolerance.
template <class S, class Layer, class Fill>
void check_layer(const Layer& layer, Index length, Fill fill) {
  auto cache = layer.template make_cache<S>();
  fill(cache, length);
  const RowMatrix<float> query = test::random_input<float>(1, layer.query_width(), 41);
  RowMatrix<float> heads(1, layer.heads_width());
  auto ws = layer.make_workspace(Threads{2});
  for (const Threads threads : {Threads{1}, Threads{2}}) {
    layer.attend(query, cache, heads, ws, threads);
    const RowMatrix<float> want = reference::decode_step(layer, cache, query);
    CAPTURE(length, threads.count, sizeof(S));
    CHECK(test::relative_error(heads, want) <= 1e-5);
  }
}

}  // namespace

namespace {
const GqaLayer<float>& gqa_layer16() {  // 3 query rows per KV head of 32
  static const auto layer = GqaLayer<float>::random(gqa_config(96, 6, 32, 2), 7);
  return layer;
}
}  // namespace

TEST_CASE("Every mechanism's decode ops equal the reference step (fp32, bf16)", "[kernels]") {
  const RopeConfig rope{RopeLayout::half_split, 10000.0, 3};
  auto fill_gqa = [](auto& cache, Index n) {
    const Index w = cache.config().n_kv_heads * cache.config().head_dim;
    cache.append(test::random_input<float>(n, w, 1), test::random_input<float>(n, w, 2));
  };
  auto fill_mla = [](auto& cache, Index n) {
    const auto& c = cache.config();
    cache.append(test::random_input<float>(n, c.kv_rank, 3),
                 test::random_input<float>(n, c.rope_dim, 4));
  };
  auto fill_lrkv = [](auto& cache, Index n) {
    const auto& c = cache.config();
    const Index hr = c.n_heads * c.rank;
    const RowMatrix<float> rms = RowMatrix<float>::Constant(n, c.key_norm ? c.n_heads : 0, 0.9f);
    cache.append({test::random_input<float>(n, c.head_dim, 5),
                  test::random_input<float>(n, c.head_dim, 6), test::random_input<float>(n, hr, 7),
                  test::random_input<float>(n, hr, 8),
                  test::random_input<float>(n, c.decoupled_dim(), 9), rms});
  };
  MlaConfig mla;
  mla.d_model = 48;
  mla.n_heads = 5;
  mla.kv_rank = 59;
  mla.q_rank = 0;
  mla.qk_nope_dim = 16;
  mla.rope_dim = 16;
  mla.v_dim = 12;
  LrkvConfig lrkv{48, 5, 64, 54, LrkvRopeMode::shared, rope};
  lrkv.key_norm = true;
  const auto gqa_layer = GqaLayer<float>::random(gqa_config(96, 6, 40, 2, rope), 1);
  const auto mha_layer = GqaLayer<float>::random(mha_config(99, 3, 33), 2);
  const auto mla_layer = MlaLayer<float>::random(mla, 3);
  MlaConfig mla16 = mla;  // d_c a multiple of 16: bf16 latents summed in pairs (AVX2)
  mla16.kv_rank = 64;
  const auto mla16_layer = MlaLayer<float>::random(mla16, 5);
  // d_h a multiple of 16, one query row per group: bf16 rows scored in pairs too.
  const auto mha16_layer = GqaLayer<float>::random(mha_config(96, 2, 48, rope), 6);
  const auto lrkv_layer = LrkvLayer<float>::random(lrkv, 4, 0.5);
  // Groups of 4 rows of whole packets: on AVX-512 fp32 scored and summed by token, bf16
  // scored by token in pairs.
  const auto gqa4_layer = GqaLayer<float>::random(gqa_config(64, 8, 32, 2, rope), 7);
  const auto gqa4_wide_layer = GqaLayer<float>::random(gqa_config(128, 8, 128, 2, rope), 8);
  for (const Index length : {1, 37, 700}) {
    check_layer<float>(gqa4_layer, length, fill_gqa);
    check_layer<float>(gqa4_wide_layer, length, fill_gqa);
    check_layer<Eigen::bfloat16>(gqa4_layer, length, fill_gqa);
    check_layer<Eigen::bfloat16>(gqa4_wide_layer, length, fill_gqa);
    check_layer<float>(gqa_layer, length, fill_gqa);
    check_layer<Eigen::bfloat16>(gqa_layer, length, fill_gqa);
    check_layer<float>(mha_layer, length, fill_gqa);
    check_layer<float>(mla_layer, length, fill_mla);
    check_layer<Eigen::bfloat16>(mla_layer, length, fill_mla);
    check_layer<Eigen::bfloat16>(mla16_layer, length, fill_mla);
    check_layer<Eigen::bfloat16>(mha16_layer, length, fill_gqa);
    check_layer<Eigen::bfloat16>(gqa_layer16(), length, fill_gqa);
    check_layer<float>(lrkv_layer, length, fill_lrkv);
    check_layer<Eigen::bfloat16>(lrkv_layer, length, fill_lrkv);
  }
}

namespace {

// score_transposed against a plain loop in double: whole packets of query rows (one, two
// and three: one pass of two packets and one of one), widths with and without a last
// unpaired element, tiles below, at and past the register blocks, a transposed-query
// stride wider than the rows (its padding NaN: read, it would show), and a prefetch
// range it must finish.
template <class S>
void check_transposed_score(Index G, Index dk, Index n) {
  const Index qt_stride = G + 16;
  const Index stride = dk + 3;
  const Index written = (n + 15) / 16 * 16;  // the kernel writes whole packets of tokens
  const Index ld = written + 16;
  const auto q = random_values<float>(G * dk, 21 + static_cast<std::uint64_t>(G * dk));
  const auto rows = random_values<S>(n * stride, 22 + static_cast<std::uint64_t>(n));
  std::vector<float> query_t(static_cast<std::size_t>(dk * qt_stride),
                             std::numeric_limits<float>::quiet_NaN());
  detail::transpose_queries(q.data(), dk, G, dk, query_t.data(), qt_stride);
  auto logits = random_values<float>(G * ld, 23);
  const auto before = logits;
  std::vector<char> ahead(4096);
  detail::Prefetcher prefetch(ahead.data(), static_cast<Index>(ahead.size()));
  detail::score_transposed(query_t.data(), qt_stride, G, dk, rows.data(), stride, n, logits.data(),
                           ld, &prefetch);
  CHECK(prefetch.next == prefetch.end);
  for (Index i = 0; i < G; ++i) {
    for (Index t = 0; t < n; ++t) {
      double want = 0.0, scale = 0.0;
      for (Index j = 0; j < dk; ++j) {
        const double p =
            static_cast<double>(q[static_cast<std::size_t>(i * dk + j)]) *
            static_cast<double>(static_cast<float>(rows[static_cast<std::size_t>(t * stride + j)]));
        want += p;
        scale += std::abs(p);
      }
      const double got = logits[static_cast<std::size_t>(i * ld + t)];
      if (!close(got, want, dk, scale)) {
        CAPTURE(G, dk, n, i, t, got, want);
        FAIL("score_transposed differs from the plain loop");
      }
    }
    for (Index t = written; t < ld; ++t) {  // nothing past the last packet of tokens
      REQUIRE(logits[static_cast<std::size_t>(i * ld + t)] ==
              before[static_cast<std::size_t>(i * ld + t)]);
    }
  }
}

// A template, so that where the build has no transposed score the calls below are never
// instantiated (the kernel is declared there, not defined).
template <bool Have>
void transposed_score_cases() {
  if constexpr (Have) {
    CHECK(detail::transposed_score<float, float>(16));
    CHECK(detail::transposed_score<float, Eigen::bfloat16>(48));
    CHECK_FALSE(detail::transposed_score<float, float>(24));  // not whole packets
    CHECK_FALSE(detail::transposed_score<double, double>(16));
    CHECK_FALSE(detail::transposed_score<float, Int8<>>(16));
    for (const Index G : {16, 32, 48}) {
      for (const Index dk : {1, 2, 3, 17, 64, 129}) {
        for (const Index n : {1, 5, 8, 9, 16, 17, 40}) {
          check_transposed_score<float>(G, dk, n);
          check_transposed_score<Eigen::bfloat16>(G, dk, n);
        }
      }
    }
  } else {
    // No layer takes it in this build.
    CHECK_FALSE(detail::transposed_score<float, float>(16));
    CHECK_FALSE(detail::transposed_score<float, Eigen::bfloat16>(32));
  }
}

MlaConfig wide_mla(Index heads) {
  MlaConfig c;
  c.d_model = 48;
  c.n_heads = heads;
  c.kv_rank = 41;  // a cached row of 57 elements: the transposed score's unpaired last one
  c.q_rank = 0;
  c.qk_nope_dim = 16;
  c.rope_dim = 16;
  c.v_dim = 12;
  c.rope = {RopeLayout::half_split, 10000.0, 3};
  return c;
}

// decode_batch of three forks of one prompt (a shared prefix, or none) against each
// fork decoded alone from a copy of its cache.
template <class S>
void check_mla_batch(const MlaLayer<float>& layer, Index shared) {
  const Index d = layer.config().d_model;
  auto pool = test::make_pool<S>(layer, 16, 128);
  auto root = test::make_paged<S>(layer, pool);
  layer.prefill(test::random_input<float>(300, d, 51), root);
  std::vector<decltype(root)> caches;
  for (const Index suffix : {0, 5, 40}) {
    caches.push_back(root);
    if (suffix > 0) layer.prefill(test::random_input<float>(suffix, d, 52 + suffix), caches.back());
  }
  auto singles = caches;
  const RowMatrix<float> x = test::random_input<float>(3, d, 60);
  RowMatrix<float> out(3, d);
  for (const Threads threads : {Threads{1}, Threads{2}}) {
    auto batch = caches;
    std::vector<decltype(root)*> batch_pointers;
    for (auto& c : batch) batch_pointers.push_back(&c);
    layer.decode_batch(x, std::span<decltype(root)* const>(batch_pointers), out, threads,
                       BatchOptions{shared});
    for (Index s = 0; s < 3; ++s) {
      auto single = singles[static_cast<std::size_t>(s)];
      const RowMatrix<float> want = layer.decode(x.row(s), single, threads);
      CAPTURE(shared, s, threads.count, sizeof(S));
      CHECK(test::relative_error(out.row(s), want) <= 1e-5);
    }
  }
}

}  // namespace

TEST_CASE("score_transposed equals a plain loop", "[kernels]") {
  transposed_score_cases<detail::kHaveTransposedScore>();
}

// MLA's heads in whole packets of 16 (one, two) take the transposed score in AVX-512
// builds (test_decode_kernels_avx512); elsewhere the same checks run score_rows.
TEST_CASE("MLA with 16 and 32 heads: attend and decode_batch equal the reference", "[kernels]") {
  auto fill_mla = [](auto& cache, Index n) {
    const auto& c = cache.config();
    cache.append(test::random_input<float>(n, c.kv_rank, 3),
                 test::random_input<float>(n, c.rope_dim, 4));
  };
  for (const Index heads : {16, 32}) {
    CAPTURE(heads);
    const auto layer =
        MlaLayer<float>::random(wide_mla(heads), 70 + static_cast<std::uint64_t>(heads));
    for (const Index length : {1, 37, 700}) {
      check_layer<float>(layer, length, fill_mla);
      check_layer<Eigen::bfloat16>(layer, length, fill_mla);
    }
    for (const Index shared : {Index{0}, Index{300}}) {
      check_mla_batch<float>(layer, shared);
      check_mla_batch<Eigen::bfloat16>(layer, shared);
    }
  }
}
