"""FSDP2 train worker: one data-parallel rank of the policy (and frozen reference policy).

``FSDPTrainWorker`` is a plain class; the driver wraps it with ``ray.remote`` (resources from the spec). All ranks call
every method together: FSDP collectives (all-gather, reduce-scatter) need every rank.

Model parallel layout (torchtitan's order, ``train_workers.sharding``): ``fully_shard`` on each decoder layer, then on
the root (:class:`ResponseLogprobModel`, which owns the embedding, final norm and the tied LM head).

Precision: with ``model.dtype`` float32 everything is float32. With bfloat16/float16 the policy trains in FSDP2 mixed
precision (``sharding.shard_mixed_precision``): float32 parameters and AdamW state, forward/backward in ``model.dtype``,
gradients reduced in ``train.reduce_dtype``; the frozen reference policy (no optimizer) is held in ``model.dtype``.
Weight sync casts the float32 parameters to the engine's dtype; checkpoints hold the float32 parameters.

Loss (``grpo.losses.policy_loss``; options from ``AlgorithmSpec``): PPO clipped surrogate per token (clip-higher, dual
clip, truncated importance weights against the engine's logprobs) + β · KL to the reference policy (in the loss, or
in the advantages with ``kl_in_reward``) − entropy bonus, aggregated with global token/sequence counts so micro-batch
and rank splits do not change it. β is the spec's ``kl_coef`` until the driver sets another (adaptive controller).
FSDP2 averages gradients over ranks, so each micro-batch loss is multiplied by the world size to make that average a
sum of the per-rank sums.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from grpo.kl import kl_penalty, kl_reward_advantages
from grpo.losses import policy_loss, truncated_importance_weights
from train_workers.packing import PackedMicroBatch, packed_attention
from train_workers.policy import ResponseLogprobModel
from train_workers.sharding import as_dtype, mixed_precision_policy, shard_model

#: Layout of the per-micro-batch metric sums that ``train_step`` all-reduces (token-weighted sums unless noted).
_SUMS = {name: i for i, name in enumerate((
    "loss",            # aggregated loss (already globally normalised: sums to the batch loss)
    "kl", "clip", "entropy", "ratio", "dual_clip", "tis",
    "tokens",          # loss tokens (the weights of the sums above)
    "logprob_diff",    # Σ |trainer old logprob − engine logprob|, first iteration only
    "tokens_first",    # loss tokens of the first iteration
    "forward_tokens",  # packed tokens run forward (all passes)
    "nonfinite_loss",       # ranks whose local loss sum is NaN/Inf (0/1 per rank, so the reduced sum counts ranks)
    "nonfinite_grad_norm",  # ranks that saw a NaN/Inf global gradient norm
))}

#: Metric names reported as the cause of a skipped update, in the order they are checked.
_NONFINITE = {"nonfinite_loss": "actor/loss", "nonfinite_grad_norm": "actor/grad_norm"}

#: Phases of a train step timed on each rank (``timing/<phase>_s`` in the metrics; rank 0's numbers).
_PHASES = ("ref_forward", "behaviour", "policy_fwd_bwd", "optimizer")


@dataclass
class _Saved:
    """What the no-grad pass before the first update records for one micro-batch (``num_iterations`` > 1)."""

    old: torch.Tensor             # [n, T] float32 behaviour (old) logprobs of the policy before the update
    ref: torch.Tensor | None      # [n, T] float32 reference-policy logprobs
    forward_tokens: int


def _peak_rss_gib() -> float:
    """Peak resident memory of this process so far, GiB (Linux ru_maxrss is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _all_reduce_sum(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Sum a small CPU tensor over the train group (NCCL reduces device tensors only, so it goes via ``device``)."""
    on_device = t.to(device)
    dist.all_reduce(on_device)
    return on_device.cpu()


def _poison_one_grad(model: torch.nn.Module) -> None:
    """Test hook: set the first element of this rank's local part of the first gradient to +Inf."""
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            if g.numel():
                g.view(-1)[0] = float("inf")
                return


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
        sampling_filters: the rollout's ``{"top_k", "top_p", "min_p"}`` (policy, old-policy and reference logprobs
            are computed under them, as the engine's are); None: off.
        max_response_tokens: for the Dr. GRPO ``seq-mean-token-sum-norm`` aggregation.
        dtype: the compute dtype name (``model.dtype``): float32, or bfloat16/float16 for mixed precision with
            float32 parameters and AdamW state.
        seed: torch seed for this rank.
    """

    def __init__(self, rank: int, world_size: int, model_path: str, train, algorithm, temperature: float,
                 max_response_tokens: int, dtype: str = "float32", seed: int = 0,
                 sampling_filters: dict | None = None):
        self.rank, self.world_size = rank, world_size
        self.model_path, self.train, self.algorithm = model_path, train, algorithm
        self.temperature, self.max_response_tokens = temperature, max_response_tokens
        self.sampling_filters = dict(sampling_filters or {})
        self.dtype = as_dtype(dtype)
        self.seed = seed
        self.policy_version = 0
        self._sync_group = None
        self._buckets = None
        self._phase_s = dict.fromkeys(_PHASES, 0.0)  # seconds per train-step phase, reset by every train_step
        self._inject_nan: str | None = None  # test hook, see inject_nan_next_step
        if train.num_threads:
            torch.set_num_threads(train.num_threads)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self._use_cuda() else torch.device("cpu")
        # CPU (gloo over loopback TCP, memory to spare): a replicated reference policy and one all-gather +
        # one reduce-scatter per step; GPU: FSDP2's memory-saving defaults. Tests flip it to compare both.
        self._cpu_fast_paths = self.device.type == "cpu"

    def _use_cuda(self) -> bool:
        return torch.cuda.is_available() and self.train.num_gpus_per_worker > 0

    # ---- set-up -------------------------------------------------------------------------------------------------
    def node_address(self) -> tuple[str, int]:
        """(IP of this node, a free port on it): rank 0's answer becomes the rendezvous address."""
        import ray

        from weight_sync.group import free_port

        ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        return ip, free_port(ip)

    def init_distributed(self, master_addr: str, master_port: int, policy_path: str | None = None) -> dict:
        """Join the train process group, build and shard the policy, reference policy and optimizer.

        ``policy_path`` (a checkpoint's HF folder, on resume) initialises the policy; the reference policy always
        comes from ``model_path`` (the job's initial model)."""
        from transformers import AutoModelForCausalLM

        backend = self.train.backend if self.train.backend != "auto" else ("nccl" if self._use_cuda() else "gloo")
        if self._use_cuda():
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            backend=backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
            world_size=self.world_size, timeout=timedelta(seconds=self.train.timeout_s),
        )
        torch.manual_seed(self.seed + self.rank)

        attention = packed_attention(self._use_cuda(), self.dtype)
        # The policy's parameters (and so AdamW's state) are float32; only its compute runs in self.dtype.
        mp_policy = mixed_precision_policy(self.dtype, self.train.reduce_dtype)

        def load(trainable: bool) -> ResponseLogprobModel:
            path = (policy_path or self.model_path) if trainable else self.model_path
            dtype = torch.float32 if trainable else self.dtype
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention)
            hf.to(self.device)
            hf.config.use_cache = False
            model = ResponseLogprobModel(hf, self.temperature, **self.sampling_filters)
            model.requires_grad_(trainable)
            model.train(trainable)
            if trainable or not self._replicate_reference():
                # CPU: unsharded from the first forward to the last backward of a step (see _accumulate_locally)
                shard_model(model, mp_policy=mp_policy if trainable else None,
                            reshard_after_forward=not self._cpu_fast_paths)
            return model

        self.policy = load(True)
        self.reference = load(False) if self.algorithm.kl_coef > 0 else None
        self.kl_coef = float(self.algorithm.kl_coef)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.policy.parameters() if p.requires_grad], lr=self.train.lr,
            betas=tuple(self.train.betas), weight_decay=self.train.weight_decay,
        )
        n_params = sum(p.numel() for p in self.policy.parameters())
        info = {"rank": self.rank, "backend": backend, "num_parameters": n_params, "pid": os.getpid(),
                "device": str(self.device), "node_id": None, "gpu_ids": []}
        import ray

        if ray.is_initialized():  # where this rank really runs, read from the worker itself
            info["node_id"] = ray.get_runtime_context().get_node_id()
            info["gpu_ids"] = [str(g) for g in ray.get_gpu_ids()]
        return info

    # ---- training -----------------------------------------------------------------------------------------------
    def set_kl_coef(self, kl_coef: float) -> None:
        """Set β for the following train steps (the driver's adaptive KL controller calls this every step)."""
        if not (math.isfinite(kl_coef) and kl_coef >= 0.0):
            raise ValueError(f"kl_coef must be finite and >= 0, got {kl_coef!r}")
        if kl_coef > 0 and self.reference is None:
            raise ValueError(f"kl_coef={kl_coef} needs the reference policy, which was not loaded (spec kl_coef 0)")
        self.kl_coef = float(kl_coef)

    def train_step(self, microbatches: list[PackedMicroBatch], num_tokens: int, num_sequences: int) -> dict:
        """``algorithm.num_iterations`` optimizer steps over this rank's micro-batches (every rank has as many).

        With one iteration the behaviour (old) logprobs are the current policy's, detached, from the same forward
        pass. With more, a no-grad pass over every micro-batch first records the behaviour logprobs (and reference
        logprobs) before the first update; every iteration's importance ratio uses them.

        Args:
            num_tokens, num_sequences: global counts of loss tokens (``response_mask``) and of sequences with at least
                one loss token, over the whole batch (all ranks).

        An iteration whose loss or global gradient norm is NaN/Inf on any rank (a flag all-reduced with the metric
        sums) skips its optimizer step on every rank and drops its gradients; when every iteration is skipped the
        policy version stays where it was.

        Returns:
            Metrics summed/averaged over all ranks and iterations (identical on every rank): ``actor/*`` and
            ``rollout/logprob_diff`` (engine vs trainer before the first update); ``actor/update_skipped`` (fraction
            of iterations skipped, 0.0 or 1.0 with one iteration) and ``actor/update_skipped_reason`` (``""``, or
            the first non-finite metric: ``"actor/loss"`` or ``"actor/grad_norm"``); ``timing/<phase>_s`` (rank 0).
        """
        t0 = time.perf_counter()
        self._phase_s = dict.fromkeys(_PHASES, 0.0)
        iterations = self.algorithm.num_iterations
        saved = [self._behaviour_pass(mb) for mb in microbatches] if iterations > 1 else [None] * len(microbatches)
        totals = torch.zeros(len(_SUMS), dtype=torch.float64)
        grad_norms, applied, skip_reason = [], 0, ""
        inject, self._inject_nan = self._inject_nan, None
        for iteration in range(iterations):
            sums = torch.zeros(len(_SUMS), dtype=torch.float64)
            self.optimizer.zero_grad(set_to_none=True)
            for i, (mb, old) in enumerate(zip(microbatches, saved)):
                self._accumulate_locally(last=i == len(microbatches) - 1)
                sums += self._microbatch(mb, old, num_tokens, num_sequences, first=iteration == 0,
                                         inject_nan=inject == "loss" and i == 0)
            t_opt = time.perf_counter()
            if inject == "grad_norm":
                _poison_one_grad(self.policy)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.train.max_grad_norm)
            grad_norm = float(_full(grad_norm))
            sums[_SUMS["nonfinite_loss"]] = float(not math.isfinite(float(sums[_SUMS["loss"]])))
            sums[_SUMS["nonfinite_grad_norm"]] = float(not math.isfinite(grad_norm))
            sums = _all_reduce_sum(sums, self.device)  # every rank sees every rank's flags: all skip or none
            bad = [metric for key, metric in _NONFINITE.items() if sums[_SUMS[key]] > 0]
            if bad:
                self.optimizer.zero_grad(set_to_none=True)  # the poisoned gradients never reach AdamW's moments
                skip_reason = skip_reason or bad[0]
            else:
                self.optimizer.step()
                applied += 1
            self._phase_s["optimizer"] += time.perf_counter() - t_opt
            grad_norms.append(grad_norm)
            totals += sums
        self.optimizer.zero_grad(set_to_none=True)
        if applied:
            self.policy_version += 1
        n = max(float(totals[_SUMS["tokens"]]), 1.0)
        n_first = max(float(totals[_SUMS["tokens_first"]]), 1.0)
        metrics = {
            "actor/loss": float(totals[_SUMS["loss"]]) / iterations,
            "actor/kl": float(totals[_SUMS["kl"]]) / n,
            "actor/kl_coef": self.kl_coef,
            "actor/clip_fraction": float(totals[_SUMS["clip"]]) / n,
            "actor/entropy": float(totals[_SUMS["entropy"]]) / n,
            "rollout/logprob_diff": float(totals[_SUMS["logprob_diff"]]) / n_first,
            "actor/ratio_mean": float(totals[_SUMS["ratio"]]) / n,
            "actor/grad_norm": sum(grad_norms) / iterations,
            "actor/update_skipped": 1.0 - applied / iterations,
            "actor/update_skipped_reason": skip_reason,  # "" or the first non-finite metric ("actor/loss", ...)
            "actor/lr": self.train.lr,
            "perf/train_tokens": float(totals[_SUMS["forward_tokens"]]),
            "timing/train_compute_s": time.perf_counter() - t0,
            **{f"timing/{name}_s": seconds for name, seconds in self._phase_s.items()},
            "memory/train_peak_rss_gib": _peak_rss_gib(),
            "policy_version": self.policy_version,
        }
        if self.algorithm.dual_clip_c is not None:
            metrics["actor/dual_clip_fraction"] = float(totals[_SUMS["dual_clip"]]) / n
        if self.algorithm.tis_cap is not None:
            metrics["actor/tis_weight_mean"] = float(totals[_SUMS["tis"]]) / n
        return metrics

    def inject_nan_next_step(self, metric: str = "loss") -> None:
        """Test hook (fault injection): make this rank's next ``train_step`` non-finite.

        ``"loss"`` multiplies the first micro-batch's loss by NaN (so its gradients are NaN too); ``"grad_norm"``
        sets one gradient element to +Inf after the backward (finite loss). Only this rank is poisoned: the others
        learn of it from the all-reduced flags.

        Raises:
            ValueError: ``metric`` is neither ``"loss"`` nor ``"grad_norm"``.
        """
        if metric not in ("loss", "grad_norm"):
            raise ValueError(f"metric must be 'loss' or 'grad_norm', got {metric!r}")
        self._inject_nan = metric

    def _accumulate_locally(self, last: bool) -> None:
        """On CPU, keep the policy unsharded and its gradients local until the step's last micro-batch, so a step
        costs one all-gather and one reduce-scatter whatever its micro-batch count (gloo over loopback TCP is slow;
        the price is one unsharded copy of the parameters and gradients per rank). On GPU, FSDP2's defaults."""
        if not self._cpu_fast_paths or not hasattr(self.policy, "set_requires_gradient_sync"):
            return
        self.policy.set_requires_gradient_sync(last)
        self.policy.set_reshard_after_backward(last)

    def _inputs(self, mb: PackedMicroBatch):
        dev = self.device
        return mb.input_ids.to(dev), mb.position_ids.to(dev), mb.logit_positions.to(dev), mb.targets.to(dev)

    def _replicate_reference(self) -> bool:
        """On CPU the frozen reference policy is a full copy on every rank (one model's memory per rank, no
        all-gathers over loopback TCP); on GPU it is sharded like the policy."""
        return self._cpu_fast_paths

    def _reference_logprobs(self, mb: PackedMicroBatch, args) -> torch.Tensor | None:
        """Reference-policy logprobs [n, T] float32 of one packed micro-batch (0 at padding); None when the job has
        no reference policy (``kl_coef`` 0)."""
        if self.reference is None:
            return None
        t0 = time.perf_counter()
        # inference_mode only for the plain replicated module (FSDP2's hooks manage their own tensors)
        with torch.inference_mode(self._replicate_reference()), torch.no_grad():
            ref_flat, _ = self.reference(*args, with_entropy=False)
            out = mb.to_padded(ref_flat.float())
        out = out.clone()  # a normal tensor: the loss's autograd may save it
        self._phase_s["ref_forward"] += time.perf_counter() - t0
        return out

    def _behaviour_pass(self, mb: PackedMicroBatch) -> _Saved:
        """No-grad forward before any update: the policy's (old) and the reference policy's logprobs [n, T]."""
        args = self._inputs(mb)
        t0 = time.perf_counter()
        with torch.no_grad():
            old_flat, _ = self.policy(*args, with_entropy=False)
        self._phase_s["behaviour"] += time.perf_counter() - t0
        return _Saved(old=mb.to_padded(old_flat.float()), ref=self._reference_logprobs(mb, args),
                      forward_tokens=mb.num_tokens)

    def _microbatch(self, mb: PackedMicroBatch, saved: _Saved | None, num_tokens: int, num_sequences: int,
                    first: bool, inject_nan: bool = False) -> torch.Tensor:
        """Forward + backward of one packed micro-batch; returns the local metric sums (layout: ``_SUMS``).
        ``inject_nan`` (test hook) multiplies the loss by NaN."""
        alg = self.algorithm
        dev = self.device
        args = self._inputs(mb)
        ref_lp = saved.ref if saved is not None else self._reference_logprobs(mb, args)
        t_policy = time.perf_counter()
        lp_flat, ent_flat = self.policy(*args)
        out = torch.zeros(len(_SUMS), dtype=torch.float64)
        out[_SUMS["forward_tokens"]] = mb.num_tokens + (saved.forward_tokens if saved is not None and first else 0)
        if mb.num_sequences == 0:
            # Placeholder micro-batch: run backward on a zero loss so every rank issues the same collectives.
            zero = lp_flat.sum() * 0.0
            if inject_nan:
                zero = zero * float("nan")
                out[_SUMS["loss"]] = float("nan")
            zero.backward()
            self._phase_s["policy_fwd_bwd"] += time.perf_counter() - t_policy
            return out
        logprobs = mb.to_padded(lp_flat)
        entropy = mb.to_padded(ent_flat)
        mask = mb.response_mask.to(dev)
        behaviour = mb.behaviour_logprobs.to(dev)
        # One iteration: the behaviour policy is the current policy (same weights), so its logprobs are these.
        old = saved.old if saved is not None else logprobs.detach()
        advantages, kl_coef = mb.advantages.to(dev), self.kl_coef
        if alg.kl_in_reward:
            kl = kl_penalty(old, ref_lp, alg.kl_estimator)  # the reward is fixed per rollout: behaviour logprobs
            advantages, kl_coef = kl_reward_advantages(advantages, kl, mask, self.kl_coef), 0.0
        tis = truncated_importance_weights(old, behaviour, mask, alg.tis_cap) if alg.tis_cap is not None else None
        loss, m = policy_loss(
            logprobs, old, advantages, mask,
            clip_eps_low=alg.clip_eps_low, clip_eps_high=alg.clip_eps_high, dual_clip_c=alg.dual_clip_c,
            loss_agg=alg.loss_agg, ref_logprobs=ref_lp, kl_coef=kl_coef, kl_estimator=alg.kl_estimator,
            entropy=entropy, entropy_coef=alg.entropy_coef, tis_weights=tis,
            num_tokens=num_tokens, num_sequences=num_sequences, max_response_tokens=self.max_response_tokens,
        )
        if inject_nan:
            loss = loss * float("nan")
        (loss * self.world_size).backward()
        self._phase_s["policy_fwd_bwd"] += time.perf_counter() - t_policy
        n_tok = float(mask.sum())
        out[_SUMS["loss"]] = float(loss.detach())
        out[_SUMS["tokens"]] = n_tok
        for key, name in (("kl", "kl"), ("clip", "clip_fraction"), ("entropy", "entropy"), ("ratio", "ratio_mean"),
                          ("dual_clip", "dual_clip_fraction")):
            if name in m:
                out[_SUMS[key]] = float(m[name]) * n_tok
        if tis is not None:
            out[_SUMS["tis"]] = float(tis.sum())
        if first:
            known = mask & torch.isfinite(behaviour)  # non-finite engine logprobs: counted by the driver instead
            out[_SUMS["logprob_diff"]] = float(torch.where(known, (old - behaviour).abs(), 0.0).sum())
            out[_SUMS["tokens_first"]] = float(known.sum())
        return out

    # ---- weight sync --------------------------------------------------------------------------------------------
    def sync_plan(self, engine_dtype: str, bucket_bytes: int):
        """The bucket plan of the policy's parameters in HF names and the engine's dtype (same on every rank)."""
        from weight_sync.buckets import plan_buckets

        dt = as_dtype(engine_dtype)
        self._engine_dtype = dt
        self._buckets = plan_buckets(
            [(name, tuple(p.shape), dt) for name, p in self._named_parameters()], bucket_bytes
        )
        return self._buckets

    def _named_parameters(self):
        """Parameters in HF checkpoint names (tied weights once), in a fixed order."""
        return list(self.policy.model.named_parameters())

    def _sync_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """The whole of one parameter (a collective over the train group) as the engine holds it: the float32
        (master) parameter cast to the ``sync_plan`` engine dtype."""
        return _full(param.detach()).to(self._engine_dtype)

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

    def broadcast_weights(self, verify: bool | list[str]) -> dict:
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
            ``{"policy_version", "seconds", "bytes", "checksums", "peak_extra_bytes", "peak_extra_bytes_accounted"}``
            (bytes, checksums and memory from rank 0; see ``stream_buckets``).

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
        params = dict(self._named_parameters())
        check = [s.name for b in self._buckets for s in b.slots] if verify is True else (verify or [])
        try:
            report = stream_buckets(self._buckets, lambda name: self._sync_tensor(params[name]), sender, check,
                                    self.device)
        except Exception:
            self.close_sync_group()
            raise
        return {"policy_version": self.policy_version, **report}

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> dict:
        """Write the policy (float32 parameters, an HF folder) and the AdamW state to ``path`` (all ranks call it;
        layout and dtypes: ``train_workers.checkpoint_io``); returns ``{"seconds"}``."""
        from train_workers.checkpoint_io import save_checkpoint

        t0 = time.perf_counter()
        save_checkpoint(self.policy, self.optimizer, self.rank, path)
        return {"seconds": time.perf_counter() - t0}

    def load_checkpoint(self, path: str, policy_version: int) -> dict[str, tuple]:
        """Restore the AdamW moments and step saved by :meth:`save_checkpoint` (the policy weights were loaded by
        ``init_distributed(policy_path=path)``) and continue at ``policy_version``; the hyperparameters stay this
        run's (its spec's), so ``actor/lr`` is the lr in use (``checkpoint_io.load_optimizer_state``).

        Returns:
            ``{field: (saved value, value in use)}`` for every optimizer field that differs from the checkpoint (the
            driver logs them in one line).

        Raises:
            FileNotFoundError: the optimizer files are missing. ValueError: they name unknown parameters.
        """
        from train_workers.checkpoint_io import load_optimizer_state

        changed = load_optimizer_state(self.policy, self.optimizer, path)
        self.policy_version = int(policy_version)
        return changed

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
