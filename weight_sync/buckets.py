"""Bucket plans: many named tensors packed into a few flat byte buffers for one broadcast each.

A plan is computed once from the trainer's parameter names/shapes/dtypes and sent to every receiver when the sync group
is formed; after that a sync is only a sequence of fixed-size byte buffers, so receivers need no per-step metadata.

Layout of one bucket (uint8 buffer of ``Bucket.nbytes``): tensors back to back in plan order, each starting at an offset
aligned to ``ALIGN_BYTES`` so that every slot can be viewed in its own dtype without a copy. A tensor larger than
``bucket_bytes`` gets a bucket of its own.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

ALIGN_BYTES = 64

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``"float32"``; raises ValueError for a dtype the wire format does not carry."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"weight sync cannot carry dtype {dtype}; supported: {sorted(_DTYPES)}")
    return name


def to_dtype(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}; supported: {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class TensorSlot:
    """Where one named tensor lives inside a bucket. ``offset``/``nbytes`` in bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Bucket:
    """One flat buffer of ``nbytes`` bytes holding ``slots`` back to back."""

    index: int
    nbytes: int
    slots: tuple[TensorSlot, ...]


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def plan_buckets(
    tensors: Iterable[tuple[str, Sequence[int], torch.dtype]], bucket_bytes: int
) -> list[Bucket]:
    """Group ``(name, shape, dtype)`` entries, in order, into buckets of at most ``bucket_bytes`` bytes.

    Order is preserved (sender and receivers walk the plan identically). A tensor larger than ``bucket_bytes`` is
    placed alone in a bucket of its own size. A zero-size tensor (a 0 in its shape) takes no bytes: it joins the
    bucket being filled at offset 0 and never closes or opens a bucket, so no bucket is empty of bytes, except that
    a plan whose tensors are all zero-size is one 0-byte bucket holding them (every name keeps a slot, and sender
    and receivers broadcast the same empty buffer). No tensors → no buckets.

    Raises:
        ValueError: ``bucket_bytes`` < 1, a duplicate name, a negative dimension, or an unsupported dtype.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[Bucket] = []
    slots: list[TensorSlot] = []
    used = 0
    seen: set[str] = set()

    def close() -> None:
        nonlocal slots, used
        if slots:
            buckets.append(Bucket(index=len(buckets), nbytes=used, slots=tuple(slots)))
        slots, used = [], 0

    for name, shape, dtype in tensors:
        if name in seen:
            raise ValueError(f"duplicate tensor name {name!r} in weight-sync plan")
        seen.add(name)
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"tensor {name!r}: expected every dimension >= 0, got shape {shape}")
        numel = 1
        for s in shape:
            numel *= s
        dtype_str = dtype_name(dtype)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            # offset 0 is aligned for every dtype, and an empty slice there is valid in any buffer
            slots.append(TensorSlot(name=name, shape=shape, dtype=dtype_str, offset=0, nbytes=0))
            continue
        start = _align(used)
        if used > 0 and start + nbytes > bucket_bytes:
            close()
            start = 0
        slots.append(TensorSlot(name=name, shape=shape, dtype=dtype_str, offset=start, nbytes=nbytes))
        used = start + nbytes
    close()
    return buckets


def pack_bucket(bucket: Bucket, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy ``tensors`` (one per slot, in slot order, already in the slot's dtype and shape) into a flat buffer.

    Args:
        out: optional reusable uint8 buffer with at least ``bucket.nbytes`` elements (double buffering).

    Returns:
        uint8 tensor of exactly ``bucket.nbytes`` bytes (a view of ``out`` when given).

    Raises:
        ValueError: count, shape or dtype of a tensor does not match its slot.
    """
    if len(tensors) != len(bucket.slots):
        raise ValueError(f"bucket {bucket.index}: expected {len(bucket.slots)} tensors, got {len(tensors)}")
    if out is None:
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
    else:
        if out.dtype != torch.uint8 or out.numel() < bucket.nbytes:
            raise ValueError(f"bucket {bucket.index}: buffer must be uint8 with >= {bucket.nbytes} bytes")
        buf = out[: bucket.nbytes]
    for slot, t in zip(bucket.slots, tensors):
        if tuple(t.shape) != slot.shape or dtype_name(t.dtype) != slot.dtype:
            raise ValueError(
                f"bucket {bucket.index}: tensor {slot.name} expected shape {slot.shape} dtype {slot.dtype}, "
                f"got {tuple(t.shape)} {t.dtype}"
            )
        buf[slot.offset : slot.offset + slot.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return buf


def unpack_bucket(bucket: Bucket, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of each slot of a received buffer as ``(name, tensor)`` in its dtype and shape (no copy)."""
    if buf.numel() < bucket.nbytes:
        raise ValueError(f"bucket {bucket.index}: buffer has {buf.numel()} bytes, plan needs {bucket.nbytes}")
    out = []
    for slot in bucket.slots:
        raw = buf[slot.offset : slot.offset + slot.nbytes]
        out.append((slot.name, raw.view(to_dtype(slot.dtype)).view(slot.shape)))
    return out


def tensor_checksum(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's raw bytes in its own dtype (C-contiguous order). Bit-exact: any changed bit changes it
    with probability 1 − 2⁻³²."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return zlib.crc32(memoryview(data))


def bucket_checksums(bucket: Bucket, buf: torch.Tensor, only: Collection[str] | None = None) -> dict[str, int]:
    """Per-tensor CRC-32 checksums of a packed bucket (a CPU uint8 buffer), keyed by tensor name.

    Args:
        only: check just these tensor names (others in the bucket are skipped); None checks all.
    """
    return {
        slot.name: zlib.crc32(memoryview(buf[slot.offset : slot.offset + slot.nbytes].numpy()))
        for slot in bucket.slots
        if only is None or slot.name in only
    }


def buckets_to_wire(buckets: Sequence[Bucket]) -> list[dict]:
    """Plain dicts/lists for transports that do not carry dataclasses (vLLM's ``collective_rpc`` serialiser)."""
    return [
        {"index": b.index, "nbytes": b.nbytes,
         "slots": [[s.name, list(s.shape), s.dtype, s.offset, s.nbytes] for s in b.slots]}
        for b in buckets
    ]


def buckets_from_wire(wire: Sequence[dict]) -> list[Bucket]:
    """Inverse of :func:`buckets_to_wire`."""
    return [
        Bucket(index=int(b["index"]), nbytes=int(b["nbytes"]),
               slots=tuple(TensorSlot(n, tuple(int(x) for x in shape), dt, int(off), int(nb))
                           for n, shape, dt, off, nb in b["slots"]))
        for b in wire
    ]
