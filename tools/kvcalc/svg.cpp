#include "svg.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <sstream>

#include "text.hpp"

namespace kvcalc {
namespace {

/// Helvetica's advance widths in 1/1000 em for ASCII 32 (space) to 126 (~), from
/// Adobe's Helvetica AFM.
constexpr std::array<short, 95> kHelvetica = {
    278, 278, 355, 556, 556, 889, 667,  222, 333, 333, 389, 584, 278,
    333, 278, 278,                                                     //  !"#$%&'()*+,-./
    556, 556, 556, 556, 556, 556, 556,  556, 556, 556,                 // 0-9
    278, 278, 584, 584, 584, 556, 1015,                                // :;<=>?@
    667, 667, 722, 722, 667, 611, 778,  722, 278, 500, 667, 556, 833,  // A-M
    722, 778, 667, 778, 722, 667, 611,  722, 667, 944, 667, 667, 611,  // N-Z
    278, 278, 278, 469, 556, 333,                                      // [\]^_`
    556, 556, 500, 556, 556, 278, 556,  556, 222, 222, 500, 222, 833,  // a-m
    556, 556, 556, 556, 333, 500, 278,  556, 500, 722, 500, 500, 500,  // n-z
    334, 260, 334, 584};                                               // {|}~

/// Length of the valid UTF-8 sequence starting at text[i], or 0 if it is not one.
std::size_t utf8_length(std::string_view text, std::size_t i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char lead = byte(i);
  std::size_t n = 0;
  unsigned min_code = 0;
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) {
    n = 2;
    min_code = 0x80;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    n = 3;
    min_code = 0x800;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    n = 4;
    min_code = 0x10000;
  } else {
    return 0;
  }
  if (i + n > text.size()) return 0;
  unsigned code = lead & (0x7F >> n);
  for (std::size_t k = 1; k < n; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    code = (code << 6) | (byte(i + k) & 0x3F);
  }
  if (code < min_code || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return 0;
  return n;
}

// Layout, in pixels. The left margin holds the row labels (right-aligned at the bars),
// the right margin the value labels after the longest bar.
constexpr int kPad = 12;  // from the picture's edge to the nearest label
constexpr int kLabelGap = 8;
constexpr int kValueGap = 6;
constexpr int kTop = 64, kBarH = 26, kGap = 14, kPlotW = 440;
constexpr double kFont = 13, kTitleFont = 15;

}  // namespace

double text_width(std::string_view text, double font_size, bool bold) {
  double em = 0.0;
  for (std::size_t i = 0; i < text.size();) {
    const auto ch = static_cast<unsigned char>(text[i]);
    const std::size_t n = utf8_length(text, i);
    if (n == 1) {
      if (ch >= 32 && ch < 127) em += kHelvetica[ch - 32] / 1000.0;  // controls: dropped
      ++i;
    } else {
      em += 1.0;  // a character outside ASCII, or a byte xml_escape replaces: a full em
      i += n == 0 ? 1 : n;
    }
  }
  return em * font_size * 1.15 * (bold ? 1.1 : 1.0);
}

std::string xml_escape(std::string_view text) {
  std::string out;
  for (std::size_t i = 0; i < text.size();) {
    const char ch = text[i];
    const std::size_t n = utf8_length(text, i);
    if (n == 0) {
      out += "\xEF\xBF\xBD";  // U+FFFD for a byte that is not UTF-8 (a file name)
      ++i;
      continue;
    }
    if (n > 1) {
      out.append(text.substr(i, n));
      i += n;
      continue;
    }
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
    ++i;
  }
  return out;
}

std::string to_svg(const Options& o, const Resolved& r, const std::vector<Row>& rows) {
  std::vector<double> values;
  std::vector<std::string> labels, value_labels;
  double label_w = 0.0, value_w = 0.0;
  for (const Row& row : rows) {
    values.push_back(static_cast<double>(row.bytes_per_token));
    labels.push_back(row.name + (row.own ? " (model)" : "") + ", " + row.detail);
    value_labels.push_back(with_commas(row.elements_per_token) + " elements, " +
                           human_bytes(row.bytes_per_token));
    label_w = std::max(label_w, text_width(labels.back(), kFont));
    value_w = std::max(value_w, text_width(value_labels.back(), kFont));
  }
  const std::string title = "KV cache per token, " + o.shape.source;
  const std::string subtitle = title_text(o, r).substr(o.shape.source.size() + 2) +
                               " (log scale: equal lengths are equal ratios)";
  const LogAxis axis(values);
  // Margins from the labels; wider when a title needs it (a long model name).
  const int left = static_cast<int>(std::ceil(kPad + label_w + kLabelGap));
  const int right = static_cast<int>(std::ceil(kValueGap + value_w + kPad));
  const int title_w = static_cast<int>(std::ceil(
      std::max(text_width(title, kTitleFont, true), text_width(subtitle, kFont)) + 2 * kPad));
  const int width = std::max(left + kPlotW + right, title_w);
  const int height = kTop + static_cast<int>(rows.size()) * (kBarH + kGap) + 56;
  static const char* const colors[] = {"#1a3956", "#2f6f8f", "#5a9bb8", "#006970", "#a14c22"};
  std::ostringstream svg;
  svg << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" viewBox=\"0 0 " << width << " " << height
      << "\" font-family=\"Helvetica, Arial, sans-serif\" font-size=\"13\">\n"
      << "  <title>" << xml_escape("KV cache per token: " + title_text(o, r)) << "</title>\n"
      << "  <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "  <text x=\"" << width / 2 << "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\" "
      << "font-weight=\"bold\">" << xml_escape(title) << "</text>\n"
      << "  <text x=\"" << width / 2 << "\" y=\"44\" text-anchor=\"middle\" fill=\"#555\">"
      << xml_escape(subtitle) << "</text>\n";
  const int plot_bottom = kTop + static_cast<int>(rows.size()) * (kBarH + kGap);
  for (int e = static_cast<int>(axis.lo); e <= static_cast<int>(axis.hi); ++e) {
    const double x = left + kPlotW * (e - axis.lo) / (axis.hi - axis.lo);
    svg << "  <line x1=\"" << fixed(x, 1) << "\" y1=\"" << kTop - 6 << "\" x2=\"" << fixed(x, 1)
        << "\" y2=\"" << plot_bottom << "\" stroke=\"#ccc\"/>\n"
        << "  <text x=\"" << fixed(x, 1) << "\" y=\"" << plot_bottom + 18
        << "\" text-anchor=\"middle\" fill=\"#555\">" << power_label(e) << "</text>\n";
  }
  svg << "  <text x=\"" << left + kPlotW / 2 << "\" y=\"" << plot_bottom + 40
      << "\" text-anchor=\"middle\" fill=\"#555\">bytes per token, all " << r.layers
      << " layers</text>\n";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& row = rows[i];
    const int y = kTop + static_cast<int>(i) * (kBarH + kGap);
    const double w =
        std::max(2.0, kPlotW * axis.fraction(static_cast<double>(row.bytes_per_token)));
    svg << "  <text x=\"" << left - kLabelGap << "\" y=\"" << y + kBarH / 2 + 5
        << "\" text-anchor=\"end\">" << xml_escape(labels[i]) << "</text>\n"
        << "  <rect x=\"" << left << "\" y=\"" << y << "\" width=\"" << fixed(w, 1)
        << "\" height=\"" << kBarH << "\" fill=\"" << colors[i % 5] << "\"/>\n"
        << "  <text x=\"" << fixed(left + w + kValueGap, 1) << "\" y=\"" << y + kBarH / 2 + 5
        << "\">" << xml_escape(value_labels[i]) << "</text>\n";
  }
  svg << "</svg>\n";
  return svg.str();
}

}  // namespace kvcalc
