"""C++ and Python ranks in one TCP group keep identical replicas.

C++ ranks (mixed_worker.cpp, on the engine) and Python ranks (mixed_worker.py, through
pulseloco.Synchronizer) hold the same fp32 and bf16 parameters and apply the same exact per-step
updates (a formula of rank, step and index). Every window, every rank must print the same digest
of θ_g and m, and that digest must equal the one of a group of C++ ranks only: a Python rank
computes bit for bit what a C++ rank of the same rank would, and the engine's state does not
depend on which language drives it.

PULSELOCO_MIXED_WORKER names the C++ worker (ctest sets it); PYTHONPATH must reach the package.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from group_helpers import environment, free_port

WORKER_PY = Path(__file__).with_name("mixed_worker.py")
WINDOWS = 4
BOUND_SECONDS = 240  # far above a run's time on two busy cores


def cpp_worker() -> str:
    path = os.environ.get("PULSELOCO_MIXED_WORKER")
    if not path:
        pytest.skip("PULSELOCO_MIXED_WORKER (the C++ worker's path) is not set")
    return path


def run_group(languages: str, mode: str) -> list[list[str]]:
    """Runs one group, rank r in languages[r] ('C' or 'P'); returns each rank's window lines."""
    common = ["--mode", mode, "--windows", str(WINDOWS), "-H", "2", "--fp32", "5000",
              "--bf16", "3001"]
    port = free_port()
    group = dict(PULSELOCO_LISTEN_ADDR="127.0.0.1", PULSELOCO_SECRET=secrets.token_hex(16),
                 PULSELOCO_RUN_ID="mixed-" + secrets.token_hex(4))
    processes = []
    try:
        python_ranks = 0
        for rank, language in enumerate(languages):
            if language == "C":
                command = [cpp_worker(), *common]
            else:
                # Alternate Python ranks pass the fp32 tensor as NumPy rather than torch.
                command = [sys.executable, str(WORKER_PY), *common]
                command += ["--numpy"] if python_ranks % 2 else []
                python_ranks += 1
            env = environment(rank, len(languages), port, group)
            processes.append(subprocess.Popen(command, env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True))
        results = [process.communicate(timeout=BOUND_SECONDS) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for rank, (process, (stdout, stderr)) in enumerate(zip(processes, results)):
        assert process.returncode == 0, f"rank {rank} ({languages[rank]}): {stderr}"
    return [[line for line in stdout.splitlines() if line.startswith("window ")]
            for stdout, _ in results]


@pytest.mark.parametrize("mode", ["pulse", "diloco"])
@pytest.mark.parametrize("languages", ["PCP", "CPCP"])
def test_cpp_and_python_ranks_keep_identical_digests(languages, mode):
    mixed = run_group(languages, mode)
    expected = [f"window {w} digest " for w in range(WINDOWS)]
    for rank, lines in enumerate(mixed):
        assert [line[:len(expected[w])] for w, line in enumerate(lines)] == expected, \
            f"rank {rank}: {lines}"
        assert all(line.endswith(" identical 1") for line in lines), f"rank {rank}: {lines}"
        assert lines == mixed[0], f"rank {rank} differs from rank 0"
    assert len(set(mixed[0])) == WINDOWS, "the state did not move between windows"
    # The same group of C++ ranks only: the same digests, window by window.
    assert run_group("C" * len(languages), mode)[0] == mixed[0]
