#!/usr/bin/env python3
"""Elastic membership across real processes: a `pulseloco coordinator` and several
pulseloco_elastic_worker processes on loopback (tests/elastic/elastic_worker.cpp).

Each scenario is one ctest (tests/elastic/CMakeLists.txt); it exits 0 when every check holds and
1 with one line per failed check otherwise.

  kill-gate | kill-exchange | kill-aggregate
      4 workers; worker w2 SIGKILLs itself (PULSELOCO_FAULT) at window 2 in that phase. The three
      survivors finish all windows. gate/exchange: window 2 is re-run and committed by the 3
      survivors; aggregate (after every member voted to commit): the survivors either committed
      window 2 with w2's message (R = 4) or re-ran it with R = 3, all the same way.
  stall
      w2 SIGSTOPs itself at window 2 (exchange). The survivors time out, the coordinator removes
      w2 after its regroup timeout, and the survivors finish with 3 workers.
  disconnect
      w2 aborts its data connections at window 2 (exchange): every worker, w2 included, asks for
      a new group, and the run finishes with all 4 in a later generation.
  join
      3 workers; once window 2 has committed, a 4th worker starts; the three hold before window
      3 until it has registered (an event in its JSON file), so it is admitted at the boundary
      after window 3; it ends with the same digest as the others.
  below-minimum
      3 workers, minimum 3; w2 is killed: the survivors stop with a clear error (exit 3) and the
      coordinator exits 1 naming the minimum.
  kill-local-rank
      3 workers of 2 ranks (a process per local rank, each over its own share); w2's local
      rank 1 SIGKILLs itself at window 2 (exchange). w2's local rank 0 ends within twice the
      timeout naming it; w0 and w1 finish every window, each share's group of 2 identical, and
      w2 is in no later window of either share.
  churn [--duration S] [--seed N] [--windows W]
      4 workers; for S seconds (or until W - 4 windows), whenever a window commits, a random
      worker may be SIGKILLed (at least 3 kept alive) and a fresh one started; then the run
      finishes its W windows, the workers holding before window W-2 until every one started has
      registered. Progress, identical digests and replay are asserted.

With --overlap delayed|eager (kill-* scenarios): the survivors' first boundary after the
regroup applies nothing (the window in flight was dropped), every other boundary w applies
window w - 1, and from that boundary on the group is the 3 survivors, numbered alike by all.

Every scenario checks, for every window: all reports of the window carry the same digest, each
report's per-rank digests agree, and `pulseloco replay` re-runs every traced window bit for bit
from the committed group's inputs.

Synchronisation is on events (lines in the workers' JSON files, the coordinator's stdout,
process exits); every wait is bounded.
"""

import argparse
import json
import os
import pathlib
import random
import selectors
import shutil
import signal
import subprocess
import sys
import time

FAILURES = []
TIMEOUT_MS = 3000  # every worker's collective timeout
WAIT_STEP = 0.05  # how often event files are re-read while waiting for an event


def check(condition, message):
    if not condition:
        FAILURES.append(message)
        print(f"FAIL: {message}", flush=True)
    return condition


class Run:
    """One coordinator and its workers, with their JSON event files under `work`."""

    def __init__(self, args, work, initial, minimum, regroup_ms=8000, join_every=1, windows=6):
        self.args = args
        self.work = work
        self.windows = windows
        # A member that cannot reach a peer of a new generation waits for it this long, and must
        # ask for the next one within the regroup timeout (docs/elastic.md).
        self.connect_ms = regroup_ms // 2
        self.trace = work / "trace"
        self.workers = {}  # id -> Popen
        self.env = dict(os.environ, PULSELOCO_LOG_LEVEL="warn")
        self.env.pop("PULSELOCO_FAULT", None)
        command = [args.pulseloco, "coordinator", "--host", "127.0.0.1", "--port", "0",
                   "--initial-workers", str(initial), "--min-workers", str(minimum),
                   "--join-every", str(join_every), "--regroup-timeout-ms", str(regroup_ms)]
        self.coordinator = subprocess.Popen(command, stdout=subprocess.PIPE, text=True,
                                            env=self.env)
        line = read_line(self.coordinator.stdout, 30)
        if not line or "listening on" not in line:
            raise RuntimeError(f"coordinator did not start: {line!r}")
        self.address = line.strip().rsplit(" ", 1)[-1]

    def start(self, worker, fault=None, windows=None, extra=(), key=None, trace=None):
        """Starts a worker process; `key` (default: the worker's id) names its process and
        event file (one per local rank of a worker of several ranks)."""
        key = key or worker
        env = dict(self.env)
        if fault:
            env["PULSELOCO_FAULT"] = fault
        command = [self.args.worker, "--coordinator", self.address, "--worker", worker,
                   "--json", str(self.work / f"{key}.jsonl"), "--windows",
                   str(windows or self.windows), "--trace-dir", str(trace or self.trace), "-H",
                   "2", "--timeout-ms", str(TIMEOUT_MS), "--connect-timeout-ms",
                   str(self.connect_ms), "--overlap", self.args.overlap, *extra]
        self.workers[key] = subprocess.Popen(command, env=env, stderr=subprocess.PIPE,
                                             text=True)

    def start_local_ranks(self, worker, ranks, fault_rank=None, fault=None):
        """Starts worker `worker` as `ranks` processes, keys "<worker>.<j>": local rank 0 first,
        the others once it has written its link's port (an event)."""
        def start(j, link):
            self.start(worker, key=f"{worker}.{j}", fault=fault if j == fault_rank else None,
                       trace=self.trace / f"local{j}",
                       extra=("--ranks-per-worker", str(ranks), "--local-rank", str(j), *link))
        def link_port():
            return next((e["port"] for e in self.events(f"{worker}.0") if e["event"] == "link"),
                        None)
        start(0, ())
        if self.wait_for(lambda: link_port() is not None, 60, f"{worker}'s link port"):
            for j in range(1, ranks):
                start(j, ("--worker-link", f"127.0.0.1:{link_port()}"))

    def start_workers(self, count, fault=None):
        """Starts w0 .. w{count-1}; `fault` (a PULSELOCO_FAULT value) goes to w2 only."""
        for i in range(count):
            self.start(f"w{i}", fault=fault if i == 2 else None)

    def events(self, worker):
        path = self.work / f"{worker}.jsonl"
        if not path.exists():
            return []
        # Only whole lines: the worker may be writing the last one right now (or was killed
        # while writing it).
        complete = path.read_text().rpartition("\n")[0]
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def all_events(self):
        return {worker: self.events(worker) for worker in self.workers}

    def wait_for(self, predicate, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(WAIT_STEP)
        check(False, f"timed out after {timeout} s waiting for {what}")
        return False

    def finish(self, survivors, timeout=240, expect_status=0):
        deadline = time.monotonic() + timeout
        for worker in survivors:
            process = self.workers[worker]
            try:
                process.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                check(False, f"{worker} did not finish within {timeout} s")
            if process.returncode != expect_status:
                check(False, f"{worker} exited {process.returncode}, expected {expect_status}: "
                      f"{process.stderr.read()[-2000:]}")

    def close(self):
        for process in self.workers.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        try:
            self.coordinator.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.coordinator.kill()
            self.coordinator.wait()
        return self.coordinator.returncode


def read_line(stream, timeout):
    selector = selectors.DefaultSelector()
    selector.register(stream, selectors.EVENT_READ)
    if not selector.select(timeout):
        return None
    return stream.readline()


def window_reports(run):
    """window -> list of reports (every worker's)."""
    by_window = {}
    for worker, records in run.all_events().items():
        for record in records:
            if record["event"] == "window":
                by_window.setdefault(record["window"], []).append(record)
    return by_window


def check_consistency(run, survivors, windows):
    by_window = window_reports(run)
    for window in range(windows):
        reports = by_window.get(window, [])
        if not check(reports, f"no report of window {window}"):
            continue
        digests = {r["digest"] for r in reports}
        check(len(digests) == 1, f"window {window}: digests differ across workers: {digests}")
        for r in reports:
            check(r["replicas_identical"], f"window {window}: {r['worker']} saw differing replicas")
            check(all(d == r["digest"] for d in r["digests"]),
                  f"window {window}: {r['worker']}'s per-rank digests disagree: {r['digests']}")
    finals = set()
    for worker in survivors:
        done = [e for e in run.events(worker) if e["event"] == "done"]
        if check(done, f"{worker} has no 'done' event"):
            finals.add(done[-1]["digest"])
            check(done[-1]["window"] == windows, f"{worker} ended at window {done[-1]['window']}")
    check(len(finals) == 1, f"survivors end with different digests: {finals}")
    return by_window


def check_replay(run, windows):
    result = subprocess.run([run.args.pulseloco, "replay", str(run.trace), "--json"],
                            capture_output=True, text=True, timeout=300)
    if not check(result.returncode == 0,
                 f"pulseloco replay exited {result.returncode}: {result.stderr[-2000:]}"):
        return {}
    records = json.loads(result.stdout)
    replayed = {r["window"]: r for r in records}
    for window in range(windows):
        check(window in replayed and replayed[window]["identical"],
              f"window {window} does not replay bit-identically")
    return replayed


def members_of(report):
    return report.get("members", [])


def scenario_kill(args, work, phase):
    run = Run(args, work, initial=4, minimum=2)
    try:
        run.start_workers(4, fault=f"window=2,phase={phase},action=kill")
        survivors = ["w0", "w1", "w3"]
        run.finish(survivors)
        victim = run.workers["w2"]
        victim.wait(timeout=30)
        check(victim.returncode == -signal.SIGKILL, f"w2 exited {victim.returncode}, not SIGKILL")
        by_window = check_consistency(run, survivors, run.windows)
        for window in (0, 1):
            check(all(r["world_size"] == 4 for r in by_window.get(window, [])),
                  f"window {window} should have 4 workers")
        if args.overlap != "blocking":
            check_overlapped_regroup(run, survivors)
            check_replay(run, run.windows)
            return
        sizes = {r["world_size"] for r in by_window.get(2, [])}
        if phase == "aggregate":
            # w2 died after every member voted to commit. Whether a survivor saw w2's last
            # completion notice before its connections were reset is a race no protocol can
            # remove (a SIGKILLed process's unread socket data turns its close into a reset):
            # the survivors either committed window 2 with w2's message (R = 4), or nobody had
            # learnt the outcome and they re-ran it with R = 3; a mix is repaired by attach().
            # Every survivor must report the same outcome.
            check(len(sizes) == 1 and sizes <= {3, 4},
                  f"window 2 (aggregate kill): survivors disagree on its group: {sizes}")
            print(f"kill-aggregate: window 2 committed with {sizes} workers", flush=True)
        else:
            check(sizes == {3}, f"window 2 ({phase} kill) should have been re-run by the 3 "
                  f"survivors: {sizes}")
        for window in range(3, run.windows):
            for r in by_window.get(window, []):
                check(r["world_size"] == 3 and "w2" not in members_of(r),
                      f"window {window}: expected the 3 survivors, got {members_of(r)}")
                check(r["generation"] >= 2, f"window {window}: still generation {r['generation']}")
        replayed = check_replay(run, run.windows)
        if phase == "aggregate" and sizes == {4} and 2 in replayed:
            check(len(replayed[2].get("ranks_without_outputs", [])) == 1,
                  "window 2's replay should name w2's rank as lost after the commit")
    finally:
        run.close()


def check_overlapped_regroup(run, survivors):
    """Overlapped windows, one regroup (w2 lost): every survivor's boundaries apply the window
    before them (window w applies w - 1), except boundary 0 and the first boundary after the
    regroup, which apply nothing (the window in flight was dropped, its entries back in e) and
    which every survivor numbers alike; from there on the group is the 3 survivors."""
    reruns = {}
    for worker in survivors:
        reports = [e for e in run.events(worker) if e["event"] == "window"]
        idle = [i for i, r in enumerate(reports) if r["window"] > 0 and r["applied_window"] is None]
        if not check(len(idle) == 1, f"{worker}: boundaries that applied nothing after window 0: "
                     f"{[reports[i]['window'] for i in idle]}, expected one (after the regroup)"):
            continue
        rerun = reports[idle[0]]
        reruns[worker] = rerun["window"]
        for r in reports:
            check(r["applied_window"] in (None, r["window"] - 1),
                  f"{worker}: boundary {r['window']} applied window {r['applied_window']}")
        for r in reports[idle[0]:]:
            check(r["world_size"] == 3 and "w2" not in members_of(r) and r["generation"] >= 2,
                  f"{worker}: boundary {r['window']} after the regroup has {members_of(r)} in "
                  f"generation {r['generation']}")
    check(len(set(reruns.values())) == 1, f"the survivors resumed at different boundaries: {reruns}")
    print(f"overlap {run.args.overlap}: the survivors' first boundary after the regroup: {reruns}",
          flush=True)


def scenario_stall(args, work):
    run = Run(args, work, initial=4, minimum=2, regroup_ms=8000)
    try:
        run.start_workers(4, fault="window=2,phase=exchange,action=stall")
        survivors = ["w0", "w1", "w3"]
        run.finish(survivors)
        check(run.workers["w2"].poll() is None, "the stalled w2 should still be stopped")
        by_window = check_consistency(run, survivors, run.windows)
        check(all(r["world_size"] == 3 for r in by_window.get(2, [])),
              "window 2 should have been retried by the 3 survivors")
        check_replay(run, run.windows)
    finally:
        run.close()


def scenario_disconnect(args, work):
    run = Run(args, work, initial=4, minimum=2)
    try:
        run.start_workers(4, fault="window=2,phase=exchange,action=disconnect")
        workers = ["w0", "w1", "w2", "w3"]
        run.finish(workers)
        by_window = check_consistency(run, workers, run.windows)
        for r in by_window.get(2, []):
            check(r["world_size"] == 4 and r["generation"] >= 2,
                  f"window 2 should be retried by all 4 in a new generation: {r['world_size']} "
                  f"workers, generation {r['generation']}")
        check_replay(run, run.windows)
        check(run.close() == 0, "the coordinator should exit 0 when every worker left")
    finally:
        run.close()


def scenario_join(args, work):
    run = Run(args, work, initial=3, minimum=2, windows=7)
    hold = work / "w3-registered"
    try:
        # The three hold before window 3 until w3 has registered with the coordinator, so that
        # the boundary after window 3 admits it whatever the machine's speed.
        for i in range(3):
            run.start(f"w{i}", extra=("--hold-at-window", "3", "--hold-file", str(hold)))
        run.wait_for(lambda: any(e["event"] == "window" and e["window"] >= 2
                                 for e in run.events("w0")), 120, "window 2 on w0")
        run.start("w3")
        run.wait_for(lambda: any(e["event"] == "registered" for e in run.events("w3")), 60,
                     "w3's registration")
        hold.touch()
        workers = ["w0", "w1", "w2", "w3"]
        run.finish(workers)
        by_window = check_consistency(run, workers, run.windows)
        attached = [e for e in run.events("w3") if e["event"] == "attached"]
        if check(attached, "w3 was never admitted"):
            first = attached[0]["window"]
            check(first == 4, f"w3 should be admitted at the boundary after window 3 (window 4), "
                  f"was at window {first}")
            for window in range(first, run.windows):
                for r in by_window.get(window, []):
                    check(r["world_size"] == 4 and "w3" in members_of(r),
                          f"window {window} after the join should have 4 workers")
        for window in range(0, 4):
            for r in by_window.get(window, []):
                check(r["world_size"] == 3, f"window {window} before the join should have 3")
        check_replay(run, run.windows)
    finally:
        run.close()


def scenario_below_minimum(args, work):
    run = Run(args, work, initial=3, minimum=3)
    try:
        run.start_workers(3, fault="window=1,phase=gate,action=kill")
        run.finish(["w0", "w1"], expect_status=3)
        for worker in ("w0", "w1"):
            stopped = [e for e in run.events(worker) if e["event"] == "stopped"]
            check(stopped and "minimum" in stopped[-1]["error"],
                  f"{worker} should stop naming the minimum: {stopped}")
        status = run.close()
        check(status == 1, f"the coordinator exited {status}, expected 1 (below the minimum)")
    finally:
        run.close()


def scenario_kill_local_rank(args, work):
    ranks = 2
    run = Run(args, work, initial=3, minimum=2)
    try:
        for worker in ("w0", "w1", "w2"):
            run.start_local_ranks(worker, ranks, fault_rank=1 if worker == "w2" else None,
                                  fault="window=2,phase=exchange,action=kill")
        victim, partner = run.workers["w2.1"], run.workers["w2.0"]
        # The victim's death and its worker's end, as this harness sees them (polled).
        died = ended = None
        deadline = time.monotonic() + 240
        while (died is None or ended is None) and time.monotonic() < deadline:
            now = time.monotonic()
            if died is None and victim.poll() is not None:
                died = now
            if ended is None and partner.poll() is not None:
                ended = now
            time.sleep(WAIT_STEP)
        check(victim.poll() == -signal.SIGKILL, f"w2.1 exited {victim.poll()}, not SIGKILL")
        if check(died is not None and ended is not None, "w2's local ranks did not both end"):
            # Twice the timeout, plus the harness's polling and process exit under load.
            bound = 2 * TIMEOUT_MS / 1000 + 2
            check(ended - died <= bound, f"w2's local rank 0 ended {ended - died:.1f} s after its "
                  f"local rank 1 died (bound {bound:.1f} s)")
            print(f"kill-local-rank: w2's local rank 0 ended {max(0, ended - died):.2f} s after "
                  "its local rank 1 died", flush=True)
        check(partner.returncode == 1, f"w2.0 exited {partner.returncode}, expected 1")
        failed = [e for e in run.events("w2.0") if e["event"] == "failed"]
        check(failed and "worker w2's local rank 1 is lost" in failed[-1]["error"],
              f"w2.0 should fail naming its lost local rank 1: {failed}")
        survivors = [f"{w}.{j}" for w in ("w0", "w1") for j in range(ranks)]
        run.finish(survivors)
        for j in range(ranks):
            by_window = {}
            for key in survivors:
                if key.endswith(f".{j}"):
                    for e in run.events(key):
                        if e["event"] == "window":
                            by_window.setdefault(e["window"], []).append(e)
            for window in range(run.windows):
                reports = by_window.get(window, [])
                if not check(len(reports) == 2, f"share {j}, window {window}: "
                             f"{len(reports)} survivors' reports, expected 2"):
                    continue
                check(len({r["digest"] for r in reports}) == 1,
                      f"share {j}, window {window}: digests differ")
                sizes = {r["world_size"] for r in reports}
                check(len(sizes) == 1, f"share {j}, window {window}: the survivors disagree on "
                      f"its group: {sizes}")
                expected = {3} if window < 2 else {2} if window > 2 else {2, 3}
                check(sizes <= expected, f"share {j}, window {window}: {sizes} workers, "
                      f"expected {expected}")
                if window > 2:
                    check(all("w2" not in members_of(r) for r in reports),
                          f"share {j}, window {window}: w2 is still a member")
            done = {e["digest"] for key in survivors if key.endswith(f".{j}")
                    for e in run.events(key) if e["event"] == "done"}
            check(len(done) == 1, f"share {j}: the survivors end with digests {done}")
        # Local rank 1's share lost its w2 member in window 2's exchange: it re-ran the window.
        check(all(e["world_size"] == 2 for key in ("w0.1", "w1.1") for e in run.events(key)
                  if e["event"] == "window" and e["window"] == 2),
              "share 1's window 2 should have been re-run by the 2 survivors")
    finally:
        run.close()


def scenario_churn(args, work):
    rng = random.Random(args.seed)
    run = Run(args, work, initial=4, minimum=2, windows=args.windows)
    killed = []
    # Every worker holds before window W-2 until the churn is over and the last replacement has
    # registered, so that it is admitted (at the boundary after that window at the latest) before
    # the run ends, however fast the windows go.
    hold = work / "churn-over"
    hold_args = ("--hold-at-window", str(args.windows - 2), "--hold-file", str(hold))
    try:
        alive = []
        for i in range(4):
            run.start(f"w{i}", extra=hold_args)
            alive.append(f"w{i}")
        started = 4
        churn_start = time.monotonic()
        deadline = churn_start + args.duration
        highest = -1

        def committed():
            return max((e["window"] for es in run.all_events().values() for e in es
                        if e["event"] == "window"), default=-1)

        # Churn while time is left and the run is far enough from its end that a replacement
        # can still be admitted.
        while time.monotonic() < deadline and highest < args.windows - 4:
            if not run.wait_for(lambda: committed() > highest, 120,
                                f"progress after window {highest}"):
                break
            highest = committed()
            if len(alive) > 3 and rng.random() < 0.5:
                victim = rng.choice(alive)
                run.workers[victim].kill()
                run.workers[victim].wait()
                alive.remove(victim)
                killed.append((victim, highest))
            if len(alive) < 4 and rng.random() < 0.7:
                worker = f"w{started}"
                started += 1
                run.start(worker, extra=hold_args)
                alive.append(worker)
        print(f"churn: {time.monotonic() - churn_start:.0f} s (limit {args.duration:.0f} s), "
              f"{highest + 1} windows committed during churn, "
              f"killed (worker, after window) {killed}, {started} workers started", flush=True)
        check(killed, "the churn killed nobody (too short a run?)")
        for worker in alive:
            run.wait_for(lambda w=worker: any(e["event"] == "registered" for e in run.events(w)),
                         60, f"{worker}'s registration")
        hold.touch()
        run.finish(alive, timeout=600)
        check_consistency(run, alive, args.windows)
        check_replay(run, args.windows)
    finally:
        run.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", required=True, help="pulseloco_elastic_worker")
    parser.add_argument("--pulseloco", required=True, help="the pulseloco CLI")
    parser.add_argument("--work", required=True, help="scratch directory (emptied first)")
    parser.add_argument("--duration", type=float, default=25, help="churn: seconds of churn")
    parser.add_argument("--seed", type=int, default=1, help="churn: random seed")
    parser.add_argument("--windows", type=int, default=30, help="churn: windows of the run")
    parser.add_argument("--overlap", default="blocking", choices=["blocking", "delayed", "eager"],
                        help="the workers' overlap (docs/algorithm.md)")
    parser.add_argument("scenario", choices=["kill-gate", "kill-exchange", "kill-aggregate",
                                             "stall", "disconnect", "join", "below-minimum",
                                             "churn", "kill-local-rank"])
    args = parser.parse_args()
    work = pathlib.Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.monotonic()
    if args.scenario == "kill-local-rank":
        scenario_kill_local_rank(args, work)
    elif args.scenario.startswith("kill-"):
        scenario_kill(args, work, args.scenario.split("-", 1)[1])
    else:
        {"stall": scenario_stall, "disconnect": scenario_disconnect, "join": scenario_join,
         "below-minimum": scenario_below_minimum, "churn": scenario_churn}[args.scenario](args,
                                                                                         work)
    print(f"{args.scenario}: {len(FAILURES)} failed checks, {time.monotonic() - started:.1f} s",
          flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
