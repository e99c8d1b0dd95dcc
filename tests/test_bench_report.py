"""scripts/bench_report.py on hand-written JSON: its last-level-cache handling (--llc)
and the note on memory-bound roofline targets (arithmetic share, bw_ref range).

The --llc fixture has one GQA decode row whose block (64 MiB) exceeds a 32 MiB cache and
one whose block (16 MiB) does not, vs_naive 2.0 and 0.9, and a context without caches (as
some VMs report). Expected lines are worked out from those numbers by hand.
"""
import importlib.util
import json
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "scripts", "bench_report.py")
spec = importlib.util.spec_from_file_location("bench_report", SCRIPT)
bench_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_report)

MIB = 1 << 20


def row(name, block_bytes, vs_naive):
    return {"name": name + "/real_time", "run_name": name + "/real_time",
            "run_type": "iteration", "iterations": 1, "real_time": 1000.0,
            "time_unit": "us", "block_bytes": block_bytes, "vs_naive": vs_naive}


def report_text(context, benchmarks, *extra):
    """The report bench_report.py writes for a JSON of these benchmarks."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "results.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"context": context, "benchmarks": benchmarks}, f)
        out = os.path.join(tmp, "benchmarks.md")
        bench_report.main([path, "--out", out, "--no-plots", *extra])
        with open(out, encoding="utf-8") as f:
            return f.read()


class LlcTest(unittest.TestCase):
    def report(self, context, *extra):
        return report_text(context, [row("decode/gqa/L:65536/T:1", 64 * MIB, 2.0),
                                     row("decode/gqa/L:16384/T:1", 16 * MIB, 0.9)], *extra)

    def test_sizes(self):
        self.assertEqual(bench_report.parse_size("32MiB"), 33554432)
        self.assertEqual(bench_report.parse_size("48KiB"), 49152)
        self.assertEqual(bench_report.parse_size("1G"), 1073741824)
        self.assertEqual(bench_report.parse_size("33554432"), 33554432)
        with self.assertRaises(bench_report.argparse.ArgumentTypeError):
            bench_report.parse_size("32Q")

    def test_no_caches_and_no_llc_is_not_measured(self):
        text = self.report({})
        self.assertIn("| b) `vs_naive` where a block does not fit the LLC | – | ≥ 1.50× | "
                      "not measured |", text)
        self.assertNotIn("> LLC)", text)
        self.assertIn("- **Caches:** –\n", text)

    def test_llc_given(self):
        text = self.report({}, "--llc", "32MiB")
        self.assertIn("| b) `decode/gqa` L=65536 T=1 vs_naive (block 64 MiB > LLC) | 2.00× | "
                      "≥ 1.50× | **PASS** |", text)
        self.assertNotIn("L=16384 T=1 vs_naive (block", text)  # 16 MiB fits 32 MiB
        self.assertNotIn("where a block does not fit the LLC", text)
        self.assertIn("the last-level cache taken as 32 MiB, `--llc`", text)

    def test_context_caches_win_over_llc(self):
        context = {"caches": [{"type": "Unified", "level": 3, "size": 128 * MIB,
                               "num_sharing": 2}]}
        text = self.report(context, "--llc", "32MiB")
        self.assertNotIn("> LLC)", text)  # 64 MiB fits the reported 128 MiB
        self.assertNotIn("`--llc`", text)


class ArithmeticNoteTest(unittest.TestCase):
    """The note on memory-bound roofline targets."""

    def test_memory_bound_miss_names_the_arithmetic(self):
        """One bf16 LRKV row: 1e6 bytes at bw_ref 1e9 B/s (1 ms of memory), 8e7 FLOPs at
        flop_ref 1e11 FLOP/s (0.8 ms of arithmetic), 2 ms per step: roofline_frac 1 / 2 =
        0.50, short of 0.85 by 0.35 (41%), the arithmetic 0.8 / 1 = 0.80 of the memory
        time; a single run, so no bw_ref range."""
        name = "decode_bf16/lrkv/L:16384/T:1/real_time"
        entry = {"name": name, "run_name": name, "run_type": "iteration", "iterations": 1,
                 "real_time": 2000.0, "time_unit": "us", "bytes": 1e6, "bw_ref": 1e9,
                 "flops": 8e7, "flop_ref": 1e11}
        text = report_text({}, [entry])
        self.assertIn("| a) `decode_bf16/lrkv` L=16384 T=1 roofline_frac | 0.50 | ≥ 0.85 | "
                      "**MISS** | short by 0.35 (41% below) | arithmetic at `flop_ref`: 0.80 "
                      "of the memory time |", text)

    def test_repetitions_give_the_bw_ref_range(self):
        """Two repetitions with bw_ref 2e10 and 3e10 B/s and their median aggregate (bw_ref
        2.5e10: 1e6 bytes take 40 us; 2e6 FLOPs at 1e11 FLOP/s 20 us; 50 us per step):
        roofline_frac 0.80, short of 0.85 by 0.05 (6%), the arithmetic 0.50 of the memory
        time, bw_ref 20.0-30.0 GB/s."""
        name = "decode/lrkv/L:65536/T:1/real_time"

        def run(bw_ref, **kind):
            return {"name": name, "run_name": name, "iterations": 1, "real_time": 50.0,
                    "time_unit": "us", "bytes": 1e6, "bw_ref": bw_ref, "flops": 2e6,
                    "flop_ref": 1e11, "repetitions": 2, **kind}

        text = report_text({}, [run(2e10, run_type="iteration", repetition_index=0),
                                run(3e10, run_type="iteration", repetition_index=1),
                                dict(run(2.5e10, run_type="aggregate", aggregate_name="median"),
                                     name=name + "_median")])
        self.assertIn("| a) `decode/lrkv` L=65536 T=1 roofline_frac | 0.80 | ≥ 0.85 | **MISS** | "
                      "short by 0.05 (6% below) | arithmetic at `flop_ref`: 0.50 of the memory "
                      "time; `bw_ref` 20.0-30.0 GB/s over 2 repetitions |", text)


if __name__ == "__main__":
    sys.exit(unittest.main())
