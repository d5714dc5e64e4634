#!/usr/bin/env python3
"""`pulseloco patch apply` and `pulseloco patch inspect` over a published run.

apply from nothing and from a state an earlier apply wrote reaches the newest version
byte-identically (the written file is read with the standard safetensors package); inspect lists
every version and checks every file; a damaged delta makes both exit 1 naming the version, and
apply then leaves --out as it was. `pulseloco patch serve` pushes the run to
`pulseloco patch subscribe`, which reaches the newest version byte-identically from nothing and
from a state it holds (apply's version 3), whose next version comes as a patch; a subscriber with
another secret, or speaking plaintext to the server's TLS, exits 1 naming why. With --bucket,
apply and inspect run over a bucket of the suite's Swift instead (the fixture's
PULSELOCO_TEST_S3_SERVER), the damaged objects written through Swift's own API.

  cli_test.py --pulseloco PATH --publisher PATH --work DIR
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

VERSIONS = 9


def bf16_state(path: Path) -> dict[str, bytes]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k).view(torch.int16).numpy().tobytes() for k in f.keys()}


def run(args: list[str], expect: int = 0,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
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
        fresh = work / "pushed-fresh.safetensors"
        first = subprocess.run([pulseloco, "patch", "subscribe", address, "--out", str(fresh),
                                "--until", str(VERSIONS)], capture_output=True, text=True,
                               timeout=120, env=env)
        assert first.returncode == 0, (first.stdout, first.stderr)
        assert first.stdout.startswith("version "), first.stdout
        assert bf16_state(fresh) == expected
        # Resumes from a state it holds (version 3, as apply wrote it): the versions after it
        # come as patches, not as the newest anchor.
        out = work / "pushed.safetensors"
        shutil.copyfile(work / "at3.safetensors", out)
        second = subprocess.run([pulseloco, "patch", "subscribe", address, "--out", str(out),
                                 "--until", str(VERSIONS)], capture_output=True, text=True,
                                timeout=120, env=env)
        assert second.returncode == 0, (second.stdout, second.stderr)
        lines = second.stdout.splitlines()
        assert lines and lines[0].startswith("version 4 ") and "anchor" not in lines[0], \
            second.stdout
        assert lines[-1].startswith(f"version {VERSIONS} "), second.stdout
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
        # An --out whose existence cannot be told is an error naming the flag, before anything.
        too_long = work / ("a" * 300) / "state.safetensors"
        failed = run([pulseloco, "patch", "subscribe", address, "--out", str(too_long)],
                     expect=1, env=env)
        assert f"I/O error: --out {too_long}: File name too long" in failed.stderr, failed.stderr
    finally:
        server.terminate()
    assert server.wait(timeout=60) == 0


def apply_and_inspect(pulseloco: str, location: str, expected_dir: Path, work: Path,
                      env: dict[str, str] | None = None) -> Path:
    """apply from nothing to 3 and from there to the newest, and inspect, over `location` (a
    directory or a bucket); returns the newest state written."""
    expected = bf16_state(expected_dir / f"step_{VERSIONS:06d}.safetensors")
    at3 = work / "at3.safetensors"
    report = json.loads(run([pulseloco, "patch", "apply", location, "--out", str(at3),
                             "--to", "3", "--json"], env=env).stdout)
    assert report["from"] is None and report["to"] == 3 and report["steps"][0]["kind"] == "anchor"
    assert bf16_state(at3) == bf16_state(expected_dir / "step_000003.safetensors")
    newest = work / "newest.safetensors"
    report = json.loads(run([pulseloco, "patch", "apply", location, "--from", str(at3),
                             "--out", str(newest), "--json"], env=env).stdout)
    assert report["from"] == 3 and report["to"] == VERSIONS, report
    assert {step["kind"] for step in report["steps"]} == {"compact"}, report
    assert bf16_state(newest) == expected

    listing = json.loads(run([pulseloco, "patch", "inspect", location, "--json"],
                             env=env).stdout)
    assert [v["version"] for v in listing["versions"]] == list(range(1, VERSIONS + 1))
    assert all(v[k]["status"] == "ok" for v in listing["versions"]
               for k in ("delta", "compact", "anchor") if k in v)
    assert all(0 < v["density"] < 0.2 for v in listing["versions"][1:]), listing
    return newest


def flip_bit(data: bytes) -> bytes:
    changed = bytearray(data)
    changed[-3] ^= 0x04
    return bytes(changed)


def check_refused(pulseloco: str, location: str, work: Path, env: dict[str, str] | None = None):
    """After version 5's files are damaged: inspect and apply exit 1 naming them, and apply
    leaves --out as it was."""
    failed = run([pulseloco, "patch", "inspect", location], expect=1, env=env)
    assert "step_000005" in failed.stderr, failed.stderr
    newest = work / "newest.safetensors"
    before = newest.read_bytes()
    failed = run([pulseloco, "patch", "apply", location, "--from", str(work / "at3.safetensors"),
                  "--out", str(newest)], expect=1, env=env)
    assert "version 5" in failed.stderr, failed.stderr
    assert newest.read_bytes() == before


def check_flags_refused(pulseloco: str, published: Path, work: Path) -> None:
    """Numbers out of their range are refused at parse time naming the flag and the value
    (CLI11's exit status for a failed check, 105), before anything starts or is written."""
    out = str(work / "flags.safetensors")
    for command, message in [
        (["serve", str(published), "--poll-ms", "0"],
         "--poll-ms: must be between 1 and 86400000, got 0"),
        (["serve", str(published), "--poll-ms", "86400001"], "got 86400001"),
        (["serve", str(published), "--min-rate", "-1"], "--min-rate: must be at least 0, got -1"),
        (["subscribe", "127.0.0.1:1", "--out", out, "--until", "-3"], "--until"),
        (["subscribe", "s3://bucket/run", "--out", out, "--poll-ms", "86400001"],
         "--poll-ms: must be between 1 and 86400000, got 86400001"),
    ]:
        refused = run([pulseloco, "patch", *command], expect=105)
        assert message in refused.stderr + refused.stdout, (command, refused.stderr)
    assert not Path(out).exists()


def bucket(args: argparse.Namespace, work: Path) -> int:
    """The same over a bucket of the suite's Swift (PULSELOCO_TEST_S3_SERVER, its state file);
    the damaged objects are written through Swift's own API, as any writer of the bucket could."""
    line = Path(os.environ["PULSELOCO_TEST_S3_SERVER"]).read_text().splitlines()[0]
    if line.startswith("SKIP:"):
        print(line)
        return 77
    info = json.loads(line)
    env = dict(os.environ, PULSELOCO_S3_ENDPOINT=info["endpoint"], AWS_REGION=info["region"],
               AWS_ACCESS_KEY_ID=info["access_key"], AWS_SECRET_ACCESS_KEY=info["secret_key"])
    prefix = f"cli-{os.getpid()}"
    location = f"s3://pulseloco-tests/{prefix}"
    expected = work / "expected"
    run([args.publisher, location, "gap_delta", str(VERSIONS), "4"], env=env)
    # The same run in a directory, for its expected states.
    run([args.publisher, str(expected), "gap_delta", str(VERSIONS), "4"])
    apply_and_inspect(args.pulseloco, location, expected / "expected", work, env)

    auth = urllib.request.Request(f"{info['endpoint']}/auth/v1.0", headers={
        "X-Auth-User": info["access_key"], "X-Auth-Key": info["secret_key"]})
    with urllib.request.urlopen(auth, timeout=30) as response:
        token = response.headers["X-Auth-Token"]
        storage = response.headers["X-Storage-Url"]
    for key in ("deltas/step_000005.safetensors", "compact/step_000005.plsp"):
        url = f"{storage}/pulseloco-tests/{prefix}/{key}"
        with urllib.request.urlopen(urllib.request.Request(
                url, headers={"X-Auth-Token": token}), timeout=30) as response:
            data = response.read()
        urllib.request.urlopen(urllib.request.Request(
            url, data=flip_bit(data), method="PUT", headers={"X-Auth-Token": token}),
            timeout=30).close()
    check_refused(args.pulseloco, location, work, env)
    print("ok")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pulseloco", required=True)
    parser.add_argument("--publisher", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--bucket", action="store_true",
                        help="over a bucket of the suite's S3 server instead of a directory")
    args = parser.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if args.bucket:
        return bucket(args, work)
    published = work / "published"
    run([args.publisher, str(published), "gap_delta", str(VERSIONS), "4"])
    expected = bf16_state(published / "expected" / f"step_{VERSIONS:06d}.safetensors")

    # From nothing to version 3, then from that state to the newest.
    apply_and_inspect(args.pulseloco, str(published), published / "expected", work)

    push(args.pulseloco, published, work, expected)

    # A bit flipped in version 5's TRL delta and in its compact patch (which apply reads).
    for delta in (published / "deltas" / "step_000005.safetensors",
                  published / "compact" / "step_000005.plsp"):
        delta.write_bytes(flip_bit(delta.read_bytes()))
    check_refused(args.pulseloco, str(published), work)
    check_flags_refused(args.pulseloco, published, work)

    # A listed file that is gone is reported as missing (an I/O error), not as damage.
    missing = published / "deltas" / "step_000005.safetensors"
    missing.unlink()
    failed = run([args.pulseloco, "patch", "inspect", str(published)], expect=1)
    assert f"I/O error: '{missing}' is missing" in failed.stderr, failed.stderr
    assert "damaged" not in failed.stderr, failed.stderr
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
