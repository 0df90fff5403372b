"""The receiving side of the weight sync, shared by every engine: one member of the sync group, the trainer's bucket
plan, and the received buckets with their checksums. Engine-neutral (torch and ``weight_sync`` only): the vLLM
worker extension (``rollout_workers.vllm.extension``) loads what it yields through vLLM's layerwise reload, the
transformers engine (``rollout_workers.hf.engine``) copies it into its model's tensors; both verify exactly the same
way (CRC-32 of the received bytes, ``weight_sync.buckets.bucket_checksums``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from weight_sync.buckets import Bucket, bucket_checksums
from weight_sync.group import SyncGroup

__all__ = ["WeightReceiver"]


class WeightReceiver:
    """One engine worker's member of the weight-sync group.

    Attributes:
        buckets: the trainer's bucket plan (after :meth:`join`); [] before.
    """

    def __init__(self):
        self._receiver = None
        self.buckets: list[Bucket] = []

    @property
    def joined(self) -> bool:
        return self._receiver is not None

    def join(self, host: str, port: int, rank: int, world_size: int, buckets: Sequence[Bucket], timeout_s: float,
             backend: str = "gloo", channel: dict | None = None, device: torch.device | None = None) -> None:
        """Join the sync group as ``rank`` (leaving a group joined before) and keep the bucket plan.

        Args:
            backend: the broadcast backend (``gloo``/``nccl``) when ``channel`` is None or a broadcast.
            channel: the sender's transport descriptor (``weight_sync.transport``): ``{"kind": "broadcast"}``,
                ``shm`` (maps the sender's shared-memory slots) or ``cuda_ipc``; None: broadcast.
            device: where received buffers live (a CUDA device for NCCL and CUDA IPC; default the CPU).

        Raises:
            RuntimeError: the group did not form within ``timeout_s``.
        """
        from weight_sync.transport import backend_for, make_receiver

        self.close()
        channel = channel or {"kind": "broadcast"}
        device = device or torch.device("cpu")
        group_backend = backend if channel["kind"] == "broadcast" else backend_for(channel["kind"], False)
        group = SyncGroup(host, port, rank, world_size, timeout_s, backend=group_backend,
                          device=device if group_backend == "nccl" else None)
        self._receiver = make_receiver(channel, group, device)
        self.buckets = list(buckets)

    def close(self) -> None:
        """Leave the group (idempotent); a sender blocked on this member fails at once."""
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()

    @property
    def names(self) -> list[str]:
        """The streamed tensor names, plan order."""
        return [s.name for b in self.buckets for s in b.slots]

    @property
    def nbytes(self) -> int:
        """Bytes one sync streams."""
        return sum(b.nbytes for b in self.buckets)

    def checked(self, verify: bool | Sequence[str]) -> set[str]:
        """The tensor names to checksum: every one (True), none (False) or the named ones."""
        return set(self.names) if verify is True else set(verify or ())

    def received(self, check: set[str], checksums: dict[str, int]) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """Receive one sync's buckets in plan order, yielding ``(bucket, buffer)`` for the caller to load; the
        CRC-32 of every tensor named in ``check`` (engine dtype, received bytes) goes into ``checksums``.

        Raises:
            RuntimeError: before :meth:`join`, or the transport failed (the sender died, stalled past the timeout,
                or closed the group after another member failed).
        """
        if self._receiver is None:
            raise RuntimeError("receive_weights called before init_weight_sync (or after close_weight_sync)")
        self._receiver.begin()
        for bucket in self.buckets:
            buf = self._receiver.receive(bucket)
            if check and any(s.name in check for s in bucket.slots):
                checksums.update(bucket_checksums(bucket, buf.cpu(), only=check))
            yield bucket, buf
