"""The GRPO driver loop: generate → score → advantages → train → sync, once per policy version.

    grpo-cluster run examples/gsm8k_smollm2_cpu.yaml

Notation: B prompts per step, G completions per prompt (a group), N = B·G sequences.

``rollout.mode`` orders the stages (``cluster.loop.overlap``): ``sync`` runs them one after the other;
``one_step_off`` generates the batch of step k+1 (on the weights step k starts from) while step k trains, then syncs
the new weights, so every batch after the first is trained one policy version after the one that sampled it;
``async`` keeps the engines generating batches back to back while each step trains, at most ``rollout.max_staleness``
versions ahead of the trainer (a stale head is dropped, counted and its prompts drawn again); with
``rollout.partial_rollout`` the producer's call in flight is interrupted after each train step instead of awaited,
and its groups are continued from their tokens on the new weights (``cluster.loop.partial_rollouts``).

With ``algorithm.dynamic_sampling`` the generate → score → advantages stage repeats (``cluster.loop.sampling``) until the
batch holds B groups with a learning signal; G follows ``GroupSizeController``; β follows the KL controller.

Each phase is a call into the part that owns it (``cluster/loop/``): ``setup`` (folders, tokenizer, prompts),
``requests`` (prompts → group requests and their seeds), ``fleet`` (engines: generate and sync, replacing failed
ones), ``scoring`` (rewards, masks, advantages), ``training`` (micro-batches, the train pool, skipped updates),
``step_metrics`` (the metrics row), ``checkpoint_state`` (save, resume), ``restarts`` (restart on failure) and, with
an ``eval`` section, ``evaluation`` (held-out ``eval/*`` between steps; the starting weights' row has step 0).

Reliability: every group is sampled with its own seed (spec seed, step, group id), so a group sampled again — after
an engine died, or after a resume — comes out the same. Checkpoints are written to a temporary folder and renamed
(a crash mid-write leaves the previous one usable); ``resume: auto`` / ``--resume`` continue from the latest complete
one with the same prompts, policy version and per-step results. Dead engines are replaced and synced before they
serve; a failed train rank stops the job naming the rank (``restart_on_failure`` resumes it automatically); updates
with NaN/Inf are skipped and counted.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

from tqdm import tqdm

from cluster.data import PromptSampler
from cluster.data.models import resolve_model_path
from cluster.ray_shell import restarts
from cluster.loop.checkpoint_state import (check_policy_kind, driver_state, inflight_groups, open_step_logs,
                                           restore_driver_state, resume_point, stale_dropped_total, write_checkpoint)
from cluster.loop.evaluation import load_evaluation, restore_best
from cluster.ray_shell.fleet import EngineFleet
from contract.errors import RecoveryDeferred
from cluster.loop.guard import build_guard, check_resume
from cluster.loop.overlap import GenerateInterrupted, make_schedule
from cluster.loop.partial_rollouts import PartialRollouts, RoundInterrupted
from cluster.ray_shell.pools import RolloutPool, TrainPool, check_cluster_resources
from cluster.loop.requests import PromptQueue
from cluster.loop.sampling import GroupSizeController, RolloutBatch, sample_groups
from cluster.loop.scoring import RoundScorer, Scoring
from cluster.loop.setup import (SetupError, check_lora, check_train_layout, ensure_writable_dir, load_prompts,
                                load_tokenizer, model_eos_ids)
from cluster.loop.step_metrics import StepBatch, StepClock, async_metrics, record_trained_prompts, step_metrics
from cluster.ray_shell.sync import WeightSync
from cluster.loop.training import SkippedUpdates, load_train_state, microbatches, set_kl_coef, train_step
from contract.versions import PolicyVersionLedger
from contract.messages import TrainResult
from cluster.ops.metrics import MetricsLogger, format_console_line
from cluster.spec import JobSpec, spec_to_yaml
from grpo.kl import AdaptiveKLController, FixedKLController


class GRPOJob:
    """One GRPO training job on a Ray cluster (``ray.init`` must have been called).

    Args:
        spec: the validated job spec.
        progress: show a progress bar on stderr.
        resume: continue from the latest complete checkpoint.
        dry_run: run every set-up check (output folders writable, model and tokenizer, data, prompt lengths, earlier
            checkpoints) and write nothing: no folder, no spec.yaml, no metrics endpoint (``grpo-cluster validate``).
            Such a job cannot :meth:`start`.
        resume_past_trip: let ``resume`` continue a job the reward-hacking guard stopped (:mod:`cluster.loop.guard`).
    Raises:
        SetupError, ModelError, DataError, MetricsError: naming the spec field and what is wrong.
    """

    def __init__(self, spec: JobSpec, progress: bool = True, resume: bool = False, dry_run: bool = False,
                 resume_past_trip: bool = False):
        self.spec, self.progress, self.dry_run = spec, progress, dry_run
        self.output_dir = Path(spec.output_dir)
        ensure_writable_dir(self.output_dir, "output_dir", create=not dry_run)
        ensure_writable_dir(self.checkpoint_root(), "checkpoint.dir", create=not dry_run)
        self.model_path = resolve_model_path(spec.model.path, spec.model.cache_dir)
        check_lora(spec.train.lora, self.model_path)
        check_train_layout(spec.train, self.model_path, spec.model.dtype)
        tokenizer = load_tokenizer(self.model_path)
        d = spec.data
        prompts = load_prompts(d, tokenizer, spec.algorithm.rewards)  # rows checked for the rewards in use
        self.prompt_ids, self.bad_rows, self.prompts_filtered = prompts.ids, prompts.bad_rows, prompts.filtered
        self.sampler = PromptSampler(prompts.examples, spec.rollout.prompts_per_step, spec.seed, shuffle=d.shuffle)
        self.requests = PromptQueue(self.sampler, self.prompt_ids, spec.seed)
        if not dry_run:
            (self.output_dir / "spec.yaml").write_text(spec_to_yaml(spec))
        self._status(f"{len(prompts.examples)} prompts from {prompts.source} ({self.bad_rows} bad rows skipped, "
                     f"{self.prompts_filtered} over data.max_prompt_tokens={d.max_prompt_tokens} dropped)")
        self.evaluation = load_evaluation(spec, tokenizer, self._status)  # None without an eval section
        alg = spec.algorithm
        self.scoring = Scoring(alg, spec.rollout.max_response_tokens, model_eos_ids(self.model_path, tokenizer))
        self.group_size = GroupSizeController(spec.rollout.group_size, alg.group_size_schedule, alg.group_size_max,
                                              alg.group_size_rise_threshold)
        self.kl_controller = (AdaptiveKLController(alg.kl_coef, alg.kl_target, alg.kl_horizon_sequences)
                              if alg.kl_controller == "adaptive" else FixedKLController(alg.kl_coef))
        self.skips = SkippedUpdates(spec.train.max_skipped_updates)
        self.versions = PolicyVersionLedger()
        # partial rollouts: the carried-over round, the interrupt epoch and the rollout/partial_* counts
        self.partial = PartialRollouts(spec.rollout.max_staleness) if spec.rollout.partial_rollout else None
        self.schedule = make_schedule(spec.rollout.mode, self._generate, self._train_batch, self._sync_step,
                                      deferrable=(RecoveryDeferred,), max_staleness=spec.rollout.max_staleness,
                                      version=lambda: self.policy_version, batch_version=_batch_version,
                                      drop=self._drop_stale, last_step=spec.total_steps,
                                      interrupt=self._interrupt_producer if self.partial is not None else None)
        self._clock = StepClock()  # the running step's clock (train and sync phases; run_step makes each step's)
        self._inflight_resampled = 0  # groups in flight at the restored checkpoint, sampled again by the next step
        self._trained_figures = None  # the fleet's figures of the batch the last step trained on
        self._stale_dropped_total = 0  # (async) groups dropped for staleness in this run (kept by checkpoints)
        self.step = 0
        self.completed: dict[int, dict] = {}  # step -> metrics, of the steps this job object ran
        self.max_model_len = spec.rollout.max_model_len or d.max_prompt_tokens + spec.rollout.max_response_tokens
        self.resume_from = resume_point(self.checkpoint_root(), resume or spec.resume == "auto", self._status)
        if self.resume_from is not None:
            past_trip = resume_past_trip or bool(spec.monitor and spec.monitor.resume_past_trip)
            check_resume(self.checkpoint_root(), past_trip, clear=not dry_run)
            self._restore(self.resume_from)
        self.rollout = self.train = self.sync = self.fleet = self.control = self.metrics = self.guard = None
        if dry_run:
            return
        open_step_logs(self.output_dir, self.step if self.resume_from is not None else None)
        self.metrics = MetricsLogger(self.output_dir, host=spec.metrics.host, port=spec.metrics.port, job=spec.name,
                                     echo=False)
        self.guard = build_guard(self)  # the reward-hacking guard of the monitor section (None without one)

    # ---- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Create the pools and the weight-sync group (engines start from the same weights: policy version 0)."""
        if self.dry_run:
            raise SetupError("a job built with dry_run=True only checks its inputs; build it again to run it")
        check_cluster_resources(self.spec)
        self._status("starting rollout engines and train workers")
        ckpt = str(self.resume_from) if self.resume_from is not None else None
        lora = self.spec.train.lora is not None  # a LoRA checkpoint holds adapters only: engines start from the base
        try:
            engine_weights = self.model_path if lora or ckpt is None else ckpt
            self.rollout = RolloutPool(self.spec, engine_weights, self.max_model_len, self.policy_version)
            self.train = TrainPool(self.spec, self.model_path, policy_path=ckpt)
            if ckpt is not None:
                self._load_optimizer(ckpt)
            self.sync = WeightSync(self.spec, self.train, self.rollout, self.versions)
            if lora and ckpt is not None:
                self.sync.sync()  # the base model's engines get the checkpoint's policy (merged or adapters) first
        except BaseException:
            self.shutdown()
            raise
        from cluster.ray_shell.control import current_job_id, start_control

        self.fleet = EngineFleet(self.spec, self.rollout, self.sync, self.versions, self._status)
        self.control = start_control(current_job_id(self.spec.name), len(self.rollout.engines))
        where = f" from {ckpt} (step {self.step}, policy version {self.policy_version})" if ckpt else ""
        self._status(f"ready{where}: {len(self.rollout.engines)} engine(s), {len(self.train.workers)} train rank(s), "
                     f"{self.train.num_parameters / 1e6:.1f}M parameters, {self.sync.num_buckets} sync bucket(s)")

    def run(self) -> list[dict]:
        """Run ``total_steps`` steps (fewer when the reward-hacking guard stops the job); returns every step's metrics
        (none when a resumed job is already done)."""
        if self.step >= self.spec.total_steps:
            self._status(f"nothing to do: step {self.step} of total_steps={self.spec.total_steps} is done")
            return []
        if self.rollout is None:
            self.start()
        bar = tqdm(total=self.spec.total_steps, desc="GRPO", unit="step", file=sys.stderr, disable=not self.progress)
        try:
            bar.update(self.step)
            if self.step == 0 and (start := self._evaluate()):  # the starting weights: a row of its own, step 0
                if self.guard is not None:
                    self.guard.observe(0, start)  # the monitor's held-out baseline
                self.metrics.log(0, start)
                tqdm.write(format_console_line(0, start), file=sys.stdout)
            while self.step < self.spec.total_steps:
                self._apply_control()
                self.step += 1
                metrics = {**self.run_step(bar), **self._evaluate()}
                tripped = self.guard is not None and self.guard.observe(self.step, metrics)  # adds monitor/*
                self._log_step(metrics)
                if self._checkpoint_due():
                    self.save_checkpoint()
                if tripped and self.guard.act(self, self.step, metrics):  # warn, stop, or roll back and go on
                    break
                bar.update(self.step - bar.n)
        finally:
            bar.close()
        return [self.completed[step] for step in sorted(self.completed)]

    @property
    def policy_version(self) -> int:
        """The trainer's latest policy version, read from the job's ledger (``versions``, its one owner)."""
        return self.versions.current

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()

    def shutdown(self) -> None:
        """Stop every engine and train rank this job started (and free their placement groups)."""
        if self.control is not None:
            self.control.close()
            self.control = None
        for pool in (self.rollout, self.train):
            if pool is not None:
                pool.shutdown()
        self.rollout = self.train = self.sync = self.fleet = None

    def scale_rollout(self, replicas: int) -> None:
        """Resize the rollout pool to ``replicas`` engines between steps (:meth:`EngineFleet.scale`)."""
        self.fleet.scale(replicas)

    def _apply_control(self) -> None:
        """Apply a replica count set by ``grpo-cluster scale`` and publish the job's state."""
        if self.control is None:
            return
        desired = self.control.desired_rollout_replicas()
        if desired is not None and desired != len(self.rollout.engines):
            self.scale_rollout(int(desired))
        self.control.report({"step": self.step, "policy_version": self.policy_version,
                             "rollout_replicas": len(self.rollout.engines), "total_steps": self.spec.total_steps,
                             "engine_restarts": self.rollout.restarts})

    # ---- one step -------------------------------------------------------------------------------------------------
    def run_step(self, bar=None) -> dict:
        """generate → score → advantages (repeated by dynamic sampling) → train → sync, in the order of
        ``rollout.mode`` (``self.schedule``; in ``one_step_off`` the next step's batch is generated during the train
        phase, in ``async`` the batches of the next steps, up to ``rollout.max_staleness`` queued). Returns the step's
        metrics."""
        self._clock = clock = StepClock(bar)
        if self.partial is not None:
            self.partial.begin_step()
        outcome = self.schedule.step(self.step, prefetch_next=self.step < self.spec.total_steps)
        batch, (result, packing, version_at_train), sync_metrics = outcome.batch, outcome.trained, outcome.synced
        for phase, seconds in batch.seconds.items():
            clock.add(phase, seconds)
        overlapped = self.schedule.mode != "sync"
        self._trained_figures = batch.fleet
        record_trained_prompts(self.output_dir, self.step, self.policy_version, batch.prompts,
                               len(self.rollout.engines), batch.group_versions if overlapped else None)
        metrics = step_metrics(
            policy_version=self.policy_version, sampling=batch.sampling, group_size=batch.group_size,
            version_at_train=version_at_train, fleet=batch.fleet, engines=len(self.rollout.engines),
            restarts=self.rollout.restarts, train=result, skipped_total=self.skips.total, sync=sync_metrics,
            packing=packing, epoch=self.sampler.epoch, prompts_filtered=self.prompts_filtered, bad_rows=self.bad_rows,
            clock=clock)
        if overlapped:  # groups drawn before the restored checkpoint and sampled again now (0 after the first step)
            metrics["rollout/inflight_resampled"] = 0 if outcome.prefetched else self._inflight_resampled
            metrics["rollout/prefetch_deferred"] = float(outcome.prefetch_deferred)
            self._inflight_resampled = 0
        if self.schedule.mode == "async":
            metrics.update(async_metrics(batch, version_at_train, outcome.dropped, outcome.queued,
                                         self._stale_dropped_total, self.spec.rollout.max_staleness))
        if self.partial is not None:
            metrics.update(self.partial.metrics(batch.sampling.batch))
        return metrics

    def _interrupt_producer(self) -> None:
        """(partial rollouts) The schedule's ``interrupt``: stop this step's producer calls on every engine."""
        self.fleet.interrupt(self.partial.epoch)

    def _drop_stale(self, batches: list[StepBatch]) -> None:
        """(async) The queued ``batches`` (oldest first) were dropped because the oldest is more than
        ``rollout.max_staleness`` versions behind: rewind the data position and the group-size controller to the
        oldest one's, so their prompts are drawn again in the same order, and count their groups."""
        self.requests.load_state_dict(batches[0].position["prompts"])
        self.group_size.load_state_dict(batches[0].position["group_size"])
        if self.partial is not None:
            self.partial.discard()  # a round carried for a later step: its prompts come after the rewound position
        groups = sum(b.sampling.num_groups_sampled for b in batches)
        self._stale_dropped_total += groups
        self._status(f"step {self.step}: dropped {len(batches)} queued batch(es), {groups} group(s): the oldest was "
                     f"sampled by version {_batch_version(batches[0])}, more than rollout.max_staleness="
                     f"{self.spec.rollout.max_staleness} behind version {self.policy_version}")

    def _generate(self, step: int) -> StepBatch:
        """generate → score → advantages for step ``step`` (repeated by dynamic sampling), on the engines' current
        weights. In ``one_step_off`` the next step's batch (``step`` > ``self.step``) is generated in the schedule's
        worker thread while the train ranks work: it uses the engines, the prompt queue, the scorer and the group-size
        controller, which nothing else touches then, and it syncs no engine (the trainer's weights are changing).

        Partial rollouts: a round carried over for ``step`` is sent again instead of drawing prompts (continued on
        the current weights); an interrupted producer call's round is carried over (``self.partial``).

        Raises:
            RecoveryDeferred: (overlapped only) an engine fault; the prompts drawn are put back, to be drawn again
                by the next step after the sync.
            GenerateInterrupted: (partial rollouts, overlapped only) the call was interrupted.
        """
        overlapped = step > self.step
        clock = StepClock(None if overlapped or self.schedule.mode != "sync" else self._clock.bar)
        carried = self.partial.take(step, self.policy_version + step - self.step) if self.partial else None
        position = (carried.position if carried is not None else
                    {"prompts": self.requests.state_dict(), "group_size": self.group_size.state_dict()})
        alg = self.spec.algorithm
        group_size = carried.group_size if carried is not None else self.group_size.group_size(step)
        self.requests.begin_step(step)
        self.fleet.begin_step()
        if carried is not None:
            self.requests.redraw(carried.examples, carried.requests)
            self.fleet.figures = carried.figures
        epoch = self.partial.epoch if self.partial is not None and overlapped else None
        sample_round = partial(self._sample_round, group_size, clock, not overlapped, carried=carried,
                               interrupt_epoch=epoch)
        try:
            sampling = sample_groups(sample_round, self.spec.rollout.prompts_per_step, dynamic=alg.dynamic_sampling,
                                     max_rounds=alg.max_sampling_rounds)
        except RecoveryDeferred as exc:
            self.requests.load_state_dict(position["prompts"])
            self._status(f"step {step}'s batch: {exc}")
            raise
        except RoundInterrupted as exc:
            self.partial.carry(step, position, group_size, exc, self.fleet.figures)
            raise GenerateInterrupted(f"step {step}'s batch: {exc}") from None
        self.group_size.observe(step, sampling.all_equal_fraction)
        return StepBatch(step=step, sampling=sampling, group_size=group_size,
                         prompts=self.requests.trained_prompts(sampling.batch.group_ids), fleet=self.fleet.figures,
                         seconds={"generate": clock.seconds["generate"], "score": clock.seconds["score"]},
                         position=position)

    def _train_batch(self, batch: StepBatch) -> tuple[TrainResult, dict, int]:
        """The train phase of a step: :meth:`_train` on ``batch``. Returns (the result, ``packing/*`` metrics, the
        policy version it trained from)."""
        version_at_train = self.policy_version
        with self._clock.phase("train"):
            result, packing = self._train(batch.sampling.batch)
        return result, packing, version_at_train

    def _sync_step(self, trained: tuple[TrainResult, dict, int]) -> dict:
        """The sync phase of a step: :meth:`_sync` of the train phase's result."""
        with self._clock.phase("sync"):
            return self._sync(trained[0])

    def _sample_round(self, group_size: int, clock: StepClock, recover: bool, num_prompts: int,
                      carried=None, interrupt_epoch: int | None = None) -> RolloutBatch:
        """generate → score → advantages for ``num_prompts`` new prompts of G = ``group_size`` completions each;
        each engine's groups are scored as soon as it finishes. ``recover``: ``EngineFleet.generate``'s. Partial
        rollouts: ``carried`` (a ``CarriedRound``) replaces the draw; ``interrupt_epoch`` makes the call interruptible.

        Raises:
            RoundInterrupted: a group came back with an interrupted completion (nothing was scored).
        """
        clock.show("generate")
        examples, requests = ((carried.examples, carried.requests) if carried is not None
                              else self.requests.draw(num_prompts, group_size))
        scorer = RoundScorer(self.scoring, requests, examples)
        extra = {"interrupt_epoch": interrupt_epoch} if interrupt_epoch is not None else {}
        with clock.measure("generate"):
            groups = self.fleet.generate(requests, scorer.on_groups, recover=recover, **extra)
        if not all(g.complete for g in groups):
            raise RoundInterrupted(examples, requests, groups)
        clock.add("score", scorer.seconds)
        with clock.phase("score"):
            return scorer.batch(groups)

    def _train(self, batch: RolloutBatch) -> tuple[TrainResult, dict]:
        """One policy update on ``batch`` (β from the KL controller). A skipped update (NaN/Inf) is counted; a good
        one feeds the KL controller. Returns (the result, the micro-batch plan's ``packing/*`` metrics).

        Raises:
            NumericsError: ``train.max_skipped_updates`` updates in a row were skipped.
        """
        per_rank, packing = microbatches(batch, self.spec.train)
        num_tokens = sum(batch.valid_lengths)
        num_sequences = sum(v > 0 for v in batch.valid_lengths)
        if self.spec.algorithm.kl_controller == "adaptive":
            set_kl_coef(self.train, self.kl_controller.value)
        result = train_step(self.train, per_rank, num_tokens, num_sequences)
        if result.skipped:
            self.skips.note(result.skip_reason, self.step, self.policy_version, self._status)
        else:
            self.skips.reset()
            self.kl_controller.update(result.metrics["actor/kl"], len(batch))
        return result, packing

    def _sync(self, result: TrainResult) -> dict:
        """Report the trainer's version to the ledger (``PolicyVersionError`` if it went backwards or skipped one)
        and send the new policy to every engine; a skipped update changes no weights, so nothing is sent. Returns the
        ``sync/*`` metrics."""
        if not self.versions.trained(result.policy_version):
            return {"sync/skipped": 1.0}
        return {**self.fleet.sync_policy().metrics(), "sync/skipped": 0.0}

    def _evaluate(self) -> dict:
        """The held-out ``eval/*`` metrics when an evaluation is due after this step (``cluster.loop.evaluation``),
        on the engines' current weights; {} otherwise."""
        if self.evaluation is None or not self.evaluation.due(self.step):
            return {}
        return self.evaluation.run(self.step, partial(self.fleet.generate, record=False))

    def _log_step(self, metrics: dict) -> None:
        """Record the finished step: the metrics row, the per-engine figures, and the console line when due."""
        self.completed[self.step] = metrics
        self.metrics.log(self.step, metrics)
        if self.schedule.mode == "sync":  # the fleet's figures are the trained batch's
            self.fleet.log_workers(self.metrics, self.step)
        else:  # the fleet's figures are the next step's prefetch's
            self.fleet.log_workers(self.metrics, self.step, self._trained_figures)
        if self.step % self.spec.metrics.log_every_steps == 0 or self.step == self.spec.total_steps:
            tqdm.write(format_console_line(self.step, metrics), file=sys.stdout)

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def checkpoint_root(self) -> Path:
        return Path(self.spec.checkpoint.dir) if self.spec.checkpoint.dir else self.output_dir / "checkpoints"

    def _checkpoint_due(self) -> bool:
        c = self.spec.checkpoint
        last = self.step == self.spec.total_steps
        best = self.evaluation is not None and self.evaluation.checkpoint_wanted(self.step)  # checkpoint.keep_best
        return (c.every_steps > 0 and self.step % c.every_steps == 0) or (last and c.save_final) or best

    def save_checkpoint(self) -> Path:
        """Write ``step_NNNNNN``: the policy as an HF folder (safetensors, config, tokenizer, generation config; with
        ``train.lora`` a PEFT adapter folder, which ``grpo-cluster merge`` turns into an HF folder), the
        sharded optimizer state, the spec and the driver state (step, policy version, data position including prompts
        drawn but not yet sampled, KL and group-size controllers; with eval, the best step), then prune to
        ``checkpoint.keep_last``, sparing the best step's checkpoint with ``checkpoint.keep_best``.

        Atomic: everything is written into ``step_NNNNNN.partial`` and renamed when complete (``trainer_state.json``
        last), so a crash mid-write leaves the previous checkpoint the latest complete one.
        """
        state = driver_state(step=self.step, policy_version=self.policy_version, prompts=self.requests,
                             prompts_filtered=self.prompts_filtered, model_path=self.model_path,
                             kl_coef=self.kl_controller.value, group_size=self.group_size, skips=self.skips,
                             engine_restarts=self.rollout.restarts if self.rollout is not None else 0,
                             inflight=self._inflight())
        if self.evaluation is not None:
            state["eval"] = self.evaluation.state_dict()
        if self.schedule.mode == "async":
            state["stale_dropped_total"] = self._stale_dropped_total
        path = write_checkpoint(self.checkpoint_root(), self.step, self.train, self.model_path,
                                spec_to_yaml(self.spec), state, self.spec.checkpoint.keep_last,
                                protect=self.evaluation.protected_step() if self.evaluation is not None else None)
        self._status(f"checkpoint saved: {path}")
        return path

    def _inflight(self) -> dict | None:
        """``driver_state``'s ``inflight`` (``one_step_off``, ``async``): the position before the oldest batch
        generated but not trained (or the round carried over by partial rollouts, which comes after every queued
        batch), and the groups of every such batch and round, so the checkpoint records the data position of the
        trained batches only; None in ``sync``."""
        if self.schedule.mode == "sync":
            return None
        queued = self.schedule.queued
        carried = self.partial.carried if self.partial is not None else None  # a later step's than any queued
        groups = sum(b.sampling.num_groups_sampled for b in queued) + (carried.num_groups if carried else 0)
        if queued:
            return {"position": queued[0].position, "groups": groups}
        if carried is not None:
            return {"position": carried.position, "groups": groups}
        return {"position": {"prompts": self.requests.state_dict(), "group_size": self.group_size.state_dict()},
                "groups": 0}

    def _restore(self, path: Path) -> None:
        """Restore the driver's side of checkpoint ``path`` (the workers load theirs in :meth:`start`).

        Raises:
            SetupError: the checkpoint's policy is not what the spec trains (LoRA adapters vs full weights, or other
                LoRA rank/alpha), or its driver state does not fit the spec's data.
        """
        check_policy_kind(path, self.spec.train.lora)
        self.schedule.discard()  # a batch prefetched before a rollback: its prompts are drawn again from the position
        if self.partial is not None:
            self.partial.discard()  # likewise a round carried over (partial rollouts)
        self._inflight_resampled = inflight_groups(path)
        self._stale_dropped_total = stale_dropped_total(path)
        self.step, policy_version = restore_driver_state(path, prompts=self.requests, kl_controller=self.kl_controller,
                                                         group_size=self.group_size, skips=self.skips)
        self.versions = PolicyVersionLedger(policy_version)
        restore_best(self.evaluation, path)
        if self.step >= self.spec.total_steps:
            self._status(f"resume: checkpoint {path} is at step {self.step} >= total_steps={self.spec.total_steps}")

    def _load_optimizer(self, ckpt: str) -> None:
        """The train ranks load checkpoint ``ckpt``'s optimizer state; fields the spec changed are said."""
        changed = load_train_state(self.train, ckpt, self.policy_version)
        if changed:  # the spec's values are in use (what actor/lr etc. report), not the checkpoint's
            self._status("optimizer fields changed from the checkpoint (saved -> in use): " + ", ".join(
                f"{field} {saved!r} -> {used!r}" for field, (saved, used) in changed.items()))

    def _status(self, message: str) -> None:
        tqdm.write(f"[grpo-cluster] {message}", file=sys.stderr)


def _batch_version(batch: StepBatch) -> int:
    """The oldest policy version that sampled a row of ``batch`` (what its staleness is measured from)."""
    return min(int(v) for v in batch.sampling.batch.versions)


def run_with_restarts(spec: JobSpec, progress: bool = True, resume: bool = False,
                      first_job: GRPOJob | None = None) -> tuple[GRPOJob, list[dict]]:
    """:func:`cluster.ray_shell.restarts.run_with_restarts` for :class:`GRPOJob`: run, and on a worker failure resume from
    the latest checkpoint up to ``spec.restart_on_failure`` times. Returns (the last job, every step's metrics)."""
    return restarts.run_with_restarts(GRPOJob, spec, progress=progress, resume=resume, first_job=first_job)
