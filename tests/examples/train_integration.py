#!/usr/bin/env python3
"""Integration tests of the training demo (build/bin/pulseloco_train) across real processes.

Each subcommand is one ctest (tests/examples/CMakeLists.txt) and exits 0 when every check holds,
1 with one line per failed check otherwise. The runs are short (a 5 M-parameter model with no
pretraining, H = 2, batch 1) so that the suite stays fast; what they check does not depend on
the model having learnt anything.

  train_integration.py --train BIN --mpirun MPIRUN --work DIR replicas
      mpirun -np 4, mode pulse, 6 windows, over TCP and MPI and with every exchange kind
      (auto, reduction, allgather; the MPI reduction run with --encoding context): every window's
      digests are equal on all ranks, every rank's
      final θ_g file is byte-identical to every other's, and all runs end with byte-identical
      weights. The TCP run publishes θ_g
      every window (--publish-dir): the report lists versions 1..6 with their patch sizes, and
      `pulseloco patch apply` reconstructs every version, the last one equal to bf16 of the
      final θ_g file.
  ... resume
      2 workers (environment rendezvous via --local-workers): 4 windows uninterrupted, against
      a run that checkpoints every window and whose second checkpoint fails on rank 1 as on a
      full disk (PULSELOCO_FAULT): both workers report it and exit 1, the first checkpoint stays
      committed, a copy with one flipped bit in rank 1's optimizer state is refused naming the
      file, and resuming from the intact one to 4 gives identical final weights and per-window
      digests. The checkpoint and trace files are then opened with the standard `safetensors`
      package and their names, shapes, dtypes and bytes checked; `pulseloco replay` reproduces
      every traced window, and names the tensor and index of a value changed in a trace. Modes
      diloco and ddp resume from a checkpoint to the uninterrupted run's digests too.
  ... bf16
      2 workers (--local-workers), weights stored in bf16 (--local-dtype bf16), 3 windows with
      each pseudo-gradient definition (--bf16-delta exact, authors): replicas identical every
      window and byte-identical final θ_g on both ranks; the two definitions end with different
      weights; `pulseloco replay` reproduces every traced window of the authors' run; an
      unknown --local-dtype is refused naming the choices, and a --json report that cannot be
      written fails the run before its first window.
  ... bucket
      2 workers (--local-workers), 3 windows published into a bucket of a local Swift with
      s3api while `pulseloco patch subscribe s3://...` in a second process follows the run: it
      ends holding the last version, bf16 of --final-weights; `pulseloco patch inspect` checks
      every object. Skipped only when Swift is not installed.
  ... exchange_bucket
      2 workers (--local-workers), 3 windows with --exchange-bucket s3://... (a local Swift with
      s3api, no port open between the workers): final weights byte-identical to the same run
      over TCP. Skipped only when Swift is not installed.
  ... json_lines
      2 workers (--local-workers), --json-lines: rank 0, the file's writer, is SIGKILLed in the
      middle of window 3's exchange (PULSELOCO_FAULT); the file holds windows 0 to 2, one valid
      JSON object per line, with hex digests.
  ... kill
      3 workers started as plain processes (environment rendezvous). Once rank 2 has logged a
      finished window, it is SIGKILLed; ranks 0 and 1 must exit non-zero within the
      configured collective timeout, with an error naming peer 2 as lost.

Synchronisation is on events (log lines, process exits), never on sleeps; every wait is bounded.
"""

import argparse
import contextlib
import json
import os
import pathlib
import selectors
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

from ports import free_port

FAILURES = []


def check(condition, message):
    if not condition:
        FAILURES.append(message)
        print(f"FAIL: {message}", flush=True)
    return condition


def common_args(args, cache_dir, lr="1e-4"):
    # No pretraining (the cache key includes the step count, so this never touches the demo's
    # pretrained cache); short windows; one thread per worker (workers share two cores).
    return ["--pretrain-steps", "0", "--cache-dir", str(cache_dir), "-H", "2", "--batch", "1",
            "--eval-batch", "2", "--threads", "1", "--lr", lr]


def mpirun_prefix(args, ranks):
    prefix = [args.mpirun, "-np", str(ranks), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        prefix.append("--allow-run-as-root")
    return prefix


def run(command, timeout, env=None):
    print("+ " + " ".join(command), flush=True)
    result = subprocess.run(command, timeout=timeout, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        print(result.stdout)
    return result


def final_weights(directory, ranks):
    files = [directory / f"global-rank-{rank:05}.safetensors" for rank in range(ranks)]
    return [f.read_bytes() if f.exists() else None for f in files]


def check_report(report_path, ranks, windows, label):
    if not check(report_path.exists(), f"{label}: no JSON report at {report_path}"):
        return None
    report = json.loads(report_path.read_text())
    check(report["world_size"] == ranks, f"{label}: world_size {report['world_size']} != {ranks}")
    check(len(report["windows"]) == windows,
          f"{label}: {len(report['windows'])} windows in the report, expected {windows}")
    check(report["replicas_identical"] is True, f"{label}: replicas_identical is not true")
    for row in report["windows"]:
        digests = row["digests"]
        check(len(digests) == ranks and len(set(digests)) == 1,
              f"{label}: window {row['window']} digests differ across ranks: {digests}")
        check(0 < row["density"] <= 1, f"{label}: window {row['window']} density {row['density']}")
        check(row["payload_bytes"] > 0 and row["payload_bytes"] < row["diloco_bytes"],
              f"{label}: window {row['window']} payload {row['payload_bytes']} is not below "
              f"DiLoCo's {row['diloco_bytes']}")
    return report


def safetensors_tensors(data):
    """{name: (dtype, shape, bytes)} of a safetensors file's bytes (BF16 included, which the
    numpy flavour of the safetensors package cannot load)."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    body = data[8 + size:]
    return {name: (entry["dtype"], entry["shape"],
                   body[entry["data_offsets"][0]:entry["data_offsets"][1]])
            for name, entry in header.items() if name != "__metadata__"}


def bf16_of_f32(raw):
    """The bf16 bits of little-endian fp32 bytes, rounded to nearest even (no NaNs here)."""
    bits = np.frombuffer(raw, dtype="<u4").astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()


def check_published(args, out, report, final_file, windows):
    versions = [row["published_version"] for row in report["windows"]]
    check(versions == list(range(1, windows + 1)), f"published versions {versions}")
    for row in report["windows"][1:]:
        check(row["publish_error"] == "" and 0 < row["patch_density"] < 1
              and 0 < row["patch_compact_bytes"] < row["patch_delta_bytes"],
              f"window {row['window']}: patch {row}")
    for version in range(1, windows + 1):
        state = out / f"version-{version}.safetensors"
        result = run([args.pulseloco, "patch", "apply", str(out / "versions"), "--to",
                      str(version), "--out", str(state)], timeout=args.timeout)
        check(result.returncode == 0, f"patch apply --to {version} exited {result.returncode}")
    if not (out / f"version-{windows}.safetensors").exists():
        return
    published = safetensors_tensors((out / f"version-{windows}.safetensors").read_bytes())
    final = {name.removeprefix("global."): tensor  # θ_g's names in the final weights file
             for name, tensor in safetensors_tensors(final_file).items()}
    check(set(published) == set(final), f"published tensors {sorted(published)[:5]}... are "
          f"not the final file's {sorted(final)[:5]}...")
    for name, (dtype, shape, raw) in published.items():
        if name not in final:
            continue
        check(dtype == "BF16" and shape == final[name][1], f"{name}: {dtype} {shape}")
        check(raw == bf16_of_f32(final[name][2]),
              f"{name}: the last published version is not bf16 of the final θ_g")


def test_replicas(args):
    ranks, windows = 4, 6
    cache = args.work / "cache"
    weights = {}
    # Every exchange kind over TCP and MPI ends on the same bits (the default, auto, chooses per
    # window; the others are forced), and so does the context encoding (the owners' reduced
    # ranges coded against θ_g too).
    for transport, exchange, encoding in (("tcp", "auto", "pulse"), ("mpi", "reduction", "context"),
                                          ("tcp", "allgather", "pulse")):
        name = f"{transport}-{exchange}-{encoding}"
        out = args.work / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        publish = ["--publish-dir", str(out / "versions")] if exchange == "auto" else []
        result = run(mpirun_prefix(args, ranks) + [
            args.train, "--mode", "pulse", "--transport", transport, "--windows", str(windows),
            "--exchange", exchange, "--encoding", encoding,
            "--json", str(out / "report.json"), "--final-weights", str(out / "final")]
            + publish + common_args(args, cache), timeout=args.timeout)
        if not check(result.returncode == 0, f"{name}: mpirun exited {result.returncode}"):
            continue
        report = check_report(out / "report.json", ranks, windows, name)
        if report is not None and exchange != "auto":
            ran = {w["exchange"] for w in report["windows"]}
            check(ran == {exchange}, f"{name}: the windows ran {ran}")
        if report is not None:
            check(report["encoding"] == encoding, f"{name}: the report names encoding "
                  f"{report['encoding']}")
        files = final_weights(out / "final", ranks)
        check(all(f is not None for f in files), f"{name}: a rank wrote no final weights")
        if all(f is not None for f in files):
            check(all(f == files[0] for f in files),
                  f"{name}: the ranks' final θ_g files are not byte-identical")
            weights[name] = files[0]
            if publish and report is not None:
                check_published(args, out, report, files[0], windows)
    check(len(set(weights.values())) == 1,
          f"the runs ended with different final weights: {sorted(weights)}")
    # The dense baselines run through the same program (the demo's other two runs).
    for mode in ("diloco", "ddp"):
        result = run(mpirun_prefix(args, ranks) + [
            args.train, "--mode", mode, "--windows", "2"] + common_args(args, cache),
            timeout=args.timeout)
        check(result.returncode == 0, f"{mode}: mpirun exited {result.returncode}")
        check("replicas bit-identical every window" in result.stdout,
              f"{mode}: no summary with identical replicas:\n{result.stdout[-2000:]}")


def test_resume(args):
    ranks = 2
    cache = args.work / "cache"
    shutil.rmtree(args.work / "resume", ignore_errors=True)
    base = args.work / "resume"
    full, part = base / "full", base / "part"
    common = ["--local-workers", str(ranks), "--mode", "pulse"] + common_args(args, cache)

    result = run([args.train, "--windows", "4", "--json", str(full / "report.json"),
                  "--final-weights", str(full / "final"), "--trace-dir", str(full / "trace"),
                  "--checkpoint-dir", str(full / "checkpoint"), "--checkpoint-every", "2"]
                 + common, timeout=args.timeout)
    check(result.returncode == 0, f"uninterrupted run exited {result.returncode}")
    # A run that does not resume from that root must not save there: removing old checkpoints
    # would delete the first run's. It is refused before its first window, the root unchanged.
    held = sorted(p.name for p in (full / "checkpoint").iterdir())
    result = run([args.train, "--windows", "1", "--checkpoint-dir", str(full / "checkpoint"),
                  "--checkpoint-every", "1"] + common, timeout=args.timeout)
    check(result.returncode == 1 and
          f"--checkpoint-dir {full / 'checkpoint'} holds another run's checkpoints (newest: "
          f"{held[-1]})" in result.stdout and
          sorted(p.name for p in (full / "checkpoint").iterdir()) == held,
          f"a fresh run into another run's checkpoint root was not refused:\n{result.stdout}")
    # The run to window 2 checkpoints every window; rank 1's write of the second checkpoint
    # fails as on a full disk: every worker reports it and exits 1 (no abort), and the first
    # checkpoint stays committed.
    full_disk = dict(os.environ, PULSELOCO_FAULT="window=2,phase=checkpoint,action=enospc,rank=1")
    result = run([args.train, "--windows", "2", "--checkpoint-dir", str(part / "checkpoint"),
                  "--checkpoint-every", "1"] + common, timeout=args.timeout, env=full_disk)
    reports = [line for line in result.stdout.splitlines()
               if line.startswith("pulseloco_train: I/O error: the checkpoint of window 2")
               and "rank 1: " in line and "No space left on device" in line]
    check(result.returncode == 1 and len(reports) == ranks,
          f"a full disk on rank 1: exit {result.returncode}, {len(reports)} workers reported it")
    committed = sorted(p.name for p in (part / "checkpoint").iterdir())
    check(committed == ["window-000001"], f"after the failed save the root holds {committed}")

    # One flipped bit in rank 1's optimizer state: resuming fails on every worker naming it.
    damaged = part / "damaged"
    shutil.copytree(part / "checkpoint", damaged)
    victim = damaged / "window-000001" / "rank-00001.optimizer.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x08
    victim.write_bytes(bytes(data))
    result = run([args.train, "--windows", "4", "--resume", str(damaged)] + common,
                 timeout=args.timeout)
    named = [line for line in result.stdout.splitlines()
             if line.startswith("pulseloco_train:") and f"{victim}: the file is damaged" in line]
    check(result.returncode == 1 and len(named) == ranks,
          f"a flipped bit in {victim.name}: exit {result.returncode}, {len(named)} workers named it")

    result = run([args.train, "--windows", "4", "--json", str(part / "second.json"),
                  "--resume", str(part / "checkpoint"), "--final-weights", str(part / "final")]
                 + common, timeout=args.timeout)
    check(result.returncode == 0, f"resumed run exited {result.returncode}")
    if FAILURES:
        return

    check("resumed at window 1 from " in result.stdout, "the resumed run did not say it resumed")
    a = final_weights(full / "final", ranks)
    b = final_weights(part / "final", ranks)
    check(a[0] is not None and a == b,
          "the resumed run's final weights differ from the uninterrupted run's")
    full_report = check_report(full / "report.json", ranks, 4, "uninterrupted")
    second = check_report(part / "second.json", ranks, 3, "resumed part")
    if full_report and second:
        resumed = [w["digests"][0] for w in second["windows"]]
        uninterrupted = [w["digests"][0] for w in full_report["windows"][1:]]
        check(resumed == uninterrupted,
              f"per-window digests differ: {resumed} vs uninterrupted {uninterrupted}")
        check([w["window"] for w in second["windows"]] == [1, 2, 3],
              f"the resumed run reports windows {[w['window'] for w in second['windows']]}")

    check_files_with_safetensors(full, ranks)
    check_inspect(args, full / "trace")
    check_replay(args, full / "trace")
    for mode in ("diloco", "ddp"):
        check_resume_continues(args, mode)


def check_resume_continues(args, mode):
    """Mode `mode`, 2 workers: a run of 3 windows checkpointing every window, and a run resumed
    from its first checkpoint (pulseloco_train continues the data at loaded.next_window) whose
    windows have the uninterrupted run's digests."""
    ranks = 2
    base = args.work / "resume" / mode
    common = ["--local-workers", str(ranks), "--mode", mode] + common_args(args,
                                                                          args.work / "cache")
    result = run([args.train, "--windows", "3", "--json", str(base / "full.json"),
                  "--checkpoint-dir", str(base / "checkpoint"), "--checkpoint-every", "1",
                  "--checkpoint-keep", "3"] + common, timeout=args.timeout)
    if not check(result.returncode == 0, f"{mode}: uninterrupted run exited {result.returncode}"):
        return
    result = run([args.train, "--windows", "3", "--json", str(base / "resumed.json"),
                  "--resume", str(base / "checkpoint" / "window-000001")] + common,
                 timeout=args.timeout)
    if not check(result.returncode == 0, f"{mode}: resumed run exited {result.returncode}"):
        return
    full = json.loads((base / "full.json").read_text())["windows"]
    resumed = json.loads((base / "resumed.json").read_text())["windows"]
    check([w["window"] for w in resumed] == [1, 2],
          f"{mode}: the resumed run reports windows {[w['window'] for w in resumed]}")
    check([w["digests"] for w in resumed] == [w["digests"] for w in full[1:]],
          f"{mode}: resumed digests {[w['digests'] for w in resumed]} differ from the "
          f"uninterrupted run's {[w['digests'] for w in full[1:]]}")


def test_json_lines(args):
    """--json-lines: rank 0 appends one JSON object per window as each completes. Rank 0 itself
    is SIGKILLed in the middle of window 3's exchange (PULSELOCO_FAULT): the file holds windows
    0, 1 and 2, one valid JSON object per line, with hex digests."""
    ranks = 2
    base = args.work / "json_lines"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    lines_file = base / "windows.jsonl"
    env = dict(os.environ, PULSELOCO_FAULT="window=3,phase=exchange,action=kill,rank=0")
    result = run([args.train, "--local-workers", str(ranks), "--mode", "pulse", "--windows", "6",
                  "--timeout-ms", "20000", "--json-lines", str(lines_file)]
                 + common_args(args, args.work / "cache"), timeout=args.timeout, env=env)
    check(result.returncode != 0, "the run whose rank 0 was killed exited 0")
    if not check(lines_file.exists(), f"no --json-lines file at {lines_file}"):
        return
    text = lines_file.read_text()
    check(text.endswith("\n"), "the --json-lines file does not end with a complete line")
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            check(False, f"line {number} of {lines_file} is not JSON ({error}): {line!r}")
    check([r.get("window") for r in rows] == [0, 1, 2],
          f"the file holds windows {[r.get('window') for r in rows]}, expected [0, 1, 2]")
    for r in rows:
        for digest in [r.get("digest")] + list(r.get("digests", [])):
            check(isinstance(digest, str) and len(digest) == 16
                  and all(c in "0123456789abcdef" for c in digest),
                  f"window {r.get('window')}: digest {digest!r} is not 16 lowercase hex digits")
        check(len(r.get("digests", [])) == ranks and set(r["digests"]) == {r["digest"]},
              f"window {r.get('window')}: digests {r.get('digests')} vs {r.get('digest')}")
        for key in ("loss", "train_loss", "entries", "payload_bytes", "seconds"):
            check(key in r, f"window {r.get('window')}: no {key!r} in {sorted(r)}")
        seconds = r.get("seconds", {})
        check(abs(seconds.get("exchange_wait", -1) + seconds.get("exchange_transfer", -1)
                  - seconds.get("exchange", 0)) < 1e-9,
              f"window {r.get('window')}: exchange is not exchange_wait + exchange_transfer in "
              f"{seconds}")


@contextlib.contextmanager
def swift_environment(bucket):
    """A local Swift with s3api (tests/io/swift_s3_server.py) holding `bucket`: yields the
    environment its clients need (endpoint, region, credentials), or None when it did not start
    (a failed check). Exits 77 (skipped) only when Swift is not installed."""
    fixture = pathlib.Path(__file__).resolve().parents[1] / "io" / "swift_s3_server.py"
    server = subprocess.Popen(["/usr/bin/python3", str(fixture), "--bucket", bucket],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()  # bounded by the fixture's own start timeout
        if line.startswith("SKIP:"):
            print(line.strip(), flush=True)
            sys.exit(77)
        if not check(line.startswith("{"), f"the S3 server did not start: {line!r}"):
            yield None
            return
        info = json.loads(line)
        yield dict(os.environ, PULSELOCO_S3_ENDPOINT=info["endpoint"], AWS_REGION=info["region"],
                   AWS_ACCESS_KEY_ID=info["access_key"], AWS_SECRET_ACCESS_KEY=info["secret_key"])
    finally:
        server.stdin.close()  # the fixture stops Swift and removes its directory
        server.wait(timeout=120)


def test_bucket(args):
    """--publish-dir s3://...: 2 workers publish 3 windows into a bucket of a local Swift with
    s3api (tests/io/swift_s3_server.py) while `pulseloco patch subscribe s3://...`, started
    before the run in a second process, follows it; the subscriber ends holding version 3, which
    is bf16 of the run's --final-weights (scripts/lib/compare_bf16_state.py), and `pulseloco
    patch inspect` checks every object. Skipped (77) only when Swift is not installed."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "scripts" / "lib"))
    from compare_bf16_state import compare

    ranks, windows = 2, 3
    base = args.work / "bucket"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    with swift_environment("pulseloco-train") as env:
        if env is not None:
            follow_bucket(args, base, env, ranks, windows, compare)


def follow_bucket(args, base, env, ranks, windows, compare):
    """test_bucket's run and subscriber, against the server whose environment is `env`."""
    subscriber = None
    try:
        address = f"s3://pulseloco-train/run-{os.getpid()}"
        state = base / "subscribed.safetensors"
        subscriber = subprocess.Popen(
            [args.pulseloco, "patch", "subscribe", address, "--out", str(state), "--until",
             str(windows), "--poll-ms", "200"], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        result = run([args.train, "--local-workers", str(ranks), "--mode", "pulse", "--windows",
                      str(windows), "--publish-dir", address, "--json", str(base / "report.json"),
                      "--final-weights", str(base / "final")]
                     + common_args(args, args.work / "cache"), timeout=args.timeout, env=env)
        if not check(result.returncode == 0, f"the run exited {result.returncode}"):
            return
        report = check_report(base / "report.json", ranks, windows, "bucket")
        if report is not None:
            versions = [row["published_version"] for row in report["windows"]]
            check(versions == list(range(1, windows + 1)), f"published versions {versions}")
            check(all(row["publish_error"] == "" for row in report["windows"]),
                  f"publish errors: {[row['publish_error'] for row in report['windows']]}")
        try:
            output, _ = subscriber.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            check(False, "the subscriber did not reach the last version")
            return
        check(subscriber.returncode == 0, f"the subscriber exited {subscriber.returncode}: {output}")
        check(f"version {windows} " in output, f"the subscriber printed: {output}")
        final = base / "final" / "global-rank-00000.safetensors"
        if check(state.exists() and final.exists(), "no subscribed state or final weights"):
            problem = compare(state, final)
            check(problem is None, f"the subscribed state: {problem}")
        inspect = run([args.pulseloco, "patch", "inspect", address], timeout=args.timeout,
                      env=env)
        check(inspect.returncode == 0, f"patch inspect exited {inspect.returncode}")
    finally:
        if subscriber is not None and subscriber.poll() is None:
            subscriber.kill()
            subscriber.wait()


def test_exchange_bucket(args):
    """--exchange-bucket s3://...: 2 workers run 3 windows through a bucket of a local Swift with
    s3api, no port open between them, and end with final weights byte-identical to the same run
    over TCP. Skipped (77) only when Swift is not installed."""
    ranks, windows = 2, 3
    base = args.work / "exchange_bucket"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    with swift_environment("pulseloco-train") as env:
        if env is None:
            return
        env["PULSELOCO_SECRET"] = "exchange-bucket-test"
        finals = {}
        for name, extra in (("tcp", []),
                            ("bucket", ["--exchange-bucket",
                                        f"s3://pulseloco-train/exchange-{os.getpid()}"])):
            result = run([args.train, "--local-workers", str(ranks), "--mode", "pulse",
                          "--windows", str(windows), "--final-weights", str(base / name)]
                         + extra + common_args(args, args.work / "cache"),
                         timeout=args.timeout, env=env)
            if not check(result.returncode == 0, f"the {name} run exited {result.returncode}"):
                return
            finals[name] = (base / name / "global-rank-00000.safetensors").read_bytes()
        check(finals["tcp"] == finals["bucket"],
              "the run through the bucket ended with other weights than over TCP")


def test_bf16(args):
    ranks, windows = 2, 3
    cache = args.work / "cache"
    base = args.work / "bf16"
    shutil.rmtree(base, ignore_errors=True)
    finals = {}
    for delta in ("exact", "authors"):
        out = base / delta
        result = run([args.train, "--local-workers", str(ranks), "--mode", "pulse",
                      "--local-dtype", "bf16", "--bf16-delta", delta, "--windows", str(windows),
                      "--json", str(out / "report.json"), "--final-weights", str(out / "final"),
                      "--trace-dir", str(out / "trace")] + common_args(args, cache),
                     timeout=args.timeout)
        if not check(result.returncode == 0, f"bf16 {delta}: exited {result.returncode}"):
            continue
        check(f"bf16 local weights (bf16 delta {delta})" in result.stdout,
              f"bf16 {delta}: the header does not name the local dtype and delta")
        report = check_report(out / "report.json", ranks, windows, f"bf16 {delta}")
        if report:
            check(report["local_dtype"] == "bf16" and report["bf16_delta"] == delta,
                  f"bf16 {delta}: report says {report['local_dtype']} / {report['bf16_delta']}")
        files = final_weights(out / "final", ranks)
        if check(all(f is not None for f in files), f"bf16 {delta}: a rank wrote no weights"):
            check(all(f == files[0] for f in files), f"bf16 {delta}: final θ_g files differ")
            finals[delta] = files[0]
    if len(finals) == 2:
        check(finals["exact"] != finals["authors"],
              "bf16: exact and authors ended with identical weights")
    trace = base / "authors" / "trace"
    if trace.exists():
        result = run([args.pulseloco, "replay", str(trace)], timeout=args.timeout)
        check(result.returncode == 0, f"pulseloco replay of the bf16 authors run exited "
              f"{result.returncode}:\n{result.stdout}")
    result = run([args.train, "--local-dtype", "fp16", "--windows", "0"], timeout=60)
    check(result.returncode != 0 and "must be one of fp32, bf16, got fp16" in result.stdout,
          f"--local-dtype fp16 was not refused by name:\n{result.stdout}")
    # A --json report that cannot be written fails the run before its first window.
    blocker = base / "a-file"
    blocker.write_text("not a directory")
    result = run([args.train, "--windows", "1", "--json", str(blocker / "report.json")] +
                 common_args(args, cache), timeout=args.timeout)
    check(result.returncode == 1 and
          f"cannot create the --json directory {blocker}" in result.stdout and
          not any(line.split()[:1] == ["0"] for line in result.stdout.splitlines()),
          f"an unwritable --json was not refused before the first window:\n{result.stdout}")
    # The other places a run writes to, and the flags that go together, are checked first too.
    refusals = [
        (["--final-weights", str(blocker / "final")],
         f"cannot create the --final-weights directory {blocker / 'final'}"),
        (["--checkpoint-dir", str(base / "checkpoints")],
         "--checkpoint-dir and --checkpoint-every (windows between checkpoints, at least 1) go "
         "together"),
        (["--checkpoint-every", "1"], "--checkpoint-dir and --checkpoint-every"),
        (["--local-dtype", "bf16", "--mode", "ddp"], "--local-dtype bf16 needs --mode pulse or diloco"),
        # Accepted as doubles, these round to infinity and to 1 as the floats they are stored in.
        (["--outer-lr", "1e39"], "--outer-lr: inf as a float, not a finite positive number"),
        (["--outer-momentum", "0.99999999"], "--outer-momentum: 1 as a float, not below 1"),
    ]
    for flags, message in refusals:
        result = run([args.train, "--windows", "1"] + flags + common_args(args, cache),
                     timeout=args.timeout)
        check(result.returncode == 1 and message in result.stdout and
              not any(line.split()[:1] == ["0"] for line in result.stdout.splitlines()),
              f"{' '.join(flags)} was not refused before the first window:\n{result.stdout}")
    check(not (base / "checkpoints").exists(), "a refused run created its checkpoint root")


def check_inspect(args, trace):
    """`pulseloco inspect` reads the message a traced rank sent and verifies every frame."""
    message = trace / "window-000002" / "rank-00001.message"
    result = run([args.pulseloco, "inspect", "--json", str(message)], timeout=args.timeout)
    check(result.returncode == 0, f"pulseloco inspect {message} exited {result.returncode}")
    header = json.loads(result.stdout)["header"]
    check(header["window"] == 2 and header["sender_rank"] == 1,
          f"pulseloco inspect: unexpected header {header}")


def check_replay(args, trace):
    """`pulseloco replay` reproduces every traced window, and points at a tampered value."""
    result = run([args.pulseloco, "replay", str(trace)], timeout=args.timeout)
    check(result.returncode == 0, f"pulseloco replay exited {result.returncode}")
    for window in range(4):
        check(f"window {window}: 2 ranks, " in result.stdout and "bit-identical" in result.stdout,
              f"pulseloco replay did not report window {window} bit-identical:\n{result.stdout}")
    # Change one recorded output of rank 1 in window 1 (a raw edit of the file's data section).
    path = trace / "window-000001" / "rank-00001.out.safetensors"
    data = bytearray(path.read_bytes())
    header_bytes = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_bytes])
    name = sorted(n for n in header if n.startswith("global."))[0]
    begin = 8 + header_bytes + header[name]["data_offsets"][0] + 4 * 5  # element 5
    data[begin:begin + 4] = bytes(a ^ b for a, b in zip(data[begin:begin + 4], b"\x00\x00\x80\x3f"))
    path.write_bytes(bytes(data))
    result = run([args.pulseloco, "replay", str(trace), "--window", "1"], timeout=args.timeout)
    check(result.returncode == 2, f"replay of a tampered trace exited {result.returncode}, not 2")
    check(f"rank 1 tensor '{name}': 1 elements differ, the first at index 5" in result.stdout,
          f"replay of a tampered trace does not point at {name}[5]:\n{result.stdout}")


def check_files_with_safetensors(run_dir, ranks):
    """Opens the checkpoint, trace and weight files with the standard safetensors package."""
    from safetensors import safe_open

    def tensors(path):
        out = {}
        with safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata() or {}
            for name in f.keys():
                out[name] = f.get_tensor(name)
        return metadata, out

    final_meta, final = tensors(run_dir / "final" / "global-rank-00000.safetensors")
    check(final_meta.get("window") == "4", f"final weights say window {final_meta.get('window')}")
    names = sorted(n[len("global."):] for n in final)
    check(len(names) > 0 and all(n.startswith("global.") for n in final),
          "the final weights hold tensors not named global.*")
    total = sum(t.size for t in final.values())
    check(total == 5_003_776, f"the final weights hold {total} parameters, expected 5,003,776")
    check(all(t.dtype == np.float32 for t in final.values()), "final weights are not all F32")

    # The checkpoints after windows 2 and 4 (the newest two are kept). The one of window 4: θ_g
    # and m in the shared file, e and the AdamW state in each rank's; the manifest lists them.
    root = run_dir / "checkpoint"
    kept = sorted(p.name for p in root.iterdir())
    check(kept == ["window-000002", "window-000004"], f"the checkpoint root holds {kept}")
    checkpoint = root / "window-000004"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    listed = {f["name"]: f["size"] for f in manifest["files"]}
    expected = ["global.safetensors"] + [f"rank-{r:05}.{kind}" for r in range(ranks)
                                         for kind in ("safetensors", "optimizer.pt")]
    check(sorted(listed) == sorted(expected) and manifest["window"] == 4,
          f"the manifest lists {sorted(listed)} at window {manifest['window']}")
    for name, size in listed.items():
        check((checkpoint / name).stat().st_size == size, f"{name}: size differs from the manifest")
    meta, shared = tensors(checkpoint / "global.safetensors")
    check(meta.get("format") == "pulseloco-checkpoint" and meta.get("window") == "4"
          and meta.get("world_size") == str(ranks),
          f"checkpoint metadata: {dict((k, meta.get(k)) for k in ('format', 'window', 'world_size'))}")
    check(sorted(shared) == sorted([f"global.{n}" for n in names] +
                                   [f"momentum.{n}" for n in names]),
          "the checkpoint's shared file does not hold exactly global.* and momentum.* per tensor")
    for n in names:
        g = shared.get(f"global.{n}")
        check(g is not None and g.dtype == np.float32 and g.shape == final[f"global.{n}"].shape
              and g.tobytes() == final[f"global.{n}"].tobytes(),
              f"checkpoint global.{n} is not the final θ_g (dtype, shape or bytes)")
        m = shared.get(f"momentum.{n}")
        check(m is not None and m.dtype == np.float32 and m.shape == g.shape,
              f"checkpoint momentum.{n}: wrong dtype or shape")
    any_momentum = any(np.any(shared[f"momentum.{n}"] != 0) for n in names)
    check(any_momentum, "the checkpoint's momentum is all zeros after 4 windows")
    for rank in range(ranks):
        rank_meta, rank_tensors = tensors(checkpoint / f"rank-{rank:05}.safetensors")
        check(rank_meta.get("rank") == str(rank), f"rank file {rank} says rank {rank_meta.get('rank')}")
        check(sorted(rank_tensors) == sorted(f"residual.{n}" for n in names),
              f"rank file {rank} does not hold exactly residual.* per tensor")
        check(all(rank_tensors[f"residual.{n}"].shape == final[f"global.{n}"].shape
                  and rank_tensors[f"residual.{n}"].dtype == np.float32 for n in names),
              f"rank file {rank}: residual shapes or dtypes differ from the model's")

    # Traces: every window has .in and .out per rank; the outputs of window w are the inputs of
    # window w + 1, and the outputs of the last window are the final weights.
    trace = run_dir / "trace"
    for window in range(4):
        for rank in range(ranks):
            for stage in ("in", "out"):
                path = trace / f"window-{window:06}" / f"rank-{rank:05}.{stage}.safetensors"
                check(path.exists(), f"trace file {path} is missing")
    if FAILURES:
        return
    for rank in range(ranks):
        for window in range(4):
            out_meta, out = tensors(trace / f"window-{window:06}" / f"rank-{rank:05}.out.safetensors")
            check(out_meta.get("stage") == "outputs" and out_meta.get("window") == str(window),
                  f"trace window {window} rank {rank}: metadata {out_meta.get('stage')}/"
                  f"{out_meta.get('window')}")
            expected = sorted(f"{p}.{n}" for p in ("global", "momentum", "residual", "local")
                              for n in names)
            check(sorted(out) == expected,
                  f"trace window {window} rank {rank}: tensor names differ from "
                  "global/momentum/residual/local per parameter")
            if window + 1 < 4:
                in_meta, nxt = tensors(trace / f"window-{window + 1:06}" /
                                       f"rank-{rank:05}.in.safetensors")
                check(in_meta.get("stage") == "inputs", "trace input file has the wrong stage")
                for prefix in ("global", "momentum", "residual"):
                    same = all(out[f"{prefix}.{n}"].tobytes() == nxt[f"{prefix}.{n}"].tobytes()
                               for n in names)
                    check(same, f"trace rank {rank}: {prefix} after window {window} differs "
                          f"from {prefix} before window {window + 1}")
            else:
                same = all(out[f"global.{n}"].tobytes() == final[f"global.{n}"].tobytes()
                           for n in names)
                check(same, f"trace rank {rank}: θ_g after the last window is not the final θ_g")



def test_kill(args):
    check_killed_worker(args)


def check_killed_worker(args, extra=(), fault=None, timeouts=1):
    """3 workers started as plain processes (environment rendezvous), `extra` added to their
    flags. Rank 2 dies: SIGKILLed here once it has logged a finished window, or, with `fault`
    (a PULSELOCO_FAULT value for rank 2), by itself where that says. Ranks 0 and 1 must exit
    non-zero within `timeouts` times the collective timeout, naming peer 2 as lost."""
    ranks, victim, timeout_ms = 3, 2, 10000
    cache = args.work / "cache"
    port = free_port()
    processes = []
    selector = selectors.DefaultSelector()
    logs = {rank: "" for rank in range(ranks)}
    open_ranks = set(range(ranks))
    exited_at = {}
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PULSELOCO_RENDEZVOUS="env",
                   # The event below is the victim's own window line: an info line, which ranks
                   # other than 0 log only when asked.
                   PULSELOCO_LOG_LEVEL="info", PULSELOCO_LOG_ALL_RANKS="1")
        env.pop("PULSELOCO_FAULT", None)
        if fault and rank == victim:
            env["PULSELOCO_FAULT"] = fault
        command = [args.train, "--mode", "pulse", "--windows", "1000",
                   "--timeout-ms", str(timeout_ms)] + list(extra) + common_args(args, cache)
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT)
        os.set_blocking(process.stdout.fileno(), False)
        selector.register(process.stdout, selectors.EVENT_READ, rank)
        processes.append(process)

    def note_exits():
        for rank, process in enumerate(processes):
            if rank not in exited_at and process.poll() is not None:
                exited_at[rank] = time.monotonic()

    def pump(until, predicate):
        """Reads output until predicate() holds or the deadline passes; returns predicate().
        Exits are noted before every evaluation, so a predicate on exited_at sees each exit
        together with its time."""
        note_exits()
        while not predicate() and time.monotonic() < until:
            for key, _ in selector.select(timeout=max(0.0, min(1.0, until - time.monotonic()))):
                chunk = key.fileobj.read()
                if chunk:
                    logs[key.data] += chunk.decode(errors="replace")
                elif chunk == b"":
                    selector.unregister(key.fileobj)
                    open_ranks.discard(key.data)
            note_exits()
        return predicate()

    try:
        if fault:
            # Event: the victim's exit (it SIGKILLs itself where the fault says).
            died = pump(time.monotonic() + args.timeout, lambda: victim in exited_at)
            if not check(died and processes[victim].returncode == -signal.SIGKILL,
                         f"rank {victim} did not die of the fault {fault}: exit "
                         f"{processes[victim].poll()}\n{logs[victim][-2000:]}"):
                return
            killed_at = exited_at[victim]
        else:
            # Event: the victim has finished a window (its engine logs "window 1 pulse: ...").
            started = pump(time.monotonic() + args.timeout,
                           lambda: "window 1 pulse:" in logs[victim]
                           or any(p.poll() is not None for p in processes))
            if not check(started and processes[victim].poll() is None,
                         f"rank {victim} never logged window 1:\n{logs[victim]}"):
                return
            processes[victim].send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
        survivors = [r for r in range(ranks) if r != victim]
        # A lost connection is noticed at once; a survivor still computing its inner steps
        # notices at its next exchange (overlapped windows: at the boundary after the exchange
        # that failed). Either way within the bound (waiting up to twice as long, to report how
        # late a survivor was rather than only that it was).
        bound = timeouts * timeout_ms / 1000.0
        pump(killed_at + 2 * bound, lambda: all(r in exited_at for r in survivors))
        for r in survivors:
            code = processes[r].poll()
            if not check(code is not None, f"rank {r} still runs {2 * bound:.0f} s after the kill"):
                continue
            elapsed = exited_at.get(r, time.monotonic()) - killed_at
            check(code != 0, f"rank {r} exited 0 after its peer was killed")
            check(elapsed <= bound, f"rank {r} exited {elapsed:.1f} s after the kill, later than "
                  f"{timeouts} x the configured timeout ({bound:.0f} s)")
            pump(time.monotonic() + 10, lambda: r not in open_ranks)  # the rest of its output
            error_lines = [l for l in logs[r].splitlines() if "pulseloco_train:" in l]
            # Every survivor names the victim, also one whose collective waited on the other
            # survivor and saw that one leave (after it had failed because of the victim).
            check(any(f"peer {victim} was lost" in l for l in error_lines),
                  f"rank {r}'s error does not name rank {victim} as lost: {error_lines}\n"
                  f"{logs[r][-2000:]}")
            print(f"rank {r}: exit {code} within {elapsed:.1f} s of the kill: "
                  f"{error_lines[-1] if error_lines else '(no error line)'}", flush=True)
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
            p.wait()


def run_tests(description, tests, add_arguments=lambda parser: None):
    """Parses the flags every integration script shares (and those `add_arguments` adds), runs
    the test named on the command line, and returns the exit status."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", required=True)
    parser.add_argument("--pulseloco", required=True, help="build/bin/pulseloco")
    parser.add_argument("--mpirun", default="mpirun")
    parser.add_argument("--work", required=True, type=pathlib.Path)
    parser.add_argument("--timeout", type=float, default=600, help="bound of each run, seconds")
    add_arguments(parser)
    parser.add_argument("test", choices=sorted(tests))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    tests[args.test](args)
    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed", flush=True)
        return 1
    print("all checks passed", flush=True)
    return 0


def main():
    return run_tests(__doc__, {"replicas": test_replicas, "resume": test_resume,
                               "kill": test_kill, "bf16": test_bf16,
                               "json_lines": test_json_lines, "bucket": test_bucket,
                               "exchange_bucket": test_exchange_bucket})


if __name__ == "__main__":
    sys.exit(main())
