"""The weight-sync process group: train rank 0 (rank 0 here) plus every rollout engine worker.

It is built without ``init_process_group`` so it can coexist with the trainers' own FSDP group and vLLM's internal
groups in the same processes: a ``TCPStore`` hosted by the sender, then a backend process group over it.
Backends: gloo (CPU), NCCL (GPU) — torch's ``ProcessGroupNCCL`` over the same store, chosen over vLLM's
``PyNcclCommunicator`` because it has timeouts — or ``"store"``: the TCPStore alone, the control channel of the
same-host IPC transports (``weight_sync.transport``).

Every wait has the group's ``timeout_s``: a member that dies or stalls turns a collective or store wait into an
error after at most that long (gloo raises at once when a peer's connection closes), never a hang. Each broadcast is
waited for with ``Work.wait(timeout)``: for gloo the collective's own timeout; for NCCL the CPU thread polls the
kernel's completion and, past the deadline, aborts the communicator and raises (torch's blocking wait). NCCL's
watchdog (the group's option timeout, set a little longer) is the backstop should that wait itself be stuck.
"""

from __future__ import annotations

import os
import random
import socket
from datetime import timedelta

import torch
from torch.distributed import BroadcastOptions, TCPStore

BACKENDS = ("gloo", "nccl", "store")

#: Extra seconds NCCL's watchdog allows beyond ``timeout_s``, so that the bounded wait (which raises in the caller)
#: fires first and the watchdog (which tears the process down) only when that wait cannot run.
NCCL_WATCHDOG_MARGIN_S = 30.0


#: Lowest port :func:`free_port` picks from: above Ray's worker ports (``--min/max-worker-port``, 10002-19999).
RENDEZVOUS_PORT_MIN = 20_000
#: Environment variable ``LOW-HIGH`` (inclusive, exclusive): the ports :func:`free_port` draws from instead, e.g. the
#: range a firewall opens between nodes, or one share of the range per process that draws concurrently.
PORT_RANGE_ENV = "GRPO_CLUSTER_RENDEZVOUS_PORTS"


def _port_span() -> tuple[int, int] | None:
    """[low, high) to draw from: :data:`PORT_RANGE_ENV`, else from :data:`RENDEZVOUS_PORT_MIN` up to the ephemeral
    range (None where that cannot be read or leaves fewer than 1000 ports).

    Raises:
        ValueError: :data:`PORT_RANGE_ENV` is set but not ``LOW-HIGH`` with 1 <= LOW < HIGH <= 65536.
    """
    text = os.environ.get(PORT_RANGE_ENV)
    if text:
        try:
            low, high = (int(x) for x in text.split("-"))
        except ValueError:
            low = high = 0
        if not 1 <= low < high <= 65536:
            raise ValueError(f"${PORT_RANGE_ENV}: expected LOW-HIGH with 1 <= LOW < HIGH <= 65536, got {text!r}")
        return low, high
    span = _ephemeral_port_range()
    if span is None or span[0] - RENDEZVOUS_PORT_MIN < 1000:
        return None
    return RENDEZVOUS_PORT_MIN, span[0]


def _ephemeral_port_range() -> tuple[int, int] | None:
    """The kernel's ephemeral port range (Linux ``ip_local_port_range``), or None where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, for a rendezvous (``TCPStore``) that binds it later.

    Where the kernel's ephemeral range can be read, the port is drawn at random from below it (from
    :data:`RENDEZVOUS_PORT_MIN`): ports handed out by ``bind(0)`` and by outgoing connections (a Ray node starting,
    gRPC, other processes) come from that range, so one of them cannot take the port between this check and the
    store's bind. Picking with ``bind(0)`` itself lost that race once (EADDRINUSE forming a weight-sync group while a
    new Ray node was starting). ``$GRPO_CLUSTER_RENDEZVOUS_PORTS`` (:data:`PORT_RANGE_ENV`) sets the range instead.
    Elsewhere, or when 64 draws are all taken, the kernel's ``bind(0)`` choice.

    Raises:
        ValueError: a malformed :data:`PORT_RANGE_ENV`.
    """
    span = _port_span()
    if span is not None:
        draw = random.SystemRandom()  # not the seeded global RNG: concurrent processes must not draw alike
        for _ in range(64):
            port = draw.randrange(*span)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports from :func:`free_port` (ports drawn one at a time can repeat, and a port used twice in a
    row can still be held by the first use's closing connection)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports


class SyncGroup:
    """A broadcast-only group of ``world_size`` ranks; rank 0 is the sender.

    Args:
        host, port: the TCPStore address (rank 0 hosts it).
        rank: this member's rank in ``[0, world_size)``.
        world_size: 1 sender + number of engine workers.
        timeout_s: every store wait and collective fails after this many seconds instead of hanging.
        backend: ``"gloo"``, ``"nccl"`` or ``"store"`` (no collective: ``broadcast`` raises; ``store`` only).
        device: NCCL only: this member's GPU (an index or ``torch.device``); None: the calling thread's current
            device. Pass it when building the group in another thread than the one that called
            ``torch.cuda.set_device`` (the current device is per thread).

    NCCL: the communicator is connected here with a one-element broadcast, so a member that never joins fails the
    constructor within ``timeout_s`` rather than the first sync.

    Raises:
        ValueError: a bad rank or backend.
        RuntimeError / DistStoreError / DistBackendError: a peer did not join within ``timeout_s``.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float, backend: str = "gloo",
                 device: torch.device | int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if backend not in BACKENDS:
            raise ValueError(f"sync backend must be one of {BACKENDS}, got {backend!r}")
        self.rank, self.world_size, self.backend, self.timeout_s = rank, world_size, backend, timeout_s
        self.timeout = timedelta(seconds=timeout_s)
        self.device = torch.device("cpu")
        self._pg = self.store = None
        self.store = TCPStore(host, port, world_size, is_master=(rank == 0), timeout=self.timeout,
                              wait_for_workers=False)
        if backend == "gloo":
            self._pg = torch.distributed.ProcessGroupGloo(self.store, rank, world_size, self.timeout)
        elif backend == "nccl":
            self.device = nccl_device(device)
            self._pg = _nccl_group(self.store, rank, world_size, self.timeout)
            with torch.cuda.device(self.device):
                self.broadcast(torch.zeros(1, device=self.device))

    def broadcast(self, tensor: torch.Tensor, async_op: bool = False):
        """Broadcast ``tensor`` in place from rank 0 (NCCL: ``tensor`` on this member's device). With ``async_op``
        returns a handle whose ``wait()`` blocks for at most ``timeout_s`` (:class:`BoundedWork`).

        Raises:
            RuntimeError: the group is closed or store-only; a peer closed its connection, or the broadcast did not
                complete within ``timeout_s`` (NCCL: the communicator is then aborted and the group closed).
        """
        if self._pg is None:
            raise RuntimeError(f"sync group (backend {self.backend!r}) has no broadcast: closed or store-only")
        opts = BroadcastOptions()
        opts.rootRank = 0
        work = BoundedWork(self._pg.broadcast([tensor], opts), self)
        if not async_op:
            work.wait()
        return work

    def close(self) -> None:
        """Drop the process group and the store (rank 0's store server stops when no reference is left). An NCCL
        communicator is aborted: a peer blocked in it fails instead of waiting for this member."""
        pg, self._pg, self.store = self._pg, None, None
        if pg is not None and self.backend == "nccl":
            try:
                pg.abort()
            except RuntimeError:
                pass


class BoundedWork:
    """A collective's work handle whose ``wait()`` gives up after the group's ``timeout_s``.

    ``Work.wait(timeout)`` blocks the calling thread until the collective completed (gloo: the transfer; NCCL: the
    kernel on the GPU, polled) or raises once ``timeout`` passed; the group is then closed (NCCL: aborted), since a
    timed-out communicator cannot be reused.
    """

    def __init__(self, work, group: SyncGroup):
        self.work, self.group = work, group

    def wait(self) -> bool:
        try:
            self.work.wait(self.group.timeout)
        except Exception as exc:
            self.group.close()
            raise RuntimeError(f"sync group rank {self.group.rank} ({self.group.backend}): broadcast failed or did "
                               f"not complete within {self.group.timeout_s:g} s: {exc}") from exc
        return True


def nccl_device(device: torch.device | int | None) -> torch.device:
    """The CUDA device an NCCL member uses: ``device`` as given, or the calling thread's current device."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"an NCCL sync group needs a CUDA device, got {device}")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _nccl_group(store, rank: int, world_size: int, timeout: timedelta):
    """torch's ``ProcessGroupNCCL`` over ``store`` (keys under ``sync-nccl/``), its watchdog timeout ``timeout`` +
    :data:`NCCL_WATCHDOG_MARGIN_S`."""
    from torch.distributed import PrefixStore, ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout + timedelta(seconds=NCCL_WATCHDOG_MARGIN_S)
    return ProcessGroupNCCL(PrefixStore("sync-nccl", store), rank, world_size, options)
