// kvcalc's presets: known model shapes, built from kvattn's config factories.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "options.hpp"

namespace kvcalc {

struct Preset {
  std::string name;
  std::string description;  // one line of --list-presets
  std::function<Shape()> make;
};

/// Every preset, in --list-presets order.
const std::vector<Preset>& presets();

/// The named preset's shape; InputError naming the known ones otherwise.
Shape preset_shape(const std::string& name);

/// The shape without --preset or --hf-config: DeepSeek-V2's, as seed 002's widget
/// starts, with no mechanism marked as the model's own.
Shape default_shape();

}  // namespace kvcalc
