"""examples/python/train.py: launched on 2 workers, it trains, reports every window on rank 0
and ends with the payload against DiLoCo and DDP and replicas identical every window.

PYTHONPATH must reach the built package (ctest sets it).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "python" / "train.py"
BOUND_SECONDS = 240  # far above a run's time on two busy cores
SUMMARY = re.compile(r"\[rank 0\] summary: 3 windows, final held-out loss [0-9.]+ .*"
                     r"DiLoCo would send .* = [0-9.]+x, DDP .* = [0-9.]+x\), "
                     r"replicas bit-identical every window$", re.MULTILINE)


@pytest.mark.parametrize("mode", ["pulse", "diloco", "ddp"])
def test_the_example_trains_under_the_launcher(mode):
    result = subprocess.run([sys.executable, "-m", "pulseloco.launch", "--nproc-per-node", "2",
                             str(EXAMPLE), "--mode", mode, "--windows", "3", "-H", "4"],
                            capture_output=True, text=True, timeout=BOUND_SECONDS)
    assert result.returncode == 0, result.stdout + result.stderr
    for window in range(3):
        assert f"[rank 0] window {window}: train loss " in result.stdout
    assert "[rank 1] window" not in result.stdout  # rank 0 alone reports
    assert SUMMARY.search(result.stdout), result.stdout
