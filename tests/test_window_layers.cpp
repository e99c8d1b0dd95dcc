// [window][layers]: every layer family (MHA, GQA, MQA, MLA in both prefill modes, LRKV)
// computes sliding windows, sink tokens, sink logits and soft-capped logits, alone and
// together, exactly as the expanded reference (reference::forward with the layer's own
// mask and logit shaping, the spec written out as loops in test_window_reference.cpp):
// prefill in chunks that cross the window, token-by-token decode over sequences many
// windows long, threads, decode_batch over caches of different lengths, and float
// against double.
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"
#include "kvattn/reference/gqa.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "kvattn/reference/mla.hpp"
#include "test_util.hpp"
#include "window_cases.hpp"

using namespace kvattn;
using test::random_input;
using test::relative_error;

namespace {

using MatD = RowMatrix<double>;
using MatF = RowMatrix<float>;

// Double against double: the kernels and the reference differ only in the order of
// their sums (tiles, online rescaling), a few ulps of each output.
constexpr double kExact = 1e-12;
// Float against the double reference, as everywhere in the suite (test_util.hpp).
constexpr double kFloat = 1e-5;

struct Span {
  const char* name;
  Index window;
  Index sink_tokens;
  bool sink_logits;
  double softcap;
};

// Each feature alone, and all of them together. The soft-cap is small (logits here are
// O(1)), so it bends every logit noticeably.
const Span kSpans[] = {
    {"window", 12, 0, false, 0.0},    {"window + sink tokens", 12, 3, false, 0.0},
    {"sink logits", 0, 0, true, 0.0}, {"soft-cap", 0, 0, false, 0.7},
    {"all", 12, 3, true, 0.7},
};

template <class Config>
Config with_span(Config c, const Span& span) {
  c.window = span.window;
  c.sink_tokens = span.sink_tokens;
  c.sink_logits = span.sink_logits;
  c.logit_softcap = span.softcap;
  return c;
}

GqaConfig gqa_case(Index n_kv = 2) { return test::window_gqa_case(n_kv); }
MlaConfig mla_case() { return test::window_mla_case(); }
LrkvConfig lrkv_case() { return test::window_lrkv_case(); }

template <class Layer>
auto prefill(const Layer& layer, const MatD& x, auto& cache, Threads threads, int mode) {
  if constexpr (requires { layer.prefill(x, cache, threads, MlaPrefill::absorbed); }) {
    return layer.prefill(x, cache, threads,
                         mode == 0 ? MlaPrefill::expanded : MlaPrefill::absorbed);
  } else {
    return layer.prefill(x, cache, threads);
  }
}

// The sequence x through the layer in pieces: prefill chunks of the given sizes (the
// first starting with an empty cache), then one decode per remaining token.
template <class Layer>
MatD run_pieces(const Layer& layer, const MatD& x, const std::vector<Index>& chunks,
                Threads threads, int mode) {
  auto cache = layer.make_cache();
  MatD out(x.rows(), layer.config().d_model);
  Index done = 0;
  for (const Index n : chunks) {
    out.middleRows(done, n) = prefill(layer, x.middleRows(done, n), cache, threads, mode);
    done += n;
  }
  auto ws = layer.make_workspace(threads);
  for (; done < x.rows(); ++done) {
    RowVector<double> y(layer.config().d_model);
    layer.decode(x.row(done), cache, y, ws, threads);
    out.row(done) = y;
  }
  REQUIRE(cache.tokens() == x.rows());
  return out;
}

template <class Layer>
void check_sequence(const Layer& layer, Index length, std::uint64_t seed) {
  const MatD x = random_input<double>(length, layer.config().d_model, seed);
  const MatD want = reference::forward(layer, x);
  const int modes = requires {
    layer.prefill(x, std::declval<typename Layer::template cache_type<>&>(), Threads{},
                  MlaPrefill::absorbed);
  }
  ? 2 : 1;
  for (int mode = 0; mode < modes; ++mode) {
    CAPTURE(mode);
    // Prefill chunks that start and end inside, across and far past the window.
    const std::vector<Index> chunk_sets[] = {{length}, {5, 1, 30}, {17, 40}, {}, {1, 2, 3}};
    for (const auto& chunks : chunk_sets) {
      for (const Threads threads : {Threads{1}, Threads{2}}) {
        CAPTURE(chunks.size(), threads.count);
        const double error = relative_error(run_pieces(layer, x, chunks, threads, mode), want);
        CAPTURE(error);
        CHECK(error <= kExact);
      }
    }
  }
}

template <class Layer, class Config>
void check_family(const Config& base, std::uint64_t seed) {
  for (const Span& span : kSpans) {
    CAPTURE(span.name);
    const auto layer = Layer::random(with_span(base, span), seed++);
    check_sequence(layer, 90, seed);
  }
}

}  // namespace

TEST_CASE("MHA, GQA and MQA with windows, sinks, sink logits and soft-caps equal the reference",
          "[window][layers]") {
  for (const Index n_kv : {Index{4}, Index{2}, Index{1}}) {
    CAPTURE(n_kv);
    check_family<GqaLayer<double>>(gqa_case(n_kv), 10 + static_cast<std::uint64_t>(n_kv) * 10);
  }
}

TEST_CASE("MLA with windows, sinks, sink logits and soft-caps equals the reference",
          "[window][layers]") {
  check_family<MlaLayer<double>>(mla_case(), 60);
}

TEST_CASE("LRKV with windows, sinks, sink logits and soft-caps equals the reference",
          "[window][layers]") {
  check_family<LrkvLayer<double>>(lrkv_case(), 80);
}

TEST_CASE("a window of 64 over 1000 decoded tokens equals the reference", "[window][layers]") {
  Span all{"all", 64, 4, true, 1.0};
  const auto check = [&](const auto& layer) {
    const MatD x = random_input<double>(1000, layer.config().d_model, 7);
    const MatD want = reference::forward(layer, x);
    const double error = relative_error(run_pieces(layer, x, {100}, Threads{2}, 1), want);
    CAPTURE(error);
    CHECK(error <= kExact);
  };
  check(GqaLayer<double>::random(with_span(gqa_case(2), all), 1));
  check(MlaLayer<double>::random(with_span(mla_case(), all), 2));
  check(LrkvLayer<double>::random(with_span(lrkv_case(), all), 3));
}

TEST_CASE("float layers with every span feature equal the double reference", "[window][layers]") {
  const Span all = kSpans[4];
  const auto check = [&](const auto& layer, const auto& wide) {
    const MatF x = random_input<float>(80, layer.config().d_model, 9);
    const MatD want = reference::forward(wide, x.cast<double>());
    auto cache = layer.make_cache();
    MatF out(x.rows(), layer.config().d_model);
    out.topRows(30) = layer.prefill(x.topRows(30), cache);
    for (Index i = 30; i < x.rows(); ++i) out.row(i) = layer.decode(x.row(i), cache);
    const double error = relative_error(out, want);
    CAPTURE(error);
    CHECK(error <= kFloat);
  };
  const auto gqa = GqaLayer<float>::random(with_span(gqa_case(2), all), 4);
  check(gqa, GqaLayer<double>(gqa.config(), gqa.weights().cast<double>()));
  const auto mla = MlaLayer<float>::random(with_span(mla_case(), all), 5);
  check(mla, MlaLayer<double>(mla.config(), mla.weights().cast<double>()));
  const auto lrkv = LrkvLayer<float>::random(with_span(lrkv_case(), all), 6);
  check(lrkv, LrkvLayer<double>(lrkv.config(), lrkv.weights().cast<double>()));
}

TEST_CASE("decode_batch with windows, sinks, sink logits and soft-caps equals the reference",
          "[window][layers][batch]") {
  const Span all = kSpans[4];
  // Three sequences of different lengths (inside, at and past the window), one batched
  // step each, at 1 and 2 threads: row s is the reference's last row of sequence s.
  const auto check = [&](const auto& layer) {
    const Index lengths[] = {5, 12, 47};
    for (const Threads threads : {Threads{1}, Threads{2}}) {
      using Cache = typename std::decay_t<decltype(layer)>::template cache_type<>;
      std::vector<Cache> caches;
      std::vector<MatD> inputs;
      MatD x(3, layer.config().d_model);
      for (Index s = 0; s < 3; ++s) {
        inputs.push_back(random_input<double>(lengths[s], layer.config().d_model, 20 + s));
        caches.push_back(layer.make_cache());
        layer.prefill(inputs.back().topRows(lengths[s] - 1), caches.back());
        x.row(s) = inputs.back().bottomRows(1);
      }
      std::vector<Cache*> pointers{&caches[0], &caches[1], &caches[2]};
      MatD out(3, layer.config().d_model);
      layer.decode_batch(x, std::span<Cache* const>(pointers), out, threads);
      for (Index s = 0; s < 3; ++s) {
        CAPTURE(s, threads.count);
        const MatD want = reference::forward(layer, inputs[static_cast<std::size_t>(s)]);
        const double error = relative_error(out.row(s), want.bottomRows(1));
        CAPTURE(error);
        CHECK(error <= kExact);
      }
    }
  };
  check(GqaLayer<double>::random(with_span(gqa_case(2), all), 11));
  check(MlaLayer<double>::random(with_span(mla_case(), all), 12));
  check(LrkvLayer<double>::random(with_span(lrkv_case(), all), 13));
}
