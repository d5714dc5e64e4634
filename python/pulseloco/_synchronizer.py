"""pulseloco.Synchronizer: the engine over a model's parameters, without copying them."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import numbers
import os
import pathlib
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from . import _pulseloco, _worker
from ._pulseloco import InvalidArgument, TensorInfo, WindowReport

PathLike = Union[str, "os.PathLike[str]"]

OPTIMIZER_FILE = "optimizer.pt"


@dataclasses.dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint that load_checkpoint() restored."""

    dir: pathlib.Path
    """The checkpoint directory loaded."""
    window: int
    """Windows it had committed (committed_windows at the save). Not where the data continues:
    with overlapped windows a window was in flight, and next_window is one more."""
    files: Dict[str, bytes]
    """This rank's own files (save_checkpoint(files=...)), verified against the manifest."""
    next_window: int
    """The number the next boundary's window gets (sync.next_window after the load): the
    window whose data the loop trains next."""
    next_step: int
    """The inner step the data loop continues from: next_window * inner_steps."""


def _named_tensors(parameters: Any) -> List[Tuple[str, Any]]:
    """(name, tensor) pairs from named_parameters(), a dict, or an iterable of tensors."""
    if isinstance(parameters, Mapping):
        items = list(parameters.items())
    else:
        try:
            items = list(parameters)
        except TypeError:
            raise InvalidArgument(
                "parameters: expected named_parameters(), a dict name -> tensor or tensors; got "
                f"a {type(parameters).__name__}") from None
        if items and not (isinstance(items[0], tuple) and len(items[0]) == 2):
            items = [(str(i), tensor) for i, tensor in enumerate(items)]
    named = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise InvalidArgument(
                "parameters: expected (name, tensor) pairs, a dict name -> tensor or tensors; "
                f"got a {type(item).__name__}")
        named.append(item)
    return named


def _path(name: str, value: Any) -> str:
    """`value` (str, bytes or os.PathLike) as a str, else InvalidArgument naming the argument."""
    try:
        return os.fsdecode(os.fspath(value))
    except TypeError:
        raise InvalidArgument(f"{name}: expected a path, got a {type(value).__name__}") from None


def _check_optimizer(optimizer: Any, method: str) -> None:
    """InvalidArgument unless `optimizer` (not None) has the torch optimizer's `method`."""
    if optimizer is not None and not callable(getattr(optimizer, method, None)):
        raise InvalidArgument(f"optimizer: expected a torch optimizer, got a "
                              f"{type(optimizer).__name__}")


def _integer(name: str, value: Any, minimum: int, maximum: int) -> int:
    """`value` as an int in [minimum, maximum], else InvalidArgument naming the argument."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise InvalidArgument(f"{name}: expected an int, got a {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise InvalidArgument(f"{name}: {value} is not in [{minimum}, {maximum}]")
    return int(value)


def _real(name: str, value: Any) -> float:
    """`value` as a float, else InvalidArgument naming the argument (the engine checks its
    range)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise InvalidArgument(f"{name}: expected a float, got a {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise InvalidArgument(f"{name}: an int too large for a float") from None


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{name}: expected a str, got a {type(value).__name__}")
    return value


UINT32_MAX = 2**32 - 1


def _cuda_device_of(tensors: List[Any]) -> Any:
    """The torch device of CUDA tensors (the engine then keeps its state there), else None."""
    if tensors and getattr(tensors[0], "is_cuda", False):
        return tensors[0].device
    return None


def _engine_view(tensor: Any) -> Any:
    """What the engine imports: the tensor itself, detached from autograd when it is a torch
    parameter (torch refuses to export tensors that require grad; detach() shares memory)."""
    detach = getattr(tensor, "detach", None)
    if detach is not None and getattr(tensor, "requires_grad", False):
        return detach()
    return tensor


class Synchronizer:
    """Synchronises a model's parameters across a group with PULSELoCo, DiLoCo or DDP.

    Synchronizer(parameters, *, mode="pulse", inner_steps=8, outer_lr=0.7,
                 outer_momentum=0.9, group=None, elastic=None, on_report=None,
                 worker=None, **engine_options)

    parameters: model.named_parameters(), a dict name -> tensor, or an iterable of tensors
        (named "0", "1", ...). Each is contiguous, float32 or bfloat16, and has __dlpack__
        (torch.Tensor) or the buffer protocol (NumPy). The engine reads and writes the tensors'
        own memory (no copy); the Synchronizer keeps them alive.
    mode: "pulse" (sparse), "diloco" (dense outer step) or "ddp" (gradients averaged).
    inner_steps: optimizer steps per window (H). outer_lr, outer_momentum: the outer Nesterov
        step's learning rate and momentum.
    group: None (the group forms from the environment: RANK, WORLD_SIZE, MASTER_ADDR,
        MASTER_PORT as torchrun sets them, mpirun's, PULSELOCO_*), or a dict of overrides with
        the C++ TransportOptions / TcpOptions field names: backend, rendezvous, rank,
        world_size, master_addr, master_port, peers, run_id, connect_timeout (s), secret,
        listen_addr, listen_port, connections_per_peer, io_timeout (s), ...; and
        exchange_bucket "s3://bucket/prefix": the group forms and exchanges through that
        bucket, no rank listening on a port (rank, world_size, run_id and secret required; not
        with elastic; docs/operations.md, "A group through a bucket").
    elastic: None, or a dict (coordinator "host:port", worker_id, admission_timeout (s),
        max_attempts_per_window; with worker=, worker_link_timeout (s): how long a local rank
        waits for the others, 600 by default): an elastic worker whose group may lose and gain
        members.
    engine_options: the C++ EngineOptions by name: chunk_elements, bucket_elements, threads,
        timeout (s), allgather, pipeline_chunk_bytes, bf16_delta, overlap, exchange,
        node_aware, verify_digests, trace_dir, state_location, publish_dir, publish_every,
        publish_continue, anchor_every, encoding, zstd_level, index_coding. Unknown names raise
        InvalidArgument.
    overlap: "blocking" (the default), "delayed" or "eager" (mode "pulse" only): with the
        latter two a window's exchange runs while the next window's inner steps run, and its
        outer step is applied at the next boundary (one window of staleness; see
        docs/operations.md, "Overlapped windows"). Call complete_in_flight() after the last
        step so that the final weights include the last window.
    worker: None (one rank is one worker; PULSELOCO_RANKS_PER_WORKER, which the launcher's
        --ranks-per-worker sets, counts as worker=G), G (every G consecutive ranks of the default
        torch.distributed group form one worker) or a dict (ranks_per_worker; sharded, default
        False; process_group: the worker's torch group, default one made here; master_ports:
        the G rendezvous ports of the local ranks' groups, default PULSELOCO_WORKER_PORTS or
        MASTER_PORT+1 .. MASTER_PORT+G). Replicated, the worker's ranks train one replica
        together (the user's DDP over sync.process_group); local rank j runs the window over
        the j-th of G contiguous ranges of the model's elements with local rank j of every
        worker, then the worker's ranks broadcast their ranges to each other. Sharded, each
        rank passes the shard it holds (as FSDP's flat parameters are), and local rank j runs
        the window over it with local rank j of every worker; nothing is broadcast.
        torch.distributed must be initialised over every rank first. With elastic=, the
        default torch group is this worker's ranks alone (each worker its own launcher), and
        the worker joins, regroups and leaves as one. See docs/operations.md, "A worker of
        several GPUs".
    on_report: None, or a callable that receives every WindowReport this Synchronizer returns
        (after_optimizer_step, run_window, complete_in_flight), on the calling thread, before
        the call returns it: a metrics sink (report.to_dict() is JSON-ready; see
        examples/python/metrics.py). An exception it raises propagates to the caller.

    Constructing it is collective: every rank constructs its Synchronizer with the same tensor
    table and options, and rank 0's weights become everyone's. Windows, checkpoints and group
    formation release the GIL. Ctrl-C during a window or a checkpoint aborts the group (the
    other ranks raise PeerLostError within their timeout) and raises KeyboardInterrupt here once
    the call has returned; during group formation, and in an elastic worker, it takes effect
    when the call returns by itself.
    """

    def __init__(self, parameters: Any, *, mode: str = "pulse", inner_steps: int = 8,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 group: Optional[Dict[str, Any]] = None,
                 elastic: Optional[Dict[str, Any]] = None,
                 on_report: Optional[Callable[[WindowReport], Any]] = None,
                 worker: Any = None,
                 **engine_options: Any) -> None:
        if on_report is not None and not callable(on_report):
            raise InvalidArgument(
                f"on_report: expected a callable or None, got a {type(on_report).__name__}")
        self._on_report = on_report
        mode = _text("mode", mode)
        inner_steps = _integer("inner_steps", inner_steps, 1, UINT32_MAX)
        outer_lr = _real("outer_lr", outer_lr)
        outer_momentum = _real("outer_momentum", outer_momentum)
        self._worker: Optional[_worker.Worker] = None
        named = _named_tensors(parameters)
        self._parameters = [tensor for _, tensor in named]
        self._cuda_device = _cuda_device_of(self._parameters)
        if worker is None:
            worker = _worker.from_environment()
        if worker is not None:
            self._engine = self._start_worker(named, worker, mode, inner_steps, outer_lr,
                                              outer_momentum, dict(engine_options), group,
                                              elastic)
            return
        self._views = [(name, _engine_view(tensor)) for name, tensor in named]
        self._engine = _pulseloco._Synchronizer(
            self._views, mode, inner_steps, outer_lr, outer_momentum, dict(engine_options),
            group, elastic)

    def _start_worker(self, named: List[Tuple[str, Any]], worker: Any, mode: str,
                      inner_steps: int, outer_lr: float, outer_momentum: float,
                      options: Dict[str, Any], group: Optional[Dict[str, Any]],
                      elastic: Optional[Dict[str, Any]]) -> Any:
        """A local rank of a worker of several ranks (docs/design.md, "A worker of several
        ranks"): the engine over this local rank's share, in the group of the workers' same
        local ranks; then the worker's ranks agree and bring each other up to date."""
        settings = _worker.parse_worker(worker)
        dist = _worker._torch_distributed()
        count = settings["ranks_per_worker"]
        world, rank = dist.get_world_size(), dist.get_rank()
        # Elastic: the default torch group is this worker's alone, and its index in the group
        # comes with each generation.
        layout = (_worker.WorkerLayout(count, 1, 0, rank % count) if elastic is not None else
                  _worker.WorkerLayout(count, world // count, rank // count, rank % count))
        table = [(name, _worker._numel(tensor), str(getattr(tensor, "dtype", "")))
                 for name, tensor in named]
        # What this rank cannot do is told to every rank in the layout check (collective), so
        # that no rank waits for one that gave up.
        problem = None
        refused = [what for what, bad in (
            ("mode 'ddp'", mode == "ddp"),
            ("overlap", options.get("overlap", "blocking") != "blocking"),
            ("publish_dir", bool(options.get("publish_dir")))) if bad]
        not_torch = [(name, tensor) for name, tensor in named if not hasattr(tensor, "detach")]
        if refused:
            problem = f"worker: a worker of several ranks does not support {', '.join(refused)}"
        elif not_torch:
            problem = (f"worker: a worker of several ranks takes torch tensors; "
                       f"'{not_torch[0][0]}' is a {type(not_torch[0][1]).__name__}")
        elif elastic is not None and world != count:
            problem = (f"worker: an elastic worker of {count} ranks runs under a "
                       f"torch.distributed group of its own ranks (each worker its own "
                       f"launcher); the default group has {world} ranks")
        elif world % count != 0:
            problem = (f"worker: ranks_per_worker {count} does not divide the {world} ranks of "
                       f"the default torch.distributed group")
        else:
            try:
                if elastic is not None:
                    if not isinstance(elastic, dict):
                        raise InvalidArgument("elastic must be a dict (coordinator, worker_id, "
                                              "...) or None")
                    elastic = _worker.elastic_overrides(layout, settings, group, elastic)
                    overrides = group
                else:
                    overrides = _worker.group_overrides(layout, settings, group)
            except InvalidArgument as error:
                problem = str(error)
        elements = _worker.check_layouts(dist, layout, settings["sharded"], table, problem)
        # The worker's own process group waits twice the engine's timeout: checked here as
        # the engine checks it, before the group is made.
        timeout = _real("option 'timeout'", options.get("timeout", 60.0))
        if not math.isfinite(timeout) or timeout < 0 or timeout > 1e12:
            raise InvalidArgument(f"option 'timeout': {timeout} s is not a duration")
        if timeout * 1000 < 0.5:  # what the engine rounds to 0 ms
            raise InvalidArgument(f"option 'timeout': {timeout} s is less than a millisecond")
        process_group = settings.get("process_group") or _worker.worker_process_group(
            count, timeout=2 * timeout)
        shares = None if settings["sharded"] else _worker.split_shares(named, count)
        self._worker = _worker.Worker(dist, layout, process_group, self._parameters, shares,
                                      elements, elastic=elastic is not None)
        if options.get("trace_dir"):
            options["trace_dir"] = os.path.join(options["trace_dir"], self._share_directory())
        if shares is None:  # sharded: this rank's tensors are its share
            self._views = [(name, _engine_view(tensor)) for name, tensor in named]
        else:
            self._views = [(piece.name, view) for piece, view in
                           zip(shares[layout.local_rank], self._worker.views(layout.local_rank))]
        try:
            engine = _pulseloco._Synchronizer(
                self._views, mode, inner_steps, outer_lr, outer_momentum, options,
                overrides, elastic)
        except _pulseloco.Error as error:
            self._worker.exchange_status("", _worker.name_engine_error(error, layout))
            raise  # exchange_status raised already
        self._worker.follow_group(engine.rank, engine.world_size)
        self._worker.exchange_status(engine.digest, None)
        if self._worker.replicated:
            self._worker.broadcast_shares()
        return engine

    def _share_directory(self) -> str:
        layout = self._worker.layout
        return f"local-{layout.local_rank}-of-{layout.ranks_per_worker}"

    def _follow_current_stream(self) -> None:
        """State on a CUDA device: the engine's next accesses run after the work queued on
        torch's current stream of that device, and that stream's later work after them."""
        if self._cuda_device is None:
            return
        import torch  # CUDA tensors came from torch

        self._engine.set_cuda_stream(torch.cuda.current_stream(self._cuda_device).cuda_stream)

    def _worker_call(self, call: Callable[[], Any], broadcast: bool = True,
                     window: bool = False) -> Any:
        """call() on the engine; in a worker of several ranks, then the status exchange and
        (broadcast, replicated workers) the shares' broadcasts inside the worker. window: the
        call may run a window."""
        if self._worker is None:
            return call()
        try:
            result = call()
        except _pulseloco.Error as error:
            named = _worker.name_engine_error(error, self._worker.layout)
            if window and self._worker.elastic:
                # An elastic window's local ranks agree on its outcome over their link (every
                # one raises), or the link lost one of them: a status exchange adds nothing and
                # would wait its timeout for a local rank that is gone or hung.
                raise named from None
            self._worker.exchange_status("", named)
            raise  # exchange_status raised already
        self._worker.follow_group(self._engine.rank, self._engine.world_size)
        if result is None:
            return None
        self._worker.exchange_status(self._engine.digest, None)
        if broadcast and self._worker.replicated:
            self._worker.broadcast_shares()
        return result

    # --- the training loop -------------------------------------------------------------------

    def before_optimizer_step(self) -> None:
        """Call after backward(), before optimizer.step(). ddp: averages every parameter's
        .grad over the ranks (collective). Other modes: nothing."""
        if self._engine.mode != "ddp":
            return
        self._follow_current_stream()
        self._engine.average_gradients(
            [getattr(tensor, "grad", None) for tensor in self._parameters])

    def after_optimizer_step(self) -> Optional[WindowReport]:
        """Call after every optimizer.step(): counts the step; every inner_steps-th call runs a
        window (collective), writes the new weights into the parameters and returns its report;
        otherwise returns None."""
        if self._cuda_device is not None and self._engine.next_step_runs_window:
            self._follow_current_stream()  # checked here: most steps run no window
        return self._deliver(self._worker_call(self._engine.after_optimizer_step, window=True))

    def run_window(self) -> WindowReport:
        """Runs a window now (collective), whatever the step count."""
        self._follow_current_stream()
        return self._deliver(self._worker_call(self._engine.run_window, window=True))

    def complete_in_flight(self) -> Optional[WindowReport]:
        """Overlapped windows (overlap="delayed" or "eager"): finishes the window in flight and
        applies its outer step without starting another (collective), e.g. after the last
        training step, so that the final weights include every window. Writes the new weights
        into the parameters and returns that boundary's report (its window and applied_window
        are the applied window's); returns None when no window is in flight (blocking runs, or
        nothing since the last boundary was completed)."""
        self._follow_current_stream()
        return self._deliver(self._engine.complete_in_flight())

    def _deliver(self, report: Optional[WindowReport]) -> Optional[WindowReport]:
        if report is not None and self._on_report is not None:
            self._on_report(report)
        return report

    # --- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self, root: PathLike, *, keep: int = 2, optimizer: Any = None,
                        files: Optional[Dict[str, bytes]] = None) -> pathlib.Path:
        """Writes a checkpoint directory under root (collective) and returns it. optimizer: a
        torch optimizer whose state_dict is saved as this rank's file "optimizer.pt"; files:
        this rank's own files (name -> bytes). The committed checkpoints beyond the newest
        `keep` are removed."""
        keep = _integer("keep", keep, 1, UINT32_MAX)
        root = _path("root", root)
        if files is not None and not isinstance(files, Mapping):
            raise InvalidArgument(f"files: expected a dict name -> bytes, got a "
                                  f"{type(files).__name__}")
        own = dict(files or {})  # the engine checks the names and bytes
        _check_optimizer(optimizer, "state_dict")
        if optimizer is not None:
            if OPTIMIZER_FILE in own:
                raise InvalidArgument(f"files holds '{OPTIMIZER_FILE}', the file optimizer= "
                                      "writes: rename it or pass only one of them")
            import torch  # only when an optimizer is given: pulseloco does not need torch

            buffer = io.BytesIO()
            torch.save(optimizer.state_dict(), buffer)
            own[OPTIMIZER_FILE] = buffer.getvalue()
        if self._worker is not None:
            root = os.path.join(root, self._share_directory())
        self._follow_current_stream()
        return pathlib.Path(self._worker_call(
            lambda: self._engine.save_checkpoint(root, keep, own), broadcast=False))

    def load_checkpoint(self, path: PathLike, *, optimizer: Any = None) -> LoadedCheckpoint:
        """Restores a checkpoint (collective): a checkpoint directory, or a root whose newest
        committed checkpoint is loaded. The parameters are reset to the checkpoint's weights;
        optimizer: restored from the checkpoint's "optimizer.pt". The data loop continues at
        the returned next_step (inner steps) or next_window (windows)."""
        path = _path("path", path)
        _check_optimizer(optimizer, "load_state_dict")
        if self._worker is not None:
            path = os.path.join(path, self._share_directory())
        self._follow_current_stream()
        # With optimizer=, a checkpoint saved without it is refused before anything changes.
        required = [OPTIMIZER_FILE] if optimizer is not None else []
        directory, window, next_window, next_step, own = self._worker_call(
            lambda: self._engine.load_checkpoint(path, required))
        if optimizer is not None:
            import torch

            optimizer.load_state_dict(torch.load(io.BytesIO(own[OPTIMIZER_FILE])))
        return LoadedCheckpoint(pathlib.Path(directory), window, own, next_window, next_step)

    def save_global_weights(self, file: PathLike) -> None:
        """Writes this rank's global weights to one safetensors file (not collective)."""
        self._engine.save_global_weights(_path("file", file))

    # --- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Leaves an elastic run, or releases the group's connections (the state stays
        readable)."""
        self._engine.close()

    def __enter__(self) -> "Synchronizer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # --- state -------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank in the group (a worker of several ranks: its global rank)."""
        if self._worker is not None:
            return self._worker.layout.rank
        return self._engine.rank

    @property
    def world_size(self) -> int:
        """Ranks in the group (workers of several ranks: every rank of every worker)."""
        if self._worker is not None:
            return self._worker.layout.workers * self._worker.layout.ranks_per_worker
        return self._engine.world_size

    @property
    def committed_windows(self) -> int:
        """Outer steps applied so far (windows committed; with overlapped windows, the window
        in flight is not counted). Not a window number: reports number windows as next_window
        does, which runs ahead once a window was dropped."""
        return self._engine.committed_windows

    @property
    def parameter_count(self) -> int:
        """Elements in the model (a worker of several ranks: the elements its ranks hold
        together, the whole model when replicated; tensor_table() and the state accessors hold
        this local rank's share)."""
        if self._worker is not None:
            return self._worker.elements
        return self._engine.parameter_count

    @property
    def state_location(self) -> str:
        """Where the global weights, momentum and residual live: "host" or "cuda:N"."""
        return self._engine.state_location

    @property
    def digest(self) -> str:
        """Combined digest of the global weights and momentum (equal on every rank), as the
        reports and the log print it: 16 lowercase hex digits. A worker of several ranks: the
        worker's digest, of its local ranks' share digests in order (equal on every rank of
        every worker), as of the last window, checkpoint or construction."""
        if self._worker is not None:
            return self._worker.digest
        return self._engine.digest

    @property
    def worker(self) -> Optional[_worker.WorkerLayout]:
        """Where this rank sits in a worker of several ranks (ranks_per_worker, workers, worker,
        local_rank); None otherwise."""
        return None if self._worker is None else self._worker.layout

    @property
    def process_group(self) -> Any:
        """A worker of several ranks: the torch.distributed group of this worker's ranks (for
        the user's DDP inside the worker); None otherwise."""
        return None if self._worker is None else self._worker.process_group

    @property
    def share_digests(self) -> List[str]:
        """A worker of several ranks: each local rank's share digest, in local rank order (as
        of the last window); empty otherwise."""
        return [] if self._worker is None else list(self._worker.share_digests)

    @property
    def next_step_runs_window(self) -> bool:
        """True when the next after_optimizer_step() runs a window."""
        return self._engine.next_step_runs_window

    @property
    def window_in_flight(self) -> bool:
        """True while a window's message has been sent but its outer step not applied
        (overlapped windows, between boundaries)."""
        return self._engine.window_in_flight

    @property
    def next_window(self) -> int:
        """The number the next boundary's window gets (its report's window): where a loop
        resumed from a checkpoint continues its data. Equals committed_windows when blocking."""
        return self._engine.next_window

    @property
    def options(self) -> Dict[str, Any]:
        """The engine's options as their canonical JSON (as checkpoints record them)."""
        return json.loads(self._engine.options_json)

    @property
    def generation(self) -> int:
        """The group's generation (elastic runs; 0 for a fixed group)."""
        return self._engine.generation

    @property
    def members(self) -> List[str]:
        """Worker ids in rank order (elastic runs; empty for a fixed group)."""
        return self._engine.members

    def tensor_table(self) -> List[TensorInfo]:
        """The engine's view of every parameter: name, data_ptr (the address it uses: the
        tensor's own), numel, dtype, device."""
        return self._engine.tensor_table()

    def global_weights(self, i: int) -> Any:
        """A float32 NumPy copy of parameter i's global weights."""
        return self._engine.global_weights(_integer("i", i, 0, 2**63 - 1))

    def momentum(self, i: int) -> Any:
        """A float32 NumPy copy of parameter i's outer momentum."""
        return self._engine.momentum(_integer("i", i, 0, 2**63 - 1))

    def residual(self, i: int) -> Any:
        """A float32 NumPy copy of parameter i's residual (this rank's error feedback)."""
        return self._engine.residual(_integer("i", i, 0, 2**63 - 1))

    def __repr__(self) -> str:
        if getattr(self, "_engine", None) is None:  # the constructor raised
            return "Synchronizer(<not constructed>)"
        return (f"Synchronizer(mode={self._engine.mode!r}, rank={self.rank}, "
                f"world_size={self.world_size}, committed_windows={self.committed_windows}, "
                f"parameters={self.parameter_count})")
