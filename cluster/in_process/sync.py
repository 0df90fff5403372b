"""The in-process weight sync: the train rank streams its policy into the fleet's ``hf`` engine through the real
weight-sync path, verified.

Sender: the rank's :class:`contract.train_worker.TrainWorker` methods, as the Ray shell calls them
(``cluster.ray_shell.sync``): ``sync_plan(model.dtype, sync.bucket_bytes)``, ``init_sync_group(host, port,
world_size=2, sync.timeout_s, transport="broadcast")``, ``broadcast_weights(verify)``. Receiver: the engine's own
side, as under Ray (:class:`rollout_workers.hf.engine.HFEngine`: ``init_weight_sync`` as rank 1 of the same
two-member group, gloo over loopback TCP; ``receive_weights``, which checksums each bucket and copies it into the
engine model's tensors by name), held against the sender's checksums (``weight_sync.verify.compare_checksums``).
Which tensors are checked follows ``sync.verify`` and ``sync.verify_full_every`` (``weight_sync.verify.
checked_names``).

Both members live in this process: two gloo process groups (the rank's default group, which gathers each tensor,
and the sync group) work side by side when each side of the sync group runs in its own thread. The sender runs in a
worker thread (``inproc-sync-sender``), the receiver in the calling thread.

What is received (``train.lora.sync``): full weights (full fine-tuning, or LoRA ``merged``) under the model's HF
names, or (``adapter``) the ``lora_A``/``lora_B`` tensors under PEFT's saved names, loaded into the engine model's
PEFT adapters; after each such sync the modules the adapter is bound to (the engine's report, read from PEFT) are
checked against the trainer's targets, as the Ray shell checks what vLLM's LoRA manager reports.

The transport is always ``broadcast`` over gloo (``sync.mode`` is a choice between processes; here there is one), so
the train rank must be on the CPU: two NCCL ranks cannot share one GPU.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from contract.sync_reports import ReceiveReport, SendReport, SyncReport
from contract.versions import PolicyVersionLedger
from weight_sync.group import free_port
from weight_sync.verify import adapter_targets, check_adapter_binding, checked_names, compare_checksums

__all__ = ["LocalWeightSync"]

HOST = "127.0.0.1"
#: Seconds beyond ``sync.timeout_s`` the receiver waits for the sender thread's result (its own waits time out
#: within ``sync.timeout_s``).
THREAD_MARGIN_S = 30.0


class LocalWeightSync:
    """The sync group between the train rank (member 0) and the fleet's engine (member 1), one verified sync per call.

    Args:
        spec: the job spec (``model.dtype``, ``sync.bucket_bytes``, ``sync.timeout_s``, ``sync.verify``,
            ``sync.verify_full_every``).
        worker: the train rank (``LocalTrainer.worker``).
        engine: the fleet's engine (:class:`rollout_workers.hf.engine.HFEngine`: ``init_weight_sync``,
            ``receive_weights``, ``close_weight_sync``).
        versions: the policy-version ledger.

    Attributes:
        buckets: the rank's bucket plan. names: the streamed tensor names, plan order. adapter_config: the rank's
            PEFT adapter config with ``train.lora.sync: adapter`` (the engine wraps its model with it), else None.

    Raises:
        ValueError: the plan's tensors are not the engine model's (names, shapes or dtypes differ; names them).
        RuntimeError: the group did not form within ``sync.timeout_s``.
    """

    def __init__(self, spec, worker, engine, versions: PolicyVersionLedger):
        self.spec = spec
        self.worker = worker
        self.engine = engine
        self.versions = versions
        self.adapter_config = worker.sync_adapter_config()
        self.buckets = worker.sync_plan(spec.model.dtype, spec.sync.bucket_bytes)
        self.names = [slot.name for b in self.buckets for slot in b.slots]
        self._sender_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inproc-sync-sender")
        self._connected = False
        self.connect()

    def connect(self) -> None:
        """(Re)form the two-member group: the rank hosts it from the sender thread while the engine joins from this
        one."""
        self.close_group()
        s = self.spec.sync
        port = free_port(HOST)
        host_side = self._sender_thread.submit(self.worker.init_sync_group, HOST, port, 2, s.timeout_s, "broadcast")
        try:
            self.engine.init_weight_sync(HOST, port, 1, 2, self.buckets, s.timeout_s, "gloo", None,
                                         self.adapter_config)
            host_side.result(timeout=s.timeout_s + THREAD_MARGIN_S)
        except BaseException:
            self.worker.close_sync_group()
            raise
        self._connected = True

    def sync(self, num_engines: int) -> SyncReport:
        """Stream the rank's policy (``versions.current``) into the engine, verify the checked tensors, and record
        every engine (all ``num_engines`` logical engines share the one) at that version in the ledger.

        Returns:
            the sync's :class:`SyncReport` (``engines`` = ``num_engines``, ``ipc`` False).

        Raises:
            RuntimeError: a transport failure on either side (the group is rebuilt before the next sync).
            SyncVerificationError: a received tensor's checksum differs from the sender's (names it);
                ``AdapterSyncError`` (adapter sync): the engine's adapter is bound to no module, or to another
                number of modules than the trainer targets (names them).
            PolicyVersionError: the rank is not at ``versions.current``.
            Every failure leaves the engines' versions unknown in the ledger (``versions.sync_failed``).
        """
        s = self.spec.sync
        version = self.versions.current
        check = checked_names(self.names, version, s.verify, s.verify_full_every)
        try:
            if not self._connected:
                self.connect()
            sent, got = self._stream(version, True if len(check) == len(self.names) else check)
            self.versions.check_trainer(sent.policy_version)
            if check:
                compare_checksums({name: sent.checksums[name] for name in check}, got.worker_checksums[0],
                                  "in-process fleet engine")
            targeted = None
            if self.adapter_config is not None:
                targeted = adapter_targets(self.names)
                check_adapter_binding(targeted, (got.worker_adapter_modules or [None])[0], "in-process fleet engine")
            self.versions.synced(version, [version] * num_engines)
        except BaseException:
            self.versions.sync_failed()
            raise
        return SyncReport(policy_version=version, verified=bool(check), verified_tensors=len(check),
                          bytes=sent.bytes, buckets=len(self.buckets), seconds_sender=sent.seconds,
                          gb_per_s=sent.bytes / max(got.seconds, sent.seconds, 1e-9) / 1e9,
                          sender_peak_extra_bytes=sent.peak_extra_bytes,
                          sender_peak_extra_bytes_accounted=sent.peak_extra_bytes_accounted,
                          engines=num_engines, ipc=False,
                          adapter_modules=len(targeted) if targeted is not None else None,
                          adapter_checksum=sent.payload_crc32, merge_rounding_error=sent.merge_rounding_error,
                          merge_update_error=sent.merge_update_error)

    def _stream(self, version: int, verify: bool | list[str]) -> tuple[SendReport, ReceiveReport]:
        """One sync: the rank's ``broadcast_weights(verify)`` in the sender thread, the engine's
        ``receive_weights(version, verify)`` here. On a failure both sides leave the group (the engine's side first,
        so that a sender still blocked on it fails at once) and the error names the root cause first."""
        sending = self._sender_thread.submit(self.worker.broadcast_weights, verify)
        # a sender that fails closes its side (the rank's broadcast_weights does), so that the engine's wait for
        # the next bucket fails at once (gloo: peer closed) rather than after sync.timeout_s; closed again here in
        # case it did not
        sending.add_done_callback(lambda f: f.exception() is not None and self.worker.close_sync_group())
        try:
            got = self.engine.receive_weights(version, verify)
        except BaseException as exc:
            self._connected = False
            self.engine.close_weight_sync()
            try:
                sending.result(timeout=self.spec.sync.timeout_s + THREAD_MARGIN_S)
            except BaseException as sender_exc:  # noqa: BLE001 - the root cause: said first
                raise RuntimeError(f"weight sync failed: train rank 0: {type(sender_exc).__name__}: {sender_exc}; "
                                   f"fleet: {type(exc).__name__}: {exc}") from exc
            finally:
                self.worker.close_sync_group()
            raise
        try:
            sent = sending.result(timeout=self.spec.sync.timeout_s + THREAD_MARGIN_S)
        except BaseException:
            self.close_group()
            raise
        return sent, got

    def close_group(self) -> None:
        """Close both members of the group (idempotent)."""
        self._connected = False
        self.engine.close_weight_sync()
        self.worker.close_sync_group()

    def close(self) -> None:
        """Close the group and stop the sender thread (idempotent)."""
        self.close_group()
        self._sender_thread.shutdown(wait=True)
