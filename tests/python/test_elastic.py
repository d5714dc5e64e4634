"""Elastic workers from Python under a `pulseloco coordinator`: a run of two workers; a run that
stops below its minimum size (MembershipError), a worker that has left, and a registration the
coordinator refuses, each raised as its pulseloco exception."""

import os

import numpy as np
import pytest

import pulseloco
from group_helpers import clean_environment, finish_all, pulseloco_cli, spawn_worker, start_coordinator

CLI = pulseloco_cli()
pytestmark = pytest.mark.skipif(CLI is None, reason="the pulseloco CLI is not built")


@pytest.fixture
def coordinator(request):
    """request.param: (initial workers, minimum workers)."""
    process, address = start_coordinator(CLI, *request.param)
    yield address
    process.kill()
    process.wait()


@pytest.mark.parametrize("coordinator", [(2, 1)], indirect=True)
def test_elastic_workers_train_with_identical_digests(coordinator):
    workers = [spawn_worker(["--coordinator", coordinator, "--worker-id", f"w{i}",
                             "--windows", "3"]) for i in range(2)]
    finish_all(workers, 120)
    reports = [[e for e in w.events if e["event"] == "window"] for w in workers]
    for worker, its_reports in zip(workers, reports):
        assert worker.popen.returncode == 0, worker.log()
        assert [r["window"] for r in its_reports] == [0, 1, 2]
        assert all(r["generation"] >= 1 and sorted(r["members"]) == ["w0", "w1"]
                   for r in its_reports)
    assert [r["digest"] for r in reports[0]] == [r["digest"] for r in reports[1]]


@pytest.mark.parametrize("coordinator", [(2, 2)], indirect=True)
def test_a_run_below_its_minimum_stops_with_membership_error(coordinator):
    workers = [spawn_worker(["--coordinator", coordinator, "--worker-id", f"w{i}", "--windows",
                             "3", "--timeout", "5"],
                            {"PULSELOCO_FAULT": "window=1,phase=gate,action=kill"} if i else None)
               for i in range(2)]
    finish_all(workers, 120)
    survivor = workers[0]
    assert survivor.popen.returncode == 3, survivor.log()
    error = survivor.event("error")
    assert error["type"] == "MembershipError" and error["kind"] == "membership", error


@pytest.mark.parametrize("coordinator", [(1, 1)], indirect=True)
def test_departed_and_refused_workers(coordinator, monkeypatch):
    for name in list(os.environ):
        monkeypatch.delenv(name)
    for name, value in clean_environment().items():
        monkeypatch.setenv(name, value)
    elastic = {"coordinator": coordinator, "worker_id": "w0", "admission_timeout": 30.0}
    sync = pulseloco.Synchronizer([np.ones(8, np.float32)], inner_steps=1, elastic=elastic)
    assert (sync.generation, sync.members) == (1, ["w0"])
    assert sync.after_optimizer_step().window == 0
    # The coordinator refuses a second live worker with the same id during its handshake.
    with pytest.raises(pulseloco.ProtocolError) as refused:
        pulseloco.Synchronizer([np.ones(8, np.float32)], elastic=elastic)
    assert "'w0' is taken" in str(refused.value)
    sync.close()
    # A worker that has left holds its state but no group.
    with pytest.raises(pulseloco.InvalidArgument) as departed:
        sync.run_window()
    assert "not attached" in str(departed.value)
    assert sync.committed_windows == 1 and len(sync.global_weights(0)) == 8
