#include "model.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvattn/analysis/decode_cost.hpp"
#include "kvattn/analysis/params.hpp"
#include "text.hpp"

namespace kvcalc {
namespace {

/// The largest divisor of H that is at most min(8, H / 2) (8 groups as in DeepSeek-V2's
/// ablation when H allows), or 1.
Index default_kv_heads(Index heads) {
  const Index cap = std::min<Index>(8, std::max<Index>(1, heads / 2));
  for (Index g = cap; g >= 1; --g) {
    if (heads % g == 0) return g;
  }
  return 1;
}

/// H * d_h, the default d, computed only when --d-model is not given: the product of
/// two counts can overflow (--heads 2^32 --head-dim 2^32).
Index default_d_model(Index heads, Index head_dim) {
  if (head_dim > 0 && heads > std::numeric_limits<Index>::max() / head_dim) {
    fail("--heads " + std::to_string(heads) + " x --head-dim " + std::to_string(head_dim) +
         " (the default --d-model) is too large to represent; give --d-model");
  }
  return heads * head_dim;
}

/// The roofline time of one decoded token of one sequence: every layer's attention step
/// over the tokens it sees (a window layer min(L, W + sink tokens)), each at max(bytes / bandwidth,
/// FLOPs / rate). The weights a step reads (MLA's W_UK and W_UV, LRKV's bases) count at
/// the cache's element width, but at least 2 bytes (a bf16 checkpoint).
template <class Config>
void add_decode_time(Row& row, const Config& config, const Resolved& r) {
  const Index weight_bytes = std::max<Index>(2, an::bytes_per_element(r.storage.dtype));
  const Index full_layers = r.stack.layers - r.stack.window_layers;
  // The step reads the tokens a query sees (window and sink tokens), not the rollback margin.
  const Index window_tokens = std::min(r.work.seq_len, r.stack.window + r.stack.sink_tokens);
  double seconds = 0.0, compute = 0.0, memory = 0.0;
  auto add = [&](Index layers, Index tokens) {
    if (layers == 0) return;
    const an::StepCost cost = an::attend_cost(config, tokens, r.storage, weight_bytes);
    seconds += static_cast<double>(layers) * an::roofline_seconds(cost, *r.machine);
    row.decode_bytes += static_cast<double>(layers) * cost.bytes;
    row.decode_flops += static_cast<double>(layers) * cost.flops;
    memory += static_cast<double>(layers) * cost.bytes / r.machine->bytes_per_second;
    compute += static_cast<double>(layers) * cost.flops / r.machine->flops_per_second;
  };
  add(full_layers, r.work.seq_len);
  add(r.stack.window_layers, window_tokens);
  row.decode_seconds = seconds;
  row.decode_memory_bound = memory >= compute;
}

template <class Config>
Row make_row(const std::string& name, const std::string& detail, const Config& config,
             const Resolved& r) {
  Row row;
  row.name = name;
  row.detail = detail;
  row.layout = an::cache_layout(config);
  try {
    row.device_layout = an::cache_layout(config, r.tp);
  } catch (const kvattn::config_error& e) {
    fail(name + " cannot run at --tp " + std::to_string(r.tp) + ": " + e.what());
  }
  const Index t = r.tp;
  row.device_elements_per_token_per_layer = row.device_layout.elements();
  row.device_bytes_per_token = an::bytes_per_token(row.device_layout, r.storage, r.layers);
  row.device_total_bytes = an::total_bytes(row.device_layout, r.storage, r.stack, r.work);
  row.elements_per_token_per_layer =
      an::detail::mul(row.device_elements_per_token_per_layer, t, "elements over devices");
  row.elements_per_token = an::detail::mul(row.elements_per_token_per_layer, r.layers, "elements");
  row.bytes_per_token = an::detail::mul(row.device_bytes_per_token, t, "bytes over devices");
  row.total_bytes = an::detail::mul(row.device_total_bytes, t, "total bytes over devices");
  row.ratio_to_mha = an::ratio_to_mha(row.layout, r.storage, r.heads, r.head_dim);
  row.groups = an::gqa_equivalent_groups(row.layout, r.storage, r.head_dim);
  row.kv_params = an::kv_projection_params(config);
  row.attention_params = an::attention_params(config);
  if (r.machine) add_decode_time(row, config, r);
  return row;
}

kvattn::GqaConfig gqa_of(const Resolved& r, Index kv) {
  kvattn::GqaConfig c;
  c.d_model = r.d_model;
  c.n_heads = r.heads;
  c.head_dim = r.head_dim;
  c.n_kv_heads = kv;
  return c;
}

kvattn::MlaConfig mla_of(const Resolved& r) {
  kvattn::MlaConfig c;
  c.d_model = r.d_model;
  c.n_heads = r.heads;
  c.kv_rank = r.kv_rank;
  c.q_rank = r.q_rank;
  c.qk_nope_dim = r.head_dim;
  c.rope_dim = r.rope_dim;
  c.v_dim = r.v_dim;
  c.kv_norm = true;
  c.q_norm = r.q_rank > 0;
  return c;
}

kvattn::LrkvConfig lrkv_of(const Resolved& r) {
  kvattn::LrkvConfig c;
  c.d_model = r.d_model;
  c.n_heads = r.heads;
  c.head_dim = r.head_dim;
  c.rank = r.lrkv_rank;
  return c;
}

}  // namespace

const std::vector<std::string>& all_mechanisms() {
  static const std::vector<std::string> names = {"MHA", "GQA", "MQA", "MLA", "LRKV"};
  return names;
}

Resolved resolve(const Options& o) {
  const Shape& s = o.shape;
  Resolved r{};
  r.heads = s.heads.value_or(128);
  r.head_dim = s.head_dim.value_or(128);
  r.layers = s.layers.value_or(60);
  r.d_model = s.d_model ? *s.d_model : default_d_model(r.heads, r.head_dim);
  r.kv_heads = s.kv_heads.value_or(default_kv_heads(r.heads));
  r.kv_rank = s.kv_rank.value_or(4 * r.head_dim);  // DeepSeek-V2: d_c = 4 d_h
  r.q_rank = s.q_rank.value_or(0);
  r.rope_dim = s.rope_dim.value_or(r.head_dim / 2);  // DeepSeek-V2: d_R = d_h / 2
  r.v_dim = s.v_dim.value_or(r.head_dim);
  r.lrkv_rank = s.lrkv_rank.value_or(r.head_dim / 2);
  if (r.heads % r.kv_heads != 0) {
    fail("--kv-heads " + std::to_string(r.kv_heads) + " must divide --heads " +
         std::to_string(r.heads) + " (one of " + divisors_text(r.heads) + ")");
  }
  if (r.lrkv_rank > r.head_dim) {
    fail("--lrkv-rank " + std::to_string(r.lrkv_rank) + " must be <= --head-dim " +
         std::to_string(r.head_dim) + " (a larger rank only adds cache)");
  }
  if (o.tp > 1 && r.heads % o.tp != 0) {
    fail("--tp " + std::to_string(o.tp) + " must divide --heads " + std::to_string(r.heads) +
         " (query heads are split across devices; one of " + divisors_text(r.heads) + ")");
  }
  const Index window = s.window.value_or(0);
  Index window_layers = s.window_layers.value_or(window > 0 ? r.layers : 0);
  if (window_layers > r.layers) {
    fail("--window-layers " + std::to_string(window_layers) + " must be <= --layers " +
         std::to_string(r.layers));
  }
  if (window_layers > 0 && window == 0) {
    fail("--window-layers " + std::to_string(window_layers) +
         " needs --window W, the tokens a sliding-window layer keeps (e.g. --window 4096)");
  }
  const Index sink_tokens = s.sink_tokens.value_or(0);
  const Index max_rollback = s.max_rollback.value_or(0);
  if ((sink_tokens > 0 || max_rollback > 0) && window == 0) {
    fail(std::string(sink_tokens > 0 ? "--sink-tokens" : "--max-rollback") +
         " needs --window W: only sliding-window layers drop tokens");
  }
  if (window == 0) window_layers = 0;
  r.stack = {r.layers, window_layers, window, sink_tokens, max_rollback};
  r.work = {o.seq_len, o.batch, o.page_size};
  const an::Dtype dtype = s.dtype.value_or(an::Dtype::bf16);
  if (o.scale_block > 0) {
    r.storage =
        an::block_scaled_storage(dtype, o.scale_block, o.rope_dtype.value_or(an::Dtype::bf16));
  } else {
    r.storage = an::plain_storage(dtype);
    if (o.rope_dtype) r.storage.rope_dtype = *o.rope_dtype;
  }
  r.tp = o.tp;
  if (o.gflops && !o.bandwidth_gbs) {
    fail(
        "--flops needs --bandwidth (the prediction is max(bytes / bandwidth, FLOPs / rate)), "
        "e.g. --bandwidth 20 --flops 500");
  }
  if (o.bandwidth_gbs) {
    // Without --flops the arithmetic is taken as free: the time is bytes / bandwidth.
    r.machine = an::Machine{*o.bandwidth_gbs * 1e9,
                            o.gflops ? *o.gflops * 1e9 : std::numeric_limits<double>::max()};
  }
  return r;
}

std::vector<Row> compute_rows(const Options& o, const Resolved& r) {
  std::vector<std::string> wanted = o.mechanisms.empty() ? all_mechanisms() : o.mechanisms;
  // The model's own mechanism first, then the others in the usual order.
  if (!o.shape.own.empty()) {
    const auto it = std::find(wanted.begin(), wanted.end(), o.shape.own);
    if (it != wanted.end()) std::rotate(wanted.begin(), it, it + 1);
  }
  std::vector<Row> rows;
  for (const std::string& name : wanted) {
    Row row;
    if (name == "MHA") {
      row = make_row(name, "n_kv " + std::to_string(r.heads), gqa_of(r, r.heads), r);
    } else if (name == "GQA") {
      row = make_row(name, "n_kv " + std::to_string(r.kv_heads), gqa_of(r, r.kv_heads), r);
    } else if (name == "MQA") {
      row = make_row(name, "n_kv 1", gqa_of(r, 1), r);
    } else if (name == "MLA") {
      row = make_row(name,
                     "d_c " + std::to_string(r.kv_rank) + " + d_R " + std::to_string(r.rope_dim),
                     mla_of(r), r);
    } else {
      row = make_row(name, "r " + std::to_string(r.lrkv_rank), lrkv_of(r), r);
    }
    row.own = name == o.shape.own;
    rows.push_back(row);
  }
  return rows;
}

BudgetResult solve_budget(const an::Budget& budget, const Options& o, const Resolved& r) {
  BudgetResult b;
  b.kv_rank = an::max_kv_rank(mla_of(r), r.layers, budget, r.storage, o.rank_step);
  b.lrkv_rank = an::max_lrkv_rank(lrkv_of(r), r.layers, budget, r.storage);
  b.kv_heads = an::max_kv_heads(gqa_of(r, r.heads), r.layers, budget, r.storage);
  b.kv_rank_bound = an::kv_rank_bound(r.rope_dim, r.layers, budget.amount);
  return b;
}

std::string storage_text(const an::CacheStorage& s) {
  std::string text(an::to_string(s.dtype));
  if (s.scale_block > 0) {
    text += " + one " + std::string(an::to_string(s.scale_dtype)) + " scale per " +
            std::to_string(s.scale_block) + " elements, rope in " +
            std::string(an::to_string(s.rope_dtype));
  } else if (s.rope_dtype != s.dtype) {
    text += ", rope in " + std::string(an::to_string(s.rope_dtype));
  }
  return text;
}

std::string title_text(const Options& o, const Resolved& r) {
  std::string t = o.shape.source + ": l " + std::to_string(r.layers) + ", H " +
                  std::to_string(r.heads) + ", d_h " + std::to_string(r.head_dim) + ", " +
                  storage_text(r.storage);
  if (r.tp > 1) t += ", tp " + std::to_string(r.tp);
  return t;
}

LogAxis::LogAxis(const std::vector<double>& values) {
  double mn = values.front(), mx = values.front();
  for (double v : values) {
    mn = std::min(mn, v);
    mx = std::max(mx, v);
  }
  lo = std::floor(std::log10(std::max(mn, 1.0)));
  hi = std::ceil(std::log10(std::max(mx, 1.0)));
  if (hi <= lo) hi = lo + 1;
}

double LogAxis::fraction(double v) const { return (std::log10(std::max(v, 1.0)) - lo) / (hi - lo); }

std::string power_label(int exponent) {
  static const char* const names[] = {"1",    "10", "100", "1k",   "10k", "100k", "1M",  "10M",
                                      "100M", "1G", "10G", "100G", "1T",  "10T",  "100T"};
  if (exponent >= 0 && exponent < 15) return names[exponent];
  return "1e" + std::to_string(exponent);
}

}  // namespace kvcalc
