"""Driver-side weight sync: forms the group (train rank 0 + every engine worker), runs one verified sync per policy
version, tracks which version every engine holds, and rebuilds the group when the engine list changes.

Life cycle (the rollout pool owns the engine actors; this class only syncs them)::

    sync = WeightSync(spec, train_pool, rollout_pool)   # plan once, form the group with rollout_pool.engines
    sync.sync(v)                                        # after every optimizer step: all engines → version v
    ... pool adds / removes / replaces engine actors in rollout_pool.engines ...
    sync.rebuild()                                      # tear the old group down, form one with the current engines
    sync.ensure_current(v)                              # new engines (version unknown) get v before they serve

A member that dies or stalls during a sync or while the group forms raises :class:`SyncMemberError` naming it
within ``sync.timeout_s`` (the group's own collectives and store waits have the same timeout, so no actor is left
blocked for longer). After a failed sync every engine's version is unknown and the group is marked broken: the next
``sync`` rebuilds it first (with ``rollout.engines`` as it is then).

Transports (``sync.mode``): ``broadcast`` (gloo on CPU, NCCL on GPU), ``ipc`` (shared memory on CPU, CUDA IPC on
GPU; every engine must be on train rank 0's Ray node, else the group is refused), ``auto`` (ipc when every engine is on
rank 0's Ray node, else broadcast); see :func:`choose_transport`.
"""

from __future__ import annotations

import time

import ray

from weight_sync.verify import checked_names


class SyncVerificationError(RuntimeError):
    """An engine's received weights differ from what the trainer sent."""


class SyncMemberError(RuntimeError):
    """A member of the weight-sync group died, failed or did not finish within ``sync.timeout_s``.

    Attributes:
        engine_indices: indices (into the synced engine list) of the engines at fault: those that died, else those
            that failed, else (a stall) every engine that had not finished. Empty when only the trainer failed.
    """

    def __init__(self, message: str, engine_indices: list[int]):
        super().__init__(message)
        self.engine_indices = engine_indices


def _pools_get(refs, timeout_s: float, what: str):
    from cluster.loop.pools import get  # late: cluster.loop.pools re-exports this module

    return get(refs, timeout_s, what)


def wait_members(refs: list, names: list[str], timeout_s: float, what: str, grace_s: float = 5.0) -> list:
    """Results of ``refs`` (one per member, named by ``names``), or :class:`SyncMemberError` within ``timeout_s``.

    On the first failure it waits up to ``grace_s`` more for the other members to fail too, then blames, in order:
    members whose actor died (``RayActorError``), members whose call raised, or, when the deadline passes, every
    member that has not finished. Engine members are named ``"engine <i> ..."``; their indices go into the error.
    """
    deadline = time.monotonic() + timeout_s
    index = {ref: i for i, ref in enumerate(refs)}
    results: list = [None] * len(refs)
    pending = list(refs)
    died: dict[int, BaseException] = {}
    failed: dict[int, BaseException] = {}

    def collect(ready) -> None:
        for ref in ready:
            pending.remove(ref)
            i = index[ref]
            try:
                results[i] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                died[i] = exc
            except ray.exceptions.RayTaskError as exc:
                failed[i] = exc

    while pending:
        ready, _ = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        collect(ready)
        if died or failed:
            grace = min(grace_s, max(0.0, deadline - time.monotonic()))
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=grace)
            collect(ready)
            break
    if not (died or failed or pending):
        return results

    def engines_of(ids) -> list[int]:
        return [int(names[i].split()[1]) for i in ids if names[i].startswith("engine ")]

    if died:
        blame, how = sorted(died), "died"
    elif failed:
        blame, how = sorted(failed), "failed"
    else:
        blame, how = sorted(index[r] for r in pending), f"did not finish within {timeout_s:g} s"
    details = "; ".join(f"{names[i]}: {_short(died.get(i) or failed.get(i))}" for i in blame if i in died or i in
                        failed)
    message = f"{what}: {', '.join(names[i] for i in blame)} {how}" + (f" ({details})" if details else "")
    cause = next((e for e in list(died.values()) + list(failed.values())), None)
    raise SyncMemberError(message, engines_of(blame)) from cause


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


def _short(exc: BaseException | None, limit: int = 300) -> str:
    if exc is None:
        return ""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + " ..."


class WeightSync:
    """The weight-sync group (train rank 0 + every engine worker) and one verified sync per policy version.

    Args:
        spec: the job spec (``sync``, ``model.dtype``, ``rollout.tensor_parallel_size``/``num_gpus_per_replica``).
        train: the train pool (``workers``, ``sync_plan``); rank 0 sends.
        rollout: the rollout pool; its ``engines`` list is read when the group is (re)built.

    Attributes:
        engines: the engine actors of the current group, in group order.
        engine_versions: the policy version each of them holds (None: unknown, i.e. new or after a failed sync).
        transport: ``broadcast``, ``shm`` or ``cuda_ipc`` (``sync.mode`` resolved).

    Raises:
        SyncMemberError: a member died or stalled while the group formed.
    """

    def __init__(self, spec, train, rollout):
        self.spec, self.train, self.rollout = spec, train, rollout
        s = spec.sync
        buckets = train.sync_plan(spec.model.dtype, s.bucket_bytes)
        self.buckets = buckets
        self.names = [slot.name for b in buckets for slot in b.slots]
        self.num_buckets = len(buckets)
        self.bytes_per_sync = sum(b.nbytes for b in buckets)
        self.engines: list = []
        self.engine_versions: list[int | None] = []
        self.transport: str | None = None
        self._broken = False
        self.rebuild()

    # ---- membership ---------------------------------------------------------------------------------------------
    def rebuild(self, engines: list | None = None) -> None:
        """Tear the current group down on its live members and form a new one with ``engines`` (default: the
        rollout pool's current ``engines``). Engines that stay keep their recorded version; new ones are unknown
        until the next :meth:`sync` (or :meth:`ensure_current`) brings them to the current policy.

        Raises:
            SyncMemberError: a member died or did not join within ``sync.timeout_s``.
        """
        s = self.spec.sync
        engines = list(self.rollout.engines if engines is None else engines)
        known = {id(e): v for e, v in zip(self.engines, self.engine_versions)}
        self._teardown()
        self._broken = True
        self.transport = self._resolve_transport(engines)
        host, port = _pools_get(self.train.workers[0].node_address.remote(), s.timeout_s, "train rank 0 address")
        tp = self.spec.rollout.tensor_parallel_size
        world = 1 + len(engines) * tp
        backend = "nccl" if self.spec.rollout.num_gpus_per_replica > 0 else "gloo"
        names = ["train rank 0"] + [f"engine {i}" for i in range(len(engines))]
        trainer = self.train.workers[0].init_sync_group.remote(host, port, world, s.timeout_s, self.transport)
        what = f"forming the weight-sync group ({self.transport}, {len(engines)} engines)"
        if self.transport == "broadcast":  # rank 0's group forms only once every engine joins: call them together
            refs = [trainer] + [e.init_weight_sync.remote(host, port, 1 + i * tp, world, self.buckets, s.timeout_s,
                                                         backend, None) for i, e in enumerate(engines)]
            wait_members(refs, names, s.timeout_s, what)
        else:  # rank 0 creates the slots first; the engines join with their descriptor
            channel = wait_members([trainer], names[:1], s.timeout_s, what)[0]
            refs = [e.init_weight_sync.remote(host, port, 1 + i * tp, world, self.buckets, s.timeout_s, backend,
                                              channel) for i, e in enumerate(engines)]
            wait_members(refs, names[1:], s.timeout_s, what)
        self.engines = engines
        self.engine_versions = [known.get(id(e)) for e in engines]
        self._broken = False

    def _teardown(self) -> None:
        """Close the current group on every member still alive (dead or stuck ones are skipped after the timeout)."""
        if not self.engines and self.transport is None:
            return
        refs = [self.train.workers[0].close_sync_group.remote()] + [e.close_weight_sync.remote() for e in self.engines]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.spec.sync.timeout_s)
        for ref in ready:
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
                pass  # a dead member has nothing to close; a failed close leaves nothing the new group uses

    def _resolve_transport(self, engines: list) -> str:
        """``sync.mode`` → ``broadcast``, ``shm`` or ``cuda_ipc`` (:func:`choose_transport`), from the Ray node ids
        that train rank 0 and every engine report about themselves now."""
        s = self.spec.sync
        if s.mode == "broadcast":
            return "broadcast"
        node = _pools_get(self.train.workers[0].sync_node_id.remote(), s.timeout_s, "train rank 0 node id")
        infos = wait_members([e.ready.remote() for e in engines], [f"engine {i}" for i in range(len(engines))],
                             s.timeout_s, "reading the engines' Ray nodes")
        return choose_transport(s.mode, self.spec.rollout.num_gpus_per_replica > 0, node,
                                [info.get("node_id") for info in infos])

    def close(self) -> None:
        """Tear the group down on every live member."""
        self._teardown()
        self.engines, self.engine_versions, self.transport = [], [], None

    # ---- syncing ------------------------------------------------------------------------------------------------
    def stale_engines(self, policy_version: int) -> list[int]:
        """Indices of engines that do not hold ``policy_version`` (new, or after a failed sync)."""
        return [i for i, v in enumerate(self.engine_versions) if v != policy_version]

    def ensure_current(self, policy_version: int) -> dict | None:
        """Sync when any engine of the group (e.g. a replacement) does not hold ``policy_version``; returns the
        sync's metrics, or None when every engine already does. The trainer must be at ``policy_version``."""
        if not self._broken and not self.stale_engines(policy_version):
            return None
        return self.sync(policy_version)

    def sync(self, policy_version: int) -> dict:
        """Stream the current policy to every engine; checksum the tensors ``sync.verify`` selects.

        Returns:
            metrics: ``sync/verified`` (every checked tensor matched on every engine worker),
            ``sync/verified_tensors`` (tensors checked per worker), ``sync/bytes``, ``sync/buckets``,
            ``sync/seconds_sender``, ``sync/gb_per_s`` (bytes / slowest member's seconds, 1 GB = 1e9 B),
            ``sync/sender_peak_extra_bytes`` (measured on train rank 0, see ``weight_sync.sender``),
            ``sync/sender_peak_extra_bytes_accounted``, ``sync/engines``, ``sync/ipc`` (1.0 on an IPC transport).

        Raises:
            SyncMemberError: an engine or the trainer died, failed or stalled (names it; within ``sync.timeout_s``).
            SyncVerificationError: a tensor's checksum on an engine differs from the trainer's (names both).
            RuntimeError: the trainer is not at ``policy_version``.
        """
        s = self.spec.sync
        if self._broken:
            self.rebuild()
        check = checked_names(self.names, policy_version, s.verify, s.verify_full_every)
        check_arg = True if len(check) == len(self.names) else check
        names = [f"train rank {r}" for r in range(len(self.train.workers))]
        names += [f"engine {i}" for i in range(len(self.engines))]
        send = [w.broadcast_weights.remote(check_arg) for w in self.train.workers]
        recv = [e.receive_weights.remote(policy_version, check_arg) for e in self.engines]
        try:
            results = wait_members(send + recv, names, s.timeout_s, f"weight sync to policy version {policy_version}")
        except SyncMemberError:
            self._broken = True
            self.engine_versions = [None] * len(self.engines)
            raise
        sent, received = results[0], results[len(send):]
        if sent.policy_version != policy_version:
            raise RuntimeError(f"trainer is at policy version {sent.policy_version}, expected {policy_version}")
        self.engine_versions = [r["policy_version"] for r in received]
        if check:
            expected = {name: sent.checksums[name] for name in check}
            for i, report in enumerate(received):
                for w, checksums in enumerate(report["worker_checksums"]):
                    _compare_checksums(expected, checksums, f"engine {i} worker {w}")
        seconds = max([r.seconds for r in results[:len(send)]] + [r["seconds"] for r in received])
        return {"sync/verified": bool(check),
                "sync/verified_tensors": len(check), "sync/bytes": float(sent.bytes),
                "sync/buckets": self.num_buckets, "sync/seconds_sender": sent.seconds,
                "sync/gb_per_s": sent.bytes / max(seconds, 1e-9) / 1e9,
                "sync/sender_peak_extra_bytes": float(sent.peak_extra_bytes),
                "sync/sender_peak_extra_bytes_accounted": float(sent.peak_extra_bytes_accounted),
                "sync/engines": len(self.engines), "sync/ipc": float(self.transport != "broadcast")}


def _compare_checksums(sent: dict[str, int], got: dict[str, int], who: str) -> None:
    """Raise :class:`SyncVerificationError` naming the first tensor whose CRC-32 differs (or the tensor sets)."""
    if set(sent) != set(got):
        missing, extra = sorted(set(sent) - set(got)), sorted(set(got) - set(sent))
        raise SyncVerificationError(f"{who}: received tensor set differs: missing {missing[:5]}, extra {extra[:5]}")
    for name, crc in sent.items():
        if got[name] != crc:
            raise SyncVerificationError(
                f"{who}: tensor {name} checksum mismatch: trainer crc32 {crc:#010x}, engine crc32 {got[name]:#010x}")
