// kvcalc: the KV-cache calculator of seed 002, Chapter 4, as a command-line tool.
//
//   kvcalc                                  DeepSeek-V2's shape, every mechanism
//   kvcalc --preset lrkv-2.5b --seq-len 8192 --batch 4
//   kvcalc --hf-config path/to/config.json --tp 8 --dtype fp8 --scale-block 128
//   kvcalc --budget 50000                   the largest d_c / r / n_kv that fit
//   kvcalc --json | --svg chart.svg         machine-readable output, a picture
//
// Every number comes from kvattn's analysis module (include/kvattn/analysis/); the
// formulas and the tensor-parallel rules are in docs/cache-size.md. Bad input prints
// one line "kvcalc: error: ..." naming the problem and exits with status 2; nothing
// is printed before all numbers are computed, so there is never a partial table.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvattn/analysis/budget.hpp"
#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/analysis/dtype.hpp"
#include "kvattn/analysis/params.hpp"

namespace {

using kvattn::Index;
namespace an = kvattn::analysis;
using json = nlohmann::ordered_json;

/// Bad input: main prints "kvcalc: error: <what>" and exits with status 2.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void fail(const std::string& message) { throw InputError(message); }

std::string with_commas(Index value) {
  std::string digits = std::to_string(value < 0 ? -value : value);
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return value < 0 ? "-" + out : out;
}

std::string fixed(double value, int decimals) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(decimals) << value;
  return s.str();
}

/// Bytes in binary units with three significant digits: "656 B", "67.5 KiB", "3.75 MiB".
std::string human_bytes(Index bytes) {
  static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 6) {
    value /= 1024.0;
    ++unit;
  }
  if (unit == 0) return std::to_string(bytes) + " B";
  const int decimals = value < 10.0 ? 2 : value < 100.0 ? 1 : 0;
  std::string text = fixed(value, decimals);
  // 3.750 -> 3.75, 67.50 -> 67.5, 2.00 -> 2
  if (text.find('.') != std::string::npos) {
    while (text.back() == '0') text.pop_back();
    if (text.back() == '.') text.pop_back();
  }
  return text + " " + units[unit];
}

// ---- Command line ------------------------------------------------------------------

/// Every knob, as given on the command line or by a preset / config.json. Unset
/// optionals take the defaults in resolve().
struct Shape {
  std::optional<Index> heads, head_dim, layers, d_model, kv_heads, kv_rank, q_rank, rope_dim, v_dim,
      lrkv_rank, window, window_layers;
  std::optional<an::Dtype> dtype;
  std::string own;                 // the model's own mechanism ("" for a bare shape)
  std::string source = "flags";    // what the shape came from, for titles
  std::vector<std::string> notes;  // facts worth printing (e.g. an ignored sliding window)
};

struct Options {
  Shape shape;
  Index seq_len = 4096;
  Index batch = 1;
  Index tp = 1;
  Index page_size = 0;
  Index scale_block = 0;
  Index rank_step = 32;
  std::optional<an::Dtype> rope_dtype;
  std::vector<std::string> mechanisms;  // empty: all
  std::optional<an::Budget> budget;
  std::string budget_text;
  bool json = false;
  std::optional<std::string> svg_path;
};

constexpr Index kMaxCount = Index{1} << 53;  // keeps every product check meaningful

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

// ---- Presets -----------------------------------------------------------------------

struct Preset {
  const char* name;
  const char* description;
  std::function<Shape()> make;
};

Shape deepseek_v2() {
  Shape s;
  s.heads = 128;
  s.head_dim = 128;
  s.layers = 60;
  s.d_model = 5120;
  s.kv_heads = 8;  // the GQA of the paper's ablation
  s.kv_rank = 512;
  s.q_rank = 1536;
  s.rope_dim = 64;
  s.v_dim = 128;
  s.own = "MLA";
  s.source = "DeepSeek-V2";
  return s;
}

Shape deepseek_v2_lite() {
  Shape s = deepseek_v2();
  s.heads = 16;
  s.layers = 27;
  s.d_model = 2048;
  s.q_rank = 0;
  s.source = "DeepSeek-V2-Lite";
  return s;
}

/// The LRKV paper's scales (seed 000, Table 7): d_h 128, d = 128 H, rank r. The MLA row
/// uses d_c 384 and no rope channel, as the paper's Table 8 baseline counts it.
Shape lrkv_scale(const char* label, Index heads, Index rank, Index layers) {
  Shape s;
  s.heads = heads;
  s.head_dim = 128;
  s.d_model = heads * 128;
  s.layers = layers;
  s.lrkv_rank = rank;
  s.kv_rank = 384;
  s.rope_dim = 0;
  s.own = "LRKV";
  s.source = std::string("LRKV paper ") + label;
  return s;
}

const std::vector<Preset>& presets() {
  static const std::vector<Preset> list = {
      {"deepseek-v2", "DeepSeek-V2 (236B): 60 layers, 128 heads x 128, d_c 512, d_R 64, d 5120",
       deepseek_v2},
      {"deepseek-v2-lite", "DeepSeek-V2-Lite (16B): 27 layers, 16 heads x 128, d_c 512, d_R 64",
       deepseek_v2_lite},
      {"lrkv-128m", "LRKV paper 128M: 6 heads x 128, r 46, 12 layers (Table 12)",
       [] { return lrkv_scale("128M", 6, 46, 12); }},
      {"lrkv-1.2b", "LRKV paper 1.2B: 12 heads x 128, r 51, 36 layers (estimated)",
       [] { return lrkv_scale("1.2B", 12, 51, 36); }},
      {"lrkv-2.5b", "LRKV paper 2.5B: 18 heads x 128, r 55, 36 layers (Table 12)",
       [] { return lrkv_scale("2.5B", 18, 55, 36); }},
      {"lrkv-6.3b", "LRKV paper 6.3B: 32 heads x 128, r 54, 36 layers (Table 12)",
       [] { return lrkv_scale("6.3B", 32, 54, 36); }},
  };
  return list;
}

Shape preset_shape(const std::string& name) {
  for (const Preset& p : presets()) {
    if (name == p.name) return p.make();
  }
  std::string names;
  for (const Preset& p : presets()) names += std::string(names.empty() ? "" : ", ") + p.name;
  fail("--preset '" + name + "' is unknown; use one of " + names + " (see --list-presets)");
}

// ---- Hugging Face config.json ------------------------------------------------------

std::string json_type(const json& value) {
  if (value.is_null()) return "null";
  if (value.is_boolean()) return "a boolean";
  if (value.is_number_float()) return "the number " + value.dump();
  if (value.is_number()) return "the number " + value.dump();
  if (value.is_string()) return "the string " + value.dump();
  if (value.is_array()) return "an array";
  return "an object";
}

/// A positive integer field; nullopt when absent or null (unless required).
std::optional<Index> hf_count(const json& j, const std::string& where, const char* key,
                              bool required, Index min_value = 1) {
  if (!j.contains(key) || j.at(key).is_null()) {
    if (required) {
      fail(where + " has no \"" + key + "\" (a Hugging Face config.json needs it, e.g. \"" + key +
           "\": 32)");
    }
    return std::nullopt;
  }
  const json& v = j.at(key);
  if (v.is_number_float() && std::fabs(v.get<double>()) >= static_cast<double>(kMaxCount)) {
    fail(where + ": \"" + key + "\" " + v.dump() + " is too large to represent");
  }
  if (!v.is_number_integer()) {
    fail(where + ": \"" + key + "\" must be an integer, got " + json_type(v) + " (e.g. \"" + key +
         "\": 32)");
  }
  if (v.is_number_unsigned() ? v.get<std::uint64_t>() > static_cast<std::uint64_t>(kMaxCount)
                             : v.get<std::int64_t>() > kMaxCount) {
    fail(where + ": \"" + key + "\" " + v.dump() + " is too large to represent");
  }
  const Index value = v.is_number_unsigned() ? static_cast<Index>(v.get<std::uint64_t>())
                                             : static_cast<Index>(v.get<std::int64_t>());
  if (value < min_value) {
    fail(where + ": \"" + key + "\" must be >= " + std::to_string(min_value) + ", got " + v.dump());
  }
  return value;
}

std::optional<bool> hf_bool(const json& j, const std::string& where, const char* key) {
  if (!j.contains(key) || j.at(key).is_null()) return std::nullopt;
  if (!j.at(key).is_boolean()) {
    fail(where + ": \"" + key + "\" must be true or false, got " + json_type(j.at(key)));
  }
  return j.at(key).get<bool>();
}

/// The config's own cache: MLA when kv_lora_rank is present (DeepSeek-V2/V3; their
/// num_key_value_heads equals the head count and is ignored), else the GQA family
/// from num_key_value_heads (absent: = num_attention_heads).
Shape shape_from_hf(const std::string& path) {
  const std::string where = "--hf-config '" + path + "'";
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) fail(where + ": no such file");
  if (std::filesystem::is_directory(path, ec)) {
    fail(where + " is a directory; give the config.json file inside it");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(where + " cannot be opened: " + std::strerror(errno));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) fail(where + " cannot be read: " + std::strerror(errno));
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) {
    fail(where + " is empty; expected a Hugging Face config.json object {...}");
  }
  json root;
  try {
    root = json::parse(text);
  } catch (const json::parse_error& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    fail(where + " is not valid JSON (truncated or malformed): " + what);
  }
  if (!root.is_object()) {
    fail(where + " must hold a JSON object {...}, got " + json_type(root));
  }
  // Multimodal configs (Gemma 3, LLaVA, ...) keep the language model in text_config.
  const json* model = &root;
  if (!root.contains("num_attention_heads") && root.contains("text_config") &&
      root.at("text_config").is_object()) {
    model = &root.at("text_config");
  }
  const json& j = *model;

  Shape s;
  // Name: _name_or_path when the file has one, else its model_type and file name.
  const std::string file = std::filesystem::path(path).filename().string();
  s.source = file;
  if (root.contains("_name_or_path") && root.at("_name_or_path").is_string() &&
      !root.at("_name_or_path").get<std::string>().empty()) {
    s.source = root.at("_name_or_path").get<std::string>();
  } else if (root.contains("model_type") && root.at("model_type").is_string()) {
    s.source = root.at("model_type").get<std::string>() + " (" + file + ")";
  }
  s.heads = hf_count(j, where, "num_attention_heads", true);
  s.layers = hf_count(j, where, "num_hidden_layers", true);
  s.d_model = hf_count(j, where, "hidden_size", true);

  const bool mla = j.contains("kv_lora_rank") && !j.at("kv_lora_rank").is_null();
  if (mla) {
    s.own = "MLA";
    s.kv_rank = hf_count(j, where, "kv_lora_rank", true);
    s.q_rank = hf_count(j, where, "q_lora_rank", false, 0).value_or(0);
    s.rope_dim = hf_count(j, where, "qk_rope_head_dim", true, 0);
    s.head_dim = hf_count(j, where, "qk_nope_head_dim", true);
    s.v_dim = hf_count(j, where, "v_head_dim", false).value_or(*s.head_dim);
    hf_count(j, where, "num_key_value_heads", false);  // type-checked, not used
    s.notes.push_back("MLA recognised by kv_lora_rank; num_key_value_heads is not used");
  } else {
    const Index heads = *s.heads;
    const Index kv = hf_count(j, where, "num_key_value_heads", false).value_or(heads);
    if (heads % kv != 0) {
      fail(where + ": num_key_value_heads (" + std::to_string(kv) +
           ") must divide num_attention_heads (" + std::to_string(heads) + ")");
    }
    s.own = kv == heads ? "MHA" : kv == 1 ? "MQA" : "GQA";
    if (s.own == "GQA") s.kv_heads = kv;  // MHA / MQA models compare with the default GQA
    if (const auto hd = hf_count(j, where, "head_dim", false)) {
      s.head_dim = *hd;
    } else {
      if (*s.d_model % heads != 0) {
        fail(where + ": no \"head_dim\" and hidden_size (" + std::to_string(*s.d_model) +
             ") is not divisible by num_attention_heads (" + std::to_string(heads) + ")");
      }
      s.head_dim = *s.d_model / heads;
    }
  }

  // Sliding windows, where the model uses them.
  const Index layers = *s.layers;
  const auto window = hf_count(j, where, "sliding_window", false);
  const auto use_window = hf_bool(j, where, "use_sliding_window");
  if (j.contains("layer_types") && !j.at("layer_types").is_null()) {
    const json& types = j.at("layer_types");
    if (!types.is_array() || static_cast<Index>(types.size()) != layers) {
      fail(where + ": \"layer_types\" must be an array of num_hidden_layers (" +
           std::to_string(layers) + ") strings");
    }
    Index sliding = 0;
    for (const json& t : types) {
      if (!t.is_string()) fail(where + ": \"layer_types\" entries must be strings");
      if (t.get<std::string>() == "sliding_attention") ++sliding;
    }
    if (sliding > 0) {
      if (!window) fail(where + ": layer_types has sliding_attention but no \"sliding_window\"");
      s.window = window;
      s.window_layers = sliding;
    }
  } else if (window && use_window == false) {
    s.notes.push_back("sliding_window " + with_commas(*window) +
                      " is not used (use_sliding_window is false)");
  } else if (window) {
    const std::string type = root.value("model_type", std::string());
    Index sliding = layers;
    if (use_window == true) {
      // Qwen2: layers from max_window_layers on use the window.
      const Index first = hf_count(j, where, "max_window_layers", false, 0).value_or(0);
      sliding = layers - std::min(first, layers);
    } else if (type == "gemma2" || j.value("model_type", std::string()) == "gemma2") {
      sliding = (layers + 1) / 2;  // even-indexed layers are local
    } else if (const auto pattern = hf_count(j, where, "sliding_window_pattern", false)) {
      sliding = layers - layers / *pattern;  // every pattern-th layer is global
    }
    if (sliding > 0) {
      s.window = window;
      s.window_layers = sliding;
    }
  }

  // The config's dtype ("torch_dtype"; newer files call it "dtype").
  for (const char* key : {"torch_dtype", "dtype"}) {
    const json* holder = root.contains(key) ? &root : j.contains(key) ? &j : nullptr;
    if (holder == nullptr || holder->at(key).is_null()) continue;
    const json& v = holder->at(key);
    if (!v.is_string()) fail(where + ": \"" + key + "\" must be a string, got " + json_type(v));
    const auto d = an::parse_dtype(v.get<std::string>());
    if (!d) {
      fail(where + ": \"" + key + "\" " + v.dump() +
           " is not a type kvcalc knows (float32, bfloat16, float16, float8_e4m3fn, ...)");
    }
    s.dtype = d;
    break;
  }
  return s;
}

// ---- The numbers -------------------------------------------------------------------

struct Resolved {
  Index heads, head_dim, layers, d_model, kv_heads, kv_rank, q_rank, rope_dim, v_dim, lrkv_rank;
  an::LayerStack stack;
  an::Workload work;
  an::CacheStorage storage;
  Index tp;
};

/// The largest divisor of H that is at most min(8, H / 2) (8 groups as in DeepSeek-V2's
/// ablation when H allows), or 1.
Index default_kv_heads(Index heads) {
  const Index cap = std::min<Index>(8, std::max<Index>(1, heads / 2));
  for (Index g = cap; g >= 1; --g) {
    if (heads % g == 0) return g;
  }
  return 1;
}

/// "1, 2, 3, 4, 6, 12": the divisors of n (the first and last few when there are many).
std::string divisors_text(Index n) {
  std::vector<Index> small, large;
  for (Index d = 1; d <= n / d; ++d) {
    if (n % d != 0) continue;
    small.push_back(d);
    if (d != n / d) large.push_back(n / d);
  }
  small.insert(small.end(), large.rbegin(), large.rend());
  std::string out;
  for (std::size_t i = 0; i < small.size(); ++i) {
    if (small.size() > 12 && i == 6) {
      out += ", ...";
      i = small.size() - 6;
    }
    out += (out.empty() ? "" : ", ") + std::to_string(small[i]);
  }
  return out;
}

Resolved resolve(const Options& o) {
  const Shape& s = o.shape;
  Resolved r{};
  r.heads = s.heads.value_or(128);
  r.head_dim = s.head_dim.value_or(128);
  r.layers = s.layers.value_or(60);
  r.d_model = s.d_model.value_or(r.heads * r.head_dim);
  r.kv_heads = s.kv_heads.value_or(default_kv_heads(r.heads));
  r.kv_rank = s.kv_rank.value_or(4 * r.head_dim);  // DeepSeek-V2: d_c = 4 d_h
  r.q_rank = s.q_rank.value_or(0);
  r.rope_dim = s.rope_dim.value_or(r.head_dim / 2);  // DeepSeek-V2: d_R = d_h / 2
  r.v_dim = s.v_dim.value_or(r.head_dim);
  r.lrkv_rank = s.lrkv_rank.value_or(r.head_dim / 2);
  if (r.heads % r.kv_heads != 0) {
    fail("--kv-heads " + std::to_string(r.kv_heads) + " must divide --heads " +
         std::to_string(r.heads) + " (one of " + divisors_text(r.heads) + ")");
  }
  if (r.lrkv_rank > r.head_dim) {
    fail("--lrkv-rank " + std::to_string(r.lrkv_rank) + " must be <= --head-dim " +
         std::to_string(r.head_dim) + " (a larger rank only adds cache)");
  }
  if (o.tp > 1 && r.heads % o.tp != 0) {
    fail("--tp " + std::to_string(o.tp) + " must divide --heads " + std::to_string(r.heads) +
         " (query heads are split across devices; one of " + divisors_text(r.heads) + ")");
  }
  const Index window = s.window.value_or(0);
  Index window_layers = s.window_layers.value_or(window > 0 ? r.layers : 0);
  if (window_layers > r.layers) {
    fail("--window-layers " + std::to_string(window_layers) + " must be <= --layers " +
         std::to_string(r.layers));
  }
  if (window_layers > 0 && window == 0) {
    fail("--window-layers " + std::to_string(window_layers) +
         " needs --window W, the tokens a sliding-window layer keeps (e.g. --window 4096)");
  }
  if (window == 0) window_layers = 0;
  r.stack = {r.layers, window_layers, window};
  r.work = {o.seq_len, o.batch, o.page_size};
  const an::Dtype dtype = s.dtype.value_or(an::Dtype::bf16);
  if (o.scale_block > 0) {
    r.storage =
        an::block_scaled_storage(dtype, o.scale_block, o.rope_dtype.value_or(an::Dtype::bf16));
  } else {
    r.storage = an::plain_storage(dtype);
    if (o.rope_dtype) r.storage.rope_dtype = *o.rope_dtype;
  }
  r.tp = o.tp;
  return r;
}

struct Row {
  std::string name;
  std::string detail;  // "n_kv 8", "d_c 512 + d_R 64", "r 64"
  bool own = false;
  an::CacheLayout layout;         // whole layer (tp 1)
  an::CacheLayout device_layout;  // one device
  Index elements_per_token_per_layer = 0;
  Index elements_per_token = 0;
  Index bytes_per_token = 0;  // summed over devices
  Index total_bytes = 0;      // summed over devices
  Index device_elements_per_token_per_layer = 0;
  Index device_bytes_per_token = 0;
  Index device_total_bytes = 0;
  double ratio_to_mha = 0.0;
  double groups = 0.0;
  Index kv_params = 0;
  Index attention_params = 0;
};

template <class Config>
Row make_row(const std::string& name, const std::string& detail, const Config& config,
             const Resolved& r) {
  Row row;
  row.name = name;
  row.detail = detail;
  row.layout = an::cache_layout(config);
  try {
    row.device_layout = an::cache_layout(config, r.tp);
  } catch (const kvattn::config_error& e) {
    fail(name + " cannot run at --tp " + std::to_string(r.tp) + ": " + e.what());
  }
  const Index t = r.tp;
  row.device_elements_per_token_per_layer = row.device_layout.elements();
  row.device_bytes_per_token = an::bytes_per_token(row.device_layout, r.storage, r.layers);
  row.device_total_bytes = an::total_bytes(row.device_layout, r.storage, r.stack, r.work);
  row.elements_per_token_per_layer =
      an::detail::mul(row.device_elements_per_token_per_layer, t, "elements over devices");
  row.elements_per_token = an::detail::mul(row.elements_per_token_per_layer, r.layers, "elements");
  row.bytes_per_token = an::detail::mul(row.device_bytes_per_token, t, "bytes over devices");
  row.total_bytes = an::detail::mul(row.device_total_bytes, t, "total bytes over devices");
  row.ratio_to_mha = an::ratio_to_mha(row.layout, r.storage, r.heads, r.head_dim);
  row.groups = an::gqa_equivalent_groups(row.layout, r.storage, r.head_dim);
  row.kv_params = an::kv_projection_params(config);
  row.attention_params = an::attention_params(config);
  return row;
}

kvattn::GqaConfig gqa_of(const Resolved& r, Index kv) {
  kvattn::GqaConfig c;
  c.d_model = r.d_model;
  c.n_heads = r.heads;
  c.head_dim = r.head_dim;
  c.n_kv_heads = kv;
  return c;
}

kvattn::MlaConfig mla_of(const Resolved& r) {
  kvattn::MlaConfig c;
  c.d_model = r.d_model;
  c.n_heads = r.heads;
  c.kv_rank = r.kv_rank;
  c.q_rank = r.q_rank;
  c.qk_nope_dim = r.head_dim;
  c.rope_dim = r.rope_dim;
  c.v_dim = r.v_dim;
  c.kv_norm = true;
  c.q_norm = r.q_rank > 0;
  return c;
}

kvattn::LrkvConfig lrkv_of(const Resolved& r) {
  kvattn::LrkvConfig c;
  c.d_model = r.d_model;
  c.n_heads = r.heads;
  c.head_dim = r.head_dim;
  c.rank = r.lrkv_rank;
  return c;
}

const std::vector<std::string>& all_mechanisms() {
  static const std::vector<std::string> names = {"MHA", "GQA", "MQA", "MLA", "LRKV"};
  return names;
}

std::vector<Row> compute_rows(const Options& o, const Resolved& r) {
  std::vector<std::string> wanted = o.mechanisms.empty() ? all_mechanisms() : o.mechanisms;
  // The model's own mechanism first, then the others in the usual order.
  if (!o.shape.own.empty()) {
    const auto it = std::find(wanted.begin(), wanted.end(), o.shape.own);
    if (it != wanted.end()) std::rotate(wanted.begin(), it, it + 1);
  }
  std::vector<Row> rows;
  for (const std::string& name : wanted) {
    Row row;
    if (name == "MHA") {
      row = make_row(name, "n_kv " + std::to_string(r.heads), gqa_of(r, r.heads), r);
    } else if (name == "GQA") {
      row = make_row(name, "n_kv " + std::to_string(r.kv_heads), gqa_of(r, r.kv_heads), r);
    } else if (name == "MQA") {
      row = make_row(name, "n_kv 1", gqa_of(r, 1), r);
    } else if (name == "MLA") {
      row = make_row(name,
                     "d_c " + std::to_string(r.kv_rank) + " + d_R " + std::to_string(r.rope_dim),
                     mla_of(r), r);
    } else {
      row = make_row(name, "r " + std::to_string(r.lrkv_rank), lrkv_of(r), r);
    }
    row.own = name == o.shape.own;
    rows.push_back(row);
  }
  return rows;
}

struct BudgetResult {
  std::optional<Index> kv_rank, lrkv_rank, kv_heads;
  double kv_rank_bound = 0.0;
};

BudgetResult solve_budget(const an::Budget& budget, const Options& o, const Resolved& r) {
  BudgetResult b;
  b.kv_rank = an::max_kv_rank(mla_of(r), r.layers, budget, r.storage, o.rank_step);
  b.lrkv_rank = an::max_lrkv_rank(lrkv_of(r), r.layers, budget, r.storage);
  b.kv_heads = an::max_kv_heads(gqa_of(r, r.heads), r.layers, budget, r.storage);
  b.kv_rank_bound = an::kv_rank_bound(r.rope_dim, r.layers, budget.amount);
  return b;
}

// ---- Output ------------------------------------------------------------------------

std::string storage_text(const an::CacheStorage& s) {
  std::string text(an::to_string(s.dtype));
  if (s.scale_block > 0) {
    text += " + one " + std::string(an::to_string(s.scale_dtype)) + " scale per " +
            std::to_string(s.scale_block) + " elements, rope in " +
            std::string(an::to_string(s.rope_dtype));
  } else if (s.rope_dtype != s.dtype) {
    text += ", rope in " + std::string(an::to_string(s.rope_dtype));
  }
  return text;
}

std::string title_text(const Options& o, const Resolved& r) {
  std::string t = o.shape.source + ": l " + std::to_string(r.layers) + ", H " +
                  std::to_string(r.heads) + ", d_h " + std::to_string(r.head_dim) + ", " +
                  storage_text(r.storage);
  if (r.tp > 1) t += ", tp " + std::to_string(r.tp);
  return t;
}

/// Decade-aligned log axis covering every value.
struct LogAxis {
  double lo, hi;
  explicit LogAxis(const std::vector<double>& values) {
    double mn = values.front(), mx = values.front();
    for (double v : values) {
      mn = std::min(mn, v);
      mx = std::max(mx, v);
    }
    lo = std::floor(std::log10(std::max(mn, 1.0)));
    hi = std::ceil(std::log10(std::max(mx, 1.0)));
    if (hi <= lo) hi = lo + 1;
  }
  double fraction(double v) const { return (std::log10(std::max(v, 1.0)) - lo) / (hi - lo); }
};

std::string power_label(int exponent) {
  static const char* const names[] = {"1",    "10", "100", "1k",   "10k", "100k", "1M",  "10M",
                                      "100M", "1G", "10G", "100G", "1T",  "10T",  "100T"};
  if (exponent >= 0 && exponent < 15) return names[exponent];
  return "1e" + std::to_string(exponent);
}

void print_table(std::ostream& out, const Options& o, const Resolved& r,
                 const std::vector<Row>& rows, const std::optional<BudgetResult>& budget) {
  out << "KV cache of " << title_text(o, r) << "\n";
  std::string workload =
      "for batch " + with_commas(r.work.batch) + " x " + with_commas(r.work.seq_len) + " tokens";
  if (r.stack.window_layers > 0) {
    workload += "; " + with_commas(r.stack.window_layers) + " of " + with_commas(r.layers) +
                " layers keep a window of " + with_commas(r.stack.window) + " tokens";
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
    auto show = [&out](const std::optional<Index>& v) {
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
  j["tp"] = r.tp;
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

std::string xml_escape(const std::string& text) {
  std::string out;
  for (const char ch : text) {
    switch (ch) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        // Control characters are not allowed in XML 1.0 text.
        if (static_cast<unsigned char>(ch) >= 0x20 || ch == '\t' || ch == '\n') out += ch;
    }
  }
  return out;
}

/// A horizontal bar chart of bytes per token on a decade-aligned log axis.
std::string to_svg(const Options& o, const Resolved& r, const std::vector<Row>& rows) {
  std::vector<double> values;
  for (const Row& row : rows) values.push_back(static_cast<double>(row.bytes_per_token));
  const LogAxis axis(values);
  const int left = 190, right = 230, top = 64, bar_h = 26, gap = 14, plot_w = 440;
  const int height = top + static_cast<int>(rows.size()) * (bar_h + gap) + 56;
  const int width = left + plot_w + right;
  static const char* const colors[] = {"#1a3956", "#2f6f8f", "#5a9bb8", "#006970", "#a14c22"};
  std::ostringstream svg;
  svg << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" viewBox=\"0 0 " << width << " " << height
      << "\" font-family=\"Helvetica, Arial, sans-serif\" font-size=\"13\">\n"
      << "  <title>" << xml_escape("KV cache per token: " + title_text(o, r)) << "</title>\n"
      << "  <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "  <text x=\"" << width / 2 << "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\" "
      << "font-weight=\"bold\">" << xml_escape("KV cache per token, " + o.shape.source)
      << "</text>\n"
      << "  <text x=\"" << width / 2 << "\" y=\"44\" text-anchor=\"middle\" fill=\"#555\">"
      << xml_escape(title_text(o, r).substr(o.shape.source.size() + 2) +
                    " (log scale: equal lengths are equal ratios)")
      << "</text>\n";
  const int plot_bottom = top + static_cast<int>(rows.size()) * (bar_h + gap);
  for (int e = static_cast<int>(axis.lo); e <= static_cast<int>(axis.hi); ++e) {
    const double x = left + plot_w * (e - axis.lo) / (axis.hi - axis.lo);
    svg << "  <line x1=\"" << fixed(x, 1) << "\" y1=\"" << top - 6 << "\" x2=\"" << fixed(x, 1)
        << "\" y2=\"" << plot_bottom << "\" stroke=\"#ccc\"/>\n"
        << "  <text x=\"" << fixed(x, 1) << "\" y=\"" << plot_bottom + 18
        << "\" text-anchor=\"middle\" fill=\"#555\">" << power_label(e) << "</text>\n";
  }
  svg << "  <text x=\"" << left + plot_w / 2 << "\" y=\"" << plot_bottom + 40
      << "\" text-anchor=\"middle\" fill=\"#555\">bytes per token, all " << r.layers
      << " layers</text>\n";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& row = rows[i];
    const int y = top + static_cast<int>(i) * (bar_h + gap);
    const double w =
        std::max(2.0, plot_w * axis.fraction(static_cast<double>(row.bytes_per_token)));
    const std::string label = row.name + (row.own ? " (model)" : "") + ", " + row.detail;
    svg << "  <text x=\"" << left - 8 << "\" y=\"" << y + bar_h / 2 + 5 << "\" text-anchor=\"end\">"
        << xml_escape(label) << "</text>\n"
        << "  <rect x=\"" << left << "\" y=\"" << y << "\" width=\"" << fixed(w, 1)
        << "\" height=\"" << bar_h << "\" fill=\"" << colors[i % 5] << "\"/>\n"
        << "  <text x=\"" << fixed(left + w + 6, 1) << "\" y=\"" << y + bar_h / 2 + 5 << "\">"
        << xml_escape(with_commas(row.elements_per_token) + " elements, " +
                      human_bytes(row.bytes_per_token))
        << "</text>\n";
  }
  svg << "</svg>\n";
  return svg.str();
}

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
  --tp N             tensor-parallel degree; totals are per device and summed
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

/// Parses argv into Options. Flags take "--flag value" or "--flag=value".
Options parse_args(int argc, char** argv, bool& exit_now) {
  std::vector<std::pair<std::string, std::optional<std::string>>> args;
  static const std::vector<std::string> valued = {
      "--heads",   "--head-dim",      "--layers",      "--d-model",    "--kv-heads",
      "--kv-rank", "--q-rank",        "--rope-dim",    "--v-dim",      "--lrkv-rank",
      "--dtype",   "--seq-len",       "--batch",       "--tp",         "--mechanism",
      "--preset",  "--hf-config",     "--budget",      "--svg",        "--page-size",
      "--window",  "--window-layers", "--scale-block", "--rope-dtype", "--rank-step"};
  static const std::vector<std::string> switches = {"--json", "--list-presets", "--help", "-h"};
  for (int i = 1; i < argc; ++i) {
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
        if (i + 1 >= argc) fail(arg + " needs a value (see --help)");
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
  exit_now = false;
  for (const auto& [flag, value] : args) {
    if (flag == "--help" || flag == "-h") {
      print_usage(std::cout);
      exit_now = true;
      return {};
    }
  }
  for (const auto& [flag, value] : args) {
    if (flag == "--list-presets") {
      for (const Preset& p : presets()) {
        std::cout << std::left << std::setw(18) << p.name << p.description << "\n";
      }
      exit_now = true;
      return {};
    }
  }

  Options o;
  if (seen.count("--preset") && seen.count("--hf-config")) {
    fail("--preset and --hf-config both describe the model; give one of them");
  }
  o.shape = deepseek_v2();
  o.shape.own.clear();
  o.shape.source = "DeepSeek-V2 shape";
  for (const auto& [flag, value] : args) {
    if (flag == "--preset") o.shape = preset_shape(*value);
    if (flag == "--hf-config") o.shape = shape_from_hf(*value);
  }
  for (const auto& [flag, value] : args) {
    const std::string& v = value ? *value : std::string();
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
    if (flag == "--dtype") s.dtype = parse_dtype_flag(flag, v);
    if (flag == "--rope-dtype") o.rope_dtype = parse_dtype_flag(flag, v);
    if (flag == "--seq-len") o.seq_len = parse_count(flag, v, 1);
    if (flag == "--batch") o.batch = parse_count(flag, v, 1);
    if (flag == "--tp") o.tp = parse_count(flag, v, 1);
    if (flag == "--page-size") o.page_size = parse_count(flag, v, 0);
    if (flag == "--scale-block") o.scale_block = parse_count(flag, v, 1);
    if (flag == "--rank-step") o.rank_step = parse_count(flag, v, 1);
    if (flag == "--json") o.json = true;
    if (flag == "--svg") {
      if (v.empty()) fail("--svg needs a file name, e.g. --svg cache.svg");
      o.svg_path = v;
    }
    if (flag == "--budget") {
      o.budget = parse_budget(v);
      o.budget_text = v;
    }
    if (flag == "--mechanism") {
      std::stringstream list(v);
      std::string item;
      while (std::getline(list, item, ',')) {
        if (item.empty()) continue;
        std::string upper;
        for (const char ch : item)
          upper += static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
        const auto& names = all_mechanisms();
        if (std::find(names.begin(), names.end(), upper) == names.end()) {
          fail("--mechanism '" + item +
               "' is unknown; use a comma list of MHA, GQA, MQA, MLA, LRKV");
        }
        if (std::find(o.mechanisms.begin(), o.mechanisms.end(), upper) == o.mechanisms.end()) {
          o.mechanisms.push_back(upper);
        }
      }
      if (o.mechanisms.empty()) {
        fail(
            "--mechanism needs at least one of MHA, GQA, MQA, MLA, LRKV (e.g. --mechanism "
            "MLA,GQA)");
      }
    }
  }
  return o;
}

int run(int argc, char** argv) {
  bool exit_now = false;
  const Options o = parse_args(argc, argv, exit_now);
  if (exit_now) return 0;
  const Resolved r = resolve(o);
  const std::vector<Row> rows = compute_rows(o, r);
  std::optional<BudgetResult> budget;
  if (o.budget) budget = solve_budget(*o.budget, o, r);

  // Everything is computed; only now write anything.
  std::ostringstream out;
  if (o.json) {
    out << to_json(o, r, rows, budget).dump(2) << "\n";
  } else {
    print_table(out, o, r, rows, budget);
  }
  if (o.svg_path) {
    const std::string svg = to_svg(o, r, rows);
    std::ofstream file(*o.svg_path, std::ios::binary | std::ios::trunc);
    if (!file) fail("--svg '" + *o.svg_path + "' cannot be written: " + std::strerror(errno));
    file << svg;
    file.close();
    if (!file) fail("--svg '" + *o.svg_path + "' could not be written completely");
    if (!o.json) out << "\nWrote " << *o.svg_path << "\n";
  }
  std::cout << out.str() << std::flush;
  return 0;
}

/// One line, whatever the message holds.
std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const InputError& e) {
    std::cerr << "kvcalc: error: " << one_line(e.what()) << "\n";
  } catch (const kvattn::config_error& e) {
    std::cerr << "kvcalc: error: impossible configuration: " << one_line(e.what()) << "\n";
  } catch (const std::overflow_error& e) {
    std::cerr << "kvcalc: error: a number is too large to represent: " << one_line(e.what())
              << "; use a smaller --seq-len, --batch or model\n";
  } catch (const std::exception& e) {
    std::cerr << "kvcalc: error: " << one_line(e.what()) << "\n";
  }
  return 2;
}
