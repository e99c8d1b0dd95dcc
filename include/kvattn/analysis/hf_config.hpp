// Reading a Hugging Face config.json into kvattn's configs: the model's attention (MHA,
// GQA, MQA as a GqaConfig, or MLA as an MlaConfig with its YaRN settings), its layer
// stack (sliding-window layers) and its storage dtype, ready for the analysis module.
//
//   #include <kvattn/analysis/hf_config.hpp>     // CMake target kvattn::hf_config
//   const auto model = kvattn::analysis::read_hf_config("config.json");
//   kvattn::analysis::total_bytes(cache_layout(*model.gqa), {}, model.stack, {32768, 8});
//
// The one kvattn header that needs nlohmann-json (Debian: nlohmann-json3-dev); the
// umbrella kvattn.hpp does not include it. docs/cache-size.md lists the fields read.
//
// Hostile input is refused with one line naming the input and the field, never a crash:
// at most HfReadOptions::max_bytes (16 MiB) are read, files must be regular files
// (checked before opening, so a FIFO or /dev/zero is refused at once, and on POSIX
// again on the opened descriptor, so a file swapped for a FIFO in between cannot make
// the read block), nesting deeper than max_depth (64) levels is refused while parsing,
// and only the fields read below are kept, so parse time is linear in the input and
// memory a small multiple of it.
#pragma once

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <istream>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

// POSIX (Debian, the target; macOS): read_hf_config reads through one descriptor it
// has checked with fstat. Elsewhere it opens a std::ifstream after the path's checks.
#if defined(__unix__) || defined(__APPLE__)
#define KVATTN_DETAIL_HF_POSIX 1
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#else
#define KVATTN_DETAIL_HF_POSIX 0
#endif

#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/analysis/dtype.hpp"
#include "kvattn/config/gqa_config.hpp"
#include "kvattn/config/mla_config.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/index.hpp"

namespace kvattn {

/// A Hugging Face config.json cannot be read or does not describe a model: one line
/// naming the input (HfReadOptions::label), the field, and what a correct value looks
/// like. Like every kvattn exception it derives from one standard exception
/// (std::invalid_argument) and from kvattn::error, which is not a std::exception, so
/// std::exception is a base once and `catch (const std::exception&)` catches it.
class hf_config_error : public std::invalid_argument, public error {
 public:
  using std::invalid_argument::invalid_argument;
  const char* what() const noexcept override { return std::invalid_argument::what(); }
};

namespace analysis {

/// The attention a config.json describes.
enum class HfAttention { mha, gqa, mqa, mla };

/// "MHA", "GQA", "MQA", "MLA".
constexpr std::string_view to_string(HfAttention attention) {
  switch (attention) {
    case HfAttention::mha:
      return "MHA";
    case HfAttention::gqa:
      return "GQA";
    case HfAttention::mqa:
      return "MQA";
    case HfAttention::mla:
      return "MLA";
  }
  return "unknown";
}

/// Default cap on the bytes read: real config.json files are a few KB.
inline constexpr std::size_t kHfMaxBytes = std::size_t{16} << 20;
/// Default cap on JSON nesting: real config.json files nest 3 or 4 levels.
inline constexpr int kHfMaxDepth = 64;
/// Largest count accepted for a dimension or layer count (2^53): products of two
/// counts then stay checkable, and doubles represent every accepted value exactly.
inline constexpr Index kHfMaxCount = Index{1} << 53;

/// How an input is named in messages, and the limits on reading it.
struct HfReadOptions {
  /// Names the input at the start of every message ("config file 'x/config.json'",
  /// kvcalc: "--hf-config 'x/config.json'"). Empty: "config.json" for text and
  /// streams, "config file '<path>'" for read_hf_config.
  std::string label;
  /// The file name in the model's name when the config has no _name_or_path. Empty:
  /// "config.json" for text and streams, the path's file name for read_hf_config.
  std::string file_name;
  std::size_t max_bytes = kHfMaxBytes;  // larger input is refused
  int max_depth = kHfMaxDepth;          // deeper nesting is refused while parsing
};

/// What a config.json says about the model's attention and its KV cache.
struct HfModel {
  /// _name_or_path when set, else "<model_type> (<file name>)", else the file name.
  std::string name;
  std::string model_type;  // model_type of the file ("" when absent)
  HfAttention attention = HfAttention::mha;
  /// MHA / GQA / MQA models (exactly one of gqa, mla is set; both validated):
  /// d_model = hidden_size, n_heads = num_attention_heads, n_kv_heads =
  /// num_key_value_heads (absent: n_heads), head_dim = head_dim (absent: hidden_size /
  /// num_attention_heads), qkv_bias = attention_bias, half-split RoPE with rope_theta.
  std::optional<GqaConfig> gqa;
  /// MLA models (DeepSeek-V2/V3, recognised by kv_lora_rank): kv_rank, q_rank
  /// (q_lora_rank; null: 0), qk_nope_dim, rope_dim (qk_rope_head_dim), v_dim
  /// (v_head_dim; absent: qk_nope_dim), interleaved RoPE with rope_theta when
  /// rope_dim > 0, YaRN from a rope_scaling of type "yarn", norm_epsilon =
  /// rms_norm_eps, q_norm when q_rank > 0.
  std::optional<MlaConfig> mla;
  /// num_hidden_layers and the sliding-window layers: layer_types, else Qwen2's
  /// use_sliding_window / max_window_layers, Gemma 2's alternation,
  /// sliding_window_pattern, or every layer (Mistral).
  LayerStack stack;
  std::optional<Dtype> dtype;      // torch_dtype (or dtype); nullopt when absent
  std::string rope_scaling;        // rope_scaling's type ("" without); only YaRN on MLA is used
  std::vector<std::string> notes;  // facts a reader should know (an unused window, ...)

  bool is_mla() const { return mla.has_value(); }
  /// H, query heads.
  Index n_heads() const { return mla ? mla->n_heads : gqa->n_heads; }
  /// d, hidden size.
  Index d_model() const { return mla ? mla->d_model : gqa->d_model; }
  /// d_h, the head width caches compare at (MLA: d_nope).
  Index head_dim() const { return mla ? mla->qk_nope_dim : gqa->head_dim; }
  Index layers() const { return stack.layers; }
};

namespace detail {

using hf_json = nlohmann::json;

/// The message on one line: control characters (a newline in a file name) become spaces.
inline std::string hf_one_line(std::string text) {
  for (char& ch : text) {
    if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) ch = ' ';
  }
  return text;
}

[[noreturn]] inline void hf_fail(std::string message) {
  throw hf_config_error(hf_one_line(std::move(message)));
}

/// At most `limit` bytes of `text`, cut at a UTF-8 boundary, "..." when shortened: a
/// 1 MB key or number must not make a 1 MB error message.
inline std::string hf_shorten(std::string_view text, std::size_t limit = 80) {
  if (text.size() <= limit) return std::string(text);
  std::size_t cut = limit;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return std::string(text.substr(0, cut)) + "...";
}

inline std::string hf_with_commas(Index value) {
  const std::string digits = std::to_string(value);
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && digits[i - 1] != '-' && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

/// "16 MiB" for whole mebibytes, else "100-byte".
inline std::string hf_limit_text(std::size_t bytes) {
  constexpr std::size_t mib = std::size_t{1} << 20;
  if (bytes >= mib && bytes % mib == 0) return std::to_string(bytes / mib) + " MiB";
  return std::to_string(bytes) + "-byte";
}

/// "the string \"32\"", "a boolean", ... for messages.
inline std::string hf_json_type(const hf_json& value) {
  if (value.is_null()) return "null";
  if (value.is_boolean()) return "a boolean";
  if (value.is_number()) return "the number " + hf_shorten(value.dump());
  if (value.is_string()) return "the string " + hf_shorten(value.dump());
  if (value.is_array()) return "an array";
  return "an object";
}

// ---- Parsing: a SAX handler that keeps only the fields read ----------------------

/// What a "layer_types" array holds, counted while parsing: its entries are not stored,
/// so a 16 MiB array costs no memory.
struct HfLayerTypes {
  Index entries = 0;      // the array's length
  Index sliding = 0;      // entries equal to "sliding_attention"
  Index not_strings = 0;  // entries that are not strings
};

/// The fields hf_interpret() reads, as parsed.
struct HfDocument {
  hf_json root;  // the kept members; a "layer_types" array is kept empty, counted below
  std::map<std::string, HfLayerTypes> layer_types;  // by prefix: "" or "text_config."
};

/// Builds the document from nlohmann's SAX events, keeping only what hf_interpret()
/// reads: the known keys of the top-level object, of "text_config" and of
/// "rope_scaling", and the counts of "layer_types". Every other value is parsed (so
/// syntax is checked) and dropped, so each key costs O(1) whatever the file holds
/// (nlohmann::ordered_json inserts by linear search: 100k keys took 14 s), memory stays
/// near the size of the fields read, and the tree never grows deeper than max_depth (a
/// 300,000-deep value overflowed the stack when copied). It also tracks where it is, so
/// an error can name the field.
class HfSax {
 public:
  explicit HfSax(int max_depth) : max_depth_(max_depth) {}

  bool null() { return put(hf_json(nullptr)); }
  bool boolean(bool value) { return put(hf_json(value)); }
  bool number_integer(hf_json::number_integer_t value) { return put(hf_json(value)); }
  bool number_unsigned(hf_json::number_unsigned_t value) { return put(hf_json(value)); }
  bool number_float(hf_json::number_float_t value, const hf_json::string_t& /*text*/) {
    return put(hf_json(value));
  }
  bool string(hf_json::string_t& value) { return put(hf_json(value)); }
  bool binary(hf_json::binary_t& /*value*/) { return put(hf_json(nullptr)); }  // not in JSON text
  bool start_object(std::size_t /*elements*/) { return open(false); }
  bool start_array(std::size_t /*elements*/) { return open(true); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(hf_json::string_t& key) {
    Level& top = levels_.back();
    top.key.assign(key);
    top.keep_member = top.node != nullptr && wanted(key);
    return true;
  }

  bool parse_error(std::size_t /*position*/, const std::string& last_token,
                   const hf_json::exception& error) {
    error_id_ = error.id;
    error_message_ = hf_shorten(error.what(), 400);  // a token can be 16 MiB long
    error_token_ = hf_shorten(last_token);
    return false;
  }

  bool too_deep() const { return too_deep_; }
  int error_id() const { return error_id_; }
  const std::string& error_message() const { return error_message_; }
  const std::string& error_token() const { return error_token_; }
  HfDocument take_document() { return {std::move(root_), std::move(layer_types_)}; }

  /// Where parsing is: "\"rope_scaling.factor\"", "\"layer_types[3]\"", or "the top level".
  std::string field() const {
    std::string path;
    for (const Level& level : levels_) {
      if (level.array) {
        if (level.index >= 0) path += "[" + std::to_string(level.index) + "]";
      } else if (!level.key.empty()) {
        if (!path.empty()) path += '.';
        path += level.key;
      }
    }
    if (path.empty()) return "the top level";
    return "\"" + hf_shorten(path) + "\"";
  }

 private:
  struct Level {
    hf_json* node = nullptr;  // where members go (kept objects); null: dropped
    bool array = false;
    std::string key;                 // the current member's key (objects)
    Index index = -1;                // the current entry's index (arrays)
    bool keep_member = false;        // whether the current member is kept
    HfLayerTypes* counts = nullptr;  // a layer_types array: where its entries are counted
  };

  static bool among(std::string_view key, const std::string_view* first, std::size_t count) {
    return std::find(first, first + count, key) != first + count;
  }

  // The keys hf_interpret() reads; everything else is dropped while parsing.
  // clang-format off
  static constexpr std::array<std::string_view, 24> kModelKeys = {
      "num_attention_heads", "num_hidden_layers", "hidden_size", "num_key_value_heads",
      "head_dim", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
      "v_head_dim", "sliding_window", "use_sliding_window", "layer_types", "max_window_layers",
      "sliding_window_pattern", "rope_theta", "rope_scaling", "rms_norm_eps", "attention_bias",
      "model_type", "torch_dtype", "dtype", "_name_or_path", "text_config"};
  // clang-format on
  static constexpr std::array<std::string_view, 8> kRopeKeys = {
      "type",      "rope_type", "factor", "original_max_position_embeddings",
      "beta_fast", "beta_slow", "mscale", "mscale_all_dim"};

  /// Whether the member `key` of the object at the top is read by interpret().
  bool wanted(std::string_view key) const {
    const std::size_t depth = levels_.size();
    const auto parent = [&](std::size_t i) -> std::string_view { return levels_[i].key; };
    const bool in_rope = (depth == 2 && parent(0) == "rope_scaling") ||
                         (depth == 3 && parent(0) == "text_config" && parent(1) == "rope_scaling");
    if (in_rope) return among(key, kRopeKeys.data(), kRopeKeys.size());
    if (depth == 1 || (depth == 2 && parent(0) == "text_config")) {
      return among(key, kModelKeys.data(), kModelKeys.size());
    }
    return false;
  }

  /// Whether the level at the top holds the model's fields: the file, or its text_config.
  bool model_level() const {
    const std::size_t depth = levels_.size();
    return depth == 1 || (depth == 2 && levels_[0].key == "text_config");
  }

  /// Whether an object stored under the current key keeps its members: text_config and
  /// rope_scaling.
  bool keeps_members() const {
    const std::string_view key = levels_.back().key;
    return (levels_.size() == 1 && key == "text_config") ||
           (model_level() && key == "rope_scaling");
  }

  /// Counts one entry of a layer_types array (null: a container).
  static void count(HfLayerTypes& counts, const hf_json* value) {
    ++counts.entries;
    if (value == nullptr || !value->is_string()) {
      ++counts.not_strings;
    } else if (value->get_ref<const std::string&>() == "sliding_attention") {
      ++counts.sliding;
    }
  }

  /// Stores a value at the current position; returns where it went (null: dropped).
  hf_json* store(hf_json value) {
    if (levels_.empty()) {
      root_ = std::move(value);
      return &root_;
    }
    Level& top = levels_.back();
    if (top.array) {
      ++top.index;
      if (top.node == nullptr) return nullptr;
      top.node->push_back(std::move(value));
      return &top.node->back();
    }
    if (!top.keep_member) return nullptr;
    hf_json& slot = (*top.node)[top.key];
    slot = std::move(value);
    return &slot;
  }

  bool put(hf_json value) {
    if (!levels_.empty() && levels_.back().counts != nullptr) count(*levels_.back().counts, &value);
    store(std::move(value));
    return true;
  }

  bool open(bool array) {
    if (static_cast<Index>(levels_.size()) >= max_depth_) {
      if (!levels_.empty() && levels_.back().array) ++levels_.back().index;  // names it
      too_deep_ = true;
      return false;  // stops the parser before it builds anything deeper
    }
    if (!levels_.empty() && levels_.back().counts != nullptr) {
      count(*levels_.back().counts, nullptr);  // a container in layer_types: not a string
    }
    // The top-level object is kept; a nested object keeps its members only where
    // hf_interpret() reads them; arrays are kept empty (only their type is read), and
    // layer_types has its entries counted.
    const bool keep = !array && (levels_.empty() || keeps_members());
    const bool counted =
        array && !levels_.empty() && model_level() && levels_.back().key == "layer_types";
    const std::string prefix = levels_.size() == 2 ? "text_config." : "";
    hf_json* node = store(array ? hf_json::array() : hf_json::object());
    HfLayerTypes* counts = nullptr;
    if (counted && node != nullptr) {
      counts = &layer_types_[prefix];
      *counts = {};  // a repeated key: the last one counts, as its value is the one kept
    }
    levels_.push_back({keep ? node : nullptr, array, {}, -1, false, counts});
    return true;
  }

  bool close() {
    levels_.pop_back();
    return true;
  }

  Index max_depth_;
  std::vector<Level> levels_;
  hf_json root_;
  std::map<std::string, HfLayerTypes> layer_types_;
  bool too_deep_ = false;
  int error_id_ = 0;
  std::string error_message_;
  std::string error_token_;
};

/// nlohmann's message without its "[json.exception.parse_error.101] " prefix.
inline std::string hf_strip_id(const std::string& message) {
  const auto end = message.find("] ");
  return hf_shorten(message.rfind("[json.exception.", 0) == 0 && end != std::string::npos
                        ? message.substr(end + 2)
                        : message,
                    240);
}

/// Parses `text` into the kept document; hf_config_error on anything but a JSON value.
inline HfDocument hf_parse_document(std::string_view text, const std::string& where,
                                    const HfReadOptions& options) {
  if (text.size() > options.max_bytes) {
    hf_fail(where + " is larger than the " + hf_limit_text(options.max_bytes) +
            " limit; a Hugging Face config.json is a few KB");
  }
  if (text.find_first_not_of(" \t\r\n") == std::string_view::npos) {
    hf_fail(where + " is empty; expected a Hugging Face config.json object {...}");
  }
  HfSax sax(options.max_depth);
  const bool ok = hf_json::sax_parse(text.data(), text.data() + text.size(), &sax,
                                     nlohmann::detail::input_format_t::json, true, false);
  if (ok) return sax.take_document();
  if (sax.too_deep()) {
    hf_fail(where + " nests deeper than " + std::to_string(options.max_depth) + " levels at " +
            sax.field() + "; a Hugging Face config.json nests a few levels");
  }
  if (sax.error_id() == 406) {  // out_of_range.406: a number beyond double's range
    hf_fail(where + ": " + sax.field() + " " + hf_shorten(sax.error_token()) +
            " is too large to represent");
  }
  hf_fail(where + " is not valid JSON (truncated or malformed) near " + sax.field() + ": " +
          hf_strip_id(sax.error_message()));
}

// ---- Interpreting the document --------------------------------------------------

/// Typed reads of one JSON object (the file, or its text_config), each naming the field
/// in its error.
class HfFields {
 public:
  HfFields(const hf_json& object, const HfDocument& document, const std::string& where,
           std::string prefix)
      : j_(object), document_(document), where_(where), prefix_(std::move(prefix)) {}

  bool has(const char* key) const { return j_.contains(key) && !j_.at(key).is_null(); }
  const hf_json& at(const char* key) const { return j_.at(key); }
  std::string name(const char* key) const { return prefix_ + key; }

  /// A whole number >= min_value; nullopt when absent or null (unless required).
  std::optional<Index> count(const char* key, bool required, Index min_value = 1) const {
    const std::string field = name(key);
    if (!has(key)) {
      if (required) {
        hf_fail(where_ + " has no \"" + field + "\" (a Hugging Face config.json needs it, e.g. \"" +
                key + "\": 32)");
      }
      return std::nullopt;
    }
    const hf_json& v = j_.at(key);
    if (v.is_number_float() && std::fabs(v.get<double>()) >= static_cast<double>(kHfMaxCount)) {
      hf_fail(where_ + ": \"" + field + "\" " + hf_shorten(v.dump()) +
              " is too large to represent");
    }
    if (!v.is_number_integer()) {
      hf_fail(where_ + ": \"" + field + "\" must be an integer, got " + hf_json_type(v) +
              " (e.g. \"" + key + "\": 32)");
    }
    if (v.is_number_unsigned() ? v.get<std::uint64_t>() > static_cast<std::uint64_t>(kHfMaxCount)
                               : v.get<std::int64_t>() > kHfMaxCount) {
      hf_fail(where_ + ": \"" + field + "\" " + v.dump() + " is too large to represent");
    }
    const Index value = v.is_number_unsigned() ? static_cast<Index>(v.get<std::uint64_t>())
                                               : static_cast<Index>(v.get<std::int64_t>());
    if (value < min_value) {
      hf_fail(where_ + ": \"" + field + "\" must be >= " + std::to_string(min_value) + ", got " +
              v.dump());
    }
    return value;
  }

  std::optional<bool> boolean(const char* key) const {
    if (!has(key)) return std::nullopt;
    if (!j_.at(key).is_boolean()) {
      hf_fail(where_ + ": \"" + name(key) + "\" must be true or false, got " +
              hf_json_type(j_.at(key)));
    }
    return j_.at(key).get<bool>();
  }

  /// Any JSON number (integer or not).
  std::optional<double> number(const char* key, const char* example) const {
    if (!has(key)) return std::nullopt;
    const hf_json& v = j_.at(key);
    if (!v.is_number()) {
      hf_fail(where_ + ": \"" + name(key) + "\" must be a number, got " + hf_json_type(v) +
              " (e.g. \"" + key + "\": " + example + ")");
    }
    return v.get<double>();
  }

  std::optional<std::string> text(const char* key) const {
    if (!has(key)) return std::nullopt;
    if (!j_.at(key).is_string()) {
      hf_fail(where_ + ": \"" + name(key) + "\" must be a string, got " + hf_json_type(j_.at(key)));
    }
    return j_.at(key).get<std::string>();
  }

  /// An object (e.g. rope_scaling); nullopt when absent or null.
  std::optional<HfFields> object(const char* key) const {
    if (!has(key)) return std::nullopt;
    if (!j_.at(key).is_object()) {
      hf_fail(where_ + ": \"" + name(key) + "\" must be an object {...}, got " +
              hf_json_type(j_.at(key)));
    }
    return HfFields(j_.at(key), document_, where_, name(key) + ".");
  }

  /// The counted entries of this object's "layer_types" array.
  HfLayerTypes layer_types() const {
    const auto it = document_.layer_types.find(prefix_);
    return it == document_.layer_types.end() ? HfLayerTypes{} : it->second;
  }

 private:
  const hf_json& j_;
  const HfDocument& document_;
  const std::string& where_;
  std::string prefix_;
};

/// Throws hf_config_error naming the input unless the config validates.
template <class Config>
void hf_validate(const Config& config, const std::string& where) {
  try {
    config.validate();
  } catch (const config_error& e) {
    hf_fail(where + ": impossible configuration: " + e.what());
  }
}

/// The GQA family: num_key_value_heads (absent: H) makes it MHA, GQA or MQA.
inline void hf_read_gqa(const HfFields& j, const std::string& where, HfModel& m, Index heads,
                        Index d_model) {
  const Index kv = j.count("num_key_value_heads", false).value_or(heads);
  if (heads % kv != 0) {
    hf_fail(where + ": num_key_value_heads (" + std::to_string(kv) +
            ") must divide num_attention_heads (" + std::to_string(heads) + ")");
  }
  m.attention = kv == heads ? HfAttention::mha : kv == 1 ? HfAttention::mqa : HfAttention::gqa;
  GqaConfig c;
  c.d_model = d_model;
  c.n_heads = heads;
  c.n_kv_heads = kv;
  if (const auto hd = j.count("head_dim", false)) {
    c.head_dim = *hd;  // Gemma 2: 256, not 3584 / 16
  } else {
    if (d_model % heads != 0) {
      hf_fail(where + ": no \"head_dim\" and hidden_size (" + std::to_string(d_model) +
              ") is not divisible by num_attention_heads (" + std::to_string(heads) + ")");
    }
    c.head_dim = d_model / heads;
  }
  m.gqa = c;
}

/// MLA (DeepSeek-V2/V3), recognised by kv_lora_rank.
inline void hf_read_mla(const HfFields& j, HfModel& m, Index heads, Index d_model) {
  m.attention = HfAttention::mla;
  MlaConfig c;
  c.d_model = d_model;
  c.n_heads = heads;
  c.kv_rank = *j.count("kv_lora_rank", true);
  c.q_rank = j.count("q_lora_rank", false, 0).value_or(0);
  c.rope_dim = *j.count("qk_rope_head_dim", true, 0);
  c.qk_nope_dim = *j.count("qk_nope_head_dim", true);
  c.v_dim = j.count("v_head_dim", false).value_or(c.qk_nope_dim);
  j.count("num_key_value_heads", false);  // type-checked; MLA does not use it
  c.q_norm = c.q_rank > 0;
  c.kv_norm = true;
  m.mla = c;
  m.notes.push_back("MLA recognised by kv_lora_rank; num_key_value_heads is not used");
}

/// Sliding windows, where the model uses them.
inline void hf_read_windows(const HfFields& j, const HfFields& root, const std::string& where,
                            HfModel& m) {
  const Index layers = m.stack.layers;
  const auto window = j.count("sliding_window", false);
  const auto use_window = j.boolean("use_sliding_window");
  if (j.has("layer_types")) {
    const HfLayerTypes types = j.layer_types();  // counted while parsing
    if (!j.at("layer_types").is_array() || types.entries != layers) {
      hf_fail(where + ": \"" + j.name("layer_types") +
              "\" must be an array of num_hidden_layers (" + std::to_string(layers) + ") strings");
    }
    if (types.not_strings > 0) {
      hf_fail(where + ": \"" + j.name("layer_types") + "\" entries must be strings");
    }
    const Index sliding = types.sliding;
    if (sliding > 0) {
      if (!window) hf_fail(where + ": layer_types has sliding_attention but no \"sliding_window\"");
      m.stack.window = *window;
      m.stack.window_layers = sliding;
    }
  } else if (window && use_window == false) {
    m.notes.push_back("sliding_window " + hf_with_commas(*window) +
                      " is not used (use_sliding_window is false)");
  } else if (window) {
    Index sliding = layers;
    if (use_window == true) {
      // Qwen2: layers from max_window_layers on use the window.
      const Index first = j.count("max_window_layers", false, 0).value_or(0);
      sliding = layers - std::min(first, layers);
    } else if (root.text("model_type").value_or("") == "gemma2" ||
               j.text("model_type").value_or("") == "gemma2") {
      sliding = (layers + 1) / 2;  // Gemma 2: even-indexed layers are local
    } else if (const auto pattern = j.count("sliding_window_pattern", false)) {
      sliding = layers - layers / *pattern;  // every pattern-th layer is global
    }
    if (sliding > 0) {
      m.stack.window = *window;
      m.stack.window_layers = sliding;
    }
  }
}

/// RoPE: rope_theta, and YaRN from rope_scaling (used by MLA; the type is recorded).
inline void hf_read_rope(const HfFields& j, const std::string& where, HfModel& m) {
  const double theta = j.number("rope_theta", "10000.0").value_or(10000.0);
  std::optional<HfFields> scaling = j.object("rope_scaling");
  if (scaling) {
    m.rope_scaling = scaling->text("type").value_or(scaling->text("rope_type").value_or(""));
  }
  if (m.gqa) m.gqa->rope = {RopeLayout::half_split, theta, 0};
  if (!m.mla || m.mla->rope_dim == 0) return;
  m.mla->rope = {RopeLayout::interleaved, theta, 0};  // DeepSeek checkpoints interleave pairs
  if (m.rope_scaling != "yarn") return;
  YarnConfig& y = m.mla->yarn;
  y.enabled = true;
  const auto factor = scaling->number("factor", "40");
  if (!factor) {
    hf_fail(where + " has no \"" + scaling->name("factor") +
            "\" (YaRN needs it, e.g. \"factor\": 40)");
  }
  y.factor = *factor;
  y.original_max_position = *scaling->count("original_max_position_embeddings", true);
  y.beta_fast = scaling->number("beta_fast", "32").value_or(y.beta_fast);
  y.beta_slow = scaling->number("beta_slow", "1").value_or(y.beta_slow);
  y.mscale = scaling->number("mscale", "0.707").value_or(y.mscale);
  y.mscale_all_dim = scaling->number("mscale_all_dim", "0.707").value_or(y.mscale_all_dim);
}

/// The config's dtype ("torch_dtype"; newer files call it "dtype"), from the file or
/// its text_config.
inline void hf_read_dtype(const HfFields& root, const HfFields& j, const std::string& where,
                          HfModel& m) {
  for (const char* key : {"torch_dtype", "dtype"}) {
    const HfFields* holder = root.has(key) ? &root : j.has(key) ? &j : nullptr;
    if (holder == nullptr) continue;
    const std::string value = *holder->text(key);
    const auto d = parse_dtype(value);
    if (!d) {
      hf_fail(where + ": \"" + holder->name(key) + "\" " + hf_shorten(holder->at(key).dump()) +
              " is not a type kvattn knows (float32, bfloat16, float16, float8_e4m3fn, ...)");
    }
    m.dtype = d;
    return;
  }
}

/// The document as a model. `where` names the input, `file` is used in the name.
inline HfModel hf_interpret(const HfDocument& document, const std::string& where,
                            const std::string& file) {
  const hf_json& root = document.root;
  if (!root.is_object()) {
    hf_fail(where + " must hold a JSON object {...}, got " + hf_json_type(root));
  }
  const HfFields top(root, document, where, "");
  // Multimodal configs (Gemma 3, LLaVA, ...) keep the language model in text_config.
  const bool nested = !root.contains("num_attention_heads") && root.contains("text_config") &&
                      root.at("text_config").is_object();
  const HfFields j =
      nested ? HfFields(root.at("text_config"), document, where, "text_config.") : top;

  HfModel m;
  m.name = file;
  const auto name_or_path = top.text("_name_or_path");
  const auto model_type = top.text("model_type");
  m.model_type = model_type.value_or("");
  if (name_or_path && !name_or_path->empty()) {
    m.name = *name_or_path;
  } else if (model_type) {
    m.name = *model_type + " (" + file + ")";
  }
  const Index heads = *j.count("num_attention_heads", true);
  m.stack.layers = *j.count("num_hidden_layers", true);
  const Index d_model = *j.count("hidden_size", true);
  if (j.has("kv_lora_rank")) {
    hf_read_mla(j, m, heads, d_model);
  } else {
    hf_read_gqa(j, where, m, heads, d_model);
  }
  hf_read_windows(j, top, where, m);
  hf_read_dtype(top, j, where, m);
  hf_read_rope(j, where, m);
  if (m.mla) m.mla->norm_epsilon = j.number("rms_norm_eps", "1e-06").value_or(1e-6);
  if (m.gqa) m.gqa->qkv_bias = j.boolean("attention_bias").value_or(false);
  if (m.gqa) hf_validate(*m.gqa, where);
  if (m.mla) hf_validate(*m.mla, where);
  return m;
}

/// Reads `in` to its end (through its stream buffer, so the stream's exception mask
/// does not matter), refusing more than max_bytes.
inline std::string hf_read_stream(std::istream& in, const std::string& where,
                                  std::size_t max_bytes) {
  std::streambuf* buffer = in.rdbuf();
  if (buffer == nullptr) hf_fail(where + " cannot be read: the stream has no buffer");
  std::string text;
  std::string chunk(std::size_t{1} << 16, '\0');  // on the heap: a 64 KiB frame is too big
  for (;;) {
    std::streamsize got = 0;
    errno = 0;
    try {
      got = buffer->sgetn(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    } catch (const std::system_error& e) {  // std::ios_base::failure: /proc/self/mem
      hf_fail(where + " cannot be read: " + e.code().message());
    } catch (const std::exception&) {
      hf_fail(where + " cannot be read: " +
              (errno != 0 ? std::string(std::strerror(errno)) : std::string("a stream error")));
    }
    if (got <= 0) break;
    text.append(chunk.data(), static_cast<std::size_t>(got));
    if (text.size() > max_bytes) {
      hf_fail(where + " is larger than the " + hf_limit_text(max_bytes) +
              " limit; a Hugging Face config.json is a few KB");
    }
  }
  return text;
}

inline HfModel hf_parse(std::string_view text, const HfReadOptions& options) {
  const std::string where = options.label.empty() ? "config.json" : options.label;
  const std::string file = options.file_name.empty() ? "config.json" : options.file_name;
  const HfDocument document = hf_parse_document(text, where, options);
  try {
    return hf_interpret(document, where, file);
  } catch (const hf_json::exception& e) {
    // Every read above is type-checked; this keeps the promise of one line naming the
    // input should one be missed.
    hf_fail(where + ": unexpected content: " + hf_strip_id(e.what()));
  }
}

/// "a FIFO", "a character device", ... for a file that is not a regular file.
inline const char* hf_file_kind(std::filesystem::file_type type) {
  switch (type) {
    case std::filesystem::file_type::character:
      return "a character device";
    case std::filesystem::file_type::block:
      return "a block device";
    case std::filesystem::file_type::fifo:
      return "a FIFO";
    case std::filesystem::file_type::socket:
      return "a socket";
    default:
      return "not a regular file";
  }
}

/// "<where> is larger than the 16 MiB limit (17,825,792 bytes); ..." for a file whose
/// size is known before reading it.
[[noreturn]] inline void hf_fail_file_size(const std::string& where, std::uintmax_t size,
                                           std::size_t max_bytes) {
  hf_fail(where + " is larger than the " + hf_limit_text(max_bytes) + " limit (" +
          hf_with_commas(static_cast<Index>(std::min<std::uintmax_t>(
              size, static_cast<std::uintmax_t>(std::numeric_limits<Index>::max())))) +
          " bytes); a Hugging Face config.json is a few KB");
}

#if KVATTN_DETAIL_HF_POSIX
/// Closes a file descriptor on every way out of hf_read_file.
class HfDescriptor {
 public:
  explicit HfDescriptor(int fd) : fd_(fd) {}
  HfDescriptor(const HfDescriptor&) = delete;
  HfDescriptor& operator=(const HfDescriptor&) = delete;
  ~HfDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

/// "a FIFO", "a character device", ... for an fstat mode that is not a regular file.
inline const char* hf_mode_kind(mode_t mode) {
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

/// Reads the regular file at `path`, at most max_bytes, through one descriptor: opened
/// with O_NONBLOCK (a FIFO put in the file's place after read_hf_config's checks on
/// the path opens at once instead of waiting for a writer) and O_CLOEXEC, then fstat on
/// that descriptor must say a regular file of at most max_bytes; what is checked is
/// what is read. Messages as read_hf_config's.
inline std::string hf_read_file(const std::filesystem::path& path, const std::string& where,
                                std::size_t max_bytes) {
  int fd = -1;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int error = errno;
    if (error == ENOENT) hf_fail(where + ": no such file");
    hf_fail(where + " cannot be opened: " + std::strerror(error));
  }
  const HfDescriptor file(fd);
  struct stat info {};
  if (::fstat(file.get(), &info) != 0) {
    const int error = errno;
    hf_fail(where + " cannot be opened: " + std::strerror(error));
  }
  if (S_ISDIR(info.st_mode)) {
    hf_fail(where + " is a directory; give the config.json file inside it");
  }
  if (!S_ISREG(info.st_mode)) {
    hf_fail(where + " is " + hf_mode_kind(info.st_mode) +
            ", not a regular file; give a config.json file");
  }
  if (info.st_size > 0 && static_cast<std::uintmax_t>(info.st_size) > max_bytes) {
    hf_fail_file_size(where, static_cast<std::uintmax_t>(info.st_size), max_bytes);
  }
  // The size can change while reading (and /proc files report 0): the cap holds anyway.
  std::string text;
  std::string chunk(std::size_t{1} << 16, '\0');
  for (;;) {
    const ssize_t got = ::read(file.get(), chunk.data(), chunk.size());
    if (got < 0) {
      const int error = errno;
      if (error == EINTR) continue;
      hf_fail(where + " cannot be read: " + std::strerror(error));
    }
    if (got == 0) break;
    text.append(chunk.data(), static_cast<std::size_t>(got));
    if (text.size() > max_bytes) {
      hf_fail(where + " is larger than the " + hf_limit_text(max_bytes) +
              " limit; a Hugging Face config.json is a few KB");
    }
  }
  return text;
}
#endif

}  // namespace detail

/// Parses the text of a config.json. Throws hf_config_error (one line naming
/// options.label and the field) on invalid JSON, more than max_bytes, nesting deeper
/// than max_depth, a missing or wrongly typed field, or an impossible model.
inline HfModel parse_hf_config(std::string_view text, const HfReadOptions& options = {}) {
  return detail::hf_parse(text, options);
}

/// Reads a config.json from `in` to its end (at most max_bytes), then as above. A
/// stream that fails while reading gives "<label> cannot be read: <reason>".
inline HfModel parse_hf_config(std::istream& in, const HfReadOptions& options = {}) {
  const std::string where = options.label.empty() ? "config.json" : options.label;
  const std::string text = detail::hf_read_stream(in, where, options.max_bytes);
  return detail::hf_parse(text, options);
}

/// Reads the config.json at `path`. The file must be a regular file (a directory,
/// FIFO, socket or device such as /dev/zero is refused before it is opened; on POSIX
/// the opened descriptor is checked again, and the file read through it, so swapping
/// the file in between cannot make the read block) of at most max_bytes; messages
/// start with options.label (default "config file '<path>'").
inline HfModel read_hf_config(const std::filesystem::path& path, HfReadOptions options = {}) {
  if (options.label.empty()) options.label = "config file '" + path.string() + "'";
  if (options.file_name.empty()) options.file_name = path.filename().string();
  const std::string& where = options.label;
  std::error_code ec;
  const std::filesystem::file_status status = std::filesystem::status(path, ec);
  if (status.type() == std::filesystem::file_type::not_found) {
    detail::hf_fail(where + ": no such file");
  }
  if (ec) detail::hf_fail(where + " cannot be opened: " + ec.message());
  if (status.type() == std::filesystem::file_type::directory) {
    detail::hf_fail(where + " is a directory; give the config.json file inside it");
  }
  if (status.type() != std::filesystem::file_type::regular) {
    detail::hf_fail(where + " is " + detail::hf_file_kind(status.type()) +
                    ", not a regular file; give a config.json file");
  }
#if KVATTN_DETAIL_HF_POSIX
  const std::string text = detail::hf_read_file(path, where, options.max_bytes);
  return detail::hf_parse(text, options);
#else
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (!ec && size > options.max_bytes) detail::hf_fail_file_size(where, size, options.max_bytes);
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    detail::hf_fail(
        where + " cannot be opened: " +
        (errno != 0 ? std::string(std::strerror(errno)) : std::string("unknown error")));
  }
  return parse_hf_config(in, options);
#endif
}

}  // namespace analysis
}  // namespace kvattn
