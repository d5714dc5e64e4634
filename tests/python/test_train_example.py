"""examples/python/train.py on 2 workers, under the launcher (blocking and overlapped windows)
and under mpirun: it trains, rank 0 reports every window, and the final line gives the payload
against DiLoCo and DDP and says the replicas stayed identical every window.
examples/python/metrics.py writes a CSV row per window from its on_report sink.

PYTHONPATH must reach the built package (ctest sets it).
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pulseloco
from group_helpers import clean_environment

MPIRUN = os.environ.get("PULSELOCO_MPIEXEC") or shutil.which("mpirun")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "python" / "train.py"
ARGUMENTS = ["--windows", "3", "-H", "4", "--pretrain-steps", "50"]
BOUND_SECONDS = 240  # far above a run's time on two busy cores
SUMMARY = re.compile(r"^(\[rank 0\] )?summary: 3 windows, final held-out loss [0-9.]+ .*"
                     r"DiLoCo would send .* = [0-9.]+x, DDP .* = [0-9.]+x\), "
                     r"replicas bit-identical every window$", re.MULTILINE)


def check_output(result: subprocess.CompletedProcess, prefix: str) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    for window in range(3):
        assert f"{prefix}window {window}: train loss " in result.stdout
    assert "[rank 1] window" not in result.stdout  # rank 0 alone reports
    assert SUMMARY.search(result.stdout), result.stdout


@pytest.mark.parametrize("mode", ["pulse", "diloco", "ddp"])
def test_the_example_trains_under_the_launcher(mode):
    result = subprocess.run([sys.executable, "-m", "pulseloco.launch", "--nproc-per-node", "2",
                             str(EXAMPLE), "--mode", mode, *ARGUMENTS],
                            env=clean_environment(), capture_output=True, text=True,
                            timeout=BOUND_SECONDS)
    check_output(result, "[rank 0] ")


def test_the_example_trains_with_overlapped_windows():
    result = subprocess.run([sys.executable, "-m", "pulseloco.launch", "--nproc-per-node", "2",
                             str(EXAMPLE), "--overlap", "eager", *ARGUMENTS],
                            env=clean_environment(), capture_output=True, text=True,
                            timeout=BOUND_SECONDS)
    check_output(result, "[rank 0] ")
    lines = [line for line in result.stdout.splitlines() if line.startswith("[rank 0] window ")]
    assert lines[0].endswith(", nothing applied yet") and lines[1].endswith(", applied window 0")
    assert "[rank 0] applied window 2 after the last step" in result.stdout


@pytest.mark.skipif(MPIRUN is None or "mpi" not in pulseloco.features()["transports"],
                    reason="no mpirun, or the MPI backend is not linked")
def test_the_example_trains_under_mpirun():
    result = subprocess.run([MPIRUN, "-np", "2", "--oversubscribe", "--allow-run-as-root",
                             "-x", "PYTHONPATH", sys.executable, str(EXAMPLE), "--mode", "pulse",
                             *ARGUMENTS],
                            env=clean_environment(), capture_output=True, text=True,
                            timeout=BOUND_SECONDS)
    check_output(result, "")


def test_the_metrics_example_writes_a_csv_row_per_window(tmp_path):
    metrics = EXAMPLE.parent / "metrics.py"
    result = subprocess.run([sys.executable, "-m", "pulseloco.launch", "--nproc-per-node", "2",
                             str(metrics), "--csv", "--out", str(tmp_path), "--windows", "3",
                             "-H", "2"],
                            env=clean_environment(), capture_output=True, text=True,
                            timeout=BOUND_SECONDS)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(tmp_path / "windows.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [row["window"] for row in rows] == ["0", "1", "2"]
    assert all(re.fullmatch("[0-9a-f]{16}", row["digest"]) for row in rows)
    assert all(float(row["payload_bytes"]) > 0 for row in rows)


@pytest.mark.parametrize("mode", ["pulse", "diloco"])
def test_the_ddp_worker_example_trains_two_workers_of_two_ranks(mode):
    example = EXAMPLE.parent / "train_ddp_worker.py"
    result = subprocess.run([sys.executable, "-m", "pulseloco.launch", "--nproc-per-node", "4",
                             "--ranks-per-worker", "2", str(example), "--mode", mode,
                             *ARGUMENTS],
                            env=clean_environment(), capture_output=True, text=True,
                            timeout=BOUND_SECONDS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"[rank 0] {mode}: 2 workers x 2 ranks" in result.stdout, result.stdout
    for window in range(3):
        assert f"[rank 0] window {window}: loss " in result.stdout, result.stdout
    assert re.search(r"^\[rank 0\] summary: 3 windows, payload per worker .* in total, replicas "
                     r"bit-identical every window$", result.stdout, re.MULTILINE), result.stdout
