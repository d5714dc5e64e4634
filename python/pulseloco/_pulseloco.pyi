"""The C++ core of pulseloco (import pulseloco instead)."""

from collections.abc import Sequence

import numpy
from numpy.typing import NDArray

import builtins

__version__: str

class Error(builtins.Exception):
    """Base of every pulseloco error. str(e) is the C++ message with its context; the context is also in attributes: kind (the C++ ErrorKind's name: 'invalid_argument', 'io', 'timeout', 'peer_lost', ...), rank, peer, tensor, index, byte_offset (None when unset) and ranks (list)."""

    kind: str | None
    rank: int | None
    peer: int | None
    tensor: str | None
    index: int | None
    byte_offset: int | None
    ranks: list[int]

class InvalidArgument(Error, builtins.ValueError):
    """A caller, an option or a file asked for something impossible (also a ValueError)."""

class IoError(Error, builtins.OSError):
    """The operating system or a file failed (also an OSError)."""

class TimeoutError(Error, builtins.TimeoutError):
    """A deadline passed (also the builtin TimeoutError)."""

class PeerLostError(Error):
    """A peer closed, crashed or became unreachable; `peer` names it when known."""

class ProtocolError(Error):
    """Bytes from a peer or a file violate the wire or file format."""

class DivergenceError(Error):
    """Replicas that must be bit-identical are not; `ranks` names them."""

class NonFiniteError(Error):
    """NaN or infinity where the algorithm forbids it; `tensor` and `index` name it."""

class MembershipError(Error):
    """This worker is not (or no longer) in the run's group, or the run stopped."""

class AbortedError(PeerLostError):
    """This rank gave up its group (an interrupt, an earlier failure): also a PeerLostError."""


def features() -> dict:
    """
    What this build offers: version, linked transports, whether the state can live on a CUDA device, TLS, elastic runs; libtorch is never linked.
    """

class PhaseSeconds:
    """Seconds one window spent in each phase."""

    @property
    def gate(self) -> float:
        """gate + encode (pulse) or pseudo-gradient (diloco)"""

    @property
    def exchange(self) -> float:
        """
        the collectives; overlapped: the time this boundary waited for the window in flight and the vote
        """

    @property
    def exchange_wait(self) -> float:
        """
        of exchange: waiting for the slowest peer to join it (until the last peer's header had arrived)
        """

    @property
    def exchange_transfer(self) -> float:
        """of exchange: the rest, exchange - exchange_wait"""

    @property
    def exchange_in_flight(self) -> float:
        """
        overlapped windows: how long the applied window's exchange ran in the background
        """

    @property
    def apply(self) -> float:
        """decode, aggregate, residual, outer step, reset"""

    @property
    def verify(self) -> float:
        """digests of the state and their all-gather"""

    @property
    def publish(self) -> float:
        """publishing the global weights (rank 0)"""

    @property
    def total(self) -> float: ...

    def to_dict(self) -> dict: ...

    def __repr__(self) -> str: ...

class WindowReport:
    """
    What one window did on this rank (returned by after_optimizer_step() and run_window()). Attributes have the C++ WindowReport's names.
    """

    @property
    def window(self) -> int:
        """
        index of the window whose inner steps just ended (0-based); blocking windows commit at their own boundary
        """

    @property
    def applied_window(self) -> int | None:
        """
        the window whose outer step this boundary applied: window when blocking, window - 1 when overlapped, None at the first overlapped boundary or when the window in flight was dropped
        """

    @property
    def mode(self) -> str:
        """'pulse', 'diloco' or 'ddp'"""

    @property
    def overlap(self) -> str:
        """'blocking', 'delayed' or 'eager' (EngineOptions::overlap)"""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def generation(self) -> int:
        """the group's generation (elastic runs; 0 otherwise)"""

    @property
    def members(self) -> list[str]:
        """worker ids in rank order (elastic runs; else empty)"""

    @property
    def parameters(self) -> int:
        """elements in the model"""

    @property
    def steps_per_window(self) -> int:
        """H"""

    @property
    def state_location(self) -> str:
        """'host' or 'cuda:N'"""

    @property
    def entries_sent(self) -> int: ...

    @property
    def density(self) -> float:
        """entries_sent / parameters"""

    @property
    def payload_bytes(self) -> int:
        """this rank's encoded contribution"""

    @property
    def received_bytes(self) -> int: ...

    @property
    def exchange(self) -> str:
        """
        how the applied window was exchanged: 'allgather' or 'reduction' (mode pulse), 'allreduce' (diloco, ddp); '' when none was applied
        """

    @property
    def union_entries(self) -> int:
        """
        elements that at least one rank sent in the window applied at this boundary
        """

    @property
    def group_entries(self) -> int:
        """the sum over ranks of the elements each sent in that window"""

    @property
    def union_ratio(self) -> float:
        """
        union_entries / group_entries: 1 for disjoint sets, 1 / world_size for identical ones; 0 when nothing was applied
        """

    @property
    def wire_bytes_sent(self) -> int: ...

    @property
    def wire_bytes_received(self) -> int: ...

    @property
    def diloco_bytes(self) -> int:
        """dense DiLoCo payload: 4 B x parameters"""

    @property
    def ddp_bytes(self) -> int:
        """dense DDP payload: H x 4 B x parameters"""

    @property
    def seconds(self) -> PhaseSeconds: ...

    @property
    def digest(self) -> str:
        """
        combined digest of the global weights and momentum: 16 lowercase hex digits
        """

    @property
    def rank_digests(self) -> list[str]:
        """every rank's digest, as digest (empty if not verified)"""

    @property
    def replicas_identical(self) -> bool: ...

    @property
    def published_version(self) -> int | None:
        """
        the version this window's global weights were published as (publish_dir, rank 0); None when not published
        """

    @property
    def patch_changed(self) -> int:
        """elements whose bf16 value changed since the last published version"""

    @property
    def patch_density(self) -> float:
        """patch_changed / parameters"""

    @property
    def patch_delta_bytes(self) -> int:
        """the TRL delta file (0: none)"""

    @property
    def patch_compact_bytes(self) -> int:
        """the compact patch file (0: none)"""

    @property
    def patch_anchor_bytes(self) -> int:
        """the anchor file; 0 when no anchor was written"""

    @property
    def publish_error(self) -> str:
        """why a due version was not published; empty otherwise"""

    def to_dict(self) -> dict:
        """
        The report as the JSON the C++ library writes (to_json; docs/operations.md, "The per-window report"): JSON-ready, digests as hex strings, seconds as a nested dict.
        """

    def summary(self) -> str:
        """The one-line summary the C++ library logs."""

    def __repr__(self) -> str: ...

class TensorInfo:
    """
    What the engine sees of one parameter tensor: data_ptr is the address it reads and writes (the tensor's own memory).
    """

    @property
    def name(self) -> str: ...

    @property
    def data_ptr(self) -> int: ...

    @property
    def numel(self) -> int: ...

    @property
    def dtype(self) -> str: ...

    @property
    def device(self) -> str: ...

    def __repr__(self) -> str: ...

class _Synchronizer:
    """
    The engine behind pulseloco.Synchronizer (use that class: it accepts named_parameters() and optimizers).
    """

    def __init__(self, parameters: list, mode: str, inner_steps: int, outer_lr: float, outer_momentum: float, options: dict, group: object | None, elastic: object | None) -> None:
        """parameters: list of (name, tensor). Forms the group (collective)."""

    def after_optimizer_step(self) -> WindowReport | None:
        """
        Counts the step; every inner_steps-th call runs a window and returns its report.
        """

    def run_window(self) -> WindowReport:
        """Runs a window now (collective)."""

    def complete_in_flight(self) -> WindowReport | None:
        """
        Overlapped windows: applies the window in flight without starting another (collective); returns that boundary's report, or None when nothing is in flight.
        """

    def average_gradients(self, gradients: list) -> None:
        """
        ddp: replaces every gradient by its average over the ranks (collective).
        """

    def save_checkpoint(self, root: str, keep: int, files: dict) -> str:
        """Writes a checkpoint under root (collective); returns its directory."""

    def load_checkpoint(self, path: str, required: Sequence[str]) -> tuple:
        """
        Loads a checkpoint (collective) holding this rank's files `required`; returns (directory, window, next_window, next_step, files).
        """

    def save_global_weights(self, file: str) -> None:
        """Writes this rank's global weights to a safetensors file."""

    def set_cuda_stream(self, stream: int) -> None:
        """
        State on a CUDA device: the engine's device work runs after what this cudaStream_t (an address; 0: the legacy default stream) holds when it starts, and the stream's later work after it. Host state ignores it.
        """

    def close(self) -> None:
        """Leaves an elastic run, or releases the group's transport."""

    def tensor_table(self) -> list[TensorInfo]:
        """The engine's view of every parameter."""

    def global_weights(self, tensor: int) -> NDArray[numpy.float32]:
        """A float32 copy of tensor i's global weights."""

    def momentum(self, tensor: int) -> NDArray[numpy.float32]:
        """A float32 copy of tensor i's outer momentum."""

    def residual(self, tensor: int) -> NDArray[numpy.float32]:
        """A float32 copy of tensor i's residual (this rank's)."""

    @property
    def mode(self) -> str: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def committed_windows(self) -> int: ...

    @property
    def parameter_count(self) -> int: ...

    @property
    def state_location(self) -> str: ...

    @property
    def digest(self) -> str: ...

    @property
    def next_step_runs_window(self) -> bool: ...

    @property
    def window_in_flight(self) -> bool: ...

    @property
    def next_window(self) -> int: ...

    @property
    def options_json(self) -> str: ...

    @property
    def generation(self) -> int: ...

    @property
    def members(self) -> list: ...
