"""How packed buckets travel from train rank 0 to the engine workers: a broadcast group, or same-host IPC.

Every transport moves the same flat ``uint8`` bucket buffers (``weight_sync.buckets``), so the bucket plan, the
checksums and the receivers' loading are identical whichever is used.

* ``broadcast``: one gloo (CPU) or NCCL (GPU) broadcast per bucket over a :class:`SyncGroup`, double-buffered: the
  sender packs bucket i+1 into the other of two buffers while bucket i is in flight. Every wait for a broadcast
  (sender and receivers) is bounded by the group's ``timeout_s`` (:class:`weight_sync.group.BoundedWork`). A tensor
  larger than the bucket size (alone in its bucket) is broadcast from its gathered copy without packing.
* ``shm`` (CPU ``ipc``): two shared-memory slots (files in ``/dev/shm`` mapped with ``torch.from_file``) of the
  largest bucket's size. The sender packs bucket i into slot i mod 2 and announces it through the group's TCPStore
  (key ``<tag>/<sync>/ready/<i>``); each receiver copies the slot into its own buffer and acknowledges
  (``<tag>/<sync>/ack/<i>/<rank>``; ``tag`` is unique per sender, so senders can share one store); the sender
  reuses a slot once every receiver acknowledged the bucket in it. The slots
  are unlinked from ``/dev/shm`` as soon as every receiver has mapped them, so nothing leaks if a process dies.
* ``cuda_ipc`` (GPU ``ipc``): the same protocol with two CUDA buffers on the sender's GPU shared through CUDA IPC
  handles (``torch.multiprocessing.reductions.reduce_tensor``), for a trainer and engine sharing one GPU, where
  NCCL cannot put two ranks. Not exercised on a GPU in this repository yet.

Receivers always return a buffer they own (the IPC receivers copy the slot), because vLLM's layerwise reload keeps
references to the loaded tensors until a layer is complete, which can be after later buckets arrived.

Every store wait uses the group's ``timeout_s``; a receiver that dies or stalls makes the sender's wait raise after at
most that long (and a gloo broadcast raises at once when a peer's connection closes).

Which one a job uses follows ``sync.mode`` and where the members run (:func:`choose_transport`).
"""

from __future__ import annotations

import os
import pickle
import uuid
import weakref
from collections.abc import Sequence

import torch

from weight_sync.buckets import Bucket
from weight_sync.group import SyncGroup

SHM_DIR = "/dev/shm"
TRANSPORTS = ("broadcast", "shm", "cuda_ipc")


def choose_transport(mode: str, on_gpu: bool, trainer_node: str | None, engine_nodes: list[str | None]) -> str:
    """The weight-sync transport for ``sync.mode``, given the Ray node ids of train rank 0 and of each engine.

    ``broadcast`` → ``"broadcast"``. ``ipc`` → ``"cuda_ipc"`` (GPU engines) or ``"shm"`` (CPU), which only work
    within one host: refused when an engine is on another Ray node. ``auto`` → the IPC transport when every engine
    reports train rank 0's node id, else ``"broadcast"`` (an unknown node id counts as another node). Node ids, not
    IP addresses, decide: several Ray nodes can share one IP (containers, a simulated cluster) without sharing
    ``/dev/shm`` or a GPU.

    Raises:
        ValueError: ``mode`` is ``ipc`` and an engine is not on train rank 0's node (names the engines and nodes).
    """
    if mode == "broadcast":
        return "broadcast"
    ipc = "cuda_ipc" if on_gpu else "shm"
    away = [i for i, node in enumerate(engine_nodes) if trainer_node is None or node != trainer_node]
    if mode == "auto":
        return "broadcast" if away else ipc
    if away:
        where = ", ".join(f"engine {i} on node {str(engine_nodes[i])[:8]}" for i in away)
        raise ValueError(f"sync.mode=ipc needs every engine on train rank 0's Ray node {str(trainer_node)[:8]}, but "
                         f"{where}; use sync.mode 'broadcast' or 'auto' across nodes")
    return ipc


# ------------------------------------------------------------------------------------------------------------ senders
class BroadcastSender:
    """Double-buffered broadcast from rank 0. Buffers (2 × the largest bucket) exist only during a sync."""

    kind = "broadcast"

    def __init__(self, group: SyncGroup, device: torch.device):
        self.group, self.device = group, device
        self._slots: list[torch.Tensor] | None = None
        self._pending = None

    def descriptor(self) -> dict:
        return {"kind": self.kind}

    @property
    def buffer_bytes(self) -> int:
        """Bytes of send buffers currently allocated."""
        return sum(s.numel() for s in self._slots) if self._slots else 0

    def begin(self, buckets: Sequence[Bucket]) -> None:
        # Buffers for the buckets that need packing; a one-tensor bucket larger than those (a tensor above
        # ``bucket_bytes``, e.g. an embedding) is broadcast straight from the gathered tensor (``buffer`` → None).
        self._capacity = max((b.nbytes for b in buckets if len(b.slots) > 1), default=0)
        self._slots = [torch.empty(self._capacity, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self._pending = self._in_flight = None

    def buffer(self, bucket: Bucket) -> torch.Tensor | None:
        if len(bucket.slots) == 1 and bucket.nbytes > self._capacity:
            return None
        # Slot i mod 2 last carried bucket i − 2, whose broadcast finished before bucket i − 1's began (``send``).
        return self._slots[bucket.index % 2][: bucket.nbytes]

    def send(self, bucket: Bucket, buf: torch.Tensor) -> None:
        if self._pending is not None:
            self._pending.wait()
        self._pending = self.group.broadcast(buf, async_op=True)
        self._in_flight = buf  # a directly sent tensor must outlive its broadcast

    def finish(self) -> None:
        try:
            if self._pending is not None:
                self._pending.wait()
        finally:
            self._pending = self._slots = self._in_flight = None

    def abort(self) -> None:
        """Forget a failed sync's buffers without waiting for its last broadcast."""
        self._slots = self._pending = self._in_flight = None

    def close(self) -> None:
        self.abort()
        self.group.close()


class _StoreSlotSender:
    """Two fixed slots announced and acknowledged through the group's TCPStore (base of the IPC senders)."""

    kind = ""

    def __init__(self, group: SyncGroup, slot_bytes: int):
        self.group, self.slot_bytes = group, slot_bytes
        self.receivers = list(range(1, group.world_size))
        self.tag = uuid.uuid4().hex[:12]  # namespaces this sender's store keys
        self._sync = 0
        self._sent: list[int] = []
        self._slots: list[torch.Tensor] = []

    @property
    def buffer_bytes(self) -> int:
        return sum(s.numel() for s in self._slots)

    def begin(self, buckets: Sequence[Bucket]) -> None:
        if max((b.nbytes for b in buckets), default=0) > self.slot_bytes:
            raise ValueError(f"a bucket is larger than the {self.slot_bytes}-byte IPC slots (plan changed?)")
        self._sync += 1
        self._sent = []

    def _wait_acks(self, index: int) -> None:
        self.group.store.wait([f"{self.tag}/{self._sync}/ack/{index}/{r}" for r in self.receivers])

    def buffer(self, bucket: Bucket) -> torch.Tensor:
        if bucket.index >= 2:
            self._wait_acks(bucket.index - 2)
        return self._slots[bucket.index % 2][: bucket.nbytes]

    def _ready(self) -> None:
        """Make the slot's bytes visible to the receivers before announcing them (CUDA: finish the packing)."""

    def send(self, bucket: Bucket, buf: torch.Tensor) -> None:
        self._ready()
        self.group.store.set(f"{self.tag}/{self._sync}/ready/{bucket.index}", "1")
        self._sent.append(bucket.index)

    def finish(self) -> None:
        for index in self._sent[-2:]:
            self._wait_acks(index)

    def abort(self) -> None:
        """A failed sync: the receivers may still hold slots, so the group must be rebuilt before the next."""
        self._sent = []

    def close(self) -> None:
        self._slots = []
        self.group.close()


class ShmSender(_StoreSlotSender):
    """Two shared-memory slots in ``/dev/shm`` (CPU ``ipc``); they persist while the group lives."""

    kind = "shm"

    def __init__(self, group: SyncGroup, slot_bytes: int, directory: str = SHM_DIR):
        super().__init__(group, slot_bytes)
        self.paths = [os.path.join(directory, f"grpo-sync-{os.getpid()}-{self.tag}-{i}") for i in range(2)]
        self._slots = [torch.from_file(p, shared=True, size=max(slot_bytes, 1), dtype=torch.uint8)
                       for p in self.paths]
        self._unlinked = False
        self._finalizer = weakref.finalize(self, _unlink, list(self.paths))

    def descriptor(self) -> dict:
        return {"kind": self.kind, "paths": list(self.paths), "slot_bytes": self.slot_bytes, "tag": self.tag}

    def begin(self, buckets: Sequence[Bucket]) -> None:
        if not self._unlinked:  # every receiver has mapped the slots: their names are no longer needed
            self.group.store.wait([f"{self.tag}/mapped/{r}" for r in self.receivers])
            self._finalizer()
            self._unlinked = True
        super().begin(buckets)

    def close(self) -> None:
        self._finalizer()
        super().close()


class CudaIpcSender(_StoreSlotSender):
    """Two buffers on the sender's GPU shared through CUDA IPC handles (GPU ``ipc``)."""

    kind = "cuda_ipc"

    def __init__(self, group: SyncGroup, slot_bytes: int, device: torch.device):
        super().__init__(group, slot_bytes)
        self._slots = [torch.empty(max(slot_bytes, 1), dtype=torch.uint8, device=device) for _ in range(2)]

    def descriptor(self) -> dict:
        from torch.multiprocessing.reductions import reduce_tensor

        # pickled: vLLM's collective_rpc serialiser carries bytes, not the rebuild function inside a handle
        handles = [pickle.dumps(reduce_tensor(s)) for s in self._slots]
        return {"kind": self.kind, "handles": handles, "slot_bytes": self.slot_bytes, "tag": self.tag}

    def _ready(self) -> None:
        torch.cuda.current_stream().synchronize()


def _unlink(paths: list[str]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def make_sender(kind: str, group: SyncGroup, device: torch.device, slot_bytes: int):
    """The sender side of transport ``kind`` (``broadcast``, ``shm`` or ``cuda_ipc``) over ``group``."""
    if kind == "broadcast":
        return BroadcastSender(group, device)
    if kind == "shm":
        return ShmSender(group, slot_bytes)
    if kind == "cuda_ipc":
        return CudaIpcSender(group, slot_bytes, device)
    raise ValueError(f"transport must be one of {TRANSPORTS}, got {kind!r}")


# ---------------------------------------------------------------------------------------------------------- receivers
class BroadcastReceiver:
    """Receives each bucket into a fresh buffer on ``device``."""

    def __init__(self, group: SyncGroup, device: torch.device):
        self.group, self.device = group, device

    def begin(self) -> None:
        pass

    def receive(self, bucket: Bucket) -> torch.Tensor:
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
        self.group.broadcast(buf)
        return buf

    def close(self) -> None:
        self.group.close()


class _StoreSlotReceiver:
    def __init__(self, group: SyncGroup, slots: list[torch.Tensor], tag: str):
        self.group, self._slots, self.tag = group, slots, tag
        self._sync = 0

    def begin(self) -> None:
        self._sync += 1

    def receive(self, bucket: Bucket) -> torch.Tensor:
        self.group.store.wait([f"{self.tag}/{self._sync}/ready/{bucket.index}"])
        buf = self._slots[bucket.index % 2][: bucket.nbytes].clone()
        if buf.is_cuda:
            torch.cuda.current_stream().synchronize()
        self.group.store.set(f"{self.tag}/{self._sync}/ack/{bucket.index}/{self.group.rank}", "1")
        return buf

    def close(self) -> None:
        self._slots = []
        self.group.close()


class ShmReceiver(_StoreSlotReceiver):
    """Maps the sender's ``/dev/shm`` slots (same host only), then tells the sender through the store."""

    def __init__(self, group: SyncGroup, descriptor: dict):
        n = max(int(descriptor["slot_bytes"]), 1)
        try:
            slots = [torch.from_file(p, shared=True, size=n, dtype=torch.uint8) for p in descriptor["paths"]]
        except (RuntimeError, OSError) as exc:
            raise RuntimeError(f"cannot map the sender's shared-memory slots {descriptor['paths']} (is this engine "
                               f"on the trainer's host? use sync.mode 'broadcast' otherwise): {exc}") from exc
        super().__init__(group, slots, descriptor["tag"])
        group.store.set(f"{self.tag}/mapped/{group.rank}", "1")


class CudaIpcReceiver(_StoreSlotReceiver):
    """Opens the sender's CUDA buffers from their IPC handles on this process's current device."""

    def __init__(self, group: SyncGroup, descriptor: dict):
        slots = []
        for handle in descriptor["handles"]:
            rebuild, args = pickle.loads(handle)
            args = list(args)
            args[6] = torch.cuda.current_device()  # the device index as this process numbers it (vLLM RLHF recipe)
            slots.append(rebuild(*args))
        super().__init__(group, slots, descriptor["tag"])


def make_receiver(descriptor: dict, group: SyncGroup, device: torch.device):
    """The receiver side for the sender's ``descriptor()``."""
    kind = descriptor.get("kind")
    if kind == "broadcast":
        return BroadcastReceiver(group, device)
    if kind == "shm":
        return ShmReceiver(group, descriptor)
    if kind == "cuda_ipc":
        return CudaIpcReceiver(group, descriptor)
    raise ValueError(f"transport must be one of {TRANSPORTS}, got {kind!r}")


def backend_for(kind: str, on_gpu: bool) -> str:
    """The :class:`SyncGroup` backend a transport needs: a collective group for broadcast, the store otherwise."""
    if kind == "broadcast":
        return "nccl" if on_gpu else "gloo"
    return "store"
