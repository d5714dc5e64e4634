"""pulseloco: sparse, bit-identical DiLoCo-style synchronisation (PULSELoCo) for PyTorch.

    import pulseloco
    sync = pulseloco.Synchronizer(model.named_parameters(), mode="pulse", inner_steps=8)
    for batch in data:
        model(batch).loss.backward()
        sync.before_optimizer_step(); optimizer.step(); optimizer.zero_grad()
        if (report := sync.after_optimizer_step()) is not None:
            print(report.summary())

The group forms from the environment torchrun, mpirun and SLURM set (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; OMPI_*; PULSELOCO_*) or from Synchronizer(..., group={...}).
"""

from ._pulseloco import (
    AbortedError,
    DivergenceError,
    Error,
    InvalidArgument,
    IoError,
    MembershipError,
    NonFiniteError,
    PeerLostError,
    PhaseSeconds,
    ProtocolError,
    TensorInfo,
    TimeoutError,
    WindowReport,
    __version__,
    features,
)
from ._synchronizer import LoadedCheckpoint, Synchronizer
from ._worker import WorkerLayout, worker_process_group

__all__ = [
    "AbortedError",
    "DivergenceError",
    "Error",
    "InvalidArgument",
    "IoError",
    "LoadedCheckpoint",
    "MembershipError",
    "NonFiniteError",
    "PeerLostError",
    "PhaseSeconds",
    "ProtocolError",
    "Synchronizer",
    "TensorInfo",
    "TimeoutError",
    "WindowReport",
    "WorkerLayout",
    "__version__",
    "features",
    "worker_process_group",
]
