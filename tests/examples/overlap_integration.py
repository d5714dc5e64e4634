#!/usr/bin/env python3
"""Overlapped windows (pulseloco_train --overlap delayed|eager, docs/algorithm.md "Overlapped
windows") across real processes. Each subcommand and variant is one ctest
(tests/examples/CMakeLists.txt); exit 0 when every check holds, 1 with one line per failed check.
The runs are those of train_integration.py (a 5 M-parameter model, no pretraining, H = 2, batch
1, one thread per worker) at the demo's inner learning rate.

  overlap_integration.py --train BIN --pulseloco BIN --mpirun MPIRUN --work DIR --overlap V
                         --launcher mpirun|env replicas
      4 ranks, 20 windows, under mpirun (TCP transport, MPI rendezvous) or as 4 processes of
      the environment rendezvous (--local-workers): every window's digests equal on all ranks,
      the report names the variant, boundary 0 applies nothing and boundary w applies window
      w - 1; every rank's final θ_g file byte-identical; the held-out loss is θ_g's (boundary
      0's is the initial loss) and the last window is applied after the loop.
  ... resume
      2 workers: 6 windows uninterrupted (traced: `pulseloco replay` reproduces every
      boundary), against 3 windows that checkpoint after boundary 2 (window 2 in flight: its
      message is in the checkpoint's rank files) and a resumed run to 6: the same final weights
      byte for byte, the same digests and applied windows from the resumption on (its first
      boundary applies the window that was in flight).
  ... kill
      3 workers (environment rendezvous); rank 2 SIGKILLs itself in the middle of window 3's
      exchange, which runs in the background during window 4's inner steps
      (PULSELOCO_FAULT=window=3,phase=exchange,action=kill,rank=2): ranks 0 and 1 exit non-zero
      within twice the collective timeout, naming peer 2 as lost (the failure surfaces at the
      next boundary).

Synchronisation is on events (process exits, log lines); every wait is bounded.
"""

import json
import shutil
import sys

import train_integration as ti
from train_integration import check


def common_args(args):
    # The demo's inner learning rate: sparser messages than train_integration.py's, so that
    # the exchange is short on shared cores.
    return ti.common_args(args, args.work / "cache", lr="3e-6")


def check_overlap_report(report_path, ranks, windows, overlap, label, first=0):
    """The checks of a report every run shares, and the applied window of each boundary."""
    report = ti.check_report(report_path, ranks, windows, label)
    if report is None:
        return None
    check(report["overlap"] == overlap, f"{label}: the report says overlap {report['overlap']}")
    check([row["window"] for row in report["windows"]] == list(range(first, first + windows)),
          f"{label}: windows {[row['window'] for row in report['windows']]}")
    for row in report["windows"]:
        expected = row["window"] - 1 if row["window"] > 0 else None
        check(row["overlap"] == overlap and row["applied_window"] == expected,
              f"{label}: boundary {row['window']} applied window {row['applied_window']} "
              f"({row['overlap']}), expected {expected}")
    return report


def identical_final_weights(directory, ranks, label):
    files = ti.final_weights(directory, ranks)
    if not check(all(f is not None for f in files), f"{label}: a rank wrote no final weights"):
        return None
    if not check(all(f == files[0] for f in files),
                 f"{label}: the ranks' final θ_g files are not byte-identical"):
        return None
    return files[0]


def test_replicas(args):
    ranks, windows = 4, 20
    out = args.work / args.launcher
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if args.launcher == "mpirun":
        prefix = ti.mpirun_prefix(args, ranks) + [args.train, "--transport", "tcp"]
    else:
        prefix = [args.train, "--local-workers", str(ranks)]
    label = f"{args.overlap} under {args.launcher}"
    result = ti.run(prefix + ["--mode", "pulse", "--overlap", args.overlap, "--windows",
                              str(windows), "--json", str(out / "report.json"),
                              "--final-weights", str(out / "final")] + common_args(args),
                    timeout=args.timeout)
    if check(result.returncode == 0, f"{label}: exited {result.returncode}"):
        report = check_overlap_report(out / "report.json", ranks, windows, args.overlap, label)
        identical_final_weights(out / "final", ranks, label)
        if report is not None:
            # The held-out loss is θ_g's: boundary 0 applied nothing (eager's local weights had
            # moved by then); the last window is applied after the loop.
            check(report["windows"][0]["loss"] == report["initial_loss"],
                  f"{label}: boundary 0's loss {report['windows'][0]['loss']} is not the initial "
                  f"{report['initial_loss']}")
            check(report["windows_applied"] == windows,
                  f"{label}: {report['windows_applied']} windows applied, expected {windows}")


def in_flight_windows(checkpoint, ranks):
    """The window of the message in flight that each rank file of a checkpoint records (None
    where it holds no message)."""
    windows = []
    for rank in range(ranks):
        data = (checkpoint / f"rank-{rank:05}.safetensors").read_bytes()
        header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
        message = header.get("in_flight_message", {})
        holds = message.get("dtype") == "U8" and message.get("shape", [0])[0] > 0
        windows.append(header.get("__metadata__", {}).get("in_flight_window") if holds else None)
    return windows


def test_resume(args):
    ranks, windows, stop = 2, 6, 3
    base = args.work / "resume"
    shutil.rmtree(base, ignore_errors=True)
    full, part = base / "full", base / "part"
    common = (["--local-workers", str(ranks), "--mode", "pulse", "--overlap", args.overlap]
              + common_args(args))

    result = ti.run([args.train, "--windows", str(windows), "--json", str(full / "report.json"),
                     "--final-weights", str(full / "final"), "--trace-dir", str(full / "trace")]
                    + common, timeout=args.timeout)
    check(result.returncode == 0, f"uninterrupted run exited {result.returncode}")
    result = ti.run([args.pulseloco, "replay", str(full / "trace")], timeout=args.timeout)
    check(result.returncode == 0, f"pulseloco replay of the uninterrupted run exited "
          f"{result.returncode}:\n{result.stdout[-3000:]}")
    # Checkpointed after boundary stop - 1, with window stop - 1 in flight; the run ends there.
    result = ti.run([args.train, "--windows", str(stop), "--checkpoint-dir",
                     str(part / "checkpoint"), "--checkpoint-every", str(stop)] + common,
                    timeout=args.timeout)
    check(result.returncode == 0, f"run to window {stop} exited {result.returncode}")
    checkpoints = sorted((part / "checkpoint").glob("window-*"))
    if not check(len(checkpoints) == 1, f"the checkpoint root holds {checkpoints}"):
        return
    recorded = in_flight_windows(checkpoints[0], ranks)
    check(recorded == [str(stop - 1)] * ranks,
          f"the checkpoint's rank files record the windows in flight {recorded}, "
          f"expected {stop - 1} on every rank")

    result = ti.run([args.train, "--windows", str(windows), "--json", str(part / "second.json"),
                     "--resume", str(part / "checkpoint"), "--final-weights", str(part / "final")]
                    + common, timeout=args.timeout)
    check(result.returncode == 0, f"resumed run exited {result.returncode}")
    if ti.FAILURES:
        return
    uninterrupted = check_overlap_report(full / "report.json", ranks, windows, args.overlap,
                                         "uninterrupted")
    resumed = check_overlap_report(part / "second.json", ranks, windows - stop, args.overlap,
                                   "resumed", first=stop)
    if uninterrupted and resumed:
        expected = [w["digests"][0] for w in uninterrupted["windows"][stop:]]
        got = [w["digests"][0] for w in resumed["windows"]]
        check(got == expected, f"per-window digests after resuming {got}, uninterrupted {expected}")
    a = identical_final_weights(full / "final", ranks, "uninterrupted")
    b = identical_final_weights(part / "final", ranks, "resumed")
    check(a is not None and a == b,
          "the resumed run's final weights differ from the uninterrupted run's")


def test_kill(args):
    ti.check_killed_worker(args, extra=["--overlap", args.overlap],
                           fault="window=3,phase=exchange,action=kill,rank=2", timeouts=2)


def main():
    def add_arguments(parser):
        parser.add_argument("--overlap", required=True, choices=["delayed", "eager"])
        parser.add_argument("--launcher", choices=["mpirun", "env"], default="env",
                            help="replicas: mpirun, or processes of the environment rendezvous")

    return ti.run_tests(__doc__, {"replicas": test_replicas, "resume": test_resume,
                                  "kill": test_kill}, add_arguments)


if __name__ == "__main__":
    sys.exit(main())
