"""The weight-sync group of the loop: train rank 0 + every engine worker, one verified sync per policy version, and
a rebuilt group when the engine list changes. ``weight_sync/`` is the transport underneath (groups, buckets,
transports, sender, receivers, verification); this module knows the pools and their membership.

Life cycle (the rollout pool owns the engine actors; this class only syncs them; every version is the ledger's)::

    sync = WeightSync(spec, train_pool, rollout_pool, versions)  # plan once, form the group with rollout_pool.engines
    sync.sync()            # after every optimizer step: all engines → versions.current
    ... pool adds / removes / replaces engine actors in rollout_pool.engines ...
    sync.rebuild()         # tear the old group down, form one with the current engines
    sync.ensure_current()  # new engines (version unknown) get versions.current before they serve

A member that dies or stalls during a sync or while the group forms raises :class:`SyncMemberError` naming it
within ``sync.timeout_s`` (the group's own collectives and store waits have the same timeout, so no actor is left
blocked for longer). After a failed sync every engine's version is unknown (``versions.sync_failed``) and the group is
marked broken: the next ``sync`` rebuilds it first (with ``rollout.engines`` as it is then).

What is streamed (``train.lora.sync``): the policy's full weights (full fine-tuning, or LoRA ``merged``), or only the
LoRA adapter tensors (``adapter``), which every engine loads as a vLLM LoRA adapter of the policy version and serves
with every request (``rollout_workers.vllm.extension``); verification is the same per-tensor checksum either way.

Transports (``sync.mode``): ``broadcast`` (gloo on CPU, NCCL on GPU), ``ipc`` (shared memory on CPU, CUDA IPC on
GPU; every engine must be on train rank 0's Ray node, else the group is refused), ``auto`` (ipc when every engine is on
rank 0's Ray node, else broadcast); see :func:`weight_sync.transport.choose_transport`.
"""

from __future__ import annotations

import time

import ray

from cluster.ray_shell.pools import get
from contract.versions import PolicyVersionLedger
from contract.messages import EngineInfo
from contract.sync_reports import ReceiveReport, SendReport, SyncReport
from weight_sync.transport import choose_transport
from weight_sync.verify import adapter_targets, check_adapter_binding, checked_names, compare_checksums


class SyncMemberError(RuntimeError):
    """A member of the weight-sync group died, failed or did not finish within ``sync.timeout_s``.

    Attributes:
        engine_indices: indices (into the synced engine list) of the engines at fault: those that died, else those
            that failed, else (a stall) every engine that had not finished. Empty when only the trainer failed.
    """

    def __init__(self, message: str, engine_indices: list[int]):
        super().__init__(message)
        self.engine_indices = engine_indices


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
        versions: the policy-version ledger: the version to sync, and where each engine's version is recorded.

    Attributes:
        engines: the engine actors of the current group, in group order (their versions: ``versions``).
        transport: ``broadcast``, ``shm`` or ``cuda_ipc`` (``sync.mode`` resolved).

    Raises:
        SyncMemberError: a member died or stalled while the group formed.
    """

    def __init__(self, spec, train, rollout, versions: PolicyVersionLedger):
        self.spec, self.train, self.rollout, self.versions = spec, train, rollout, versions
        buckets = train.sync_plan(spec.model.dtype, spec.sync.bucket_bytes)
        self.buckets = buckets
        self.names = [slot.name for b in buckets for slot in b.slots]
        self.num_buckets = len(buckets)
        self.bytes_per_sync = sum(b.nbytes for b in buckets)
        self.adapter_config = train.sync_adapter_config()  # train.lora.sync: adapter; None: full weights
        self.engines: list = []
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
        self._teardown()
        self._broken = True
        self.transport = self._resolve_transport(engines)
        host, port = get(self.train.workers[0].node_address.remote(), s.timeout_s, "train rank 0 address")
        tp = self.spec.rollout.tensor_parallel_size
        world = 1 + len(engines) * tp
        backend = "nccl" if self.spec.rollout.num_gpus_per_replica > 0 else "gloo"
        names = ["train rank 0"] + [f"engine {i}" for i in range(len(engines))]
        trainer = self.train.workers[0].init_sync_group.remote(host, port, world, s.timeout_s, self.transport)
        what = f"forming the weight-sync group ({self.transport}, {len(engines)} engines)"
        if self.transport == "broadcast":  # rank 0's group forms only once every engine joins: call them together
            refs = [trainer] + [e.init_weight_sync.remote(host, port, 1 + i * tp, world, self.buckets, s.timeout_s,
                                                         backend, None, self.adapter_config)
                                for i, e in enumerate(engines)]
            wait_members(refs, names, s.timeout_s, what)
        else:  # rank 0 creates the slots first; the engines join with their descriptor
            channel = wait_members([trainer], names[:1], s.timeout_s, what)[0]
            refs = [e.init_weight_sync.remote(host, port, 1 + i * tp, world, self.buckets, s.timeout_s, backend,
                                              channel, self.adapter_config) for i, e in enumerate(engines)]
            wait_members(refs, names[1:], s.timeout_s, what)
        self.engines = engines
        self.versions.set_engines(engines)
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
        node = get(self.train.workers[0].sync_node_id.remote(), s.timeout_s, "train rank 0 node id")
        infos: list[EngineInfo] = wait_members([e.ready.remote() for e in engines],
                                               [f"engine {i}" for i in range(len(engines))], s.timeout_s,
                                               "reading the engines' Ray nodes")
        return choose_transport(s.mode, self.spec.rollout.num_gpus_per_replica > 0, node,
                                [info.node_id for info in infos])

    def close(self) -> None:
        """Tear the group down on every live member."""
        self._teardown()
        self.engines, self.transport = [], None
        self.versions.set_engines([])

    # ---- syncing ------------------------------------------------------------------------------------------------
    def ensure_current(self) -> SyncReport | None:
        """Sync when any engine of the group (e.g. a replacement) does not hold the ledger's current version;
        returns the sync's report, or None when every engine already does."""
        if not self._broken and not self.versions.stale_engines():
            return None
        return self.sync()

    def sync(self) -> SyncReport:
        """Stream the current policy (``versions.current``) to every engine; checksum the tensors ``sync.verify``
        selects; record every engine's version in the ledger.

        Returns:
            the sync's report (``SyncReport.metrics`` gives the ``sync/*`` metrics).

        Raises:
            SyncMemberError: an engine or the trainer died, failed or stalled (names it; within ``sync.timeout_s``).
            SyncVerificationError: a tensor's checksum on an engine differs from the trainer's (names both);
                ``AdapterSyncError`` (adapter sync): an engine's adapter is bound to no module, or to another number
                of modules than the trainer targets (names them).
            PolicyVersionError: the trainer is not at ``versions.current``, or an engine reports another version.
        """
        s = self.spec.sync
        version = self.versions.current
        if self._broken:
            self.rebuild()
        check = checked_names(self.names, version, s.verify, s.verify_full_every)
        check_arg = True if len(check) == len(self.names) else check
        names = [f"train rank {r}" for r in range(len(self.train.workers))]
        names += [f"engine {i}" for i in range(len(self.engines))]
        send = [w.broadcast_weights.remote(check_arg) for w in self.train.workers]
        recv = [e.receive_weights.remote(version, check_arg) for e in self.engines]
        try:
            results = wait_members(send + recv, names, s.timeout_s, f"weight sync to policy version {version}")
        except SyncMemberError:
            self._broken = True
            self.versions.sync_failed()
            raise
        sent: list[SendReport] = results[:len(send)]
        received: list[ReceiveReport] = results[len(send):]
        try:
            self.versions.check_trainer(sent[0].policy_version)
            if check:
                expected = {name: sent[0].checksums[name] for name in check}
                for i, report in enumerate(received):
                    for w, checksums in enumerate(report.worker_checksums):
                        compare_checksums(expected, checksums, f"engine {i} worker {w}")
            targeted = self._check_adapter_binding(received)
            self.versions.synced(version, [r.policy_version for r in received])
        except Exception:
            self.versions.sync_failed()  # no engine counts as holding the version until it is verified
            raise
        seconds = max(r.seconds for r in sent + received)
        rank0 = sent[0]
        return SyncReport(policy_version=version, verified=bool(check), verified_tensors=len(check),
                          bytes=rank0.bytes, buckets=self.num_buckets, seconds_sender=rank0.seconds,
                          gb_per_s=rank0.bytes / max(seconds, 1e-9) / 1e9,
                          sender_peak_extra_bytes=rank0.peak_extra_bytes,
                          sender_peak_extra_bytes_accounted=rank0.peak_extra_bytes_accounted,
                          engines=len(self.engines), ipc=self.transport != "broadcast",
                          adapter_modules=len(targeted) if targeted is not None else None,
                          adapter_checksum=rank0.payload_crc32, merge_rounding_error=rank0.merge_rounding_error,
                          merge_update_error=rank0.merge_update_error)

    def _check_adapter_binding(self, received: list[ReceiveReport]) -> list[str] | None:
        """With adapter sync, check that every engine worker's adapter is bound to the modules the trainer targets
        (``weight_sync.verify.check_adapter_binding``) and return those modules; None for full weights.

        Raises:
            AdapterSyncError: a worker reported no binding, zero modules, or another count (naming the modules).
        """
        if self.adapter_config is None:
            return None
        targeted = adapter_targets(self.names)
        for i, report in enumerate(received):
            for w, modules in enumerate(report.worker_adapter_modules or [None]):
                check_adapter_binding(targeted, modules, f"engine {i} worker {w}")
        return targeted
