"""The weight-sync sender side of a train rank, backend-neutral: bucket plan, sync group, streaming to the engines.

:class:`WeightSender` is composed with a backend's :class:`SyncSource`, which names every tensor the engines receive
(HF names, HF shapes) and gathers each one whole on demand: FSDP2's is
:class:`train_workers.fsdp_sync.FSDPSyncSource` (``full_tensor`` of each DTensor; LoRA's merged or adapter tensors),
Megatron-core's :class:`train_workers.megatron.sync.MegatronSyncSource` (each tensor gathered over the TP group of the
stage holding it). Train rank 0 is rank 0 of the weight-sync group (train rank 0 + every engine worker); the other
train ranks take part only in the gathers that rebuild each full tensor. Transport, buckets and verification live in
``weight_sync/`` (``buckets``, ``transport``, ``sender``, ``verify``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from contract.sync_reports import SendReport
from train_workers.sharding import as_dtype

#: ``(HF name, shape, gather)``: ``gather()`` (a collective over the train group) returns the whole tensor.
Source = tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]


class SyncSource(Protocol):
    """The tensors a train rank streams to the engines.

    Attributes:
        adapter_sync: the tensors are LoRA adapter tensors (``train.lora.sync: adapter``): the sender digests the
            payload (``SendReport.payload_crc32``).
    """

    adapter_sync: bool

    def sources(self, engine_dtype: torch.dtype) -> list[Source]:
        """``(HF name, shape, gather)`` of every tensor the engines receive, in plan order (the same on every rank);
        ``gather()`` (a collective) returns the whole tensor in ``engine_dtype``."""
        ...

    def merge_rounding(self) -> tuple[float, float] | None:
        """With merged LoRA weights, (relative error, update error) of the update in the tensors gathered since the
        last :meth:`sources` call (``train_workers.lora.MergeRounding``); None when nothing is merged."""
        ...


class WeightSender:
    """Weight sync of one train rank (module docstring).

    Args:
        rank: this train rank (0 hosts the group). device: this rank's device (buffers and NCCL).
        use_cuda: whether the rank is on a GPU (transport backend).
        source: the backend's :class:`SyncSource`; None: the worker has not built its policy yet (a worker holds
            such a sender from its construction, so a sync call made too early fails with the errors below, and
            replaces it with one over its source once the policy is built).

    Attributes:
        group: rank 0's transport sender (``weight_sync.transport``), None when no group is formed.
        buckets: the plan of the last :meth:`plan` call (None before).
    """

    def __init__(self, rank: int, device: torch.device, use_cuda: bool, source: SyncSource | None = None):
        self.rank, self.device, self.use_cuda, self.source = rank, device, use_cuda, source
        self.group = None
        self.buckets = None
        self.engine_dtype: torch.dtype | None = None

    def sources(self) -> list[Source]:
        """The source's tensors in the engine dtype of the last :meth:`plan`."""
        return self.source.sources(self.engine_dtype)

    def plan(self, engine_dtype: str, bucket_bytes: int) -> list:
        """The bucket plan (``weight_sync.buckets.Bucket`` list) of the source's tensors in the engine's dtype,
        buckets of at most ``bucket_bytes`` bytes (same on every rank).

        Raises:
            ValueError: an unknown dtype name.
            RuntimeError: no source yet (the worker's ``init_distributed`` has not run).
        """
        from weight_sync.buckets import plan_buckets

        if self.source is None:
            raise RuntimeError("sync_plan called before init_distributed (no policy to plan)")
        dt = as_dtype(engine_dtype)
        self.engine_dtype = dt
        self.buckets = plan_buckets([(name, shape, dt) for name, shape, _ in self.sources()], bucket_bytes)
        return self.buckets

    def init_group(self, host: str, port: int, world_size: int, timeout_s: float,
                   transport: str = "broadcast") -> dict | None:
        """Rank 0 hosts the weight-sync group (rank 0 of it) and its transport; other train ranks do nothing here.

        Args:
            transport: ``broadcast`` (gloo/NCCL; blocks until every engine worker joined, so the engines must join
                concurrently), ``shm`` or ``cuda_ipc`` (returns at once; the engines join afterwards with the
                returned descriptor). See ``weight_sync.transport``.

        Returns:
            The transport descriptor the engines join with (rank 0), None on other ranks.

        Raises:
            RuntimeError: called before :meth:`plan`.
        """
        from weight_sync.group import SyncGroup
        from weight_sync.transport import backend_for, make_sender

        self.close_group()
        if self.rank != 0:
            return None
        if self.buckets is None:
            raise RuntimeError("init_sync_group called before sync_plan")
        backend = backend_for(transport, self.use_cuda)
        group = SyncGroup(host, port, 0, world_size, timeout_s, backend=backend,
                          device=self.device if backend == "nccl" else None)
        largest = max((b.nbytes for b in self.buckets), default=0)
        self.group = make_sender(transport, group, self.device, largest)
        return self.group.descriptor()

    def close_group(self) -> None:
        """Tear down this rank's side of the weight-sync group (before a group with new membership is built)."""
        if self.group is not None:
            self.group.close()
            self.group = None

    def send(self, verify: bool | list[str], policy_version: int) -> SendReport:
        """Stream the source's tensors to every engine, bucket by bucket (all train ranks call this together).

        Each tensor is gathered whole (a collective over the train group), cast to the engine dtype and copied into
        its bucket's buffer at once; rank 0 hands a full bucket to the transport (an asynchronous broadcast, or an
        IPC slot) while it packs the next into the other buffer (double buffering). The sender holds two bucket
        buffers plus one gathered tensor, never the whole model (``weight_sync.sender.stream_buckets``). After a
        transport error the group is closed (peers blocked in it fail at once) and must be rebuilt.

        Args:
            verify: True to CRC-32 every tensor, False none, or the names to check (``weight_sync.verify``).
            policy_version: the version being sent (reported back).

        Returns:
            this rank's :class:`SendReport` (bytes, checksums, the adapter payload's digest and memory from rank 0;
            see ``stream_buckets``; the merged update's rounding error from the source).

        Raises:
            RuntimeError: called before :meth:`plan`/:meth:`init_group`, or the transport failed (a receiver died
                or stalled past ``sync.timeout_s``).
        """
        from weight_sync.sender import stream_buckets

        if self.buckets is None:
            raise RuntimeError("broadcast_weights called before sync_plan")
        sender = self.group if self.rank == 0 else None
        if self.rank == 0 and sender is None:
            raise RuntimeError("broadcast_weights on train rank 0 before init_sync_group (or after a failed sync)")
        gather = {name: fn for name, _, fn in self.sources()}
        check = [s.name for b in self.buckets for s in b.slots] if verify is True else (verify or [])
        try:
            report = stream_buckets(self.buckets, lambda name: gather[name](), sender, check, self.device,
                                    digest=self.source.adapter_sync)
        except Exception:
            self.close_group()
            raise
        rounding = self.source.merge_rounding() or (None, None)
        return SendReport(policy_version=policy_version, seconds=report["seconds"], bytes=report["bytes"],
                          checksums=report["checksums"], peak_extra_bytes=report["peak_extra_bytes"],
                          peak_extra_bytes_accounted=report["peak_extra_bytes_accounted"],
                          payload_crc32=report["payload_crc32"], merge_rounding_error=rounding[0],
                          merge_update_error=rounding[1])
