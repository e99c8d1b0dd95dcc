// Number and text formatting shared by kvcalc's table, JSON and SVG output.
#pragma once

#include <string>

#include "kvattn/core/index.hpp"

namespace kvcalc {

/// 1966080 -> "1,966,080".
std::string with_commas(kvattn::Index value);
/// value with `decimals` digits after the point.
std::string fixed(double value, int decimals);
/// Bytes in binary units with three significant digits: "656 B", "67.5 KiB", "3.75 MiB".
std::string human_bytes(kvattn::Index bytes);
/// A duration in the unit that shows it best: "840 ns", "12.3 us", "4.56 ms", "1.23 s".
std::string human_seconds(double seconds);
/// "1, 2, 3, 4, 6, 12": the divisors of n (the first and last few when there are many).
std::string divisors_text(kvattn::Index n);
/// One line, whatever the message holds.
std::string one_line(std::string text);

}  // namespace kvcalc
