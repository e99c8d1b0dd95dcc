// kvcalc --svg: a horizontal bar chart of bytes per token on a log axis, sized from
// its own labels so that no label is cut at the edge of the picture.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "model.hpp"

namespace kvcalc {

/// The SVG document.
std::string to_svg(const Options& o, const Resolved& r, const std::vector<Row>& rows);

/// Estimated advance width in pixels of `text` (UTF-8) at `font_size` px: Helvetica's
/// advance widths (Adobe's AFM; Arial's are the same), times 1.15 for a wider fallback
/// sans-serif (DejaVu Sans, Linux's usual one, is 4-17% wider), times 1.1 more in bold;
/// a non-ASCII character counts one em.
double text_width(std::string_view text, double font_size, bool bold = false);

/// `text` with XML's special characters escaped and invalid UTF-8 or control
/// characters replaced, fit for SVG text and attributes.
std::string xml_escape(std::string_view text);

}  // namespace kvcalc
