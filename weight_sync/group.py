"""The weight-sync process group: train rank 0 (rank 0 here) plus every rollout engine worker.

It is built without ``init_process_group`` so it can coexist with the trainers' own FSDP group and vLLM's internal
groups in the same processes: a ``TCPStore`` hosted by the sender, then a backend process group over it.
Backends: gloo (CPU), NCCL through vLLM's ``PyNcclCommunicator`` on GPUs (vLLM's RLHF recipe), or ``"store"``: the
TCPStore alone, the control channel of the same-host IPC transports (``weight_sync.transport``).

Every wait has the group's ``timeout_s``: a member that dies or stalls turns a collective or store wait into an
error after at most that long (gloo raises at once when a peer's connection closes), never a hang.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
from torch.distributed import BroadcastOptions, TCPStore

BACKENDS = ("gloo", "nccl", "store")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class SyncGroup:
    """A broadcast-only group of ``world_size`` ranks; rank 0 is the sender.

    Args:
        host, port: the TCPStore address (rank 0 hosts it).
        rank: this member's rank in ``[0, world_size)``.
        world_size: 1 sender + number of engine workers.
        timeout_s: every store wait and collective fails after this many seconds instead of hanging.
        backend: ``"gloo"``, ``"nccl"`` or ``"store"`` (no collective: ``broadcast`` raises; ``store`` only).

    Raises:
        ValueError: a bad rank or backend.
        RuntimeError / DistStoreError: a peer did not join within ``timeout_s``.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float, backend: str = "gloo"):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if backend not in BACKENDS:
            raise ValueError(f"sync backend must be one of {BACKENDS}, got {backend!r}")
        self.rank, self.world_size, self.backend, self.timeout_s = rank, world_size, backend, timeout_s
        timeout = timedelta(seconds=timeout_s)
        self._pg = self._nccl = self.store = None
        if backend in ("gloo", "store"):
            self.store = TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout,
                                  wait_for_workers=False)
            if backend == "gloo":
                self._pg = torch.distributed.ProcessGroupGloo(self.store, rank, world_size, timeout)
        else:
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            spg = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size,
                                               store_timeout=int(timeout_s))
            self.store = spg.store
            self._nccl = PyNcclCommunicator(spg, device=torch.cuda.current_device())

    def broadcast(self, tensor: torch.Tensor, async_op: bool = False):
        """Broadcast ``tensor`` in place from rank 0. With ``async_op`` returns a work handle (``.wait()``).

        Raises:
            RuntimeError: the group is closed or store-only; gloo: a peer closed its connection or did not take part
                within ``timeout_s``.
        """
        if self._nccl is not None:
            self._nccl.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
            return _Done()
        if self._pg is None:
            raise RuntimeError(f"sync group (backend {self.backend!r}) has no broadcast: closed or store-only")
        opts = BroadcastOptions()
        opts.rootRank = 0
        work = self._pg.broadcast([tensor], opts)
        if async_op:
            return work
        work.wait()
        return _Done()

    def close(self) -> None:
        """Drop the process group and the store (rank 0's store server stops when no reference is left)."""
        self._pg = self._nccl = self.store = None


class _Done:
    def wait(self) -> bool:
        return True
