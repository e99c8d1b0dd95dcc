// [quantized][codec]: the block-quantized storage formats (core/quantized.hpp) on their
// own, and the decode kernels over quantized rows (detail/quantized_kernels.hpp).
//
//  * e4m3 codes decode to the values the OCP FP8 spec gives (hand-derived here), and
//    encoding rounds to nearest with ties to even, saturating at 448.
//  * A quantized row's codes and scales sit where docs/api.md says (read here byte by
//    byte), the block's largest magnitude maps to the format's largest code, and every
//    element is within the format's error bound: int8 scale / 2; e4m3
//    max(2^-4 |x|, 2^-10 scale).
//  * The SIMD code widening equals the scalar decode for every code.
//  * score_quantized / accumulate_quantized equal plain double loops over the rows
//    dequantized by this test, for rows of one block and of several (a partial last one).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kvattn/core/quantized.hpp"
#include "kvattn/detail/quantized_kernels.hpp"
#include "quantized_util.hpp"

using namespace kvattn;
using kvattn::test::e4m3_value;
using kvattn::test::stored_scale;

namespace {

bool is_nan_code(int code) { return (code & 0x7F) == 0x7F; }

template <class S>
double code_value(const detail::storage_element_t<S>& code) {
  if constexpr (S::code == Dtype::int8) {
    return static_cast<double>(code);
  } else {
    return e4m3_value(code.bits);
  }
}

std::vector<float> normal_row(Index w, std::uint64_t seed, float outlier = 0.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(w));
  for (float& v : x) v = normal(rng);
  if (outlier != 0.0f) x[static_cast<std::size_t>(w / 3)] = outlier;
  return x;
}

template <class S>
std::vector<detail::storage_element_t<S>> encode_row(const std::vector<float>& x) {
  using Traits = detail::StorageTraits<S>;
  const Index w = static_cast<Index>(x.size());
  std::vector<detail::storage_element_t<S>> row(static_cast<std::size_t>(Traits::row_elements(w)));
  Traits::encode([&](Index j) { return x[static_cast<std::size_t>(j)]; }, w, row.data());
  return row;
}

// Every element of a quantized row within the format's bound, each block's largest
// magnitude on the largest code, the scale max|x| / code_max (in fp32).
template <class S>
void check_row(const std::vector<float>& x) {
  constexpr Index B = S::block;
  constexpr bool int8 = S::code == Dtype::int8;
  constexpr double code_max = int8 ? 127.0 : 448.0;
  const Index w = static_cast<Index>(x.size());
  const auto row = encode_row<S>(x);
  REQUIRE(static_cast<Index>(row.size()) == w + 4 * ((w + B - 1) / B));
  for (Index b = 0; b * B < w; ++b) {
    const Index j0 = b * B, j1 = std::min(w, j0 + B);
    double amax = 0.0;
    for (Index j = j0; j < j1; ++j) amax = std::max(amax, std::fabs(double(x[std::size_t(j)])));
    const double scale = stored_scale(row.data(), w, b);
    CHECK(scale == static_cast<double>(static_cast<float>(amax / code_max)));
    double largest_code = 0.0;
    for (Index j = j0; j < j1; ++j) {
      const double code = code_value<S>(row[std::size_t(j)]);
      if constexpr (!int8) CHECK_FALSE(is_nan_code(row[std::size_t(j)].bits));
      CHECK(std::fabs(code) <= code_max);
      largest_code = std::max(largest_code, std::fabs(code));
      const double value = x[std::size_t(j)];
      const double error = std::fabs(value - code * scale);
      // The bound, with the slack of the scale's own fp32 rounding (relative 2^-24 of the
      // value) and of the quotient x / scale computed in double.
      const double bound =
          int8 ? scale / 2 : std::max(std::ldexp(std::fabs(value), -4), std::ldexp(scale, -10));
      CAPTURE(b, j, value, code, scale, error, bound);
      CHECK(error <= bound * (1 + 1e-12) + std::ldexp(std::fabs(value), -23));
    }
    if (amax > 0) CHECK(largest_code == code_max);
  }
}

}  // namespace

TEST_CASE("e4m3 codes decode to the spec's values", "[quantized][codec]") {
  CHECK(static_cast<float>(fp8_e4m3{0x00}) == 0.0f);
  CHECK(static_cast<float>(fp8_e4m3{0x01}) == std::ldexp(1.0f, -9));  // smallest subnormal
  CHECK(static_cast<float>(fp8_e4m3{0x07}) == 7 * std::ldexp(1.0f, -9));
  CHECK(static_cast<float>(fp8_e4m3{0x08}) == std::ldexp(1.0f, -6));  // smallest normal
  CHECK(static_cast<float>(fp8_e4m3{0x38}) == 1.0f);
  CHECK(static_cast<float>(fp8_e4m3{0x3A}) == 1.25f);
  CHECK(static_cast<float>(fp8_e4m3{0x7E}) == 448.0f);  // largest finite
  CHECK(static_cast<float>(fp8_e4m3{0xB8}) == -1.0f);
  CHECK(static_cast<float>(fp8_e4m3{0xC0}) == -2.0f);
  for (int code = 0; code < 256; ++code) {
    if (is_nan_code(code)) continue;
    CAPTURE(code);
    CHECK(static_cast<double>(fp8_e4m3{static_cast<std::uint8_t>(code)}) ==
          e4m3_value(static_cast<std::uint8_t>(code)));
  }
  // The magnitudes increase strictly with the code: the format is monotonic.
  for (int code = 1; code < 0x7F; ++code)
    CHECK(e4m3_value(std::uint8_t(code)) > e4m3_value(std::uint8_t(code - 1)));
}

TEST_CASE("e4m3 encoding rounds to nearest even and saturates", "[quantized][codec]") {
  using detail::encode_e4m3;
  // Every finite code's value encodes to itself (-0 to 0x80).
  for (int code = 0; code < 256; ++code) {
    if (is_nan_code(code)) continue;
    CHECK(encode_e4m3(e4m3_value(std::uint8_t(code))) == code);
  }
  CHECK(encode_e4m3(1.0625) == 0x38);                // halfway 1 .. 1.125: to the even mantissa (1)
  CHECK(encode_e4m3(1.1875) == 0x3A);                // halfway 1.125 .. 1.25: to 1.25
  CHECK(encode_e4m3(1.07) == 0x39);                  // past halfway: up
  CHECK(encode_e4m3(std::ldexp(1.0, -10)) == 0x00);  // halfway 0 .. 2^-9: to 0
  CHECK(encode_e4m3(3 * std::ldexp(1.0, -10)) == 0x02);   // halfway 2^-9 .. 2^-8: to 2^-8
  CHECK(encode_e4m3(15 * std::ldexp(1.0, -10)) == 0x08);  // halfway 7 .. 8 x 2^-9: to 2^-6
  CHECK(encode_e4m3(248.0) == 0x78);  // halfway 240 (m = 7) .. 256: the carry to 2^8
  CHECK(encode_e4m3(-3.5) == 0xC6);
  CHECK(encode_e4m3(460.0) == 0x7E);  // beyond 448 saturates (never 0x7F, NaN)
  CHECK(encode_e4m3(1e30) == 0x7E);
}

TEST_CASE("quantized rows: layout, scales and error bounds", "[quantized][codec]") {
  for (const Index w : {Index{1}, Index{54}, Index{64}, Index{128}, Index{200}, Index{512}}) {
    for (const float outlier : {0.0f, 40.0f}) {
      CAPTURE(w, outlier);
      const auto x = normal_row(w, 17 + static_cast<std::uint64_t>(w), outlier);
      check_row<Int8<128>>(x);
      check_row<Int8<32>>(x);
      check_row<Fp8E4M3<128>>(x);
      check_row<Fp8E4M3<16>>(x);
    }
  }
  // Ties to even in int8: a block whose largest magnitude is 127 has scale 1.
  const std::vector<float> ties{127.0f, 0.5f, 1.5f, 2.5f, -0.5f, -2.5f, 3.49f};
  const auto row = encode_row<Int8<128>>(ties);
  CHECK(stored_scale(row.data(), 7, 0) == 1.0f);
  const std::vector<int> want{127, 0, 2, 2, 0, -2, 3};
  for (std::size_t j = 0; j < want.size(); ++j) CHECK(int(row[j]) == want[j]);
  // An all-zero block: scale 0, codes 0, decoding to 0.
  const auto zeros = encode_row<Fp8E4M3<128>>(std::vector<float>(40, 0.0f));
  CHECK(stored_scale(zeros.data(), 40, 0) == 0.0f);
  for (Index j = 0; j < 40; ++j) CHECK(zeros[std::size_t(j)].bits == 0);
}

TEST_CASE("SIMD code widening equals the scalar decode", "[quantized][codec]") {
  constexpr Index P = detail::packet_size<float>;
  alignas(64) float out[P];
  for (int first = 0; first < 256; first += static_cast<int>(P)) {
    std::int8_t ints[P];
    fp8_e4m3 fp8[P];
    for (Index k = 0; k < P; ++k) {
      int code = (first + static_cast<int>(k)) % 256;
      if (is_nan_code(code)) code = 0x7E;
      ints[k] = static_cast<std::int8_t>(first + static_cast<int>(k) - 128);
      fp8[k] = fp8_e4m3{static_cast<std::uint8_t>(code)};
    }
    detail::ei::pstore(out, detail::load_widened<float>(ints));
    for (Index k = 0; k < P; ++k) CHECK(out[k] == static_cast<float>(ints[k]));
    detail::ei::pstore(out, detail::load_widened<float>(fp8));
    for (Index k = 0; k < P; ++k) {
      CAPTURE(int(fp8[k].bits));
      CHECK(static_cast<double>(out[k]) == e4m3_value(fp8[k].bits));
    }
  }
}

namespace {

// score_quantized and accumulate_quantized against double loops on the rows dequantized
// by this test (code x scale, read from the bytes): G query rows, n rows of width w.
template <class S>
void check_kernels(Index G, Index n, Index w, std::uint64_t seed) {
  using E = detail::storage_element_t<S>;
  const Index stride = detail::StorageTraits<S>::row_elements(w);
  std::vector<E> rows(static_cast<std::size_t>(n * stride));
  std::vector<double> dequantized(static_cast<std::size_t>(n * w));
  for (Index t = 0; t < n; ++t) {
    const auto x = normal_row(w, seed + static_cast<std::uint64_t>(t), t == 3 ? 9.0f : 0.0f);
    const auto row = encode_row<S>(x);
    std::copy(row.begin(), row.end(), rows.begin() + t * stride);
    for (Index j = 0; j < w; ++j) {
      dequantized[std::size_t(t * w + j)] =
          code_value<S>(row[std::size_t(j)]) * stored_scale(row.data(), w, j / S::block);
    }
  }
  const auto q = normal_row(G * w, seed + 1000);
  const Index ld = (n + 15) / 16 * 16;
  std::vector<float> logits(std::size_t(G * ld)), spare(std::size_t((G + 1) * ld));
  detail::score_quantized<float, S>(q.data(), w, G, rows.data(), stride, w, n, logits.data(), ld,
                                    spare.data());
  const auto weights = normal_row(G * ld, seed + 2000);
  std::vector<float> acc(std::size_t(G * w), 0.5f);
  detail::accumulate_quantized<float, S>(weights.data(), ld, G, rows.data(), stride, w, n,
                                         acc.data(), w, 16, nullptr, spare.data());
  for (Index i = 0; i < G; ++i) {
    for (Index t = 0; t < n; ++t) {
      double want = 0.0, size = 0.0;
      for (Index j = 0; j < w; ++j) {
        const double term = double(q[std::size_t(i * w + j)]) * dequantized[std::size_t(t * w + j)];
        want += term;
        size += std::fabs(term);
      }
      CAPTURE(G, n, w, i, t);
      CHECK(std::fabs(logits[std::size_t(i * ld + t)] - want) <= 1e-5 * size + 1e-30);
    }
    for (Index j = 0; j < w; ++j) {
      double want = 0.5, size = 0.5;
      for (Index t = 0; t < n; ++t) {
        const double term =
            double(weights[std::size_t(i * ld + t)]) * dequantized[std::size_t(t * w + j)];
        want += term;
        size += std::fabs(term);
      }
      CAPTURE(G, n, w, i, j);
      CHECK(std::fabs(acc[std::size_t(i * w + j)] - want) <= 1e-5 * size);
    }
  }
}

}  // namespace

TEST_CASE("decode kernels over quantized rows equal loops on the dequantized rows",
          "[quantized][codec]") {
  for (const Index G : {Index{1}, Index{3}, Index{8}}) {
    check_kernels<Int8<128>>(G, 37, 128, 5);
    check_kernels<Fp8E4M3<128>>(G, 37, 128, 6);
    check_kernels<Int8<64>>(G, 21, 200, 7);     // 4 blocks, the last one 8 wide
    check_kernels<Fp8E4M3<128>>(G, 19, 54, 8);  // one block narrower than the row's packets
    check_kernels<Fp8E4M3<32>>(G, 9, 96, 9);
  }
}
