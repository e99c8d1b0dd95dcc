// kvcalc --json: one object with the shape, storage, workload and a row per mechanism.
// The field names are kvcalc's interface (docs/cache-size.md); keep them stable.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "model.hpp"

namespace kvcalc {

/// The object, indented by 2, with a final newline.
std::string to_json_text(const Options& o, const Resolved& r, const std::vector<Row>& rows,
                         const std::optional<BudgetResult>& budget);

}  // namespace kvcalc
