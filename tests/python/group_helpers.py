"""Spawning groups of worker processes for the Python tests: every wait is bounded and
synchronised on the workers' output lines or exits, never on sleeps."""

import json
import os
import pathlib
import queue
import selectors
import subprocess
import sys
import threading
import time

from pulseloco.launch import _ports_below_ephemeral

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "worker.py"
# How long a process' output may stay open after its exit: its readers end at EOF, at once
# unless something it started still holds the pipes.
READERS_SECONDS = 30


def free_port():
    """A TCP port that was free a moment ago (the rendezvous binds it soon after), below the
    ephemeral range: a port from bind(0) could be taken meanwhile by one of the processes' own
    connections or listeners."""
    return _ports_below_ephemeral("127.0.0.1", 1)[0]


class Process:
    """A process whose stdout JSON lines arrive as events and whose stderr is kept."""

    def __init__(self, argv, env):
        self.argv = argv
        self.popen = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
        self.events = []
        self.stderr = []
        self._queue = queue.Queue()
        self._readers = [threading.Thread(target=self._read_stdout, daemon=True),
                         threading.Thread(target=self._read_stderr, daemon=True)]
        for reader in self._readers:
            reader.start()

    def _read_stdout(self):
        for line in self.popen.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:  # not an event (mpirun may interleave ranks' lines)
                self.stderr.append(line)
                continue
            self.events.append(event)
            self._queue.put(event)
        self._queue.put(None)  # end of output

    def _read_stderr(self):
        for line in self.popen.stderr:
            self.stderr.append(line)

    def wait_for(self, event_name, timeout):
        """The next event called event_name; fails when the process ends or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no '{event_name}' event within {timeout} s: {self.log()}")
            try:
                event = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if event is None:
                raise AssertionError(f"ended without a '{event_name}' event: {self.log()}")
            if event["event"] == event_name:
                return event

    def finish(self, timeout):
        """Waits for the exit (killing the process after timeout) and for its last output lines;
        returns the exit code."""
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            self._join_readers(READERS_SECONDS)  # for the log's last lines
            raise AssertionError(f"still running after {timeout} s: {self.log()}")
        # The exit does not mean the readers have taken the last lines yet (callers read
        # events and stderr next).
        if not self._join_readers(READERS_SECONDS):
            raise AssertionError(f"exited with {code}, but its output was still open "
                                 f"{READERS_SECONDS} s later (held by a process it started?): "
                                 f"{self.log()}")
        return code

    def _join_readers(self, timeout):
        """Whether both readers reached the end of their pipe within timeout."""
        deadline = time.monotonic() + timeout
        for reader in self._readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        return not any(reader.is_alive() for reader in self._readers)

    def wait_until_stopped(self, timeout):
        """Until the process is stopped (SIGSTOP); fails when it exits or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self.popen.pid, os.WNOHANG | os.WUNTRACED)
            if pid and os.WIFSTOPPED(status):
                return
            if pid:
                # waitpid has reaped it: popen could no longer learn its status.
                self.popen.returncode = os.waitstatus_to_exitcode(status)
                self._join_readers(READERS_SECONDS)
                raise AssertionError(f"exited with {self.popen.returncode} instead of stopping: "
                                     f"{self.log()}")
            if time.monotonic() >= deadline:
                raise AssertionError(f"did not stop within {timeout} s: {self.log()}")
            time.sleep(0.01)  # re-asks for the state, not a wait for an outcome

    def event(self, name):
        """The last event called name (None when there is none)."""
        found = [e for e in self.events if e["event"] == name]
        return found[-1] if found else None

    def log(self):
        return (f"{self.argv}\nevents: {self.events}\nstderr (last lines):\n"
                + "".join(self.stderr[-30:]))


GROUP_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def clean_environment(extra=None):
    """This environment without any launcher's or pulseloco's variables, plus extra."""
    env = {name: value for name, value in os.environ.items()
           if name not in GROUP_VARIABLES and not name.startswith(("PULSELOCO_", "OMPI_", "PMI"))}
    env.update(PULSELOCO_LOG_LEVEL="warn", OMP_NUM_THREADS="1")
    env.update(extra or {})
    return env


def environment(rank, world_size, port, extra=None):
    """A rank's environment as torchrun would set it (loopback), plus extra."""
    env = clean_environment(dict(RANK=str(rank), WORLD_SIZE=str(world_size),
                                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
    env.update(extra or {})
    return env


def spawn_worker(args, extra_env=None):
    """One worker outside any fixed group (an elastic worker)."""
    return Process([sys.executable, str(WORKER), *args], clean_environment(extra_env))


def spawn_group(world_size, args, rank_env=None, script=WORKER):
    """Starts world_size workers (rank_env: rank -> extra variables)."""
    port = free_port()
    return [Process([sys.executable, str(script), *args],
                    environment(rank, world_size, port, (rank_env or {}).get(rank)))
            for rank in range(world_size)]


def finish_all(processes, timeout):
    """Exit codes of every process, within one overall deadline (the rest are killed)."""
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for process in processes:
            codes.append(process.finish(max(1.0, deadline - time.monotonic())))
    finally:
        for process in processes:
            if process.popen.poll() is None:
                process.popen.kill()
                process.popen.wait()
    return codes


def run_group(world_size, args, timeout, rank_env=None):
    """Runs a group to its end; returns the processes (events, exit codes checked by callers)."""
    processes = spawn_group(world_size, args, rank_env)
    finish_all(processes, timeout)
    return processes


def pulseloco_cli():
    """The `pulseloco` program (PULSELOCO_CLI, set by ctest; else the build tree's)."""
    path = pathlib.Path(os.environ.get("PULSELOCO_CLI", HERE.parents[1] / "build/bin/pulseloco"))
    return path if path.exists() else None


def start_coordinator(cli, initial_workers, min_workers=1, timeout=30, extra_env=None):
    """A `pulseloco coordinator` on loopback; returns (process, "host:port")."""
    process = subprocess.Popen(
        [str(cli), "coordinator", "--host", "127.0.0.1", "--port", "0", "--initial-workers",
         str(initial_workers), "--min-workers", str(min_workers), "--regroup-timeout-ms",
         "30000"],
        stdout=subprocess.PIPE, text=True, env=clean_environment(extra_env))
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            process.kill()
            raise AssertionError(f"the coordinator printed nothing within {timeout} s")
    line = process.stdout.readline()
    if "listening on" not in line:
        process.kill()
        raise AssertionError(f"the coordinator did not start: {line!r}")
    return process, line.strip().rsplit(" ", 1)[-1]
