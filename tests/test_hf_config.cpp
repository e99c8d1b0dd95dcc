// The Hugging Face config.json parser (kvattn/analysis/hf_config.hpp), called directly:
// real configs read as the models are (checked against hand numbers and the library's
// own factories: DeepSeek-V2/V3's config.json must give deepseek_v2_config() /
// deepseek_v3_config()), every error is one line naming the input and the field, and
// hostile inputs (findings 10-14: deep nesting, many keys, devices, FIFOs, huge files,
// number overflow, wrong types) are refused without a crash or a hang.
//
// HF_DATA (tests/test_kvcalc_data) comes from tests/CMakeLists.txt.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <streambuf>
#include <string>
#include <thread>
#include <type_traits>

#include "kvattn/analysis/hf_config.hpp"

namespace {

namespace an = kvattn::analysis;
using kvattn::Index;

std::string data(const std::string& name) { return std::string(HF_DATA) + "/" + name; }

std::filesystem::path scratch_dir() {
  static const std::filesystem::path dir = [] {
    auto d = std::filesystem::temp_directory_path() /
             ("hf_config_test_" + std::to_string(static_cast<long>(::getpid())));
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

an::HfReadOptions labelled(const std::string& label) {
  an::HfReadOptions options;
  options.label = label;
  return options;
}

/// The parse must fail with one line that starts with `label` and contains `expected`.
template <class Parse>
void check_error(Parse&& parse, const std::string& label, const std::string& expected) {
  try {
    parse();
    FAIL("no error; expected one containing: " << expected);
  } catch (const kvattn::hf_config_error& e) {
    const std::string message = e.what();
    INFO(message);
    CHECK(message.rfind(label, 0) == 0);
    CHECK(message.find('\n') == std::string::npos);
    CHECK(message.find("[json.exception") == std::string::npos);
    CHECK(message.find(expected) != std::string::npos);
  }
}

void check_text_error(const std::string& text, const std::string& expected) {
  check_error([&] { an::parse_hf_config(text, labelled("cfg")); }, "cfg", expected);
}

void check_file_error(const std::string& path, const std::string& expected) {
  check_error([&] { an::read_hf_config(path); }, "config file '" + path + "'", expected);
}

const std::string kMinimal =
    R"("hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32)";

/// A config of `keys` unread keys ("key0": 0, ...) before the three read ones.
std::string many_keys(int keys) {
  std::string text = "{";
  for (int i = 0; i < keys; ++i)
    text += "\"key" + std::to_string(i) + "\": " + std::to_string(i) + ", ";
  return text + kMinimal + "}";
}

/// The fastest of `runs` parses of `text`, in seconds: the minimum is the least
/// disturbed by other work on a shared machine.
double parse_seconds(const std::string& text, int runs) {
  double best = 1e300;
  for (int run = 0; run < runs; ++run) {
    const auto start = std::chrono::steady_clock::now();
    const an::HfModel model = an::parse_hf_config(text);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    REQUIRE(model.n_heads() == 32);
    best = std::min(best, seconds);
  }
  return best;
}

// Sanitizers and unoptimized builds make parsing many times slower: there the time's
// scaling is checked, not its absolute value.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__) || !defined(__OPTIMIZE__)
constexpr bool kTimed = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer) || __has_feature(undefined_behavior_sanitizer)
constexpr bool kTimed = false;
#else
constexpr bool kTimed = true;
#endif
#else
constexpr bool kTimed = true;
#endif

}  // namespace

TEST_CASE("hf_config_error is an invalid_argument and a kvattn::error, std::exception once",
          "[hf_config]") {
  static_assert(std::is_base_of_v<std::invalid_argument, kvattn::hf_config_error>);
  static_assert(std::is_base_of_v<kvattn::error, kvattn::hf_config_error>);
  static_assert(!std::is_base_of_v<kvattn::config_error, kvattn::hf_config_error>);
  // Unambiguous: with two std::exception bases this conversion would not compile.
  static_assert(std::is_convertible_v<kvattn::hf_config_error*, std::exception*>);
  bool by_std = false, by_standard_base = false, by_kvattn = false;
  try {
    an::parse_hf_config("[]");
  } catch (const std::exception& e) {
    by_std = std::string(e.what()).find("got an array") != std::string::npos;
  }
  try {
    an::parse_hf_config("[]");
  } catch (const std::invalid_argument& e) {
    by_standard_base = std::string(e.what()).find("got an array") != std::string::npos;
  }
  try {
    an::parse_hf_config("[]");
  } catch (const kvattn::error& e) {
    by_kvattn = std::string(e.what()).find("got an array") != std::string::npos;
  }
  CHECK(by_std);
  CHECK(by_standard_base);
  CHECK(by_kvattn);
}

TEST_CASE("hf_config reads GQA-family configs as the models cache", "[hf_config][analysis]") {
  // Llama 3 8B: 8 KV heads of 4096 / 32 = 128, 32 layers, bf16, RoPE theta 500000.
  const an::HfModel llama = an::read_hf_config(data("llama3_8b.json"));
  CHECK(llama.attention == an::HfAttention::gqa);
  REQUIRE(llama.gqa);
  CHECK_FALSE(llama.mla);
  CHECK(*llama.gqa ==
        kvattn::gqa_config(4096, 32, 128, 8, {kvattn::RopeLayout::half_split, 500000.0, 0}));
  CHECK(llama.stack == an::LayerStack{32, 0, 0});
  CHECK(llama.dtype == an::Dtype::bf16);
  CHECK(llama.name == "llama (llama3_8b.json)");  // model_type (file name)
  CHECK(llama.model_type == "llama");
  CHECK(llama.notes.empty());

  // Mistral 7B: sliding_window 4096 on every one of its 32 layers.
  CHECK(an::read_hf_config(data("mistral_7b.json")).stack == an::LayerStack{32, 32, 4096});
  // Qwen2 7B: use_sliding_window false, so no window, and a note saying so.
  const an::HfModel qwen = an::read_hf_config(data("qwen2_7b.json"));
  CHECK(qwen.stack == an::LayerStack{28, 0, 0});
  REQUIRE(qwen.notes.size() == 1);
  CHECK(qwen.notes[0] == "sliding_window 131,072 is not used (use_sliding_window is false)");
  CHECK(qwen.gqa->n_kv_heads == 4);
  // Gemma 2 9B: head_dim 256 (not 3584 / 16 = 224), every other of 42 layers local: 21.
  const an::HfModel gemma = an::read_hf_config(data("gemma2_9b.json"));
  CHECK(gemma.gqa->head_dim == 256);
  CHECK(gemma.stack == an::LayerStack{42, 21, 4096});
  CHECK(gemma.dtype == an::Dtype::fp32);
  // No num_key_value_heads: MHA, 2048 / 16 = 128, fp16.
  const an::HfModel mha = an::read_hf_config(data("mha_no_kv_heads.json"));
  CHECK(mha.attention == an::HfAttention::mha);
  CHECK(mha.gqa->n_kv_heads == 16);
  CHECK(mha.head_dim() == 128);
  CHECK(mha.dtype == an::Dtype::fp16);
  // layer_types: 3 of 4 layers "sliding_attention" over 512 tokens; one KV head: MQA;
  // the dtype under its newer key "dtype".
  const an::HfModel lt = an::read_hf_config(data("layer_types.json"));
  CHECK(lt.attention == an::HfAttention::mqa);
  CHECK(lt.stack == an::LayerStack{4, 3, 512});
  CHECK(lt.dtype == an::Dtype::bf16);
  CHECK(lt.gqa->head_dim == 64);
}

TEST_CASE("hf_config: text_config, Qwen2 window layers, attention_bias, rope_scaling types",
          "[hf_config]") {
  // Gemma 3 keeps the language model in text_config; sliding_window_pattern 6 makes every
  // 6th layer global: 34 - floor(34 / 6) = 29 local layers. torch_dtype at the top.
  const an::HfModel g3 = an::parse_hf_config(R"({
    "model_type": "gemma3", "torch_dtype": "bfloat16",
    "text_config": {"hidden_size": 2560, "num_attention_heads": 8, "num_key_value_heads": 4,
                    "head_dim": 256, "num_hidden_layers": 34, "sliding_window": 1024,
                    "sliding_window_pattern": 6, "rope_scaling": {"rope_type": "linear", "factor": 8}},
    "vision_config": {"hidden_size": 1152}})");
  CHECK(g3.name == "gemma3 (config.json)");
  CHECK(g3.stack == an::LayerStack{34, 29, 1024});
  CHECK(*g3.gqa == kvattn::gqa_config(2560, 8, 256, 4, {kvattn::RopeLayout::half_split}));
  CHECK(g3.dtype == an::Dtype::bf16);
  CHECK(g3.rope_scaling == "linear");
  // Qwen2 with use_sliding_window: layers from max_window_layers (21) on: 24 - 21 = 3.
  const an::HfModel q = an::parse_hf_config(R"({"model_type": "qwen2", "hidden_size": 896,
    "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24,
    "sliding_window": 32768, "use_sliding_window": true, "max_window_layers": 21,
    "attention_bias": true, "_name_or_path": "Qwen/Qwen2-0.5B"})");
  CHECK(q.stack == an::LayerStack{24, 3, 32768});
  CHECK(q.gqa->qkv_bias);
  CHECK(q.gqa->head_dim == 64);  // 896 / 14
  CHECK(q.name == "Qwen/Qwen2-0.5B");
  // A rope_scaling that is not YaRN is recorded and changes no config.
  const an::HfModel l =
      an::parse_hf_config("{" + kMinimal + R"(, "rope_scaling": {"rope_type": "llama3"}})");
  CHECK(l.rope_scaling == "llama3");
  CHECK(*l.gqa == kvattn::mha_config(4096, 32, 128, {kvattn::RopeLayout::half_split}));
}

TEST_CASE("hf_config: DeepSeek's config.json files give the library's MLA factories",
          "[hf_config][mla]") {
  // The fixtures carry no rope_scaling: the factories' configs without YaRN.
  kvattn::MlaConfig v2 = kvattn::deepseek_v2_config();
  v2.yarn = {};
  const an::HfModel ds = an::read_hf_config(data("deepseek_v2.json"));
  CHECK(ds.attention == an::HfAttention::mla);
  REQUIRE(ds.mla);
  CHECK_FALSE(ds.gqa);
  CHECK(*ds.mla == v2);
  CHECK(ds.layers() == 60);
  REQUIRE(ds.notes.size() == 1);
  CHECK(ds.notes[0] == "MLA recognised by kv_lora_rank; num_key_value_heads is not used");
  kvattn::MlaConfig lite = kvattn::deepseek_v2_lite_config();
  lite.yarn = {};
  const an::HfModel dsl = an::read_hf_config(data("deepseek_v2_lite.json"));
  CHECK(*dsl.mla == lite);  // q_lora_rank null: no query compression
  CHECK(dsl.layers() == 27);

  // The attention block of deepseek-ai/DeepSeek-V2's and -V3's config.json, rope_scaling
  // included: exactly deepseek_v2_config() and deepseek_v3_config().
  const std::string v2_json = R"({"hidden_size": 5120, "num_attention_heads": 128,
    "num_hidden_layers": 60, "num_key_value_heads": 128, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "rope_theta": 10000, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                     "type": "yarn"}})";
  const an::HfModel full = an::parse_hf_config(v2_json);
  CHECK(*full.mla == kvattn::deepseek_v2_config());
  CHECK(full.rope_scaling == "yarn");
  // m = 0.1 * 0.707 * ln 40 + 1 = 1.26080 (ln 40 = 3.688879).
  CHECK(full.mla->attention_factor() == Approx(1.2608038).epsilon(1e-7));
  std::string v3_json = v2_json;
  v3_json.replace(v3_json.find("5120"), 4, "7168");
  v3_json.replace(v3_json.find("0.707"), 5, "1.0");
  v3_json.replace(v3_json.find("0.707"), 5, "1.0");
  CHECK(*an::parse_hf_config(v3_json).mla == kvattn::deepseek_v3_config());
}

TEST_CASE("hf_config: the same one-line errors kvcalc gives, naming the input and field",
          "[hf_config][reliability]") {
  check_file_error(data("no_such_file.json"), ": no such file");
  check_file_error(std::string(HF_DATA), " is a directory; give the config.json file inside it");
  check_file_error(data("empty.json"), " is empty; expected a Hugging Face config.json object");
  check_file_error(data("truncated.json"), " is not valid JSON (truncated or malformed)");
  check_file_error(data("array.json"), " must hold a JSON object {...}, got an array");
  check_file_error(data("heads_string.json"),
                   ": \"num_attention_heads\" must be an integer, got the string \"32\"");
  check_file_error(data("heads_float.json"),
                   ": \"num_attention_heads\" must be an integer, got the number 32.5");
  check_file_error(data("layers_negative.json"), ": \"num_hidden_layers\" must be >= 1, got -1");
  check_file_error(data("heads_missing.json"), " has no \"num_attention_heads\"");
  check_file_error(data("dtype_unknown.json"), ": \"torch_dtype\" \"float13\" is not a type");
  check_file_error(data("kv_not_dividing.json"),
                   ": num_key_value_heads (5) must divide num_attention_heads (32)");
  check_file_error(data("kv_bool.json"),
                   ": \"num_key_value_heads\" must be an integer, got a boolean");
  check_file_error(data("kv_huge.json"), "is too large to represent");
  check_file_error(data("mla_no_rope.json"), " has no \"qk_rope_head_dim\"");
  // The caller's label starts every message (kvcalc passes "--hf-config '<path>'").
  check_error([] { an::read_hf_config(data("array.json"), labelled("--hf-config 'a'")); },
              "--hf-config 'a'", "got an array");
  // A label with a newline still gives one line.
  check_error([] { an::parse_hf_config("[]", labelled("two\nlines")); }, "two lines", "array");
  // Fields inside text_config and rope_scaling are named with their path.
  check_text_error(R"({"text_config": {"hidden_size": 64, "num_attention_heads": "8",
                       "num_hidden_layers": 2}})",
                   "\"text_config.num_attention_heads\" must be an integer, got the string");
  check_text_error("{" + kMinimal + R"(, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rope_scaling": {"type": "yarn", "factor": "40"}})",
                   "\"rope_scaling.factor\" must be a number, got the string \"40\"");
  check_text_error("{" + kMinimal + R"(, "rope_scaling": [1]})",
                   "\"rope_scaling\" must be an object {...}, got an array");
  // A model the configs refuse (YaRN's beta_slow must stay below beta_fast) names the file.
  check_text_error("{" + kMinimal + R"(, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rope_scaling": {"type": "yarn", "factor": 40,
    "original_max_position_embeddings": 4096, "beta_fast": 1, "beta_slow": 32}})",
                   ": impossible configuration: MlaConfig: yarn.beta_slow");
  // Dimensions whose sizes overflow 64 bits (each below the 2^53 cap): the config says so.
  check_text_error(R"({"hidden_size": 4503599627370496, "num_attention_heads": 1,
                       "num_hidden_layers": 1, "head_dim": 4503599627370496})",
                   ": impossible configuration: GqaConfig:");
}

TEST_CASE("hf_config finding 10: a value nested 300,000 deep is refused, not a crash",
          "[hf_config][reliability]") {
  // Before: a stack overflow (SIGSEGV) in ordered_json's recursive copy.
  const std::size_t n = 300'000;
  const std::string deep =
      "{\"x\": " + std::string(n, '[') + std::string(n, ']') + ", " + kMinimal + "}";
  check_text_error(deep, " nests deeper than 64 levels at \"x[0][0][0]");
  // The limit is exact: 64 levels (the top object and 63 arrays) are read, 65 are not.
  const auto nested = [](std::size_t arrays) {
    return "{\"x\": " + std::string(arrays, '[') + std::string(arrays, ']') + ", " + kMinimal + "}";
  };
  CHECK(an::parse_hf_config(nested(63)).layers() == 32);
  check_text_error(nested(64), "nests deeper than 64 levels");
  an::HfReadOptions shallow;
  shallow.max_depth = 2;
  CHECK_THROWS_WITH(an::parse_hf_config(nested(2), shallow),
                    Catch::Contains("nests deeper than 2 levels at \"x[0]\""));
}

TEST_CASE("hf_config finding 11: parsing is linear; keys it does not read are never stored",
          "[hf_config][reliability]") {
  // Before: ordered_json inserted every key by a linear search, O(n^2): 100k keys took
  // 14 s. Tested by its mechanism here (of 200,000 keys only the 3 read ones enter the
  // document, so each key costs one look-up in a fixed list of names) and by its time
  // in the next test.
  const std::string text = many_keys(200'000);
  const an::detail::HfDocument kept =
      an::detail::hf_parse_document(text, "cfg", an::HfReadOptions{});
  CHECK(kept.root.size() == 3);
  CHECK(kept.root.at("num_hidden_layers") == 32);
  CHECK(an::parse_hf_config(text).n_heads() == 32);
  // Containers under unread keys are dropped whole; under read keys only what is read
  // stays: not text_config's unread members, not the arrays' entries. layer_types'
  // entries are counted, not stored: 3 entries, 1 sliding, 2 not strings.
  const an::detail::HfDocument doc = an::detail::hf_parse_document(
      R"({"id2label": {"0": "a", "1": "b"}, "text_config": {"vision": {"x": 1}, "head_dim": 8},
          "num_attention_heads": [1, 2, 3],
          "layer_types": [{"a": 1}, "sliding_attention", 7]})",
      "cfg", an::HfReadOptions{});
  CHECK(doc.root == nlohmann::json::parse(R"({"text_config": {"head_dim": 8},
                                              "num_attention_heads": [], "layer_types": []})"));
  REQUIRE(doc.layer_types.count("") == 1);
  CHECK(doc.layer_types.at("").entries == 3);
  CHECK(doc.layer_types.at("").sliding == 1);
  CHECK(doc.layer_types.at("").not_strings == 2);
  // And the fields read keep their errors: an array where a count belongs is named.
  check_text_error(R"({"hidden_size": 64, "num_attention_heads": [1, 2], "num_hidden_layers": 1})",
                   "\"num_attention_heads\" must be an integer, got an array");
  check_text_error("{" + kMinimal + R"(, "layer_types": [1], "num_hidden_layers": 1})",
                   "\"layer_types\" entries must be strings");
}

TEST_CASE("hf_config finding 11: parse time is linear in the keys, 200k well under a second",
          "[hf_config][reliability]") {
  // Doubling the keys must not quadruple the time. T(n) = a n + b n^2 gives
  // T(2n) / T(n) = (2a + 4bn) / (a + bn), below 4 for every a > 0: a bound of 4 could
  // never fail, so the bound is 3. Linear parsing measures about 2 (each time the
  // fastest of 3, interleaved, so a preempted run does not count); the old quadratic
  // parser, 14 s at 100k keys against about 0.1 s of linear work, was about 4.
  const std::string keys200k = many_keys(200'000);
  const std::string keys400k = many_keys(400'000);
  REQUIRE(keys400k.size() < an::kHfMaxBytes);
  double t200 = parse_seconds(keys200k, 1);
  // A quadratic parser takes minutes on 400k keys: stop here rather than wait.
  REQUIRE(t200 < (kTimed ? 2.0 : 60.0));
  double t400 = parse_seconds(keys400k, 1);
  for (int round = 0; round < 2; ++round) {
    t200 = std::min(t200, parse_seconds(keys200k, 1));
    t400 = std::min(t400, parse_seconds(keys400k, 1));
  }
  INFO("200k keys: " << t200 << " s, 400k keys: " << t400 << " s, ratio " << t400 / t200);
  CHECK(t400 < 3.0 * t200);
  if (kTimed) CHECK(t200 < 2.0);  // about 0.1 s in an optimized build
}

TEST_CASE("hf_config finding 12: a size cap, and devices, directories and FIFOs refused first",
          "[hf_config][reliability]") {
  // Text and streams: at most max_bytes.
  an::HfReadOptions small;
  small.label = "cfg";
  small.max_bytes = 100;
  const std::string exactly = "{" + kMinimal + "}" + std::string(100 - kMinimal.size() - 2, ' ');
  REQUIRE(exactly.size() == 100);
  CHECK(an::parse_hf_config(exactly, small).layers() == 32);
  CHECK_THROWS_WITH(
      an::parse_hf_config(exactly + " ", small),
      "cfg is larger than the 100-byte limit; a Hugging Face config.json is a few KB");
  std::istringstream stream(exactly + " ");
  CHECK_THROWS_WITH(an::parse_hf_config(stream, small),
                    Catch::Contains("larger than the 100-byte limit"));
  // The default cap, 16 MiB, on a stream of 16 MiB + 1 spaces.
  std::istringstream big(std::string((std::size_t{16} << 20) + 1, ' '));
  CHECK_THROWS_WITH(an::parse_hf_config(big), Catch::Contains("larger than the 16 MiB limit"));
  // A file's size is checked before reading: a sparse file of 17 MiB = 17,825,792 bytes.
  const auto huge = scratch_dir() / "huge.json";
  { std::ofstream(huge).put(' '); }
  std::filesystem::resize_file(huge, std::uintmax_t{17} << 20);
  check_file_error(huge.string(),
                   " is larger than the 16 MiB limit (17,825,792 bytes); a Hugging Face");
  // Devices never reach the reader: before, /dev/zero ran until memory ran out and
  // /dev/urandom never finished.
  check_file_error("/dev/zero", " is a character device, not a regular file");
  check_file_error("/dev/urandom", " is a character device, not a regular file");
  // A FIFO without a writer: opening it would block forever.
  const auto fifo = scratch_dir() / "fifo.json";
  std::filesystem::remove(fifo);
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  check_file_error(fifo.string(), " is a FIFO, not a regular file");
  std::filesystem::remove(fifo);
  check_file_error(scratch_dir().string(), " is a directory");
}

TEST_CASE("hf_config: a file is checked on the descriptor it is read from",
          "[hf_config][reliability]") {
  // read_hf_config checks the path, then reads the file through hf_read_file, which
  // opens it without blocking and checks the descriptor with fstat: a file swapped for
  // a FIFO after the path's checks is refused, not waited on. Called here directly on
  // a FIFO, as it would meet one. If the open blocked (no O_NONBLOCK), a watchdog opens
  // the FIFO for writing after 2 s, which unblocks it, and the test fails, not hangs.
  const auto fifo = scratch_dir() / "swapped.json";
  std::filesystem::remove(fifo);
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::atomic<bool> unblocked{false};
  std::thread watchdog([&] {
    std::unique_lock<std::mutex> lock(mutex);
    if (cv.wait_for(lock, std::chrono::seconds(2), [&] { return done; })) return;
    const int writer = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (writer >= 0) {
      unblocked = true;
      ::close(writer);
    }
  });
  check_error([&] { an::detail::hf_read_file(fifo, "cfg", an::kHfMaxBytes); }, "cfg",
              " is a FIFO, not a regular file; give a config.json file");
  {
    const std::lock_guard<std::mutex> lock(mutex);
    done = true;
  }
  cv.notify_one();
  watchdog.join();
  CHECK_FALSE(unblocked.load());
  std::filesystem::remove(fifo);
  // The same checks as on the path, now on the descriptor: a device, a directory, a
  // missing file, the size cap (a sparse 17 MiB file).
  check_error([&] { an::detail::hf_read_file("/dev/null", "cfg", an::kHfMaxBytes); }, "cfg",
              " is a character device, not a regular file");
  check_error([&] { an::detail::hf_read_file(scratch_dir(), "cfg", an::kHfMaxBytes); }, "cfg",
              " is a directory; give the config.json file inside it");
  check_error(
      [&] { an::detail::hf_read_file(scratch_dir() / "absent.json", "cfg", an::kHfMaxBytes); },
      "cfg", ": no such file");
  const auto huge = scratch_dir() / "huge_fd.json";
  { std::ofstream(huge).put(' '); }
  std::filesystem::resize_file(huge, std::uintmax_t{17} << 20);
  check_error([&] { an::detail::hf_read_file(huge, "cfg", an::kHfMaxBytes); }, "cfg",
              " is larger than the 16 MiB limit (17,825,792 bytes); a Hugging Face");
  std::filesystem::remove(huge);
  // A file of several read chunks (64 KiB each) is read whole: 200,000 bytes of
  // whitespace before the object, and exactly the cap is accepted, one byte more not.
  const auto padded = scratch_dir() / "padded.json";
  const std::string body = std::string(200'000, ' ') + "{" + kMinimal + "}";
  { std::ofstream(padded, std::ios::binary) << body; }
  CHECK(an::detail::hf_read_file(padded, "cfg", body.size()) == body);
  CHECK(an::read_hf_config(padded).n_heads() == 32);
  check_error([&] { an::detail::hf_read_file(padded, "cfg", body.size() - 1); }, "cfg",
              " is larger than the 200072-byte limit (200,073 bytes)");
  std::filesystem::remove(padded);
}

TEST_CASE("hf_config finding 14: library errors become one line naming the file and field",
          "[hf_config][reliability]") {
  // Before: "[json.exception.out_of_range.406] number overflow parsing '1e400'".
  check_text_error(R"({"hidden_size": 1e400, "num_attention_heads": 32, "num_hidden_layers": 32})",
                   "cfg: \"hidden_size\" 1e400 is too large to represent");
  check_text_error(R"({"text_config": {"rope_scaling": {"factor": -1e999}}})",
                   "\"text_config.rope_scaling.factor\" -1e999 is too large to represent");
  // Before: "[json.exception.type_error.302] type must be string, but is number".
  check_text_error("{\"model_type\": 5, \"sliding_window\": 4096, " + kMinimal + "}",
                   "cfg: \"model_type\" must be a string, got the number 5");
  // Syntax errors name the field they are in, without nlohmann's prefix.
  check_text_error(
      "{" + kMinimal + ", \"layer_types\": [\"full_attention\", }",
      "is not valid JSON (truncated or malformed) near \"layer_types[0]\": parse error");
  check_text_error("{\"hidden_size\": 40x96}",
                   "is not valid JSON (truncated or malformed) near \"hidden_size\"");
  // Before: "basic_filebuf::underflow error reading the file" (from /proc/self/mem).
  if (std::filesystem::exists("/proc/self/mem")) {
    check_file_error("/proc/self/mem", " cannot be read: Input/output error");
  }
  // A stream whose buffer fails while reading.
  struct Failing : std::streambuf {
    int_type underflow() override { throw std::ios_base::failure("device gone"); }
  } failing;
  std::istream in(&failing);
  check_error([&] { an::parse_hf_config(in, labelled("stream")); }, "stream", " cannot be read: ");
}

TEST_CASE("hf_config reads a stream whatever its exception mask", "[hf_config]") {
  std::istringstream in("{" + kMinimal + "}");
  in.exceptions(std::ios::failbit | std::ios::badbit | std::ios::eofbit);
  CHECK(an::parse_hf_config(in).n_heads() == 32);
}
