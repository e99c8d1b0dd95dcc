// kvcalc's numbers: the options resolved to one shape, and one row per mechanism,
// every number from kvattn's analysis module (docs/cache-size.md).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "kvattn/analysis/budget.hpp"
#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/analysis/decode_cost.hpp"
#include "options.hpp"

namespace kvcalc {

/// The options with every default applied and every cross-field rule checked.
struct Resolved {
  Index heads, head_dim, layers, d_model, kv_heads, kv_rank, q_rank, rope_dim, v_dim, lrkv_rank;
  an::LayerStack stack;
  an::Workload work;
  an::CacheStorage storage;
  Index tp;
  std::optional<an::Machine> machine;  // --bandwidth / --flops
};

/// One mechanism's cache at the resolved shape.
struct Row {
  std::string name;
  std::string detail;  // "n_kv 8", "d_c 512 + d_R 64", "r 64"
  bool own = false;
  an::CacheLayout layout;         // whole layer (tp 1)
  an::CacheLayout device_layout;  // one device
  Index elements_per_token_per_layer = 0;
  Index elements_per_token = 0;
  Index bytes_per_token = 0;  // summed over devices
  Index total_bytes = 0;      // summed over devices
  Index device_elements_per_token_per_layer = 0;
  Index device_bytes_per_token = 0;
  Index device_total_bytes = 0;
  double ratio_to_mha = 0.0;
  double groups = 0.0;
  Index kv_params = 0;
  Index attention_params = 0;
  // With --bandwidth: one decode step of one sequence through every layer (each
  // layer's attention step over the tokens it keeps, at the roofline).
  std::optional<double> decode_seconds;
  bool decode_memory_bound = true;
  double decode_bytes = 0.0;  // summed over layers (and devices)
  double decode_flops = 0.0;
};

struct BudgetResult {
  std::optional<Index> kv_rank, lrkv_rank, kv_heads;
  double kv_rank_bound = 0.0;
};

/// "MHA", "GQA", "MQA", "MLA", "LRKV": every row, in the usual order.
const std::vector<std::string>& all_mechanisms();

Resolved resolve(const Options& o);
std::vector<Row> compute_rows(const Options& o, const Resolved& r);
BudgetResult solve_budget(const an::Budget& budget, const Options& o, const Resolved& r);

/// "bf16", "fp8_e4m3 + one fp32 scale per 128 elements, rope in bf16", ...
std::string storage_text(const an::CacheStorage& s);
/// "DeepSeek-V2: l 60, H 128, d_h 128, bf16[, tp 8]".
std::string title_text(const Options& o, const Resolved& r);

/// Decade-aligned log axis covering every value.
struct LogAxis {
  double lo, hi;
  explicit LogAxis(const std::vector<double>& values);
  double fraction(double v) const;
};

/// 10^exponent as "1", "10k", "1M", ... ("1e15" beyond).
std::string power_label(int exponent);

}  // namespace kvcalc
