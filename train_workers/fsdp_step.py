"""The FSDP2 train step: micro-batch loss, gradient clipping, the NaN/Inf skip, the step's metrics.

:class:`FSDPStep` is the training half of :class:`train_workers.fsdp_worker.FSDPTrainWorker` (a mixin: the worker
builds ``policy``, ``reference``, ``optimizer``, ``device``; this file uses them). Seams a subclass may override
(``tests/faults.py`` does, to inject non-finite steps): :meth:`FSDPStep._microbatch_loss` and
:meth:`FSDPStep._clip_gradients`; a backend whose own schedule runs the micro-batches (Megatron's pipeline,
``train_workers.megatron.pipeline``) overrides :meth:`FSDPStep._forward_backward` and
:meth:`FSDPStep._behaviour_passes` and still computes each micro-batch's loss with :meth:`FSDPStep._microbatch_loss`.

Loss (``grpo.losses.policy_loss``; options from ``AlgorithmSpec``): PPO clipped surrogate per token (clip-higher, dual
clip, truncated importance weights against the engine's logprobs) + β · KL to the reference policy (in the loss, or
in the advantages with ``kl_in_reward``) − entropy bonus, aggregated with global token/sequence counts so micro-batch
and rank splits do not change it. β is the spec's ``kl_coef`` until the driver sets another (adaptive controller).
FSDP2 averages gradients over ranks, so each micro-batch loss is multiplied by the world size to make that average a
sum of the per-rank sums.

Off-policy correction (``grpo.off_policy``; decoupled PPO): the proximal policy is the trainer's policy at the start of
the step (the "old" logprobs), the behaviour policy is the engine that sampled the tokens (``behaviour_logprobs``).
``algorithm.tis_cap`` with ``tis_level`` re-weights the pg term by truncated ratios proximal/behaviour, per token or
per sequence. ``algorithm.mis`` drops tokens (or sequences) whose ratio is outside the band from the loss: the
proximal logprobs are then recorded by a no-grad pass before the first update (also with one iteration), the kept
tokens and sequences are counted over all ranks, and the loss is aggregated over the kept tokens with those counts as
the global denominators — a dropped token adds nothing to the numerator and is not counted in the denominator
(``token-mean``: kept tokens; ``seq-mean-token-mean``: each sequence's mean over its kept tokens, divided by the
sequences with at least one kept token; ``seq-mean-token-sum-norm``: kept sequences x max_response_tokens), so the
step's loss is exactly ``grpo.losses.aggregate_loss`` of the whole batch under the kept mask, whatever the micro-batch
and rank split, and its scale does not shrink as more tokens are dropped. The per-token metrics ``actor/kl``,
``clip_fraction``, ``entropy``, ``ratio_mean``, ``tis_weight_mean`` are then means over kept tokens. KL in the reward
(``kl_in_reward``) still uses every valid token: the reward belongs to the rollout.

Notation: n sequences in a micro-batch, T their longest response (tokens).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from contract.messages import TrainResult
from grpo.kl import kl_penalty, kl_reward_advantages
from grpo.losses import policy_loss
from grpo.off_policy import behaviour_kl_k3, importance_log_ratio, importance_weights, mis_keep_mask, sequence_log_ratio
from contract.batches import PackedMicroBatch
from train_workers.sharding import full_tensor

#: Layout of the per-micro-batch metric sums that ``train_step`` all-reduces (token-weighted sums unless noted).
SUMS = {name: i for i, name in enumerate((
    "loss",            # aggregated loss (already globally normalised: sums to the batch loss)
    "kl", "clip", "entropy", "ratio", "dual_clip", "tis",
    "tokens",          # loss tokens (the weights of the sums above)
    "logprob_diff",    # Σ |trainer old logprob − engine logprob|, first iteration only
    "tokens_first",    # loss tokens of the first iteration
    "forward_tokens",  # packed tokens run forward (all passes)
    "nonfinite_loss",       # ranks whose local loss sum is NaN/Inf (0/1 per rank, so the reduced sum counts ranks)
    "nonfinite_grad_norm",  # ranks that saw a NaN/Inf global gradient norm
    # off-policy correction (tis_cap or mis set), first iteration only:
    "mis_masked",           # valid loss tokens that MIS dropped
    "tokens_valid_first",   # valid loss tokens before MIS
    "kl_behaviour",         # Σ k3 estimate of KL(behaviour || proximal) over tokens with a finite engine logprob
))}

#: Layout of the off-policy extremes that ``train_step`` all-reduces with MAX (log space; -inf: no token).
EXTREMES = {name: i for i, name in enumerate((
    "log_ratio_max", "neg_log_ratio_min",          # token ratio proximal / behaviour
    "seq_log_ratio_max", "neg_seq_log_ratio_min",  # geometric-mean ratio of each sequence
))}

#: Metric names reported as the cause of a skipped update, in the order they are checked.
_NONFINITE = {"nonfinite_loss": "actor/loss", "nonfinite_grad_norm": "actor/grad_norm"}

#: Phases of a train step timed on each rank (``timing/<phase>_s`` in the metrics; rank 0's numbers).
PHASES = ("ref_forward", "behaviour", "policy_fwd_bwd", "optimizer")


@dataclass
class Saved:
    """What the no-grad pass before the first update records for one micro-batch (``num_iterations`` > 1)."""

    old: torch.Tensor | None      # [n, T] float32 behaviour (old) logprobs of the policy before the update
    #                               (None on a pipeline stage that does not compute the loss: Megatron pp > 1)
    ref: torch.Tensor | None      # [n, T] float32 reference-policy logprobs
    forward_tokens: int
    keep: torch.Tensor | None = None  # [n, T] bool: tokens that algorithm.mis keeps in the loss (None: MIS off)


def _peak_rss_gib() -> float:
    """Peak resident memory of this process so far, GiB (Linux ru_maxrss is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor passes through)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _all_reduce_sum(t: torch.Tensor, device: torch.device, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """Sum (or ``op``) a small CPU tensor over ``group`` (None: the train group; NCCL reduces device tensors only,
    so it goes via ``device``)."""
    on_device = t.to(device)
    dist.all_reduce(on_device, op=op, group=group)
    return on_device.cpu()


class FSDPStep:
    """Train-step methods of :class:`train_workers.fsdp_worker.FSDPTrainWorker`.

    Uses the worker's ``policy``, ``reference`` (or None), ``optimizer``, ``device``, ``world_size``, ``train``,
    ``algorithm``, ``kl_coef``, ``max_response_tokens``, ``policy_version`` and ``_cpu_fast_paths``; keeps the step's
    phase seconds in ``_phase_s`` (keys :data:`PHASES`).
    """

    _lora = None  # train_workers.lora.LoraPolicy when train.lora is set (the worker builds it), else None
    #: Process group the step's metric sums and counts are reduced over: None, the whole train group (FSDP2: every
    #: rank holds different sequences); a backend whose ranks share sequences (Megatron's tensor-parallel ranks)
    #: sets its data-parallel group, so each sequence is counted once.
    _metrics_group = None

    def _has_reference(self) -> bool:
        """Whether the job has a reference policy: a frozen copy (``self.reference``) or, with LoRA, the policy with
        its adapters off."""
        return self.reference is not None or (self._lora is not None and self._lora.with_reference)

    def set_kl_coef(self, kl_coef: float) -> None:
        """Set β for the following train steps (the driver's adaptive KL controller calls this every step).

        Raises:
            ValueError: ``kl_coef`` is negative or not finite, or > 0 without a reference policy.
        """
        if not (math.isfinite(kl_coef) and kl_coef >= 0.0):
            raise ValueError(f"kl_coef must be finite and >= 0, got {kl_coef!r}")
        if kl_coef > 0 and not self._has_reference():
            raise ValueError(f"kl_coef={kl_coef} needs the reference policy, which was not loaded (spec kl_coef 0)")
        self.kl_coef = float(kl_coef)

    def train_step(self, microbatches: list[PackedMicroBatch], num_tokens: int, num_sequences: int) -> TrainResult:
        """``algorithm.num_iterations`` optimizer steps over this rank's micro-batches (every rank has as many).

        With one iteration the behaviour (old) logprobs are the current policy's, detached, from the same forward
        pass. With more, or with ``algorithm.mis``, a no-grad pass over every micro-batch first records the behaviour
        logprobs (and reference logprobs) before the first update; every iteration's importance ratio uses them.
        With ``algorithm.mis`` the loss is aggregated over the kept tokens, with kept counts (module doc) in place of
        ``num_tokens`` / ``num_sequences``.

        Args:
            num_tokens, num_sequences: global counts of loss tokens (``response_mask``) and of sequences with at least
                one loss token, over the whole batch (all ranks).

        An iteration whose loss or global gradient norm is NaN/Inf on any rank (a flag all-reduced with the metric
        sums) skips its optimizer step on every rank and drops its gradients; when every iteration is skipped the
        policy version stays where it was.

        Returns:
            :class:`TrainResult`, identical on every rank: ``policy_version`` after the step; ``skipped`` (any
            iteration skipped) and ``skip_reason`` (``""``, or the first non-finite metric: ``"actor/loss"`` or
            ``"actor/grad_norm"``); ``metrics`` summed/averaged over all ranks and iterations: ``actor/*`` (with
            ``actor/update_skipped``, the fraction of iterations skipped, 0.0 or 1.0 with one iteration) and
            ``rollout/logprob_diff`` (engine vs trainer before the first update); ``timing/<phase>_s`` (rank 0).
        """
        t0 = time.perf_counter()
        self._phase_s = dict.fromkeys(PHASES, 0.0)
        self._extremes = torch.full((len(EXTREMES),), -math.inf, dtype=torch.float64)
        iterations, mis = self.algorithm.num_iterations, self.algorithm.mis
        saved = self._behaviour_passes(microbatches) if iterations > 1 or mis is not None \
            else [None] * len(microbatches)
        if mis is not None:
            num_tokens, num_sequences = self._mis_keep(microbatches, saved)
        totals = torch.zeros(len(SUMS), dtype=torch.float64)
        grad_norms, applied, skip_reason = [], 0, ""
        for iteration in range(iterations):
            self.optimizer.zero_grad(set_to_none=True)
            sums = self._forward_backward(microbatches, saved, num_tokens, num_sequences, first=iteration == 0)
            t_opt = time.perf_counter()
            grad_norm = self._clip_gradients()
            sums[SUMS["nonfinite_loss"]] = float(not math.isfinite(float(sums[SUMS["loss"]])))
            sums[SUMS["nonfinite_grad_norm"]] = float(not math.isfinite(grad_norm))
            # every rank sees every rank's flags: all skip or none
            sums = _all_reduce_sum(sums, self.device, group=self._metrics_group)
            bad = [metric for key, metric in _NONFINITE.items() if sums[SUMS[key]] > 0]
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
        metrics = self._step_metrics(totals, grad_norms, applied, iterations, t0)
        if self._correcting():
            metrics.update(self._off_policy_metrics(totals))
        return TrainResult(policy_version=self.policy_version, skipped=applied < iterations,
                           skip_reason=skip_reason, metrics=metrics, kl=metrics["actor/kl"])

    def _step_metrics(self, totals: torch.Tensor, grad_norms: list[float], applied: int, iterations: int,
                      t0: float) -> dict[str, float]:
        """The step's metrics from the all-reduced sums (layout :data:`SUMS`) of every iteration."""
        n = max(float(totals[SUMS["tokens"]]), 1.0)
        n_first = max(float(totals[SUMS["tokens_first"]]), 1.0)
        metrics = {
            "actor/loss": float(totals[SUMS["loss"]]) / iterations,
            "actor/kl": float(totals[SUMS["kl"]]) / n,
            "actor/kl_coef": self.kl_coef,
            "actor/clip_fraction": float(totals[SUMS["clip"]]) / n,
            "actor/entropy": float(totals[SUMS["entropy"]]) / n,
            "rollout/logprob_diff": float(totals[SUMS["logprob_diff"]]) / n_first,
            "actor/ratio_mean": float(totals[SUMS["ratio"]]) / n,
            "actor/grad_norm": sum(grad_norms) / iterations,
            "actor/update_skipped": 1.0 - applied / iterations,
            "actor/lr": self.train.lr,
            "perf/train_tokens": float(totals[SUMS["forward_tokens"]]),
            "timing/train_compute_s": time.perf_counter() - t0,
            **{f"timing/{name}_s": seconds for name, seconds in self._phase_s.items()},
            "memory/train_peak_rss_gib": _peak_rss_gib(),
        }
        if self._lora is not None:
            metrics.update(self._lora_metrics())
        if self.algorithm.dual_clip_c is not None:
            metrics["actor/dual_clip_fraction"] = float(totals[SUMS["dual_clip"]]) / n
        if self.algorithm.tis_cap is not None:
            metrics["actor/tis_weight_mean"] = float(totals[SUMS["tis"]]) / n
        return metrics

    def _correcting(self) -> bool:
        """Whether an off-policy correction is on (``algorithm.tis_cap`` or ``algorithm.mis``): its metrics are
        reported then only, so a job without one logs exactly the metrics it always did."""
        return self.algorithm.tis_cap is not None or self.algorithm.mis is not None

    def _off_policy_metrics(self, totals: torch.Tensor) -> dict[str, float]:
        """The correction's metrics from the all-reduced sums of the first iteration, and the token and sequence
        ratio extremes (a MAX all-reduce: a collective, every rank calls it), exact over all ranks:
        ``actor/kl_behaviour_current`` (mean k3 estimate of KL(engine || trainer before the step) per token with a
        finite engine logprob), ``actor/behaviour_ratio_min/max`` (token ratio trainer/engine),
        ``actor/behaviour_seq_ratio_min/max`` (geometric-mean ratio of a sequence; NaN when there is no token) and,
        with MIS, ``actor/mis_masked_fraction`` (dropped / valid loss tokens)."""
        ext = torch.exp(_all_reduce_sum(self._extremes, self.device, op=dist.ReduceOp.MAX, group=self._metrics_group))

        def extreme(name: str, negate: bool) -> float:
            value = float(ext[EXTREMES[name]])
            return math.nan if value == 0.0 else (1.0 / value if negate else value)  # exp(-inf) = 0: no token

        out = {
            "actor/kl_behaviour_current": float(totals[SUMS["kl_behaviour"]]) / max(
                float(totals[SUMS["tokens_first"]]), 1.0),
            "actor/behaviour_ratio_min": extreme("neg_log_ratio_min", True),
            "actor/behaviour_ratio_max": extreme("log_ratio_max", False),
            "actor/behaviour_seq_ratio_min": extreme("neg_seq_log_ratio_min", True),
            "actor/behaviour_seq_ratio_max": extreme("seq_log_ratio_max", False),
        }
        if self.algorithm.mis is not None:
            out["actor/mis_masked_fraction"] = float(totals[SUMS["mis_masked"]]) / max(
                float(totals[SUMS["tokens_valid_first"]]), 1.0)
        return out

    def _mis_keep(self, microbatches: list[PackedMicroBatch], saved: list[Saved]) -> tuple[int, int]:
        """Record ``algorithm.mis``'s keep mask in each micro-batch's :class:`Saved` (from the proximal logprobs of
        the no-grad pass) and return the global (all ranks) counts of kept tokens and of sequences with at least one
        kept token: the loss aggregation's denominators. A collective."""
        mis = self.algorithm.mis
        counts = torch.zeros(2, dtype=torch.float64)
        for mb, s in zip(microbatches, saved):
            if mb.num_sequences == 0 or s.old is None:  # None: a pipeline stage without the loss (Megatron pp > 1)
                continue
            s.keep = mis_keep_mask(s.old, mb.behaviour_logprobs.to(self.device), mb.response_mask.to(self.device),
                                   mis.low, mis.high, mis.level)
            counts[0] += float(s.keep.sum())
            counts[1] += float(s.keep.any(dim=-1).sum())
        counts = _all_reduce_sum(counts, self.device, group=self._metrics_group)
        return int(counts[0]), int(counts[1])

    def _lora_metrics(self) -> dict[str, float]:
        """With ``train.lora`` only (a collective: every rank's peak RSS is summed into its own slot):
        ``actor/trainable_parameters`` and ``actor/trainable_fraction`` (adapters, whole model), every rank's
        ``memory/train_rank<r>_peak_rss_gib`` and rank 0's ``memory/train_optimizer_state_gib`` (its AdamW shards)."""
        rss = torch.zeros(self.world_size, dtype=torch.float64)
        rss[self.rank] = _peak_rss_gib()
        rss = _all_reduce_sum(rss, self.device)
        state_bytes = sum(_local(v).numel() * _local(v).element_size() for per_param in self.optimizer.state.values()
                          for v in per_param.values() if isinstance(v, torch.Tensor))
        return {**self._lora.metrics(),
                **{f"memory/train_rank{r}_peak_rss_gib": float(v) for r, v in enumerate(rss)},
                "memory/train_optimizer_state_gib": state_bytes / 2**30}

    def _clip_gradients(self) -> float:
        """Clip the policy's gradients to ``train.max_grad_norm`` (global L2 norm over all ranks, in place) and
        return the norm before clipping; NaN/Inf when any gradient element is (the step is then skipped)."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.train.max_grad_norm)
        return float(full_tensor(grad_norm))

    def _accumulate_locally(self, last: bool) -> None:
        """On CPU, keep the policy unsharded and its gradients local until the step's last micro-batch, so a step
        costs one all-gather and one reduce-scatter whatever its micro-batch count (gloo over loopback TCP is slow;
        the price is one unsharded copy of the parameters and gradients per rank). On GPU, FSDP2's defaults."""
        if not self._cpu_fast_paths or not hasattr(self.policy, "set_requires_gradient_sync"):
            return
        self.policy.set_requires_gradient_sync(last)
        self.policy.set_reshard_after_backward(last)

    def _inputs(self, mb: PackedMicroBatch):
        """``(input_ids, position_ids, logit_positions, targets)`` of ``mb`` on this rank's device."""
        dev = self.device
        return mb.input_ids.to(dev), mb.position_ids.to(dev), mb.logit_positions.to(dev), mb.targets.to(dev)

    def _replicate_reference(self) -> bool:
        """On CPU the frozen reference policy is a full copy on every rank (one model's memory per rank, no
        all-gathers over loopback TCP); on GPU it is sharded like the policy."""
        return self._cpu_fast_paths

    def reference_logprobs(self, mb: PackedMicroBatch) -> torch.Tensor | None:
        """Reference-policy logprobs [n, T] float32 of one packed micro-batch (0 at padding); None when the job has
        no reference policy (``kl_coef`` 0). A collective on GPU (the reference policy is sharded there) and with
        LoRA, where the reference policy is the sharded policy run with its adapters off; the policy is left sharded
        as it was found (a train step instead keeps it gathered for the policy's own forward)."""
        out = self._reference_logprobs(mb, self._inputs(mb))
        if self._lora is not None:
            from torch.distributed.fsdp import FSDPModule

            for module in self.policy.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        return out

    def _reference_logprobs(self, mb: PackedMicroBatch, args: tuple) -> torch.Tensor | None:
        """:meth:`reference_logprobs` inside a train step, on ``mb``'s tensors already on the device
        (:meth:`_inputs`)."""
        if not self._has_reference():
            return None
        t0 = time.perf_counter()
        if self._lora is not None:
            module, context, replicated = self.policy, self._lora.adapters_off(), False
        else:
            module, context, replicated = self.reference, contextlib.nullcontext(), self._replicate_reference()
        # inference_mode only for the plain replicated module (FSDP2's hooks manage their own tensors)
        with context, torch.inference_mode(replicated), torch.no_grad():
            ref_flat, _ = module(*args, with_entropy=False)
            out = mb.to_padded(ref_flat.float())
        out = out.clone()  # a normal tensor: the loss's autograd may save it
        self._phase_s["ref_forward"] += time.perf_counter() - t0
        return out

    def _forward_backward(self, microbatches: list[PackedMicroBatch], saved: list[Saved | None], num_tokens: int,
                          num_sequences: int, first: bool) -> torch.Tensor:
        """Forward + backward of every micro-batch of one iteration (gradients accumulate in ``.grad``); returns the
        local metric sums, float64 [len(SUMS)]. A backend whose schedule owns the micro-batch loop (Megatron's
        pipeline) overrides this and calls :meth:`_microbatch_loss` for each micro-batch's loss."""
        sums = torch.zeros(len(SUMS), dtype=torch.float64)
        for i, (mb, old) in enumerate(zip(microbatches, saved)):
            self._accumulate_locally(last=i == len(microbatches) - 1)
            sums += self._microbatch(mb, old, num_tokens, num_sequences, first=first)
        return sums

    def _behaviour_passes(self, microbatches: list[PackedMicroBatch]) -> list[Saved]:
        """:meth:`_behaviour_pass` of every micro-batch, in order."""
        return [self._behaviour_pass(mb) for mb in microbatches]

    def _behaviour_pass(self, mb: PackedMicroBatch) -> Saved:
        """No-grad forward before any update: the policy's (old) and the reference policy's logprobs [n, T]."""
        args = self._inputs(mb)
        t0 = time.perf_counter()
        with torch.no_grad():
            old_flat, _ = self.policy(*args, with_entropy=False)
        self._phase_s["behaviour"] += time.perf_counter() - t0
        return Saved(old=mb.to_padded(old_flat.float()), ref=self._reference_logprobs(mb, args),
                     forward_tokens=mb.num_tokens)

    def _microbatch(self, mb: PackedMicroBatch, saved: Saved | None, num_tokens: int, num_sequences: int,
                    first: bool) -> torch.Tensor:
        """Forward + backward of one packed micro-batch; returns the local metric sums (layout: :data:`SUMS`)."""
        args = self._inputs(mb)
        ref_lp = saved.ref if saved is not None else self._reference_logprobs(mb, args)
        t_policy = time.perf_counter()
        loss, out = self._microbatch_loss(mb, args, saved, ref_lp, num_tokens, num_sequences, first)
        (loss * self.world_size).backward()
        self._phase_s["policy_fwd_bwd"] += time.perf_counter() - t_policy
        return out

    def _microbatch_loss(self, mb: PackedMicroBatch, args: tuple, saved: Saved | None,
                         ref_lp: torch.Tensor | None, num_tokens: int, num_sequences: int,
                         first: bool, policy_out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Policy forward and loss of one packed micro-batch (no backward).

        Args:
            args: ``mb``'s tensors on the device (:meth:`_inputs`). saved: the behaviour pass's record (several
                iterations) or None. ref_lp: reference logprobs [n, T] float32 or None. first: the step's first
                iteration (``rollout/logprob_diff`` is measured then). policy_out: the policy's (logprobs [M],
                entropy [M]) when a pipeline schedule already ran the forward (``args`` is then unused); None runs
                ``self.policy(*args)`` here.

        Returns:
            (loss: scalar float32 with autograd, this rank's share of the globally normalised batch loss — 0 times
            the forward for a placeholder micro-batch, so every rank issues the same collectives in the backward;
            the local metric sums, float64 [len(SUMS)]).
        """
        alg = self.algorithm
        dev = self.device
        lp_flat, ent_flat = self.policy(*args) if policy_out is None else policy_out
        out = torch.zeros(len(SUMS), dtype=torch.float64)
        out[SUMS["forward_tokens"]] = mb.num_tokens + (saved.forward_tokens if saved is not None and first else 0)
        if mb.num_sequences == 0:
            return lp_flat.sum() * 0.0, out
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
        tis = importance_weights(old, behaviour, mask, alg.tis_cap, alg.tis_level) if alg.tis_cap is not None else None
        loss_mask = saved.keep if saved is not None and saved.keep is not None else mask  # MIS: kept tokens only
        loss, m = policy_loss(
            logprobs, old, advantages, loss_mask,
            clip_eps_low=alg.clip_eps_low, clip_eps_high=alg.clip_eps_high, dual_clip_c=alg.dual_clip_c,
            loss_agg=alg.loss_agg, ref_logprobs=ref_lp, kl_coef=kl_coef, kl_estimator=alg.kl_estimator,
            entropy=entropy, entropy_coef=alg.entropy_coef, tis_weights=tis,
            num_tokens=num_tokens, num_sequences=num_sequences, max_response_tokens=self.max_response_tokens,
        )
        n_tok = float(loss_mask.sum())
        out[SUMS["loss"]] = float(loss.detach())
        out[SUMS["tokens"]] = n_tok
        for key, name in (("kl", "kl"), ("clip", "clip_fraction"), ("entropy", "entropy"), ("ratio", "ratio_mean"),
                          ("dual_clip", "dual_clip_fraction")):
            if name in m:
                out[SUMS[key]] = float(m[name]) * n_tok
        if tis is not None:
            out[SUMS["tis"]] = float(torch.where(loss_mask, tis, 0.0).sum())
        if first:
            known = mask & torch.isfinite(behaviour)  # non-finite engine logprobs: counted by the driver instead
            out[SUMS["logprob_diff"]] = float(torch.where(known, (old - behaviour).abs(), 0.0).sum())
            out[SUMS["tokens_first"]] = float(known.sum())
            if self._correcting():
                self._record_off_policy(out, old, behaviour, mask, loss_mask)
        return loss, out

    def _record_off_policy(self, out: torch.Tensor, old: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
                           loss_mask: torch.Tensor) -> None:
        """Add one micro-batch's off-policy sums to ``out`` (layout :data:`SUMS`) and its ratio extremes to
        ``self._extremes`` (layout :data:`EXTREMES`). old, behaviour: [n, T] float32; mask, loss_mask: [n, T] bool
        (valid loss tokens; those MIS keeps)."""
        k3, _ = behaviour_kl_k3(old, behaviour, mask)
        out[SUMS["kl_behaviour"]] = float(k3.sum())
        out[SUMS["tokens_valid_first"]] = float(mask.sum())
        out[SUMS["mis_masked"]] = float((mask & ~loss_mask).sum())
        log_ratio, known = importance_log_ratio(old, behaviour, mask)
        seq = sequence_log_ratio(log_ratio, mask, "mean")[mask.any(dim=-1)]
        for values, hi, lo in ((log_ratio[known], "log_ratio_max", "neg_log_ratio_min"),
                               (seq, "seq_log_ratio_max", "neg_seq_log_ratio_min")):
            if values.numel():
                self._extremes[EXTREMES[hi]] = max(float(self._extremes[EXTREMES[hi]]), float(values.max()))
                self._extremes[EXTREMES[lo]] = max(float(self._extremes[EXTREMES[lo]]), float(-values.min()))
