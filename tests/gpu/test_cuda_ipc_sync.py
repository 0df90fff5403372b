"""The colocated GPU path: a trainer process sends buckets through CUDA IPC handles to a receiver process on the
same GPU (where NCCL cannot put two ranks), with the same checksums as every other transport. Skipped without CUDA
(conftest); not yet run on a GPU in this repository."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
HOST = "127.0.0.1"


def _receiver(port: int, descriptor: dict, plan_wire: list, queue) -> None:
    from weight_sync.buckets import bucket_checksums, buckets_from_wire
    from weight_sync.group import SyncGroup
    from weight_sync.transport import make_receiver

    torch.cuda.set_device(0)
    rx = make_receiver(descriptor, SyncGroup(HOST, port, 1, 2, 120, backend="store"), torch.device("cuda"))
    checksums: dict[str, int] = {}
    for _ in range(2):
        rx.begin()
        for bucket in buckets_from_wire(plan_wire):
            buf = rx.receive(bucket)
            assert buf.is_cuda
            checksums.update(bucket_checksums(bucket, buf.cpu()))
    queue.put(checksums)


def test_cuda_ipc_delivers_the_checksummed_bytes():
    import torch.multiprocessing as mp

    from weight_sync.buckets import buckets_to_wire, plan_buckets
    from weight_sync.group import SyncGroup, free_port
    from weight_sync.sender import stream_buckets
    from weight_sync.transport import make_sender

    device = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": torch.randn(300 + i, 64, generator=g).to(device) for i in range(8)}
    tensors["half"] = torch.randn(1000, generator=g).to(torch.bfloat16).to(device)
    plan = plan_buckets([(n, t.shape, t.dtype) for n, t in tensors.items()], 200 * 1024)
    port = free_port(HOST)
    sender = make_sender("cuda_ipc", SyncGroup(HOST, port, 0, 2, 120, backend="store"), device,
                         max(b.nbytes for b in plan))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, sender.descriptor(), buckets_to_wire(plan), queue))
    proc.start()
    for _ in range(2):
        report = stream_buckets(plan, tensors.__getitem__, sender, check=list(tensors), device=device)
    received = queue.get(timeout=180)
    proc.join(60)
    sender.close()
    assert proc.exitcode == 0
    assert received == report["checksums"] and len(received) == len(tensors)
