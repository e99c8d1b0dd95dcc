// libFuzzer target: kvattn::analysis::parse_hf_config on arbitrary bytes.
//
// Beyond "no crash, no sanitizer report", each input checks the parser's promises:
// - it either returns a model or throws kvattn::hf_config_error; any other exception
//   escapes and fails the run (a raw nlohmann or standard-library error would);
// - an error is one line, starts with the input's label, and is not nlohmann's raw text;
// - a model has exactly one of gqa / mla, both valid, and a consistent layer stack whose
//   cache size the analysis module can compute;
// - the string and std::istream overloads agree.
// Seed corpus and regression inputs: tests/fuzz/hf_config/.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <string_view>

#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/analysis/hf_config.hpp"

namespace {

namespace an = kvattn::analysis;

[[noreturn]] void violated(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_hf_config: %s: %s\n", what, detail.c_str());
  std::abort();
}

constexpr const char* kLabel = "fuzz.json";

void check_error(const std::string& message, const std::string& input) {
  if (message.rfind(kLabel, 0) != 0) violated("message does not start with the label", message);
  // nlohmann's own text, unless the input holds it (messages quote fields and tokens).
  if (message.find("[json.exception") != std::string::npos &&
      input.find("[json.exception") == std::string::npos) {
    violated("raw nlohmann message", message);
  }
  for (const char ch : message) {
    if (static_cast<unsigned char>(ch) < 0x20) violated("message is not one line", message);
  }
}

void check_model(const an::HfModel& m) {
  if (m.gqa.has_value() == m.mla.has_value()) violated("not exactly one config", m.name);
  if (m.is_mla() != (m.attention == an::HfAttention::mla)) violated("attention kind", m.name);
  if (m.gqa) m.gqa->validate();  // a config_error escapes: the parser let it through
  if (m.mla) m.mla->validate();
  an::check(m.stack);
  if (m.layers() < 1 || m.layers() > an::kHfMaxCount) violated("layer count", m.name);
  if (m.n_heads() < 1 || m.head_dim() < 1 || m.d_model() < 1) violated("dimensions", m.name);
  if (m.name.empty()) violated("empty name", "");
  // The analysis accepts it: one layer's elements per token (an overflow_error of a
  // total is legitimate for huge shapes, so only the per-layer size is required).
  if (m.gqa) static_cast<void>(an::elements_per_token_per_layer(*m.gqa));
  if (m.mla) static_cast<void>(an::elements_per_token_per_layer(*m.mla));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  an::HfReadOptions options;
  options.label = kLabel;

  std::string text_error, stream_error;
  an::HfModel from_text, from_stream;
  try {
    from_text = an::parse_hf_config(std::string_view(text), options);
  } catch (const kvattn::hf_config_error& e) {
    text_error = e.what();
    check_error(text_error, text);
  }
  std::istringstream in(text);
  try {
    from_stream = an::parse_hf_config(in, options);
  } catch (const kvattn::hf_config_error& e) {
    stream_error = e.what();
  }
  if (text_error != stream_error)
    violated("string and stream disagree", text_error + " | " + stream_error);
  if (text_error.empty()) {
    check_model(from_text);
    if (from_text.gqa != from_stream.gqa || from_text.mla != from_stream.mla ||
        from_text.stack != from_stream.stack || from_text.name != from_stream.name) {
      violated("string and stream models differ", from_text.name);
    }
  }
  return 0;
}
