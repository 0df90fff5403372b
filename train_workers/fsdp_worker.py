"""FSDP2 train worker: one data-parallel rank of the policy (and frozen reference policy).

``FSDPTrainWorker`` is a plain class; the driver wraps it with ``ray.remote`` (resources from the spec). All ranks call
every method together: FSDP collectives (all-gather, reduce-scatter) need every rank.

Model parallel layout (torchtitan's order): ``fully_shard`` on each decoder layer, then on the root
(:class:`ResponseLogprobModel`, which owns the embedding, final norm and the tied LM head).

Loss (seed formula; see ``grpo.losses.policy_loss``): PPO clipped surrogate per token + ``kl_coef`` · k3 KL to the
reference policy, aggregated with global token/sequence counts so micro-batch and rank splits do not change it.
FSDP2 averages gradients over ranks, so each micro-batch loss is multiplied by the world size to make that average a
sum of the per-rank sums.
"""

from __future__ import annotations

import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from grpo.losses import policy_loss
from train_workers.packing import PackedMicroBatch
from train_workers.policy import ResponseLogprobModel

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _shard(model: ResponseLogprobModel, mesh=None, reshard_after_forward: bool = True) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.get_decoder().layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)


def _peak_rss_gib() -> float:
    """Peak resident memory of this process so far, GiB (Linux ru_maxrss is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly DTensor-sharded) parameter; a collective over the train group."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class FSDPTrainWorker:
    """One rank of the FSDP2 data-parallel train group.

    Args:
        rank, world_size: this rank and the number of train ranks.
        model_path: local HF folder of the initial policy (also the reference policy).
        train: the spec's ``TrainSpec``; algorithm: ``AlgorithmSpec``.
        temperature: sampling temperature (logprobs are recomputed at it).
        max_response_tokens: for the Dr. GRPO ``seq-mean-token-sum-norm`` aggregation.
        dtype: parameter dtype name.
        seed: torch seed for this rank.
    """

    def __init__(self, rank: int, world_size: int, model_path: str, train, algorithm, temperature: float,
                 max_response_tokens: int, dtype: str = "float32", seed: int = 0):
        self.rank, self.world_size = rank, world_size
        self.model_path, self.train, self.algorithm = model_path, train, algorithm
        self.temperature, self.max_response_tokens = temperature, max_response_tokens
        self.dtype = _DTYPES[dtype]
        self.seed = seed
        self.policy_version = 0
        self._sync_group = None
        self._buckets = None
        if train.num_threads:
            torch.set_num_threads(train.num_threads)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self._use_cuda() else torch.device("cpu")

    def _use_cuda(self) -> bool:
        return torch.cuda.is_available() and self.train.num_gpus_per_worker > 0

    # ---- set-up -------------------------------------------------------------------------------------------------
    def node_address(self) -> tuple[str, int]:
        """(IP of this node, a free port on it): rank 0's answer becomes the rendezvous address."""
        import ray

        from weight_sync.group import free_port

        ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        return ip, free_port(ip)

    def init_distributed(self, master_addr: str, master_port: int) -> dict:
        """Join the train process group, build and shard the policy, reference policy and optimizer."""
        from transformers import AutoModelForCausalLM

        backend = self.train.backend if self.train.backend != "auto" else ("nccl" if self._use_cuda() else "gloo")
        if self._use_cuda():
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            backend=backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
            world_size=self.world_size, timeout=timedelta(seconds=self.train.timeout_s),
        )
        torch.manual_seed(self.seed + self.rank)

        def load(trainable: bool) -> ResponseLogprobModel:
            hf = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype)
            hf.to(self.device)
            hf.config.use_cache = False
            model = ResponseLogprobModel(hf, self.temperature)
            model.requires_grad_(trainable)
            model.train(trainable)
            _shard(model)
            return model

        self.policy = load(True)
        self.reference = load(False) if self.algorithm.kl_coef > 0 else None
        self.optimizer = torch.optim.AdamW(
            [p for p in self.policy.parameters() if p.requires_grad], lr=self.train.lr,
            betas=tuple(self.train.betas), weight_decay=self.train.weight_decay,
        )
        n_params = sum(p.numel() for p in self.policy.parameters())
        return {"rank": self.rank, "backend": backend, "num_parameters": n_params, "pid": os.getpid()}

    # ---- training -----------------------------------------------------------------------------------------------
    def train_step(self, microbatches: list[PackedMicroBatch], num_tokens: int, num_sequences: int) -> dict:
        """One optimizer step over this rank's micro-batches (every rank has the same number).

        Args:
            num_tokens, num_sequences: global response-token and sequence counts of the whole batch (all ranks).

        Returns:
            Metrics summed/averaged over all ranks (identical on every rank): ``actor/*`` and ``rollout/logprob_diff``.
        """
        t0 = time.perf_counter()
        alg = self.algorithm
        sums = torch.zeros(8, dtype=torch.float64)  # loss, kl·n, clip·n, ent·n, |Δlp|·n, n_tokens, ratio·n, fwd tokens
        self.optimizer.zero_grad(set_to_none=True)
        for mb in microbatches:
            sums += self._microbatch(mb, num_tokens, num_sequences)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.train.max_grad_norm)
        grad_norm = float(_full(grad_norm))
        dist.all_reduce(sums)
        finite = math.isfinite(grad_norm) and math.isfinite(float(sums[0]))
        if finite:
            self.optimizer.step()
            self.policy_version += 1
        self.optimizer.zero_grad(set_to_none=True)
        n = max(float(sums[5]), 1.0)
        return {
            "actor/loss": float(sums[0]),
            "actor/kl": float(sums[1]) / n,
            "actor/clip_fraction": float(sums[2]) / n,
            "actor/entropy": float(sums[3]) / n,
            "rollout/logprob_diff": float(sums[4]) / n,
            "actor/ratio_mean": float(sums[6]) / n,
            "actor/grad_norm": grad_norm,
            "actor/update_skipped": 0.0 if finite else 1.0,
            "actor/lr": self.train.lr,
            "perf/train_tokens": float(sums[7]),
            "timing/train_compute_s": time.perf_counter() - t0,
            "memory/train_peak_rss_gib": _peak_rss_gib(),
            "policy_version": self.policy_version,
        }

    def _microbatch(self, mb: PackedMicroBatch, num_tokens: int, num_sequences: int) -> torch.Tensor:
        """Forward + backward of one packed micro-batch; returns the local metric sums."""
        alg = self.algorithm
        dev = self.device
        args = (mb.input_ids.to(dev), mb.position_ids.to(dev), mb.logit_positions.to(dev), mb.targets.to(dev))
        ref_lp = None
        if self.reference is not None:
            with torch.no_grad():
                ref_flat, _ = self.reference(*args, with_entropy=False)
            ref_lp = mb.to_padded(ref_flat.float())
        lp_flat, ent_flat = self.policy(*args)
        if mb.num_sequences == 0:
            # Placeholder micro-batch: run backward on a zero loss so every rank issues the same collectives.
            (lp_flat.sum() * 0.0).backward()
            return torch.tensor([0, 0, 0, 0, 0, 0, 0, mb.num_tokens], dtype=torch.float64)
        logprobs = mb.to_padded(lp_flat)
        entropy = mb.to_padded(ent_flat)
        mask = mb.response_mask.to(dev)
        old = logprobs.detach()  # one update per rollout batch: the behaviour policy is the current policy
        loss, m = policy_loss(
            logprobs, old, mb.advantages.to(dev), mask,
            clip_eps_low=alg.clip_eps_low, clip_eps_high=alg.clip_eps_high, loss_agg=alg.loss_agg,
            ref_logprobs=ref_lp, kl_coef=alg.kl_coef, kl_estimator=alg.kl_estimator,
            entropy=entropy, entropy_coef=alg.entropy_coef,
            num_tokens=num_tokens, num_sequences=num_sequences, max_response_tokens=self.max_response_tokens,
        )
        (loss * self.world_size).backward()
        n_tok = float(mask.sum())
        diff = float(torch.where(mask, (logprobs.detach() - mb.behaviour_logprobs.to(dev)).abs(), 0.0).sum())
        kl = float(m["kl"]) if "kl" in m else 0.0
        return torch.tensor([
            float(loss.detach()), kl * n_tok, float(m["clip_fraction"]) * n_tok, float(m["entropy"]) * n_tok,
            diff, n_tok, float(m["ratio_mean"]) * n_tok, mb.num_tokens,
        ], dtype=torch.float64)

    # ---- weight sync --------------------------------------------------------------------------------------------
    def sync_plan(self, engine_dtype: str, bucket_bytes: int):
        """The bucket plan of the policy's parameters in HF names and the engine's dtype (same on every rank)."""
        from weight_sync.buckets import plan_buckets

        dt = _DTYPES[engine_dtype]
        self._engine_dtype = dt
        self._buckets = plan_buckets(
            [(name, tuple(p.shape), dt) for name, p in self._named_parameters()], bucket_bytes
        )
        return self._buckets

    def _named_parameters(self):
        """Parameters in HF checkpoint names (tied weights once), in a fixed order."""
        return list(self.policy.model.named_parameters())

    def init_sync_group(self, host: str, port: int, world_size: int, timeout_s: float) -> int:
        """Rank 0 hosts the weight-sync group (rank 0 of it); other train ranks do nothing here."""
        from weight_sync.group import SyncGroup

        if self.rank == 0:
            backend = "nccl" if self._use_cuda() else "gloo"
            self._sync_group = SyncGroup(host, port, 0, world_size, timeout_s, backend=backend)
        return self.rank

    def broadcast_weights(self, verify: bool) -> dict:
        """Stream the policy to every engine, bucket by bucket (all train ranks call this together).

        Each bucket's tensors are gathered from their shards (``full_tensor``, a collective over the train group),
        cast to the engine dtype and packed into one flat buffer; rank 0 broadcasts it asynchronously while the next
        bucket is gathered into the other buffer (double buffering). At most two buckets are materialised at once.

        Returns:
            ``{"policy_version", "seconds", "bytes", "checksums"}`` (checksums and bytes from rank 0 only).
        """
        from weight_sync.buckets import bucket_checksums, pack_bucket

        if self._buckets is None:
            raise RuntimeError("broadcast_weights called before sync_plan")
        t0 = time.perf_counter()
        params = dict(self._named_parameters())
        sender = self.rank == 0
        if sender and self._sync_group is None:
            raise RuntimeError("broadcast_weights on train rank 0 before init_sync_group")
        checksums: dict[str, int] = {}
        pending = None
        total = 0
        with torch.no_grad():
            for bucket in self._buckets:
                tensors = [_full(params[s.name]).to(self._engine_dtype) for s in bucket.slots]
                if not sender:
                    continue
                buf = pack_bucket(bucket, [t.cpu() if self.device.type == "cpu" else t for t in tensors])
                if self.device.type == "cuda":
                    buf = buf.to(self.device)
                if verify:
                    checksums.update(bucket_checksums(bucket, buf.cpu()))
                if pending is not None:
                    pending.wait()
                pending = self._sync_group.broadcast(buf, async_op=True)
                total += bucket.nbytes
            if pending is not None:
                pending.wait()
        return {"policy_version": self.policy_version, "seconds": time.perf_counter() - t0, "bytes": total,
                "checksums": checksums}

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> dict:
        """Write the policy as an HF folder (rank 0: safetensors + config) and the sharded optimizer state (all
        ranks, torch.distributed.checkpoint) under ``path/optimizer``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
        )

        t0 = time.perf_counter()
        full = get_model_state_dict(self.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            state = {k.removeprefix("model."): v for k, v in full.items()}
            self.policy.model.save_pretrained(path, state_dict=state, safe_serialization=True)
        del full
        optim = get_optimizer_state_dict(self.policy, self.optimizer)
        dcp.save({"optimizer": optim}, checkpoint_id=os.path.join(path, "optimizer"))
        dist.barrier()
        return {"seconds": time.perf_counter() - t0}

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
