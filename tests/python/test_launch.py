"""python -m pulseloco.launch: the environment of each rank, output, failures and signals.

The launcher is run on small scripts of the tests' own. Ranks that must wait for the test (or
for each other) block on events: a FIFO, a line on the launcher's output, a signal. Every run
is bounded by a watchdog that kills the launcher, so that a hang fails the test instead of
blocking it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

# The launcher's source file: run directly, it needs neither the extension nor the package.
LAUNCH = Path(__file__).resolve().parents[2] / "python" / "pulseloco" / "launch.py"
BOUND_SECONDS = 120  # far above what any run here takes on two busy cores


def write_script(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(body))
    return path


def launch(arguments: list[str], env: dict[str, str] | None = None,
           **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LAUNCH), *arguments], env=env,
                          capture_output=True, text=True, timeout=BOUND_SECONDS, **kwargs)


class Watched:
    """A launcher run whose output the test reads as it comes; killed after BOUND_SECONDS."""

    def __init__(self, arguments: list[str], env: dict[str, str] | None = None):
        self.process = subprocess.Popen([sys.executable, str(LAUNCH), *arguments], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
        self.watchdog = threading.Timer(BOUND_SECONDS, self.process.kill)
        self.watchdog.start()
        self.stdout_lines: list[str] = []

    def read_until(self, count: int, marker: str) -> None:
        """Reads stdout until `count` lines contain `marker` (EOF first: the test fails)."""
        seen = 0
        while seen < count:
            line = self.process.stdout.readline()
            assert line, f"the launcher's stdout ended before {count} lines with {marker!r}: " \
                f"{self.stdout_lines}"
            self.stdout_lines.append(line)
            seen += marker in line

    def finish(self) -> tuple[int, str, str]:
        stdout, stderr = self.process.communicate()
        self.watchdog.cancel()
        self.stdout_lines += stdout.splitlines(keepends=True)
        return self.process.returncode, "".join(self.stdout_lines), stderr


def assert_exited(pids: list[int]) -> None:
    """Every pid has exited (or is a zombie that no one reaps yet); waits for it, bounded."""
    for pid in pids:
        try:
            descriptor = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            ready, _, _ = select.select([descriptor], [], [], BOUND_SECONDS)
            assert ready, f"process {pid} still runs"
        finally:
            os.close(descriptor)


def pids_in(output: str, marker: str) -> list[int]:
    return [int(word) for line in output.splitlines() if marker in line
            for word in line.split(marker, 1)[1].split()]


ENVIRONMENT_SCRIPT = """
    import json, os
    names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
             "MASTER_PORT", "PULSELOCO_SECRET", "PULSELOCO_RUN_ID", "PYTHONUNBUFFERED",
             "PULSELOCO_LISTEN_ADDR", "PULSELOCO_NODE", "PULSELOCO_SECRET_FILE"]
    print("env " + json.dumps({name: os.environ.get(name) for name in names}))
"""


def environments(output: str) -> dict[int, dict[str, str]]:
    found = {}
    for line in output.splitlines():
        prefix, _, rest = line.partition("] env ")
        if rest:
            found[int(prefix.removeprefix("[rank "))] = json.loads(rest)
    return found


def test_every_rank_gets_torchrun_variables_and_a_shared_secret_and_run_id_fresh_per_launch(tmp_path):
    script = write_script(tmp_path, "env.py", ENVIRONMENT_SCRIPT)
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PULSELOCO_SECRET", "PULSELOCO_RUN_ID", "PULSELOCO_LISTEN_ADDR")}
    first = launch(["--nproc-per-node", "3", str(script)], env=clean)
    assert first.returncode == 0, first.stderr
    ranks = environments(first.stdout)
    assert sorted(ranks) == [0, 1, 2]
    for rank, env in ranks.items():
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["PYTHONUNBUFFERED"] == "1"
        assert env["PULSELOCO_LISTEN_ADDR"] == "127.0.0.1"  # all ranks are local
        for shared in ("MASTER_PORT", "PULSELOCO_SECRET", "PULSELOCO_RUN_ID"):
            assert env[shared] == ranks[0][shared], shared
    assert 0 < int(ranks[0]["MASTER_PORT"]) < 65536
    assert len(ranks[0]["PULSELOCO_SECRET"]) >= 32

    second = environments(launch(["--nproc-per-node", "1", str(script)], env=clean).stdout)
    assert second[0]["PULSELOCO_SECRET"] != ranks[0]["PULSELOCO_SECRET"]
    assert second[0]["PULSELOCO_RUN_ID"] != ranks[0]["PULSELOCO_RUN_ID"]


def test_explicit_address_port_secret_and_run_id_are_kept(tmp_path):
    script = write_script(tmp_path, "env.py", ENVIRONMENT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PULSELOCO_LISTEN_ADDR"}
    env.update(PULSELOCO_SECRET="the-users-secret", PULSELOCO_RUN_ID="run-7")
    result = launch(["--nproc_per_node", "2", "--master-addr", "127.0.0.2",
                     "--master_port", "29123", str(script)], env=env)
    assert result.returncode == 0, result.stderr
    for env in environments(result.stdout).values():
        assert env["MASTER_ADDR"] == "127.0.0.2"
        assert env["MASTER_PORT"] == "29123"
        assert env["PULSELOCO_SECRET"] == "the-users-secret"
        assert env["PULSELOCO_RUN_ID"] == "run-7"
        assert env["PULSELOCO_LISTEN_ADDR"] == "127.0.0.2"


def test_no_listen_address_is_chosen_for_a_master_beyond_loopback(tmp_path):
    script = write_script(tmp_path, "env.py", ENVIRONMENT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PULSELOCO_LISTEN_ADDR"}
    result = launch(["--nproc-per-node", "1", "--master-addr", "192.0.2.1", "--master-port",
                     "29500", str(script)], env=env)
    assert result.returncode == 0, result.stderr
    assert environments(result.stdout)[0]["PULSELOCO_LISTEN_ADDR"] is None


def test_each_node_of_a_multi_node_launch_gets_its_ranks_and_names_its_node(tmp_path):
    script = write_script(tmp_path, "env.py", ENVIRONMENT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PULSELOCO_NODE"}
    env.update(PULSELOCO_SECRET="the-users-secret", PULSELOCO_RUN_ID="run-8")
    seen = {}
    for node in (0, 1):
        result = launch(["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "3",
                         "--master-port", "29124", str(script)], env=env)
        assert result.returncode == 0, result.stderr
        for rank, variables in environments(result.stdout).items():
            seen[rank] = variables
            assert variables["RANK"] == str(rank)
            assert variables["LOCAL_RANK"] == str(rank - 3 * node)
            assert variables["GROUP_RANK"] == str(node)
            assert variables["PULSELOCO_NODE"] == f"node-{node}"
            assert variables["WORLD_SIZE"] == "6"
            assert variables["LOCAL_WORLD_SIZE"] == "3"
            assert variables["PULSELOCO_RUN_ID"] == "run-8"
    assert sorted(seen) == list(range(6))
    # A node name the user set is kept.
    result = launch(["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1",
                     "--master-port", "29124", str(script)], env=dict(env, PULSELOCO_NODE="rack-3"))
    assert environments(result.stdout)[1]["PULSELOCO_NODE"] == "rack-3"


def test_a_secret_file_is_passed_on_without_a_generated_secret_that_would_override_it(tmp_path):
    script = write_script(tmp_path, "env.py", ENVIRONMENT_SCRIPT)
    secret_file = tmp_path / "secret"
    secret_file.write_text("the-users-secret\n")
    env = {k: v for k, v in os.environ.items() if k != "PULSELOCO_SECRET"}
    env.update(PULSELOCO_SECRET_FILE=str(secret_file), PULSELOCO_RUN_ID="run-9")
    runs = {"single node": ["--nproc-per-node", "2"]}
    for node in (0, 1):
        runs[f"node {node}"] = ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
                                "2", "--master-port", "29126"]
    for name, arguments in runs.items():
        result = launch([*arguments, str(script)], env=env)
        assert result.returncode == 0, (name, result.stderr)
        ranks = environments(result.stdout)
        assert len(ranks) == 2, (name, result.stdout)
        for variables in ranks.values():
            assert variables["PULSELOCO_SECRET"] is None, name
            assert variables["PULSELOCO_SECRET_FILE"] == str(secret_file), name


def test_a_multi_node_launch_without_a_shared_port_secret_or_run_id_is_refused(tmp_path):
    (tmp_path / "x.py").write_text("")
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PULSELOCO_SECRET", "PULSELOCO_SECRET_FILE", "PULSELOCO_RUN_ID")}
    no_port = launch(["--nnodes", "2", "--nproc-per-node", "1", "x.py"], env=clean, cwd=tmp_path)
    assert no_port.returncode == 2
    assert "--nnodes above 1 needs --master-port" in no_port.stderr
    no_ids = launch(["--nnodes", "2", "--nproc-per-node", "1", "--master-port", "29125", "x.py"],
                    env=clean, cwd=tmp_path)
    assert no_ids.returncode == 2
    assert "needs PULSELOCO_SECRET and PULSELOCO_RUN_ID set" in no_ids.stderr
    no_run_id = launch(["--nnodes", "2", "--nproc-per-node", "1", "--master-port", "29125",
                        "x.py"], env=dict(clean, PULSELOCO_SECRET="s"), cwd=tmp_path)
    assert "needs PULSELOCO_RUN_ID set" in no_run_id.stderr


def test_output_lines_are_prefixed_with_the_rank(tmp_path):
    script = write_script(tmp_path, "talk.py", """
        import os, sys
        rank = os.environ["RANK"]
        print(f"first {rank}")
        print(f"second {rank}", file=sys.stderr)
        sys.stdout.write(f"unterminated {rank}")
    """)
    result = launch(["--nproc-per-node", "2", str(script), "ignored-argument"])
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] first {rank}\n" in result.stdout
        assert f"[rank {rank}] unterminated {rank}\n" in result.stdout
        assert f"[rank {rank}] second {rank}\n" in result.stderr
    assert all(line.startswith("[rank ") for line in result.stdout.splitlines())


def test_ranks_filters_the_copied_output_and_tee_keeps_every_ranks_whole_output(tmp_path):
    script = write_script(tmp_path, "talk.py", """
        import os, sys
        rank = os.environ["RANK"]
        print(f"out {rank}")
        print(f"err {rank}", file=sys.stderr)
    """)
    logs = tmp_path / "logs"
    result = launch(["--nproc-per-node", "4", "--ranks", "0,2-3", "--tee", str(logs),
                     str(script)])
    assert result.returncode == 0, result.stderr
    for rank in (0, 2, 3):
        assert f"[rank {rank}] out {rank}\n" in result.stdout
        assert f"[rank {rank}] err {rank}\n" in result.stderr
    assert "[rank 1]" not in result.stdout + result.stderr
    for rank in range(4):
        lines = (logs / f"rank-{rank}.log").read_text().splitlines()
        assert sorted(lines) == [f"err {rank}", f"out {rank}"], lines
    # torchrun's spelling of the filter.
    result = launch(["--nproc-per-node", "2", "--local-ranks-filter", "1", str(script)])
    assert result.returncode == 0, result.stderr
    assert "[rank 0]" not in result.stdout and "[rank 1] out 1\n" in result.stdout


def test_script_arguments_and_module_mode(tmp_path):
    package = tmp_path / "users_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "entry.py").write_text(
        "import os, sys\nprint('module', os.environ['RANK'], sys.argv[1:])\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    result = launch(["--nproc-per-node", "2", "-m", "users_package.entry", "--mode", "pulse"],
                    env=env)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] module {rank} ['--mode', 'pulse']" in result.stdout


@pytest.mark.parametrize("arguments, complaint", [
    (["--nproc-per-node", "0", "x.py"], "--nproc-per-node must be at least 1"),
    (["--nproc-per-node", "2", "no-such-script.py"], "'no-such-script.py' does not exist"),
    (["--nproc-per-node", "2", "--master-port", "70000", "x.py"], "--master-port"),
    (["script.py"], "--nproc-per-node"),
    (["--nproc-per-node", "2", "--ranks", "1,x", "x.py"], "'1,x' is not a list of ranks"),
    (["--nproc-per-node", "2", "--ranks", "0,2-3", "x.py"], "--ranks names ranks [2, 3]"),
    (["--nproc-per-node", "2", "--nnodes", "0", "x.py"], "--nnodes must be at least 1"),
    (["--nproc-per-node", "4", "--ranks-per-worker", "3", "x.py"],
     "--ranks-per-worker must be at least 1 and divide --nproc-per-node 4, not 3"),
    (["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2", "x.py"],
     "--node-rank must be in 0..1, not 2"),
    (["--nproc-per-node", "2", "--grace-period", "nan", "x.py"],
     "--grace-period must be a finite number of seconds, at least 0, not nan"),
    (["--nproc-per-node", "2", "--grace-period", "inf", "x.py"], "not inf"),
    (["--nproc-per-node", "2", "--grace-period", "-1", "x.py"], "at least 0, not -1.0"),
    (["--nproc-per-node", "2", "-m", "no_such_package.entry"],
     "no module named 'no_such_package' (-m no_such_package.entry)"),
])
def test_bad_arguments_are_named(tmp_path, arguments, complaint):
    (tmp_path / "x.py").write_text("")
    result = launch(arguments, cwd=tmp_path)
    assert result.returncode == 2
    assert complaint in result.stderr


def test_a_tee_that_cannot_be_written_stops_the_launch_before_any_rank_starts(tmp_path):
    script = tmp_path / "marks.py"
    script.write_text("import os, pathlib\n"
                      "pathlib.Path(os.environ['MARKS'], os.environ['RANK']).touch()\n")
    marks = tmp_path / "marks"
    marks.mkdir()
    logs = tmp_path / "logs"
    (logs / "rank-1.log").mkdir(parents=True)  # rank 1's file cannot be opened
    result = launch(["--nproc-per-node", "2", "--tee", str(logs), str(script)],
                    env=dict(os.environ, MARKS=str(marks)))
    assert result.returncode == 1, result.stderr
    assert f"cannot write the --tee directory '{logs}'" in result.stderr, result.stderr
    assert list(marks.iterdir()) == []


# Ranks other than 1 start a grandchild, say their pids, tell rank 1 through the FIFO that they
# are ready, and wait forever; rank 1 fails once all of them are ready.
FAILING_RANK_SCRIPT = """
    import os, signal, subprocess, sys, threading
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    fifo = sys.argv[1]
    if rank == 1:
        # One descriptor, open for reading and writing throughout: the pipe always has a reader,
        # so a byte written between two reads is never lost with the pipe.
        reader = os.open(fifo, os.O_RDWR)
        ready = 0
        while ready < world - 1:
            ready += len(os.read(reader, world))
        print("failing now", flush=True)
        sys.exit(int(sys.argv[2]))
    if len(sys.argv) > 3:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import threading; threading.Event().wait()"])
    print(f"pids {os.getpid()} {child.pid}", flush=True)
    with open(fifo, "w") as writer:
        writer.write("x")
    threading.Event().wait()
"""


def test_a_failing_rank_ends_the_others_and_its_status_is_the_exit_status(tmp_path):
    script = write_script(tmp_path, "fail.py", FAILING_RANK_SCRIPT)
    fifo = tmp_path / "ready"
    os.mkfifo(fifo)
    result = launch(["--nproc-per-node", "3", str(script), str(fifo), "3"])
    assert result.returncode == 3
    assert "[rank 1] failing now" in result.stdout
    assert "rank 1 (pid" in result.stderr and "exited with status 3" in result.stderr
    assert "ending the other ranks" in result.stderr
    pids = pids_in(result.stdout, "pids ")
    assert len(pids) == 4  # ranks 0 and 2 and their children
    assert_exited(pids)


def test_ranks_that_ignore_sigterm_are_killed_after_the_grace_period(tmp_path):
    script = write_script(tmp_path, "fail.py", FAILING_RANK_SCRIPT)
    fifo = tmp_path / "ready"
    os.mkfifo(fifo)
    result = launch(["--nproc-per-node", "2", "--grace-period", "0.5", str(script), str(fifo),
                     "5", "ignore-sigterm"])
    assert result.returncode == 5
    assert "sending SIGKILL" in result.stderr
    assert_exited(pids_in(result.stdout, "pids "))


def test_a_rank_killed_by_a_signal_is_named(tmp_path):
    script = write_script(tmp_path, "crash.py", """
        import os, signal, threading
        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGSEGV)
        threading.Event().wait()
    """)
    result = launch(["--nproc-per-node", "2", str(script)])
    assert result.returncode == 128 + signal.SIGSEGV
    assert "rank 0" in result.stderr and "was killed by SIGSEGV" in result.stderr


SIGNAL_SCRIPT = """
    import os, signal, subprocess, sys, threading
    def on_sigterm(signum, frame):
        print("got SIGTERM", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_sigterm)
    child = subprocess.Popen([sys.executable, "-c", "import threading; threading.Event().wait()"])
    waiting = threading.Event()
    try:
        # Inside the try: the test interrupts as soon as it reads this line.
        print(f"pids {os.getpid()} {child.pid}", flush=True)
        waiting.wait()
    except KeyboardInterrupt:
        print("got KeyboardInterrupt", flush=True)
"""


@pytest.mark.parametrize("signum, says", [(signal.SIGINT, "got KeyboardInterrupt"),
                                         (signal.SIGTERM, "got SIGTERM")])
def test_sigint_and_sigterm_are_forwarded_and_every_process_ends(tmp_path, signum, says):
    script = write_script(tmp_path, "wait.py", SIGNAL_SCRIPT)
    run = Watched(["--nproc-per-node", "3", str(script)])
    run.read_until(3, "pids ")
    run.process.send_signal(signum)
    status, stdout, stderr = run.finish()
    assert status == 128 + signum, stderr
    assert f"{signal.Signals(signum).name} received; forwarding it to every rank" in stderr
    for rank in range(3):
        assert f"[rank {rank}] {says}" in stdout
    pids = pids_in(stdout, "pids ")
    assert len(pids) == 6
    assert_exited(pids)


def test_the_launcher_runs_as_a_module_of_the_package(tmp_path):
    script = write_script(tmp_path, "env.py", ENVIRONMENT_SCRIPT)
    # The package directory of this source tree (or of the build tree, when PYTHONPATH names
    # one): `-m pulseloco.launch` must work there, with or without the extension built.
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(LAUNCH.parents[1]))
    probe = subprocess.run([sys.executable, "-c", "import pulseloco.launch"], env=env,
                           capture_output=True, text=True, timeout=BOUND_SECONDS)
    if probe.returncode != 0:
        pytest.skip(f"pulseloco.launch is not importable here: {probe.stderr.strip()}")
    result = subprocess.run([sys.executable, "-m", "pulseloco.launch", "--nproc-per-node", "2",
                             str(script)], env=env, capture_output=True, text=True,
                            timeout=BOUND_SECONDS)
    assert result.returncode == 0, result.stderr
    assert sorted(environments(result.stdout)) == [0, 1]


WORKER_SCRIPT = """
    import json, os
    names = ["RANK", "MASTER_PORT", "PULSELOCO_RANKS_PER_WORKER", "PULSELOCO_WORKER_PORTS"]
    print("env " + json.dumps({name: os.environ.get(name) for name in names}))
"""


def test_ranks_per_worker_names_the_worker_size_and_its_groups_ports(tmp_path):
    script = write_script(tmp_path, "env.py", WORKER_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PULSELOCO_")}
    chosen = environments(launch(["--nproc-per-node", "4", "--ranks-per-worker", "2",
                                  str(script)], env=env).stdout)
    assert sorted(chosen) == [0, 1, 2, 3]
    ports = chosen[0]["PULSELOCO_WORKER_PORTS"].split(",")
    assert len(set(ports + [chosen[0]["MASTER_PORT"]])) == 3  # distinct free ports
    for variables in chosen.values():
        assert variables["PULSELOCO_RANKS_PER_WORKER"] == "2"
        assert variables["PULSELOCO_WORKER_PORTS"] == chosen[0]["PULSELOCO_WORKER_PORTS"]
    # With --master-port P every node derives the same ports: P+1 .. P+G.
    given = environments(launch(["--nproc-per-node", "2", "--ranks-per-worker", "2",
                                 "--master-port", "29130", str(script)], env=env).stdout)
    assert given[1]["PULSELOCO_WORKER_PORTS"] == "29131,29132"
    assert given[1]["MASTER_PORT"] == "29130"
    # Without the option nothing is set.
    plain = environments(launch(["--nproc-per-node", "1", str(script)], env=env).stdout)
    assert plain[0]["PULSELOCO_RANKS_PER_WORKER"] is None
