"""The ``rollout`` section of a job spec: the engines (replicas, resources, vLLM settings), sampling (G, temperature,
filters, length cap), the rollout mode and its staleness, partial rollouts and multi-turn episodes
(``multi_turn``, :mod:`cluster.spec.multi_turn`). Re-exported by :mod:`cluster.spec.sections`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from cluster.spec.algorithm import MAX_GROUP_SIZE, FieldConflict
from cluster.spec.fields import (
    MAX_DEVICES_PER_ACTOR, MAX_MEMORY_GIB,
    MAX_SEQUENCE_TOKENS, MAX_TIMEOUT_S, MAX_TOP_K, MIN_TEMPERATURE, SPEC_CONFIG, CpuCores, CustomResources,
    check_cpu_cores, check_custom_resources,
)
from cluster.spec.multi_turn import MultiTurnSpec

__all__ = ["RolloutSpec"]


class RolloutSpec(BaseModel):
    """Rollout engine replicas (vLLM) and sampling: B prompts × G completions per step."""

    model_config = SPEC_CONFIG
    replicas: int = Field(1, ge=1, le=4096, strict=True, description="Number of rollout engine replicas (Ray actors).")
    num_cpus_per_replica: float = Field(1.0, strict=True, ge=0, le=MAX_DEVICES_PER_ACTOR, description=(
        "CPUs Ray reserves per rollout replica."))
    num_gpus_per_replica: float = Field(0.0, strict=True, ge=0, le=MAX_DEVICES_PER_ACTOR, description=(
        "GPUs Ray reserves per rollout replica."))
    tensor_parallel_size: int = Field(1, ge=1, le=1024, strict=True, description=(
        "Tensor-parallel ranks inside one engine replica."))
    prompts_per_step: int = Field(4, ge=1, le=65536, strict=True, description="B: prompts sampled per training step.")
    group_size: int = Field(4, ge=2, le=MAX_GROUP_SIZE, strict=True, description=(
        "G: completions per prompt (a group); advantages compare them."))
    temperature: float = Field(1.0, strict=True, ge=MIN_TEMPERATURE, le=10, description=(
        "Sampling temperature, at least 0.01: vLLM raises a lower one to 0.01 (SamplingParams), so the engine would "
        "sample at another temperature than the trainer's logprobs assume."))
    top_p: float = Field(1.0, strict=True, gt=0, le=1, description=(
        "Nucleus sampling probability mass; 1 is off. The trainer's logprobs are renormalised over the same kept set "
        "(grpo.logprobs.filter_logits_)."))
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K, strict=True, description=(
        "Sample from the k most likely tokens (ties with the k-th kept, as in vLLM); 0 or -1 is off (vLLM's "
        "semantics), as is k >= vocabulary size."))
    min_p: float = Field(0.0, strict=True, ge=0, lt=1, description=(
        "Drop tokens whose probability is below min_p times the most likely token's; 0 is off. vLLM applies it "
        "after the temperature, before top-k and top-p."))
    max_response_tokens: int = Field(256, ge=1, le=MAX_SEQUENCE_TOKENS, strict=True, description=(
        "Completion length cap in tokens."))
    kv_cache_gib: float = Field(2.0, strict=True, gt=0, le=MAX_MEMORY_GIB, description=(
        "CPU engines: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."))
    gpu_memory_utilization: float = Field(0.5, strict=True, gt=0, lt=1, description=(
        "GPU engines: fraction of GPU memory the engine may use (weights + KV cache)."))
    enforce_eager: bool = Field(True, description="Disable CUDA graphs / compilation in the engine.")
    max_model_len: int | None = Field(None, ge=1, le=2 * MAX_SEQUENCE_TOKENS, strict=True, description=(
        "Engine context length in tokens; null lets the engine use the model's own."))
    timeout_s: float = Field(900, strict=True, gt=0, le=MAX_TIMEOUT_S, description=(
        "Seconds to wait for one step's rollouts before failing."))
    max_staleness: int = Field(0, ge=0, le=1_000_000, strict=True, description=(
        "Largest accepted (trainer policy version - sample policy version); 0 is on-policy. Older samples are "
        "refused and sampled again. mode one_step_off trains on samples one version old: it needs >= 1; mode async "
        "lets the producer run up to this many versions ahead: it needs >= 1. Left out, it is 0 in mode sync and 1 "
        "in modes one_step_off and async."))
    mode: Literal["sync", "one_step_off", "async"] = Field("sync", description=(
        "When each step's batch is generated (cluster.loop.overlap). 'sync': generate, then train, then sync the "
        "weights; every sample is on-policy. 'one_step_off': the batch of step k+1 is generated on the weights step k "
        "starts from while step k trains, so steps take about max(generate, train) instead of their sum and samples "
        "are one policy version old (staleness 1; the first step's are on-policy). 'async': while each step trains, "
        "a producer generates batches back to back into a queue holding at most max_staleness of them, so every "
        "trained batch is at most max_staleness versions old (older ones are dropped, counted in "
        "rollout/stale_dropped, and their prompts drawn again). Weights are synced between generate calls, so a step "
        "lasts at least until the slowest generate call started during it ends, unless partial_rollout is on."))
    partial_rollout: bool = Field(False, strict=True, description=(
        "Partial rollouts (mode async only, which true implies when mode is left out; AReaL's interruptible rollout, "
        "PipelineRL's in-flight weight updates): "
        "after each train step the producer's generate call is interrupted instead of awaited; unfinished "
        "completions are aborted in vLLM, the new weights are synced, and the next producer call continues them "
        "from their tokens on the new weights (their KV cache is recomputed: one prefill of prompt + tokens so far). "
        "Every response token records the policy version that sampled it (a trajectory may span versions; a group's "
        "staleness is measured from its oldest token). Counted in rollout/partial_interrupted, "
        "rollout/partial_resumed and rollout/partial_older_token_fraction."))
    max_engine_restarts: int = Field(3, ge=0, le=1_000_000, strict=True, description=(
        "Engines that die are replaced and synced before they serve; more than this many replacements in one job "
        "stop it with the cause."))
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field("PACK", description=(
        "Ray placement-group strategy across engine replicas (each multi-GPU engine's own bundles are always "
        "STRICT_PACK, i.e. on one node)."))
    resources: CustomResources = Field(default_factory=dict, description=(
        "Custom Ray resources each engine replica reserves besides CPUs/GPUs, e.g. {rollout_node: 1} to place the "
        "engines only on nodes started with `ray start --resources '{\"rollout_node\": 8}'`; {} reserves none."))
    cpu_affinity: CpuCores | None = Field(None, description=(
        "CPU core ids (os.sched_getaffinity's numbering) each engine replica runs on: the engine actor binds its "
        "process (os.sched_setaffinity, inherited by vLLM's engine-core and worker processes) and, on CPU engines, "
        "vLLM's OpenMP threads, one per core (VLLM_CPU_OMP_THREADS_BIND, the cores split into tensor_parallel_size "
        "equal contiguous parts, one per TP rank). null (default): no binding; CPU engines bind their threads to "
        "cores 0..cpu_count-1. Every replica on a node uses the same cores; a core the engine's process may not use "
        "stops it at start, naming this field. Give engines and train ranks disjoint cores (train.cpu_affinity) so "
        "that rollout.mode one_step_off/async really overlap generation and training on one machine."))

    multi_turn: MultiTurnSpec | None = Field(None, description=(
        f"{MultiTurnSpec.__doc__} null (the default): one completion per prompt, no environment."))

    @model_validator(mode="before")
    @classmethod
    def _implied_settings(cls, data):
        """What a chosen mode implies when the spec leaves the setting out: ``partial_rollout: true`` implies
        ``mode: async``; ``mode`` one_step_off or async implies ``max_staleness: 1`` (the least either can run with).
        A value the spec gives is kept, and checked by :meth:`_mode_needs_staleness`."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("partial_rollout") is True and "mode" not in data:
            data["mode"] = "async"
        if data.get("mode") in ("one_step_off", "async") and "max_staleness" not in data:
            data["max_staleness"] = 1
        return data

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        return check_custom_resources(resources, "rollout", "replica")

    @field_validator("cpu_affinity")
    @classmethod
    def _cpu_cores(cls, cores: list[int] | None) -> list[int] | None:
        return check_cpu_cores(cores)

    @model_validator(mode="after")
    def _cores_per_tp_rank(self) -> RolloutSpec:
        cores = self.cpu_affinity
        if cores is not None and self.num_gpus_per_replica == 0 and len(cores) % self.tensor_parallel_size:
            raise FieldConflict("rollout.cpu_affinity", (
                f"a CPU engine binds each of its tensor_parallel_size={self.tensor_parallel_size} ranks' threads to "
                f"an equal share of the cores: expected a multiple of {self.tensor_parallel_size} core ids, got "
                f"{len(cores)} ({cores})"))
        return self

    @model_validator(mode="after")
    def _mode_needs_staleness(self) -> RolloutSpec:
        if self.mode == "one_step_off" and self.max_staleness < 1:
            raise FieldConflict("rollout.max_staleness", (
                f"rollout.mode 'one_step_off' trains each batch one policy version after the one that sampled it "
                f"(staleness 1): expected max_staleness >= 1, got {self.max_staleness}"))
        if self.mode == "async" and self.max_staleness < 1:
            raise FieldConflict("rollout.max_staleness", (
                f"rollout.mode 'async' generates batches while the policy trains, so they are trained at least one "
                f"version after the one that sampled them: expected max_staleness >= 1, got {self.max_staleness}"))
        if self.partial_rollout and self.mode != "async":
            raise FieldConflict("rollout.partial_rollout", (
                f"partial rollouts interrupt the producer's in-flight generate call at each weight update, which only "
                f"rollout.mode 'async' has: expected mode 'async', got {self.mode!r}"))
        return self
