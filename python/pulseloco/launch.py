"""Start N local processes of a training script, with the variables torchrun sets.

    python -m pulseloco.launch --nproc-per-node N [--master-addr 127.0.0.1]
        [--master-port P] [--grace-period S] [--ranks 0,2-3] [--tee DIR] script.py ARGS...
    python -m pulseloco.launch --nproc-per-node N -m package.module ARGS...
    python -m pulseloco.launch --nnodes M --node-rank K --nproc-per-node N
        --master-addr HOST --master-port P script.py ARGS...      (on each of M nodes)
    python -m pulseloco.launch ... --nproc-per-node G --ranks-per-worker G script.py ARGS...

Each process gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
(default: a free port), PULSELOCO_SECRET (fresh and random unless it or PULSELOCO_SECRET_FILE
is set), PULSELOCO_RUN_ID (fresh and random unless set), PYTHONUNBUFFERED=1 (unless set) and,
when the master address is a loopback address, PULSELOCO_LISTEN_ADDR (unless set) to it, so
that `pulseloco.Synchronizer(...)` forms its group from the environment.

With --nnodes M (torchrun's static multi-node launch), run the launcher once on each node with
its --node-rank K (0 .. M-1), the same --nproc-per-node, and the address and port of node 0's
rank 0, which serves the rendezvous. Rank = K * N + local rank, WORLD_SIZE = M * N, GROUP_RANK
= K, and PULSELOCO_NODE (unless set) = "node-K", so that the ranks of one launcher form one
node for node-aware exchanges (docs/operations.md, "Nodes"). Every node must then share
PULSELOCO_SECRET (or PULSELOCO_SECRET_FILE, a file holding the same secret) and
PULSELOCO_RUN_ID: the launcher refuses to start without them (and without --master-port)
instead of generating values the other nodes cannot know.

With --ranks-per-worker G (G divides N), every G consecutive ranks of a node form one worker
of several ranks (docs/operations.md, "A worker of several GPUs"): each process also gets
PULSELOCO_RANKS_PER_WORKER = G, which makes `pulseloco.Synchronizer(...)` a local rank of its
worker, and PULSELOCO_WORKER_PORTS, the G rendezvous ports of the local ranks' groups: free
ports on the master address below the system's ephemeral port range (which the ranks' own
connections and listeners draw from before those groups form), or with --master-port P the
ports P+1 .. P+G (P itself is left to torch.distributed's store).

Every line a process writes to stdout or stderr is copied to the
launcher's stdout or stderr with the prefix "[rank N] ": of every rank, or of the ranks that
--ranks names. --tee DIR also writes each rank's whole output, unprefixed, to DIR/rank-N.log.

The library logs each window's line on rank 0 only (the other ranks at debug level, or all of
them with PULSELOCO_LOG_ALL_RANKS=1), so the combined output holds one line per window.

SIGINT and SIGTERM sent to the launcher are forwarded to every process. When a process fails
(a non-zero exit status or a signal), the launcher names it, ends the others (SIGTERM, then
SIGKILL after the grace period) and exits with the failed process' status (128 + the signal's
number for a signal). Each process runs in a process group of its own, so that what it started
is ended with it and a Ctrl-C at the terminal reaches it once, through the launcher.

Standard library only: it runs before the extension is built.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import ipaddress
import math
import os
import random
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Optional

_PREFIX = "pulseloco.launch: "
# A line longer than this is passed on in pieces rather than held in memory until its end.
_MAX_LINE_BYTES = 1 << 16
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _message(text: str) -> None:
    sys.stderr.write(_PREFIX + text + "\n")
    sys.stderr.flush()


def _parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pulseloco.launch",
        description="Start N local processes of a training script with the environment "
        "torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...) plus a "
        "fresh PULSELOCO_SECRET and PULSELOCO_RUN_ID.",
    )
    # torchrun spells its options both ways; so does this launcher.
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, required=True,
                        metavar="N", help="number of processes to start (>= 1)")
    parser.add_argument("--nnodes", type=int, default=1, metavar="M",
                        help="number of nodes, one launcher on each (default: 1)")
    parser.add_argument("--node-rank", "--node_rank", type=int, default=0, metavar="K",
                        help="this node's place among the nodes, 0 .. M-1 (default: 0)")
    parser.add_argument("--master-addr", "--master_addr", default="127.0.0.1",
                        help="MASTER_ADDR (default: 127.0.0.1)")
    parser.add_argument("--master-port", "--master_port", type=int, default=None,
                        help="MASTER_PORT (default: a free port on the master address)")
    parser.add_argument("--ranks-per-worker", "--ranks_per_worker", type=int, default=None,
                        metavar="G", help="every G consecutive ranks of a node form one worker "
                        "(G divides --nproc-per-node): sets PULSELOCO_RANKS_PER_WORKER and "
                        "PULSELOCO_WORKER_PORTS")
    parser.add_argument("--grace-period", type=float, default=10.0, metavar="SECONDS",
                        help="how long the processes get to exit after SIGTERM before SIGKILL "
                        "(default: 10)")
    parser.add_argument("--ranks", "--local-ranks-filter", "--local_ranks_filter",
                        default=None, metavar="LIST", type=_rank_list,
                        help="copy only these local ranks' output, e.g. 0 or 0,2-3 (default: every "
                        "rank)")
    parser.add_argument("--tee", default=None, metavar="DIR",
                        help="also write each rank's whole output to DIR/rank-N.log")
    parser.add_argument("-m", "--module", action="store_true",
                        help="run the target as a module (python -m target)")
    parser.add_argument("target", help="the script (or, with -m, the module) to run")
    parser.add_argument("arguments", nargs=argparse.REMAINDER,
                        help="arguments passed to every process")
    options = parser.parse_args(argv)
    if options.nproc_per_node < 1:
        parser.error(f"--nproc-per-node must be at least 1, not {options.nproc_per_node}")
    if options.nnodes < 1:
        parser.error(f"--nnodes must be at least 1, not {options.nnodes}")
    if not 0 <= options.node_rank < options.nnodes:
        parser.error(f"--node-rank must be in 0..{options.nnodes - 1}, not {options.node_rank}")
    if options.nnodes > 1:
        if options.master_port is None:
            parser.error("--nnodes above 1 needs --master-port: every node's launcher must name "
                         "the same port of node 0's rank 0")
        missing = [name for name in ("PULSELOCO_SECRET", "PULSELOCO_RUN_ID")
                   if not os.environ.get(name) and
                   not (name == "PULSELOCO_SECRET" and os.environ.get("PULSELOCO_SECRET_FILE"))]
        if missing:
            parser.error(f"--nnodes above 1 needs {' and '.join(missing)} set, the same on "
                         f"every node (a value generated here would differ on each node)")
    if options.ranks_per_worker is not None and not (
            options.ranks_per_worker >= 1 and options.nproc_per_node % options.ranks_per_worker == 0):
        parser.error(f"--ranks-per-worker must be at least 1 and divide --nproc-per-node "
                     f"{options.nproc_per_node}, not {options.ranks_per_worker}")
    if options.master_port is not None and not 0 < options.master_port < 65536:
        parser.error(f"--master-port must be in 1..65535, not {options.master_port}")
    if not math.isfinite(options.grace_period) or options.grace_period < 0:
        parser.error(f"--grace-period must be a finite number of seconds, at least 0, not "
                     f"{options.grace_period}")
    if options.ranks is not None:
        beyond = sorted(r for r in options.ranks if r >= options.nproc_per_node)
        if beyond:
            parser.error(f"--ranks names ranks {beyond}, beyond the {options.nproc_per_node} "
                         f"processes")
    if not options.module and not os.path.isfile(options.target):
        parser.error(f"the script '{options.target}' does not exist")
    if options.module and not _module_exists(options.target.split(".")[0]):
        parser.error(f"no module named '{options.target.split('.')[0]}' (-m {options.target}) "
                     f"on the ranks' path: the working directory and PYTHONPATH")
    return options


def _module_exists(name: str) -> bool:
    """Whether `python -m` in this directory finds the top-level module `name` (its sys.path:
    the working directory, then this interpreter's, less this script's own directory), without
    importing it."""
    if name in sys.builtin_module_names:
        return True
    search = [os.getcwd(), *sys.path[1:]]
    return importlib.machinery.PathFinder.find_spec(name, search) is not None


def _rank_list(text: str) -> frozenset[int]:
    """ "0,2-3" -> {0, 2, 3}."""
    ranks: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low = int(first)
            high = int(last) if dash else low
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"'{text}' is not a list of ranks (e.g. 0 or 0,2-3)") from None
        if low < 0 or high < low:
            raise argparse.ArgumentTypeError(f"'{part}' in '{text}' is not a rank or a range")
        ranks.update(range(low, high + 1))
    return frozenset(ranks)


def _free_ports(address: str, count: int) -> list[int]:
    """count distinct ports nothing listens on now (the rendezvous bind them shortly after)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    probes = []
    try:
        for _ in range(count):
            probes.append(socket.socket(family, socket.SOCK_STREAM))
            probes[-1].bind((address, 0))
        return [probe.getsockname()[1] for probe in probes]
    except OSError as error:
        raise SystemExit(f"{_PREFIX}cannot bind the master address '{address}' to find a free "
                         f"port: {error}") from None
    finally:
        for probe in probes:
            probe.close()


def _ports_below_ephemeral(address: str, count: int) -> list[int]:
    """count distinct free ports below the range the system hands out for bind(0) and outgoing
    connections: the ranks open many of those (torch.distributed's connections, pulseloco's
    listeners) before the local ranks' groups bind their rendezvous ports, and one of them could
    take a port that bind(0) had found free. Falls back to _free_ports when that range starts
    too low to leave room."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            low = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    if low <= 10000 + 100 * count:
        return _free_ports(address, count)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    chooser = random.SystemRandom()
    found: list[int] = []
    for _ in range(100 * count):
        port = chooser.randrange(10000, low)
        if port in found:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    return _free_ports(address, count)


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def _rank_environment(options: argparse.Namespace, port: int,
                      worker_ports: list[int]) -> list[tuple[int, dict[str, str]]]:
    """Each process' rank in the group and its environment, in local rank order."""
    shared = dict(os.environ)
    if options.ranks_per_worker is not None:
        shared.update(PULSELOCO_RANKS_PER_WORKER=str(options.ranks_per_worker),
                      PULSELOCO_WORKER_PORTS=",".join(map(str, worker_ports)))
    # The library reads PULSELOCO_SECRET before PULSELOCO_SECRET_FILE (and an empty value as
    # unset): a secret generated here would override the user's file, and on several nodes
    # differ on each.
    if not shared.get("PULSELOCO_SECRET") and not shared.get("PULSELOCO_SECRET_FILE"):
        shared["PULSELOCO_SECRET"] = secrets.token_hex(16)
    shared.setdefault("PULSELOCO_RUN_ID", "launch-" + secrets.token_hex(8))
    shared.setdefault("PYTHONUNBUFFERED", "1")
    if _is_loopback(options.master_addr):
        # Every rank is on this host: nothing needs to listen beyond loopback.
        shared.setdefault("PULSELOCO_LISTEN_ADDR", options.master_addr)
    per_node = options.nproc_per_node
    if options.nnodes > 1:
        shared.setdefault("PULSELOCO_NODE", f"node-{options.node_rank}")
    shared.update(WORLD_SIZE=str(options.nnodes * per_node), LOCAL_WORLD_SIZE=str(per_node),
                  GROUP_RANK=str(options.node_rank), MASTER_ADDR=options.master_addr,
                  MASTER_PORT=str(port))
    first = options.node_rank * per_node
    return [(first + local, dict(shared, RANK=str(first + local), LOCAL_RANK=str(local)))
            for local in range(per_node)]


def _describe(status: int) -> str:
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"was killed by {name}"
    return f"exited with status {status}"


def _exit_status(status: int) -> int:
    return 128 - status if status < 0 else status


@dataclass
class _Stream:
    """One process' stdout or stderr: the bytes after its last complete line."""

    rank: int
    sink: Optional[BinaryIO]  # None: this rank's lines are not copied (--ranks)
    tee: Optional[BinaryIO] = None  # its --tee file, shared by its stdout and stderr
    pending: bytes = b""

    def write(self, data: bytes) -> None:
        data = self.pending + data
        lines = data.split(b"\n")
        self.pending = lines.pop()
        if len(self.pending) >= _MAX_LINE_BYTES:
            lines.append(self.pending)
            self.pending = b""
        self._emit(lines)

    def close(self) -> None:
        if self.pending:
            self._emit([self.pending])
            self.pending = b""

    def _emit(self, lines: list[bytes]) -> None:
        if not lines:
            return
        if self.tee is not None:
            self.tee.write(b"".join(line + b"\n" for line in lines))
            self.tee.flush()
        if self.sink is None:
            return
        prefix = f"[rank {self.rank}] ".encode()
        try:
            self.sink.write(b"".join(prefix + line + b"\n" for line in lines))
            self.sink.flush()
        except BrokenPipeError:
            pass  # the reader went away (`| head`); the processes keep running to their end


@dataclass
class _Rank:
    rank: int
    process: subprocess.Popen
    status: Optional[int] = None

    def signal_group(self, signum: int) -> None:
        # The process leads its own group: the signal reaches what it started too.
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class _Launch:
    ranks: list[_Rank]
    grace_period: float
    failure: Optional[_Rank] = None
    interrupted: Optional[int] = None
    kill_at: Optional[float] = None  # SIGKILL whatever still runs at this time
    streams: dict[int, _Stream] = field(default_factory=dict)

    def end_all(self, signum: int) -> None:
        for rank in self.ranks:
            if rank.status is None:
                rank.signal_group(signum)
        if self.kill_at is None:
            self.kill_at = time.monotonic() + self.grace_period

    def reap(self) -> None:
        for rank in self.ranks:
            if rank.status is not None:
                continue
            status = rank.process.poll()
            if status is None:
                continue
            rank.status = status
            # Whatever the process left running in its group goes with it (and would otherwise
            # hold its output pipes open).
            rank.signal_group(signal.SIGKILL)
            if status != 0 and self.failure is None and self.interrupted is None:
                self.failure = rank
                _message(f"rank {rank.rank} (pid {rank.process.pid}) {_describe(status)}; "
                         f"ending the other ranks")
                self.end_all(signal.SIGTERM)

    def forward(self, signum: int) -> None:
        name = signal.Signals(signum).name
        _message(f"{name} received; forwarding it to every rank")
        if self.interrupted is None:
            self.interrupted = signum
        self.end_all(signum)

    def running(self) -> bool:
        return any(rank.status is None for rank in self.ranks)


def _run(options: argparse.Namespace) -> int:
    workers = options.ranks_per_worker or 0
    if options.master_port is None:
        port = _free_ports(options.master_addr, 1)[0]
        worker_ports = _ports_below_ephemeral(options.master_addr, workers) if workers else []
    else:
        # Every node derives the same ports: the master port's successors.
        port = options.master_port
        worker_ports = [port + 1 + j for j in range(workers)]
        if worker_ports and worker_ports[-1] > 65535:
            raise SystemExit(f"{_PREFIX}--master-port {port} leaves no room for the "
                             f"{workers} ports after it that the workers' groups use")
    ranks = list(_rank_environment(options, port, worker_ports))
    tees: dict[int, BinaryIO] = {}
    command = [sys.executable]
    command += ["-m", options.target] if options.module else [options.target]
    command += options.arguments

    # Signals reach the loop below through a wakeup pipe: the handlers do nothing themselves,
    # and Python writes each signal's number into the pipe. SIGCHLD says a process has ended.
    # Everything set up here is undone in the `finally` below, also when the setup fails halfway.
    wake_fds: tuple[int, ...] = ()
    previous_wakeup: Optional[int] = None
    previous_handlers: dict[int, Any] = {}
    selector = selectors.DefaultSelector()
    launch = _Launch(ranks=[], grace_period=options.grace_period)
    try:
        wake_fds = os.pipe()
        wake_read, wake_write = wake_fds
        os.set_blocking(wake_read, False)
        os.set_blocking(wake_write, False)
        previous_wakeup = signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
        for signum in (*_FORWARDED_SIGNALS, signal.SIGCHLD):
            previous_handlers[signum] = signal.signal(signum, lambda *_: None)
        selector.register(wake_read, selectors.EVENT_READ)
        if options.tee is not None:
            # Every rank's file is opened before any rank starts: a --tee that cannot be
            # written stops the launch before it begins.
            try:
                os.makedirs(options.tee, exist_ok=True)
                for rank, _ in ranks:
                    tees[rank] = open(os.path.join(options.tee, f"rank-{rank}.log"), "wb")
            except OSError as error:
                raise SystemExit(f"{_PREFIX}cannot write the --tee directory '{options.tee}': "
                                 f"{error}") from None
        for local, (rank, environment) in enumerate(ranks):
            process = subprocess.Popen(command, env=environment, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       start_new_session=True)
            launch.ranks.append(_Rank(rank, process))
            tee = tees.get(rank)
            shown = options.ranks is None or local in options.ranks
            for pipe, sink in ((process.stdout, sys.stdout.buffer),
                               (process.stderr, sys.stderr.buffer)):
                os.set_blocking(pipe.fileno(), False)
                launch.streams[pipe.fileno()] = _Stream(rank, sink if shown else None, tee)
                selector.register(pipe, selectors.EVENT_READ)
        _loop(launch, selector, wake_read)
    finally:
        for rank in launch.ranks:
            if rank.status is None:
                rank.signal_group(signal.SIGKILL)
                rank.status = rank.process.wait()
        for stream in launch.streams.values():
            stream.close()
        for tee in tees.values():
            tee.close()
        selector.close()
        for rank in launch.ranks:
            for pipe in (rank.process.stdout, rank.process.stderr):
                pipe.close()
        if previous_wakeup is not None:
            signal.set_wakeup_fd(previous_wakeup)
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)
        for fd in wake_fds:
            os.close(fd)

    if launch.failure is not None:
        status = launch.failure.status
        _message(f"rank {launch.failure.rank} {_describe(status)}")
        return _exit_status(status)
    if launch.interrupted is not None:
        return 128 + launch.interrupted
    return 0


def _loop(launch: _Launch, selector: selectors.BaseSelector, wake_read: int) -> None:
    launch.reap()  # a process may have ended before SIGCHLD was first waited for
    # The loop ends once every process has ended and its output has been passed on. Output
    # pipes that outlive their process (held by something that left its group) are waited for
    # only for the grace period.
    drain_until: Optional[float] = None
    while True:
        open_pipes = len(selector.get_map()) - 1
        if not launch.running():
            if open_pipes == 0:
                return
            if drain_until is None:
                drain_until = time.monotonic() + launch.grace_period
        deadline = drain_until if drain_until is not None else launch.kill_at
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        events = selector.select(timeout)
        now = time.monotonic()
        if drain_until is not None and now >= drain_until:
            return
        if launch.kill_at is not None and now >= launch.kill_at and launch.running():
            _message("ranks still running after the grace period; sending SIGKILL")
            for rank in launch.ranks:
                if rank.status is None:
                    rank.signal_group(signal.SIGKILL)
            launch.kill_at = None
        for key, _ in events:
            if key.fd == wake_read:
                _handle_signals(launch, wake_read)
                continue
            data = os.read(key.fd, 1 << 16)
            if data:
                launch.streams[key.fd].write(data)
            else:
                selector.unregister(key.fileobj)
                launch.streams[key.fd].close()


def _handle_signals(launch: _Launch, wake_read: int) -> None:
    try:
        received = os.read(wake_read, 512)
    except BlockingIOError:
        return
    for signum in received:
        if signum in _FORWARDED_SIGNALS:
            launch.forward(signum)
    # SIGCHLD, or a signal that arrived while a process was ending: look at every process.
    launch.reap()


def main(argv: Optional[list[str]] = None) -> int:
    options = _parse_arguments(sys.argv[1:] if argv is None else argv)
    return _run(options)


if __name__ == "__main__":
    sys.exit(main())
