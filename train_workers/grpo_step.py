"""The GRPO train step, backend-neutral: micro-batch loss, KL, off-policy correction, NaN/Inf skip, metrics.

:class:`GRPOStep` is composed with a backend's :class:`~train_workers.step_engine.StepEngine` (FSDP2:
:class:`train_workers.fsdp_engine.FSDPEngine`; Megatron-core: :class:`train_workers.megatron.engine.MegatronEngine`),
which runs the forwards and backwards, clips and applies the gradients and reduces the metric sums over the ranks.
Both workers hold one of each (``worker.step``, ``worker.engine``). Seams a test subclass may override
(``tests/faults.py`` does, to inject non-finite steps): :meth:`GRPOStep._microbatch_loss` and
:meth:`GRPOStep._forward_backward`.

Loss (``grpo.losses.policy_loss``; options from ``AlgorithmSpec``): the policy-gradient term of ``policy_loss`` (PPO
clipped surrogate per token by default; GSPO, GSPO-token, CISPO: ``grpo.policy_losses``) with clip-higher, dual
clip, truncated importance weights against the engine's logprobs + β · KL to the reference policy (in the loss, or
in the advantages with ``kl_in_reward``) − entropy bonus, aggregated with global token/sequence counts so micro-batch
and rank splits do not change it. β is the spec's ``kl_coef`` until the driver sets another (adaptive controller).
Each micro-batch's loss is this rank's share of the batch loss; the engine scales it for its gradient reduction
(FSDP2 averages gradients over ranks, so both engines back-propagate it times the world size).

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

Pipeline parallelism: when the engine has a schedule (``engine.pipeline``, Megatron pp > 1) the behaviour, reference
and gradient passes each run every micro-batch through it; only the stage that computes the loss holds logprobs (the
other stages' records carry ``old=None`` and their metric sums are zeros).

Notation: n sequences in a micro-batch, T their longest response (tokens).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from contract.batches import PackedMicroBatch
from contract.messages import TrainResult
from grpo.kl import kl_penalty, kl_reward_advantages
from grpo.losses import policy_loss
from grpo.off_policy import behaviour_kl_k3, importance_log_ratio, importance_weights, mis_keep_mask, sequence_log_ratio
from train_workers.step_engine import StepEngine
from train_workers.step_metrics import (EXTREMES, NONFINITE, PHASES, SUMS, off_policy_metrics, option_metrics,
                                        step_metrics)


@dataclass
class Saved:
    """What the no-grad pass before the first update records for one micro-batch (several iterations, or MIS)."""

    old: torch.Tensor | None      # [n, T] float32 behaviour (old) logprobs of the policy before the update
    #                               (None on a pipeline stage that does not compute the loss: Megatron pp > 1)
    ref: torch.Tensor | None      # [n, T] float32 reference-policy logprobs
    forward_tokens: int
    keep: torch.Tensor | None = None  # [n, T] bool: tokens that algorithm.mis keeps in the loss (None: MIS off)


class GRPOStep:
    """The GRPO step of one train rank over its engine (module docstring).

    Args:
        engine: the backend's models (:class:`~train_workers.step_engine.StepEngine`).
        algorithm: the spec's ``AlgorithmSpec``. train: its ``TrainSpec`` (``lr``: the starting learning rate).
        max_response_tokens: for the Dr. GRPO ``seq-mean-token-sum-norm`` aggregation.

    Attributes:
        kl_coef: β in use (:meth:`set_kl_coef`). lr: the learning rate in use (:meth:`set_lr`), ``actor/lr``.
        phase_s: seconds per phase of the last step (keys :data:`~train_workers.step_metrics.PHASES`).
        traced: the last step's ``TrainResult.token_logprobs`` (this rank's traced sequences).
    """

    def __init__(self, engine: StepEngine, algorithm, train, max_response_tokens: int):
        self.engine, self.algorithm, self.train = engine, algorithm, train
        self.max_response_tokens = max_response_tokens
        self.kl_coef = float(algorithm.kl_coef)
        self.lr = float(train.lr)
        self.phase_s = dict.fromkeys(PHASES, 0.0)
        self._extremes = torch.full((len(EXTREMES),), -math.inf, dtype=torch.float64)
        self.traced: dict[int, list[float]] = {}

    def set_kl_coef(self, kl_coef: float) -> None:
        """Set β for the following train steps (the driver's adaptive KL controller calls this every step).

        Raises:
            ValueError: ``kl_coef`` is negative or not finite, or > 0 without a reference policy.
        """
        if not (math.isfinite(kl_coef) and kl_coef >= 0.0):
            raise ValueError(f"kl_coef must be finite and >= 0, got {kl_coef!r}")
        if kl_coef > 0 and not self.engine.has_reference:
            raise ValueError(f"kl_coef={kl_coef} needs the reference policy, which was not loaded (spec kl_coef 0)")
        self.kl_coef = float(kl_coef)

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every parameter group of the engine's optimizer for the following steps (the
        loop's schedule, ``cluster.loop.lr_schedule``, calls this before each step).

        Raises:
            ValueError: ``lr`` is negative or not finite.
        """
        if not (math.isfinite(lr) and lr >= 0.0):
            raise ValueError(f"lr must be finite and >= 0, got {lr!r}")
        for group in self.engine.optimizer.param_groups:
            group["lr"] = float(lr)
        self.lr = float(lr)

    def train_step(self, microbatches: list[PackedMicroBatch], num_tokens: int, num_sequences: int,
                   policy_version: int) -> TrainResult:
        """``algorithm.num_iterations`` optimizer steps over this rank's micro-batches (every rank has as many).

        With one iteration the behaviour (old) logprobs are the current policy's, detached, from the same forward
        pass. With more, or with ``algorithm.mis``, a no-grad pass over every micro-batch first records the behaviour
        logprobs (and reference logprobs) before the first update; every iteration's importance ratio uses them.
        With ``algorithm.mis`` the loss is aggregated over the kept tokens, with kept counts (module doc) in place of
        ``num_tokens`` / ``num_sequences``.

        Args:
            num_tokens, num_sequences: global counts of loss tokens (``response_mask``) and of sequences with at least
                one loss token, over the whole batch (all ranks).
            policy_version: the rank's policy version before the step.

        An iteration whose loss or global gradient norm is NaN/Inf on any rank (a flag all-reduced with the metric
        sums) skips its optimizer step on every rank and drops its gradients; when every iteration is skipped the
        policy version stays where it was.

        Returns:
            :class:`TrainResult`, identical on every rank: ``policy_version`` after the step (+1 when any iteration
            applied its update); ``skipped`` (any iteration skipped) and ``skip_reason`` (``""``, or the first
            non-finite metric: ``"actor/loss"`` or ``"actor/grad_norm"``); ``metrics`` summed/averaged over all ranks
            and iterations: ``actor/*`` (with ``actor/update_skipped``, the fraction of iterations skipped, 0.0 or 1.0
            with one iteration) and ``rollout/logprob_diff`` (engine vs trainer before the first update);
            ``timing/<phase>_s`` (rank 0); ``kl``: ``actor/kl``; ``grad_norm``: ``actor/grad_norm``;
            ``token_logprobs``: this rank's traced sequences (``PackedMicroBatch.traced``).
        """
        t0 = time.perf_counter()
        engine, alg = self.engine, self.algorithm
        self.phase_s = dict.fromkeys(PHASES, 0.0)
        self.traced = {}
        self._extremes = torch.full((len(EXTREMES),), -math.inf, dtype=torch.float64)
        iterations, mis = alg.num_iterations, alg.mis
        saved = self._behaviour_passes(microbatches) if iterations > 1 or mis is not None \
            else [None] * len(microbatches)
        if mis is not None:
            num_tokens, num_sequences = self._mis_keep(microbatches, saved)
        totals = torch.zeros(len(SUMS), dtype=torch.float64)
        grad_norms, applied, skip_reason = [], 0, ""
        for iteration in range(iterations):
            engine.zero_grad()
            sums = self._forward_backward(microbatches, saved, num_tokens, num_sequences, first=iteration == 0)
            t_opt = time.perf_counter()
            grad_norm = engine.clip_gradients()
            sums[SUMS["nonfinite_loss"]] = float(not math.isfinite(float(sums[SUMS["loss"]])))
            sums[SUMS["nonfinite_grad_norm"]] = float(not math.isfinite(grad_norm))
            sums = engine.all_reduce_sum(sums)  # every rank sees every rank's flags: all skip or none
            bad = [metric for key, metric in NONFINITE.items() if sums[SUMS[key]] > 0]
            if bad:
                engine.zero_grad()  # the poisoned gradients never reach the optimizer's moments
                skip_reason = skip_reason or bad[0]
            else:
                engine.optimizer_step()
                applied += 1
            self.phase_s["optimizer"] += time.perf_counter() - t_opt
            grad_norms.append(grad_norm)
            totals += sums
        engine.zero_grad()
        metrics = step_metrics(totals, grad_norms, applied, iterations, self.kl_coef, self.lr, self.phase_s, t0)
        metrics.update(engine.extra_metrics())
        metrics.update(option_metrics(totals, alg))
        if self._correcting():
            metrics.update(off_policy_metrics(totals, engine.all_reduce_max(self._extremes), mis is not None))
        return TrainResult(policy_version=policy_version + 1 if applied else policy_version,
                           skipped=applied < iterations, skip_reason=skip_reason, metrics=metrics,
                           kl=metrics["actor/kl"], grad_norm=metrics["actor/grad_norm"], token_logprobs=self.traced)

    def _correcting(self) -> bool:
        """Whether the off-policy metrics are reported: with a correction on (``algorithm.tis_cap`` or
        ``algorithm.mis``), or one turned off explicitly (``algorithm.off_policy_correction: none``, so the gap it
        leaves is measured); a job without either logs exactly the metrics it always did."""
        alg = self.algorithm
        return alg.tis_cap is not None or alg.mis is not None or alg.off_policy_correction == "none"

    def _mis_keep(self, microbatches: list[PackedMicroBatch], saved: list[Saved]) -> tuple[int, int]:
        """Record ``algorithm.mis``'s keep mask in each micro-batch's :class:`Saved` (from the proximal logprobs of
        the no-grad pass) and return the global (all ranks) counts of kept tokens and of sequences with at least one
        kept token: the loss aggregation's denominators. A collective."""
        mis = self.algorithm.mis
        counts = torch.zeros(2, dtype=torch.float64)
        for mb, s in zip(microbatches, saved):
            if mb.num_sequences == 0 or s.old is None:  # None: a pipeline stage without the loss (Megatron pp > 1)
                continue
            dev = s.old.device
            s.keep = mis_keep_mask(s.old, mb.behaviour_logprobs.to(dev), mb.response_mask.to(dev),
                                   mis.low, mis.high, mis.level)
            counts[0] += float(s.keep.sum())
            counts[1] += float(s.keep.any(dim=-1).sum())
        counts = self.engine.all_reduce_sum(counts)
        return int(counts[0]), int(counts[1])

    # ---- passes over the micro-batches ----------------------------------------------------------------------------
    def _behaviour_passes(self, microbatches: list[PackedMicroBatch]) -> list[Saved]:
        """No-grad passes before any update: each micro-batch's policy (old) and reference-policy logprobs."""
        if self.engine.pipeline is not None:
            return self._pipelined_behaviour_passes(microbatches)
        return [self._behaviour_pass(mb) for mb in microbatches]

    def _behaviour_pass(self, mb: PackedMicroBatch) -> Saved:
        """:meth:`_behaviour_passes` of one micro-batch."""
        args = self.engine.inputs(mb)
        t0 = time.perf_counter()
        old = self.engine.behaviour_logprobs(mb, args)
        self.phase_s["behaviour"] += time.perf_counter() - t0
        return Saved(old=old, ref=self._reference_logprobs(mb, args), forward_tokens=mb.num_tokens)

    def _reference_logprobs(self, mb: PackedMicroBatch, args: tuple) -> torch.Tensor | None:
        """Reference-policy logprobs [n, T] float32 of ``mb`` (its tensors on the device, ``args``); None without a
        reference policy."""
        if not self.engine.has_reference:
            return None
        t0 = time.perf_counter()
        out = self.engine.reference_logprobs(mb, args)
        self.phase_s["ref_forward"] += time.perf_counter() - t0
        return out

    def _forward_backward(self, microbatches: list[PackedMicroBatch], saved: list[Saved | None], num_tokens: int,
                          num_sequences: int, first: bool) -> torch.Tensor:
        """Forward + backward of every micro-batch of one iteration (gradients accumulate in ``.grad``); returns the
        local metric sums, float64 [len(SUMS)]."""
        if self.engine.pipeline is not None:
            return self._pipelined_forward_backward(microbatches, saved, num_tokens, num_sequences, first)
        sums = torch.zeros(len(SUMS), dtype=torch.float64)
        for i, (mb, old) in enumerate(zip(microbatches, saved)):
            self.engine.prepare_microbatch(last=i == len(microbatches) - 1)
            sums += self._microbatch(mb, old, num_tokens, num_sequences, first=first)
        return sums

    def _microbatch(self, mb: PackedMicroBatch, saved: Saved | None, num_tokens: int, num_sequences: int,
                    first: bool) -> torch.Tensor:
        """Forward + backward of one packed micro-batch; returns the local metric sums (layout: :data:`SUMS`)."""
        args = self.engine.inputs(mb)
        ref_lp = saved.ref if saved is not None else self._reference_logprobs(mb, args)
        t_policy = time.perf_counter()
        loss, out = self._microbatch_loss(mb, self.engine.policy_forward(args), saved, ref_lp, num_tokens,
                                          num_sequences, first)
        self.engine.backward(loss)
        self.phase_s["policy_fwd_bwd"] += time.perf_counter() - t_policy
        return out

    def _pipelined_behaviour_passes(self, microbatches: list[PackedMicroBatch]) -> list[Saved]:
        """:meth:`_behaviour_passes` through the engine's pipeline schedule (``old=None``, ``ref=None`` on stages
        that do not compute the loss)."""
        if not microbatches:
            return []
        staged = self.engine.pipeline.prepare(microbatches)
        t0 = time.perf_counter()
        olds = self.engine.pipeline.logprobs(staged, reference=False)
        self.phase_s["behaviour"] += time.perf_counter() - t0
        refs = self._pipelined_references(staged, len(microbatches))
        return [Saved(old=old, ref=ref, forward_tokens=mb.num_tokens)
                for mb, old, ref in zip(microbatches, olds, refs)]

    def _pipelined_references(self, staged: object, count: int) -> list[torch.Tensor | None]:
        """Reference-policy logprobs of each staged micro-batch (Nones on stages without the loss, and without a
        reference policy)."""
        if not self.engine.has_reference:
            return [None] * count
        t0 = time.perf_counter()
        out = self.engine.pipeline.logprobs(staged, reference=True)
        self.phase_s["ref_forward"] += time.perf_counter() - t0
        return out

    def _pipelined_forward_backward(self, microbatches: list[PackedMicroBatch], saved: list[Saved | None],
                                    num_tokens: int, num_sequences: int, first: bool) -> torch.Tensor:
        """:meth:`_forward_backward` through the engine's pipeline schedule; the metric sums are zeros on stages
        that do not compute the loss."""
        sums = torch.zeros(len(SUMS), dtype=torch.float64)
        if not microbatches:
            return sums
        staged = self.engine.pipeline.prepare(microbatches)
        refs = [s.ref for s in saved] if saved[0] is not None else \
            self._pipelined_references(staged, len(microbatches))

        def loss_fn(index: int, policy_out: tuple) -> tuple[torch.Tensor, int]:
            loss, mb_sums = self._microbatch_loss(microbatches[index], policy_out, saved[index], refs[index],
                                                  num_tokens, num_sequences, first)
            sums.add_(mb_sums)
            return loss, int(mb_sums[SUMS["tokens"]])

        t0 = time.perf_counter()
        self.engine.pipeline.forward_backward(staged, loss_fn)
        self.phase_s["policy_fwd_bwd"] += time.perf_counter() - t0
        return sums

    # ---- the loss of one micro-batch ------------------------------------------------------------------------------
    def _microbatch_loss(self, mb: PackedMicroBatch, policy_out: tuple, saved: Saved | None,
                         ref_lp: torch.Tensor | None, num_tokens: int, num_sequences: int,
                         first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss of one packed micro-batch from the policy's output (no backward).

        Args:
            policy_out: the policy's (logprobs [M], entropy [M]) with autograd. saved: the behaviour pass's record
                (several iterations, or MIS) or None. ref_lp: reference logprobs [n, T] float32 or None. first: the
                step's first iteration (``rollout/logprob_diff`` is measured then).

        Returns:
            (loss: scalar float32 with autograd, this rank's share of the globally normalised batch loss — 0 times
            the forward for a placeholder micro-batch, so every rank issues the same collectives in the backward;
            the local metric sums, float64 [len(SUMS)]).
        """
        alg = self.algorithm
        lp_flat, ent_flat = policy_out
        out = torch.zeros(len(SUMS), dtype=torch.float64)
        out[SUMS["forward_tokens"]] = mb.num_tokens + (saved.forward_tokens if saved is not None and first else 0)
        if mb.num_sequences == 0:
            return lp_flat.sum() * 0.0, out
        dev = lp_flat.device
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
            entropy=entropy, entropy_coef=alg.entropy_coef, tis_weights=tis, loss_mode=alg.policy_loss,
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
            self._trace(mb, old)
        return loss, out

    def _trace(self, mb: PackedMicroBatch, old: torch.Tensor) -> None:
        """Keep the trainer's logprobs before the update (``old``, [n, T] float32) of ``mb``'s traced sequences in
        :attr:`traced`, keyed by their index in the step's rollout batch: every response token, R_i floats."""
        if mb.traced is None or not bool(mb.traced.any()):
            return
        lengths = torch.bincount(mb.token_seq, minlength=mb.num_sequences).tolist()
        for slot in mb.traced.nonzero().flatten().tolist():
            self.traced[int(mb.seq_indices[slot])] = old[slot, :lengths[slot]].detach().float().cpu().tolist()

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
