// Structured fuzz target: bytes -> a small bounded layer config (GQA/MHA/MQA, MLA or
// LRKV; dimensions up to a few dozen, sometimes invalid on purpose; with a selector of
// 3 ... 5, also a window, sink tokens, sink logits and a soft-cap) and a sequence of
// calls (prefill — MLA's in the mode the input picks: automatic, expanded, absorbed, or
// an invalid one that must be refused — decode, attend, truncate, append, reserve, and
// wrongly shaped arguments) on it, with inputs and weights drawn from a seeded N(0, 1)
// — raw bytes as floats would be NaN soup — and the cache storing double or bf16 (the
// input picks). The property: every call either throws a documented kvattn exception
// (config_error, shape_error) and leaves the cache's tokens, capacity and bytes as they
// were, or returns a result equal to the expanded reference (reference::decode_step on
// the cache's own rows, through W_O for whole-layer outputs) to 1e-10 in double — the
// equivalence tests' bound, loosened by 100x for the fuzzer's degenerate shapes (d = 1,
// one-token caches). A violation aborts, which libFuzzer reports as a crash.
//
// The same bound for bf16 storage, honestly: the reference reads the cache's stored
// (rounded) rows widened to double, and the layers attend over exactly those rounded
// values too (prefill stages the new rows rounded to S before attending; decode and
// attend read the cache), so bf16 rounding is on both sides and only double arithmetic
// differs. What bf16 changes against a double cache (up to ~1.6e-2 relative,
// test_storage_bf16.cpp) is not what is compared here.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <type_traits>

#include "../attend_util.hpp"
#include "../test_util.hpp"
#include "kvattn/analysis/params.hpp"
#include "kvattn/attention/mla.hpp"
#include "kvattn/reference/gqa.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "kvattn/reference/mla.hpp"

namespace {

using namespace kvattn;
using Mat = RowMatrix<double>;

constexpr double kTolerance = 1e-10;

// Reads small integers from the input; past its end every read is 0.
class Bytes {
 public:
  Bytes(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  unsigned byte() { return position_ < size_ ? data_[position_++] : 0u; }
  // An integer in [lo, hi].
  Index in(Index lo, Index hi) { return lo + static_cast<Index>(byte()) % (hi - lo + 1); }
  bool flag() { return (byte() & 1u) != 0; }
  // A raw field: usually in [lo, hi], sometimes anything (negative, huge, zero).
  Index field(Index lo, Index hi) {
    const unsigned selector = byte();
    if (selector < 240) return in(lo, hi);
    const Index raw = static_cast<Index>(static_cast<std::int64_t>(
        (std::uint64_t{byte()} << 56) | (std::uint64_t{byte()} << 32) | byte()));
    return selector % 2 == 0 ? raw : -static_cast<Index>(byte());
  }
  bool done() const { return position_ >= size_; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t position_ = 0;
};

[[noreturn]] void violation(const std::string& what) {
  std::fprintf(stderr, "fuzz_layers: property violated: %s\n", what.c_str());
  std::abort();
}

void expect_close(const Mat& got, const Mat& want, const std::string& what) {
  if (!want.allFinite()) return;  // nothing to compare against (the reference itself failed)
  const double error = test::relative_error(got, want);
  if (!(error <= kTolerance)) violation(what + ": relative error " + std::to_string(error));
}

RopeConfig rope_of(Bytes& in) {
  switch (in.in(0, 2)) {
    case 0:
      return {};
    case 1:
      return {RopeLayout::half_split, in.flag() ? 10000.0 : 50.0, in.in(0, 30)};
    default:
      return {RopeLayout::interleaved, in.flag() ? 10000.0 : 50.0, in.in(0, 30)};
  }
}

GqaConfig gqa_of(Bytes& in) {
  GqaConfig c;
  c.rope = rope_of(in);
  c.d_model = in.field(1, 24);
  c.n_heads = in.field(1, 8);
  c.n_kv_heads = in.flag() ? c.n_heads : in.field(1, 4);
  c.head_dim = in.field(1, 12);
  if (c.rope.enabled() && in.byte() < 250) c.head_dim += c.head_dim % 2;
  c.qkv_bias = in.flag();
  return c;
}

MlaConfig mla_of(Bytes& in) {
  MlaConfig c;
  c.d_model = in.field(1, 24);
  c.n_heads = in.field(1, 6);
  c.kv_rank = in.field(1, 20);
  c.q_rank = in.flag() ? 0 : in.field(1, 12);
  c.q_norm = c.q_rank > 0 && in.flag();
  c.kv_norm = in.flag();
  c.qk_nope_dim = in.field(1, 10);
  c.v_dim = in.field(1, 10);
  c.rope = rope_of(in);
  c.rope_dim = c.rope.enabled() ? 2 * in.in(1, 4) : in.in(0, 3);
  if (c.rope.enabled() && in.byte() >= 250) c.rope_dim += 1;  // odd: refused
  c.yarn = {c.rope.enabled() && in.flag(), 1.0 + in.in(0, 30), in.in(1, 64), 32.0, 1.0, 1.0,
            in.flag() ? 1.0 : 0.0};
  return c;
}

LrkvConfig lrkv_of(Bytes& in) {
  LrkvConfig c;
  c.d_model = in.field(1, 24);
  c.n_heads = in.field(1, 6);
  c.head_dim = 2 * in.in(1, 6);
  c.rank = in.field(0, c.head_dim);
  // The reference decode step covers none, shared and decoupled.
  c.rope_mode = static_cast<LrkvRopeMode>(in.in(0, 2));
  if (c.rope_mode != LrkvRopeMode::none) {
    c.rope = {in.flag() ? RopeLayout::half_split : RopeLayout::interleaved, 10000.0, in.in(0, 30)};
  }
  if (c.rope_mode == LrkvRopeMode::decoupled) c.rope_dim = 2 * in.in(1, 3);
  c.key_norm = in.flag();
  return c;
}

// Whole-layer output rows of tokens `first` ... cache.tokens() - 1 of x (rows of x
// aligned with the cache's tokens from `first`), each through the reference decode step
// on the cache truncated to that token, then W_O.
template <class Layer, class Cache>
Mat reference_outputs(const Layer& layer, const Cache& cache, const Mat& x, Index first) {
  Mat out(x.rows(), layer.config().d_model);
  for (Index i = 0; i < x.rows(); ++i) {
    Cache prefix = cache;
    prefix.truncate(first + i + 1);
    const Mat query = test::project_query(layer, x.row(i));
    out.row(i) = reference::decode_step(layer, prefix, query) * layer.weights().w_o;
  }
  return out;
}

// Raw rows for append, from the seeded generator (LRKV's key RMS near 1, > 0).
struct RowsStore {
  Mat m[6];
};

template <class S>
typename GqaCache<double, S>::rows_type make_rows(const GqaCache<double, S>& cache, Index n,
                                                  std::mt19937_64& rng, RowsStore& s) {
  const Index w = cache.config().kv_width();
  s.m[0] = random_normal<double>(n, w, rng);
  s.m[1] = random_normal<double>(n, w, rng);
  return {s.m[0], s.m[1]};
}
template <class S>
typename MlaCache<double, S>::rows_type make_rows(const MlaCache<double, S>& cache, Index n,
                                                  std::mt19937_64& rng, RowsStore& s) {
  s.m[0] = random_normal<double>(n, cache.config().kv_rank, rng);
  s.m[1] = random_normal<double>(n, cache.config().rope_dim, rng);
  return {s.m[0], s.m[1]};
}
template <class S>
typename LrkvCache<double, S>::rows_type make_rows(const LrkvCache<double, S>& cache, Index n,
                                                   std::mt19937_64& rng, RowsStore& s) {
  const LrkvConfig& c = cache.config();
  s.m[0] = random_normal<double>(n, c.head_dim, rng);
  s.m[1] = random_normal<double>(n, c.head_dim, rng);
  s.m[2] = random_normal<double>(n, c.residual_width(), rng);
  s.m[3] = random_normal<double>(n, c.residual_width(), rng);
  s.m[4] = random_normal<double>(n, c.decoupled_dim(), rng);
  s.m[5] = (random_normal<double>(n, c.key_norm ? c.n_heads : 0, rng).array() * 0.2 + 1.0).matrix();
  return {s.m[0], s.m[1], s.m[2], s.m[3], s.m[4], s.m[5]};
}

// Runs `call`; a kvattn::error must leave the cache's token count, capacity and bytes
// as they were (the fault-injection tests check the rows bitwise; here the cheap part,
// every run).
template <class Cache, class Call>
bool run_checked(const Cache& cache, const std::string& what, Call call) {
  const Index tokens = cache.tokens();
  const Index capacity = cache.capacity();
  const std::size_t bytes = cache.bytes();
  try {
    call();
    return true;
  } catch (const kvattn::error&) {
    if (cache.tokens() != tokens || cache.capacity() != capacity || cache.bytes() != bytes) {
      violation(what + " threw but changed the cache (tokens " + std::to_string(tokens) + " -> " +
                std::to_string(cache.tokens()) + ", capacity " + std::to_string(capacity) + " -> " +
                std::to_string(cache.capacity()) + ")");
    }
    return false;
  }
}

// MLA's prefill in the mode the input picks (a fourth value is no MlaPrefill and must be
// refused with a config_error); the other layers have one prefill.
template <class Layer, class Cache>
bool prefill_checked(const Layer& layer, const Mat& x, Cache& cache, Threads threads, Bytes& in,
                     Mat& y) {
  if constexpr (std::is_same_v<Layer, MlaLayer<double>>) {
    const Index pick = in.in(0, 3);
    const auto mode = static_cast<MlaPrefill>(pick);
    const std::string what = "prefill (MLA mode " + std::to_string(pick) + ")";
    const bool ran = run_checked(cache, what, [&] { y = layer.prefill(x, cache, threads, mode); });
    if (ran && pick == 3) violation("MLA prefill accepted mode 3, which is no MlaPrefill");
    return ran;
  } else {
    (void)in;
    return run_checked(cache, "prefill", [&] { y = layer.prefill(x, cache, threads); });
  }
}

template <class S, class Layer>
void run_calls(const Layer& layer, Bytes& in, std::uint64_t seed) {
  using Cache = typename Layer::template cache_type<S>;
  std::mt19937_64 rng(seed);
  const Index d = layer.config().d_model;
  Cache cache = layer.template make_cache<S>(in.in(0, 8));
  const Threads threads{static_cast<int>(in.in(1, 3))};
  auto workspace = layer.make_workspace(threads);
  for (int step = 0; step < 12 && !in.done(); ++step) {
    switch (in.in(0, 7)) {
      case 0: {  // prefill of n tokens
        const Mat x = random_normal<double>(in.in(0, 20), d, rng);
        const Index past = cache.tokens();
        Mat y;
        if (prefill_checked(layer, x, cache, threads, in, y)) {
          expect_close(y, reference_outputs(layer, cache, x, past), "prefill");
        }
        break;
      }
      case 1: {  // decode of one token
        const Mat x = random_normal<double>(1, d, rng);
        Mat out(1, d);
        if (run_checked(cache, "decode",
                        [&] { layer.decode(x, cache, out, workspace, threads); })) {
          expect_close(out, reference_outputs(layer, cache, x, cache.tokens() - 1), "decode");
        }
        break;
      }
      case 2: {  // attend with a random projected query
        const Mat query = random_normal<double>(1, layer.query_width(), rng);
        Mat heads(1, layer.heads_width());
        if (run_checked(cache, "attend",
                        [&] { layer.attend(query, cache, heads, workspace, threads); })) {
          expect_close(heads, reference::decode_step(layer, cache, query), "attend");
        }
        break;
      }
      case 3: {  // truncate, sometimes out of range
        const Index n = in.in(0, cache.tokens() + 2);
        run_checked(cache, "truncate", [&] { cache.truncate(n); });
        break;
      }
      case 4: {  // append raw rows
        RowsStore store;
        const auto rows = make_rows(cache, in.in(0, 6), rng, store);
        run_checked(cache, "append", [&] { cache.append(rows); });
        break;
      }
      case 5: {  // reserve, sometimes negative
        const Index n = in.in(0, 64) - 4;
        run_checked(cache, "reserve", [&] { cache.reserve(n); });
        break;
      }
      case 6: {  // a wrongly shaped decode: must be a shape_error
        const Mat x = random_normal<double>(in.in(2, 3), d + in.in(0, 1), rng);
        Mat out(1, d);
        if (run_checked(cache, "bad decode",
                        [&] { layer.decode(x, cache, out, workspace, threads); })) {
          violation("decode accepted a " + std::to_string(x.rows()) + " x " +
                    std::to_string(x.cols()) + " x");
        }
        break;
      }
      default: {  // a fork: decoding the copy leaves the original alone
        Cache fork = cache;
        const Mat x = random_normal<double>(1, d, rng);
        Mat out(1, d);
        const Index tokens = cache.tokens();
        run_checked(fork, "fork decode", [&] { layer.decode(x, fork, out, workspace, threads); });
        if (cache.tokens() != tokens) violation("decoding a fork changed the original");
        break;
      }
    }
  }
}

// The window fields from the input (when `spanned`): a window of 0 ... 40 tokens (0:
// global), 0 ... 5 sink tokens (refused without a window), sink logits, and a soft-cap
// (now and then a negative one, refused).
template <class Config>
Config with_span(Config c, Bytes& in, bool spanned) {
  if (!spanned) return c;
  c.window = in.in(0, 40);
  c.sink_tokens = in.in(0, 5);
  c.sink_logits = in.flag();
  const unsigned cap = in.byte();
  c.logit_softcap = cap >= 250 ? -1.0 : (cap % 2 == 0 ? 0.0 : 0.25 * static_cast<double>(cap % 40));
  return c;
}

template <class Config, class Layer>
void run_mechanism(const Config& config, Bytes& in) {
  const std::uint64_t seed = in.byte();
  try {
    config.validate();
    // A valid config may still be far too large to allocate (std::bad_alloc, documented
    // but out of the fuzzer's memory limit): the calls are fuzzed on small layers only.
    if (analysis::attention_params(config) > 200000) return;
  } catch (const kvattn::error&) {
    return;  // a refused config (or a parameter count past 2^63): documented
  }
  const auto layer = Layer::random(config, seed);
  if (in.flag()) {
    run_calls<Eigen::bfloat16>(layer, in, seed + 1);
  } else {
    run_calls<double>(layer, in, seed + 1);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Bytes in(data, size);
  try {
    // 0 ... 2: the mechanism; 3 ... 5: the same with a window, sink tokens, sink logits
    // and a soft-cap from the input (so inputs from before these fields keep their meaning).
    const Index pick = in.in(0, 5);
    const bool spanned = pick >= 3;
    switch (pick % 3) {
      case 0:
        run_mechanism<GqaConfig, GqaLayer<double>>(with_span(gqa_of(in), in, spanned), in);
        break;
      case 1:
        run_mechanism<MlaConfig, MlaLayer<double>>(with_span(mla_of(in), in, spanned), in);
        break;
      default:
        run_mechanism<LrkvConfig, LrkvLayer<double>>(with_span(lrkv_of(in), in, spanned), in);
        break;
    }
  } catch (const kvattn::error&) {
    // documented: a config or shape error the calls above did not catch themselves
  } catch (const std::exception& e) {
    violation(std::string("undocumented exception: ") + e.what());
  }
  return 0;
}
