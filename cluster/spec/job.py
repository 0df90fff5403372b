"""The top-level job spec, :class:`JobSpec`: every section, and the checks that involve more than one section.

Imports only pydantic and :mod:`cluster.spec` modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from cluster.spec.agents import AGENT_REWARD, agent_conflicts, context_tokens, uses_agent_pool
from cluster.spec.algorithm import REWARD_NAMES, AlgorithmSpec, FieldConflict, algorithm_conflicts
from cluster.spec.data import implied_source
from cluster.spec.evaluation import EvalSpec, eval_conflicts
from cluster.spec.fields import MAX_SEED, SPEC_CONFIG
from cluster.spec.implied import Rule, with_implied
from cluster.spec.health import HealthSpec
from cluster.spec.lora import lora_conflicts
from cluster.spec.monitor import MonitorSpec
from cluster.spec.multi_turn import ENVIRONMENT_REWARD
from cluster.spec.rewards import RewardEndpointSpec, RewardPoolSpec, register_endpoints
from cluster.spec.sections import (
    CheckpointSpec, DataSpec, MetricsSpec, ModelSpec, RaySpec, RolloutSpec, SyncSpec, TrainSpec,
)

__all__ = ["JobSpec"]


def job_implied(values: Mapping[str, Any]) -> dict[str, tuple[Any, str]]:
    """The job's :data:`cluster.spec.implied.Rule` across sections. An agent (``rollout.agent``) returns its
    episode's reward, so ``algorithm.rewards`` defaults to none and ``eval.format_reward`` to null (its held-out
    episodes are scored by its own reward). A generated task (``data.source: reasoning_gym``, given or implied) is
    scored by its own scorer, so the settings that name the task's reward default to it: ``algorithm.rewards``
    ``{reasoning_gym: 1.0}``, ``eval.accuracy_reward`` (with an ``eval`` section and no ``eval.data_path``) and
    ``monitor.verifiable_reward`` (with a ``monitor`` section); with an agent nothing more is implied."""
    out: dict[str, tuple[Any, str]] = {}
    ev, monitor, rollout = values.get("eval"), values.get("monitor"), values.get("rollout")
    if isinstance(rollout, Mapping) and rollout.get("agent") is not None:
        why = "rollout.agent: the agent's return is the reward"
        out["algorithm.rewards"] = ({}, why)
        if isinstance(ev, Mapping):
            out["eval.format_reward"] = (None, why)
        return out  # the agent scores its own episodes, a generated task's too
    section = values.get("data")
    if not isinstance(section, Mapping) or (section.get("source") or implied_source(section)) != "reasoning_gym":
        return out
    why = "data.source reasoning_gym: a generated task is scored by its own scorer"
    out.setdefault("algorithm.rewards", ({"reasoning_gym": 1.0}, why))
    if isinstance(ev, Mapping) and ev.get("data_path") is None:
        out["eval.accuracy_reward"] = ("reasoning_gym", why)
    if isinstance(monitor, Mapping):
        out["monitor.verifiable_reward"] = ("reasoning_gym", why)
    return out


class JobSpec(BaseModel):
    """A whole GRPO job: model, data, rollout, training, algorithm, weight sync, metrics, checkpoints, Ray and
    (optional) held-out evaluation."""

    model_config = SPEC_CONFIG
    IMPLIED: ClassVar[Rule] = staticmethod(job_implied)
    name: str = Field("grpo", min_length=1, description="Job name (metrics label, Ray job name).")
    seed: int = Field(0, ge=0, le=MAX_SEED, strict=True, description=(
        "Root seed; per-step and per-sample seeds derive from it (replica and rank offsets are added, and numpy "
        "seeds must be < 2**32)."))
    output_dir: str = Field(min_length=1, description=(
        "Folder for metrics.jsonl, logs and checkpoints. A relative path is taken from the working directory "
        "`run` starts in (not the spec file's folder, unlike data.train_path): the examples write to "
        "runs/<name> under the folder they are run from."))
    total_steps: int = Field(ge=1, le=10_000_000, strict=True, description=(
        "Number of training steps (policy versions) to run."))
    model: ModelSpec = Field(default_factory=ModelSpec, description=ModelSpec.__doc__)
    data: DataSpec = Field(description=DataSpec.__doc__)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description=RolloutSpec.__doc__)
    train: TrainSpec = Field(default_factory=TrainSpec, description=TrainSpec.__doc__)
    # before algorithm: fields are validated in order, and algorithm.rewards may name an endpoint
    reward_endpoints: dict[str, RewardEndpointSpec] = Field(default_factory=dict, description=(
        f"Reward models served over HTTP, by name: {RewardEndpointSpec.__doc__} Each name is a reward function "
        "algorithm.rewards (and eval) may weight; the service is checked before the job starts."))
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec, description=AlgorithmSpec.__doc__)
    reward_pool: RewardPoolSpec = Field(default_factory=RewardPoolSpec, description=RewardPoolSpec.__doc__)
    sync: SyncSpec = Field(default_factory=SyncSpec, description=SyncSpec.__doc__)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec, description=MetricsSpec.__doc__)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description=CheckpointSpec.__doc__)
    ray: RaySpec = Field(default_factory=RaySpec, description=RaySpec.__doc__)
    eval: EvalSpec | None = Field(None, description=(
        f"{EvalSpec.__doc__} null (the default): no evaluation, no eval/* metrics."))
    monitor: MonitorSpec | None = Field(None, description=MonitorSpec.__doc__ + " Null: no guard.")
    health: HealthSpec = Field(default_factory=HealthSpec, description=HealthSpec.__doc__)
    resume: Literal["never", "auto"] = Field("never", description=(
        "'auto' continues from the latest complete checkpoint in checkpoint.dir when there is one "
        "(same as `grpo-cluster run --resume`)."))
    restart_on_failure: int = Field(0, ge=0, le=1000, strict=True, description=(
        "When a worker fails, tear the pools down and resume from the latest checkpoint, up to this many times."))

    @field_validator("reward_endpoints")
    @classmethod
    def _register_endpoints(cls, endpoints: dict[str, RewardEndpointSpec]) -> dict[str, RewardEndpointSpec]:
        return register_endpoints(endpoints)

    @model_validator(mode="wrap")
    @classmethod
    def _implied_by_choices(cls, data: Any, handler) -> JobSpec:
        """What an agent or a generated task implies when the spec leaves the setting out (:func:`job_implied`,
        :mod:`cluster.spec.implied`); values the spec gives are kept and checked as written (an agent's:
        :func:`cluster.spec.agents.agent_conflicts`)."""
        return with_implied(data, handler, job_implied)

    @model_validator(mode="after")
    def _cross_field_checks(self) -> JobSpec:
        rollout, train, rewards = self.rollout, self.train, self.reward_pool
        needed = context_tokens(rollout, self.data.max_prompt_tokens)
        if rollout.max_model_len is not None and needed > rollout.max_model_len:
            if rollout.agent is not None:
                raise FieldConflict("rollout.max_model_len", (
                    f"expected max_model_len >= rollout.agent_pool.max_episode_tokens (the longest context of an "
                    f"agent's call) = {needed}, got {rollout.max_model_len}"))
            what = ("rollout.multi_turn.max_episode_tokens" if rollout.multi_turn is not None
                    else "rollout.max_response_tokens")
            raise FieldConflict("rollout.max_model_len", (
                f"expected max_model_len >= data.max_prompt_tokens + {what} = "
                f"{self.data.max_prompt_tokens} + {needed - self.data.max_prompt_tokens} = {needed}, "
                f"got {rollout.max_model_len}"))
        if not self.algorithm.rewards and rollout.agent is None:
            raise FieldConflict("algorithm.rewards", (
                f"expected at least one reward from {', '.join(REWARD_NAMES)} (or one of your own), got none; only "
                f"an agent's job (rollout.agent) has none: its agent returns the reward"))
        for conflict in agent_conflicts(self, rewards_given=bool(self.algorithm.rewards)):
            raise conflict
        if rollout.agent is not None and AGENT_REWARD in self.algorithm.rewards:
            raise FieldConflict("algorithm.rewards", f"{AGENT_REWARD!r} is the reward component of an agent")
        if rollout.multi_turn is not None:
            mt = rollout.multi_turn
            turn = mt.turn_tokens(rollout.max_response_tokens)
            cap = "rollout.multi_turn.max_turn_tokens" if mt.max_turn_tokens is not None else \
                "rollout.max_response_tokens"
            if mt.max_episode_tokens < turn:
                raise FieldConflict("rollout.multi_turn.max_episode_tokens", (
                    f"expected at least one turn's cap ({cap} = {turn}), got {mt.max_episode_tokens}: the budget "
                    f"holds every turn and observation of an episode; lower the turn's cap or raise the budget"))
        if rollout.multi_turn is not None and ENVIRONMENT_REWARD in self.algorithm.rewards:
            raise FieldConflict("algorithm.rewards", (
                f"{ENVIRONMENT_REWARD!r} is the reward component of a multi-turn episode's environment "
                f"(reward/{ENVIRONMENT_REWARD}: its turn rewards), which the loop adds itself: expected no reward "
                f"function of that name with rollout.multi_turn, got {sorted(self.algorithm.rewards)}"))
        if rollout.multi_turn is not None and self.algorithm.overlong_buffer_tokens is not None:
            raise FieldConflict("algorithm.overlong_buffer_tokens", (
                "the DAPO overlong penalty measures a completion against rollout.max_response_tokens; a multi-turn "
                "episode (rollout.multi_turn) has a turn cap and an episode budget instead: expected "
                "overlong_buffer_tokens null with multi_turn"))
        agents = rollout.agent_pool if uses_agent_pool(rollout) else None
        cpus = (rollout.replicas * rollout.num_cpus_per_replica + train.world_size * train.num_cpus_per_worker
                + rewards.workers * rewards.num_cpus_per_worker
                + (agents.workers * agents.num_cpus_per_worker if agents is not None else 0))
        if self.ray.address is None and self.ray.num_cpus is not None and cpus > self.ray.num_cpus:
            reward = (f" + reward {rewards.workers} x {rewards.num_cpus_per_worker:g}"
                      if rewards.workers and rewards.num_cpus_per_worker else "")
            agent = (f" + agent {agents.workers} x {agents.num_cpus_per_worker:g}"
                     if agents is not None and agents.num_cpus_per_worker else "")
            raise FieldConflict("ray.num_cpus", (
                f"the job reserves {cpus:g} CPUs (rollout {rollout.replicas} x {rollout.num_cpus_per_replica:g} "
                f"+ train {train.world_size} x {train.num_cpus_per_worker:g}{reward}{agent}) but the local cluster "
                f"has {self.ray.num_cpus}; Ray would wait forever"))
        if (conflict := async_overlap_conflict(rollout, train)) is not None:
            raise conflict
        if rollout.partial_rollout and self.algorithm.dynamic_sampling:
            raise FieldConflict("rollout.partial_rollout", (
                "partial rollouts carry one interrupted sampling round over to the next producer call; dynamic "
                "sampling runs several rounds per batch: expected algorithm.dynamic_sampling false with "
                "partial_rollout true"))
        if train.warmup_steps > self.total_steps:
            raise FieldConflict("train.warmup_steps", (
                f"the warmup must fit in the run: expected warmup_steps <= total_steps ({self.total_steps}), got "
                f"{train.warmup_steps}"))
        if train.reduce_dtype not in ("float32", self.model.dtype):
            raise FieldConflict("train.reduce_dtype", (
                f"expected 'float32' or model.dtype ({self.model.dtype!r}), got {train.reduce_dtype!r}"))
        for conflict in algorithm_conflicts(self.algorithm, rollout):
            raise conflict
        for conflict in lora_conflicts(train.lora, rollout) if train.lora is not None else ():
            raise conflict
        for conflict in eval_conflicts(self.eval, self.data, rollout) if self.eval is not None else ():
            raise conflict
        if rollout.agent is not None and self.eval is not None:
            unused = [f"eval.{name}" for name in ("accuracy_reward", "format_reward", "max_tokens")
                      if name in self.eval.model_fields_set and getattr(self.eval, name) is not None]
            if unused:
                raise FieldConflict(unused[0], (
                    f"an agent's held-out episodes are scored by its own reward (eval/accuracy: the share whose "
                    f"'accuracy' component, or reward when it returns none, is >= 1) and its calls are capped by "
                    f"rollout.max_response_tokens: expected {', '.join(unused)} left out with rollout.agent"))
        if self.checkpoint.keep_best and self.eval is None:
            raise FieldConflict("checkpoint.keep_best", (
                "keep_best keeps the checkpoint of the best eval/accuracy step; it needs an eval section"))
        for conflict in monitor_conflicts(self):
            raise conflict
        generated = self.data.source == "reasoning_gym" and rollout.agent is None  # an agent scores its own
        weighted = {name for name, weight in self.algorithm.rewards.items() if weight != 0}
        if generated and ("accuracy" in weighted or "reasoning_gym" not in weighted):
            raise FieldConflict("algorithm.rewards", (
                f"data.source 'reasoning_gym' is scored by the task's own scorer: expected a nonzero "
                f"'reasoning_gym' weight and no 'accuracy' weight (it compares GSM8K numbers), got "
                f"{dict(self.algorithm.rewards)}"))
        if not generated and "reasoning_gym" in self.algorithm.rewards:
            raise FieldConflict("algorithm.rewards", (
                f"the 'reasoning_gym' reward scores problems from data.source 'reasoning_gym', got data.source "
                f"{self.data.source!r}"))
        return self


def async_overlap_conflict(rollout, train) -> FieldConflict | None:
    """``rollout.mode: async`` needs generation to overlap training. It cannot when an engine and train ranks share
    one GPU with no memory split. Ray gives a whole-number GPU request whole GPUs of its own, and packs fractional
    requests onto any GPU with room left, whatever the pools reserve in all; so an engine's GPU bundle (``rollout.
    num_gpus_per_replica``, split into ``tensor_parallel_size`` bundles by ``RolloutPool._spawn``) and a train rank
    (``train.num_gpus_per_worker``) can share a GPU when both are fractions (< 1) that fit together (sum <= 1). Up to
    n = min(``train.world_size``, ⌊(1 − engine bundle) / rank⌋) ranks fit beside one engine bundle; it is refused when
    the engine's memory share (``rollout.gpu_memory_utilization``) plus theirs (n × their reserved fraction, the only
    share the spec gives them) exceeds that GPU. CPU pools share cores, which overlap fine: never refused. None when
    async can overlap (or the mode is not async)."""
    tp = rollout.tensor_parallel_size if rollout.num_gpus_per_replica > 0 else 1
    engine, rank = rollout.num_gpus_per_replica / tp, train.num_gpus_per_worker  # GPUs per bundle / per rank
    tolerance = 1e-9  # reservations such as 0.1 × 3 are sums of binary fractions
    if rollout.mode != "async" or not (0 < engine < 1 and 0 < rank < 1) or engine + rank > 1 + tolerance:
        return None
    ranks = max(n for n in range(1, train.world_size + 1) if engine + n * rank <= 1 + tolerance)
    share = ranks * rank
    if rollout.gpu_memory_utilization + share <= 1 + tolerance:
        return None
    return FieldConflict("rollout.mode", (
        f"'async' overlaps generation with training, but an engine's GPU bundle ({rollout.num_gpus_per_replica:g} GPU "
        f"/ {tp} bundle(s) = {engine:g}) and {ranks} train rank(s) of {rank:g} GPU fit on one GPU, so they can share "
        f"one GPU, and rollout.gpu_memory_utilization {rollout.gpu_memory_utilization:g} + the train ranks' "
        f"{share:g} exceeds it: expected a memory split (gpu_memory_utilization <= {1 - share:g}) or pools that "
        f"cannot share a GPU (whole-GPU reservations, or an engine bundle and a rank that sum to > 1)"))


def monitor_conflicts(spec: JobSpec) -> list[FieldConflict]:
    """The ``monitor`` section against the rest of the spec (nothing when it is absent or disabled): the reward
    components it names must be weighted in ``algorithm.rewards``; ``rollback`` needs periodic checkpoints."""
    m = spec.monitor
    if m is None or not m.enabled:
        return []
    rewards = sorted(spec.algorithm.rewards)
    out = []
    if m.verifiable_reward not in rewards:
        out.append(FieldConflict("monitor.verifiable_reward", (
            f"expected one of algorithm.rewards {rewards}, got {m.verifiable_reward!r}")))
    unknown = [n for n in m.shaping_rewards or () if n not in rewards or n == m.verifiable_reward]
    if unknown:
        out.append(FieldConflict("monitor.shaping_rewards", (
            f"expected names from algorithm.rewards {rewards} other than verifiable_reward, got {unknown}")))
    ckpt = spec.checkpoint
    if m.action == "rollback" and not 1 <= ckpt.every_steps < spec.total_steps:
        out.append(FieldConflict("monitor.action", (
            "'rollback' restores the last checkpoint taken before the onset, so it needs checkpoints during the run: "
            f"expected 1 <= checkpoint.every_steps < total_steps ({spec.total_steps}), got {ckpt.every_steps}")))
    elif m.action == "rollback" and ckpt.keep_last is not None and ckpt.keep_last < 2:
        out.append(FieldConflict("monitor.action", (
            "'rollback' restores a checkpoint taken before the onset, which is never the newest one: expected "
            f"checkpoint.keep_last null or >= 2, got {ckpt.keep_last}")))
    return out
