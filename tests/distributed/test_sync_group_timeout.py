"""Every weight-sync broadcast wait is bounded by the group's ``timeout_s`` (issue 12, section 3).

CPU: a gloo member that joined and then never takes part makes the sender's broadcast raise within the timeout and
closes the group; :class:`BoundedWork` hands the group's timeout to ``Work.wait`` (the call that, for NCCL, polls the
kernel and aborts the communicator past the deadline). The NCCL group itself is tested in ``tests/gpu``.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from weight_sync.group import BoundedWork, SyncGroup, free_port, nccl_device

HOST = "127.0.0.1"


def _pair(timeout_s: float) -> tuple[SyncGroup, SyncGroup]:
    port, holder = free_port(), {}
    joiner = threading.Thread(target=lambda: holder.setdefault("rx", SyncGroup(HOST, port, 1, 2, timeout_s)))
    joiner.start()
    sender = SyncGroup(HOST, port, 0, 2, timeout_s)
    joiner.join()
    return sender, holder["rx"]


def test_gloo_broadcast_to_a_silent_member_fails_within_the_timeout():
    sender, silent = _pair(timeout_s=2.0)
    try:
        t0 = time.monotonic()
        work = sender.broadcast(torch.ones(1024), async_op=True)
        with pytest.raises(RuntimeError, match=r"sync group rank 0 \(gloo\): broadcast failed or did not complete "
                                               r"within 2 s"):
            work.wait()
        elapsed = time.monotonic() - t0
        assert 1.5 < elapsed < 10.0, elapsed
        with pytest.raises(RuntimeError, match="closed or store-only"):
            sender.broadcast(torch.ones(4))
    finally:
        sender.close()
        silent.close()


def test_gloo_broadcast_completes_when_both_take_part():
    sender, receiver = _pair(timeout_s=10.0)
    try:
        got = torch.zeros(8)
        rx = threading.Thread(target=receiver.broadcast, args=(got,))
        rx.start()
        assert sender.broadcast(torch.arange(8.0), async_op=True).wait() is True
        rx.join(10)
        assert torch.equal(got, torch.arange(8.0))
    finally:
        sender.close()
        receiver.close()


class _Work:
    def __init__(self, error: Exception | None = None):
        self.error, self.timeouts = error, []

    def wait(self, timeout: timedelta) -> bool:
        self.timeouts.append(timeout)
        if self.error is not None:
            raise self.error
        return True


def test_bounded_work_waits_with_the_group_timeout_and_closes_on_failure():
    group = SyncGroup(HOST, free_port(), 0, 1, 3.5, backend="store")
    work = _Work()
    assert BoundedWork(work, group).wait() is True
    assert work.timeouts == [timedelta(seconds=3.5)] and group.store is not None
    failing = _Work(RuntimeError("Watchdog caught collective operation timeout"))
    with pytest.raises(RuntimeError, match=r"within 3.5 s: Watchdog caught collective operation timeout"):
        BoundedWork(failing, group).wait()
    assert failing.timeouts == [timedelta(seconds=3.5)] and group.store is None


def test_nccl_device_is_explicit():
    assert nccl_device(1) == torch.device("cuda", 1)
    assert nccl_device("cuda:3") == torch.device("cuda", 3)
    with pytest.raises(ValueError, match="needs a CUDA device, got cpu"):
        nccl_device("cpu")
