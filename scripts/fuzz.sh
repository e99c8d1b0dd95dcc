#!/usr/bin/env bash
# Fuzzes open-ended: builds the libFuzzer targets (the `fuzz` preset, build/fuzz) and
# runs each for SECONDS (default 300), or only the named targets. Each keeps a working
# corpus in build/fuzz/corpus/<name>/ (reused by the next run) seeded from
# tests/fuzz/<name>/; a crash is saved in build/fuzz/artifacts/<name>/.
#
#   ./scripts/fuzz.sh [SECONDS] [TARGET...]     e.g. ./scripts/fuzz.sh 600 hf_config
#
# A crash found: fix it, then keep the input as a regression input in the corpus
# (cp build/fuzz/artifacts/<name>/crash-... tests/fuzz/<name>/regression-<what>), so
# the CI replay (scripts/fuzz-ci.sh) and the test suite (fuzz.<name>.replay) run it.
# JOBS=<n> sets the build parallelism (default 2).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
jobs="${JOBS:-2}"
seconds="${1:-300}"
[[ $# -gt 0 ]] && shift
if ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz.sh: SECONDS must be a positive whole number, not '$seconds'" >&2
  echo "usage: ./scripts/fuzz.sh [SECONDS] [TARGET...]" >&2
  exit 2
fi
wanted=("$@")

./scripts/install-deps.sh
cmake --preset fuzz
cmake --build --preset fuzz -j "$jobs"

failed=()
ran=0
while IFS=$'\t' read -r name binary corpus _runs; do
  [[ -n "$name" ]] || continue
  if [[ ${#wanted[@]} -gt 0 && ! " ${wanted[*]} " =~ " $name " ]]; then
    continue
  fi
  ran=$((ran + 1))
  work="build/fuzz/corpus/$name"
  artifacts="build/fuzz/artifacts/$name/"
  mkdir -p "$work" "$artifacts"
  echo "fuzz.sh: $name for $seconds s (corpus $work + $corpus)"
  # New inputs go to the first directory, the working corpus; the seeds are only read.
  if ! "$binary" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=2048 \
    "-artifact_prefix=$artifacts" -print_final_stats=1 "$work" "$corpus"; then
    failed+=("$name")
  fi
done <build/fuzz/fuzz-targets.txt

if [[ $ran -eq 0 ]]; then
  echo "fuzz.sh: no target named ${wanted[*]}; the targets are:" >&2
  cut -f1 build/fuzz/fuzz-targets.txt >&2
  exit 2
fi
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "fuzz.sh: crashes in ${failed[*]}; inputs in build/fuzz/artifacts/<name>/" >&2
  echo "  HINT: after the fix, cp the input to tests/fuzz/<name>/regression-<what>" >&2
  exit 1
fi
echo "fuzz.sh: no crash in $ran target(s)"
