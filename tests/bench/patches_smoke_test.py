#!/usr/bin/env python3
"""pulseloco_bench_patches on a tiny Qwen2-shaped model (and, when built with libtorch, on the
training example after a short pretraining): one record per published version after the first,
with the sizes of every format consistent with what they hold and a sample per repeat of every
time. Usage: patches_smoke_test.py BINARY [--with-example] [--case qwen|example|flags]: each case
is its own ctest test, so that one's time under a loaded machine does not count against another.
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

BINARY = None
WITH_EXAMPLE = False
REPEATS = 2
WINDOWS = 2


def lr_of(record):
    """The record's lr to 3 digits (the generator's lr is a float)."""
    return float(f"{record['lr']:.3g}")


def run(*args):
    # Bounded, with room for a machine whose every core is busy (ctest's own limit is above it).
    return subprocess.run([BINARY, *args], capture_output=True, text=True, timeout=800)


class PatchesBenchmark(unittest.TestCase):
    def check_records(self, records, lrs):
        self.assertEqual(len(records), WINDOWS * len(lrs))
        self.assertEqual(sorted({lr_of(r) for r in records}), sorted(lrs))
        for r in records:
            with self.subTest(lr=lr_of(r), version=r["version"]):
                self.assertEqual(r["benchmark"], "patches")
                self.assertIn(r["version"], range(1, WINDOWS + 1))
                n, changed, b = r["parameters"], r["changed"], r["bytes"]
                self.assertGreater(changed, 0)
                self.assertLess(changed, n)
                self.assertAlmostEqual(r["density"], changed / n)
                # An anchor holds every element as bf16; a raw delta 4 + 2 bytes per change.
                self.assertGreater(b["anchor"], 2 * n)
                self.assertGreaterEqual(b["trl_raw_i32"], 6 * changed)
                # gap_delta's indices are U16 or U32: never larger than raw I32 (but for the
                # longer encoding name in the metadata).
                self.assertLessEqual(b["trl_gap_delta"], b["trl_raw_i32"] + 16)
                self.assertGreaterEqual(b["trl_gap_delta"], 4 * changed)
                self.assertGreater(b["compact"], 0)
                self.assertAlmostEqual(r["ratio_over_compact"]["trl_gap_delta"],
                                       b["trl_gap_delta"] / b["compact"])
                for name, s in r["seconds"].items():
                    self.assertEqual(len(s["samples"]), REPEATS, name)
                    self.assertTrue(all(x > 0 for x in s["samples"]), name)
                    self.assertLessEqual(s["min"], s["median"])
                    self.assertLessEqual(s["median"], s["max"])

    def records(self, *args):
        with tempfile.TemporaryDirectory() as work:
            result = run(*args, "--repeats", str(REPEATS), "--work-dir", work, "--json")
            self.assertEqual(result.returncode, 0, result.stderr)
            self.assertEqual(os.listdir(work), [], "the publishing directories are removed")
        return [json.loads(line) for line in result.stdout.splitlines()]

    def test_qwen_tiny(self):
        records = self.records("--cases", "qwen", "--qwen", "tiny", "--qwen-lr", "3e-6,2e-5",
                               "--qwen-windows", str(WINDOWS), "--generator-threads", "1")
        self.check_records(records, [3e-6, 2e-5])
        # The larger learning rate changes more weights.
        density = {(lr_of(r), r["version"]): r["density"] for r in records}
        self.assertGreater(density[(2e-5, 1)], density[(3e-6, 1)])

    def test_example(self):
        if not WITH_EXAMPLE:
            self.skipTest("built without libtorch or the examples")
        with tempfile.TemporaryDirectory() as cache:
            records = self.records("--cases", "example", "--lr", "3e-6", "--pretrain-steps", "2",
                                   "--example-windows", str(WINDOWS), "--cache-dir", cache)
        self.check_records(records, [3e-6])

    def test_bad_flag_is_refused(self):
        result = run("--cases", "nothing")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("--cases", result.stderr + result.stdout)


CASES = {"qwen": "test_qwen_tiny", "example": "test_example", "flags": "test_bad_flag_is_refused"}

if __name__ == "__main__":
    BINARY = sys.argv[1]
    WITH_EXAMPLE = "--with-example" in sys.argv[2:]
    selected = []
    if "--case" in sys.argv:
        selected = [f"PatchesBenchmark.{CASES[sys.argv[sys.argv.index('--case') + 1]]}"]
    unittest.main(argv=sys.argv[:1] + selected)
