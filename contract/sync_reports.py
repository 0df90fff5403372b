"""The reports of one weight sync (``policy version → every engine``), typed messages that cross a process boundary:
a train rank's :class:`SendReport`, an engine's :class:`ReceiveReport`, and the coordinator's verified
:class:`SyncReport` the loop reads (its ``sync/*`` metrics, the LoRA checks).

Plain frozen dataclasses (pickled by Ray as they are), like the rest of :mod:`contract.messages`; part of the
ground-floor ``contract`` package, which imports no other project package (``tests/unit/test_import_layering.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SendReport:
    """A train rank's side of one streamed sync (``broadcast_weights``); bytes, checksums and memory from rank 0.

    Attributes:
        policy_version: the version of the weights sent. seconds: wall seconds of the send.
        bytes: bytes streamed (engine dtype). checksums: CRC-32 per checked tensor name (rank 0; empty elsewhere).
        peak_extra_bytes: measured memory growth of the sender during the stream (``weight_sync.sender``).
        peak_extra_bytes_accounted: the buffers the sender held at its peak, counted from their sizes.
        payload_crc32: (``train.lora.sync: adapter``) CRC-32 of every byte streamed, buckets in plan order: the
            adapter payload's checksum, which must change from one policy version to the next after a non-zero
            update; None for full weights.
        merge_rounding_error: (``train.lora.sync: merged``) ‖cast(W + s·B·A) − W − s·B·A‖ / ‖s·B·A‖
            over every merged tensor: how far the merged weights the engines receive are from the trainer's
            policy, in units of the LoRA update (``train_workers.lora.MergeRounding``); None without a merge, or
            while the update is 0.
        merge_update_error: (``train.lora.sync: merged``) ‖cast(W + s·B·A) − cast(W) − s·B·A‖ /
            ‖s·B·A‖: the part of the update the engine dtype's rounding loses (≈ 1: the update vanished);
            None as above.
    """

    policy_version: int
    seconds: float
    bytes: int
    checksums: dict[str, int]
    peak_extra_bytes: int
    peak_extra_bytes_accounted: int
    payload_crc32: int | None = None
    merge_rounding_error: float | None = None
    merge_update_error: float | None = None


@dataclass(frozen=True)
class ReceiveReport:
    """An engine's side of one sync (``receive_weights``).

    Attributes:
        policy_version: the version the engine now serves. seconds: its first worker's wall seconds.
        bytes: bytes received by its first worker. worker_checksums: per engine worker (tensor-parallel shard
            owner), CRC-32 per checked tensor name of the bytes it received.
        worker_adapter_modules: (``train.lora.sync: adapter``) per engine worker, the base-model modules (HF names,
            packed layers such as ``qkv_proj`` counted as their parts) that the served adapter is bound to after the
            sync, read from the engine's own LoRA state (vLLM's LoRA manager; PEFT in the in-process fleet); None
            for full weights.
    """

    policy_version: int
    seconds: float
    bytes: int
    worker_checksums: list[dict[str, int]]
    worker_adapter_modules: list[list[str]] | None = None


@dataclass(frozen=True)
class SyncReport:
    """One verified sync of the policy to every engine (``cluster.ray_shell.sync.WeightSync.sync``).

    Attributes:
        policy_version: the version every engine of the group now holds.
        verified: every checked tensor matched on every engine worker (False when none was checked).
        verified_tensors: tensors checked per worker. bytes: bytes streamed. buckets: buckets per sync.
        seconds_sender: train rank 0's wall seconds. gb_per_s: bytes / slowest member's seconds / 1e9.
        sender_peak_extra_bytes, sender_peak_extra_bytes_accounted: train rank 0's memory (``SendReport``).
        engines: engines synced. ipc: the transport was an IPC one (``shm``/``cuda_ipc``) rather than a broadcast.
        adapter_modules: (``train.lora.sync: adapter``) the modules the adapter is bound to on every engine worker,
            checked equal to the trainer's targeted modules (``weight_sync.verify.check_adapter_binding``); None for
            full weights.
        adapter_checksum: (``train.lora.sync: adapter``) the adapter payload's CRC-32 (``SendReport.payload_crc32``),
            which the loop compares between versions; None for full weights.
        merge_rounding_error, merge_update_error: (``train.lora.sync: merged``) train rank 0's
            ``SendReport.merge_rounding_error`` and ``merge_update_error``.
    """

    policy_version: int
    verified: bool
    verified_tensors: int
    bytes: int
    buckets: int
    seconds_sender: float
    gb_per_s: float
    sender_peak_extra_bytes: int
    sender_peak_extra_bytes_accounted: int
    engines: int
    ipc: bool
    adapter_modules: int | None = None
    adapter_checksum: int | None = None
    merge_rounding_error: float | None = None
    merge_update_error: float | None = None

    def metrics(self) -> dict[str, float]:
        """The ``sync/*`` metrics of this sync (names as logged since the first release), plus with LoRA
        ``sync/adapter_modules`` (adapter sync) or ``sync/merge_rounding_error`` and ``sync/merge_update_error``
        (merged sync, once the update is non-zero)."""
        out = {"sync/verified": self.verified, "sync/verified_tensors": self.verified_tensors,
               "sync/bytes": float(self.bytes), "sync/buckets": self.buckets,
               "sync/seconds_sender": self.seconds_sender, "sync/gb_per_s": self.gb_per_s,
               "sync/sender_peak_extra_bytes": float(self.sender_peak_extra_bytes),
               "sync/sender_peak_extra_bytes_accounted": float(self.sender_peak_extra_bytes_accounted),
               "sync/engines": self.engines, "sync/ipc": float(self.ipc)}
        if self.adapter_modules is not None:
            out["sync/adapter_modules"] = float(self.adapter_modules)
        for key, value in (("merge_rounding_error", self.merge_rounding_error),
                           ("merge_update_error", self.merge_update_error)):
            if value is not None:
                out[f"sync/{key}"] = value
        return out
