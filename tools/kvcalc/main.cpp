// kvcalc: the KV-cache calculator of seed 002, Chapter 4, as a command-line tool.
//
//   kvcalc                                  DeepSeek-V2's shape, every mechanism
//   kvcalc --preset lrkv-2.5b --seq-len 8192 --batch 4
//   kvcalc --hf-config path/to/config.json --tp 8 --dtype fp8 --scale-block 128
//   kvcalc --budget 50000                   the largest d_c / r / n_kv that fit
//   kvcalc --json | --svg chart.svg         machine-readable output, a picture
//
// Every number comes from kvattn's analysis module (include/kvattn/analysis/), a
// config.json is read by analysis/hf_config.hpp; the formulas and the tensor-parallel
// rules are in docs/cache-size.md. Bad input prints one line "kvcalc: error: ..."
// naming the problem and exits with status 2; nothing is printed before all numbers
// are computed, so there is never a partial table.
//
// The pieces: args (command line), presets, model (the numbers), table, json_output,
// svg, kvcalc (run(), callable without exiting: tests and fuzzing use it).
#include <string>
#include <vector>

#include "kvcalc.hpp"

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  return kvcalc::run(args, kvcalc::system_io());
}
