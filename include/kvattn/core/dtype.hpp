// Storage types of a KV cache and their sizes: the storage scalar -> Dtype mapping the
// caches use to name their layout, and the element sizes the analytic module counts
// with (re-exported as kvattn::analysis::Dtype etc. by analysis/dtype.hpp).
//
// Byte counts never hard-code "2 bytes per element": they go through
// bytes_per_element(Dtype). Everything here is constexpr and free of Eigen.
#pragma once

#include <optional>
#include <string_view>
#include <type_traits>

#include "kvattn/core/index.hpp"

// Eigen's narrow scalar types, declared here so this header stays free of Eigen.
namespace Eigen {
struct bfloat16;
struct half;
}  // namespace Eigen

namespace kvattn {

/// Element type of a cache buffer.
enum class Dtype {
  fp64,      // IEEE double, 8 bytes (a GqaCache<double> stores this)
  fp32,      // IEEE single, 4 bytes
  bf16,      // bfloat16, 2 bytes (the seeds' and most checkpoints' cache type)
  fp16,      // IEEE half, 2 bytes
  fp8_e4m3,  // 8-bit float (e4m3fn), 1 byte; usually with block scales
  fp8_e5m2,  // 8-bit float (e5m2), 1 byte
  int8,      // 8-bit integer, 1 byte; needs scales to mean anything
};

/// Bytes one element of `dtype` occupies.
constexpr Index bytes_per_element(Dtype dtype) {
  switch (dtype) {
    case Dtype::fp64:
      return 8;
    case Dtype::fp32:
      return 4;
    case Dtype::bf16:
    case Dtype::fp16:
      return 2;
    case Dtype::fp8_e4m3:
    case Dtype::fp8_e5m2:
    case Dtype::int8:
      return 1;
  }
  return 0;  // unreachable for a valid enumerator
}

/// The canonical short name ("fp32", "bf16", "fp8_e4m3", ...).
constexpr std::string_view to_string(Dtype dtype) {
  switch (dtype) {
    case Dtype::fp64:
      return "fp64";
    case Dtype::fp32:
      return "fp32";
    case Dtype::bf16:
      return "bf16";
    case Dtype::fp16:
      return "fp16";
    case Dtype::fp8_e4m3:
      return "fp8_e4m3";
    case Dtype::fp8_e5m2:
      return "fp8_e5m2";
    case Dtype::int8:
      return "int8";
  }
  return "unknown";
}

/// Parses a dtype name: the canonical names above, the PyTorch / Hugging Face
/// `torch_dtype` spellings ("float32", "bfloat16", "float16", "half", "float64",
/// "float8_e4m3fn", "float8_e5m2") and the short "fp8" (= fp8_e4m3). Case-sensitive,
/// as config.json files are. std::nullopt for anything else.
constexpr std::optional<Dtype> parse_dtype(std::string_view name) {
  struct Entry {
    std::string_view name;
    Dtype dtype;
  };
  constexpr Entry table[] = {
      {"fp64", Dtype::fp64},         {"float64", Dtype::fp64},
      {"double", Dtype::fp64},       {"fp32", Dtype::fp32},
      {"float32", Dtype::fp32},      {"float", Dtype::fp32},
      {"bf16", Dtype::bf16},         {"bfloat16", Dtype::bf16},
      {"fp16", Dtype::fp16},         {"float16", Dtype::fp16},
      {"half", Dtype::fp16},         {"fp8", Dtype::fp8_e4m3},
      {"fp8_e4m3", Dtype::fp8_e4m3}, {"float8_e4m3fn", Dtype::fp8_e4m3},
      {"fp8_e5m2", Dtype::fp8_e5m2}, {"float8_e5m2", Dtype::fp8_e5m2},
      {"int8", Dtype::int8},
  };
  for (const Entry& entry : table) {
    if (entry.name == name) return entry.dtype;
  }
  return std::nullopt;
}

/// A block-quantized storage type (core/quantized.hpp): each cached row of w elements is
/// stored as w codes of `Code` (Dtype::int8 or Dtype::fp8_e4m3), one byte each, followed
/// by ceil(w / Block) fp32 scales, one per block of Block elements along the row (the last
/// block may be shorter; a block never spans two rows). Use the aliases kvattn::Int8<B> and
/// kvattn::Fp8E4M3<B>.
template <Dtype Code, Index Block>
struct BlockQuantized {
  static_assert(Code == Dtype::int8 || Code == Dtype::fp8_e4m3,
                "kvattn::BlockQuantized: the codes are int8 or fp8_e4m3");
  static_assert(Block >= 1, "kvattn::BlockQuantized: a block holds at least one element");
  static constexpr Dtype code = Code;
  static constexpr Index block = Block;
};

template <class S>
inline constexpr bool is_block_quantized_v = false;
template <Dtype Code, Index Block>
inline constexpr bool is_block_quantized_v<BlockQuantized<Code, Block>> = true;

/// The Dtype of a C++ storage scalar: float -> fp32, double -> fp64, Eigen::bfloat16 ->
/// bf16, Eigen::half -> fp16, BlockQuantized<Code, B> -> Code (the storage types the
/// library's caches take). Other
/// types do not compile, so a new storage type must be added here first.
template <class S>
constexpr Dtype dtype_of() {
  if constexpr (std::is_same_v<S, float>) {
    return Dtype::fp32;
  } else if constexpr (std::is_same_v<S, double>) {
    return Dtype::fp64;
  } else if constexpr (std::is_same_v<S, Eigen::bfloat16>) {
    return Dtype::bf16;
  } else if constexpr (std::is_same_v<S, Eigen::half>) {
    return Dtype::fp16;
  } else if constexpr (is_block_quantized_v<S>) {
    return S::code;  // the codes' type; the scales are fp32
  } else {
    static_assert(sizeof(S) == 0, "kvattn::dtype_of: no Dtype for this storage type");
  }
}

}  // namespace kvattn
