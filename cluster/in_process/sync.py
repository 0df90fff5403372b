"""The in-process weight sync: the train rank streams its policy into the fleet's own model through the real
weight-sync path, verified.

Sender: the rank's :class:`contract.train_worker.TrainWorker` methods, as the Ray shell calls them
(``cluster.ray_shell.sync``): ``sync_plan(model.dtype, sync.bucket_bytes)``, ``init_sync_group(host, port,
world_size=2, sync.timeout_s, transport="broadcast")``, ``broadcast_weights(verify)``. Receiver: rank 1 of the same
two-member :class:`weight_sync.group.SyncGroup` (gloo over loopback TCP) with the transport's receiver
(``weight_sync.transport.make_receiver``), each bucket checksummed (``weight_sync.buckets.bucket_checksums``) and
unpacked (``unpack_bucket``) into the fleet model's tensors by name, then held against the sender's checksums
(``weight_sync.verify.compare_checksums``). Which tensors are checked follows ``sync.verify`` and
``sync.verify_full_every`` (``weight_sync.verify.checked_names``).

Both members live in this process: two gloo process groups (the rank's default group, which gathers each tensor,
and the sync group) work side by side when each side of the sync group runs in its own thread. The sender runs in a
worker thread (``inproc-sync-sender``), the receiver in the calling thread.

What is received (``train.lora.sync``): full weights (full fine-tuning, or LoRA ``merged``) under the model's HF
names; tied embeddings are sent once and the LM head, sharing the embedding's tensor, follows. Or (``adapter``) the
``lora_A``/``lora_B`` tensors under PEFT's saved names, loaded into the fleet model's PEFT adapters; after each such
sync the modules the adapter is bound to are read from PEFT (:func:`peft_bound_modules`) and checked against the
trainer's targets, as the Ray shell checks what vLLM's LoRA manager reports.

The transport is always ``broadcast`` over gloo (``sync.mode`` is a choice between processes; here there is one), so
the train rank must be on the CPU: two NCCL ranks cannot share one GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from contract.messages import SendReport, SyncReport
from contract.versions import PolicyVersionLedger
from train_workers.lora import ADAPTER, PEFT_PREFIX, is_adapter, saved_name
from weight_sync.buckets import bucket_checksums, unpack_bucket
from weight_sync.group import SyncGroup, free_port
from weight_sync.transport import make_receiver
from weight_sync.verify import adapter_targets, check_adapter_binding, checked_names, compare_checksums

__all__ = ["LocalWeightSync", "peft_bound_modules", "sync_targets"]

HOST = "127.0.0.1"
#: Seconds beyond ``sync.timeout_s`` the receiver waits for the sender thread's result (its own waits time out
#: within ``sync.timeout_s``).
THREAD_MARGIN_S = 30.0


def peft_bound_modules(model: torch.nn.Module) -> list[str]:
    """The modules (HF names, sorted) whose LoRA adapter is in effect in the fleet's PEFT model: every PEFT
    ``LoraLayer`` that holds the policy's adapter (``train_workers.lora.ADAPTER``) as an active adapter, with
    adapters enabled, not merged into its base weight (a sync writes the adapter tensors, which a merged layer no
    longer reads) and a non-zero scaling. [] for a model without PEFT layers."""
    from peft.tuners.lora import LoraLayer

    bound = []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or ADAPTER not in module.lora_A:
            continue
        if module.disable_adapters or module.merged or ADAPTER not in module.active_adapters:
            continue
        if module.scaling.get(ADAPTER, 0.0) == 0.0:
            continue
        bound.append(name.removeprefix(PEFT_PREFIX))
    return sorted(bound)


def sync_targets(model: torch.nn.Module, adapter: bool) -> dict[str, torch.nn.Parameter]:
    """The fleet model's tensors a sync writes, by the names the trainer streams them under.

    Args:
        model: the fleet's HF causal LM; with ``adapter`` a PEFT model wrapping it.
        adapter: ``train.lora.sync: adapter``: only the adapter tensors, under PEFT's saved names
            (``train_workers.lora.saved_name``: ``...q_proj.lora_A.weight``); else every parameter under its HF
            name (tied weights once: ``named_parameters`` lists a shared tensor once).
    """
    if adapter:
        return {saved_name(n): p for n, p in model.named_parameters() if is_adapter(n)}
    return dict(model.named_parameters())


class LocalWeightSync:
    """The sync group between the train rank (member 0) and the fleet's model (member 1), one verified sync per call.

    Args:
        spec: the job spec (``model.dtype``, ``sync.bucket_bytes``, ``sync.timeout_s``, ``sync.verify``,
            ``sync.verify_full_every``).
        worker: the train rank (``LocalTrainer.worker``).
        targets: :func:`sync_targets` of the fleet model.
        versions: the policy-version ledger.
        bound_modules: (``train.lora.sync: adapter``) → the modules the fleet model's adapter is bound to
            (:func:`peft_bound_modules`), read after every sync and checked against the trainer's targets; None for
            full weights.

    Attributes:
        buckets: the rank's bucket plan. names: the streamed tensor names, plan order.

    Raises:
        ValueError: the plan's tensors are not the fleet model's (names, shapes or dtypes differ; names them).
        RuntimeError: the group did not form within ``sync.timeout_s``.
    """

    def __init__(self, spec, worker, targets: dict[str, torch.nn.Parameter], versions: PolicyVersionLedger,
                 bound_modules: Callable[[], list[str]] | None = None):
        self.spec, self.worker, self.targets, self.versions = spec, worker, targets, versions
        self.bound_modules = bound_modules
        self.buckets = worker.sync_plan(spec.model.dtype, spec.sync.bucket_bytes)
        self.names = [slot.name for b in self.buckets for slot in b.slots]
        self._check_plan()
        self._sender_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inproc-sync-sender")
        self._receiver = None
        self.connect()

    def _check_plan(self) -> None:
        """Every planned tensor has a fleet tensor of the same shape and dtype, and every fleet tensor is planned."""
        slots = {s.name: s for b in self.buckets for s in b.slots}
        missing, extra = sorted(set(slots) - set(self.targets)), sorted(set(self.targets) - set(slots))
        if missing or extra:
            raise ValueError(f"weight sync: the trainer's tensors are not the fleet model's: {len(missing)} sent "
                             f"but absent from the fleet model {missing[:4]}, {len(extra)} never sent {extra[:4]}")
        for name, slot in slots.items():
            t = self.targets[name]
            if tuple(t.shape) != slot.shape or str(t.dtype).removeprefix("torch.") != slot.dtype:
                raise ValueError(f"weight sync: tensor {name}: the trainer sends shape {slot.shape} {slot.dtype}, the "
                                 f"fleet model holds {tuple(t.shape)} {t.dtype} (model.dtype={self.spec.model.dtype})")

    def connect(self) -> None:
        """(Re)form the two-member group: the rank hosts it from the sender thread while this thread joins."""
        self.close_group()
        s = self.spec.sync
        port = free_port(HOST)
        host_side = self._sender_thread.submit(self.worker.init_sync_group, HOST, port, 2, s.timeout_s, "broadcast")
        try:
            group = SyncGroup(HOST, port, 1, 2, s.timeout_s, backend="gloo")
            descriptor = host_side.result(timeout=s.timeout_s + THREAD_MARGIN_S)
        except BaseException:
            self.worker.close_sync_group()
            raise
        self._receiver = make_receiver(descriptor, group, torch.device("cpu"))

    def sync(self, num_engines: int) -> SyncReport:
        """Stream the rank's policy (``versions.current``) into the fleet model, verify the checked tensors, and
        record every engine (all ``num_engines`` share the model) at that version in the ledger.

        Returns:
            the sync's :class:`SyncReport` (``engines`` = ``num_engines``, ``ipc`` False).

        Raises:
            RuntimeError: a transport failure on either side (the group is rebuilt before the next sync).
            SyncVerificationError: a received tensor's checksum differs from the sender's (names it);
                ``AdapterSyncError`` (adapter sync): the fleet model's adapter is bound to no module, or to another
                number of modules than the trainer targets (names them).
            PolicyVersionError: the rank is not at ``versions.current``.
            Every failure leaves the engines' versions unknown in the ledger (``versions.sync_failed``).
        """
        s = self.spec.sync
        version = self.versions.current
        check = checked_names(self.names, version, s.verify, s.verify_full_every)
        try:
            if self._receiver is None:
                self.connect()
            sent, seconds, got = self._stream(True if len(check) == len(self.names) else check, set(check))
            self.versions.check_trainer(sent.policy_version)
            if check:
                compare_checksums({name: sent.checksums[name] for name in check}, got, "in-process fleet model")
            targeted = None
            if self.bound_modules is not None:
                targeted = adapter_targets(self.names)
                check_adapter_binding(targeted, self.bound_modules(), "in-process fleet model")
            self.versions.synced(version, [version] * num_engines)
        except BaseException:
            self.versions.sync_failed()
            raise
        return SyncReport(policy_version=version, verified=bool(check), verified_tensors=len(check),
                          bytes=sent.bytes, buckets=len(self.buckets), seconds_sender=sent.seconds,
                          gb_per_s=sent.bytes / max(seconds, sent.seconds, 1e-9) / 1e9,
                          sender_peak_extra_bytes=sent.peak_extra_bytes,
                          sender_peak_extra_bytes_accounted=sent.peak_extra_bytes_accounted,
                          engines=num_engines, ipc=False,
                          adapter_modules=len(targeted) if targeted is not None else None,
                          adapter_checksum=sent.payload_crc32, merge_rounding_error=sent.merge_rounding_error,
                          merge_update_error=sent.merge_update_error)

    @torch.no_grad()
    def _stream(self, verify: bool | list[str], check: set[str]) -> tuple[SendReport, float, dict[str, int]]:
        """One sync: the rank's ``broadcast_weights(verify)`` in the sender thread, each bucket received here,
        checksummed (the names in ``check``) and copied into the fleet tensors. Returns (the rank's report, the
        receiver's seconds, the receiver's checksums). On a failure both sides' group is closed."""
        t0 = time.perf_counter()
        sending = self._sender_thread.submit(self.worker.broadcast_weights, verify)
        # a sender that fails closes its side (the rank's broadcast_weights does), so that this thread's wait for
        # the next bucket fails at once (gloo: peer closed) rather than after sync.timeout_s; closed again here in
        # case it did not
        sending.add_done_callback(lambda f: f.exception() is not None and self.worker.close_sync_group())
        got: dict[str, int] = {}
        try:
            self._receiver.begin()
            for bucket in self.buckets:
                buf = self._receiver.receive(bucket)
                if check and any(slot.name in check for slot in bucket.slots):
                    got.update(bucket_checksums(bucket, buf, only=check))
                for name, tensor in unpack_bucket(bucket, buf):
                    self.targets[name].copy_(tensor)
        except BaseException as exc:
            receiver, self._receiver = self._receiver, None
            receiver.close()  # a sender still blocked on this member fails at once (gloo: peer closed)
            try:
                sending.result(timeout=self.spec.sync.timeout_s + THREAD_MARGIN_S)
            except BaseException as sender_exc:  # noqa: BLE001 - the root cause: said first
                raise RuntimeError(f"weight sync failed: train rank 0: {type(sender_exc).__name__}: {sender_exc}; "
                                   f"fleet: {type(exc).__name__}: {exc}") from exc
            finally:
                self.worker.close_sync_group()
            raise
        seconds = time.perf_counter() - t0
        try:
            sent = sending.result(timeout=self.spec.sync.timeout_s + THREAD_MARGIN_S)
        except BaseException:
            self.close_group()
            raise
        return sent, seconds, got

    def close_group(self) -> None:
        """Close both members of the group (idempotent)."""
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()
        self.worker.close_sync_group()

    def close(self) -> None:
        """Close the group and stop the sender thread (idempotent)."""
        self.close_group()
        self._sender_thread.shutdown(wait=True)
