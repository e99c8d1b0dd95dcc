#include "table.hpp"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <string>

#include "text.hpp"

namespace kvcalc {

void print_table(std::ostream& out, const Options& o, const Resolved& r,
                 const std::vector<Row>& rows, const std::optional<BudgetResult>& budget) {
  out << "KV cache of " << title_text(o, r) << "\n";
  std::string workload =
      "for batch " + with_commas(r.work.batch) + " x " + with_commas(r.work.seq_len) + " tokens";
  if (r.stack.window_layers > 0) {
    workload += "; " + with_commas(r.stack.window_layers) + " of " + with_commas(r.layers) +
                " layers keep a window of " + with_commas(r.stack.window) + " tokens";
    if (r.stack.sink_tokens > 0)
      workload += " + " + with_commas(r.stack.sink_tokens) + " sink tokens";
    if (r.stack.max_rollback > 0)
      workload += " + " + with_commas(r.stack.max_rollback) + " for rollback";
  }
  if (r.work.page_tokens > 0)
    workload += "; pages of " + with_commas(r.work.page_tokens) + " tokens";
  out << "Totals " << workload << "\n";
  for (const std::string& note : o.shape.notes) out << "Note: " << note << "\n";
  out << "\n";

  std::vector<std::vector<std::string>> cells;
  std::vector<std::string> header = {"mechanism", "elem/token/layer", "elem/token", "bytes/token",
                                     "total",     "vs MHA",           "GQA groups"};
  if (r.tp > 1) {
    header[1] = "elem/tok/layer (all devices)";
    header.push_back("per device/token");
    header.push_back("per device total");
  }
  if (r.machine) {
    header.push_back("decode/token");
    header.push_back("bound");
  }
  cells.push_back(header);
  for (const Row& row : rows) {
    std::vector<std::string> line = {row.name + (row.own ? "*" : "") + " (" + row.detail + ")",
                                     with_commas(row.elements_per_token_per_layer),
                                     with_commas(row.elements_per_token),
                                     human_bytes(row.bytes_per_token),
                                     human_bytes(row.total_bytes),
                                     fixed(100.0 * row.ratio_to_mha, 2) + "%",
                                     fixed(row.groups, 2)};
    if (r.tp > 1) {
      line.push_back(human_bytes(row.device_bytes_per_token));
      line.push_back(human_bytes(row.device_total_bytes));
    }
    if (row.decode_seconds) {
      line.push_back(human_seconds(*row.decode_seconds));
      line.push_back(row.decode_memory_bound ? "memory" : "compute");
    }
    cells.push_back(line);
  }
  std::vector<std::size_t> width(header.size(), 0);
  for (const auto& line : cells) {
    for (std::size_t c = 0; c < line.size(); ++c) width[c] = std::max(width[c], line[c].size());
  }
  for (std::size_t i = 0; i < cells.size(); ++i) {
    for (std::size_t c = 0; c < cells[i].size(); ++c) {
      if (c == 0) {
        out << std::left << std::setw(static_cast<int>(width[c])) << cells[i][c];
      } else {
        out << "  " << std::right << std::setw(static_cast<int>(width[c])) << cells[i][c];
      }
    }
    out << "\n";
    if (i == 0) {
      std::size_t total = 0;
      for (std::size_t w : width) total += w + 2;
      out << std::string(total - 2, '-') << "\n";
    }
  }
  for (const Row& row : rows) {
    if (row.own) {
      out << "* the model's own mechanism\n";
      break;
    }
  }
  if (r.machine) {
    out << "decode/token: one sequence's attention step in every layer at "
        << fixed(r.machine->bytes_per_second / 1e9, 1) << " GB/s";
    if (o.gflops) out << " and " << fixed(*o.gflops, 1) << " GFLOP/s";
    out << " (max of bytes / bandwidth and FLOPs / rate, per layer; analysis/decode_cost.hpp)\n";
  }

  // Log-scale bars of bytes per token: equal lengths are equal ratios.
  std::vector<double> values;
  for (const Row& row : rows) values.push_back(static_cast<double>(row.bytes_per_token));
  const LogAxis axis(values);
  constexpr int kBar = 48;
  out << "\nBytes per token (log scale, " << power_label(static_cast<int>(axis.lo)) << " to "
      << power_label(static_cast<int>(axis.hi)) << " bytes):\n";
  for (const Row& row : rows) {
    const int n = std::max(1, static_cast<int>(std::lround(
                                  kBar * axis.fraction(static_cast<double>(row.bytes_per_token)))));
    out << std::left << std::setw(5) << row.name << " |"
        << std::string(static_cast<std::size_t>(n), '#')
        << std::string(static_cast<std::size_t>(kBar - n), ' ') << "| "
        << human_bytes(row.bytes_per_token) << "\n";
  }

  if (budget) {
    const an::Budget& b = *o.budget;
    const std::string amount = b.unit == an::BudgetUnit::elements
                                   ? with_commas(b.amount) + " elements"
                                   : human_bytes(b.amount) + " (" + with_commas(b.amount) + " B)";
    out << "\nBudget " << amount << " per token over " << r.layers << " layers:\n";
    auto show = [](const std::optional<Index>& v) {
      return v ? with_commas(*v) : std::string("none fits");
    };
    out << "  MLA   largest d_c in steps of " << o.rank_step << " (d_R " << r.rope_dim
        << "): " << show(budget->kv_rank);
    if (b.unit == an::BudgetUnit::elements) {
      out << "  (bound " << fixed(budget->kv_rank_bound, 1) << ")";
    }
    out << "\n  LRKV  largest rank r (d_h " << r.head_dim << "): " << show(budget->lrkv_rank)
        << "\n  GQA   largest n_kv dividing " << r.heads << ": " << show(budget->kv_heads) << "\n";
  }
}

}  // namespace kvcalc
