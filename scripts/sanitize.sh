#!/usr/bin/env bash
# Builds the tests under AddressSanitizer + UndefinedBehaviorSanitizer and runs
# them (the `sanitize` preset: Clang 14, -O0 -g1, the slowest tests -O1, asserts on,
# build/sanitize).
# Any sanitizer report fails its test.
#
#   ./scripts/sanitize.sh
#
# JOBS=<n> sets the parallelism (default 2).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
jobs="${JOBS:-2}"

./scripts/install-deps.sh
cmake --preset sanitize
cmake --build --preset sanitize -j "$jobs"
ctest --preset sanitize --output-on-failure -j "$jobs"
