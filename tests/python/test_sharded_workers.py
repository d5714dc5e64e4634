"""Sharded workers: each local rank holds a shard of the model (as FSDP's flat parameters are)
and runs the window over it with the same local rank of every other worker.

What the equivalence test compares, and why it is exact: W workers x 2 local ranks, each
holding its shards of two padded units (sharded_worker.py), against a reference of W ranks,
one per worker, holding the unpadded units. The inner step is elementwise, so every shard takes
the whole model's steps restricted to it, bit for bit. pulse's window is elementwise or sums
in rank order whatever an element's position, so its global weights and momentum equal the
reference's for any data. diloco's all-reduce sums each segment of a bucket starting at a
different rank, so over more than two workers an element's summation order depends on its
position; over 2 workers each sum has two terms (commutative), so diloco is compared over 2.
The padding's pseudo-gradient is zero, so it never fires and stays zero.
"""

import sys

import pytest

from group_helpers import HERE, Process, clean_environment, finish_all
from test_workers import BOUND_SECONDS, events, free_ports, run

SCRIPT = HERE / "sharded_worker.py"
UNIT_SIZES = (301, 160)  # sharded_worker.UNITS
FLOAT_HEX = 8  # hex digits of one float32


def spawn(workers, shards, args, per_rank_args=None):
    """workers x shards processes of sharded workers (torch.distributed over all)."""
    world = workers * shards
    torch_port, *ports = free_ports(1 + shards)
    return [Process([sys.executable, str(SCRIPT), "--shards", str(shards), *args,
                     *(per_rank_args or {}).get(rank, [])],
                    clean_environment(dict(
                        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(torch_port),
                        PULSELOCO_WORKER_PORTS=",".join(map(str, ports)))))
            for rank in range(world)]


def spawn_reference(workers, args):
    (port,) = free_ports(1)
    return [Process([sys.executable, str(SCRIPT), *args],
                    clean_environment(dict(RANK=str(rank), WORLD_SIZE=str(workers),
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))))
            for rank in range(workers)]


def unsharded(done_of_worker, key):
    """Each unit's hex, its shards' pieces joined in local rank order, the padding cut off."""
    shards = sorted(done_of_worker, key=lambda e: e["local_rank"])
    return ["".join(e[key][unit] for e in shards)[:numel * FLOAT_HEX]
            for unit, numel in enumerate(UNIT_SIZES)]


@pytest.mark.parametrize("mode, workers", [("pulse", 3), ("diloco", 2)])
def test_sharded_workers_equal_one_rank_per_worker_holding_the_whole_model(mode, workers):
    args = ["--mode", mode, "--windows", "3", "--inner-steps", "2"]
    sharded = run(spawn(workers, 2, args))
    reference = run(spawn_reference(workers, args))

    # The worker's ranks hold both units padded to an even length together.
    assert {p.event("ready")["parameter_count"] for p in sharded} == {302 + 160}
    reference_windows = events(reference, "window")
    sharded_windows = events(sharded, "window")
    for window in range(3):
        by_rank = [windows[window] for windows in sharded_windows]
        assert all(e["window"] == window for e in by_rank), by_rank
        assert len({e["digest"] for e in by_rank}) == 1, by_rank  # one worker digest
        for local in range(2):
            assert len({e["share_digest"] for e in by_rank[local::2]}) == 1, by_rank
        if mode == "pulse":
            assert all(e["entries_sent"] > 0 for e in by_rank), by_rank
            # A worker's shares send the reference rank's entries: the padding never fires.
            for worker in range(workers):
                assert sum(e["entries_sent"] for e in by_rank[2 * worker:2 * worker + 2]) == \
                    reference_windows[worker][window]["entries_sent"]

    expected = reference[0].event("done")
    done = [p.event("done") for p in sharded]
    for worker in range(workers):
        mine = done[2 * worker:2 * worker + 2]
        assert unsharded(mine, "global_weights") == expected["global_weights"]
        assert unsharded(mine, "momentum") == expected["momentum"]
        assert unsharded(mine, "local_weights") == expected["local_weights"]
        shards = sorted(mine, key=lambda e: e["local_rank"])
        for unit, numel in enumerate(UNIT_SIZES):  # the padding stayed zero
            whole = "".join(e["global_weights"][unit] for e in shards)
            assert set(whole[numel * FLOAT_HEX:]) <= {"0"}, whole
    assert len({e["digest"] for e in done}) == 1


def test_mismatched_shards_are_refused_naming_both_sides():
    # Worker 1's local rank 1 claims one element more than worker 0's local rank 1.
    processes = spawn(2, 2, ["--windows", "1"], per_rank_args={3: ["--extra", "1"]})
    codes = finish_all(processes, BOUND_SECONDS)
    for process, code in zip(processes, codes):
        assert code == 3, process.log()
        error = process.event("error")
        assert error["type"] == "InvalidArgument", error
        assert "local rank 1's shard tables" in error["message"], error
        assert "rank 1 has 2 tensors, 231 elements" in error["message"], error
        assert "rank 3 has 2 tensors, 233 elements" in error["message"], error


def test_a_sharded_worker_checkpoint_resumes_to_the_uninterrupted_runs_windows(tmp_path):
    root = str(tmp_path / "checkpoints")
    whole = run(spawn(2, 2, ["--windows", "3", "--save", root, "--save-after", "1"]))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == \
        ["local-0-of-2", "local-1-of-2"]
    resumed = run(spawn(2, 2, ["--windows", "3", "--resume", root]))
    first = events(whole, "window")
    for rank, process in enumerate(resumed):
        loaded = process.event("loaded")
        assert loaded["window"] == 1, process.log()
        assert loaded["digest"] == first[rank][0]["digest"]
        later = {e["window"]: e for e in process.events if e["event"] == "window"}
        assert sorted(later) == [1, 2], process.log()
        for window in (1, 2):
            assert later[window]["digest"] == first[rank][window]["digest"]
            assert later[window]["share_digest"] == first[rank][window]["share_digest"]
    assert [p.event("done")["local_weights"] for p in resumed] == \
        [p.event("done")["local_weights"] for p in whole]
