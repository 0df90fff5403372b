"""Job spec: the one validated, frozen description of a GRPO run.

A spec is a YAML file (see ``examples/``) validated into :class:`JobSpec`. Every model rejects unknown keys and
is frozen after validation; numbers carry their unit in the field name (``timeout_s``, ``bucket_bytes``,
``kv_cache_gib``). Derived per-rank numbers belong in a separate plan object, never in the spec.

Loading (:func:`load_spec`)::

    spec = load_spec("examples/gsm8k_smollm2_cpu.yaml", ["rollout.group_size=8", "train.lr=1e-6"])

- Overrides are ``dotted.key=value``; the value is parsed as YAML (``4`` → int, ``true`` → bool, ``[1, 2]`` →
  list, an empty value → null). An unknown dotted key is an error that lists the valid keys at that level.
- Relative paths: ``data.train_path`` / ``data.test_path`` written in the YAML file are resolved against the YAML
  file's folder when the file exists there (so a spec can name data next to it), otherwise they are left as
  written, relative to the working directory. ``model.path`` likewise, when it names an existing folder next to
  the spec. Everything else (``output_dir``, ``checkpoint.dir``, ``model.cache_dir``) is relative to the working
  directory, as for any CLI tool. Values given with ``--set`` are never rewritten.
- Every problem is reported in one :class:`SpecError`, one line each:
  ``<file>:<line>: <dotted.field>: <message> (got <value>)``, with ``--set <key>`` in place of the line for
  values that came from an override (of the field, a section above it, or a key inside it).
- Integer fields are strict: ``4`` is accepted, ``true``, ``"4"`` and ``4.0`` are not (``--set x=4`` parses as an
  int). Counts and sizes have upper bounds that catch a mistyped extra digit.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.spec.algorithm import MAX_GROUP_SIZE, REWARD_NAMES, AlgorithmSpec, algorithm_conflicts
from cluster.spec.algorithm import FieldConflict as _FieldConflict

__all__ = [
    "REWARD_NAMES", "SpecError", "ModelSpec", "DataSpec", "RolloutSpec", "TrainSpec", "AlgorithmSpec", "SyncSpec",
    "MetricsSpec", "CheckpointSpec", "RaySpec", "JobSpec", "locate_field_error", "parse_byte_size", "load_spec",
    "load_spec_text", "spec_to_yaml",
]

DEFAULT_SYSTEM_PROMPT = (
    "You are a careful math tutor. Solve the problem by reasoning step by step. "
    "End your reply with a final line of the form '#### <number>', where <number> is the final answer."
)

_CONFIG = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

# Integer fields are strict: YAML (and --set) ints are accepted, but not true/false, "4" or 4.0. Upper bounds catch
# typos (an extra digit) before any resource is reserved.
MAX_SEQUENCE_TOKENS = 1_048_576
MAX_SEED = 2**31 - 1
MAX_TOP_K = 16_777_216  # far above any vocabulary; catches a mistyped extra digit
#: Lowest rollout temperature: vLLM's SamplingParams raises any temperature in (0, 0.01) to 0.01 (``_MAX_TEMP``,
#: with only a log warning), so a lower spec value would make the trainer's logprobs (at the spec's temperature)
#: describe another distribution than the one the engine sampled from.
MIN_TEMPERATURE = 0.01
#: Upper bound of every timeout (7 days): larger values overflow datetime.timedelta in torch.distributed.
MAX_TIMEOUT_S = 7 * 24 * 3600.0


class SpecError(ValueError):
    """A job spec could not be read or validated; the message lists every problem, one per line."""


#: Ray's builtin resources (lower case) → the field that sets each per actor; None: not settable per pool.
_BUILTIN_RESOURCES = {"cpu": "num_cpus", "gpu": "num_gpus", "memory": None, "object_store_memory": None}
#: Largest custom-resource amount per actor (a typo guard, like the bounds on counts).
MAX_CUSTOM_RESOURCE = 1_000_000.0
#: A pool's custom resources: strict names and amounts (``"1"`` or ``true`` are refused, ints are taken as floats).
CustomResources = dict[Annotated[str, Field(strict=True)], Annotated[float, Field(strict=True)]]


def _check_custom_resources(resources: dict[str, float], section: str, per: str) -> dict[str, float]:
    """Validate a pool's custom Ray resources per actor (``{name: amount}``), e.g. ``{"rollout_node": 1}``.

    Checked here so that a mistake fails at spec load naming the field, not at actor creation (Ray's own rules plus
    typo guards): names are non-empty without whitespace and are not Ray's builtin ``CPU``/``GPU``/``memory``/
    ``object_store_memory`` in any letter case (CPUs and GPUs have their own fields, e.g.
    ``rollout.num_cpus_per_replica``); amounts are > 0, at most :data:`MAX_CUSTOM_RESOURCE`, and whole multiples of
    0.0001 (Ray's resource unit), at least one unit (an amount like 1.0e-11 passes a rounding tolerance but is 0
    units).

    Raises:
        ValueError: naming the resource, what was expected and what was given.
    """
    for name, amount in resources.items():
        if not name or any(c.isspace() for c in name):
            raise ValueError(f"resource name {name!r}: expected a non-empty name without whitespace")
        if name.lower() in _BUILTIN_RESOURCES:
            field = _BUILTIN_RESOURCES[name.lower()]
            hint = f"set {section}.{field}_per_{per} instead" if field else "it cannot be reserved per pool"
            raise ValueError(f"resource {name!r} is one of Ray's builtin resources: {hint}")
        if not 0 < amount <= MAX_CUSTOM_RESOURCE:
            raise ValueError(f"resource {name!r}: expected an amount in (0, {MAX_CUSTOM_RESOURCE:g}], got {amount!r}")
        units = amount * 10_000
        if round(units) == 0 or abs(units - round(units)) > 1e-6:  # 1e-11 is 0 units: Ray would reserve nothing
            raise ValueError(f"resource {name!r}: expected a multiple of 0.0001 (Ray's resource unit), got {amount!r}")
    return resources


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_byte_size(value: Any) -> Any:
    """Turn ``"64MiB"``, ``"512MB"``, ``"1GiB"`` or ``"4096"`` into an int number of bytes.

    Units (case-insensitive): B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024). Non-strings are
    returned unchanged for the int validator to judge. Raises ValueError for unknown units or fractional bytes.
    """
    if not isinstance(value, str):
        return value
    match = _BYTE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BYTE_UNITS:
        raise ValueError(f"expected a byte size such as 67108864, '64MiB', '512MB' or '1GiB', got {value!r}")
    number = float(match.group(1)) * _BYTE_UNITS[unit]
    if number != int(number):
        raise ValueError(f"expected a whole number of bytes, got {value!r} = {number} bytes")
    return int(number)


ByteSize = Annotated[int, BeforeValidator(parse_byte_size)]


class ModelSpec(BaseModel):
    """Which policy model to train and how to hold its weights."""

    model_config = _CONFIG
    path: str = Field("builtin:SmolLM2-135M-Instruct", min_length=1, description=(
        "Model to start from: a builtin alias ('builtin:<name>'), a local Hugging Face folder, or a hub id."))
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description=(
            "Rollout engine dtype and the policy's compute dtype. float32: pure float32 training. bfloat16/float16: "
            "mixed precision (float32 parameters and AdamW state, forward/backward in this dtype, weights sent to "
            "the engines in this dtype); the frozen reference policy is held in this dtype."))
    cache_dir: str | None = Field(None, description=(
        "Folder for converted/downloaded model files; null means ~/.cache/grpo-cluster."))


class DataSpec(BaseModel):
    """Prompt data: GSM8K-style jsonl rows with a question and an answer ending in '#### <final answer>'."""

    model_config = _CONFIG
    train_path: str = Field(min_length=1, description="Training jsonl file (one JSON object per line).")
    test_path: str | None = Field(None, description="Optional held-out jsonl file for evaluation.")
    question_field: str = Field("question", min_length=1, description="JSON field holding the question.")
    answer_field: str = Field("answer", min_length=1, description="JSON field holding the worked answer.")
    system_prompt: str | None = Field(DEFAULT_SYSTEM_PROMPT, description=(
        "System message placed before every question; null sends no system message."))
    prompt_suffix: str = Field("", description="Text appended directly after the question in the user message.")
    max_prompt_tokens: int = Field(512, ge=1, le=MAX_SEQUENCE_TOKENS, strict=True, description=(
        "Prompts longer than this many tokens are dropped."))
    shuffle: bool = Field(True, description="Shuffle prompts each epoch (permutation derived from seed and epoch).")
    on_bad_row: Literal["error", "skip"] = Field("error", description=(
        "Malformed rows: 'error' stops with file:line, 'skip' drops and counts them."))


class RolloutSpec(BaseModel):
    """Rollout engine replicas (vLLM) and sampling: B prompts × G completions per step."""

    model_config = _CONFIG
    replicas: int = Field(1, ge=1, le=4096, strict=True, description="Number of rollout engine replicas (Ray actors).")
    num_cpus_per_replica: float = Field(1.0, ge=0, description="CPUs Ray reserves per rollout replica.")
    num_gpus_per_replica: float = Field(0.0, ge=0, description="GPUs Ray reserves per rollout replica.")
    tensor_parallel_size: int = Field(1, ge=1, le=1024, strict=True, description=(
        "Tensor-parallel ranks inside one engine replica."))
    prompts_per_step: int = Field(4, ge=1, le=65536, strict=True, description="B: prompts sampled per training step.")
    group_size: int = Field(4, ge=2, le=MAX_GROUP_SIZE, strict=True, description=(
        "G: completions per prompt (a group); advantages compare them."))
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE, le=10, description=(
        "Sampling temperature, at least 0.01: vLLM raises a lower one to 0.01 (SamplingParams), so the engine would "
        "sample at another temperature than the trainer's logprobs assume."))
    top_p: float = Field(1.0, gt=0, le=1, description=(
        "Nucleus sampling probability mass; 1 is off. The trainer's logprobs are renormalised over the same kept set "
        "(grpo.logprobs.filter_logits_)."))
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K, strict=True, description=(
        "Sample from the k most likely tokens (ties with the k-th kept, as in vLLM); 0 or -1 is off (vLLM's "
        "semantics), as is k >= vocabulary size."))
    min_p: float = Field(0.0, ge=0, lt=1, description=(
        "Drop tokens whose probability is below min_p times the most likely token's; 0 is off. vLLM applies it "
        "after the temperature, before top-k and top-p."))
    max_response_tokens: int = Field(256, ge=1, le=MAX_SEQUENCE_TOKENS, strict=True, description=(
        "Completion length cap in tokens."))
    kv_cache_gib: float = Field(2.0, gt=0, description="CPU engines: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float = Field(0.5, gt=0, lt=1, description=(
        "GPU engines: fraction of GPU memory the engine may use (weights + KV cache)."))
    enforce_eager: bool = Field(True, description="Disable CUDA graphs / compilation in the engine.")
    max_model_len: int | None = Field(None, ge=1, le=2 * MAX_SEQUENCE_TOKENS, strict=True, description=(
        "Engine context length in tokens; null lets the engine use the model's own."))
    timeout_s: float = Field(900, gt=0, le=MAX_TIMEOUT_S, description=(
        "Seconds to wait for one step's rollouts before failing."))
    max_staleness: int = Field(0, ge=0, le=1_000_000, strict=True, description=(
        "Largest accepted (trainer policy version - sample policy version); 0 is on-policy. Older samples are "
        "refused and sampled again."))
    max_engine_restarts: int = Field(3, ge=0, le=1_000_000, strict=True, description=(
        "Engines that die are replaced and synced before they serve; more than this many replacements in one job "
        "stop it with the cause."))
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field("PACK", description=(
        "Ray placement-group strategy across engine replicas (each multi-GPU engine's own bundles are always "
        "STRICT_PACK, i.e. on one node)."))
    resources: CustomResources = Field(default_factory=dict, description=(
        "Custom Ray resources each engine replica reserves besides CPUs/GPUs, e.g. {rollout_node: 1} to place the "
        "engines only on nodes started with `ray start --resources '{\"rollout_node\": 8}'`; {} reserves none."))

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        return _check_custom_resources(resources, "rollout", "replica")


class TrainSpec(BaseModel):
    """Train workers (FSDP2 ranks) and the AdamW optimizer."""

    model_config = _CONFIG
    world_size: int = Field(1, ge=1, le=65536, strict=True, description=(
        "Number of train ranks (Ray actors in one process group)."))
    num_cpus_per_worker: float = Field(1.0, ge=0, description="CPUs Ray reserves per train rank.")
    num_gpus_per_worker: float = Field(0.0, ge=0, description="GPUs Ray reserves per train rank.")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description=(
        "torch.distributed backend; 'auto' picks nccl when GPUs are reserved, else gloo."))
    num_threads: int | None = Field(None, ge=1, le=4096, strict=True, description=(
        "torch intra-op threads per rank; null keeps torch's."))
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (beta1, beta2), each in [0, 1).")
    max_grad_norm: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    reduce_dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description=(
        "dtype in which FSDP2 reduces (averages) gradients over the train ranks. With model.dtype bfloat16/float16 "
        "the policy trains in mixed precision: float32 parameters and AdamW state, forward/backward in model.dtype, "
        "gradients reduced in this dtype; it must be float32 or model.dtype."))
    max_tokens_per_microbatch: int = Field(4096, ge=16, le=16_777_216, strict=True, description=(
        "Token budget of one forward/backward pass."))
    timeout_s: float = Field(900, gt=0, le=MAX_TIMEOUT_S, description=(
        "Seconds to wait for one train step before failing."))
    oversize_sequences: Literal["own", "error"] = Field("own", description=(
        "A sequence longer than max_tokens_per_microbatch: 'own' trains it in a micro-batch of its own, 'error' "
        "stops the step naming it."))
    strategy: Literal["fsdp", "megatron"] = Field("fsdp", description=(
        "Data-parallel training strategy; 'megatron' is reserved and rejected until its workers exist."))
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field("PACK", description=(
        "Ray placement-group strategy for the train ranks' bundles."))
    resources: CustomResources = Field(default_factory=dict, description=(
        "Custom Ray resources each train rank reserves besides CPUs/GPUs, e.g. {train_node: 1} to place the ranks "
        "only on nodes that advertise that resource; {} reserves none."))
    max_skipped_updates: int = Field(3, ge=1, le=1_000_000, strict=True, description=(
        "Updates with a NaN/Inf loss or gradient are skipped (weights unchanged, nothing broadcast); this many in a "
        "row stop the job naming the step and the metric."))

    @field_validator("strategy")
    @classmethod
    def _strategy_available(cls, strategy: str) -> str:
        if strategy != "fsdp":
            raise ValueError(f"strategy {strategy!r} is not available yet; use 'fsdp'")
        return strategy

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        return _check_custom_resources(resources, "train", "worker")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"expected each beta in [0, 1), got {list(betas)}")
        return betas

    @model_validator(mode="after")
    def _backend_matches_devices(self) -> TrainSpec:
        if self.backend == "nccl" and self.num_gpus_per_worker == 0:
            raise _FieldConflict("train.backend", (
                "backend 'nccl' needs GPUs, but train.num_gpus_per_worker is 0; "
                "use 'gloo' or 'auto' on CPU, or reserve GPUs"))
        return self


class SyncSpec(BaseModel):
    """Streaming trainer weights into the rollout engines after each step."""

    model_config = _CONFIG
    bucket_bytes: ByteSize = Field(64 * 2**20, ge=1024, strict=True, description=(
        "Bytes per broadcast bucket; ints or strings like '64MiB', '512MB', '1GiB'."))
    verify: bool | Literal["sample"] = Field(True, description=(
        "Compare every engine's per-tensor CRC-32 of the received weights with the trainer's: true after every "
        "sync, false never, 'sample' a rotating 1/verify_full_every of the tensors every sync and all of them "
        "every verify_full_every-th policy version."))
    verify_full_every: int = Field(10, ge=1, strict=True, description=(
        "With verify 'sample': policy versions between full checks (K); sampled checks cover every tensor once "
        "per K consecutive versions."))
    timeout_s: float = Field(300, gt=0, le=MAX_TIMEOUT_S, description=(
        "Seconds one weight sync (and forming the sync group) may take; an engine that dies or stalls becomes an "
        "error naming it within this limit."))
    mode: Literal["broadcast", "ipc", "auto"] = Field("broadcast", description=(
        "How buckets reach the engines: 'broadcast' (gloo/NCCL group), 'ipc' (same host only: shared memory on CPU, "
        "CUDA IPC handles on GPU), 'auto' (ipc when every engine is on the trainer rank 0's Ray node)."))


class MetricsSpec(BaseModel):
    """metrics.jsonl in output_dir, console lines, and a Prometheus endpoint."""

    model_config = _CONFIG
    host: str = Field("127.0.0.1", description="Address the Prometheus HTTP server binds to.")
    port: int | None = Field(9300, ge=0, le=65535, strict=True, description=(
        "Prometheus port; 0 picks a free one, null disables."))
    log_every_steps: int = Field(1, ge=1, strict=True, description="Print a console line every this many steps.")


class CheckpointSpec(BaseModel):
    """Saving the policy as a Hugging Face folder."""

    model_config = _CONFIG
    every_steps: int = Field(0, ge=0, strict=True, description="Save every this many steps; 0 saves only at the end.")
    save_final: bool = Field(True, description="Save after the last step.")
    dir: str | None = Field(None, description="Checkpoint folder; null means <output_dir>/checkpoints.")
    keep_last: int | None = Field(None, ge=1, le=1_000_000, strict=True, description=(
        "Keep only this many newest complete checkpoints (older ones are deleted after a new one is complete); "
        "null keeps all."))


class RaySpec(BaseModel):
    """Which Ray cluster to run on."""

    model_config = _CONFIG
    address: str | None = Field(None, description="Existing cluster address ('auto', 'ray://h:p'); null starts one.")
    num_cpus: int | None = Field(None, ge=1, strict=True, description=(
        "CPUs of a locally started cluster; null uses all."))
    dashboard_host: str = Field("127.0.0.1", description="Address the Ray dashboard binds to (local cluster).")


class JobSpec(BaseModel):
    """A whole GRPO job: model, data, rollout, training, algorithm, weight sync, metrics, checkpoints, Ray."""

    model_config = _CONFIG
    name: str = Field("grpo", min_length=1, description="Job name (metrics label, Ray job name).")
    seed: int = Field(0, ge=0, le=MAX_SEED, strict=True, description=(
        "Root seed; per-step and per-sample seeds derive from it (replica and rank offsets are added, and numpy "
        "seeds must be < 2**32)."))
    output_dir: str = Field(min_length=1, description="Folder for metrics.jsonl, logs and checkpoints.")
    total_steps: int = Field(ge=1, le=10_000_000, strict=True, description=(
        "Number of training steps (policy versions) to run."))
    model: ModelSpec = Field(default_factory=ModelSpec, description=ModelSpec.__doc__)
    data: DataSpec = Field(description=DataSpec.__doc__)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description=RolloutSpec.__doc__)
    train: TrainSpec = Field(default_factory=TrainSpec, description=TrainSpec.__doc__)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec, description=AlgorithmSpec.__doc__)
    sync: SyncSpec = Field(default_factory=SyncSpec, description=SyncSpec.__doc__)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec, description=MetricsSpec.__doc__)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description=CheckpointSpec.__doc__)
    ray: RaySpec = Field(default_factory=RaySpec, description=RaySpec.__doc__)
    resume: Literal["never", "auto"] = Field("never", description=(
        "'auto' continues from the latest complete checkpoint in checkpoint.dir when there is one "
        "(same as `grpo-cluster run --resume`)."))
    restart_on_failure: int = Field(0, ge=0, le=1000, strict=True, description=(
        "When a worker fails, tear the pools down and resume from the latest checkpoint, up to this many times."))

    @model_validator(mode="after")
    def _cross_field_checks(self) -> JobSpec:
        rollout, train = self.rollout, self.train
        needed = self.data.max_prompt_tokens + rollout.max_response_tokens
        if rollout.max_model_len is not None and needed > rollout.max_model_len:
            raise _FieldConflict("rollout.max_model_len", (
                f"expected max_model_len >= data.max_prompt_tokens + rollout.max_response_tokens = "
                f"{self.data.max_prompt_tokens} + {rollout.max_response_tokens} = {needed}, "
                f"got {rollout.max_model_len}"))
        cpus = rollout.replicas * rollout.num_cpus_per_replica + train.world_size * train.num_cpus_per_worker
        if self.ray.address is None and self.ray.num_cpus is not None and cpus > self.ray.num_cpus:
            raise _FieldConflict("ray.num_cpus", (
                f"the job reserves {cpus:g} CPUs (rollout {rollout.replicas} x {rollout.num_cpus_per_replica:g} "
                f"+ train {train.world_size} x {train.num_cpus_per_worker:g}) but the local cluster has "
                f"{self.ray.num_cpus}; Ray would wait forever"))
        if train.reduce_dtype not in ("float32", self.model.dtype):
            raise _FieldConflict("train.reduce_dtype", (
                f"expected 'float32' or model.dtype ({self.model.dtype!r}), got {train.reduce_dtype!r}"))
        for conflict in algorithm_conflicts(self.algorithm, rollout):
            raise conflict
        return self


# --------------------------------------------------------------------------------------------------- loading

Loc = tuple[str, ...]


class _SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader, also reading exponent floats without a dot (``1e-3``, ``2E5``) as floats, as YAML 1.2
    and JSON do; YAML 1.1 (PyYAML) reads them as strings, which strict fields (``rollout.resources`` amounts) then
    refuse as "not a valid number"."""


_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


class _SpecDumper(yaml.SafeDumper):
    """PyYAML's safe dumper with :class:`_SpecLoader`'s float rule, so a string like "1e5" is written quoted and
    read back as a string."""


_SpecDumper.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _safe_load(text: str) -> Any:
    """``yaml.safe_load`` with :class:`_SpecLoader` (a SafeLoader: no arbitrary objects)."""
    return yaml.load(text, Loader=_SpecLoader)


def load_spec(path: str | Path, overrides: Sequence[str] = ()) -> JobSpec:
    """Read a YAML job spec, apply ``dotted.key=value`` overrides, validate; raises SpecError on any problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: spec file not found (cwd: {Path.cwd()})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read spec file: {exc}") from None
    return load_spec_text(text, source=str(path), base_dir=path.parent, overrides=overrides)


def load_spec_text(text: str, *, source: str = "<string>", base_dir: str | Path | None = None,
                   overrides: Sequence[str] = ()) -> JobSpec:
    """Like :func:`load_spec` for YAML text; ``source`` names it in errors, ``base_dir`` anchors data paths."""
    try:
        root = yaml.compose(text, Loader=_SpecLoader)
    except yaml.YAMLError as exc:
        raise SpecError(_yaml_error_message(exc, source)) from None
    lines: dict[Loc, int] = {}
    if root is not None:
        _collect_lines(root, (), lines, source)  # first: refuses aliases before anything is built from them
    try:
        data = _safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(_yaml_error_message(exc, source)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"{source}:1: expected a mapping of top-level keys "
                        f"({', '.join(JobSpec.model_fields)}), got {type(data).__name__}")
    if base_dir is not None:
        _resolve_relative_paths(data, Path(base_dir))
    for section in [k for k, v in data.items() if v is None and _model_at((str(k),)) is not None]:
        data[section] = {}  # a section whose keys are all commented out means "all defaults"
    set_by = _apply_overrides(data, overrides)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_format_errors(exc, source, lines, set_by)) from None


def locate_field_error(message: str, path: str | Path, overrides: Sequence[str] = ()) -> str:
    """``message`` prefixed with where its field's value came from, when it starts with a spec field (``model.path:
    model folder ... not found`` → ``job.yaml:11: model.path: ...`` or ``--set model.path: model.path: ...``), for
    the input checks made after the spec is valid (model, data, output folders). Other messages, or a spec file
    that can no longer be read, are returned unchanged."""
    field = message.split(": ", 1)[0] if ": " in message else ""
    loc = tuple(field.split("."))
    if not field or loc[0] not in JobSpec.model_fields or (len(loc) > 1 and (
            (cls := _model_at(loc[:-1])) is None or loc[-1] not in cls.model_fields)):
        return message
    lines: dict[Loc, int] = {}
    try:
        root = yaml.compose(Path(path).read_text(encoding="utf-8"), Loader=_SpecLoader)
        if root is not None:
            _collect_lines(root, (), lines, str(path))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, SpecError):
        return message
    set_by = {tuple(raw.partition("=")[0].strip().split(".")): raw.partition("=")[0].strip() for raw in overrides}
    return f"{_where(loc, str(path), lines, set_by)}: {message}"


def spec_to_yaml(spec: JobSpec) -> str:
    """Serialise a spec to YAML text that :func:`load_spec_text` reads back into an equal spec."""
    return yaml.dump(spec.model_dump(mode="json"), Dumper=_SpecDumper, sort_keys=False, allow_unicode=True)


def _yaml_error_message(exc: yaml.YAMLError, source: str) -> str:
    """``file:line: invalid YAML: [context (line N): ]problem`` from a PyYAML error."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"{source}:{mark.line + 1}" if mark is not None else source
    problem = getattr(exc, "problem", None) or str(exc)
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None:
        problem = f"{context} (line {context_mark.line + 1}): {problem}"
    return f"{where}: invalid YAML: {problem}"


def _collect_lines(node: yaml.Node, prefix: Loc, lines: dict[Loc, int], source: str,
                   seen: set[int] | None = None) -> None:
    """Map dotted paths to 1-based line numbers (a key's line, or a list item's); duplicate keys are errors.

    Raises:
        SpecError: a duplicate key, or a YAML alias (``*name``): a node met twice. Specs need no aliases, and
            refusing them stops recursive aliases and exponential "billion laughs" documents at once.
    """
    seen = set() if seen is None else seen
    if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
        if id(node) in seen:
            where = ".".join(prefix) or "the top level"
            raise SpecError(f"{source}:{node.start_mark.line + 1}: {where}: YAML aliases (*name) are not supported "
                            f"in job specs; write the value out")
        seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            loc = (*prefix, str(key_node.value))
            line = key_node.start_mark.line + 1
            if loc in lines:
                raise SpecError(f"{source}:{line}: {'.'.join(loc)}: duplicate key "
                                f"{key_node.value!r} (first at line {lines[loc]})")
            lines[loc] = line
            _collect_lines(value_node, loc, lines, source, seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            loc = (*prefix, str(index))
            lines[loc] = item.start_mark.line + 1
            _collect_lines(item, loc, lines, source, seen)


def _resolve_relative_paths(data: dict, base_dir: Path) -> None:
    """Rewrite data.*_path (existing files) and model.path (existing folders) found next to the spec file."""
    for section, key, exists in (("data", "train_path", Path.is_file), ("data", "test_path", Path.is_file),
                                 ("model", "path", Path.is_dir)):
        block = data.get(section)
        value = block.get(key) if isinstance(block, dict) else None
        if isinstance(value, str) and value and not os.path.isabs(value) and not value.startswith("builtin:"):
            candidate = base_dir / os.path.expanduser(value)
            if exists(candidate):
                block[key] = os.path.normpath(os.path.abspath(candidate))


def _model_at(loc: Sequence[str]) -> type[BaseModel] | None:
    """The spec model class found by walking field names from JobSpec, or None if loc leaves the models."""
    cls: type[BaseModel] = JobSpec
    for part in loc:
        field = cls.model_fields.get(part)
        ann = field.annotation if field is not None else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        cls = ann
    return cls


def _check_override_key(loc: Loc, raw: str) -> None:
    """Raise SpecError unless loc names a spec field (or an entry of a dict-valued field)."""
    for depth, part in enumerate(loc):
        parent = loc[:depth]
        cls = _model_at(parent)
        if cls is None:
            field = _model_at(parent[:-1]).model_fields[parent[-1]]
            if getattr(field.annotation, "__origin__", None) is dict and depth == len(loc) - 1:
                return
            raise SpecError(f"--set {raw}: {'.'.join(parent)} is a value, not a section; "
                            f"cannot set {'.'.join(loc)!r}")
        if part not in cls.model_fields:
            level = ".".join(parent) or "top level"
            raise SpecError(f"--set {raw}: unknown key {part!r} at {level}; allowed: {', '.join(cls.model_fields)}")


def _apply_overrides(data: dict, overrides: Sequence[str]) -> dict[Loc, str]:
    """Apply ``dotted.key=value`` strings in order; returns {loc: dotted key} of what they set."""
    set_by: dict[Loc, str] = {}
    for raw in overrides:
        key, sep, text = raw.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SpecError(f"--set {raw!r}: expected 'dotted.key=value', e.g. 'rollout.group_size=8'")
        loc = tuple(key.split("."))
        if any(not part for part in loc):
            raise SpecError(f"--set {raw!r}: empty segment in key {key!r}; expected 'section.field=value'")
        _check_override_key(loc, raw)
        try:
            value = _safe_load(text)
        except yaml.YAMLError:
            value = text
        block = data
        for part in loc[:-1]:
            if not isinstance(block.get(part), dict):
                block[part] = {}
            block = block[part]
        block[loc[-1]] = value
        set_by[loc] = key
    return set_by


def _format_errors(exc: ValidationError, source: str, lines: Mapping[Loc, int], set_by: Mapping[Loc, str]) -> str:
    """One ``<where>: <dotted.field>: <message> (got <value>)`` line per pydantic error."""
    out = []
    for err in exc.errors():
        loc: Loc = tuple(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        cause = (err.get("ctx") or {}).get("error")
        show_value = err["type"] not in ("missing", "extra_forbidden", "value_error")  # our messages name it
        if isinstance(cause, _FieldConflict):
            loc, msg, show_value = tuple(cause.field.split(".")), str(cause), False
        elif err["type"] == "extra_forbidden":
            cls = _model_at(loc[:-1])
            allowed = ", ".join(cls.model_fields) if cls is not None else "?"
            msg = f"unknown key {loc[-1]!r}; allowed: {allowed}"
        elif err["type"] == "missing":
            msg = f"required key {loc[-1]!r} is missing"
        where = _where(loc, source, lines, set_by)
        got = f" (got {_short_repr(err['input'])})" if show_value else ""
        out.append(f"{where}: {'.'.join(loc) or '<spec>'}: {msg}{got}")
    header = f"{source}: invalid job spec ({len(out)} problem{'s' if len(out) != 1 else ''}):"
    return "\n".join([header, *("  " + line for line in out)])


def _where(loc: Loc, source: str, lines: Mapping[Loc, int], set_by: Mapping[Loc, str]) -> str:
    """Where loc's value came from, most specific first: an override of loc or a parent (``--set key``); else
    overrides of keys inside loc (``--set algorithm.rewards.nope=1`` for an error at ``algorithm.rewards``); else
    loc's YAML line, or its nearest parent's."""
    for end in range(len(loc), 0, -1):
        if loc[:end] in set_by:
            return f"--set {set_by[loc[:end]]}"
    inside = [key for set_loc, key in set_by.items() if loc and set_loc[:len(loc)] == loc]
    if inside:
        return ", ".join(f"--set {key}" for key in inside)
    for end in range(len(loc), 0, -1):
        if loc[:end] in lines:
            return f"{source}:{lines[loc[:end]]}"
    return source


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
