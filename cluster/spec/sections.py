"""The job spec's sections other than ``algorithm`` (see :mod:`cluster.spec.algorithm`), ``data`` (see
:mod:`cluster.spec.data`) and ``metrics`` (see :mod:`cluster.spec.metrics`), both re-exported here: model, rollout,
train, sync, checkpoint and Ray; ``rollout`` lives in :mod:`cluster.spec.rollout`, re-exported here.

Each section is a frozen pydantic model that rejects unknown keys; its own field checks are here, checks across
sections are in :class:`cluster.spec.job.JobSpec`. Imports only pydantic and :mod:`cluster.spec` modules and,
through :mod:`cluster.spec.variants`, ``train_workers.registry`` (``train.strategy`` names).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, StrictFloat, field_validator, model_validator

from cluster.spec.algorithm import FieldConflict
from cluster.spec.data import DEFAULT_SYSTEM_PROMPT, DataSpec, HubDatasetSpec, ReasoningGymSpec
from cluster.spec.fields import (
    MAX_BUCKET_BYTES, MAX_COUNT, MAX_DEVICES_PER_ACTOR, NonEmptyStr, unused_when_off,
    MAX_COEFFICIENT, MAX_TIMEOUT_S, SPEC_CONFIG, ByteSize, CpuCores, CustomResources, check_cpu_cores,
    check_custom_resources,
)
from cluster.spec.implied import Rule, with_implied
from cluster.spec.lora import LoraSpec
from cluster.spec.metrics import MetricsSpec
from cluster.spec.rollout import RolloutSpec
from cluster.spec.variants import TRAIN_BACKEND, model_parallel_strategies

__all__ = [
    "DEFAULT_SYSTEM_PROMPT", "ModelSpec", "DataSpec", "HubDatasetSpec", "ReasoningGymSpec", "RolloutSpec",
    "TrainSpec", "SyncSpec", "MetricsSpec", "CheckpointSpec", "PreemptSpec", "RaySpec",
]


class ModelSpec(BaseModel):
    """Which policy model to train and how to hold its weights."""

    model_config = SPEC_CONFIG
    path: str = Field("builtin:SmolLM2-135M-Instruct", min_length=1, description=(
        "Model to start from: a builtin alias ('builtin:<name>'), a local Hugging Face folder, or a hub id."))
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description=(
            "Rollout engine dtype and the policy's compute dtype. float32: pure float32 training. bfloat16/float16: "
            "mixed precision (float32 parameters and AdamW state, forward/backward in this dtype, weights sent to "
            "the engines in this dtype); the frozen reference policy is held in this dtype."))
    cache_dir: NonEmptyStr | None = Field(None, description=(
        "Folder for converted/downloaded model files; null means ~/.cache/grpo-cluster."))
    revision: str | None = Field(None, min_length=1, description=(
        "Git revision (branch, tag or commit) of a hub model (model.path 'org/name'), passed to every load of the "
        "model, tokenizer and config (trainer, engines, in-process fleet, checks); null: the default branch. "
        "Ignored for local folders."))
    trust_remote_code: bool = Field(False, strict=True, description=(
        "Run the model repository's own Python code when loading it (transformers' and vLLM's trust_remote_code), "
        "needed by architectures transformers does not ship. Only for repositories you trust."))


#: The learning rate full fine-tuning starts from (``train.lr``'s default).
FULL_FINETUNE_LR = 1e-6
#: LoRA's learning rate, 10x full fine-tuning's: LoRA's optimal one is about 10x (J. Schulman and Thinking Machines
#: Lab 2025, "LoRA Without Regret", for SFT and RL alike); docs/results.md's LoRA run on the GSM8K demo used 10x.
LORA_LR = 1e-5


def train_implied(values: Mapping[str, Any]) -> dict[str, tuple[Any, str]]:
    """The ``train`` section's :data:`cluster.spec.implied.Rule`: a model-parallel layout (``tensor_parallel_size``
    or ``pipeline_parallel_size`` > 1, or ``sequence_parallel: true``) implies the model-parallel strategy when
    exactly one is registered (megatron); ``lora`` implies LoRA's learning rate :data:`LORA_LR` (10x full
    fine-tuning's)."""
    out: dict[str, tuple[Any, str]] = {}
    layout = (values.get("tensor_parallel_size", 1), values.get("pipeline_parallel_size", 1),
              values.get("sequence_parallel", False))
    if layout != (1, 1, False) and len(parallel := model_parallel_strategies()) == 1:
        out["strategy"] = (parallel[0], "train.tensor_parallel_size / pipeline_parallel_size / sequence_parallel: "
                                        "a model-parallel layout, which only that backend runs")
    if values.get("lora") is not None:
        out["lr"] = (LORA_LR, f"train.lora: LoRA's learning rate is about {LORA_LR / FULL_FINETUNE_LR:g}x full "
                              f"fine-tuning's (Schulman et al. 2025, 'LoRA Without Regret')")
    return out


class TrainSpec(BaseModel):
    """Train workers (FSDP2 ranks), the AdamW optimizer and, optionally, LoRA adapters (``lora``)."""

    model_config = SPEC_CONFIG
    IMPLIED: ClassVar[Rule] = staticmethod(train_implied)
    world_size: int = Field(1, ge=1, le=65536, strict=True, description=(
        "Number of train ranks (Ray actors in one process group)."))
    num_cpus_per_worker: float = Field(1.0, strict=True, ge=0, le=MAX_DEVICES_PER_ACTOR, description=(
        "CPUs Ray reserves per train rank."))
    num_gpus_per_worker: float = Field(0.0, strict=True, ge=0, le=MAX_DEVICES_PER_ACTOR, description=(
        "GPUs Ray reserves per train rank."))
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description=(
        "torch.distributed backend; 'auto' picks nccl when GPUs are reserved, else gloo."))
    num_threads: int | None = Field(None, ge=1, le=4096, strict=True, description=(
        "torch intra-op threads per rank; null keeps torch's (with cpu_affinity: one per core of cpu_affinity)."))
    cpu_affinity: CpuCores | None = Field(None, description=(
        "CPU core ids (os.sched_getaffinity's numbering) every train rank's process is bound to "
        "(os.sched_setaffinity); with num_threads null each rank then runs len(cpu_affinity) torch threads. null "
        "(default): no binding. Every rank on a node is bound to the same cores, so ranks sharing a node share them "
        "(set num_threads to split them); a core the rank's process may not use stops it at start, naming this "
        "field. Give train ranks and engines disjoint cores (rollout.cpu_affinity) so that rollout.mode "
        "one_step_off/async really overlap training and generation on one machine."))
    lr: float = Field(FULL_FINETUNE_LR, strict=True, gt=0, le=MAX_COEFFICIENT, description=(
        "AdamW learning rate; at most 1e6. Left out, 1e-6 for full fine-tuning and 1e-5 with lora (LoRA's optimum "
        "is about 10x full fine-tuning's: Schulman et al. 2025, 'LoRA Without Regret')."))
    weight_decay: float = Field(0.0, strict=True, ge=0, le=MAX_COEFFICIENT, description=(
        "AdamW decoupled weight decay: each step multiplies the weights by 1 - lr·weight_decay, which must stay in "
        "(0, 1] (lr·weight_decay < 1)."))
    betas: tuple[StrictFloat, StrictFloat] = Field((0.9, 0.999), description="AdamW (beta1, beta2), each in [0, 1).")
    max_grad_norm: float = Field(1.0, strict=True, gt=0, le=MAX_COEFFICIENT, description=(
        "Global gradient-norm clip; at most 1e6."))
    reduce_dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description=(
        "dtype in which FSDP2 reduces (averages) gradients over the train ranks. With model.dtype bfloat16/float16 "
        "the policy trains in mixed precision: float32 parameters and AdamW state, forward/backward in model.dtype, "
        "gradients reduced in this dtype; it must be float32 or model.dtype."))
    max_tokens_per_microbatch: int = Field(4096, ge=16, le=16_777_216, strict=True, description=(
        "Token budget of one forward/backward pass."))
    timeout_s: float = Field(900, strict=True, gt=0, le=MAX_TIMEOUT_S, description=(
        "Seconds to wait for one train step before failing."))
    oversize_sequences: Literal["own", "error"] = Field("own", description=(
        "A sequence longer than max_tokens_per_microbatch: 'own' trains it in a micro-batch of its own, 'error' "
        "stops the step naming it."))
    strategy: Annotated[str, TRAIN_BACKEND.validator] = Field("fsdp", strict=True, description=TRAIN_BACKEND.describe(
        "Training strategy, the train backend started on every rank",
        "fsdp (FSDP2, data parallelism), megatron (Megatron-core tensor and pipeline parallelism, float32)"))
    tensor_parallel_size: int = Field(1, ge=1, le=1024, strict=True, description=(
        "Megatron tensor-parallel ranks per model replica (strategy megatron, which > 1 implies when strategy is left "
        "out); must divide the model's attention "
        "heads and kv heads. Data-parallel size = world_size / (tensor_parallel_size × pipeline_parallel_size)."))
    pipeline_parallel_size: int = Field(1, ge=1, le=1024, strict=True, description=(
        "Megatron pipeline stages per model replica (strategy megatron, which > 1 implies when strategy is left out; "
        "megatron-core's 1F1B schedule); must divide the model's layers."))
    sequence_parallel: bool = Field(False, strict=True, description=(
        "Megatron sequence parallelism (strategy megatron, which true implies when strategy is left out): "
        "activations outside attention/MLP split by sequence over the tensor-parallel ranks; needs "
        "tensor_parallel_size > 1."))
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field("PACK", description=(
        "Ray placement-group strategy for the train ranks' bundles."))
    resources: CustomResources = Field(default_factory=dict, description=(
        "Custom Ray resources each train rank reserves besides CPUs/GPUs, e.g. {train_node: 1} to place the ranks "
        "only on nodes that advertise that resource; {} reserves none."))
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description=(
        "Learning rate after the warmup, over the steps left until total_steps: 'constant' stays at lr, 'linear' "
        "falls in a straight line and 'cosine' along a half cosine, both from lr towards lr x min_lr_ratio "
        "(cluster.loop.lr_schedule). The rate is a function of the step, so a resumed run continues it exactly."))
    warmup_steps: int = Field(0, ge=0, le=10_000_000, strict=True, description=(
        "Steps over which the learning rate rises linearly to lr (step k of the warmup trains at lr x k / "
        "warmup_steps); 0: no warmup. At most total_steps. Exclusive with warmup_ratio."))
    warmup_ratio: float | None = Field(None, strict=True, ge=0, lt=1, description=(
        "The warmup as a fraction of total_steps (rounded to whole steps), instead of warmup_steps; null: use "
        "warmup_steps."))
    min_lr_ratio: float = Field(0.0, strict=True, ge=0, le=1, description=(
        "Where 'linear' and 'cosine' decay end, as a fraction of lr (reached after the last step)."))
    activation_checkpointing: bool = Field(False, strict=True, description=(
        "Strategy fsdp: recompute each decoder layer's activations in the backward pass instead of keeping them "
        "(transformers' non-reentrant gradient checkpointing of every layer of the policy). Less memory for more "
        "compute. On CPU ranks it also turns on the lean memory paths: the policy resharded after every forward "
        "and backward (its full parameters held one layer at a time), gradients reduce-scattered after every "
        "micro-batch (a gradient shard instead of a full-size gradient), the reference policy sharded instead of "
        "replicated, freed heap returned to the OS before each micro-batch; results are unchanged. Measured on CPU "
        "in docs/results.md."))
    cpu_offload: bool = Field(False, strict=True, description=(
        "Strategy fsdp: keep the sharded parameters, their gradients and the AdamW state in CPU memory and run the "
        "optimizer step on the CPU (FSDP2's CPUOffloadPolicy); each layer's parameters are copied to the GPU for "
        "its forward and backward. For models whose weights and optimizer state do not fit the GPUs. Nothing moves "
        "on CPU ranks."))
    max_skipped_updates: int = Field(3, ge=1, le=1_000_000, strict=True, description=(
        "Updates with a NaN/Inf loss or gradient are skipped (weights unchanged, nothing broadcast); this many in a "
        "row stop the job naming the step and the metric."))
    lora: LoraSpec | None = Field(None, description=(
        f"{LoraSpec.__doc__} null (the default): full fine-tuning of every weight."))

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        return check_custom_resources(resources, "train", "worker")

    @field_validator("cpu_affinity")
    @classmethod
    def _cpu_cores(cls, cores: list[int] | None) -> list[int] | None:
        return check_cpu_cores(cores)

    @model_validator(mode="wrap")
    @classmethod
    def _implied_settings(cls, data: Any, handler) -> TrainSpec:
        """What the layout and ``lora`` imply when the spec leaves the setting out (:func:`train_implied`,
        :mod:`cluster.spec.implied`); a strategy the spec gives is kept and checked by
        :meth:`_model_parallel_layout`."""
        return with_implied(data, handler, train_implied)

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"expected each beta in [0, 1), got {list(betas)}")
        return betas

    @model_validator(mode="after")
    def _decay_factor(self) -> TrainSpec:
        if self.lr * self.weight_decay >= 1.0:
            raise FieldConflict("train.weight_decay", (
                f"AdamW multiplies the weights by 1 - lr·weight_decay each step; expected lr·weight_decay < 1, got "
                f"{self.lr:g}·{self.weight_decay:g} = {self.lr * self.weight_decay:g} (weights that flip sign and "
                f"grow every step overflow float32)"))
        return self

    @model_validator(mode="after")
    def _schedule_and_memory(self) -> TrainSpec:
        if self.warmup_ratio is not None and self.warmup_steps:
            raise FieldConflict("train.warmup_ratio", (
                f"give the warmup once: expected warmup_ratio null with warmup_steps={self.warmup_steps}, or "
                f"warmup_steps 0, got warmup_ratio={self.warmup_ratio}"))
        for name, what in (("activation_checkpointing", "activation checkpointing"), ("cpu_offload", "CPU offload")):
            if getattr(self, name) and self.strategy != "fsdp":
                raise FieldConflict(f"train.{name}", (
                    f"{what} is built for the FSDP2 backend only: expected strategy 'fsdp', got {self.strategy!r}"))
        return self

    @model_validator(mode="after")
    def _backend_matches_devices(self) -> TrainSpec:
        if self.backend == "nccl" and self.num_gpus_per_worker == 0:
            raise FieldConflict("train.backend", (
                "backend 'nccl' needs GPUs, but train.num_gpus_per_worker is 0; "
                "use 'gloo' or 'auto' on CPU, or reserve GPUs"))
        return self

    @model_validator(mode="after")
    def _model_parallel_layout(self) -> TrainSpec:
        """TP/PP/SP need a model-parallel strategy (registered with ``model_parallel=True``: megatron), SP needs
        TP > 1, and TP × PP divides world_size (the data-parallel size is the quotient). Checks against the model
        (heads, layers) run when its config.json is read."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        layout = (("tensor_parallel_size", tp, 1), ("pipeline_parallel_size", pp, 1),
                  ("sequence_parallel", self.sequence_parallel, False))
        changed = [(name, value, default) for name, value, default in layout if value != default]
        parallel = model_parallel_strategies() if changed else []
        if changed and self.strategy not in parallel:
            name, value, default = changed[0]
            need = f"strategy {' or '.join(map(repr, parallel))}" if parallel else "a model-parallel strategy"
            raise FieldConflict(f"train.{name}", (
                f"{name}={value} needs {need}; strategy {self.strategy!r} shards only by data parallelism "
                f"(expected {name}={default})"))
        if self.sequence_parallel and tp == 1:
            raise FieldConflict("train.sequence_parallel", (
                "sequence_parallel splits activations over the tensor-parallel ranks: it needs "
                "tensor_parallel_size > 1, got 1"))
        if self.world_size % (tp * pp):
            # the pipeline size is named when it alone breaks the layout (tp divides world_size, pp does not)
            culprit = "pipeline_parallel_size" if self.world_size % tp == 0 and self.world_size % pp else (
                "tensor_parallel_size")
            raise FieldConflict(f"train.{culprit}", (
                f"tensor_parallel_size × pipeline_parallel_size = {tp} × {pp} = {tp * pp} must divide "
                f"train.world_size = {self.world_size}"))
        return self


class SyncSpec(BaseModel):
    """Streaming trainer weights into the rollout engines after each step."""

    model_config = SPEC_CONFIG
    bucket_bytes: ByteSize = Field(64 * 2**20, ge=1024, le=MAX_BUCKET_BYTES, strict=True, description=(
        "Bytes per broadcast bucket; ints or strings like '64MiB', '512MB', '1GiB'."))
    verify: bool | Literal["sample"] = Field(True, description=(
        "Compare every engine's per-tensor CRC-32 of the received weights with the trainer's: true after every "
        "sync, false never, 'sample' a rotating 1/verify_full_every of the tensors every sync and all of them "
        "every verify_full_every-th policy version."))
    verify_full_every: int = Field(10, ge=1, le=MAX_COUNT, strict=True, description=(
        "With verify 'sample': policy versions between full checks (K); sampled checks cover every tensor once "
        "per K consecutive versions."))
    timeout_s: float = Field(300, strict=True, gt=0, le=MAX_TIMEOUT_S, description=(
        "Seconds one weight sync (and forming the sync group) may take; an engine that dies or stalls becomes an "
        "error naming it within this limit."))
    mode: Literal["broadcast", "ipc", "auto"] = Field("broadcast", description=(
        "How buckets reach the engines: 'broadcast' (gloo/NCCL group), 'ipc' (same host only: shared memory on CPU, "
        "CUDA IPC handles on GPU), 'auto' (ipc when every engine is on the trainer rank 0's Ray node)."))


    @model_validator(mode="after")
    def _full_every_needs_sampling(self) -> SyncSpec:
        if self.verify != "sample":
            unused_when_off(self, ("verify_full_every",), "sync", "sync.verify: sample")
        return self


class PreemptSpec(BaseModel):
    """What the job does on SIGTERM (what Ray's job stop and a Kubernetes pod eviction send): it stops generating,
    finishes or abandons the step in flight, writes a checkpoint within ``deadline_s`` and exits with code 75
    (docs/operations.md, "Preemption")."""

    model_config = SPEC_CONFIG
    enabled: bool = Field(True, strict=True, description=(
        "Catch SIGTERM and checkpoint before exiting (exit code 75); false: SIGTERM ends the driver at once, as the "
        "operating system's default, and a resume continues from the latest periodic checkpoint."))
    deadline_s: float = Field(120.0, strict=True, gt=0, le=MAX_TIMEOUT_S, description=(
        "Seconds from the first SIGTERM within which the step in flight is finished or abandoned and the checkpoint "
        "is complete; past them the driver exits without it (code 75; the previous complete checkpoint stays the "
        "latest). The pods' terminationGracePeriodSeconds and Ray's RAY_JOB_STOP_WAIT_TIME_S must exceed it "
        "(grpo-cluster submit sets the latter)."))

    @model_validator(mode="after")
    def _deadline_needs_enabled(self) -> PreemptSpec:
        if not self.enabled:
            unused_when_off(self, ("deadline_s",), "checkpoint.on_preempt", "checkpoint.on_preempt.enabled: true")
        return self


class CheckpointSpec(BaseModel):
    """Saving the policy as a Hugging Face folder."""

    model_config = SPEC_CONFIG
    every_steps: int = Field(0, ge=0, le=MAX_COUNT, strict=True, description=(
        "Save every this many steps; 0 saves only at the end."))
    save_final: bool = Field(True, strict=True, description="Save after the last step.")
    dir: NonEmptyStr | None = Field(None, description="Checkpoint folder; null means <output_dir>/checkpoints.")
    keep_last: int | None = Field(None, ge=1, le=1_000_000, strict=True, description=(
        "Keep only this many newest complete checkpoints (older ones are deleted after a new one is complete); "
        "null keeps all."))
    keep_best: bool = Field(False, strict=True, description=(
        "Keep the checkpoint of the step with the best eval/accuracy (needs an eval section): when an evaluation "
        "at step s >= 1 beats every earlier one (ties keep the earlier step), step s's checkpoint is written (if "
        "checkpoint.every_steps did not write one there) and keep_last never deletes it while it is the best; it "
        "is kept besides the keep_last newest. A best at step 0 is the starting model itself (model.path)."))
    on_preempt: PreemptSpec = Field(default_factory=PreemptSpec, description=PreemptSpec.__doc__)


class RaySpec(BaseModel):
    """Which Ray cluster to run on."""

    model_config = SPEC_CONFIG
    address: NonEmptyStr | None = Field(None, description=(
        "Existing cluster address ('auto', 'ray://h:p'); null starts one."))
    num_cpus: int | None = Field(None, ge=1, le=int(MAX_DEVICES_PER_ACTOR) * 1024, strict=True, description=(
        "CPUs of a locally started cluster; null uses all."))
    dashboard_host: NonEmptyStr = Field("127.0.0.1", description="Address the Ray dashboard binds to (local cluster).")

