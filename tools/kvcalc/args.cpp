#include "args.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <iomanip>
#include <map>
#include <sstream>
#include <utility>

#include "model.hpp"
#include "presets.hpp"
#include "text.hpp"

namespace kvcalc {
namespace {

/// A whole number >= min_value; names the flag and shows a correct value on error.
Index parse_count(const std::string& flag, const std::string& text, Index min_value) {
  const std::string example = flag + " " + std::to_string(std::max<Index>(min_value, 1) * 64);
  if (text.empty()) fail(flag + " needs a value, e.g. " + example);
  if (text[0] == '-' && text.size() > 1 && std::isdigit(static_cast<unsigned char>(text[1]))) {
    fail(flag + " must not be negative, got '" + text + "' (e.g. " + example + ")");
  }
  for (const char ch : text) {
    if (!std::isdigit(static_cast<unsigned char>(ch))) {
      fail(flag + " must be a whole number, got '" + text + "' (e.g. " + example + ")");
    }
  }
  errno = 0;
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text.c_str(), &end, 10);
  if (errno == ERANGE || value > static_cast<unsigned long long>(kMaxCount)) {
    fail(flag + " " + text + " is too large to represent (at most " + with_commas(kMaxCount) + ")");
  }
  const auto result = static_cast<Index>(value);
  if (result < min_value) {
    fail(flag + " must be >= " + std::to_string(min_value) + ", got " + text + " (e.g. " + example +
         ")");
  }
  return result;
}

/// A rate > 0 (a plain decimal number, e.g. 20 or 12.5); names the flag on error.
double parse_rate(const std::string& flag, const std::string& text, const char* unit) {
  const std::string example = flag + (std::string(unit) == "GB/s" ? " 20" : " 500");
  bool digits = false, dot = false, ok = !text.empty();
  for (const char ch : text) {
    if (std::isdigit(static_cast<unsigned char>(ch))) {
      digits = true;
    } else if (ch == '.' && !dot) {
      dot = true;
    } else {
      ok = false;
    }
  }
  if (!ok || !digits) {
    fail(flag + " must be a positive number of " + unit + ", got '" + text + "' (e.g. " + example +
         ")");
  }
  const double value = std::strtod(text.c_str(), nullptr);
  if (!(value > 0.0) || !std::isfinite(value) || value > 1e12) {
    fail(flag + " must be > 0 and at most 1e12 " + unit + ", got '" + text + "' (e.g. " + example +
         ")");
  }
  return value;
}

an::Dtype parse_dtype_flag(const std::string& flag, const std::string& text) {
  if (const auto d = an::parse_dtype(text)) return *d;
  fail(flag + " '" + text +
       "' is not a known type; use one of fp32, bf16, fp16, fp8 (= fp8_e4m3), fp8_e5m2, int8, "
       "fp64 (or float32, bfloat16, float16)");
}

/// "50000" (elements), "69120B", "64KiB", "3.5MiB", "1GiB" (bytes).
an::Budget parse_budget(const std::string& text) {
  const std::string hint =
      " (e.g. --budget 50000 for elements per token, or 64KiB / 3.75MiB / 69120B for bytes)";
  std::size_t digits_end = 0;
  while (digits_end < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[digits_end])) || text[digits_end] == '.')) {
    ++digits_end;
  }
  const std::string number = text.substr(0, digits_end);
  const std::string suffix = text.substr(digits_end);
  if (!text.empty() && text[0] == '-')
    fail("--budget must not be negative, got '" + text + "'" + hint);
  if (number.empty() || std::count(number.begin(), number.end(), '.') > 1 || number == ".") {
    fail("--budget must be a number with an optional unit, got '" + text + "'" + hint);
  }
  double scale = 1.0;
  an::BudgetUnit unit = an::BudgetUnit::bytes;
  if (suffix.empty()) {
    unit = an::BudgetUnit::elements;
  } else if (suffix == "B") {
    scale = 1.0;
  } else if (suffix == "KiB") {
    scale = 1024.0;
  } else if (suffix == "MiB") {
    scale = 1024.0 * 1024.0;
  } else if (suffix == "GiB") {
    scale = 1024.0 * 1024.0 * 1024.0;
  } else {
    fail("--budget unit '" + suffix + "' is not one of B, KiB, MiB, GiB" + hint);
  }
  const double value = std::strtod(number.c_str(), nullptr) * scale;
  if (unit == an::BudgetUnit::elements && number.find('.') != std::string::npos) {
    fail("--budget in elements must be a whole number, got '" + text + "'" + hint);
  }
  if (!(value < static_cast<double>(kMaxCount))) {
    fail("--budget " + text + " is too large to represent" + hint);
  }
  const auto amount = static_cast<Index>(std::floor(value));
  if (amount < 1) fail("--budget must be at least 1 element or 1 byte, got '" + text + "'" + hint);
  return {amount, unit};
}

/// "mqa,LRKV" -> {"MQA", "LRKV"}, each once.
std::vector<std::string> parse_mechanisms(const std::string& text) {
  std::vector<std::string> mechanisms;
  std::stringstream list(text);
  std::string item;
  while (std::getline(list, item, ',')) {
    if (item.empty()) continue;
    std::string upper;
    for (const char ch : item)
      upper += static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    const auto& names = all_mechanisms();
    if (std::find(names.begin(), names.end(), upper) == names.end()) {
      fail("--mechanism '" + item + "' is unknown; use a comma list of MHA, GQA, MQA, MLA, LRKV");
    }
    if (std::find(mechanisms.begin(), mechanisms.end(), upper) == mechanisms.end()) {
      mechanisms.push_back(upper);
    }
  }
  if (mechanisms.empty()) {
    fail("--mechanism needs at least one of MHA, GQA, MQA, MLA, LRKV (e.g. --mechanism MLA,GQA)");
  }
  return mechanisms;
}

using Args = std::vector<std::pair<std::string, std::optional<std::string>>>;

/// Splits the arguments into (flag, value) pairs; every flag known, none twice.
Args split_flags(const std::vector<std::string>& argv) {
  static const std::vector<std::string> valued = {
      "--heads",     "--head-dim",      "--layers",      "--d-model",     "--kv-heads",
      "--kv-rank",   "--q-rank",        "--rope-dim",    "--v-dim",       "--lrkv-rank",
      "--dtype",     "--seq-len",       "--batch",       "--tp",          "--mechanism",
      "--preset",    "--hf-config",     "--budget",      "--svg",         "--page-size",
      "--window",    "--window-layers", "--scale-block", "--rope-dtype",  "--rank-step",
      "--bandwidth", "--flops",         "--sink-tokens", "--max-rollback"};
  static const std::vector<std::string> switches = {"--json", "--list-presets", "--help", "-h"};
  Args args;
  for (std::size_t i = 0; i < argv.size(); ++i) {
    std::string arg = argv[i];
    std::optional<std::string> value;
    if (const auto eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    if (std::find(switches.begin(), switches.end(), arg) != switches.end()) {
      if (value) fail(arg + " takes no value");
      args.emplace_back(arg, std::nullopt);
    } else if (std::find(valued.begin(), valued.end(), arg) != valued.end()) {
      if (!value) {
        if (i + 1 >= argv.size()) fail(arg + " needs a value (see --help)");
        value = argv[++i];
      }
      args.emplace_back(arg, value);
    } else if (arg.rfind("-", 0) == 0) {
      fail("unknown option '" + arg + "' (see --help for the options)");
    } else {
      fail("unexpected argument '" + arg + "'; options start with -- (see --help)");
    }
  }
  std::map<std::string, int> seen;
  for (const auto& [flag, value] : args) {
    if (++seen[flag] > 1) fail(flag + " is given twice");
  }
  return args;
}

bool has(const Args& args, const char* flag) {
  return std::any_of(args.begin(), args.end(), [&](const auto& a) { return a.first == flag; });
}

/// One flag's value into the options (the model source is already applied).
void apply(const std::string& flag, const std::string& v, Options& o) {
  Shape& s = o.shape;
  if (flag == "--heads") s.heads = parse_count(flag, v, 1);
  if (flag == "--head-dim") s.head_dim = parse_count(flag, v, 1);
  if (flag == "--layers") s.layers = parse_count(flag, v, 1);
  if (flag == "--d-model") s.d_model = parse_count(flag, v, 1);
  if (flag == "--kv-heads") s.kv_heads = parse_count(flag, v, 1);
  if (flag == "--kv-rank") s.kv_rank = parse_count(flag, v, 1);
  if (flag == "--q-rank") s.q_rank = parse_count(flag, v, 0);
  if (flag == "--rope-dim") s.rope_dim = parse_count(flag, v, 0);
  if (flag == "--v-dim") s.v_dim = parse_count(flag, v, 1);
  if (flag == "--lrkv-rank") s.lrkv_rank = parse_count(flag, v, 0);
  if (flag == "--window") s.window = parse_count(flag, v, 1);
  if (flag == "--window-layers") s.window_layers = parse_count(flag, v, 0);
  if (flag == "--sink-tokens") s.sink_tokens = parse_count(flag, v, 0);
  if (flag == "--max-rollback") s.max_rollback = parse_count(flag, v, 0);
  if (flag == "--dtype") s.dtype = parse_dtype_flag(flag, v);
  if (flag == "--rope-dtype") o.rope_dtype = parse_dtype_flag(flag, v);
  if (flag == "--seq-len") o.seq_len = parse_count(flag, v, 1);
  if (flag == "--batch") o.batch = parse_count(flag, v, 1);
  if (flag == "--tp") o.tp = parse_count(flag, v, 1);
  if (flag == "--page-size") o.page_size = parse_count(flag, v, 0);
  if (flag == "--scale-block") o.scale_block = parse_count(flag, v, 1);
  if (flag == "--rank-step") o.rank_step = parse_count(flag, v, 1);
  if (flag == "--json") o.json = true;
  if (flag == "--bandwidth") o.bandwidth_gbs = parse_rate(flag, v, "GB/s");
  if (flag == "--flops") o.gflops = parse_rate(flag, v, "GFLOP/s");
  if (flag == "--svg") {
    if (v.empty()) fail("--svg needs a file name, e.g. --svg cache.svg");
    o.svg_path = v;
  }
  if (flag == "--budget") {
    o.budget = parse_budget(v);
    o.budget_text = v;
  }
  if (flag == "--mechanism") o.mechanisms = parse_mechanisms(v);
}

}  // namespace

void print_usage(std::ostream& out) {
  out << R"(kvcalc: KV-cache size of MHA, GQA, MQA, MLA and LRKV for one model shape.

Usage: kvcalc [--preset NAME | --hf-config FILE] [options]

Model shape (defaults: DeepSeek-V2; a preset or config.json sets them, flags override):
  --heads N          H, query heads                           (128)
  --head-dim N       d_h, head width (MLA: d_nope)           (128)
  --layers N         l, attention layers                     (60)
  --d-model N        d, hidden size, for parameter counts    (H * d_h)
  --kv-heads N       GQA's KV heads n_kv, divides H          (8, or a divisor <= H/2)
  --kv-rank N        MLA's latent width d_c                  (4 * d_h)
  --q-rank N         MLA's query latent d_c' (0: none)       (0)
  --rope-dim N       MLA's decoupled rope width d_R          (d_h / 2)
  --v-dim N          MLA's value head width d_v              (d_h)
  --lrkv-rank N      LRKV's residual rank r, <= d_h          (d_h / 2)
Serving:
  --dtype NAME       fp32, bf16, fp16, fp8 (e4m3), fp8_e5m2, int8, fp64   (bf16)
  --scale-block N    block-quantized cache: one fp32 scale per N elements of a row,
                     rope parts kept in --rope-dtype (bf16)
  --rope-dtype NAME  storage of MLA's rope key
  --seq-len N        tokens per sequence                     (4096)
  --batch N          sequences held at once                  (1)
  --page-size N      tokens per page of a paged cache (0: exact)
  --window N         sliding window W: such layers keep at most W tokens
  --window-layers N  how many layers use the window          (all, with --window)
  --sink-tokens N    window layers also keep their first N tokens (StreamingLLM) (0)
  --max-rollback N   window layers also keep N tokens past the window, so a
                     rollback (speculative decoding) of up to N tokens is exact (0)
  --tp N             tensor-parallel degree; totals are per device and summed
  --bandwidth GB/S   predict a decode step per token (one sequence, every layer's
                     attention over the tokens it keeps) at this read bandwidth ...
  --flops GFLOP/S    ... and this arithmetic rate: max(bytes / bandwidth, FLOPs /
                     rate) per layer (without --flops, bytes / bandwidth)
Input and output:
  --preset NAME      a known model (--list-presets)
  --hf-config FILE   a Hugging Face config.json (Llama/Mistral/Qwen/Gemma, DeepSeek-V2/V3)
  --mechanism LIST   only these rows: MHA,GQA,MQA,MLA,LRKV
  --budget N         solve backwards: N elements per token (all layers), or bytes
                     with a unit: 69120B, 64KiB, 3.75MiB, 1GiB
  --rank-step N      MLA d_c granularity for --budget        (32)
  --json             print one JSON object instead of the table
  --svg FILE         also write the bar chart as an SVG picture
  --list-presets, --help
)";
}

std::optional<Options> parse_args(const std::vector<std::string>& argv, std::ostream& out,
                                  const ConfigReader& read_config) {
  const Args args = split_flags(argv);
  if (has(args, "--help") || has(args, "-h")) {
    print_usage(out);
    return std::nullopt;
  }
  if (has(args, "--list-presets")) {
    for (const Preset& p : presets()) {
      out << std::left << std::setw(18) << p.name << p.description << "\n";
    }
    return std::nullopt;
  }

  Options o;
  if (has(args, "--preset") && has(args, "--hf-config")) {
    fail("--preset and --hf-config both describe the model; give one of them");
  }
  o.shape = default_shape();
  // The model first, so that the other flags override it whatever their order.
  for (const auto& [flag, value] : args) {
    if (flag == "--preset") o.shape = preset_shape(*value);
    if (flag == "--hf-config") o.shape = read_config(*value);
  }
  for (const auto& [flag, value] : args) apply(flag, value ? *value : std::string(), o);
  return o;
}

}  // namespace kvcalc
