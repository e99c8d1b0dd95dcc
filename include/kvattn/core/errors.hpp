// Error types thrown by every public call on bad input, in every build type.
#pragma once

#include <stdexcept>
#include <string>

#include "kvattn/core/types.hpp"

namespace kvattn {

/// A configuration breaks a rule; the message names the field, its value and the rule.
class config_error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// An argument has the wrong shape; the message names the argument, the expected
/// shape and the shape that came.
class shape_error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {

/// "(any x 128)" style shape text; a negative extent means "any".
// Built with += rather than "literal" + std::string: GCC 12 reports a false
// -Wrestrict on the inlined operator+ at -O2 (GCC bug 105329).
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

/// Throws config_error with "<where>: <field> (<value>) <rule>" unless `ok`.
template <class Value>
void require(bool ok, const char* where, const char* field, const Value& value,
             const std::string& rule) {
  if (!ok) {
    throw config_error(std::string(where) + ": " + field + " (" + std::to_string(value) + ") " +
                       rule);
  }
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
