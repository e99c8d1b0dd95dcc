// Which tokens of a sequence enter a pooled vector, and the checks every pooling
// call shares.
//
// NV-Embed masks the instruction tokens of a query out of the pooled mean: they
// still shape the other tokens through self-attention, but their own vectors are
// not averaged in (seed 002, Chapter 6).
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "kvattn/core/errors.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn {

/// A pooling call has nothing to pool: an empty sequence, or a mask that drops every
/// token. The message says which and how to fix it.
class pooling_error : public std::invalid_argument, public error {
 public:
  using std::invalid_argument::invalid_argument;
  const char* what() const noexcept override { return std::invalid_argument::what(); }
};

/// One flag per token (true: the token enters the pooled vector). An empty mask
/// means every token.
using TokenMask = std::vector<bool>;

/// A mask keeping every one of `length` tokens.
inline TokenMask all_tokens(Index length) {
  return TokenMask(static_cast<std::size_t>(length < 0 ? 0 : length), true);
}

/// A mask dropping the first `prefix` tokens (e.g. an instruction) of `length`.
inline TokenMask skip_prefix(Index length, Index prefix) {
  TokenMask mask = all_tokens(length);
  for (Index i = 0; i < prefix && i < length; ++i) mask[static_cast<std::size_t>(i)] = false;
  return mask;
}

namespace detail {

/// Whether token i is kept by `mask` (an empty mask keeps every token).
inline bool kept(const TokenMask& mask, Index i) {
  return mask.empty() || mask[static_cast<std::size_t>(i)];
}

/// Checks a pooling input x (L x d) and its mask; returns the number of kept tokens.
/// Throws shape_error on a wrong width or mask length, pooling_error when nothing
/// is left to pool.
template <class Matrix>
Index check_pool_input(const char* where, const Matrix& x, Index d_model, const TokenMask& mask) {
  check_shape(where, "x", x, -1, d_model);
  if (x.rows() == 0) {
    throw pooling_error(std::string(where) + ": x has no tokens " + shape_text(0, x.cols()) +
                        "; pooling needs at least one token (L >= 1)");
  }
  if (!mask.empty() && static_cast<Index>(mask.size()) != x.rows()) {
    throw shape_error(std::string(where) + ": mask has " + std::to_string(mask.size()) +
                      " entries, expected " + std::to_string(x.rows()) +
                      " (one per token of x), or none to keep every token");
  }
  Index count = 0;
  for (Index i = 0; i < x.rows(); ++i) count += kept(mask, i) ? 1 : 0;
  if (count == 0) {
    throw pooling_error(std::string(where) + ": mask drops all " + std::to_string(x.rows()) +
                        " tokens; keep at least one token (true) to pool");
  }
  return count;
}

}  // namespace detail
}  // namespace kvattn
