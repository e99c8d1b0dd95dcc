#!/usr/bin/env bash
# CI's fuzz step. Builds the libFuzzer targets (the `fuzz` preset: clang++-14 with
# ASan + UBSan, build/fuzz), then for every target listed in build/fuzz/fuzz-targets.txt
# (tests/fuzz/CMakeLists.txt):
#   1. replays its corpus tests/fuzz/<name>/ (seeds and regression inputs), each once;
#   2. fuzzes from that corpus deterministically: -seed=1 -runs=<RUNS of the target>.
# New inputs go to a scratch directory (the corpus in git is never written). A crash,
# sanitizer report, timeout or broken property fails the step; the input is kept in
# build/fuzz/artifacts/<name>/ and each target's log in build/fuzz/logs/<name>.log.
#
#   ./scripts/fuzz-ci.sh
#
# JOBS=<n> sets the build parallelism (default 2). Budget: under ~5 minutes on the
# 2-core CI machine, build included (docs/building.md has the measured times).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
jobs="${JOBS:-2}"
start=$SECONDS

./scripts/install-deps.sh
cmake --preset fuzz
cmake --build --preset fuzz -j "$jobs"
built=$SECONDS

list=build/fuzz/fuzz-targets.txt
if [[ ! -s "$list" ]]; then
  echo "fuzz-ci.sh: no fuzz targets listed in $list" >&2
  exit 1
fi
mkdir -p build/fuzz/logs
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

# -timeout: seconds per input; -rss_limit_mb: memory per process; -max_len: input size
# when mutating (the replay runs every corpus file whole).
common=(-timeout=30 -rss_limit_mb=2048)
while IFS=$'\t' read -r name binary corpus runs; do
  [[ -n "$name" ]] || continue
  artifacts="build/fuzz/artifacts/$name/"
  log="build/fuzz/logs/$name.log"
  mkdir -p "$artifacts" "$scratch/$name"
  target_start=$SECONDS
  inputs=("$corpus"/*)
  status=0
  {
    "$binary" "${common[@]}" "-artifact_prefix=$artifacts" "${inputs[@]}" &&
      "$binary" "${common[@]}" "-artifact_prefix=$artifacts" -seed=1 "-runs=$runs" \
        -max_len=4096 -print_final_stats=1 "$scratch/$name" "$corpus"
  } >"$log" 2>&1 || status=$?
  if [[ $status -ne 0 ]]; then
    tail -n 60 "$log" >&2
    echo "fuzz-ci.sh: $name FAILED (log: $log; input: $artifacts)" >&2
    echo "  HINT: fix it, then keep the input as a regression input:" >&2
    echo "        cp $artifacts<crash-file> $corpus/regression-<what-it-is>" >&2
    exit 1
  fi
  covered=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 || true)
  echo "fuzz-ci.sh: $name: ${#inputs[@]} corpus inputs replayed, $runs runs (-seed=1), ${covered:-cov: ?}, $((SECONDS - target_start)) s"
done <"$list"

echo "fuzz-ci.sh: all fuzz targets passed in $((SECONDS - start)) s (build $((built - start)) s)"
