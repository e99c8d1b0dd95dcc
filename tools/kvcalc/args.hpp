// kvcalc's command line: flags to Options, --help and --list-presets.
#pragma once

#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "options.hpp"

namespace kvcalc {

/// Reads the model shape of --hf-config FILE (kvcalc.cpp gives the real reader; a fuzz
/// target gives one that never touches the file system).
using ConfigReader = std::function<Shape(const std::string& path)>;

/// Parses the arguments (without the program name) into Options. Flags take
/// "--flag value" or "--flag=value". Writes --help or --list-presets to `out` and
/// returns nullopt for them. Throws InputError on bad input.
std::optional<Options> parse_args(const std::vector<std::string>& args, std::ostream& out,
                                  const ConfigReader& read_config);

void print_usage(std::ostream& out);

}  // namespace kvcalc
