#!/usr/bin/env bash
# Builds kvattn with its tests, header checks, benchmarks and examples, and runs
# the whole test suite (the `default` preset: RelWithDebInfo, build/default).
#
#   ./scripts/test.sh
#
# Installs missing Debian packages first (scripts/install-deps.sh).
# JOBS=<n> sets the parallelism (default 2).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
jobs="${JOBS:-2}"

./scripts/install-deps.sh
cmake --preset default
cmake --build --preset default -j "$jobs"
ctest --preset default --output-on-failure -j "$jobs"
