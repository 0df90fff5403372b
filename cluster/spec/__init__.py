"""Job spec: the one validated, frozen description of a GRPO run.

A spec is a YAML file (see ``examples/``) validated into :class:`JobSpec`. Every model rejects unknown keys and
is frozen after validation; numbers carry their unit in the field name (``timeout_s``, ``bucket_bytes``,
``kv_cache_gib``). Derived per-rank numbers belong in a separate plan object, never in the spec.

Modules: ``fields`` (shared field types, bounds, validators), ``data`` (the data section: sources, columns,
prompt rendering), ``metrics`` (the metrics section and its experiment trackers), ``sections`` (model, rollout,
train, sync, checkpoint, Ray; re-exports ``data``'s and ``metrics``' models), ``algorithm`` (the GRPO objective;
reward keys, which may name functions by location and import them), ``rewards`` (the reward pool and reward
endpoints, registered as reward functions), ``multi_turn`` (``rollout.multi_turn``), ``agents`` (``rollout.agent``,
its options and its pool; the agent is imported and its signature checked), ``evaluation`` (held-out
evaluation), ``lora`` (LoRA adapters, ``train.lora``), ``monitor`` (the reward-hacking guard), ``health`` (health
warnings), ``variants`` (fields
that select a registered variant, checked against its registry), ``job`` (:class:`JobSpec` and its cross-section
checks), ``loading`` (YAML with file:line errors, ``--set`` overrides, :func:`spec_to_yaml`). This package imports only
pydantic, PyYAML and, lazily, ``grpo`` registries (reward functions, advantage estimators, loss aggregations, KL
estimators, TIS/MIS levels) and ``train_workers.registry`` (backend names); never Ray or other ``cluster``
subpackages, and torch only through those ``grpo`` modules. Validating a spec imports the reward functions it names
by location (``grpo.rewards.loading``) and its agent (``cluster.agents.loading``, lazily), and registers its reward
endpoints (``cluster.rewards.endpoint``).
"""

from cluster.spec.algorithm import MAX_GROUP_SIZE, REWARD_NAMES, AlgorithmSpec, MisSpec
from cluster.spec.data import HubDatasetSpec, HumanEvalSpec, ReasoningGymSpec
from cluster.spec.evaluation import MAX_EVAL_SAMPLES, EvalSpec
from cluster.spec.fields import (
    MAX_CUSTOM_RESOURCE, MAX_SEED, MAX_SEQUENCE_TOKENS, MAX_TIMEOUT_S, MAX_TOP_K, MIN_TEMPERATURE, ByteSize,
    CustomResources, parse_byte_size,
)
from cluster.spec.health import HealthSpec
from cluster.spec.job import JobSpec
from cluster.spec.lora import LoraSpec
from cluster.spec.loading import SpecError, load_spec, load_spec_text, locate_field_error, spec_to_yaml
from cluster.spec.monitor import MonitorSpec
from cluster.spec.rewards import RewardEndpointSpec, RewardPoolSpec
from cluster.spec.sections import (
    DEFAULT_SYSTEM_PROMPT, CheckpointSpec, DataSpec, MetricsSpec, ModelSpec, RaySpec, RolloutSpec, SyncSpec,
    TrainSpec,
)

__all__ = [
    "REWARD_NAMES", "SpecError", "ModelSpec", "DataSpec", "RolloutSpec", "TrainSpec", "AlgorithmSpec", "SyncSpec",
    "MetricsSpec", "CheckpointSpec", "RaySpec", "EvalSpec", "MonitorSpec", "HealthSpec", "LoraSpec", "MisSpec",
    "JobSpec",
    "HubDatasetSpec", "HumanEvalSpec", "ReasoningGymSpec", "RewardEndpointSpec", "RewardPoolSpec",
    "locate_field_error", "parse_byte_size",
    "load_spec", "load_spec_text", "spec_to_yaml",
]

# Also public (re-exported, not in __all__, as before the split): DEFAULT_SYSTEM_PROMPT, MAX_GROUP_SIZE, the other
# bounds (MAX_EVAL_SAMPLES too), ByteSize and CustomResources.
