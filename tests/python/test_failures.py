"""Failures across processes: a killed peer, Ctrl-C in a window, diverging replicas and a
non-finite weight, each raised in Python as its pulseloco exception with its context."""

import os
import signal
import time

from group_helpers import finish_all, run_group, spawn_group

TIMEOUT = 10.0  # the engine's collective timeout in these runs (seconds)


def error_of(process):
    error = process.event("error")
    assert error is not None, process.log()
    return error


def test_killed_peer_raises_peer_lost_within_twice_the_timeout():
    processes = run_group(
        2, ["--windows", "3", "--timeout", str(TIMEOUT)], timeout=120,
        rank_env={1: {"PULSELOCO_FAULT": "window=1,phase=exchange,action=kill"}})
    survivor, killed = processes
    assert killed.popen.returncode == -signal.SIGKILL, killed.log()
    assert survivor.popen.returncode == 3, survivor.log()
    error = error_of(survivor)
    assert error["type"] == "PeerLostError", error
    assert error["kind"] == "peer_lost"
    assert (error["rank_context"], error["peer"]) == (0, 1), error
    assert error["elapsed"] < 2 * TIMEOUT, error


def wait_until_main_thread_sleeps(pid, timeout=30):
    """Until the process's main thread is blocked (state S: here, waiting for its window)."""
    deadline = time.monotonic() + timeout
    stat = f"/proc/{pid}/task/{pid}/stat"
    while time.monotonic() < deadline:
        with open(stat) as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "S":
                return
        time.sleep(0.01)  # re-read the state, not a wait for an outcome
    raise AssertionError(f"process {pid}'s main thread did not block within {timeout} s")


def test_ctrl_c_in_a_window_interrupts_this_rank_and_fails_the_others():
    # Rank 0 stops itself (SIGSTOP) at the start of window 1, so rank 1 waits inside it.
    processes = spawn_group(
        2, ["--windows", "3", "--timeout", str(TIMEOUT), "--announce"],
        rank_env={0: {"PULSELOCO_FAULT": "window=1,phase=gate,action=stall"}})
    stalled, interrupted = processes
    try:
        interrupted.wait_for("ready", 60)
        while interrupted.wait_for("entering", 60)["window"] != 1:
            pass
        stalled.wait_until_stopped(120)  # rank 0 has stopped itself in window 1
        wait_until_main_thread_sleeps(interrupted.popen.pid)  # in the window, not before it
        os.kill(interrupted.popen.pid, signal.SIGINT)
        interrupted.wait_for("interrupted", 30)
        os.kill(stalled.popen.pid, signal.SIGCONT)
    finally:
        if stalled.popen.poll() is None:
            os.kill(stalled.popen.pid, signal.SIGCONT)
        codes = finish_all(processes, 2 * TIMEOUT + 30)
    assert codes == [3, 4], [p.log() for p in processes]
    # The interrupted rank had aborted its group: using it again is an AbortedError.
    aborted = error_of(interrupted)
    assert aborted["after"] == "interrupt"
    assert aborted["type"] == "AbortedError", aborted
    assert aborted["kind"] == "aborted"
    lost = error_of(stalled)
    assert lost["type"] in ("PeerLostError", "AbortedError"), lost
    assert lost["elapsed"] < 2 * TIMEOUT, lost


def test_diverging_replicas_raise_divergence_naming_the_rank():
    # ddp compares the weights after each window: rank 1 changes one between two windows.
    processes = run_group(3, ["--mode", "ddp", "--windows", "3", "--perturb", "1:1"],
                          timeout=180)
    for rank, process in enumerate(processes):
        assert process.popen.returncode == 3, process.log()
        error = error_of(process)
        assert error["type"] == "DivergenceError", error
        assert error["ranks"] == [1], error
        assert error["rank_context"] == rank


def test_non_finite_weight_raises_non_finite_naming_tensor_and_index():
    processes = run_group(2, ["--windows", "3", "--timeout", str(TIMEOUT), "--infinity", "1:1"],
                          timeout=120)
    healthy, broken = processes
    error = error_of(broken)
    assert error["type"] == "NonFiniteError", error
    assert (error["tensor"], error["index"], error["rank_context"]) == ("0.weight", 5, 1), error
    assert broken.popen.returncode == 3
    # The healthy rank never commits a window its peer did not join.
    assert healthy.popen.returncode == 3, healthy.log()
    assert error_of(healthy)["type"].endswith("Error")
