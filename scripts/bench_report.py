#!/usr/bin/env python3
"""Turn a kvattn_bench Google Benchmark JSON file into docs/benchmarks.md.

    python3 scripts/bench_report.py RESULTS.json \\
        [--out docs/benchmarks.md] [--plots docs/bench | --no-plots] \\
        [--command "CMD"]... [--llc SIZE]

Reads the JSON that `kvattn_bench --benchmark_out=RESULTS.json
--benchmark_out_format=json` writes and writes one markdown report: the run's
context, one table per mechanism, the performance targets evaluated as
PASS/MISS, and (with --plots) two SVG plots embedded by relative links. A
`## Notes` section already in the output file is copied over unchanged, so
regenerating the report keeps hand-written analysis.

Benchmark names it understands (Google Benchmark ArgNames, a trailing
`/real_time` or `/manual_time` is ignored):

    <family>/<mech>/L:<L>/T:<threads>

with family one of decode, decode_bf16, decode_bf16dot, decode_int8, decode_fp8, decode_naive,
decode_precached, decode_expanded, layer_decode, prefill, and `ref/...` for reference probes
(appendix only). Counters read from each entry: bytes_per_second, flops, bytes,
cache_bytes, block_bytes, bw_ref, flop_ref, roofline_frac, vs_naive. Any of them
may be missing ("–"). The context's `simd_level` (kvattn::simd_level(), added by
kvattn_bench) names the instruction set the kernels were compiled for. The
context's caches give the last-level cache size the `vs_naive >= 1.5` targets need;
--llc SIZE (e.g. 32MiB) stands in where a host reports none.

Standard library only, plus matplotlib for the plots (Debian:
python3-matplotlib), imported only when plots are requested.
"""

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import textwrap
from collections import defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MECHANISMS = {
    "mha": "MHA (H=32)",
    "gqa": "GQA (8 KV heads)",
    "mqa": "MQA",
    "mla": "MLA absorbed (V2-Lite shape)",
    "mla_v2": "MLA absorbed (V2 shape)",
    "lrkv": "LRKV factored (r=54)",
}
MECH_ORDER = list(MECHANISMS)

FAMILIES = [
    "decode",
    "decode_naive",
    "decode_bf16",
    "decode_bf16dot",
    "decode_int8",
    "decode_fp8",
    "decode_precached",
    "layer_decode",
    "decode_expanded",
    "prefill",
]
# Families whose rows get a "speedup vs expanded" (a decode step of some kind).
DECODE_LIKE = {"decode", "decode_bf16", "decode_bf16dot", "decode_int8", "decode_fp8", "decode_naive",
               "decode_precached", "layer_decode"}
# Memory-bound and compute-bound decode mechanisms (the roofline targets).
MEMORY_BOUND = ("mha", "gqa", "lrkv")
COMPUTE_BOUND = ("mqa", "mla", "mla_v2")
# Mechanisms whose factored step must beat the naive code by 1.5x once a block the
# naive code re-reads per query head (block_bytes) no longer fits the last-level cache.
NAIVE_RE_READS = ("gqa", "mqa", "mla", "mla_v2", "lrkv")

PLOT_FILES = ("decode_time.svg", "roofline_frac.svg")
DASH = "–"
NOTES_HEADING = "## Notes"
NOTES_PLACEHOLDER = "<!-- notes: written by hand after the run -->"

# Top-level JSON fields of a benchmark entry that are not user counters.
NOT_COUNTERS = {
    "family_index",
    "per_family_instance_index",
    "repetitions",
    "repetition_index",
    "threads",
    "iterations",
    "real_time",
    "cpu_time",
    "error_occurred",
}
# Name components Google Benchmark appends for its own options.
GB_SUFFIX = re.compile(
    r"^(real_time|manual_time|process_time|"
    r"(min_time|min_warmup_time|repeats|iterations|threads):[^/]*)$")
# Context fields Google Benchmark writes itself; any other is shown as is
# (benchmark::AddCustomContext).
STANDARD_CONTEXT = {
    "date", "host_name", "executable", "num_cpus", "mhz_per_cpu", "cpu_scaling_enabled",
    "caches", "load_avg", "library_build_type", "json_schema_version", "simd_level",
}
TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


# --------------------------------------------------------------------------
# Reading the JSON


class Entry:
    """One benchmark (one name), after choosing the median or the run."""

    def __init__(self, name, raw, statistic, repetitions=()):
        self.name = name
        self.raw = raw
        self.statistic = statistic  # "median of N", "single run", ...
        self.repetitions = list(repetitions)  # the per-repetition runs, when there are several
        self.family = None
        self.mech = None
        self.L = None
        self.T = None
        unit = TIME_UNITS.get(raw.get("time_unit", "ns"), 1e-9)
        self.time = _num(raw.get("real_time"))
        self.time = self.time * unit if self.time is not None else None
        self.cpu_time = _num(raw.get("cpu_time"))
        if self.cpu_time is not None:
            self.cpu_time *= unit
        self.counters = {
            k: v for k, v in raw.items()
            if k not in NOT_COUNTERS and _num(v) is not None
        }
        self._parse_name()

    def _parse_name(self):
        parts = [p for p in self.name.split("/") if not GB_SUFFIX.match(p)]
        if len(parts) < 2:
            return
        args = {}
        for part in parts[2:]:
            key, sep, value = part.partition(":")
            if not sep or not re.fullmatch(r"-?\d+", value):
                return
            args[key] = int(value)
        if "L" in args and "T" in args and len(args) == 2:
            self.family, self.mech = parts[0], parts[1]
            self.L, self.T = args["L"], args["T"]

    @property
    def parsed(self):
        return self.family is not None and self.family != "ref"

    @property
    def key(self):
        return (self.family, self.mech, self.L, self.T)

    def counter(self, name):
        return _num(self.counters.get(name))

    def repetition_range(self, name):
        """(lowest, highest) of a counter over the repetitions, or None with fewer than 2."""
        values = [_num(r.get(name)) for r in self.repetitions]
        values = [v for v in values if v is not None]
        return (min(values), max(values)) if len(values) >= 2 else None

    def roofline_frac(self):
        value = self.counter("roofline_frac")
        if value is not None:
            return value
        terms = self.bound_terms()
        if terms is None or not self.time:
            return None
        return max(terms) / self.time

    def bound_terms(self):
        """(memory seconds, compute seconds) at the reference rates."""
        nbytes, bw_ref = self.counter("bytes"), self.counter("bw_ref")
        flops, flop_ref = self.counter("flops"), self.counter("flop_ref")
        if None in (nbytes, bw_ref, flops, flop_ref) or not bw_ref or not flop_ref:
            return None
        return nbytes / bw_ref, flops / flop_ref

    def bound(self):
        terms = self.bound_terms()
        if terms is None:
            return None
        return "memory" if terms[0] >= terms[1] else "compute"


def _num(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _run_name(bench):
    if bench.get("run_name"):
        return bench["run_name"]
    name = bench.get("name", "")
    agg = bench.get("aggregate_name")
    if bench.get("run_type") == "aggregate" and agg and name.endswith("_" + agg):
        return name[: -len(agg) - 1]
    return name


def _median_entry(runs):
    """Median of each numeric field over repetitions without aggregates."""
    merged = dict(runs[0])
    for key, value in runs[0].items():
        if _num(value) is None:
            continue
        values = [_num(r.get(key)) for r in runs]
        values = [v for v in values if v is not None]
        if values:
            merged[key] = statistics.median(values)
    return merged


def load(path):
    """Returns (context, entries in file order, errored benchmark names)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    context = data.get("context", {}) or {}
    groups = {}
    errors = []
    for bench in data.get("benchmarks", []) or []:
        if not isinstance(bench, dict) or "name" not in bench:
            continue
        run = _run_name(bench)
        if bench.get("error_occurred"):
            error = (run, bench.get("error_message", ""))
            if error not in errors:  # once, not once per repetition
                errors.append(error)
            continue
        group = groups.setdefault(run, {"median": None, "mean": None, "iters": []})
        if bench.get("run_type") == "aggregate":
            agg = bench.get("aggregate_name")
            if agg in ("median", "mean"):
                group[agg] = bench
        else:
            group["iters"].append(bench)
    entries = []
    for run, group in groups.items():
        reps = len(group["iters"]) or None
        if group["median"] is not None:
            raw = group["median"]
            n = raw.get("repetitions") or reps
            entries.append(Entry(run, raw, f"median of {n}" if n else "median", group["iters"]))
        elif group["iters"]:
            if len(group["iters"]) == 1:
                entries.append(Entry(run, group["iters"][0], "single run"))
            else:
                raw = _median_entry(group["iters"])
                entries.append(Entry(run, raw, f"median of {reps} (computed)", group["iters"]))
        elif group["mean"] is not None:
            raw = group["mean"]
            entries.append(Entry(run, raw, "mean"))
    return context, entries, errors


# --------------------------------------------------------------------------
# Formatting


def fmt_time(seconds):
    if seconds is None:
        return DASH
    if seconds >= 1.0:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def fmt_num(value, digits=2, suffix=""):
    if value is None:
        return DASH
    return f"{value:.{digits}f}{suffix}"


def fmt_rate(value):
    """A GB/s figure: one decimal, but two significant digits below 1."""
    if value is None:
        return DASH
    if value == 0 or value >= 1:
        return f"{value:.1f}"
    return f"{value:.2g}"


def fmt_ratio(value):
    if value is None:
        return DASH
    if value >= 100:
        return f"{value:.0f}×"
    if value >= 10:
        return f"{value:.1f}×"
    return f"{value:.2f}×"


def fmt_bytes(n):
    n = _num(n)
    if n is None:
        return DASH
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024.0
    return DASH


def fmt_L(L):
    if L % 1024 == 0 and L >= 1024:
        return f"{L // 1024}k"
    return str(L)


def mech_name(mech):
    return MECHANISMS.get(mech, mech)


def mech_sort_key(mech):
    return (MECH_ORDER.index(mech) if mech in MECH_ORDER else len(MECH_ORDER), mech)


def family_sort_key(family):
    return (FAMILIES.index(family) if family in FAMILIES else len(FAMILIES), family)


def md_escape(text):
    return str(text).replace("|", "\\|")


def table(header, rows, align):
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    for row in rows:
        out.append("| " + " | ".join(md_escape(c) for c in row) + " |")
    return out


# --------------------------------------------------------------------------
# The report


def describe_context(context, entries, commands, json_path, llc=None):
    lines = []
    date = context.get("date", DASH)
    host = context.get("host_name", DASH)
    cpus = context.get("num_cpus")
    mhz = context.get("mhz_per_cpu")
    cpu_text = f"{cpus} CPUs" if cpus is not None else DASH
    if mhz is not None:
        cpu_text += f" at {mhz} MHz"
    caches = []
    for cache in context.get("caches", []) or []:
        text = f"L{cache.get('level', '?')} {cache.get('type', '')} {fmt_bytes(cache.get('size'))}"
        sharing = cache.get("num_sharing")
        if sharing and sharing > 1:
            text += f" (shared by {sharing})"
        caches.append(text.replace("  ", " "))
    lines.append(f"- **Date:** {date}")
    isa = context.get("simd_level")
    lines.append("- **ISA (kvattn::simd_level()):** "
                 + (f"`{isa}`" if isa else "not recorded (a kvattn_bench without simd_level)"))
    lines.append(f"- **Host:** {host}")
    lines.append(f"- **CPU:** {cpu_text}")
    if caches:
        lines.append(f"- **Caches:** {', '.join(caches)}")
    elif llc is not None:
        lines.append(f"- **Caches:** {DASH} (none reported; the last-level cache taken as "
                     f"{fmt_bytes(llc)}, `--llc`)")
    else:
        lines.append(f"- **Caches:** {DASH}")
    load_avg = context.get("load_avg")
    if load_avg:
        lines.append("- **Load average at start:** "
                     + ", ".join(f"{x:.2f}" for x in load_avg))
    lines.append("- **Build type:** Google Benchmark library "
                 f"{context.get('library_build_type', DASH)}; kvattn as built by the command "
                 "below (`bench-report.sh` uses the `release` preset: Release, `-march=native`)")
    for key in sorted(context):
        if key not in STANDARD_CONTEXT and isinstance(context[key], (str, int, float)):
            lines.append(f"- **{key}:** {context[key]}")
    stats = sorted({e.statistic for e in entries})
    if stats:
        lines.append(f"- **Statistic:** {', '.join(stats)}; "
                     "times are wall-clock (`real_time`) per step")
    lines.append(f"- **Results file:** `{os.path.basename(json_path)}`")
    lines.append("")
    lines.append("Command:")
    lines.append("")
    lines.append("```sh")
    lines.extend(commands or ["(not recorded: pass --command to bench_report.py)"])
    lines.append("```")
    return lines


HOW_TO_READ = """\
## How to read this

- **time / step** is the wall-clock time of one step (`real_time`, median of the
  repetitions when there are several): one decoded token for the decode families,
  the whole prompt of L tokens for `prefill`.
- **L** is the number of cached tokens a step attends over; **T** the number of
  threads the step uses.
- **cache GB/s** is `bytes_per_second / 1e9`: the bytes a step must read (KV cache,
  plus weights where the benchmark counts them) divided by the step time.
- **roofline_frac** = max(bytes / bw_ref, flops / flop_ref) / time, where `bw_ref` is
  the bandwidth of a plain read-only pass over the same bytes and `flop_ref` the
  FLOP/s of a dense GEMM, both measured in the same run on the same machine. 1.0
  means the step runs as fast as its bytes can be read or its FLOPs done at those
  rates; above 1.0 is possible when the data fits a cache the reference pass did not,
  or when the step reads memory faster than that plain pass does: the decode steps'
  software prefetches touch each 4 KiB page ahead, which the plain pass does not (see
  the Notes for a read pass with the same touches).
- **bound** is `memory` when bytes / bw_ref ≥ flops / flop_ref, else `compute`.
- **predicted** (`predicted_seconds`, `decode*/` rows) is the analysis module's
  prediction of the step, `analysis::roofline_seconds(attend_cost(config, L, storage),
  {bw_ref, flop_ref})`: the bytes and FLOPs it derives from the config alone, at this
  run's measured limits; the same formula as `kvcalc --bandwidth/--flops`. Measured
  time / predicted = 1 / roofline_frac when the benchmark reads exactly the predicted
  bytes.
- **vs naive** (`vs_naive` counter, `decode/` rows) = time of the naive step (the
  `decode_naive` code) / time of the row, the naive step timed inside the row's own
  loop after each timed step, so both see the same memory bandwidth: how much faster
  kvattn's step is than the obvious Eigen code over the same cache buffers (per-head
  GEMVs or per-group GEMM, whichever was faster; the `decode_naive` row's label says
  which). Below 1.0 the library loses to code a user would write.
- **speedup vs expanded** = time(`decode_expanded`, same mechanism, L, T) / time of
  the row: how much the factored (compact-cache) path saves over expanding every
  head's K and V and recomputing.
- **arithmetic at `flop_ref`** (the note of each memory-bound mechanism's
  `roofline_frac` target) = (flops / flop_ref) / (bytes / bw_ref): the time the step's
  arithmetic alone would take at the dense GEMM's rate, as a fraction of its memory
  time. Near 1, the step can reach its memory bound only by doing its arithmetic at
  nearly the GEMM's rate while it streams (context for a miss, not its cause: see the
  Notes); above 1 the row is bound by its arithmetic (**bound** says `compute`) and its
  `roofline_frac` compares it with the GEMM's rate. Beside it, the lowest and highest
  `bw_ref` of the row's repetitions: how far the host's memory moved while the row ran.
- A `–` means the benchmark did not report what that column needs.
"""


def mechanism_tables(entries, index):
    lines = []
    by_mech = defaultdict(list)
    for e in entries:
        if e.parsed:
            by_mech[e.mech].append(e)
    if not by_mech:
        return ["No mechanism benchmarks in this run.", ""]
    for mech in sorted(by_mech, key=mech_sort_key):
        rows = sorted(by_mech[mech], key=lambda e: (family_sort_key(e.family), e.T, e.L))
        lines.append(f"### {mech_name(mech)}")
        lines.append("")
        body = []
        for e in rows:
            speedup = None
            if e.family in DECODE_LIKE:
                expanded = index.get(("decode_expanded", e.mech, e.L, e.T))
                if expanded and expanded.time and e.time:
                    speedup = expanded.time / e.time
            bps = e.counter("bytes_per_second")
            body.append([
                f"`{e.name}`",
                str(e.L),
                str(e.T),
                fmt_time(e.time),
                fmt_time(e.counter("predicted_seconds")),
                fmt_rate(bps / 1e9 if bps is not None else None),
                fmt_num(e.roofline_frac()),
                e.bound() or DASH,
                fmt_ratio(e.counter("vs_naive")),
                fmt_ratio(speedup),
            ])
        lines += table(["benchmark", "L", "T", "time / step", "predicted", "cache GB/s",
                        "roofline_frac", "bound", "vs naive", "speedup vs expanded"],
                       body, "lrrrrrrlrr")
        lines.append("")
    return lines


class Target:
    def __init__(self, label, goal_text, value, passed, miss, note="", fmt=fmt_num):
        self.label = label
        self.goal_text = goal_text
        self.value = value
        self.passed = passed  # True, False, or None (not measured)
        self.miss = miss
        self.note = note
        self.fmt = fmt

    def row(self):
        if self.passed is None:
            result = "not measured"
        else:
            result = "**PASS**" if self.passed else "**MISS**"
        return [self.label, self.fmt(self.value), self.goal_text, result,
                self.miss if self.passed is False else "", self.note]


def at_least(label, value, goal, note="", fmt=fmt_num):
    goal_text = "≥ " + fmt(goal)
    if value is None:
        return Target(label, goal_text, None, None, "", note or "missing entry or counter", fmt)
    passed = value >= goal
    miss = f"short by {fmt(goal - value)} ({(goal - value) / goal:.0%} below)"
    return Target(label, goal_text, value, passed, miss, note, fmt)


def at_most(label, value, goal, goal_text, note="", fmt=fmt_num):
    if value is None or goal is None:
        return Target(label, goal_text, value, None, "", note or "missing entry or counter", fmt)
    passed = value <= goal
    miss = f"over by {fmt(value - goal)} ({(value - goal) / goal:.0%} above)"
    return Target(label, goal_text, value, passed, miss, note, fmt)


def time_ratio(index, num_key, den_key):
    num, den = index.get(num_key), index.get(den_key)
    if num is None or den is None or not num.time or not den.time:
        return None
    return num.time / den.time


def largest_T(entries, family="decode", L=None):
    ts = [e.T for e in entries if e.parsed and e.family == family and (L is None or e.L == L)]
    return max(ts) if ts else None


def key_name(key):
    family, mech, L, T = key
    return f"{family}/{mech}/L:{L}/T:{T}"


def why_missing(index, keys, counters=()):
    """Why a target could not be evaluated: a missing entry or counter."""
    absent = [f"`{key_name(k)}`" for k in keys if k not in index]
    if absent:
        return "no entry " + ", ".join(absent)
    lacking = []
    for k in keys:
        e = index[k]
        if not e.time:
            lacking.append(f"no time on `{key_name(k)}`")
        for c in counters:
            if c == "roofline_frac" and e.roofline_frac() is None:
                lacking.append(f"no `roofline_frac` (nor bytes, flops, bw_ref, flop_ref) "
                               f"on `{key_name(k)}`")
            elif c != "roofline_frac" and not e.counter(c):
                lacking.append(f"no `{c}` counter on `{key_name(k)}`")
    return "; ".join(lacking)


def arithmetic_note(entry):
    """The note of a memory-bound mechanism's roofline target: its arithmetic's time at
    `flop_ref` as a fraction of its memory time, and the range of `bw_ref` over the
    repetitions (HOW_TO_READ explains both)."""
    notes = []
    terms = entry.bound_terms()
    if terms is not None and terms[0]:
        notes.append(f"arithmetic at `flop_ref`: {terms[1] / terms[0]:.2f} of the memory time")
    bw = entry.repetition_range("bw_ref")
    if bw is not None:
        notes.append(f"`bw_ref` {bw[0] / 1e9:.1f}-{bw[1] / 1e9:.1f} GB/s over "
                     f"{len(entry.repetitions)} repetitions")
    return "; ".join(notes)


def ratio_target(index, label, num_key, den_key, goal):
    value = time_ratio(index, num_key, den_key)
    note = why_missing(index, [num_key, den_key]) if value is None else ""
    return at_least(label, value, goal, note, fmt=fmt_ratio)


def last_level_cache(context, given=None):
    """Bytes of the largest (last-level) cache in the JSON context; where the context has
    none (some VMs report no caches to Google Benchmark), `given` (--llc), else None."""
    sizes = [_num(c.get("size")) for c in context.get("caches", []) or []]
    sizes = [x for x in sizes if x]
    return max(sizes) if sizes else given


def parse_size(text):
    """Bytes from '33554432', '32MiB', '32M', '48KiB' (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 32MiB)")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


def evaluate_targets(entries, index, context=None, llc_given=None):
    targets = []
    big = 65536
    t_all = largest_T(entries, "decode", big)
    thread_counts = [1] + ([t_all] if t_all and t_all > 1 else [])

    def roofline_goal(mech, T):
        """The issue's roofline_frac goal: memory-bound 0.85 with one thread and 0.80
        with more, compute-bound 0.75 of flop_ref."""
        if mech in MEMORY_BOUND:
            return 0.85 if T == 1 else 0.80
        return 0.75

    def frac_target(label, key, goal):
        e = index.get(key)
        value = e.roofline_frac() if e else None
        if value is None:
            note = why_missing(index, [key], ["roofline_frac"])
        else:
            note = arithmetic_note(e) if key[1] in MEMORY_BOUND else ""
        return at_least(label, value, goal, note)

    # a) roofline: memory-bound mechanisms >= 0.85 with one thread, >= 0.80 with all;
    #    compute-bound >= 0.75 of flop_ref; at L 16384 and 65536, fp32 and bf16 caches.
    for mech in MEMORY_BOUND + COMPUTE_BOUND:
        for family in ("decode", "decode_bf16"):
            for L in (16384, big):
                for T in thread_counts:
                    targets.append(frac_target(
                        f"a) `{family}/{mech}` L={L} T={T} roofline_frac",
                        (family, mech, L, T), roofline_goal(mech, T)))
    # a) continued: for bf16 caches the issue asks for the CPU's bf16 dot-product
    #    instructions where it has them. Those are the opt-in decode_bf16dot/ rows (MLA's
    #    layers, the GQA family's and LRKV's), held to their mechanism's goals when this run's
    #    build had the instructions (context bf16_dot = yes; otherwise the rows ran the
    #    float path of decode_bf16/ and say nothing new). decode_bf16/ keeps its own
    #    targets.
    bf16_dot = (context or {}).get("bf16_dot") == "yes"
    if bf16_dot:
        for mech in MEMORY_BOUND + COMPUTE_BOUND:
            for L in (16384, big):
                for T in thread_counts:
                    key = ("decode_bf16dot", mech, L, T)
                    if key in index:
                        targets.append(frac_target(
                            f"a) `decode_bf16dot/{mech}` L={L} T={T} roofline_frac "
                            "(opt-in bf16 dot products)", key, roofline_goal(mech, T)))

    # b) vs_naive >= 1.0 on every decode row with L >= 1024 (one line: the lowest), and
    #    >= 1.5 where the naive code re-reads a block that does not fit the LLC.
    rows = [e for e in entries if e.parsed and e.family == "decode" and e.L >= 1024]
    with_ratio = [(e.counter("vs_naive"), e) for e in rows if e.counter("vs_naive") is not None]
    if with_ratio:
        low, worst = min(with_ratio, key=lambda x: x[0])
        below = [f"`{key_name(e.key)}` {v:.2f}" for v, e in sorted(with_ratio, key=lambda x: x[0])
                 if v < 1.0]
        note = (f"lowest: `{key_name(worst.key)}`; {len(with_ratio)} rows"
                + (("; below 1.0: " + ", ".join(below)) if below else ""))
        targets.append(at_least("b) min vs_naive over every `decode/` row, L >= 1024", low, 1.0,
                                note, fmt=fmt_ratio))
    else:
        targets.append(Target("b) min vs_naive over every `decode/` row, L >= 1024", "≥ 1.00×",
                              None, None, "", "no `vs_naive` counter in this run"))
    llc = last_level_cache(context or {}, llc_given)
    if llc is None and any(e.mech in NAIVE_RE_READS for e in rows):
        targets.append(Target("b) `vs_naive` where a block does not fit the LLC", "≥ 1.50×", None,
                              None, "", "the run reported no cache sizes: rerun the report "
                              "with --llc SIZE", fmt=fmt_ratio))
    for e in sorted(rows, key=lambda e: (mech_sort_key(e.mech), e.L, e.T)):
        block = e.counter("block_bytes")
        if e.mech not in NAIVE_RE_READS or block is None or llc is None or block <= llc:
            continue
        targets.append(at_least(
            f"b) `decode/{e.mech}` L={e.L} T={e.T} vs_naive (block {fmt_bytes(block)} > LLC)",
            e.counter("vs_naive"), 1.5,
            "" if e.counter("vs_naive") is not None else "no `vs_naive` counter", fmt=fmt_ratio))

    # c) a bf16 cache >= 1.8x faster than fp32 for the memory-bound mechanisms (and, as
    #    a) continued, with the opt-in bf16 dot products where the run has them).
    for mech in MEMORY_BOUND:
        for T in thread_counts:
            targets.append(ratio_target(
                index, f"c) time(`decode/{mech}`) / time(`decode_bf16/{mech}`), L={big} T={T}",
                ("decode", mech, big, T), ("decode_bf16", mech, big, T), 1.8))
            dot_key = ("decode_bf16dot", mech, big, T)
            if bf16_dot and dot_key in index:
                targets.append(ratio_target(
                    index, f"c) time(`decode/{mech}`) / time(`decode_bf16dot/{mech}`), "
                    f"L={big} T={T} (opt-in bf16 dot products)",
                    ("decode", mech, big, T), dot_key, 1.8))

    # d) factored MLA against the expanded reference at L = 4096.
    targets.append(ratio_target(
        index, "d) time(`decode_expanded/mla`) / time(`decode/mla`), L=4096 T=1",
        ("decode_expanded", "mla", 4096, 1), ("decode", "mla", 4096, 1), 20.0))

    # e) absorbed MLA against the precached (up-projected) path at L = 65536.
    targets.append(ratio_target(
        index, f"e) time(`decode_precached/mla`) / time(`decode/mla`), L={big} T=1",
        ("decode_precached", "mla", big, 1), ("decode", "mla", big, 1), 1.5))

    # f) LRKV decode time tracks its cache size relative to MHA.
    lrkv_key, mha_key = ("decode", "lrkv", big, 1), ("decode", "mha", big, 1)
    lrkv, mha = index.get(lrkv_key), index.get(mha_key)
    ratio = time_ratio(index, lrkv_key, mha_key)
    cache_ratio, note = None, ""
    if lrkv is not None and mha is not None:
        lc, mc = lrkv.counter("cache_bytes"), mha.counter("cache_bytes")
        if lc is not None and mc:
            cache_ratio = lc / mc
            note = f"cache ratio {cache_ratio:.3f} from `cache_bytes`"
        else:
            lb, mb = lrkv.counter("bytes"), mha.counter("bytes")
            if lb is not None and mb:
                cache_ratio = lb / mb
                note = (f"cache ratio {cache_ratio:.3f} from the `bytes` counters (fallback: "
                        "no `cache_bytes` counter; includes weights, so not the cache alone)")
    if ratio is None or cache_ratio is None:
        note = why_missing(index, [lrkv_key, mha_key], ["bytes"]) or note
    goal = cache_ratio + 0.10 if cache_ratio is not None else None
    goal_text = (f"≤ {goal:.2f}×" if goal is not None else "≤ cache ratio + 0.10")
    targets.append(at_most(
        f"f) time(`decode/lrkv`) / time(`decode/mha`), L={big} T=1",
        ratio, goal, goal_text, note, fmt=fmt_ratio))

    # g) prefill at L = 8192 reaches half the dense GEMM rate.
    prefills = sorted((e for e in entries if e.parsed and e.family == "prefill" and e.L == 8192),
                      key=lambda e: (mech_sort_key(e.mech), e.T))
    if not prefills:
        targets.append(Target("g) `prefill/*` L=8192 (flops / time) / flop_ref", "≥ 0.50",
                              None, None, "", "no prefill entry at L=8192"))
    for e in prefills:
        flops, flop_ref = e.counter("flops"), e.counter("flop_ref")
        value = None
        if flops is not None and flop_ref and e.time:
            value = flops / e.time / flop_ref
        note = why_missing(index, [e.key], ["flops", "flop_ref"]) if value is None else ""
        targets.append(at_least(f"g) `prefill/{e.mech}` L=8192 T={e.T} (flops / time) / flop_ref",
                                value, 0.50, note))

    # h) quantized caches: roofline_frac >= 0.80, and the speedup over the bf16 cache
    #    (vs_bf16) >= 0.85 x the ratio of the two roofline times (vs_bf16_goal).
    for family in ("decode_int8", "decode_fp8"):
        for mech in ("mha", "gqa", "mqa"):
            for T in thread_counts:
                key = (family, mech, big, T)
                e = index.get(key)
                if e is None:
                    continue
                targets.append(frac_target(f"h) `{family}/{mech}` L={big} T={T} roofline_frac",
                                           key, 0.80))
                goal = e.counter("vs_bf16_goal")
                label = f"h) `{family}/{mech}` L={big} T={T} vs_bf16 (≥ vs_bf16_goal)"
                if goal is None:
                    targets.append(Target(label, "≥ vs_bf16_goal", None, None, "",
                                          "no decode_bf16 row in this run"))
                else:
                    targets.append(at_least(label, e.counter("vs_bf16"), goal, fmt=fmt_ratio))
    return targets


def targets_section(targets):
    lines = ["## Targets", ""]
    counts = defaultdict(int)
    for t in targets:
        counts[{True: "PASS", False: "MISS", None: "not measured"}[t.passed]] += 1
    lines.append(f"{counts['PASS']} PASS, {counts['MISS']} MISS, "
                 f"{counts['not measured']} not measured.")
    lines.append("")
    lines += table(["target", "measured", "goal", "result", "miss by", "note"],
                   [t.row() for t in targets], "lrrlll")
    lines.append("")
    return lines


def appendix(entries, errors):
    lines = []
    refs = [e for e in entries if e.family == "ref" or e.name.startswith("ref/")]
    others = [e for e in entries if not e.parsed and e not in refs]
    if not refs and not others and not errors:
        return lines
    lines += ["## Appendix: reference probes and other entries", ""]
    if refs or others:
        body = []
        for e in refs + others:
            counters = ", ".join(f"{k}={_fmt_counter(v)}" for k, v in sorted(e.counters.items()))
            body.append([f"`{e.name}`", fmt_time(e.time), fmt_time(e.cpu_time), counters or DASH])
        lines += table(["benchmark", "time / step", "CPU time", "counters"], body, "lrrl")
        lines.append("")
    if errors:
        lines.append("Benchmarks that reported an error:")
        lines.append("")
        for name, message in errors:
            lines.append(f"- `{name}`: {message or '(no message)'}")
        lines.append("")
    return lines


def _fmt_counter(value):
    value = _num(value)
    if value is None:
        return DASH
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4g}"


def read_notes(path):
    """The old `## Notes` section (to the end of the file), or None."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    match = re.search(r"^## Notes[ \t]*$", text, re.MULTILINE)
    if not match:
        return None
    return text[match.start():].rstrip() + "\n"


# --------------------------------------------------------------------------
# Plots


def make_plots(entries, index, plots_dir):
    """Writes the SVGs; returns the file names written."""
    try:
        import matplotlib
    except ImportError:
        sys.exit("bench_report.py: matplotlib is missing (Debian: apt-get install "
                 "python3-matplotlib, or ./scripts/install-deps.sh); or pass --no-plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, NullLocator
    from matplotlib.transforms import blended_transform_factory

    # Stable output: fixed ids (hash salt), no date, glyphs as paths.
    plt.rcParams.update({
        "svg.hashsalt": "kvattn-bench",
        "svg.fonttype": "path",
        "font.size": 10,
    })
    os.makedirs(plots_dir, exist_ok=True)
    written = []
    colors = plt.get_cmap("tab10").colors

    decode = [e for e in entries if e.parsed and e.family == "decode" and e.time]
    mechs = sorted({e.mech for e in decode}, key=mech_sort_key)
    t_all = largest_T(decode)
    multi = t_all is not None and t_all > 1
    unknown = [m for m in mechs if m not in MECH_ORDER]

    def color(mech):
        i = MECH_ORDER.index(mech) if mech in MECH_ORDER else len(MECH_ORDER) + unknown.index(mech)
        return colors[i % len(colors)]

    def save(fig, name):
        fig.savefig(os.path.join(plots_dir, name), format="svg", metadata={"Date": None},
                    bbox_inches="tight")
        plt.close(fig)
        written.append(name)

    # Decode time per step against L, log-log: one color per mechanism, T=1
    # solid, T=all dashed.
    if decode:
        fig, ax = plt.subplots(figsize=(9, 5.5))
        all_L = sorted({e.L for e in decode})
        for mech in mechs:
            for T, style, marker in ((1, "-", "o"), (t_all, "--", "s")):
                if T is None or (style == "--" and not multi):
                    continue
                pts = sorted((e.L, e.time) for e in decode if e.mech == mech and e.T == T)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle=style,
                            marker=marker, markersize=4, color=color(mech))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(all_L)
        ax.set_xticklabels([fmt_L(L) for L in all_L])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: fmt_time(y)))
        ax.set_xlabel("L (cached tokens)")
        ax.set_ylabel("time per decode step")
        ax.set_title("decode/ step time against L")
        ax.grid(True, which="major", alpha=0.3)
        ax.grid(True, which="minor", axis="y", alpha=0.1)
        mech_legend = ax.legend(
            [Line2D([], [], color=color(m), marker="o", markersize=4) for m in mechs],
            [mech_name(m) for m in mechs], fontsize=8, loc="upper left")
        ax.add_artist(mech_legend)
        styles = [(Line2D([], [], color="gray", linestyle="-", marker="o", markersize=4), "T=1")]
        if multi:
            styles.append((Line2D([], [], color="gray", linestyle="--", marker="s",
                                  markersize=4), f"T={t_all}"))
        ax.legend([s[0] for s in styles], [s[1] for s in styles], fontsize=8,
                  loc="lower right", title="threads", title_fontsize=8)
        save(fig, "decode_time.svg")

    # roofline_frac at the largest L of each mechanism, T=1 against T=all.
    bars = []
    for mech in mechs:
        with_frac = [e for e in decode if e.mech == mech and e.roofline_frac() is not None]
        if not with_frac:
            continue
        L = max(e.L for e in with_frac)
        one = index.get(("decode", mech, L, 1))
        full = index.get(("decode", mech, L, t_all)) if multi else None
        bars.append((mech, L,
                     one.roofline_frac() if one else None,
                     full.roofline_frac() if full else None))
    if bars:
        lengths = [b[1] for b in bars]
        common_L = max(sorted(set(lengths)), key=lengths.count)
        fig, ax = plt.subplots(figsize=(9, 5))
        width = 0.38 if multi else 0.6
        top = 1.1
        for i, (mech, L, f1, fall) in enumerate(bars):
            series = [(f1, -width / 2 if multi else 0.0, False)]
            if multi:
                series.append((fall, width / 2, True))
            for value, dx, hatched in series:
                if value is None:
                    continue
                top = max(top, value * 1.12)
                ax.bar(i + dx, value, width, color=color(mech), alpha=0.55 if hatched else 1.0,
                       edgecolor="black", linewidth=0.5, hatch="//" if hatched else None)
                ax.text(i + dx, value + 0.015, f"{value:.2f}", ha="center", va="bottom",
                        fontsize=8)
        labels = []
        for mech, L, _, _ in bars:
            label = textwrap.fill(mech_name(mech), 14)
            if L != common_L:
                label += f"\nL={fmt_L(L)}"
            labels.append(label)
        ax.set_xticks(range(len(bars)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_xlim(-0.6, len(bars) - 0.4)
        ax.set_ylim(0, top)
        at_right = blended_transform_factory(ax.transAxes, ax.transData)
        for y, style, col, text in ((1.0, "-", "black", "roofline 1.0"),
                                    (0.85, "--", "tab:green", "target 0.85\nMHA, GQA, LRKV"),
                                    (0.75, ":", "tab:red", "target 0.75\nMQA, MLA")):
            ax.axhline(y, color=col, linestyle=style, linewidth=1.2 if y == 1.0 else 1.0)
            ax.text(1.01, y, text, transform=at_right, ha="left", va="center", fontsize=8,
                    color=col)
        ax.set_ylabel("roofline_frac")
        ax.set_title(f"decode/ roofline_frac at L={fmt_L(common_L)}")
        ax.grid(True, axis="y", alpha=0.3)
        if multi:
            ax.legend([Patch(facecolor="lightgray", edgecolor="black", linewidth=0.5),
                       Patch(facecolor="lightgray", edgecolor="black", linewidth=0.5,
                             hatch="//", alpha=0.55)],
                      ["T=1", f"T={t_all}"], fontsize=8, loc="upper left", ncol=2)
        save(fig, "roofline_frac.svg")

    # A plot this run has no data for must not survive from an earlier run.
    for name in PLOT_FILES:
        path = os.path.join(plots_dir, name)
        if name not in written and os.path.exists(path):
            os.remove(path)
    return written


# --------------------------------------------------------------------------


def build_report(json_path, context, entries, errors, commands, plots, plot_rel, notes,
                 llc=None):
    index = {}
    for e in entries:
        if e.parsed:
            index[e.key] = e
    lines = [
        "# kvattn benchmarks",
        "",
        "<!-- Generated by scripts/bench_report.py (./scripts/bench-report.sh); do not edit by",
        "     hand except the Notes section at the end, which regenerating keeps. -->",
        "",
    ]
    lines += describe_context(context, entries, commands, json_path, llc)
    lines.append("")
    lines += HOW_TO_READ.splitlines()
    lines.append("")
    lines += targets_section(evaluate_targets(entries, index, context, llc))
    if plots:
        lines += ["## Plots", ""]
        if "decode_time.svg" in plots:
            lines += [f"![decode time per step against L]({plot_rel}/decode_time.svg)", ""]
        if "roofline_frac.svg" in plots:
            lines += [f"![roofline_frac per mechanism]({plot_rel}/roofline_frac.svg)", ""]
    lines += ["## Results by mechanism", ""]
    lines += mechanism_tables(entries, index)
    lines += appendix(entries, errors)
    if notes:
        lines += notes.rstrip("\n").splitlines()
    else:
        lines += [NOTES_HEADING, "", NOTES_PLACEHOLDER]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Write docs/benchmarks.md (and SVG plots) from kvattn_bench's "
                    "Google Benchmark JSON output.",
        epilog="Usually run through ./scripts/bench-report.sh, which builds and runs "
               "kvattn_bench first.")
    parser.add_argument("json", help="Google Benchmark JSON (--benchmark_out_format=json)")
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks.md"),
                        help="markdown report to write (default: docs/benchmarks.md); "
                             "its existing '## Notes' section is kept")
    plot_group = parser.add_mutually_exclusive_group()
    plot_group.add_argument("--plots", default=os.path.join(REPO, "docs", "bench"),
                            metavar="DIR",
                            help="directory for decode_time.svg and roofline_frac.svg "
                                 "(default: docs/bench)")
    plot_group.add_argument("--no-plots", action="store_true",
                            help="write no plots (matplotlib not needed)")
    parser.add_argument("--command", action="append", default=[],
                        help="command line that produced the JSON, shown in the report "
                             "(repeatable, one line each)")
    parser.add_argument("--llc", type=parse_size, metavar="SIZE",
                        help="last-level cache size (e.g. 32MiB) for the vs_naive >= 1.5 "
                             "targets, used only when the JSON context reports no caches")
    args = parser.parse_args(argv)

    try:
        context, entries, errors = load(args.json)
    except (OSError, ValueError) as err:
        sys.exit(f"bench_report.py: cannot read {args.json}: {err}")
    if not entries and not errors:
        print(f"bench_report.py: warning: no benchmarks in {args.json}", file=sys.stderr)

    index = {e.key: e for e in entries if e.parsed}
    plots = []
    out_dir = os.path.dirname(os.path.abspath(args.out))
    plot_rel = ""
    if not args.no_plots:
        plots = make_plots(entries, index, args.plots)
        plot_rel = os.path.relpath(os.path.abspath(args.plots), out_dir).replace(os.sep, "/")

    notes = read_notes(args.out)
    report = build_report(args.json, context, entries, errors, args.command, plots,
                          plot_rel, notes, args.llc)
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".benchmarks.", suffix=".md")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(report)
    os.replace(tmp, args.out)
    os.chmod(args.out, 0o644)
    print(f"bench_report.py: wrote {args.out}"
          + (f" and {', '.join(os.path.join(args.plots, p) for p in plots)}" if plots else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
