"""Workers of several ranks: DDP (gloo) inside each worker, pulseloco between workers, each local
rank carrying its share of the window.

What the equivalence tests compare, and why it is exact: a run of W workers x 2 local ranks
against a reference run of W ranks, one per worker, whose rank computes the gradients of its
worker's 2 micro-batches and averages them as DDP does (each multiplied by 1/2, then summed).
DDP's all-reduce of two ranks computes the same sum (fp32 addition of two terms is
commutative), so every worker's replica takes the reference rank's inner steps bit for bit. The
windows then differ only in how the elements are laid out: each local rank's engine holds a
contiguous range of the model. pulse aggregates every element in rank order whatever its
position, so its windows are bit-identical for any data. diloco's all-reduce sums each segment
of a bucket starting at a different rank, so an element's summation order depends on its
position; over 2 workers that is a sum of two terms (commutative), and over 3 it is exact only
because every partial sum is representable: the reference checks before each window that every
|theta_l - theta_g| is at most 2^-6 |theta_g|, which makes every pseudo-gradient an exact
difference (Sterbenz) and a multiple of theta_g's half-ulp with under 2^20 units, so each sum of
three is exact in any order.
"""

import json
import signal
import subprocess
import sys
import time

import pytest

from group_helpers import (HERE, Process, clean_environment, finish_all, pulseloco_cli,
                           start_coordinator)
from pulseloco.launch import _ports_below_ephemeral

SCRIPT = HERE / "ddp_worker.py"
BOUND_SECONDS = 300  # up to nine interpreters importing torch on two busy cores


def free_ports(count):
    """count distinct ports that were free a moment ago, below the ephemeral range (the ranks'
    own connections and listeners cannot take them before the rendezvous bind them)."""
    return _ports_below_ephemeral("127.0.0.1", count)


def spawn_workers(workers, ranks_per_worker, args, per_rank_args=None, rank_env=None):
    """workers x ranks_per_worker processes in worker mode (torch.distributed over all).
    rank_env: rank -> extra environment variables."""
    world = workers * ranks_per_worker
    torch_port, *ports = free_ports(1 + ranks_per_worker)
    processes = []
    for rank in range(world):
        env = clean_environment(dict(
            RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(torch_port), PULSELOCO_WORKER_PORTS=",".join(map(str, ports)),
            **(rank_env or {}).get(rank, {})))
        rank_args = (per_rank_args or {}).get(rank, ["--ranks-per-worker", str(ranks_per_worker)])
        processes.append(Process([sys.executable, str(SCRIPT), *args, *rank_args], env))
    return processes


def spawn_reference(workers, micro_batches, args):
    """One rank per worker, each with the worker's whole batch as micro_batches micro-batches."""
    (port,) = free_ports(1)
    return [Process([sys.executable, str(SCRIPT), *args, "--micro-batches", str(micro_batches)],
                    clean_environment(dict(RANK=str(rank), WORLD_SIZE=str(workers),
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))))
            for rank in range(workers)]


def run(processes):
    codes = finish_all(processes, BOUND_SECONDS)
    for process, code in zip(processes, codes):
        assert code == 0, process.log()
    return processes


def events(processes, name):
    return [[e for e in process.events if e["event"] == name] for process in processes]


@pytest.mark.parametrize("mode", ["pulse", "diloco"])
@pytest.mark.parametrize("workers", [2, 3])
def test_a_worker_of_two_ddp_ranks_equals_one_rank_with_the_whole_batch(mode, workers):
    args = ["--mode", mode, "--windows", "3", "--inner-steps", "2"]
    grouped = run(spawn_workers(workers, 2, args))
    reference = run(spawn_reference(workers, 2, args))

    counts = {process.event("ready")["parameter_count"] for process in grouped + reference}
    assert counts == {161}, counts  # the whole model on every rank
    for gap in events(reference[:1], "gap")[0]:
        assert gap["largest_ratio"] <= 2.0 ** -6, gap
    reference_windows = events(reference, "window")
    worker_windows = events(grouped, "window")
    for window in range(3):
        by_rank = [windows[window] for windows in worker_windows]
        assert all(e["window"] == window for e in by_rank), by_rank
        # Every rank of every worker: one worker digest, and one model.
        assert len({e["digest"] for e in by_rank}) == 1, by_rank
        assert len({e["parameters"] for e in by_rank}) == 1, by_rank
        # The reference's model after the same window.
        expected = {windows[window]["parameters"] for windows in reference_windows}
        assert expected == {by_rank[0]["parameters"]}, (window, expected, by_rank[0])
        # Each share's digest is the same on every worker.
        for local in range(2):
            assert len({e["share_digest"] for e in by_rank[local::2]}) == 1, by_rank
        if mode == "diloco":
            # One worker's message: its shares together carry the reference rank's bytes.
            for worker in range(workers):
                shares = by_rank[2 * worker:2 * worker + 2]
                assert sum(e["payload_bytes"] for e in shares) == \
                    reference_windows[worker][window]["payload_bytes"], (shares, reference_windows)

    done = [process.event("done") for process in grouped]
    expected = reference[0].event("done")
    for worker in range(workers):
        shares = sorted(done[2 * worker:2 * worker + 2], key=lambda e: e["local_rank"])
        assert "".join(e["global_weights"] for e in shares) == expected["global_weights"]
        assert "".join(e["momentum"] for e in shares) == expected["momentum"]
    assert len({e["digest"] for e in done}) == 1


@pytest.mark.parametrize("workers", [2, 3])
def test_a_killed_local_rank_fails_every_other_rank_naming_it(workers):
    # Worker 1's local rank 1 (rank 3) kills itself at the start of window 1, before it sends
    # anything (the engine's fault injection: the point is exact, where a kill from here could
    # land before, in or after the window).
    timeout = 10.0
    processes = spawn_workers(workers, 2, ["--windows", "3", "--timeout", str(timeout)],
                              rank_env={3: {"PULSELOCO_FAULT": "window=1,phase=gate,action=kill"}})
    codes = finish_all(processes, BOUND_SECONDS)
    assert codes[3] == -signal.SIGKILL, processes[3].log()
    assert [e["window"] for e in processes[3].events if e["event"] == "window"] == [0]
    survivors = [(p, c) for rank, (p, c) in enumerate(zip(processes, codes)) if rank != 3]
    for process, code in survivors:
        assert code == 3, process.log()
        error = process.event("error")
        assert error["type"] in ("PeerLostError", "AbortedError", "TimeoutError"), error
        assert "rank 3" in error["message"], error
        assert error["elapsed"] <= 2 * timeout, error


def test_mismatched_worker_layouts_are_refused_naming_both_sides():
    # Ranks 0 and 1 say a worker has 2 ranks, ranks 2 and 3 that it has 1.
    one = ["--ranks-per-worker", "1"]
    processes = spawn_workers(2, 2, ["--windows", "1"], per_rank_args={2: one, 3: one})
    codes = finish_all(processes, BOUND_SECONDS)
    for process, code in zip(processes, codes):
        assert code == 3, process.log()
        error = process.event("error")
        assert error["type"] == "InvalidArgument", error
        assert "ranks 0, 1 have 2" in error["message"], error
        assert "ranks 2, 3 have 1" in error["message"], error


def test_the_launcher_forms_workers_of_its_ranks():
    launcher = HERE.parents[1] / "python" / "pulseloco" / "launch.py"
    result = subprocess.run(
        [sys.executable, str(launcher), "--nproc-per-node", "4", "--ranks-per-worker", "2",
         str(SCRIPT), "--windows", "2"],
        env=clean_environment(), capture_output=True, text=True, timeout=BOUND_SECONDS)
    assert result.returncode == 0, result.stdout + result.stderr
    windows = {}
    for line in result.stdout.splitlines():
        prefix, _, rest = line.partition("] ")
        if rest.startswith("{"):
            event = json.loads(rest)
            if event["event"] == "window":
                windows.setdefault(event["window"], {})[prefix] = event
    assert sorted(windows) == [0, 1], result.stdout
    for by_rank in windows.values():
        assert len(by_rank) == 4, by_rank
        assert len({e["digest"] for e in by_rank.values()}) == 1, by_rank
        assert len({e["parameters"] for e in by_rank.values()}) == 1, by_rank


def test_a_worker_checkpoint_resumes_to_the_uninterrupted_runs_windows(tmp_path):
    root = str(tmp_path / "checkpoints")
    args = ["--windows", "3"]
    traces = tmp_path / "traces"
    whole = run(spawn_workers(2, 2, [*args, "--save", root, "--save-after", "1", "--trace-dir",
                                     str(traces)]))
    # Each local rank's share is a checkpoint of its own under the root, and a trace of its own.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == \
        ["local-0-of-2", "local-1-of-2"]
    assert sorted(p.name for p in traces.iterdir()) == ["local-0-of-2", "local-1-of-2"]
    for share in traces.iterdir():
        assert any(share.iterdir()), share
    resumed = run(spawn_workers(2, 2, [*args, "--resume", root]))
    first = events(whole, "window")
    for process in resumed:
        loaded = process.event("loaded")
        assert loaded["window"] == 1, process.log()
        assert loaded["digest"] == first[0][0]["digest"]
        assert loaded["parameters"] == first[0][0]["parameters"]
        later = {e["window"]: e for e in process.events if e["event"] == "window"}
        assert sorted(later) == [1, 2], process.log()
        for window in (1, 2):
            assert later[window]["digest"] == first[0][window]["digest"]
            assert later[window]["parameters"] == first[0][window]["parameters"]


def test_bf16_replicas_are_brought_up_to_date_inside_the_worker():
    # gloo has neither bf16 all-reduces (DDP) nor bf16 broadcasts: the worker's replicas take the
    # same steps here without DDP, and the shares travel inside the worker as bytes.
    processes = run(spawn_workers(2, 2, ["--dtype", "bfloat16", "--no-ddp", "--windows", "2"]))
    for window in events(processes, "window"):
        assert [e["window"] for e in window] == [0, 1]
    for window in range(2):
        by_rank = [windows[window] for windows in events(processes, "window")]
        assert len({e["digest"] for e in by_rank}) == 1, by_rank
        assert len({e["parameters"] for e in by_rank}) == 1, by_rank


def test_a_rank_that_cannot_start_its_worker_is_named_to_every_rank():
    # Rank 3 asks for overlapped windows, which workers of several ranks refuse: it says why, and
    # the others, instead of waiting for it, name it.
    processes = spawn_workers(2, 2, ["--windows", "1"], per_rank_args={
        3: ["--ranks-per-worker", "2", "--overlap", "delayed"]})
    codes = finish_all(processes, BOUND_SECONDS)
    for rank, (process, code) in enumerate(zip(processes, codes)):
        assert code == 3, process.log()
        error = process.event("error")
        assert error["type"] == "InvalidArgument", error
        assert "does not support overlap" in error["message"], error
        if rank != 3:
            assert error["message"].startswith("rank 3 cannot start its worker: "), error


@pytest.fixture
def torch_group_of_one(tmp_path):
    """torch.distributed over this process alone (gloo): a worker's own checks refuse before any
    group or coordinator is contacted."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def expect_refusal(construct, says):
    import pulseloco

    with pytest.raises(pulseloco.InvalidArgument) as refused:
        construct()
    assert says in str(refused.value), refused.value


def linear_parameters():
    import torch

    return torch.nn.Linear(4, 2).named_parameters()


@pytest.mark.parametrize("option, named", [
    ({"mode": "ddp"}, "mode 'ddp'"),
    ({"overlap": "delayed"}, "overlap"),
    ({"publish_dir": "versions"}, "publish_dir"),
])
def test_a_worker_refuses_what_it_does_not_support(torch_group_of_one, option, named):
    import pulseloco

    expect_refusal(lambda: pulseloco.Synchronizer(linear_parameters(), worker=1, **option),
                   f"does not support {named}")


@pytest.mark.parametrize("timeout, says", [
    ("60", "option 'timeout': expected a float, got a str"),
    (None, "option 'timeout': expected a float, got a NoneType"),
    (-1.0, "option 'timeout': -1.0 s is not a duration"),
    (float("inf"), "option 'timeout': inf s is not a duration"),
    (0, "option 'timeout': 0.0 s is less than a millisecond"),
])
def test_a_workers_timeout_is_checked_naming_the_option(torch_group_of_one, monkeypatch, timeout,
                                                        says):
    # A worker's own process group waits on the timeout before the engine would check it (the
    # port only lets the worker's group settings pass; nothing listens).
    import pulseloco

    monkeypatch.setenv("MASTER_PORT", "29999")
    expect_refusal(lambda: pulseloco.Synchronizer(linear_parameters(), worker=1, timeout=timeout),
                   says)


@pytest.mark.parametrize("call, says", [
    (lambda pulseloco: pulseloco.worker_process_group("1"),
     "worker: ranks_per_worker: expected an int, got a str"),
    (lambda pulseloco: pulseloco.worker_process_group(1, timeout=-5),
     "worker: timeout: expected seconds above 0 or None, got -5"),
    (lambda pulseloco: pulseloco.worker_process_group(1, timeout=float("nan")),
     "worker: timeout: expected seconds above 0 or None, got nan"),
    (lambda pulseloco: pulseloco.Synchronizer(linear_parameters(), worker=1, group="tcp"),
     "option 'group': expected a dict or None, got a str"),
    (lambda pulseloco: pulseloco.Synchronizer(linear_parameters(), worker=1,
                                              group={"master_port": 29500.9}),
     "worker: group option master_port 29500.9 is not a port number"),
    (lambda pulseloco: pulseloco.Synchronizer(linear_parameters(), worker=1,
                                              group={"master_port": True}),
     "worker: group option master_port True is not a port number"),
    # A torch.distributed group of one rank cannot hold a worker of two: each elastic worker
    # runs under its own launcher, its default group being its ranks.
    (lambda pulseloco: pulseloco.Synchronizer(linear_parameters(), worker=2,
                                              elastic={"coordinator": "127.0.0.1:1"}),
     "an elastic worker of 2 ranks runs under a torch.distributed group of its own ranks"),
])
def test_worker_arguments_that_cannot_work_are_named(torch_group_of_one, call, says):
    import pulseloco

    expect_refusal(lambda: call(pulseloco), says)


def spawn_elastic_worker(worker_id, coordinator, args, env, local_env=None):
    """Worker w2 of the elastic test: two processes started here, torch.distributed over its own
    two ranks (so that the test can watch one of them fail). local_env: local rank -> extra
    environment variables."""
    torch_port, *ports = free_ports(3)
    return [Process([sys.executable, str(SCRIPT), *args, "--ranks-per-worker", "2",
                     "--coordinator", coordinator, "--worker-id", worker_id],
                    clean_environment(dict(env, RANK=str(j), WORLD_SIZE="2",
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(torch_port),
                                           PULSELOCO_WORKER_PORTS=",".join(map(str, ports)),
                                           **(local_env or {}).get(j, {}))))
            for j in range(2)]


def launch_elastic_worker(worker_id, coordinator, args, env):
    """An elastic worker of two ranks under its own `python -m pulseloco.launch`, as a user
    starts one (the secret and run id shared by the run come from `env`)."""
    launcher = HERE.parents[1] / "python" / "pulseloco" / "launch.py"
    return subprocess.Popen(
        [sys.executable, str(launcher), "--nproc-per-node", "2", "--ranks-per-worker", "2",
         str(SCRIPT), *args, "--coordinator", coordinator, "--worker-id", worker_id],
        env=clean_environment(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)


def launched_events(output, name):
    """The events called `name` in a launcher's output, per rank ("[r] {...}" lines)."""
    by_rank = {}
    for line in output.splitlines():
        prefix, _, rest = line.partition("] ")
        if rest.startswith("{"):
            event = json.loads(rest)
            if event["event"] == name:
                by_rank.setdefault(prefix, []).append(event)
    return [by_rank[rank] for rank in sorted(by_rank)]


@pytest.mark.skipif(pulseloco_cli() is None, reason="the pulseloco CLI is not built")
@pytest.mark.parametrize("fault", ["dies", "hangs"])
def test_elastic_workers_of_two_ddp_ranks_lose_a_worker_whose_local_rank_fails(fault):
    # A local rank that dies (SIGKILL) or hangs (SIGSTOP) ends its worker: its local rank 0
    # names it, when the link closes or when worker_link_timeout runs out, and the other workers
    # regroup without the worker (the hung rank's group fails at the collective timeout). The
    # local rank kills or stops itself at the start of window 1 (the engine's fault injection),
    # before it sends anything.
    # (collective timeout, worker_link_timeout): the link outlasts a window that fails by timeout.
    timeout, link_timeout = (10.0, 600.0) if fault == "dies" else (5.0, 15.0)
    run = {"PULSELOCO_SECRET": "elastic-workers-test", "PULSELOCO_RUN_ID": "elastic-workers"}
    coordinator, address = start_coordinator(pulseloco_cli(), 3, 2, extra_env=run)
    args = ["--windows", "3", "--announce", "--timeout", str(timeout),
            "--worker-link-timeout", str(link_timeout)]
    launched = [launch_elastic_worker(f"w{w}", address, args, run) for w in range(2)]
    action = "kill" if fault == "dies" else "stall"
    w2 = spawn_elastic_worker("w2", address, args, run,
                              {1: {"PULSELOCO_FAULT": f"window=1,phase=gate,action={action}"}})
    victim, partner = w2[1], w2[0]  # worker w2's local rank 1, and its local rank 0
    outputs = []
    try:
        entering = [victim.wait_for("entering", BOUND_SECONDS) for _ in range(2)]
        assert entering[-1]["window"] == 1
        if fault == "dies":
            victim.popen.wait(timeout=BOUND_SECONDS)
        else:
            victim.wait_until_stopped(BOUND_SECONDS)
        faulted = time.monotonic()
        codes = finish_all([partner], BOUND_SECONDS)
        noticed = time.monotonic() - faulted  # until the partner's process ended
        for launcher in launched:
            outputs.append(launcher.communicate(timeout=BOUND_SECONDS)[0])
    finally:
        if victim.popen.poll() is None:  # stopped
            victim.popen.kill()
            victim.popen.wait()
        finish_all(w2, 1)
        for launcher in launched:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
        coordinator.kill()
        coordinator.wait()
    assert codes[0] == 3, partner.log()
    error = partner.event("error")
    assert error["peer"] is None, error  # the message names the local rank, not a group rank
    if fault == "dies":
        # w2's local rank 0 ends naming its lost local rank, within twice the timeout.
        assert victim.popen.returncode == -signal.SIGKILL
        assert error["type"] == "PeerLostError", error
        assert "worker w2's local rank 1 is lost" in error["message"], error
        assert noticed <= 2 * timeout, (noticed, error)
    else:
        # ... or once worker_link_timeout has run out (after its own window, which ends within
        # twice the timeout).
        assert error["type"] == "TimeoutError", error
        assert f"worker w2's local rank 1 did not answer within {int(link_timeout * 1000)} ms" \
            in error["message"], error
        assert noticed <= link_timeout + 2 * timeout, (noticed, error)
    # w0 and w1 regroup without w2 and finish, every rank of both with one worker digest.
    for launcher in launched:
        assert launcher.returncode == 0, "\n".join(outputs)
    windows = [ranks for output in outputs for ranks in launched_events(output, "window")]
    assert len(windows) == 4, outputs
    for window in range(3):
        by_rank = [its[window] for its in windows]
        assert len({e["digest"] for e in by_rank}) == 1, by_rank
        for local in range(2):
            assert len({e["share_digest"] for e in by_rank[local::2]}) == 1, by_rank
        if window == 0:
            assert all(e["world_size"] == 3 for e in by_rank), by_rank
        if window == 2:
            assert all(sorted(e["members"]) == ["w0", "w1"] for e in by_rank), by_rank
    done = [ranks[-1] for output in outputs for ranks in launched_events(output, "done")]
    assert len(done) == 4 and len({e["digest"] for e in done}) == 1, done
