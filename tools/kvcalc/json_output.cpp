#include "json_output.hpp"

#include <nlohmann/json.hpp>

namespace kvcalc {
namespace {

using json = nlohmann::ordered_json;  // keeps the fields in the order written

json to_json(const Options& o, const Resolved& r, const std::vector<Row>& rows,
             const std::optional<BudgetResult>& budget) {
  json j;
  j["source"] = o.shape.source;
  j["own_mechanism"] = o.shape.own.empty() ? json(nullptr) : json(o.shape.own);
  j["shape"] = {{"heads", r.heads},        {"head_dim", r.head_dim}, {"layers", r.layers},
                {"d_model", r.d_model},    {"kv_heads", r.kv_heads}, {"kv_rank", r.kv_rank},
                {"q_rank", r.q_rank},      {"rope_dim", r.rope_dim}, {"v_dim", r.v_dim},
                {"lrkv_rank", r.lrkv_rank}};
  j["storage"] = {{"dtype", std::string(an::to_string(r.storage.dtype))},
                  {"rope_dtype", std::string(an::to_string(r.storage.rope_dtype))},
                  {"scale_block", r.storage.scale_block},
                  {"scale_dtype", std::string(an::to_string(r.storage.scale_dtype))}};
  j["seq_len"] = r.work.seq_len;
  j["batch"] = r.work.batch;
  j["page_size"] = r.work.page_tokens;
  j["window"] = r.stack.window;
  j["window_layers"] = r.stack.window_layers;
  j["sink_tokens"] = r.stack.sink_tokens;
  j["max_rollback"] = r.stack.max_rollback;
  j["tp"] = r.tp;
  if (r.machine) {
    j["machine"] = {{"bandwidth_gb_per_s", r.machine->bytes_per_second / 1e9},
                    {"gflop_per_s", o.gflops ? json(*o.gflops) : json(nullptr)}};
  }
  json list = json::array();
  for (const Row& row : rows) {
    list.push_back({{"name", row.name},
                    {"detail", row.detail},
                    {"own", row.own},
                    {"elements_per_token_per_layer", row.elements_per_token_per_layer},
                    {"elements_per_token", row.elements_per_token},
                    {"bytes_per_token", row.bytes_per_token},
                    {"total_bytes", row.total_bytes},
                    {"ratio_to_mha", row.ratio_to_mha},
                    {"gqa_equivalent_groups", row.groups},
                    {"per_device",
                     {{"elements_per_token_per_layer", row.device_elements_per_token_per_layer},
                      {"bytes_per_token", row.device_bytes_per_token},
                      {"total_bytes", row.device_total_bytes}}},
                    {"kv_projection_params", row.kv_params},
                    {"attention_params", row.attention_params}});
    if (row.decode_seconds) {
      list.back()["decode"] = {{"seconds_per_token", *row.decode_seconds},
                               {"bound", row.decode_memory_bound ? "memory" : "compute"},
                               {"bytes_per_token", row.decode_bytes},
                               {"flops_per_token", row.decode_flops}};
    }
  }
  j["mechanisms"] = list;
  if (budget) {
    auto opt = [](const std::optional<Index>& v) { return v ? json(*v) : json(nullptr); };
    j["budget"] = {
        {"amount", o.budget->amount},
        {"unit", o.budget->unit == an::BudgetUnit::elements ? "elements" : "bytes"},
        {"layers", r.layers},
        {"mla_kv_rank", opt(budget->kv_rank)},
        {"mla_kv_rank_step", o.rank_step},
        {"mla_kv_rank_bound",
         o.budget->unit == an::BudgetUnit::elements ? json(budget->kv_rank_bound) : json(nullptr)},
        {"lrkv_rank", opt(budget->lrkv_rank)},
        {"gqa_kv_heads", opt(budget->kv_heads)}};
  }
  return j;
}

}  // namespace

std::string to_json_text(const Options& o, const Resolved& r, const std::vector<Row>& rows,
                         const std::optional<BudgetResult>& budget) {
  // A file name is not always UTF-8 (the source of a config without _name_or_path);
  // replace invalid bytes with U+FFFD rather than throwing from dump().
  return to_json(o, r, rows, budget).dump(2, ' ', false, json::error_handler_t::replace) + "\n";
}

}  // namespace kvcalc
