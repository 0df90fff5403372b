"""The trainer side of one sync: gather each tensor, pack it into its bucket, hand the bucket to the transport.

Every train rank runs :func:`stream_buckets` with the same plan: gathering a tensor from its FSDP2 shards
(``full_tensor()``) is a collective over the train group, so all ranks gather every tensor in plan order; only rank 0
(the one with a transport sender) packs and sends. Tensors are gathered one at a time and copied into the bucket
buffer at once, so the sender never holds more than its two bucket buffers plus one gathered tensor: about two
buckets of extra memory, never the whole model.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Collection, Sequence

import torch

from weight_sync.buckets import Bucket, bucket_checksums, dtype_name


class PeakMemory:
    """Measures the peak memory this process uses above its level at entry, in bytes.

    CUDA (``device.type == "cuda"``): ``torch.cuda.max_memory_allocated`` above ``memory_allocated`` at entry (the
    caching allocator's exact count). CPU: the resident set size (``/proc/self/statm``), sampled every
    ``interval_s`` by a thread, above its value at entry; 0 where ``/proc`` is missing. RSS also counts other threads'
    allocations and pages of shared memory touched for the first time, so it is an upper bound that can miss spikes
    shorter than the interval.
    """

    def __init__(self, device: torch.device, interval_s: float = 0.002):
        self.device, self.interval_s = device, interval_s
        self.peak_bytes = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        self._base = _rss_bytes()
        self._peak = self._base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="sync-rss-sampler", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, _rss_bytes())

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = max(0, torch.cuda.max_memory_allocated(self.device) - self._base)
            return
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, _rss_bytes())
        self.peak_bytes = max(0, self._peak - self._base)


def _rss_bytes() -> int:
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def stream_buckets(
    buckets: Sequence[Bucket],
    gather: Callable[[str], torch.Tensor],
    sender=None,
    check: Collection[str] = (),
    device: torch.device = torch.device("cpu"),
    digest: bool = False,
) -> dict:
    """Gather, pack and send every bucket of ``buckets`` (all train ranks call this together).

    Args:
        gather: ``name → tensor`` in the slot's shape and dtype (e.g. ``param.full_tensor().to(dtype)``); called for
            every tensor in plan order on every rank (a collective when sharded). Its result is dropped right after
            it is packed.
        sender: the transport sender (``weight_sync.transport``) on rank 0; None on the other ranks (gather only).
        check: tensor names to CRC-32 on the sender (the same names the receivers check).
        device: where the sender's buffers live (CUDA: checksums copy each checked bucket to the CPU).
        digest: also CRC-32 the bytes of every tensor sent, in plan order (meant for small payloads such as LoRA
            adapters: each bucket is read once more, on the CPU).

    Returns:
        ``{"bytes", "checksums": {name: crc32}, "payload_crc32", "peak_extra_bytes", "peak_extra_bytes_accounted",
        "seconds"}`` (``payload_crc32``: the digest on rank 0, else None):
        ``peak_extra_bytes`` measured by :class:`PeakMemory` over the whole sync, ``peak_extra_bytes_accounted`` the
        largest sum of live send buffers + one gathered tensor that the loop itself holds (a cast to another engine
        dtype, or a sharded gather's internal buffers, add about one more tensor).

    Raises:
        ValueError: a gathered tensor's shape or dtype differs from its slot.
        RuntimeError / DistStoreError: from the transport (a receiver died or stalled past the group's timeout).
    """
    t0 = time.perf_counter()
    check = set(check)
    checksums: dict[str, int] = {}
    payload: int | None = None
    total = accounted = 0
    with PeakMemory(device) as mem, torch.no_grad():
        if sender is not None:
            sender.begin(buckets)
        try:
            for bucket in buckets:
                buf = sender.buffer(bucket) if sender is not None else None
                direct = sender is not None and buf is None  # the sender takes this tensor's own bytes
                for slot in bucket.slots:
                    t = gather(slot.name)
                    if tuple(t.shape) != slot.shape or dtype_name(t.dtype) != slot.dtype:
                        raise ValueError(f"tensor {slot.name}: plan has shape {slot.shape} dtype {slot.dtype}, "
                                         f"gathered {tuple(t.shape)} {t.dtype}")
                    live = (sender.buffer_bytes if sender is not None else 0) + slot.nbytes
                    accounted = max(accounted, live)
                    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
                    if direct:
                        buf = flat
                    elif buf is not None and slot.nbytes:
                        buf[slot.offset : slot.offset + slot.nbytes].copy_(flat)
                    del t, flat
                if sender is None:
                    continue
                if check and any(s.name in check for s in bucket.slots):
                    checksums.update(bucket_checksums(bucket, buf.cpu(), only=check))
                if digest:  # the tensors' bytes only: alignment padding may hold an earlier bucket's bytes
                    host = buf.cpu()
                    for slot in bucket.slots:
                        payload = zlib.crc32(memoryview(host[slot.offset:slot.offset + slot.nbytes].numpy()),
                                             payload or 0)
                sender.send(bucket, buf)
                total += bucket.nbytes
            if sender is not None:
                sender.finish()
        except BaseException:
            if sender is not None:
                sender.abort()
            raise
    return {"bytes": total, "checksums": checksums, "payload_crc32": payload, "peak_extra_bytes": mem.peak_bytes,
            "peak_extra_bytes_accounted": accounted, "seconds": time.perf_counter() - t0}
