// kvcalc's default output: a table per mechanism and log-scale bars of bytes per token.
#pragma once

#include <optional>
#include <ostream>
#include <vector>

#include "model.hpp"

namespace kvcalc {

void print_table(std::ostream& out, const Options& o, const Resolved& r,
                 const std::vector<Row>& rows, const std::optional<BudgetResult>& budget);

}  // namespace kvcalc
