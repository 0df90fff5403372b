"""Device-check section for the same-host weight-sync transport: ``weight_sync.transport``'s CUDA-IPC sender in this
process, its receiver in a spawned process (as a trainer and a colocated engine worker), CRC-32 of every tensor
compared on both sides, then a second, unverified sync timed for throughput. ``--dry-run`` runs the same protocol
over the shared-memory (``shm``) transport on CPU.
"""

from __future__ import annotations

import time

import torch

from bench.gpu_check import Context, Result, verdict

HOST = "127.0.0.1"


def _receiver(port: int, descriptor: dict, wire: list, verify: list[bool], device: str, queue) -> None:
    """Spawned engine side: join the store group, receive every bucket per sync, CRC-check the first sync."""
    from weight_sync.buckets import bucket_checksums, buckets_from_wire
    from weight_sync.group import SyncGroup
    from weight_sync.transport import make_receiver

    try:
        if device == "cuda":
            torch.cuda.set_device(0)
        rx = make_receiver(descriptor, SyncGroup(HOST, port, 1, 2, 60, backend="store"), torch.device(device))
        checksums: dict[str, int] = {}
        on_device = True
        for check in verify:
            rx.begin()
            for bucket in buckets_from_wire(wire):
                buf = rx.receive(bucket)
                on_device &= buf.device.type == device
                if check:
                    checksums.update(bucket_checksums(bucket, buf.cpu()))
        rx.close()
        queue.put({"checksums": checksums, "on_device": on_device})
    except Exception as exc:  # noqa: BLE001 - reported to the section
        queue.put({"error": f"{type(exc).__name__}: {exc}"})


def section_cuda_ipc(ctx: Context) -> Result:
    """Two syncs of a model-sized set of tensors through CUDA IPC (``shm`` in the dry run) to another process."""
    import queue as queue_mod

    import torch.multiprocessing as mp

    from weight_sync.buckets import buckets_to_wire, plan_buckets
    from weight_sync.group import SyncGroup, free_port
    from weight_sync.sender import stream_buckets
    from weight_sync.transport import make_sender

    kind = "shm" if ctx.dry_run else "cuda_ipc"
    device = torch.device("cpu") if ctx.dry_run else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    # GPU: 32 × 16 MiB bf16 tensors (512 MiB) in 64 MiB buckets; dry run: 8 small float32 tensors + one bf16
    count, numel, bucket_bytes = (8, 4096, 40 * 1024) if ctx.dry_run else (32, 8 << 20, 64 << 20)
    dtype = torch.float32 if ctx.dry_run else torch.bfloat16
    tensors = {f"layers.{i}.w": torch.randn(numel + i, generator=gen, device=device).to(dtype) for i in range(count)}
    tensors["norm"] = torch.randn(1000, generator=gen, device=device).to(torch.bfloat16)
    plan = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], bucket_bytes)
    port = free_port(HOST)
    sender = make_sender(kind, SyncGroup(HOST, port, 0, 2, 60, backend="store"), device,
                         max(b.nbytes for b in plan))
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    proc = spawn.Process(target=_receiver, args=(port, sender.descriptor(), buckets_to_wire(plan), [True, False],
                                                 device.type, results))
    proc.start()
    try:
        first = stream_buckets(plan, tensors.__getitem__, sender, check=list(tensors), device=device)
        t0 = time.perf_counter()
        second = stream_buckets(plan, tensors.__getitem__, sender, check=(), device=device)
        sync_s = time.perf_counter() - t0
        try:
            received = results.get(timeout=60)
        except queue_mod.Empty:
            received = {"error": "receiver sent nothing within 60 s"}
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        sender.close()
    numbers = {"transport": kind, "tensors": len(tensors), "buckets": len(plan), "bytes": second["bytes"],
               "sync_s": round(sync_s, 4), "gb_per_s": round(second["bytes"] / sync_s / 1e9, 2),
               "first_sync_s": round(first["seconds"], 4), "receiver_exit_code": proc.exitcode}
    if "error" in received:
        return Result("FAIL", f"receiver: {received['error']}", numbers)
    failures = []
    if received["checksums"] != first["checksums"] or len(received["checksums"]) != len(tensors):
        bad = sorted(n for n in tensors if received["checksums"].get(n) != first["checksums"].get(n))
        failures.append(f"CRC-32 differs for {len(bad)} of {len(tensors)} tensors, e.g. {bad[:3]}")
    if not received["on_device"]:
        failures.append(f"receiver buffers not on {device.type}")
    if proc.exitcode != 0:
        failures.append(f"receiver exit code {proc.exitcode}")
    numbers["crc_checked_tensors"] = len(received["checksums"])
    return verdict(failures, numbers, f"{kind}: every tensor arrived with the sender's CRC-32")
