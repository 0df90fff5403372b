"""The NCCL weight-sync group bounds every broadcast (issue 12, section 3). Skipped without CUDA (conftest).

Two members on two GPUs (NCCL cannot put two ranks of one communicator on one GPU), each built in its own thread with
its device passed explicitly: a broadcast both take part in arrives; then the receiver stays silent and the sender's
broadcast raises within ``timeout_s`` (torch's blocking ``Work.wait(timeout)`` aborts the communicator) — no hang.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from weight_sync.group import SyncGroup, free_port

pytestmark = pytest.mark.gpu

TIMEOUT_S = 5.0


def test_nccl_broadcast_is_bounded():
    if torch.cuda.device_count() < 2:
        pytest.skip("an NCCL group of two members needs two GPUs")
    port, holder = free_port(), {}
    joiner = threading.Thread(target=lambda: holder.setdefault(
        "rx", SyncGroup("127.0.0.1", port, 1, 2, TIMEOUT_S, "nccl", device=1)))
    joiner.start()
    sender = SyncGroup("127.0.0.1", port, 0, 2, TIMEOUT_S, "nccl", device=0)
    joiner.join()
    receiver = holder["rx"]
    assert (sender.device, receiver.device) == (torch.device("cuda", 0), torch.device("cuda", 1))

    got = torch.zeros(1024, device="cuda:1")
    rx = threading.Thread(target=receiver.broadcast, args=(got,))
    rx.start()
    sender.broadcast(torch.arange(1024.0, device="cuda:0"))
    rx.join(30)
    assert torch.equal(got.cpu(), torch.arange(1024.0))

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="did not complete within"):
        sender.broadcast(torch.ones(1 << 24, device="cuda:0"))  # 64 MiB: more than NCCL buffers
    assert time.monotonic() - t0 < TIMEOUT_S + 20
    receiver.close()
