"""Groups of 2 and 4 processes train a small torch model over TCP (environment rendezvous on
loopback) in each mode, and with overlapped windows; every rank must print the same digests,
window after window."""

import pytest

from group_helpers import run_group

WINDOWS = 3


def check_identical(processes, windows):
    for process in processes:
        assert process.popen.returncode == 0, process.log()
        ready = process.event("ready")
        assert ready["zero_copy"], "the engine's views must be the tensors' own memory"
    per_rank = [[e for e in p.events if e["event"] == "window"] for p in processes]
    for reports in per_rank:
        assert [r["window"] for r in reports] == list(range(windows))
        assert all(r["replicas_identical"] for r in reports)
    for window in range(windows):
        digests = {reports[window]["digest"] for reports in per_rank}
        assert len(digests) == 1, f"window {window}: ranks printed different digests {digests}"
    finals = [p.event("done") for p in processes]
    assert len({f["digest"] for f in finals}) == 1
    assert all(f["weights"] == finals[0]["weights"] for f in finals), "the models differ"
    # The models trained on different data: a window that changed nothing would also agree.
    assert per_rank[0][0]["digest"] != per_rank[0][-1]["digest"]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("mode", ["pulse", "diloco", "ddp"])
def test_group_trains_with_identical_digests(mode, world_size):
    processes = run_group(world_size, ["--mode", mode, "--windows", str(WINDOWS)], timeout=240)
    check_identical(processes, WINDOWS)
    assert {e["mode"] for p in processes for e in p.events if e["event"] == "window"} == {mode}


@pytest.mark.parametrize("mode", ["pulse", "diloco"])
def test_bf16_parameters(mode):
    processes = run_group(2, ["--mode", mode, "--dtype", "bfloat16", "--windows", str(WINDOWS)],
                          timeout=180)
    check_identical(processes, WINDOWS)


@pytest.fixture(scope="module")
def blocking_digests():
    """Per window, the digest 2 blocking ranks agree on (the reference of the overlapped runs)."""
    processes = run_group(2, ["--windows", "2"], timeout=180)
    check_identical(processes, 2)
    return [e["digest"] for e in processes[0].events if e["event"] == "window"]


@pytest.mark.parametrize("overlap", ["delayed", "eager"])
def test_overlapped_windows_keep_the_replicas_identical(overlap, blocking_digests):
    windows = 4
    processes = run_group(2, ["--overlap", overlap, "--windows", str(windows)], timeout=240)
    check_identical(processes, windows)
    for process in processes:
        reports = [e for e in process.events if e["event"] == "window"]
        assert {r["overlap"] for r in reports} == {overlap}
        # Each boundary applies the window before it; the first has nothing to apply.
        assert [r["applied_window"] for r in reports] == [None, *range(windows - 1)]
        # Window 0 started from the same weights and trained on the same data as the blocking
        # run's window 0: applying it gives the same θ_g and m.
        assert reports[1]["digest"] == blocking_digests[0]
        # complete_in_flight() applied the last window, and then there was nothing in flight.
        completed = process.event("completed")
        assert (completed["window"], completed["applied_window"]) == (windows - 1, windows - 1)
        assert completed["replicas_identical"] and not completed["in_flight"]
        assert not completed["again"]
        done = process.event("done")
        assert done["window"] == windows and done["digest"] == completed["digest"]
    assert processes[0].event("completed")["digest"] == processes[1].event("completed")["digest"]
