#include "text.hpp"

#include <algorithm>
#include <iomanip>
#include <sstream>
#include <vector>

namespace kvcalc {

using kvattn::Index;

std::string with_commas(Index value) {
  std::string digits = std::to_string(value < 0 ? -value : value);
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return value < 0 ? "-" + out : out;
}

std::string fixed(double value, int decimals) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(decimals) << value;
  return s.str();
}

std::string human_bytes(Index bytes) {
  static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 6) {
    value /= 1024.0;
    ++unit;
  }
  if (unit == 0) return std::to_string(bytes) + " B";
  const int decimals = value < 10.0 ? 2 : value < 100.0 ? 1 : 0;
  std::string text = fixed(value, decimals);
  // 3.750 -> 3.75, 67.50 -> 67.5, 2.00 -> 2
  if (text.find('.') != std::string::npos) {
    while (text.back() == '0') text.pop_back();
    if (text.back() == '.') text.pop_back();
  }
  return text + " " + units[unit];
}

std::string divisors_text(Index n) {
  std::vector<Index> small, large;
  for (Index d = 1; d <= n / d; ++d) {
    if (n % d != 0) continue;
    small.push_back(d);
    if (d != n / d) large.push_back(n / d);
  }
  small.insert(small.end(), large.rbegin(), large.rend());
  std::string out;
  for (std::size_t i = 0; i < small.size(); ++i) {
    if (small.size() > 12 && i == 6) {
      out += ", ...";
      i = small.size() - 6;
    }
    out += (out.empty() ? "" : ", ") + std::to_string(small[i]);
  }
  return out;
}

std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

std::string human_seconds(double seconds) {
  if (seconds < 1e-6) return fixed(seconds * 1e9, 0) + " ns";
  if (seconds < 1e-3) return fixed(seconds * 1e6, seconds < 1e-5 ? 2 : 1) + " us";
  if (seconds < 1.0) return fixed(seconds * 1e3, seconds < 1e-2 ? 2 : 1) + " ms";
  return fixed(seconds, 2) + " s";
}

}  // namespace kvcalc
