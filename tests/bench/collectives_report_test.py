#!/usr/bin/env python3
"""bench/collectives_report.py on records written here: runs of one setup share a column
(a trailing -runN is dropped), each cell lists the runs' ratios and the ranges of our CPU per
call and of our CPU / OpenMPI's, and shaped-link records show their link and ratio to bound."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

REPORT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "collectives_report.py")


def record(setup, transport, seconds, cpu, ratio=None, nbytes=1 << 20, **extra):
    r = {"benchmark": "collectives", "operation": "sparse_allgather", "transport": transport,
         "bytes_per_rank": nbytes, "seconds": seconds, "cpu_seconds": cpu, "setup": setup,
         "ranks": 4, "iterations": 7}
    if ratio is not None:
        r["ratio_to_openmpi"] = ratio
    r.update(extra)
    return r


def report(records):
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        path = f.name
    try:
        return subprocess.run([sys.executable, REPORT, path], check=True, capture_output=True,
                              text=True).stdout.splitlines()
    finally:
        os.unlink(path)


class CollectivesReport(unittest.TestCase):
    def test_runs_of_one_setup_share_a_column(self):
        lines = report([
            record("a-run1", "pulseloco-tcp", 0.011, 0.002, ratio=1.10),
            record("a-run1", "openmpi-tcp", 0.010, 0.002),
            record("b-run1", "pulseloco-tcp", 0.030, 0.004, ratio=1.50),
            record("b-run1", "openmpi-tcp", 0.020, 0.002),
            record("a-run2", "pulseloco-tcp", 0.012, 0.003, ratio=1.20),
            record("a-run2", "openmpi-tcp", 0.010, 0.002),
        ])
        self.assertEqual(lines[0], "| operation | link | bytes per rank | a | b |")
        self.assertEqual(len(lines), 3)
        self.assertEqual(
            lines[2],
            "| sparse_allgather | loopback | 1 MiB | 1.10, 1.20 (cpu 2.0-3.0 ms; cpu ratio "
            "1.00-1.50) | 1.50 (cpu 4.0-4.0 ms; cpu ratio 2.00-2.00) |")

    def test_shaped_links_show_their_rate_and_ratio_to_bound(self):
        lines = report([
            record("netns-tbf-1gbit", "pulseloco-tcp", 0.027, 0.01, link_mbit=1000.0,
                   ratio_to_bound=1.07, bound_seconds=0.0252),
            record("netns-tbf-100mbit", "pulseloco-tcp", 0.27, 0.01, link_mbit=100.0,
                   ratio_to_bound=1.05, bound_seconds=0.252),
        ])
        self.assertEqual(lines[0],
                         "| operation | link | bytes per rank | netns-tbf-1gbit | netns-tbf-100mbit |")
        self.assertEqual(lines[2], "| sparse_allgather | 100 Mbit/s | 1 MiB |  | 1.05 (cpu 10.0-10.0 ms) |")
        self.assertEqual(lines[3], "| sparse_allgather | 1000 Mbit/s | 1 MiB | 1.07 (cpu 10.0-10.0 ms) |  |")

    def test_a_setup_with_two_algorithms_gets_a_column_for_each(self):
        lines = report([
            record("s-run1", "pulseloco-tcp", 0.013, 0.01, algorithm="ring", link_mbit=1000.0,
                   ratio_to_bound=1.01, bound_seconds=0.0126),
            record("s-run1", "pulseloco-tcp", 0.014, 0.02, algorithm="direct", link_mbit=1000.0,
                   ratio_to_bound=1.07, bound_seconds=0.0126),
            record("t-run1", "pulseloco-tcp", 0.013, 0.01, algorithm="ring", link_mbit=1000.0,
                   ratio_to_bound=1.02, bound_seconds=0.0126),
        ])
        self.assertEqual(lines[0],
                         "| operation | link | bytes per rank | s (ring) | s (direct) | t |")
        self.assertEqual(
            lines[2],
            "| sparse_allgather | 1000 Mbit/s | 1 MiB | 1.01 (cpu 10.0-10.0 ms) | "
            "1.07 (cpu 20.0-20.0 ms) | 1.02 (cpu 10.0-10.0 ms) |")

    def test_automatic_choosing_by_size_stays_one_column(self):
        lines = report([
            record("a-run1", "pulseloco-tcp", 0.002, 0.003, ratio=1.20, algorithm="direct"),
            record("a-run1", "pulseloco-tcp", 0.040, 0.050, ratio=1.10, algorithm="ring",
                   nbytes=16 << 20),
        ])
        self.assertEqual(lines[0], "| operation | link | bytes per rank | a |")
        self.assertEqual(len(lines), 4)

    def test_records_without_ours_are_refused(self):
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            f.write(json.dumps(record("a-run1", "openmpi-tcp", 0.01, 0.002)) + "\n")
            path = f.name
        try:
            result = subprocess.run([sys.executable, REPORT, path], capture_output=True, text=True)
        finally:
            os.unlink(path)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("no records of pulseloco-tcp", result.stderr)


if __name__ == "__main__":
    unittest.main()
