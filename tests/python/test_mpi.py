"""`mpirun -np 2 python script.py`: the group forms through MPI (the MPI rendezvous with the TCP
data plane, and the MPI transport itself) and trains with identical digests."""

import json
import os
import shutil
import subprocess
import sys

import pytest

import pulseloco
from group_helpers import WORKER, Process, clean_environment, finish_all

MPIRUN = os.environ.get("PULSELOCO_MPIEXEC") or shutil.which("mpirun")
pytestmark = pytest.mark.skipif(
    MPIRUN is None or "mpi" not in pulseloco.features()["transports"],
    reason="no mpirun, or the MPI backend is not linked")


def mpirun(ranks, transport, output):
    """mpirun writes each rank's output to its own file under `output` (on its standard output
    the ranks' lines may interleave)."""
    env = clean_environment({"PULSELOCO_TRANSPORT": transport})
    command = [MPIRUN, "-np", str(ranks), "--oversubscribe", "--allow-run-as-root",
               "--output-filename", str(output)]
    for name in ("PULSELOCO_TRANSPORT", "PULSELOCO_LOG_LEVEL", "PYTHONPATH", "OMP_NUM_THREADS"):
        if name in env:
            command += ["-x", name]
    return Process([*command, sys.executable, str(WORKER), "--windows", "3"], env)


@pytest.mark.parametrize("transport", ["tcp", "mpi"])
def test_mpirun_group_trains_with_identical_digests(transport, tmp_path):
    run = mpirun(2, transport, tmp_path)
    assert finish_all([run], 120) == [0], run.log()
    events = [json.loads(line) for path in sorted(tmp_path.glob("*/rank.*/stdout"))
              for line in path.read_text().splitlines() if line.startswith("{")]
    done = [e for e in events if e["event"] == "done"]
    assert sorted(e["rank"] for e in done) == [0, 1], run.log()
    assert done[0]["digest"] == done[1]["digest"] and done[0]["window"] == 3
    windows = {}
    for event in events:
        if event["event"] == "window":
            windows.setdefault(event["window"], set()).add(event["digest"])
    assert sorted(windows) == [0, 1, 2] and all(len(d) == 1 for d in windows.values())
