// libFuzzer target: kvcalc's command line, through kvcalc::run() (tools/kvcalc/).
//
// Input: the arguments, separated by NUL bytes ("--preset\0deepseek-v2\0--json"). No
// file is touched: --hf-config X parses the text X itself as the config.json, and
// --svg X keeps the picture in memory.
//
// Checked for every input, beyond "no crash, no sanitizer report":
// - the status is 0 or 2; with 2, nothing on stdout and exactly one line on stderr,
//   "kvcalc: error: ...", never nlohmann's raw text; with 0, nothing on stderr;
// - --json output parses as JSON; an SVG is a whole document.
// Seed corpus and regression inputs: tests/fuzz/kvcalc_args/.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvcalc.hpp"

namespace {

[[noreturn]] void violated(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_kvcalc_args: %s: %s\n", what, detail.c_str());
  std::abort();
}

std::vector<std::string> split_args(const std::uint8_t* data, std::size_t size) {
  std::vector<std::string> args;
  std::string current;
  for (std::size_t i = 0; i < size; ++i) {
    if (data[i] == 0) {
      args.push_back(current);
      current.clear();
    } else {
      current += static_cast<char>(data[i]);
    }
  }
  if (!current.empty()) args.push_back(current);
  return args;
}

bool has(const std::vector<std::string>& args, const std::string& flag) {
  for (const std::string& a : args) {
    if (a == flag || a.rfind(flag + "=", 0) == 0) return true;
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::vector<std::string> args = split_args(data, size);
  std::ostringstream out, err;
  std::string svg;
  kvcalc::Io io;
  io.out = &out;
  io.err = &err;
  io.read_config = [](const std::string& text, const kvattn::analysis::HfReadOptions& options) {
    return kvattn::analysis::parse_hf_config(text, options);
  };
  io.write_file = [&svg](const std::string& /*path*/, const std::string& content) {
    svg = content;
  };

  const int status = kvcalc::run(args, io);
  const std::string o = out.str(), e = err.str();
  if (status == 2) {
    if (!o.empty()) violated("output before an error", o);
    if (e.rfind("kvcalc: error: ", 0) != 0) violated("error line", e);
    if (e.find('\n') != e.size() - 1) violated("error is not one line", e);
    // nlohmann's own text, unless the input holds it (messages quote fields and tokens).
    const std::string input(reinterpret_cast<const char*>(data), size);
    if (e.find("[json.exception") != std::string::npos &&
        input.find("[json.exception") == std::string::npos) {
      violated("raw nlohmann message", e);
    }
    return 0;
  }
  if (status != 0) violated("status", std::to_string(status));
  if (!e.empty()) violated("stderr on success", e);
  if (o.empty()) violated("no output", "");
  const bool info = has(args, "--help") || has(args, "-h") || has(args, "--list-presets");
  if (!info && has(args, "--json") && !nlohmann::json::accept(o)) violated("--json output", o);
  if (!svg.empty() &&
      (svg.rfind("<?xml", 0) != 0 || svg.size() < 7 || svg.substr(svg.size() - 7) != "</svg>\n")) {
    violated("SVG document", svg);
  }
  return 0;
}
