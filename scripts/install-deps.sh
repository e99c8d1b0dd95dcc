#!/usr/bin/env bash
# Installs the Debian 12 packages kvattn's build needs, if any are missing.
#
#   ./scripts/install-deps.sh
#
# Checks with dpkg-query first: when everything is installed it does nothing (no
# network, no root needed). Otherwise runs `apt-get update` once and installs only
# what is missing, as root directly or through sudo.
set -euo pipefail

packages=(
  g++                  # the compiler (C++20)
  cmake                # >= 3.21
  make                 # CMake's default generator
  libeigen3-dev        # Eigen 3.4, the library's one dependency
  catch2               # Catch2 2.13, the tests
  libbenchmark-dev     # Google Benchmark 1.7, the benchmarks
  nlohmann-json3-dev   # JSON: kvattn::hf_config, kvcalc, the tests, benchmark reports
  libopenmpi-dev       # MPI (Open MPI): kvattn::mpi, kvattn/distributed/, the mpi tests
  openmpi-bin          # mpiexec, which runs the mpi-labelled tests on 1 to 4 ranks
  clang-14             # the sanitize and fuzz presets' compiler (scripts/sanitize.sh,
                       # scripts/fuzz.sh, scripts/fuzz-ci.sh)
  libomp-14-dev        # clang's OpenMP runtime, for the sanitize preset's threaded tests
  libclang-rt-14-dev   # libFuzzer and the sanitizer runtimes: only a Recommends of
                       # clang-14, which --no-install-recommends would skip
  python3              # scripts/bench_report.py, the benchmark report
  python3-matplotlib   # its plots (docs/bench/*.svg)
)

if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
  echo "install-deps.sh: no dpkg-query/apt-get here (not Debian or Ubuntu); skipping." >&2
  echo "  HINT: install a C++20 compiler, CMake >= 3.21, Eigen 3.4, Catch2 2.13 and" >&2
  echo "        Google Benchmark yourself; CMake will say which one it cannot find." >&2
  exit 0
fi

missing=()
for package in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$package" 2>/dev/null || true)
  if [[ "$status" != "installed" ]]; then
    missing+=("$package")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps.sh: all ${#packages[@]} packages already installed."
  exit 0
fi

if [[ $(id -u) -eq 0 ]]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1; then
  as_root=(sudo)
else
  echo "install-deps.sh: missing packages: ${missing[*]}" >&2
  echo "  HINT: run this script as root, or install sudo, or run:" >&2
  echo "        apt-get update && apt-get install -y ${missing[*]}" >&2
  exit 1
fi

echo "install-deps.sh: installing ${missing[*]}"
"${as_root[@]}" apt-get update
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y --no-install-recommends "${missing[@]}"
