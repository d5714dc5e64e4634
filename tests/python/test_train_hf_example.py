"""examples/python/train_hf.py, a transformers Qwen2 model in bf16 with the PULSE authors'
configuration, on 2 workers under the launcher: the replicas hold the same global weights after
every window (pulse blocking and eager, diloco, ddp), and pulse sends less than DiLoCo would.

Skips, naming the reason, where transformers with Qwen2 does not import (scripts/deps installs
a release that works with Debian's torch). PYTHONPATH must reach the built package (ctest sets
it).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from group_helpers import clean_environment

try:
    from transformers import Qwen2Config  # noqa: F401
    MISSING = None
except ImportError as error:  # transformers absent, or older than Qwen2 (4.37)
    MISSING = f"transformers with Qwen2 does not import here: {error}"

pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "python" / "train_hf.py"
ARGUMENTS = ["--windows", "3", "-H", "4"]
BOUND_SECONDS = 300  # far above a run's time on two busy cores
LINE = re.compile(r"^\[rank (\d)\] (\{.*\})$")


def launch(*arguments: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "pulseloco.launch", "--nproc-per-node", "2",
                             str(EXAMPLE), *ARGUMENTS, *arguments],
                            env=clean_environment(), capture_output=True, text=True,
                            timeout=BOUND_SECONDS)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def reports_by_rank(stdout: str) -> dict[int, list[dict]]:
    reports: dict[int, list[dict]] = {0: [], 1: []}
    for line in stdout.splitlines():
        match = LINE.match(line)
        if match:
            reports[int(match.group(1))].append(json.loads(match.group(2)))
    return reports


@pytest.mark.parametrize("mode, overlap", [("pulse", "blocking"), ("pulse", "eager"),
                                           ("diloco", "blocking"), ("ddp", "blocking")])
def test_every_window_leaves_both_workers_with_the_same_global_weights(mode, overlap):
    reports = reports_by_rank(launch("--mode", mode, "--overlap", overlap, "--json").stdout)
    # Blocking: one report per window. Eager: one per boundary and the last window's, applied
    # after the loop.
    expected = 3 if overlap == "blocking" else 4
    assert [len(r) for r in reports.values()] == [expected, expected], reports
    for first, second in zip(reports[0], reports[1]):
        assert first["window"] == second["window"]
        assert first["applied_window"] == second["applied_window"]
        assert first["digest"] == second["digest"], (first, second)
        assert first["state_location"] == "host"
    if mode == "pulse":
        sent = [r for r in reports[0] if r["loss"] is not None and r["payload_bytes"] > 0]
        assert sent, reports[0]
        for report in sent:
            assert 0 < report["density"] < 0.5, report
            assert report["payload_bytes"] < report["diloco_bytes"], report


def test_rank_zero_prints_a_line_per_window_and_the_summary():
    stdout = launch().stdout
    for window in range(3):
        assert re.search(rf"^\[rank 0\] window {window}: train loss [0-9.]+, density "
                         r"[0-9.]+%, payload .* \(DiLoCo [0-9.]+x, DDP [0-9.]+x\), gate .* "
                         r"digest [0-9a-f]{16}$", stdout, re.MULTILINE), stdout
    assert "[rank 1] window" not in stdout
    assert re.search(r"^\[rank 0\] summary: 3 windows, payload per worker .* replicas "
                     r"bit-identical every window$", stdout, re.MULTILINE), stdout
