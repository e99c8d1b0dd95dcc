#!/usr/bin/env bash
# Builds and runs kvattn_bench (the `release` preset: Release, -march=native,
# build/release), then writes docs/benchmarks.md and the plots in docs/bench/ from
# its JSON output (scripts/bench_report.py).
#
#   ./scripts/bench-report.sh [--build-dir DIR] [--filter REGEX] [--min-time S]
#                             [--repetitions N] [--json FILE] [--from-json FILE]
#                             [--llc SIZE]
#
#   --build-dir DIR   build tree (default build/release, the preset's own)
#   --filter REGEX    only the benchmarks matching REGEX (--benchmark_filter)
#   --min-time S      minimum seconds per benchmark, a plain number (--benchmark_min_time)
#   --repetitions N   run each benchmark N times; the report uses the medians
#   --json FILE       where the benchmark JSON goes (default <build dir>/bench-results.json)
#   --from-json FILE  build and run nothing: write the report from an existing JSON file
#   --llc SIZE        last-level cache size (e.g. 32MiB) for the vs_naive targets, where
#                     the host reports no caches to Google Benchmark (some VMs do not)
#
# Installs missing Debian packages first (scripts/install-deps.sh), including
# python3-matplotlib for the plots. A `## Notes` section already in
# docs/benchmarks.md is kept. JOBS=<n> sets the build parallelism (default 2).
set -euo pipefail

usage() {
  sed -n '6,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

die_usage() {
  echo "bench-report.sh: $*" >&2
  echo "usage:" >&2
  usage >&2
  exit 2
}

# The command line as given, for the report's header.
command_line="./scripts/bench-report.sh"
for arg in "$@"; do
  command_line+=" $(printf '%q' "$arg")"
done

caller_dir="$PWD"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
jobs="${JOBS:-2}"

# Relative paths on the command line are relative to where the script was called.
absolute() {
  case "$1" in
    /*) printf '%s\n' "$1" ;;
    *) printf '%s\n' "$caller_dir/$1" ;;
  esac
}

build_dir=""
filter=""
min_time=""
repetitions=""
json=""
from_json=""
llc=""

while [[ $# -gt 0 ]]; do
  flag="$1"
  value=""
  has_value=0
  case "$flag" in
    --*=*)
      value="${flag#*=}"
      flag="${flag%%=*}"
      has_value=1
      ;;
  esac
  case "$flag" in
    -h | --help)
      usage
      exit 0
      ;;
    --build-dir | --filter | --min-time | --repetitions | --json | --from-json | --llc)
      if [[ $has_value -eq 0 ]]; then
        [[ $# -ge 2 ]] || die_usage "$flag needs a value"
        value="$2"
        shift
      fi
      [[ -n "$value" ]] || die_usage "$flag needs a non-empty value"
      case "$flag" in
        --build-dir) build_dir="$(absolute "$value")" ;;
        --filter) filter="$value" ;;
        --min-time)
          [[ "$value" =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)$ ]] ||
            die_usage "--min-time takes a plain number of seconds (e.g. 0.5), not '$value'"
          min_time="$value"
          ;;
        --repetitions)
          [[ "$value" =~ ^[1-9][0-9]*$ ]] ||
            die_usage "--repetitions takes a positive integer, not '$value'"
          repetitions="$value"
          ;;
        --json) json="$(absolute "$value")" ;;
        --from-json) from_json="$(absolute "$value")" ;;
        --llc)
          [[ "$value" =~ ^[0-9]+(\.[0-9]+)?[KMGkmg]?(i?[Bb])?$ ]] ||
            die_usage "--llc takes a size such as 32MiB or 33554432, not '$value'"
          llc="$value"
          ;;
      esac
      ;;
    *)
      die_usage "unknown argument '$1'"
      ;;
  esac
  shift
done

if [[ -n "$from_json" ]]; then
  for option in build_dir filter min_time repetitions json; do
    if [[ -n "${!option}" ]]; then
      die_usage "--from-json runs nothing; --${option//_/-} does not go with it"
    fi
  done
  [[ -f "$from_json" ]] || die_usage "--from-json: no file '$from_json'"
fi

cd "$repo"
./scripts/install-deps.sh

# A python3 that has matplotlib: the first on PATH, else Debian's own (a python3
# from pyenv, conda or a virtualenv does not see python3-matplotlib).
python=""
for candidate in "${PYTHON:-}" python3 /usr/bin/python3; do
  if [[ -n "$candidate" ]] && command -v "$candidate" >/dev/null 2>&1 &&
    "$candidate" -c 'import matplotlib' >/dev/null 2>&1; then
    python="$candidate"
    break
  fi
done
if [[ -z "$python" ]]; then
  echo "bench-report.sh: no python3 with matplotlib found." >&2
  echo "  HINT: apt-get install python3-matplotlib (./scripts/install-deps.sh does), or" >&2
  echo "        set PYTHON=/path/to/python3 that has matplotlib." >&2
  exit 1
fi

commands=(--command "$command_line")
if [[ -n "$from_json" ]]; then
  json="$from_json"
else
  default_build="$repo/build/release"
  build_dir="${build_dir:-$default_build}"
  json="${json:-$build_dir/bench-results.json}"

  if [[ "$build_dir" == "$default_build" ]]; then
    cmake --preset release
    cmake --build --preset release -j "$jobs" --target kvattn_bench
  else
    cmake --preset release -B "$build_dir"
    cmake --build "$build_dir" -j "$jobs" --target kvattn_bench
  fi

  bench=("$build_dir/bench/kvattn_bench" --benchmark_format=console
    "--benchmark_out=$json" --benchmark_out_format=json)
  [[ -n "$filter" ]] && bench+=("--benchmark_filter=$filter")
  [[ -n "$min_time" ]] && bench+=("--benchmark_min_time=$min_time")
  [[ -n "$repetitions" ]] && bench+=("--benchmark_repetitions=$repetitions")

  mkdir -p "$(dirname "$json")"
  "${bench[@]}"

  shown=""
  for arg in "${bench[@]}"; do
    arg="${arg//"$repo"\//}"
    shown+="${shown:+ }$(printf '%q' "$arg")"
  done
  commands+=(--command "$shown")
fi

report_args=("${commands[@]}")
[[ -n "$llc" ]] && report_args+=(--llc "$llc")
"$python" scripts/bench_report.py "$json" --out docs/benchmarks.md --plots docs/bench \
  "${report_args[@]}"
