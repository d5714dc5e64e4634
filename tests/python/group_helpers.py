"""Spawning groups of worker processes for the Python tests: every wait is bounded and
synchronised on the workers' output lines or exits, never on sleeps."""

import json
import os
import pathlib
import queue
import selectors
import socket
import subprocess
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "worker.py"


def free_port():
    """A TCP port that was free a moment ago (the rendezvous binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A process whose stdout JSON lines arrive as events and whose stderr is kept."""

    def __init__(self, argv, env):
        self.argv = argv
        self.popen = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
        self.events = []
        self.stderr = []
        self._queue = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

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
        """Waits for the exit (killing the process after timeout) and returns the exit code."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            raise AssertionError(f"still running after {timeout} s: {self.log()}")

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
