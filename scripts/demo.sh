#!/usr/bin/env bash
# Builds and runs the main demo, examples/decode_demo.cpp: MHA, GQA and MQA at a
# realistic shape, factored decode against the expanded reference (the `release`
# preset: Release, -march=native, build/release).
#
#   ./scripts/demo.sh [demo arguments...]
#
# Installs missing Debian packages first (scripts/install-deps.sh).
# JOBS=<n> sets the parallelism (default 2).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
jobs="${JOBS:-2}"

./scripts/install-deps.sh
cmake --preset release
cmake --build --preset release --target decode_demo -j "$jobs"
./build/release/examples/decode_demo "$@"
