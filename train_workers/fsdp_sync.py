"""The weight-sync sender side of an FSDP2 train rank: bucket plan, sync group, streaming the policy to the engines.

:class:`FSDPSync` is a mixin of :class:`train_workers.fsdp_worker.FSDPTrainWorker` (it uses the worker's ``policy``,
``rank``, ``device``, ``policy_version`` and ``_use_cuda``). Train rank 0 is rank 0 of the weight-sync group (train rank 0 + every
engine worker); the other train ranks take part only in the all-gathers that rebuild each full tensor. Transport,
buckets and verification live in ``weight_sync/`` (``buckets``, ``transport``, ``sender``, ``verify``).

Weight sync casts the float32 (master) parameters to the engine's dtype. With ``train.lora`` and ``sync: merged`` the
engines receive the merged weights ``W + (alpha/r)·B·A`` under the model's own names (``train_workers.lora``), so they
need no change; with ``sync: adapter`` they receive only the ``lora_A``/``lora_B`` tensors under PEFT's saved names
and serve them as a vLLM LoRA adapter (``rollout_workers.vllm_extension``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from contract.messages import SendReport
from train_workers.sharding import as_dtype, full_tensor


class FSDPSync:
    """Weight-sync methods of :class:`train_workers.fsdp_worker.FSDPTrainWorker`."""

    _sync_group = None  # rank 0's transport sender (``weight_sync.transport``), None when no group is formed
    _buckets = None     # the plan of the last ``sync_plan`` call
    _lora = None        # the worker's ``train_workers.lora.LoraPolicy`` with ``train.lora``, else None

    def sync_plan(self, engine_dtype: str, bucket_bytes: int) -> list:
        """The bucket plan (``weight_sync.buckets.Bucket`` list) of the policy's parameters in HF names and the
        engine's dtype, buckets of at most ``bucket_bytes`` bytes (same on every rank).

        Raises:
            ValueError: an unknown dtype name.
        """
        from weight_sync.buckets import plan_buckets

        dt = as_dtype(engine_dtype)
        self._engine_dtype = dt
        self._buckets = plan_buckets([(name, shape, dt) for name, shape, _ in self._sync_sources()], bucket_bytes)
        return self._buckets

    def _named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters in HF checkpoint names (tied weights once), in a fixed order."""
        return list(self.policy.model.named_parameters())

    def _sync_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """The whole of one parameter (a collective over the train group) as the engine holds it: the float32
        (master) parameter cast to the ``sync_plan`` engine dtype."""
        return full_tensor(param.detach()).to(self._engine_dtype)

    def _sync_sources(self) -> list[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]]:
        """``(HF name, shape, gather)`` of every tensor the engines receive, in plan order; ``gather()`` (a
        collective) returns the whole tensor in the engine dtype. With ``train.lora``: ``sync: merged``, the base
        weights with the adapters merged in (``LoraPolicy.merged_sources``), under the same names as without LoRA;
        ``sync: adapter``, the adapter tensors only (``LoraPolicy.adapter_sources``, PEFT's saved names)."""
        if self._adapter_sync():
            return [(name, shape, lambda f=f: f().to(self._engine_dtype))
                    for name, shape, f in self._lora.adapter_sources()]
        if self._lora is not None:
            return [(name, shape, lambda f=f: f().to(self._engine_dtype))
                    for name, shape, f in self._lora.merged_sources()]
        return [(name, tuple(p.shape), lambda p=p: self._sync_tensor(p)) for name, p in self._named_parameters()]

    def _adapter_sync(self) -> bool:
        """``train.lora.sync`` is ``adapter``: the engines receive the adapter tensors only."""
        return self._lora is not None and self.train.lora.sync == "adapter"

    def sync_adapter_config(self) -> dict | None:
        """With ``train.lora.sync: adapter``, the policy's PEFT ``adapter_config.json`` as a dict
        (``LoraPolicy.adapter_config``); None otherwise."""
        return self._lora.adapter_config() if self._adapter_sync() else None

    def sync_node_id(self) -> str | None:
        """This rank's Ray node id (``sync.mode: auto`` compares it with the engines'); None outside Ray."""
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

    def init_sync_group(self, host: str, port: int, world_size: int, timeout_s: float,
                        transport: str = "broadcast") -> dict | None:
        """Rank 0 hosts the weight-sync group (rank 0 of it) and its transport; other train ranks do nothing here.

        Args:
            transport: ``broadcast`` (gloo/NCCL; blocks until every engine worker joined, so the engines must join
                concurrently), ``shm`` or ``cuda_ipc`` (returns at once; the engines join afterwards with the
                returned descriptor). See ``weight_sync.transport``.

        Returns:
            The transport descriptor the engines join with (rank 0), None on other ranks.

        Raises:
            RuntimeError: called before :meth:`sync_plan`.
        """
        from weight_sync.group import SyncGroup
        from weight_sync.transport import backend_for, make_sender

        self.close_sync_group()
        if self.rank != 0:
            return None
        if self._buckets is None:
            raise RuntimeError("init_sync_group called before sync_plan")
        backend = backend_for(transport, self._use_cuda())
        group = SyncGroup(host, port, 0, world_size, timeout_s, backend=backend,
                          device=self.device if backend == "nccl" else None)
        largest = max((b.nbytes for b in self._buckets), default=0)
        self._sync_group = make_sender(transport, group, self.device, largest)
        return self._sync_group.descriptor()

    def close_sync_group(self) -> None:
        """Tear down this rank's side of the weight-sync group (before a group with new membership is built)."""
        if self._sync_group is not None:
            self._sync_group.close()
            self._sync_group = None

    def broadcast_weights(self, verify: bool | list[str]) -> SendReport:
        """Stream the policy to every engine, bucket by bucket (all train ranks call this together).

        Each tensor is gathered from its shards (``full_tensor``, a collective over the train group), cast to the
        engine dtype and copied into its bucket's buffer at once; rank 0 hands a full bucket to the transport
        (an asynchronous broadcast, or an IPC slot) while it packs the next into the other buffer (double
        buffering). The sender holds two bucket buffers plus one gathered tensor, never the whole model
        (``weight_sync.sender.stream_buckets``). After a transport error the group is closed (peers blocked in it
        fail at once) and must be rebuilt.

        Args:
            verify: True to CRC-32 every tensor, False none, or the names to check (``weight_sync.verify``).

        Returns:
            this rank's :class:`SendReport` (bytes, checksums and memory from rank 0; see ``stream_buckets``).

        Raises:
            RuntimeError: called before ``sync_plan``/``init_sync_group``, or the transport failed (a receiver died
                or stalled past ``sync.timeout_s``).
        """
        from weight_sync.sender import stream_buckets

        if self._buckets is None:
            raise RuntimeError("broadcast_weights called before sync_plan")
        sender = self._sync_group if self.rank == 0 else None
        if self.rank == 0 and sender is None:
            raise RuntimeError("broadcast_weights on train rank 0 before init_sync_group (or after a failed sync)")
        gather = {name: fn for name, _, fn in self._sync_sources()}
        check = [s.name for b in self._buckets for s in b.slots] if verify is True else (verify or [])
        try:
            report = stream_buckets(self._buckets, lambda name: gather[name](), sender, check, self.device)
        except Exception:
            self.close_sync_group()
            raise
        return SendReport(policy_version=self.policy_version, seconds=report["seconds"], bytes=report["bytes"],
                          checksums=report["checksums"], peak_extra_bytes=report["peak_extra_bytes"],
                          peak_extra_bytes_accounted=report["peak_extra_bytes_accounted"])
