// kvcalc as a function: everything main() does, without exiting the process and with
// its file access replaceable, so that tests and the fuzz target
// (tests/fuzz/fuzz_kvcalc_args.cpp) can call it.
#pragma once

#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "kvattn/analysis/hf_config.hpp"
#include "options.hpp"

namespace kvcalc {

/// Where kvcalc's output goes and how it touches files.
struct Io {
  std::ostream* out = nullptr;  // the table or --json, --help, --list-presets
  std::ostream* err = nullptr;  // the one error line
  /// Reads --hf-config FILE; messages start with options.label.
  std::function<an::HfModel(const std::string& path, const an::HfReadOptions& options)> read_config;
  /// Writes --svg FILE; throws InputError when it cannot.
  std::function<void(const std::string& path, const std::string& content)> write_file;
};

/// std::cout, std::cerr, the real file system.
Io system_io();

/// The model shape of a parsed config.json: the model's own mechanism, its dimensions,
/// sliding windows, dtype and notes.
Shape shape_of(const an::HfModel& model);

/// Runs kvcalc with `args` (without the program name). Returns the exit status: 0, or
/// 2 after writing one line "kvcalc: error: ..." to io.err (and nothing to io.out).
int run(const std::vector<std::string>& args, const Io& io);

}  // namespace kvcalc
