#include "presets.hpp"

#include <cctype>

#include "kvattn/config/lrkv_config.hpp"
#include "kvattn/config/mla_config.hpp"

namespace kvcalc {
namespace {

// Layer counts are the models' config.json num_hidden_layers: kvattn's configs describe
// one attention layer, so the depth is the preset's own fact.
constexpr Index kDeepSeekV2Layers = 60;
constexpr Index kDeepSeekV2LiteLayers = 27;
// The GQA row of DeepSeek-V2's ablation: 8 KV heads.
constexpr Index kDeepSeekGqaHeads = 8;

Shape mla_shape(const kvattn::MlaConfig& c, Index layers, const std::string& source) {
  Shape s;
  s.heads = c.n_heads;
  s.head_dim = c.qk_nope_dim;
  s.layers = layers;
  s.d_model = c.d_model;
  s.kv_heads = kDeepSeekGqaHeads;
  s.kv_rank = c.kv_rank;
  s.q_rank = c.q_rank;
  s.rope_dim = c.rope_dim;
  s.v_dim = c.v_dim;
  s.own = "MLA";
  s.source = source;
  return s;
}

/// One scale of the LRKV paper (seed 000, Table 7): d_h 128, d = 128 H, rank r.
struct LrkvScale {
  const char* label;  // "128M"
  Index heads;
  Index rank;
  Index layers;
  const char* layers_from;  // where the layer count comes from
};

constexpr LrkvScale kLrkvScales[] = {
    {"128M", 6, 46, 12, "Table 12"},
    {"1.2B", 12, 51, 36, "estimated"},
    {"2.5B", 18, 55, 36, "Table 12"},
    {"6.3B", 32, 54, 36, "Table 12"},
};

kvattn::LrkvConfig lrkv_config(const LrkvScale& scale) {
  kvattn::LrkvConfig c;
  c.head_dim = 128;
  c.n_heads = scale.heads;
  c.d_model = scale.heads * c.head_dim;
  c.rank = scale.rank;
  return c;
}

/// The MLA row uses d_c 384 and no rope channel, as the paper's Table 8 baseline counts it.
Shape lrkv_shape(const LrkvScale& scale) {
  const kvattn::LrkvConfig c = lrkv_config(scale);
  Shape s;
  s.heads = c.n_heads;
  s.head_dim = c.head_dim;
  s.d_model = c.d_model;
  s.layers = scale.layers;
  s.lrkv_rank = c.rank;
  s.kv_rank = 384;
  s.rope_dim = 0;
  s.own = "LRKV";
  s.source = std::string("LRKV paper ") + scale.label;
  return s;
}

std::string mla_description(const char* title, const kvattn::MlaConfig& c, Index layers,
                            bool with_d_model) {
  std::string text = std::string(title) + ": " + std::to_string(layers) + " layers, " +
                     std::to_string(c.n_heads) + " heads x " + std::to_string(c.qk_nope_dim) +
                     ", d_c " + std::to_string(c.kv_rank) + ", d_R " + std::to_string(c.rope_dim);
  if (with_d_model) text += ", d " + std::to_string(c.d_model);
  return text;
}

std::vector<Preset> make_presets() {
  constexpr kvattn::MlaConfig v2 = kvattn::deepseek_v2_config();
  constexpr kvattn::MlaConfig lite = kvattn::deepseek_v2_lite_config();
  std::vector<Preset> list = {
      {"deepseek-v2", mla_description("DeepSeek-V2 (236B)", v2, kDeepSeekV2Layers, true),
       [] { return mla_shape(kvattn::deepseek_v2_config(), kDeepSeekV2Layers, "DeepSeek-V2"); }},
      {"deepseek-v2-lite",
       mla_description("DeepSeek-V2-Lite (16B)", lite, kDeepSeekV2LiteLayers, false),
       [] {
         return mla_shape(kvattn::deepseek_v2_lite_config(), kDeepSeekV2LiteLayers,
                          "DeepSeek-V2-Lite");
       }},
  };
  for (const LrkvScale& scale : kLrkvScales) {
    std::string name = std::string("lrkv-") + scale.label;
    for (char& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    const kvattn::LrkvConfig c = lrkv_config(scale);
    list.push_back({name,
                    std::string("LRKV paper ") + scale.label + ": " + std::to_string(c.n_heads) +
                        " heads x " + std::to_string(c.head_dim) + ", r " + std::to_string(c.rank) +
                        ", " + std::to_string(scale.layers) + " layers (" + scale.layers_from + ")",
                    [scale] { return lrkv_shape(scale); }});
  }
  return list;
}

}  // namespace

const std::vector<Preset>& presets() {
  static const std::vector<Preset> list = make_presets();
  return list;
}

Shape preset_shape(const std::string& name) {
  for (const Preset& p : presets()) {
    if (name == p.name) return p.make();
  }
  std::string names;
  for (const Preset& p : presets()) names += (names.empty() ? "" : ", ") + p.name;
  fail("--preset '" + name + "' is unknown; use one of " + names + " (see --list-presets)");
}

Shape default_shape() {
  Shape s = preset_shape("deepseek-v2");
  s.own.clear();
  s.source = "DeepSeek-V2 shape";
  return s;
}

}  // namespace kvcalc
