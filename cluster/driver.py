"""The GRPO loop: generate → score → advantages → train → sync, once per policy version.

    grpo-cluster run examples/learn_cpu.yaml                         # the Ray shell builds the job (cluster.ray_shell)
    job = cluster.in_process.local_job(spec); job.run()             # in this process, no Ray or vLLM

Notation: B prompts per step, G completions per prompt (a group), N = B·G sequences.

:class:`GRPOJob` is pure: it is constructed from a spec and the collaborators it is given — the rollout side
(``contract.protocols.Fleet``), the train side (``Trainer``), the reward pool (``RewardPool``, optional: default the
driver itself), metric sinks and an optional control channel — and imports neither Ray nor a runtime. Each phase is a
call into the part that owns it (``cluster/loop/``): ``setup`` (the checks before anything starts), ``job_workers``
(starting, stopping and scaling the collaborators), ``production`` (prompts → groups → rewards → advantages,
dynamic sampling, partial rollouts), ``training`` (micro-batches, the update, the KL controller, skipped updates, the
sync), ``rollout_modes`` (``rollout.mode``: when each batch is generated relative to training), ``step_metrics`` (the
metrics row), ``job_checkpoints`` (when, what, save, resume), ``evaluation`` (held-out ``eval/*`` between steps; the
starting weights' row has step 0) and ``guard`` (the reward-hacking guard, which acts on the job through
:class:`cluster.loop.guard.GuardTarget`).

Reliability: every group is sampled with its own seed (spec seed, step, group id), so a group sampled again — after
an engine died, or after a resume — comes out the same. Checkpoints are written to a temporary folder and renamed;
``resume: auto`` / ``--resume`` continue from the latest complete one with the same prompts, policy version and
per-step results. Updates with NaN/Inf are skipped and counted.
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

from tqdm import tqdm

from cluster.data import PromptSampler
from cluster.loop.agent_episodes import AgentEpisodeRunner, check_agent_parts
from cluster.loop.checkpoint_state import open_step_logs, resume_point
from cluster.loop.episodes import make_episode_runner
from cluster.loop.evaluation import load_evaluation
from cluster.loop.goodput import GoodputLedger
from cluster.loop.guard import build_guard, check_resume
from cluster.loop.health import HealthMonitor, StepView
from cluster.loop.job_checkpoints import JobCheckpoints, checkpoint_root
from cluster.loop.job_workers import JobWorkers
from cluster.loop.preemption import Preemption
from cluster.loop.production import BatchProducer
from cluster.loop.requests import PromptQueue
from cluster.loop.rollout_modes import make_rollout
from cluster.loop.samples import SampleRecorder
from cluster.loop.sampling import GroupSizeController
from cluster.loop.scoring import Scoring
from cluster.loop.setup import SetupError, check_before_start, load_prompts, model_eos_ids
from cluster.loop.step_metrics import record_trained_prompts, step_metrics
from cluster.loop.summary import build_summary, write_summary
from cluster.loop.training import SkippedUpdates, TrainPhase
from cluster.sinks.metrics import MetricSinks, MetricsLogger, format_console_line, read_metrics_jsonl
from cluster.sinks.samples import SampleLog
from cluster.sinks.trackers import build_trackers
from cluster.rewards.inline import InlineRewardPool
from cluster.spec import JobSpec, spec_to_yaml
from cluster.spec.agents import AGENT_REWARD, context_tokens
from cluster.spec.algorithm import off_policy_warning
from cluster.spec.multi_turn import ENVIRONMENT_REWARD
from contract.agents import AgentEndpoint, AgentPool
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
        agent_pool, agent_endpoint: (``rollout.agent``, or ``rollout.multi_turn.runner: agent_pool``) where the
            episodes run (``contract.agents.AgentPool``, not started) and the rollout side's chat-completions
            endpoint they call (``contract.agents.AgentEndpoint``; started with the fleet when it has ``start``).
        sinks: where metrics go; None: ``metrics.jsonl`` and the spec's Prometheus endpoint (``MetricsLogger``),
            ``samples.jsonl`` (``SampleLog``: ``metrics.samples_per_step``) and the trackers of ``metrics.trackers``
            (``cluster.sinks.trackers``).
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
                 reward_pool: RewardPool | None = None, agent_pool: AgentPool | None = None,
                 agent_endpoint: AgentEndpoint | None = None, sinks: list[MetricSink] | None = None,
                 control: ControlChannel | None = None, progress: bool = True, resume: bool = False,
                 dry_run: bool = False, resume_past_trip: bool = False):
        if not dry_run and (fleet is None or trainer is None):
            raise SetupError("GRPOJob needs a fleet and a trainer (contract.protocols); build a ready job with "
                             "cluster.ray_shell.runtime.build_job(spec) or cluster.in_process.local_job(spec)")
        self.spec, self.progress, self.dry_run = spec, progress, dry_run
        self.fleet = fleet
        self.trainer = trainer
        self._born = time.monotonic()
        self.reward_pool = reward_pool if reward_pool is not None else InlineRewardPool()
        agents = check_agent_parts(spec, agent_pool, agent_endpoint, dry_run)
        self.agent_pool, self.agent_endpoint = (agent_pool, agent_endpoint) if agents else (None, None)
        self.workers = JobWorkers(fleet, trainer, self.reward_pool, agent_pool=self.agent_pool,
                                  agent_endpoint=self.agent_endpoint, control=control, status=self.status)
        self.output_dir = Path(spec.output_dir)
        self.metrics_path = self.output_dir / "metrics.jsonl"
        self.model_path, tokenizer = check_before_start(spec, self.checkpoint_root(), (trainer, fleet),
                                                        create=not dry_run)
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
        self.samples = SampleRecorder(tokenizer, spec.metrics.samples_per_step, spec.metrics.sample_max_tokens)
        alg = spec.algorithm
        if (warning := off_policy_warning(alg, spec.rollout)) is not None:
            self.status(f"warning: {warning}")
        self.scoring = Scoring(alg, spec.rollout.max_response_tokens, model_eos_ids(self.model_path, tokenizer),
                               episode_reward=AGENT_REWARD if spec.rollout.agent is not None else ENVIRONMENT_REWARD)
        self.group_size = GroupSizeController(spec.rollout.group_size, alg.group_size_schedule, alg.group_size_max,
                                              alg.group_size_rise_threshold)
        self.kl_controller = make_kl_controller(alg.kl_controller, alg.kl_coef, alg.kl_target, alg.kl_horizon_sequences)
        self.skips = SkippedUpdates(spec.train.max_skipped_updates)
        self.versions = PolicyVersionLedger()
        self.episodes = (  # agents (or environments) on the agent pool; multi_turn; None: one completion each
            AgentEpisodeRunner.for_job(spec, agent_endpoint, agent_pool, tokenizer, self.versions, self.status)
            if agents else make_episode_runner(spec, tokenizer, self.status))
        # every collaborator that reports its workers' time (contract.goodput.TimedPool) is read each step
        self.goodput = GoodputLedger(lambda: (self.fleet, self.trainer, self.reward_pool, self.episodes,
                                              self.agent_pool))
        self.health = HealthMonitor(spec.health, self.status)
        self.producer = BatchProducer(spec, self.requests, self.scoring, self.group_size, self.status,
                                      self.reward_pool, fleet=fleet, episodes=self.episodes,
                                      driver_clock=self.goodput.driver)
        self.preemption = Preemption(spec.checkpoint.on_preempt, self.checkpoint_root(), self.status)
        self.training = TrainPhase(spec, self.kl_controller, self.skips, self.versions, self.status,
                                   current_step=lambda: self.step, trainer=trainer, fleet=fleet,
                                   driver_clock=self.goodput.driver,
                                   before_update=self.preemption.update_begins)  # a SIGTERM from then finishes the step
        self.schedule = make_rollout(spec, self.producer, self.training, lambda: self.policy_version, self.status)
        self.checkpoints = JobCheckpoints(spec, self.model_path, prompts=self.requests,
                                          prompts_filtered=self.prompts_filtered, kl_controller=self.kl_controller,
                                          group_size=self.group_size, skips=self.skips, versions=self.versions,
                                          schedule=self.schedule, evaluation=self.evaluation, trainer=trainer,
                                          status=self.status)
        self.step = 0
        self.completed: dict[int, dict] = {}  # step -> metrics, of the steps this job object ran
        self.max_model_len = spec.rollout.max_model_len or context_tokens(spec.rollout, d.max_prompt_tokens)
        self.started = False
        self.stop_reason: str | None = None
        self.summary: dict | None = None  # the end-of-run summary, once run() ended (cluster.loop.summary)
        self._trained_figures = None  # the fleet's figures of the batch the last step trained on
        self.resume_from = resume_point(self.checkpoint_root(), resume or spec.resume == "auto", self.status)
        if self.resume_from is not None:
            past_trip = resume_past_trip or bool(spec.monitor and spec.monitor.resume_past_trip)
            check_resume(self.checkpoint_root(), past_trip, clear=not dry_run)
            self.step = self.checkpoints.restore(self.resume_from)
        self.metrics = self.guard = None
        if dry_run:
            return
        open_step_logs(self.output_dir, self.step if self.resume_from is not None else None)
        self._replay_health()
        self.metrics = MetricSinks(sinks if sinks is not None else [
            MetricsLogger(self.output_dir, host=spec.metrics.host, port=spec.metrics.port, job=spec.name, echo=False),
            SampleLog(self.output_dir), *build_trackers(spec, self.output_dir, self.status)])
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
        self.workers.start(self.model_path, ckpt, self.versions, lora=self.spec.train.lora is not None)
        self.started = True
        where = f" from {ckpt} (step {self.step}, policy version {self.policy_version})" if ckpt else ""
        self.status(f"ready{where}: {self.workers.describe()}")

    def run(self) -> list[dict]:
        """Run ``total_steps`` steps (fewer when the reward-hacking guard stops the job); returns every step's metrics
        (none when a resumed job is already done).

        Raises:
            Preempted: a SIGTERM came (``checkpoint.on_preempt``, :mod:`cluster.loop.preemption`); the step in flight
                was finished or abandoned and its checkpoint written. The caller shuts the workers down and exits.
        """
        if self.step >= self.spec.total_steps:
            self.status(f"nothing to do: step {self.step} of total_steps={self.spec.total_steps} is done")
            self._summarize()
            return []
        with self.preemption.armed():
            return self._run()

    def _run(self) -> list[dict]:
        with self.preemption.abortable(self):  # start-up and the starting evaluation: nothing trained to save
            if not self.started:
                self.start()
            start = self._evaluate() if self.step == 0 else {}
        bar = tqdm(total=self.spec.total_steps, desc="GRPO", unit="step", file=sys.stderr, disable=not self.progress)
        try:
            bar.update(self.step)
            if start:  # the starting weights: a row of its own, step 0
                if self.guard is not None:
                    self.guard.observe(0, start)  # the monitor's held-out baseline
                self.metrics.log(0, start)
                self.metrics.log_samples(0, self.samples.take())
                tqdm.write(format_console_line(0, start), file=sys.stdout)
            while self.step < self.spec.total_steps and self.stop_reason is None:
                self.workers.apply_control({"step": self.step, "policy_version": self.policy_version,
                                            "total_steps": self.spec.total_steps})
                self.preemption.between_steps(self)  # after a SIGTERM: checkpoint, Preempted
                self.step += 1
                with self.preemption.step_in_flight(self):  # a SIGTERM before the update abandons the step
                    step_metrics = self.run_step(bar)
                metrics = {**step_metrics, **self._evaluate()}
                tripped = self.guard is not None and self.guard.observe(self.step, metrics)  # adds monitor/*
                self._log_step(metrics)
                if self.checkpoints.due(self.step):
                    self.save_checkpoint()
                if tripped:
                    self.guard.act(self, self.step, metrics)  # warn, stop, or roll back and go on
                bar.update(self.step - bar.n)
            self.preemption.between_steps(self)  # a SIGTERM during the last step
        finally:
            bar.close()
        self._summarize()
        return [self.completed[step] for step in sorted(self.completed)]

    def _replay_health(self) -> None:
        """A resumed or rolled-back job: the health detectors start afresh from the rows kept in ``metrics.jsonl``
        (those up to the checkpoint's step), so they judge the next steps as the uninterrupted run's would."""
        if self.resume_from is not None and self.metrics_path.is_file():
            self.health.restart(read_metrics_jsonl(self.metrics_path))

    def _summarize(self) -> None:
        """Write the end-of-run summary (``summary.json``, ``summary.txt``; :mod:`cluster.loop.summary`) from the
        run's ``metrics.jsonl`` into :attr:`summary`."""
        rows = read_metrics_jsonl(self.metrics_path) if self.metrics_path.is_file() else []
        self.summary = build_summary(
            rows, name=self.spec.name, output_dir=self.output_dir, total_steps=self.spec.total_steps,
            wall_s=time.monotonic() - self._born, steps_run=self.completed, stop_reason=self.stop_reason,
            accounting_s=self.goodput.overhead_s + self.health.overhead_s, checkpoint_dir=self.checkpoint_root())
        write_summary(self.output_dir, self.summary)

    def close(self) -> None:
        """Close the metric sinks."""
        if self.metrics is not None:
            self.metrics.close()

    def stop_workers(self) -> None:
        """Stop the agent pool and the endpoint, the fleet, the trainer and the reward pool (each idempotent); the
        job can :meth:`start` them again."""
        self.workers.stop()
        self.started = False

    def shutdown(self) -> None:
        """Stop everything this job started: the control channel, the engines, the train ranks and the reward
        workers."""
        self.workers.close_control()
        if self.episodes is not None:
            self.episodes.shutdown()
        self.stop_workers()

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
        self.step = self.checkpoints.restore(self.resume_from)
        open_step_logs(self.output_dir, self.step)
        self.metrics.reopen()
        self._replay_health()
        for step in [s for s in self.completed if s > self.step]:
            del self.completed[step]
        self.start()

    # ---- one step -------------------------------------------------------------------------------------------------
    def run_step(self, bar=None) -> dict:
        """generate → score → advantages (repeated by dynamic sampling) → train → sync, in the order of
        ``rollout.mode`` (:attr:`schedule`). Returns the step's metrics."""
        clock = self.training.begin_step(bar)
        self.goodput.begin_step()
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
        metrics.update(self.goodput.end_step(sync_s=clock.seconds["sync"], trained_tokens=trained.trained_tokens))
        metrics.update(self.schedule.metrics(outcome))
        metrics.update(self.producer.partial_metrics(batch.sampling.batch))
        metrics.update(self.reward_pool.metrics())
        if self.agent_pool is not None:
            metrics.update(self.agent_pool.metrics())
        self.samples.train_records(self.step, batch.sampling.batch, trained.result, trained.version_at_train,
                                   self.policy_version)
        sampled = batch.sampling.sampled
        metrics.update(self.health.observe(StepView(self.step, metrics, sampled.response_ids, sampled.texts,
                                                    sampled.finish_reasons)))
        return metrics

    def _evaluate(self) -> dict:
        """The held-out ``eval/*`` metrics when an evaluation is due after this step (``cluster.loop.evaluation``),
        on the engines' current weights; {} otherwise."""
        if self.evaluation is None or not self.evaluation.due(self.step):
            return {}
        if self.episodes is not None:  # held-out episodes run the same way as training's
            generate = partial(self.episodes.run, self.fleet, examples=self.evaluation.rows, record=False)
        else:
            generate = partial(self.fleet.generate, record=False)
        metrics = self.evaluation.run(self.step, generate)
        self.samples.eval_records(self.step, *self.evaluation.results())
        return metrics

    def _log_step(self, metrics: dict) -> None:
        """Record the finished step: the metrics row, the per-engine figures of the batch it trained on, and the
        console line when due."""
        self.completed[self.step] = metrics
        self.metrics.log(self.step, metrics)
        self.metrics.log_samples(self.step, self.samples.take())
        self.fleet.log_workers(self.metrics, self.step, self._trained_figures)
        if self.step % self.spec.metrics.log_every_steps == 0 or self.step == self.spec.total_steps:
            tqdm.write(format_console_line(self.step, metrics), file=sys.stdout)

    # ---- checkpoints (cluster.loop.job_checkpoints) ---------------------------------------------------------------
    def checkpoint_root(self) -> Path:
        """``checkpoint.dir``, or ``output_dir/checkpoints``."""
        return checkpoint_root(self.spec)

    def save_checkpoint(self, state: dict | None = None) -> Path:
        """Write the checkpoint of ``state`` (:meth:`checkpoint_state`; None: now's) and return its folder
        (:meth:`JobCheckpoints.save`: atomic, pruned to ``checkpoint.keep_last``)."""
        return self.checkpoints.save(state if state is not None else self.checkpoint_state())

    def checkpoint_state(self) -> dict:
        """The driver state a checkpoint written now records (``trainer_state.json``, :meth:`JobCheckpoints.state`)."""
        return self.checkpoints.state(self.step, self.fleet.restarts if self.started else 0)

    def status(self, message: str) -> None:
        """Print a one-line status message (``[grpo-cluster] ...``) on stderr, above the progress bar."""
        tqdm.write(f"[grpo-cluster] {message}", file=sys.stderr)
