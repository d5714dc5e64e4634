#!/usr/bin/env python3
"""pulseloco_bench_transport with three link securities side by side (two ranks as threads,
tiny sizes), and bench/tls_report.py on its records: every group is measured in every round,
each record names its link security and round, and the report has a row per pattern and size
with both ratios."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

REPORT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "tls_report.py")
BENCH = sys.argv.pop(1) if len(sys.argv) > 1 else None


class TlsReport(unittest.TestCase):
    def test_the_benchmark_measures_every_security_in_every_round(self):
        self.assertIsNotNone(BENCH, "usage: tls_report_smoke_test.py PULSELOCO_BENCH_TRANSPORT")
        run = subprocess.run(
            [BENCH, "--link-security", "hmac,tls,tls-same-host-plaintext", "--repeats", "2",
             "--min-bytes", "1024", "--max-bytes", "4096", "--seconds", "0.01", "--json"],
            check=True, capture_output=True, text=True, timeout=240)
        records = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        seen = {(r["pattern"], r["bytes"], r["repeat"], r["link_security"]) for r in records}
        expected = {(pattern, nbytes, repeat, security)
                    for pattern in ("exchange", "stream") for nbytes in (1024, 4096)
                    for repeat in (1, 2) for security in ("hmac", "tls", "tls-same-host-plaintext")}
        self.assertEqual(seen, expected)
        self.assertTrue(all(r["seconds"] > 0 and r["cpu_seconds"] >= 0 for r in records))

        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            f.write(run.stdout)
            path = f.name
        try:
            lines = subprocess.run([sys.executable, REPORT, path], check=True,
                                   capture_output=True, text=True).stdout.splitlines()
        finally:
            os.unlink(path)
        self.assertIn("TLS / plaintext", lines[0])
        self.assertIn("TLS, same-host plaintext / plaintext", lines[0])
        rows = [line for line in lines[2:] if line.startswith("| loopback")]
        self.assertEqual(len(rows), 4, lines)
        for row in rows:
            cells = [c.strip() for c in row.strip("|").split("|")]
            self.assertRegex(cells[3], r"^\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)$")
            self.assertRegex(cells[4], r"^\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)$")


if __name__ == "__main__":
    unittest.main()
