"""A Synchronizer group through a bucket (group={"exchange_bucket": "s3://..."}), against a local
OpenStack Swift with s3api (tests/io/swift_s3_server.py): two ranks, threads of this process, end
their windows with the same weights as the same two ranks over TCP. Skipped only when Swift is
not installed."""
import json
import os
import pathlib
import subprocess
import threading

import numpy as np
import pytest

import pulseloco
from group_helpers import free_port

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "io" / "swift_s3_server.py"


@pytest.fixture(scope="module")
def s3_environment():
    server = subprocess.Popen(["/usr/bin/python3", str(FIXTURE), "--bucket", "pulseloco-python"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()  # bounded by the fixture's own start timeout
        if line.startswith("SKIP:"):
            pytest.skip(line.strip())
        assert line.startswith("{"), f"the S3 server did not start: {line!r}"
        info = json.loads(line)
        yield {"PULSELOCO_S3_ENDPOINT": info["endpoint"], "AWS_REGION": info["region"],
               "AWS_ACCESS_KEY_ID": info["access_key"],
               "AWS_SECRET_ACCESS_KEY": info["secret_key"]}
    finally:
        server.stdin.close()  # the fixture stops Swift and removes its directory
        server.wait(timeout=120)


def run_two_ranks(groups, windows=3):
    """Two ranks in threads, each with its own weights and local steps; their weights after
    `windows` windows."""
    weights = [np.random.default_rng(r).normal(0, 0.02, 5000).astype(np.float32)
               for r in range(2)]
    errors = []

    def rank(r):
        try:
            with pulseloco.Synchronizer([weights[r]], group=groups[r], timeout=30.0) as sync:
                rng = np.random.default_rng(100 + r)
                for _ in range(windows):
                    weights[r] += rng.normal(0, 1e-3, weights[r].size).astype(np.float32)
                    assert sync.run_window().replicas_identical
        except BaseException as error:  # noqa: BLE001 (handed to the main thread)
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return weights


def test_two_ranks_through_a_bucket_match_tcp(s3_environment, monkeypatch):
    for name, value in s3_environment.items():
        monkeypatch.setenv(name, value)
    port = free_port()
    tcp = [dict(rendezvous="env", rank=r, world_size=2, master_addr="127.0.0.1",
                master_port=port, run_id="tcp", listen_addr="127.0.0.1") for r in range(2)]
    bucket = [dict(exchange_bucket=f"s3://pulseloco-python/run-{os.getpid()}", rank=r,
                   world_size=2, run_id="bucket", secret="python-bucket-test",
                   connect_timeout=30.0) for r in range(2)]
    over_tcp = run_two_ranks(tcp)
    through_bucket = run_two_ranks(bucket)
    for r in range(2):
        assert np.array_equal(over_tcp[r], through_bucket[r])
    assert np.array_equal(through_bucket[0], through_bucket[1])
