// kvcalc's inputs: the model shape (from flags, a preset or a config.json) and the
// serving options, before defaults are applied (model.hpp resolves them).
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvattn/analysis/budget.hpp"
#include "kvattn/analysis/dtype.hpp"
#include "kvattn/core/index.hpp"

namespace kvcalc {

using kvattn::Index;
namespace an = kvattn::analysis;

/// Bad input: run() prints "kvcalc: error: <what>" and returns status 2.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void fail(const std::string& message) { throw InputError(message); }

/// The largest count a flag accepts (2^53): every product of two counts can then be
/// checked, and doubles hold every count exactly.
inline constexpr Index kMaxCount = Index{1} << 53;

/// Every knob, as given on the command line or by a preset / config.json. Unset
/// optionals take the defaults in resolve().
struct Shape {
  std::optional<Index> heads, head_dim, layers, d_model, kv_heads, kv_rank, q_rank, rope_dim, v_dim,
      lrkv_rank, window, window_layers, sink_tokens, max_rollback;
  std::optional<an::Dtype> dtype;
  std::string own;                 // the model's own mechanism ("" for a bare shape)
  std::string source = "flags";    // what the shape came from, for titles
  std::vector<std::string> notes;  // facts worth printing (e.g. an ignored sliding window)
};

struct Options {
  Shape shape;
  Index seq_len = 4096;
  Index batch = 1;
  Index tp = 1;
  Index page_size = 0;
  Index scale_block = 0;
  Index rank_step = 32;
  std::optional<an::Dtype> rope_dtype;
  std::vector<std::string> mechanisms;  // empty: all
  std::optional<an::Budget> budget;
  std::string budget_text;
  bool json = false;
  std::optional<std::string> svg_path;
  // The roofline of a decode step (analysis/decode_cost.hpp): read bandwidth in GB/s
  // (--bandwidth) and arithmetic rate in GFLOP/s (--flops, needs --bandwidth).
  std::optional<double> bandwidth_gbs;
  std::optional<double> gflops;
};

}  // namespace kvcalc
