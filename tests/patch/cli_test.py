#!/usr/bin/env python3
"""`pulseloco patch apply` and `pulseloco patch inspect` over a published run.

apply from nothing and from a state an earlier apply wrote reaches the newest version
byte-identically (the written file is read with the standard safetensors package); inspect lists
every version and checks every file; a damaged delta makes both exit 1 naming the version, and
apply then leaves --out as it was. `pulseloco patch serve` pushes the run to
`pulseloco patch subscribe`, which reaches the newest version byte-identically from nothing and
resumes from the state it wrote; a subscriber with another secret, or speaking plaintext to the
server's TLS, exits 1 naming why.

  cli_test.py --pulseloco PATH --publisher PATH --work DIR
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

VERSIONS = 9


def bf16_state(path: Path) -> dict[str, bytes]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k).view(torch.int16).numpy().tobytes() for k in f.keys()}


def run(args: list[str], expect: int = 0) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert result.returncode == expect, (args, result.returncode, result.stdout, result.stderr)
    return result


def push(pulseloco: str, published: Path, work: Path, expected: dict[str, bytes]) -> None:
    env = dict(os.environ, PULSELOCO_SECRET="cli-push-secret")
    server = subprocess.Popen([pulseloco, "patch", "serve", str(published), "--listen",
                               "127.0.0.1:0"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = server.stdout.readline()  # "serving DIR on HOST:PORT"
        assert line.startswith("serving "), line
        address = line.split()[-1]
        out = work / "pushed.safetensors"
        first = subprocess.run([pulseloco, "patch", "subscribe", address, "--out", str(out),
                                "--until", "1"], capture_output=True, text=True, timeout=120,
                               env=env)
        assert first.returncode == 0, (first.stdout, first.stderr)
        assert first.stdout.startswith("version "), first.stdout
        held = int(first.stdout.split()[1])
        # Resumes from the state it wrote: nothing but the versions after it.
        second = subprocess.run([pulseloco, "patch", "subscribe", address, "--out", str(out),
                                 "--until", str(VERSIONS)], capture_output=True, text=True,
                                timeout=120, env=env)
        assert second.returncode == 0, (second.stdout, second.stderr)
        if held < VERSIONS:
            assert second.stdout.startswith(f"version {held + 1} "), second.stdout
        assert bf16_state(out) == expected
        refused = subprocess.run([pulseloco, "patch", "subscribe", address, "--out",
                                  str(work / "refused.safetensors")], capture_output=True,
                                 text=True, timeout=120,
                                 env=dict(os.environ, PULSELOCO_SECRET="another secret"))
        assert refused.returncode == 1 and "refused this subscriber" in refused.stderr, refused
        assert not (work / "refused.safetensors").exists()
        # Plaintext against the server's TLS (hmac, or no secret) fails at its first attempt,
        # naming why: retried, it would end at its connect timeout as a timeout error.
        no_secret = {k: v for k, v in os.environ.items()
                     if k not in ("PULSELOCO_SECRET", "PULSELOCO_SECRET_FILE")}
        for subscriber_env in (dict(env, PULSELOCO_LINK_SECURITY="hmac"), no_secret):
            mismatched = subprocess.run(
                [pulseloco, "patch", "subscribe", address, "--out",
                 str(work / "mismatched.safetensors")], capture_output=True, text=True,
                timeout=120, env=dict(subscriber_env, PULSELOCO_CONNECT_TIMEOUT_MS="60000"))
            assert mismatched.returncode == 1, mismatched
            assert "pulseloco: protocol violation: " in mismatched.stderr, mismatched.stderr
            assert "link security differs: the server's links use TLS" in mismatched.stderr, \
                mismatched.stderr
            assert not (work / "mismatched.safetensors").exists()
    finally:
        server.terminate()
    assert server.wait(timeout=60) == 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pulseloco", required=True)
    parser.add_argument("--publisher", required=True)
    parser.add_argument("--work", required=True)
    args = parser.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    published = work / "published"
    run([args.publisher, str(published), "gap_delta", str(VERSIONS), "4"])
    expected = bf16_state(published / "expected" / f"step_{VERSIONS:06d}.safetensors")

    # From nothing to version 3, then from that state to the newest.
    at3 = work / "at3.safetensors"
    report = json.loads(run([args.pulseloco, "patch", "apply", str(published), "--out", str(at3),
                             "--to", "3", "--json"]).stdout)
    assert report["from"] is None and report["to"] == 3 and report["steps"][0]["kind"] == "anchor"
    assert bf16_state(at3) == bf16_state(published / "expected" / "step_000003.safetensors")
    newest = work / "newest.safetensors"
    report = json.loads(run([args.pulseloco, "patch", "apply", str(published), "--from", str(at3),
                             "--out", str(newest), "--json"]).stdout)
    assert report["from"] == 3 and report["to"] == VERSIONS, report
    assert {step["kind"] for step in report["steps"]} == {"compact"}, report
    assert bf16_state(newest) == expected

    listing = json.loads(run([args.pulseloco, "patch", "inspect", str(published), "--json"]).stdout)
    assert [v["version"] for v in listing["versions"]] == list(range(1, VERSIONS + 1))
    assert all(v[k]["status"] == "ok" for v in listing["versions"]
               for k in ("delta", "compact", "anchor") if k in v)
    assert all(0 < v["density"] < 0.2 for v in listing["versions"][1:]), listing

    push(args.pulseloco, published, work, expected)

    # A bit flipped in version 5's TRL delta and in its compact patch (which apply reads).
    for delta in (published / "deltas" / "step_000005.safetensors",
                  published / "compact" / "step_000005.plsp"):
        data = bytearray(delta.read_bytes())
        data[-3] ^= 0x04
        delta.write_bytes(bytes(data))
    failed = run([args.pulseloco, "patch", "inspect", str(published)], expect=1)
    assert "step_000005" in failed.stderr, failed.stderr
    before = newest.read_bytes()
    failed = run([args.pulseloco, "patch", "apply", str(published), "--from", str(at3),
                  "--out", str(newest)], expect=1)
    assert "version 5" in failed.stderr, failed.stderr
    assert newest.read_bytes() == before
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
