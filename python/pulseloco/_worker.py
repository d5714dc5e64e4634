"""A worker of several ranks: the user's torch.distributed data parallelism inside the worker,
pulseloco between workers, each local rank carrying 1/G of the outer sync.

Replicated (DDP inside the worker): the model's elements, flattened in table order, are cut into
G near-equal contiguous ranges; local rank j owns range j on every worker (the split is a
function of the parameter table and G only). Sharded (FSDP or any sharding inside the worker):
each local rank passes the shard it holds, and that shard is its share.

Local rank j runs the window over its share in a pulseloco group of its own: local rank j of
every worker, rank = the worker's index. Afterwards the worker's ranks exchange a status (did
each window commit, its share digest) and, when replicated, the owners broadcast their ranges'
new local weights inside the worker, over a torch.distributed group of the worker's ranks. The
global weights, momentum and residual of a share live on its owner only.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _pulseloco
from ._pulseloco import InvalidArgument

# A status message inside the worker: JSON, zero-padded to this many bytes.
_STATUS_BYTES = 2048
_WORKER_OPTIONS = ("ranks_per_worker", "sharded", "process_group", "master_ports")


@dataclasses.dataclass(frozen=True)
class WorkerLayout:
    """Where this rank sits: worker `worker` of `workers`, local rank `local_rank` of
    `ranks_per_worker`; global rank = worker * ranks_per_worker + local_rank."""

    ranks_per_worker: int
    workers: int
    worker: int
    local_rank: int

    @property
    def rank(self) -> int:
        return self.worker * self.ranks_per_worker + self.local_rank

    def global_rank(self, worker: int, local_rank: int) -> int:
        return worker * self.ranks_per_worker + local_rank

    def describe(self, worker: int, local_rank: int) -> str:
        """"worker 1's local rank 1 (rank 3)"."""
        return (f"worker {worker}'s local rank {local_rank} "
                f"(rank {self.global_rank(worker, local_rank)})")


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements [begin, end) of the table's tensor `tensor`, named for the engine."""

    tensor: int
    begin: int
    end: int
    name: str


def _numel(tensor: Any) -> int:
    """A tensor's (or NumPy array's) element count; 0 for anything else, which the worker's
    layout check then refuses on every rank."""
    numel = getattr(tensor, "numel", None)
    if callable(numel):
        return int(numel())
    size = getattr(tensor, "size", None)
    return size if isinstance(size, int) else 0


def split_shares(named: Sequence[Tuple[str, Any]], ranks_per_worker: int) -> List[List[Piece]]:
    """The G shares of the table: the elements flattened in table order, cut at
    floor(N * j / G). A piece that is a whole tensor keeps the tensor's name; a part is named
    "name[begin:end]"."""
    numels = [_numel(tensor) for _, tensor in named]
    total = sum(numels)
    if total < ranks_per_worker:
        raise InvalidArgument(f"worker: the model's {total} elements cannot be split among "
                              f"{ranks_per_worker} local ranks")
    shares: List[List[Piece]] = []
    for j in range(ranks_per_worker):
        low, high = total * j // ranks_per_worker, total * (j + 1) // ranks_per_worker
        pieces = []
        offset = 0
        for t, ((name, _), numel) in enumerate(zip(named, numels)):
            begin, end = max(low, offset) - offset, min(high, offset + numel) - offset
            if begin < end:
                whole = begin == 0 and end == numel
                pieces.append(Piece(t, begin, end, name if whole else f"{name}[{begin}:{end}]"))
            offset += numel
        shares.append(pieces)
    return shares


def piece_view(tensor: Any, piece: Piece) -> Any:
    """The piece's elements as a 1-d view of the tensor's own memory."""
    detach = getattr(tensor, "detach", None)
    flat = detach().view(-1) if detach is not None else tensor.reshape(-1)
    return flat[piece.begin:piece.end]


def _torch_distributed() -> Any:
    try:
        import torch.distributed as dist
    except ImportError as error:
        raise InvalidArgument("worker: a worker of several ranks needs torch.distributed "
                              f"({error})") from None
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgument(
            "worker: torch.distributed must be initialised over every rank of every worker "
            "(torch.distributed.init_process_group) before the Synchronizer is constructed")
    return dist


def worker_process_group(ranks_per_worker: int, timeout: Optional[float] = None) -> Any:
    """Creates one torch.distributed group per worker (ranks w*G .. w*G+G-1 of the default
    group) and returns this rank's: the group for the user's DDP inside the worker. Collective
    over every rank of the default group. timeout: seconds (None: torch's default)."""
    if not isinstance(ranks_per_worker, int) or isinstance(ranks_per_worker, bool):
        raise InvalidArgument(f"worker: ranks_per_worker: expected an int, got a "
                              f"{type(ranks_per_worker).__name__}")
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                                or not 0 < timeout < 1e13):
        raise InvalidArgument(f"worker: timeout: expected seconds above 0 or None, got {timeout!r}")
    dist = _torch_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    if ranks_per_worker < 1 or world % ranks_per_worker != 0:
        raise InvalidArgument(f"worker: ranks_per_worker {ranks_per_worker} does not divide the "
                              f"{world} ranks of the default torch.distributed group")
    kwargs = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    mine = None
    for worker in range(world // ranks_per_worker):
        ranks = list(range(worker * ranks_per_worker, (worker + 1) * ranks_per_worker))
        group = dist.new_group(ranks=ranks, **kwargs)
        if rank in ranks:
            mine = group
    return mine


def from_environment() -> Optional[int]:
    """PULSELOCO_RANKS_PER_WORKER (set by the launcher's --ranks-per-worker), or None."""
    text = os.environ.get("PULSELOCO_RANKS_PER_WORKER", "")
    if not text:
        return None
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise InvalidArgument(f"PULSELOCO_RANKS_PER_WORKER: '{text}' is not a number of "
                              "ranks (at least 1)")
    return count


def parse_worker(worker: Any) -> Dict[str, Any]:
    """worker=G or worker={"ranks_per_worker": G, "sharded": bool, "process_group": pg,
    "master_ports": [...]}."""
    if isinstance(worker, int) and not isinstance(worker, bool):
        worker = {"ranks_per_worker": worker}
    if not isinstance(worker, dict):
        raise InvalidArgument(f"worker: expected an int (ranks per worker) or a dict, got a "
                              f"{type(worker).__name__}")
    unknown = sorted(set(worker) - set(_WORKER_OPTIONS))
    if unknown:
        raise InvalidArgument(f"worker: unknown option(s) {', '.join(unknown)} "
                              f"(known: {', '.join(_WORKER_OPTIONS)})")
    count = worker.get("ranks_per_worker")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise InvalidArgument(f"worker: ranks_per_worker must be a positive int, not {count!r}")
    sharded = worker.get("sharded", False)
    if not isinstance(sharded, bool):
        raise InvalidArgument(f"worker: sharded must be True or False, not {sharded!r}")
    return dict(worker, sharded=sharded)


def check_layouts(dist: Any, layout: WorkerLayout, sharded: bool,
                  table: List[Tuple[str, int, str]], problem: Optional[str]) -> int:
    """Every rank of the default group must hold the same ranks_per_worker and sharding, and the
    same parameter table as the ranks it shares a window with: every rank when replicated, the
    same local rank of every worker when sharded. None may have a problem (what keeps it from
    starting). Collective. Raises InvalidArgument on every rank, naming the ranks on each side,
    or the rank and its problem. Returns the elements the worker's ranks hold together (the
    model's, when replicated)."""
    mine = {"problem": problem, "ranks_per_worker": layout.ranks_per_worker, "sharded": sharded,
            "table": hashlib.sha256(json.dumps(table).encode()).hexdigest()[:16],
            "tensors": len(table), "elements": sum(numel for _, numel, _ in table)}
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    lines = []
    comparisons = [("ranks_per_worker", "ranks_per_worker", range(len(everyone))),
                   ("sharded", "sharded", range(len(everyone)))]
    if not sharded:
        comparisons.append(("table", "parameter tables (names, sizes, dtypes)",
                            range(len(everyone))))
    else:
        for j in range(layout.ranks_per_worker):
            comparisons.append(("table", f"local rank {j}'s shard tables (names, sizes, dtypes)",
                                range(j, len(everyone), layout.ranks_per_worker)))
    for key, what, ranks in comparisons:
        holders: Dict[str, List[int]] = {}
        for rank in ranks:
            theirs = everyone[rank]
            value = theirs[key] if key != "table" else (
                f"{theirs['tensors']} tensors, {theirs['elements']} elements, "
                f"digest {theirs['table']}")
            holders.setdefault(str(value), []).append(rank)
        if len(holders) > 1:
            sides = [f"{'rank' if len(ranks) == 1 else 'ranks'} "
                     f"{', '.join(map(str, ranks))} {'has' if len(ranks) == 1 else 'have'} "
                     f"{value}" for value, ranks in holders.items()]
            lines.append(f"{what}: {'; '.join(sides)}")
    if lines:
        raise InvalidArgument("worker layouts differ across ranks: " + " | ".join(lines))
    if problem is not None:
        raise InvalidArgument(problem)
    failed = [(rank, theirs["problem"]) for rank, theirs in enumerate(everyone)
              if theirs["problem"] is not None]
    if failed:
        rank, text = failed[0]
        raise InvalidArgument(f"rank {rank} cannot start its worker: {text}")
    if not sharded:
        return mine["elements"]
    first = layout.global_rank(layout.worker, 0)
    return sum(theirs["elements"] for theirs in everyone[first:first + layout.ranks_per_worker])


def _local_rank_ports(layout: WorkerLayout, worker: Dict[str, Any],
                      overrides: Dict[str, Any]) -> List[int]:
    """The G rendezvous ports of the local ranks: worker["master_ports"],
    PULSELOCO_WORKER_PORTS, or MASTER_PORT + 1 .. MASTER_PORT + G."""
    ports = worker.get("master_ports")
    if ports is None and os.environ.get("PULSELOCO_WORKER_PORTS"):
        text = os.environ["PULSELOCO_WORKER_PORTS"]
        try:
            ports = [int(port) for port in text.split(",")]
        except ValueError:
            raise InvalidArgument(f"PULSELOCO_WORKER_PORTS: '{text}' is not a list of ports "
                                  "(e.g. 29501,29502)") from None
    elif ports is not None:
        if not isinstance(ports, (list, tuple)) or not all(
                isinstance(port, int) and not isinstance(port, bool) for port in ports):
            raise InvalidArgument(f"worker: master_ports must be a list of ints, not {ports!r}")
    if ports is None:
        base = overrides.get("master_port")
        if base is not None:
            # int() would truncate 29500.9 or read True as 1.
            if not isinstance(base, int) or isinstance(base, bool) or not 1 <= base <= 65535:
                raise InvalidArgument(f"worker: group option master_port {base!r} is not a "
                                      "port number")
            first = base
        elif os.environ.get("MASTER_PORT"):
            try:
                first = int(os.environ["MASTER_PORT"])
            except ValueError:
                raise InvalidArgument(f"worker: MASTER_PORT {os.environ['MASTER_PORT']!r} is "
                                      "not a port number") from None
        else:
            raise InvalidArgument("worker: no rendezvous port for the local ranks' groups "
                                  "(set MASTER_PORT, PULSELOCO_WORKER_PORTS or "
                                  "worker={'master_ports': [...]})")
        ports = [first + 1 + i for i in range(layout.ranks_per_worker)]
    if len(ports) != layout.ranks_per_worker:
        raise InvalidArgument(f"worker: {len(ports)} rendezvous ports for "
                              f"{layout.ranks_per_worker} local ranks")
    for port in ports:
        if not 1 <= port <= 65535:
            raise InvalidArgument(f"worker: rendezvous port {port} is not in [1, 65535]")
    return list(ports)


def _group_dict(group: Any) -> Dict[str, Any]:
    if group is not None and not isinstance(group, dict):
        raise InvalidArgument(f"option 'group': expected a dict or None, got a "
                              f"{type(group).__name__}")
    return dict(group or {})


def group_overrides(layout: WorkerLayout, worker: Dict[str, Any],
                    group: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The pulseloco group of local rank index j: local rank j of every worker, ranked by
    worker, at its own rendezvous port and run id."""
    j = layout.local_rank
    overrides = _group_dict(group)
    ports = _local_rank_ports(layout, worker, overrides)
    overrides.update(rank=layout.worker, world_size=layout.workers, master_port=ports[j])
    if "master_addr" not in overrides and os.environ.get("MASTER_ADDR"):
        overrides["master_addr"] = os.environ["MASTER_ADDR"]
    run_id = overrides.get("run_id") or os.environ.get("PULSELOCO_RUN_ID")
    if run_id:
        overrides["run_id"] = f"{run_id}.local{j}"
    return overrides


def elastic_overrides(layout: WorkerLayout, worker: Dict[str, Any],
                      group: Optional[Dict[str, Any]],
                      elastic: Dict[str, Any]) -> Dict[str, Any]:
    """An elastic worker of several ranks: `elastic` with this rank's place in its worker and
    the worker's link, which local rank 0 hosts at the first local rank port on MASTER_ADDR
    (the local ranks' groups themselves come from the coordinator)."""
    overrides = _group_dict(group)
    ports = _local_rank_ports(layout, worker, overrides)
    host = overrides.get("master_addr") or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    return dict(elastic, local_rank=layout.local_rank, ranks_per_worker=layout.ranks_per_worker,
                worker_link=f"{host}:{ports[0]}")


def combine_digests(digests: Sequence[str]) -> str:
    """The worker's digest: of its shares' digests in local rank order (16 hex digits)."""
    return hashlib.blake2b("".join(digests).encode(), digest_size=8).hexdigest()


class Worker:
    """One local rank's part of a worker: its share, its worker's torch group, the status
    exchange and (replicated) the broadcasts that bring the worker's replicas up to date."""

    def __init__(self, dist: Any, layout: WorkerLayout, process_group: Any,
                 parameters: List[Any], shares: Optional[List[List[Piece]]],
                 elements: int, elastic: bool = False) -> None:
        """shares: the G shares of the replicated model; None when sharded (this rank's
        parameters are its share). elements: the elements the worker's ranks hold together.
        elastic: the default torch group is this worker's alone (each worker its own
        launcher), and the layout's worker index follows the group's generations."""
        self.dist = dist
        self.layout = layout
        self.elastic = elastic
        # The default torch group's rank of this worker's local rank 0.
        self._torch_first = 0 if elastic else layout.global_rank(layout.worker, 0)
        self.process_group = process_group
        self.parameters = parameters
        self.shares = shares
        self.elements = elements
        self.digest = ""
        self.share_digests: List[str] = []
        backend = dist.get_backend(process_group)
        self._device = None
        if backend == "nccl":
            import torch

            self._device = torch.device("cuda", torch.cuda.current_device())

    def torch_rank(self, local_rank: int) -> int:
        """The default torch group's rank of this worker's local rank `local_rank`."""
        return self._torch_first + local_rank

    def follow_group(self, rank: int, size: int) -> None:
        """An elastic worker: its index and the workers in the current generation."""
        if self.elastic:
            self.layout = dataclasses.replace(self.layout, worker=rank, workers=size)

    @property
    def replicated(self) -> bool:
        """Every rank holds the whole model (DDP), so the shares are broadcast after a
        window; False when each rank holds only its own shard."""
        return self.shares is not None

    def views(self, share: int) -> List[Any]:
        assert self.shares is not None, "a sharded worker has no shares of a replica"
        return [piece_view(self.parameters[p.tensor], p) for p in self.shares[share]]

    def exchange_status(self, share_digest: str, error: Optional[BaseException]) -> None:
        """Tells every other local rank how this rank's window went and learns theirs
        (collective inside the worker). Raises: this rank's own error (named as this worker's
        local rank); else the first other local rank's failure, or a PeerLostError naming a
        local rank that could not be reached."""
        import torch

        layout = self.layout
        if error is None:
            status = {"ok": True, "digest": share_digest}
        else:
            status = {"ok": False, "type": type(error).__name__,
                      "kind": getattr(error, "kind", None),
                      "message": str(error)[:_STATUS_BYTES - 200]}
        mine = torch.zeros(_STATUS_BYTES, dtype=torch.uint8, device=self._device)
        encoded = json.dumps(status).encode()[:_STATUS_BYTES]
        mine[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
        sends = []
        received: Dict[int, Dict[str, Any]] = {layout.local_rank: status}
        unreachable: List[int] = []
        for j in range(layout.ranks_per_worker):
            if j == layout.local_rank:
                continue
            try:
                sends.append(self.dist.isend(mine, dst=self.torch_rank(j),
                                             group=self.process_group))
            except RuntimeError:  # gloo fails at once when the connection is gone
                unreachable.append(j)
        for j in range(layout.ranks_per_worker):
            if j == layout.local_rank or j in unreachable:
                continue
            theirs = torch.zeros(_STATUS_BYTES, dtype=torch.uint8, device=self._device)
            try:
                self.dist.recv(theirs, src=self.torch_rank(j), group=self.process_group)
            except RuntimeError:
                unreachable.append(j)
                continue
            raw = bytes(theirs.cpu().tolist()).rstrip(b"\0")
            received[j] = json.loads(raw.decode())
        for send in sends:
            try:
                send.wait()
            except RuntimeError:
                pass  # that local rank is named below, from its receive
        if error is not None:
            raise error
        for j in range(layout.ranks_per_worker):
            theirs = received.get(j)
            if theirs is not None and not theirs["ok"]:
                cls = getattr(_pulseloco, theirs["type"], _pulseloco.Error)
                raise _named(cls(f"{layout.describe(layout.worker, j)} failed: "
                                 f"{theirs['message']}"), layout.global_rank(layout.worker, j),
                             theirs.get("kind"))
        if unreachable:
            j = unreachable[0]
            raise _named(_pulseloco.PeerLostError(
                f"{layout.describe(layout.worker, j)} is lost: its worker's collective failed "
                f"(this is {layout.describe(layout.worker, layout.local_rank)})"),
                layout.global_rank(layout.worker, j))
        self.share_digests = [received[j]["digest"] for j in range(layout.ranks_per_worker)]
        self.digest = combine_digests(self.share_digests)

    def broadcast_shares(self) -> None:
        """Every owner's new local weights to the worker's other ranks (collective inside the
        worker): one broadcast per share, of its pieces' bytes (so that any dtype goes, bf16
        included, which gloo cannot reduce or broadcast as such)."""
        import torch

        layout = self.layout
        for j in range(layout.ranks_per_worker):
            views = [view.view(torch.uint8) for view in self.views(j)]
            if j == layout.local_rank:
                flat = torch.cat(views)
            else:
                flat = torch.empty(sum(view.numel() for view in views), dtype=torch.uint8,
                                   device=views[0].device)
            try:
                self.dist.broadcast(flat, src=self.torch_rank(j), group=self.process_group)
            except RuntimeError as error:
                raise _named(_pulseloco.PeerLostError(
                    f"bringing the worker up to date after the window: the broadcast of "
                    f"{layout.describe(layout.worker, j)}'s share failed: {error}"),
                    layout.global_rank(layout.worker, j)) from None
            if j != layout.local_rank:
                offset = 0
                for view in views:
                    view.copy_(flat[offset:offset + view.numel()])
                    offset += view.numel()


def _named(error: BaseException, rank: int, kind: Optional[str] = "peer_lost") -> BaseException:
    """error with the context attributes every pulseloco error has; rank: the one it names."""
    error.kind = kind  # type: ignore[attr-defined]
    error.peer = rank  # type: ignore[attr-defined]
    error.ranks = [rank]  # type: ignore[attr-defined]
    return error


def name_engine_error(error: BaseException, layout: WorkerLayout) -> BaseException:
    """An engine error of local rank j's group, its group ranks (worker indices) named as the
    workers' local ranks j with their global ranks."""
    peer = getattr(error, "peer", None)
    detail = f"in the window of local rank {layout.local_rank}'s share"
    if peer is not None:
        detail += f" (group rank {peer} is {layout.describe(peer, layout.local_rank)})"
    named = type(error)(f"{error} [{detail}]")
    for attribute in ("kind", "tensor", "index", "byte_offset"):
        setattr(named, attribute, getattr(error, attribute, None))
    # Ranks as global ranks: the group's rank r is worker r's local rank j.
    named.rank = layout.rank
    named.peer = None if peer is None else layout.global_rank(peer, layout.local_rank)
    named.ranks = [layout.global_rank(r, layout.local_rank) for r in getattr(error, "ranks", [])]
    return named
