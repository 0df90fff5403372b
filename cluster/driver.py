"""The GRPO loop: generate → score → advantages → train → sync, once per policy version.

    grpo-cluster run examples/learn_cpu.yaml                         # the Ray shell builds the job (cluster.ray_shell)
    job = cluster.in_process.local_job(spec); job.run()             # in this process, no Ray or vLLM

Notation: B prompts per step, G completions per prompt (a group), N = B·G sequences.

:class:`GRPOJob` is pure: it is constructed from a spec and the collaborators it is given — the rollout side
(``contract.protocols.Fleet``), the train side (``Trainer``), the reward pool (``RewardPool``, optional: default the
driver itself), metric sinks and an optional control channel — and
imports neither Ray nor a runtime. Each phase is a call into the part that owns it (``cluster/loop/``):
``production`` (prompts → groups → rewards → advantages, dynamic sampling, partial rollouts), ``training`` (micro-
batches, the update, the KL controller, skipped updates, the sync), ``rollout_modes`` (``rollout.mode``: when each
batch is generated relative to training), ``step_metrics`` (the metrics row), ``checkpoint_state`` (save, resume),
``evaluation`` (held-out ``eval/*`` between steps; the starting weights' row has step 0) and ``guard`` (the
reward-hacking guard, which acts on the job through :class:`cluster.loop.guard.GuardTarget`).

Reliability: every group is sampled with its own seed (spec seed, step, group id), so a group sampled again — after
an engine died, or after a resume — comes out the same. Checkpoints are written to a temporary folder and renamed;
``resume: auto`` / ``--resume`` continue from the latest complete one with the same prompts, policy version and
per-step results. Updates with NaN/Inf are skipped and counted.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

from tqdm import tqdm

from cluster.data import PromptSampler
from cluster.data.models import resolve_model_path
from cluster.loop.checkpoint_state import (check_policy_kind, driver_state, open_step_logs, restore_driver_state,
                                           resume_point, write_checkpoint)
from cluster.loop.episodes import make_episode_runner
from cluster.loop.evaluation import load_evaluation, restore_best
from cluster.loop.guard import build_guard, check_resume
from cluster.loop.production import BatchProducer
from cluster.loop.requests import PromptQueue
from cluster.loop.rollout_modes import make_rollout
from cluster.loop.sampling import GroupSizeController
from cluster.loop.scoring import Scoring
from cluster.loop.setup import (SetupError, check_reward_endpoints, ensure_writable_dir, load_prompts, load_tokenizer,
                                model_eos_ids)
from cluster.loop.step_metrics import StepClock, record_trained_prompts, step_metrics
from cluster.loop.training import SkippedUpdates, TrainPhase, load_train_state
from cluster.ops.metrics import MetricSinks, MetricsLogger, format_console_line
from cluster.ops.trackers import build_trackers, check_trackers
from cluster.rewards.inline import InlineRewardPool
from cluster.spec import JobSpec, spec_to_yaml
from cluster.spec.algorithm import off_policy_warning
from cluster.spec.multi_turn import generated_tokens
from contract.model_source import ModelSource
from contract.protocols import ControlChannel, Fleet, MetricSink, RewardPool, Trainer
from contract.versions import PolicyVersionLedger
from grpo.kl import make_kl_controller


class GRPOJob:
    """One GRPO training job over the collaborators it is given.

    Args:
        spec: the validated job spec.
        fleet: the rollout side (``contract.protocols.Fleet``), not started. trainer: the train side
            (``Trainer``), not started. Both may be None only with ``dry_run``; their pre-start checks
            (``check``) run here, before anything starts.
        reward_pool: where the reward functions run (``contract.protocols.RewardPool``), not started; None: in the
            driver (``cluster.rewards.inline.InlineRewardPool``).
        sinks: where metrics go; None: ``metrics.jsonl`` and the spec's Prometheus endpoint (``MetricsLogger``) and
            the trackers of ``metrics.trackers`` (``cluster.ops.trackers``).
        control: how an operator steers the job between steps (``grpo-cluster scale``); None: nobody does.
        progress: show a progress bar on stderr.
        resume: continue from the latest complete checkpoint.
        dry_run: run every set-up check (output folders writable, model and tokenizer, data, prompt lengths, earlier
            checkpoints) and write nothing: no folder, no spec.yaml, no metrics endpoint (``grpo-cluster validate``).
            Such a job cannot :meth:`start`.
        resume_past_trip: let ``resume`` continue a job the reward-hacking guard stopped (:mod:`cluster.loop.guard`).
    Raises:
        SetupError, ModelError, DataError, MetricsError, TrackerSetupError: naming the spec field and what is wrong.
    """

    def __init__(self, spec: JobSpec, *, fleet: Fleet | None = None, trainer: Trainer | None = None,
                 reward_pool: RewardPool | None = None, sinks: list[MetricSink] | None = None,
                 control: ControlChannel | None = None, progress: bool = True, resume: bool = False,
                 dry_run: bool = False, resume_past_trip: bool = False):
        if not dry_run and (fleet is None or trainer is None):
            raise SetupError("GRPOJob needs a fleet and a trainer (contract.protocols); build a ready job with "
                             "cluster.ray_shell.build_job(spec) or cluster.in_process.local_job(spec)")
        self.spec, self.progress, self.dry_run = spec, progress, dry_run
        self.fleet, self.trainer, self.control = fleet, trainer, control
        self.reward_pool = reward_pool if reward_pool is not None else InlineRewardPool()
        self.output_dir = Path(spec.output_dir)
        self.metrics_path = self.output_dir / "metrics.jsonl"
        ensure_writable_dir(self.output_dir, "output_dir", create=not dry_run)
        ensure_writable_dir(self.checkpoint_root(), "checkpoint.dir", create=not dry_run)
        check_trackers(list(spec.metrics.trackers))  # their libraries, before anything heavy
        self.model_path = resolve_model_path(spec.model.path, spec.model.cache_dir)
        for part in (trainer, fleet):
            if part is not None:
                part.check(self.model_path)
        check_reward_endpoints(spec.reward_endpoints)
        tokenizer = load_tokenizer(self.model_path, ModelSource.of(spec.model))
        d = spec.data
        prompts = load_prompts(d, tokenizer, spec.algorithm.rewards)  # rows checked for the rewards in use
        self.prompt_ids, self.bad_rows, self.prompts_filtered = prompts.ids, prompts.bad_rows, prompts.filtered
        self.sampler = PromptSampler(prompts.examples, spec.rollout.prompts_per_step, spec.seed, shuffle=d.shuffle)
        self.requests = PromptQueue(self.sampler, self.prompt_ids, spec.seed)
        if not dry_run:
            (self.output_dir / "spec.yaml").write_text(spec_to_yaml(spec))
        self.status(f"{len(prompts.examples)} prompts from {prompts.source} ({self.bad_rows} bad rows skipped, "
                     f"{self.prompts_filtered} over data.max_prompt_tokens={d.max_prompt_tokens} dropped)")
        self.evaluation = load_evaluation(spec, tokenizer, self.status)  # None without an eval section
        alg = spec.algorithm
        if (warning := off_policy_warning(alg, spec.rollout)) is not None:
            self.status(f"warning: {warning}")
        self.scoring = Scoring(alg, spec.rollout.max_response_tokens, model_eos_ids(self.model_path, tokenizer))
        self.group_size = GroupSizeController(spec.rollout.group_size, alg.group_size_schedule, alg.group_size_max,
                                              alg.group_size_rise_threshold)
        self.kl_controller = make_kl_controller(alg.kl_controller, alg.kl_coef, alg.kl_target, alg.kl_horizon_sequences)
        self.skips = SkippedUpdates(spec.train.max_skipped_updates)
        self.versions = PolicyVersionLedger()
        self.producer = BatchProducer(spec, self.requests, self.scoring, self.group_size, self.status,
                                      self.reward_pool)
        self.producer.episodes = self.episodes = make_episode_runner(spec, tokenizer, self.status)  # multi_turn
        self.training = TrainPhase(spec, self.kl_controller, self.skips, self.versions, self.status,
                                   current_step=lambda: self.step)
        self.schedule = make_rollout(spec, self.producer, self.training, lambda: self.policy_version, self.status)
        self.step = 0
        self.completed: dict[int, dict] = {}  # step -> metrics, of the steps this job object ran
        self.max_model_len = spec.rollout.max_model_len or d.max_prompt_tokens + generated_tokens(spec.rollout)
        self.started = False
        self.stop_reason: str | None = None
        self._trained_figures = None  # the fleet's figures of the batch the last step trained on
        self.resume_from = resume_point(self.checkpoint_root(), resume or spec.resume == "auto", self.status)
        if self.resume_from is not None:
            past_trip = resume_past_trip or bool(spec.monitor and spec.monitor.resume_past_trip)
            check_resume(self.checkpoint_root(), past_trip, clear=not dry_run)
            self._restore_state(self.resume_from)
        self.metrics = self.guard = None
        if dry_run:
            return
        open_step_logs(self.output_dir, self.step if self.resume_from is not None else None)
        self.metrics = MetricSinks(sinks if sinks is not None else [
            MetricsLogger(self.output_dir, host=spec.metrics.host, port=spec.metrics.port, job=spec.name, echo=False),
            *build_trackers(spec, self.output_dir, self.status)])
        resumed_at = self.step if self.resume_from is not None else None
        self.guard = build_guard(spec.monitor, self.checkpoint_root(), self.scoring.weights, self.status, resumed_at,
                                 self.metrics_path)
        if self.guard is not None:
            self.guard.apply_weights(self)

    # ---- lifecycle ------------------------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        """The trainer's latest policy version, read from the job's ledger (``versions``, its one owner)."""
        return self.versions.current

    def start(self) -> None:
        """Start the trainer (from the model, or the checkpoint resumed), the fleet (engines at the trainer's
        policy version, joined to its weight sync) and the reward pool."""
        if self.dry_run:
            raise SetupError("a job built with dry_run=True only checks its inputs; build it again to run it")
        self.status("starting rollout engines and train workers")
        ckpt = str(self.resume_from) if self.resume_from is not None else None
        lora = self.spec.train.lora is not None  # a LoRA checkpoint holds adapters only: engines start from the base
        try:
            self.trainer.start(self.model_path, policy_path=ckpt)
            if ckpt is not None:
                self._load_optimizer(ckpt)
            engine_weights = self.model_path if lora or ckpt is None else ckpt
            self.fleet.start(engine_weights, self.policy_version, self.trainer, self.versions, self.status)
            if lora and ckpt is not None:
                self.fleet.sync_policy()  # the base model's engines get the checkpoint's policy (merged or adapters)
            self.reward_pool.start()
        except BaseException:
            self.stop_workers()
            raise
        self.producer.fleet = self.training.fleet = self.fleet
        self.training.trainer = self.trainer
        self.started = True
        where = f" from {ckpt} (step {self.step}, policy version {self.policy_version})" if ckpt else ""
        self.status(f"ready{where}: {self.fleet.describe()}, {self.trainer.describe()}, "
                    f"{self.reward_pool.describe()}")

    def run(self) -> list[dict]:
        """Run ``total_steps`` steps (fewer when the reward-hacking guard stops the job); returns every step's metrics
        (none when a resumed job is already done)."""
        if self.step >= self.spec.total_steps:
            self.status(f"nothing to do: step {self.step} of total_steps={self.spec.total_steps} is done")
            return []
        if not self.started:
            self.start()
        bar = tqdm(total=self.spec.total_steps, desc="GRPO", unit="step", file=sys.stderr, disable=not self.progress)
        try:
            bar.update(self.step)
            if self.step == 0 and (start := self._evaluate()):  # the starting weights: a row of its own, step 0
                if self.guard is not None:
                    self.guard.observe(0, start)  # the monitor's held-out baseline
                self.metrics.log(0, start)
                tqdm.write(format_console_line(0, start), file=sys.stdout)
            while self.step < self.spec.total_steps and self.stop_reason is None:
                self._apply_control()
                self.step += 1
                metrics = {**self.run_step(bar), **self._evaluate()}
                tripped = self.guard is not None and self.guard.observe(self.step, metrics)  # adds monitor/*
                self._log_step(metrics)
                if self._checkpoint_due():
                    self.save_checkpoint()
                if tripped:
                    self.guard.act(self, self.step, metrics)  # warn, stop, or roll back and go on
                bar.update(self.step - bar.n)
        finally:
            bar.close()
        return [self.completed[step] for step in sorted(self.completed)]

    def close(self) -> None:
        """Close the metric sinks."""
        if self.metrics is not None:
            self.metrics.close()

    def stop_workers(self) -> None:
        """Stop the fleet, the trainer and the reward pool (each idempotent); the job can :meth:`start` them
        again."""
        for part in (self.fleet, self.trainer, self.reward_pool):
            if part is not None:
                part.shutdown()
        self.started = False

    def shutdown(self) -> None:
        """Stop everything this job started: the control channel, the engines, the train ranks and the reward
        workers."""
        if self.control is not None:
            self.control.close()
            self.control = None
        if self.episodes is not None:
            self.episodes.host.shutdown()
        self.stop_workers()

    def scale_rollout(self, replicas: int) -> None:
        """Resize the rollout side to ``replicas`` engines between steps (:meth:`Fleet.scale`)."""
        self.fleet.scale(replicas)

    def _apply_control(self) -> None:
        """Apply a replica count set by ``grpo-cluster scale`` and publish the job's state."""
        if self.control is None:
            return
        desired = self.control.desired_rollout_replicas()
        if desired is not None and desired != self.fleet.num_engines:
            self.scale_rollout(int(desired))
        self.control.report({"step": self.step, "policy_version": self.policy_version,
                             "rollout_replicas": self.fleet.num_engines, "total_steps": self.spec.total_steps,
                             "engine_restarts": self.fleet.restarts})

    # ---- what the guard may do (cluster.loop.guard.GuardTarget) ------------------------------------------------
    def request_stop(self, reason: str) -> None:
        """End the job cleanly after the running step (``reason`` is kept in :attr:`stop_reason`)."""
        self.stop_reason = reason

    def set_reward_weight(self, name: str, weight: float) -> None:
        """Use ``weight`` for reward component ``name`` from the next scored group on.

        Raises:
            KeyError: ``name`` is not one of ``algorithm.rewards``.
        """
        if name not in self.scoring.weights:
            raise KeyError(f"reward {name!r} is not in algorithm.rewards {sorted(self.scoring.weights)}")
        self.scoring.weights[name] = float(weight)

    def restore(self, path: Path) -> None:
        """Return to checkpoint ``path``: stop the collaborators, restore the driver state, cut the per-step logs and
        the finished steps back to its step, and start the collaborators again from it.

        Raises:
            SetupError: the checkpoint does not fit the job (naming the file).
        """
        self.stop_workers()
        self.resume_from = Path(path)
        self._restore_state(self.resume_from)
        open_step_logs(self.output_dir, self.step)
        self.metrics.reopen()
        for step in [s for s in self.completed if s > self.step]:
            del self.completed[step]
        self.start()

    # ---- one step -------------------------------------------------------------------------------------------------
    def run_step(self, bar=None) -> dict:
        """generate → score → advantages (repeated by dynamic sampling) → train → sync, in the order of
        ``rollout.mode`` (:attr:`schedule`). Returns the step's metrics."""
        clock = self.training.clock = StepClock(bar)
        self.producer.begin_step()
        outcome = self.schedule.step(self.step, bar)
        batch, trained = outcome.batch, outcome.trained
        for phase, seconds in batch.seconds.items():
            clock.add(phase, seconds)
        self._trained_figures = batch.fleet
        record_trained_prompts(self.output_dir, self.step, self.policy_version, batch.prompts,
                               self.fleet.num_engines, self.schedule.sample_versions(batch))
        metrics = step_metrics(
            policy_version=self.policy_version, sampling=batch.sampling, group_size=batch.group_size,
            version_at_train=trained.version_at_train, fleet=batch.fleet, engines=self.fleet.num_engines,
            restarts=self.fleet.restarts, train=trained.result, skipped_total=self.skips.total,
            sync=outcome.synced, packing=trained.packing, epoch=self.sampler.epoch,
            prompts_filtered=self.prompts_filtered, bad_rows=self.bad_rows, clock=clock)
        metrics.update(self.schedule.metrics(outcome))
        metrics.update(self.producer.partial_metrics(batch.sampling.batch))
        metrics.update(self.reward_pool.metrics())
        return metrics

    def _evaluate(self) -> dict:
        """The held-out ``eval/*`` metrics when an evaluation is due after this step (``cluster.loop.evaluation``),
        on the engines' current weights; {} otherwise."""
        if self.evaluation is None or not self.evaluation.due(self.step):
            return {}
        if self.episodes is not None:  # held-out episodes run the same way as training's
            return self.evaluation.run(self.step, partial(self.episodes.run, self.fleet,
                                                          examples=self.evaluation.rows, record=False))
        return self.evaluation.run(self.step, partial(self.fleet.generate, record=False))

    def _log_step(self, metrics: dict) -> None:
        """Record the finished step: the metrics row, the per-engine figures of the batch it trained on, and the
        console line when due."""
        self.completed[self.step] = metrics
        self.metrics.log(self.step, metrics)
        self.fleet.log_workers(self.metrics, self.step, self._trained_figures)
        if self.step % self.spec.metrics.log_every_steps == 0 or self.step == self.spec.total_steps:
            tqdm.write(format_console_line(self.step, metrics), file=sys.stdout)

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def checkpoint_root(self) -> Path:
        """``checkpoint.dir``, or ``output_dir/checkpoints``."""
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
        drawn but not yet sampled, KL and group-size controllers; with eval, the best step; the rollout mode's own
        fields), then prune to ``checkpoint.keep_last``, sparing the best step's checkpoint with
        ``checkpoint.keep_best``.

        Atomic: everything is written into ``step_NNNNNN.partial`` and renamed when complete (``trainer_state.json``
        last), so a crash mid-write leaves the previous checkpoint the latest complete one.
        """
        state = driver_state(step=self.step, policy_version=self.policy_version, prompts=self.requests,
                             prompts_filtered=self.prompts_filtered, model_path=self.model_path,
                             kl_coef=self.kl_controller.value, group_size=self.group_size, skips=self.skips,
                             engine_restarts=self.fleet.restarts if self.started else 0,
                             inflight=self.schedule.inflight())
        if self.evaluation is not None:
            state["eval"] = self.evaluation.state_dict()
        state.update(self.schedule.state_dict())
        path = write_checkpoint(self.checkpoint_root(), self.step, self.trainer, self.model_path,
                                spec_to_yaml(self.spec), state, self.spec.checkpoint.keep_last,
                                protect=self.evaluation.protected_step() if self.evaluation is not None else None)
        self.status(f"checkpoint saved: {path}")
        return path

    def _restore_state(self, path: Path) -> None:
        """Restore the driver's side of checkpoint ``path`` (the collaborators load theirs in :meth:`start`).

        Raises:
            SetupError: the checkpoint's policy is not what the spec trains (LoRA adapters vs full weights, or other
                LoRA rank/alpha), or its driver state does not fit the spec's data.
        """
        check_policy_kind(path, self.spec.train.lora)
        self.schedule.restore(path)  # batches prefetched or carried: their prompts are drawn again from the position
        self.step, policy_version = restore_driver_state(path, prompts=self.requests, kl_controller=self.kl_controller,
                                                         group_size=self.group_size, skips=self.skips)
        self.versions.restore(policy_version)
        restore_best(self.evaluation, path)
        if self.step >= self.spec.total_steps:
            self.status(f"resume: checkpoint {path} is at step {self.step} >= total_steps={self.spec.total_steps}")

    def _load_optimizer(self, ckpt: str) -> None:
        """The train ranks load checkpoint ``ckpt``'s optimizer state; fields the spec changed are said."""
        changed = load_train_state(self.trainer, ckpt, self.policy_version)
        if changed:  # the spec's values are in use (what actor/lr etc. report), not the checkpoint's
            self.status("optimizer fields changed from the checkpoint (saved -> in use): " + ", ".join(
                f"{field} {saved!r} -> {used!r}" for field, (saved, used) in changed.items()))

    def status(self, message: str) -> None:
        """Print a one-line status message (``[grpo-cluster] ...``) on stderr, above the progress bar."""
        tqdm.write(f"[grpo-cluster] {message}", file=sys.stderr)
