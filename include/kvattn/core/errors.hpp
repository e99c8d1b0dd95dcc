// Error types thrown by every public call on bad input, in every build type.
//
// Every kvattn exception derives from kvattn::error and from one standard exception:
//   config_error, shape_error                  std::invalid_argument (here)
//   overflow_error                             std::overflow_error (here)
//   length_error                               std::length_error (here)
//   pooling_error                              std::invalid_argument (pooling/token_mask.hpp)
//   pool_exhausted                             std::runtime_error (cache/page_pool.hpp)
//   hf_config_error                            std::invalid_argument (analysis/hf_config.hpp)
// kvattn::error does not derive from std::exception itself: if it did, each of these
// would hold two std::exception bases and `catch (const std::exception&)` would be
// ambiguous and stop catching them. So `catch (const std::exception&)`, a catch by the
// standard base and `catch (const kvattn::error&)` all catch every one of them.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

#include "kvattn/core/index.hpp"

namespace kvattn {

/// The base of every kvattn exception (a mixin beside the standard base).
class error {
 public:
  virtual ~error() = default;
  /// The message, as std::exception::what() gives it.
  virtual const char* what() const noexcept = 0;

 protected:
  error() = default;
  error(const error&) = default;
  error& operator=(const error&) = default;
};

/// A configuration breaks a rule; the message names the field, its value and the rule.
class config_error : public std::invalid_argument, public error {
 public:
  using std::invalid_argument::invalid_argument;
  const char* what() const noexcept override { return std::invalid_argument::what(); }
};

/// An argument has the wrong shape; the message names the argument, the expected
/// shape and the shape that came.
class shape_error : public std::invalid_argument, public error {
 public:
  using std::invalid_argument::invalid_argument;
  const char* what() const noexcept override { return std::invalid_argument::what(); }
};

/// A total (over layers, sequence length, batch) does not fit in a signed 64-bit
/// integer: the analytic module's answer cannot be represented. A valid layer can
/// still overflow a total, so this is not a config_error.
class overflow_error : public std::overflow_error, public error {
 public:
  using std::overflow_error::overflow_error;
  const char* what() const noexcept override { return std::overflow_error::what(); }
};

/// A cache capacity (tokens x elements per token) whose size in bytes cannot be
/// represented: the reserve or append that asked for it changed nothing.
class length_error : public std::length_error, public error {
 public:
  using std::length_error::length_error;
  const char* what() const noexcept override { return std::length_error::what(); }
};

/// A value the storage cannot represent: a NaN or an infinity appended to a block-quantized
/// cache (core/quantized.hpp), whose block scale would then be meaningless. The call that
/// met it changed nothing.
class value_error : public std::domain_error, public error {
 public:
  using std::domain_error::domain_error;
  const char* what() const noexcept override { return std::domain_error::what(); }
};

namespace detail {

inline void append_part(std::string& text, std::string_view part) { text += part; }
inline void append_part(std::string& text, const char* part) { text += part; }
inline void append_part(std::string& text, const std::string& part) { text += part; }
inline void append_part(std::string& text, double value) { text += std::to_string(value); }
inline void append_part(std::string& text, bool value) { text += value ? "1" : "0"; }
template <class Integer>
requires std::is_integral_v<Integer>
inline void append_part(std::string& text, Integer value) { text += std::to_string(value); }

/// The parts concatenated (strings as they are, numbers by std::to_string).
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::string text;
  (append_part(text, parts), ...);
  return text;
}

/// Throws config_error with the parts concatenated. Not constexpr: a constant
/// evaluation that reaches it fails to compile, which is what a bad constexpr config
/// should do.
template <class... Parts>
[[noreturn]] void fail_config(const Parts&... parts) {
  throw config_error(concat(parts...));
}

/// "(any x 128)" style shape text; a negative extent means "any".
inline std::string shape_text(Index rows, Index cols) {
  std::string text = "(";
  text += rows < 0 ? std::string("any") : std::to_string(rows);
  text += " x ";
  text += cols < 0 ? std::string("any") : std::to_string(cols);
  text += ")";
  return text;
}

/// Throws shape_error unless `actual` is `expected_rows x expected_cols`
/// (a negative expected extent accepts any value).
template <class Matrix>
void check_shape(const char* where, const char* what, const Matrix& actual, Index expected_rows,
                 Index expected_cols) {
  const bool rows_ok = expected_rows < 0 || actual.rows() == expected_rows;
  const bool cols_ok = expected_cols < 0 || actual.cols() == expected_cols;
  if (!rows_ok || !cols_ok) {
    throw shape_error(std::string(where) + ": " + what + " has shape " +
                      shape_text(actual.rows(), actual.cols()) + ", expected " +
                      shape_text(expected_rows, expected_cols));
  }
}

/// Throws shape_error unless 0 <= index < count: "<where>: <what> (<index>) must be in
/// [0, <count>)".
inline void check_index(const char* where, const char* what, Index index, Index count) {
  if (index < 0 || index >= count) {
    throw shape_error(std::string(where) + ": " + what + " (" + std::to_string(index) +
                      ") must be in [0, " + std::to_string(count) + ")");
  }
}

/// Throws config_error with "<where>: <field> (<value>) <rule>" unless `ok`. Usable in
/// constant expressions (only the throwing branch is not constant).
template <class Value>
constexpr void require(bool ok, const char* where, const char* field, const Value& value,
                       std::string_view rule) {
  if (!ok) fail_config(where, ": ", field, " (", value, ") ", rule);
}

/// Throws shape_error unless the cache holds a token to attend from: attend() is
/// the step of the newest cached token.
inline void require_tokens(const char* where, Index tokens) {
  if (tokens < 1) {
    throw shape_error(std::string(where) +
                      ": the cache holds 0 tokens, expected at least 1 (attend computes the "
                      "step of the newest cached token; append or decode it first)");
  }
}

}  // namespace detail
}  // namespace kvattn
