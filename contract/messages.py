"""Typed messages that cross a process boundary (a Ray actor's, or a runtime's), in one module every side imports.

The control plane (``cluster/``) and its workers (``rollout_workers/``, ``train_workers/``) speak only these types:
a request goes out, a typed result comes back, and a metrics dict carries nothing but metrics (numbers the driver
logs). Control data — a policy version, why an update was skipped, the KL the controller steers by, where a worker
runs, what a sync checked — has its own field. Part of the ground-floor ``contract`` package, which imports no other
project package (``tests/unit/test_import_layering.py``).

Plain dataclasses (pickled by Ray as they are): no Ray, no torch.distributed here; ``GroupResult`` holds CPU tensors.

Notation: G completions per prompt (a group), R_i tokens in completion i.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: ``GroupResult.finish_reasons`` entry of a completion aborted by a weight update (``rollout.partial_rollout``).
INTERRUPTED = "interrupted"


# ---- rollout: driver → engine → driver -------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingOverride:
    """Sampling settings a request uses instead of the spec's ``rollout`` ones (held-out evaluation: greedy or its
    own temperature, its own length cap; top_p 1, top_k and min_p off).

    Attributes:
        temperature: 0 is greedy decoding. max_tokens: completion length cap in tokens.
    """

    temperature: float
    max_tokens: int


@dataclass(frozen=True)
class GroupRequest:
    """One prompt to sample a group for.

    Attributes:
        group_id: unique within a step (sampling rounds continue the count).
        prompt_ids: the chat-templated prompt (``cluster.data.chat_prompt_ids``: the template's own BOS, nothing
            added); vLLM gets it as a token prompt and does not tokenize again, so the engine samples from exactly
            the ids training scores.
        group_size: G for this prompt; None uses the ``group_size`` argument of ``RolloutEngine.generate``
            (adaptive group size sets it).
        seed: seeds this request's sampler alone, so a group's completions depend only on the weights, the prompt
            and the seed — not on the engine or the rest of the batch. The driver derives it from (spec seed, step,
            group id) (``cluster.loop.requests.request_seed``), which makes re-sampled groups and resumed runs
            reproducible.
        sampling: None samples with the spec's ``rollout`` settings (training); a :class:`SamplingOverride` replaces
            them for this request (held-out evaluation).
        resume_from: (``rollout.partial_rollout``) the group as an earlier, interrupted generate call left it: its
            completions with finish reason ``"interrupted"`` are continued from their tokens on the engine's current
            weights (``rollout_workers.partial``), the others are returned as they are. None: sample from scratch.
        max_tokens: a lower length cap for this request's completions, tokens (multi-turn episodes: what is left of
            the turn's and the episode's budgets, ``cluster.loop.episodes``); the sampling settings are otherwise
            unchanged. None: the sampling's own cap (``rollout.max_response_tokens`` or the override's).
    """

    group_id: int
    prompt_ids: list[int]
    group_size: int | None = None
    seed: int | None = None
    sampling: SamplingOverride | None = None
    resume_from: GroupResult | None = None
    max_tokens: int | None = None

    def length_cap(self, sampling_cap: int) -> int:
        """The completion length cap in tokens: ``sampling_cap`` (the request's sampling settings'), lowered to
        :attr:`max_tokens` when that is set."""
        return sampling_cap if self.max_tokens is None else min(sampling_cap, self.max_tokens)


@dataclass(frozen=True)
class EpisodeSummary:
    """How one multi-turn episode went (``rollout.multi_turn``; ``cluster.loop.episodes``), for the ``episode/*``
    metrics and the scoring of its row.

    Attributes:
        turns: policy turns sampled. tool_calls: tool calls the environment ran. tool_errors: those that failed
            because of the call (bad JSON, an unknown tool, a program that raised): observations, not infra
            failures; None: not observed (a function agent runs its own tools: the loop sees the calls the endpoint
            parsed, not their results).
        observation_tokens: tokens the environment's observations added (masked out of the loss).
        ended: ``"done"`` (the environment ended it; an agent returned), ``"max_turns"``, ``"token_budget"`` (the
            next turn or observation would not fit ``max_episode_tokens``; an agent's call was refused for its
            budget: a policy failure) or ``"infra_failed"`` (the environment or agent raised or timed out, its worker
            died: the row gets no reward, like a None reward).
        turn_reward: the sum of the rewards the environment gave with its observations, 0.0 when it gave none; an
            agent's (``rollout.agent``) returned reward, NaN when it returned None (no reward: excluded, counted).
        restarts: times the episode was sampled again from its start after an engine failure.
        environment_s: wall seconds its environment steps took (they run beside other episodes').
        detail: why it infra-failed (``""`` otherwise).
        calls: (agents) the chat-completions calls its endpoint served (None: not an agent's episode). sequences:
            (agents) the training sequences it became: 1, plus one for each call whose messages rewrote the history
            instead of extending it.
        components: (agents) the named reward components the agent returned (a dict), each logged as
            ``reward/<name>``; {} otherwise.
    """

    turns: int
    tool_calls: int = 0
    tool_errors: int | None = 0
    observation_tokens: int = 0
    ended: str = "done"
    turn_reward: float = 0.0
    restarts: int = 0
    environment_s: float = 0.0
    detail: str = ""
    calls: int | None = None
    sequences: int = 1
    components: dict[str, float] = field(default_factory=dict)

    @property
    def infra_failed(self) -> bool:
        """The environment failed (not the policy): the episode is left out of the loss and counted."""
        return self.ended == "infra_failed"

    @property
    def rewritten(self) -> bool:
        """(agents) A call rewrote the history: the episode trains as more than one sequence."""
        return self.sequences > 1


@dataclass
class GroupResult:
    """The G completions of one prompt.

    Attributes:
        response_ids: G lists of R_i token ids (int); the EOS token, when sampled, is the last one.
        behaviour_logprobs: G float32 tensors [R_i], natural log, under the sampling distribution.
        finish_reasons: G of ``"stop"`` (EOS or stop string), ``"length"`` (hit ``max_response_tokens``) or
            ``"interrupted"`` (``rollout.partial_rollout``: aborted by a weight update before it finished; the tokens
            so far are kept and continued by a later call, see ``GroupRequest.resume_from``).
        texts: G decoded completions (special tokens skipped).
        policy_version: the OLDEST policy version that sampled any token of the group (every token's, for a group
            sampled in one call); a group's staleness is measured from it.
        token_versions: G lists of R_i ints, the policy version that sampled each response token (partial rollouts:
            a completion interrupted by a weight update and continued spans versions); None means every token was
            sampled by ``policy_version`` (:meth:`versions_of`).
        loss_masks: (multi-turn episodes) G lists of R_i bools: True for the tokens the policy sampled, False for
            the observation tokens an environment inserted between turns (their behaviour logprob is 0 and they
            never count in the loss, the KL or the entropy); None means every response token was sampled.
        episodes: (multi-turn episodes) G :class:`EpisodeSummary`; None for single completions. With
            ``episode_of``: one per completion (the summary of the completion's episode, repeated).
        episode_of: (agents) per completion, the index (0..G-1) of the episode it is a training sequence of: an
            episode whose agent rewrote its history becomes several sequences, which share its reward and advantage
            (``cluster.loop.scoring``); None: each completion is its own episode (G completions).
        prompts: (agents) per completion, the prompt ids it continues (each episode's first call renders its own
            prompt; a rewritten history is a new prompt); None: every completion continues ``prompt_ids``.
    """

    group_id: int
    prompt_ids: list[int]
    response_ids: list[list[int]]
    behaviour_logprobs: list[torch.Tensor]
    finish_reasons: list[str]
    texts: list[str]
    policy_version: int
    token_versions: list[list[int]] | None = None
    loss_masks: list[list[bool]] | None = None
    episodes: list[EpisodeSummary] | None = None
    episode_of: list[int] | None = None
    prompts: list[list[int]] | None = None

    @property
    def complete(self) -> bool:
        """True when no completion was interrupted (the group can be scored and trained)."""
        return INTERRUPTED not in self.finish_reasons

    def versions_of(self, i: int) -> list[int]:
        """The policy version of each token of completion ``i`` (R_i ints)."""
        if self.token_versions is None:
            return [self.policy_version] * len(self.response_ids[i])
        return list(self.token_versions[i])

    def sampled_of(self, i: int) -> list[bool]:
        """Whether the policy sampled each token of completion ``i`` (R_i bools; all True without a loss mask)."""
        if self.loss_masks is None:
            return [True] * len(self.response_ids[i])
        return list(self.loss_masks[i])

    def prompt_of(self, i: int) -> list[int]:
        """The prompt ids completion ``i`` continues (``prompts[i]``, else the group's ``prompt_ids``)."""
        return list(self.prompts[i]) if self.prompts is not None else list(self.prompt_ids)

    def episode_index(self, i: int) -> int:
        """The index within the group of the episode completion ``i`` belongs to (``i`` without ``episode_of``)."""
        return self.episode_of[i] if self.episode_of is not None else i

    def episode_rows(self) -> list[int]:
        """The last completion of each episode, in episode order: one row per episode (all rows without
        ``episode_of``)."""
        last = {self.episode_index(i): i for i in range(len(self.response_ids))}
        return [last[e] for e in sorted(last)]

    @property
    def newest_version(self) -> int:
        """The newest policy version that sampled any token (``policy_version`` when there is none)."""
        return max((v for i in range(len(self.response_ids)) for v in self.versions_of(i)),
                   default=self.policy_version)



@dataclass(frozen=True)
class GenerateStats:
    """One engine's figures for one ``generate`` call.

    Attributes:
        seconds: wall seconds the engine was busy with the call.
        tokens: response tokens sampled.
        kv_cache_usage: estimated peak fraction [0, 1] of the engine's KV cache the call used (prompt + completion
            tokens of all its requests over the cache's token capacity); None when the capacity is unknown.
    """

    seconds: float
    tokens: int
    kv_cache_usage: float | None = None


@dataclass(frozen=True)
class EngineInfo:
    """What a rollout engine reports about itself (``RolloutEngine.ready``, also the liveness probe).

    Attributes:
        policy_version: the version its weights hold; None after a failed sync (it refuses to generate).
        pid: process id. node_id: Ray node id (None outside Ray). gpu_ids: the GPU ids Ray gave the process.
        cpu_cores: the CPU core ids the process may run on (``os.sched_getaffinity``; ``rollout.cpu_affinity``
            when set), sorted.
    """

    policy_version: int | None
    pid: int
    node_id: str | None = None
    gpu_ids: list[str] = field(default_factory=list)
    cpu_cores: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class EngineLoad:
    """One engine's share of one ``RolloutPool.generate`` call (an engine that got no group: zeros and None).

    Attributes:
        groups: groups dispatched to it. tokens: response tokens it sampled. seconds: its busy wall seconds.
        kv_cache_usage: its estimated peak KV-cache fraction [0, 1] (``GenerateStats``); None when unknown or not
            called.
    """

    groups: int
    tokens: int = 0
    seconds: float = 0.0
    kv_cache_usage: float | None = None


@dataclass(frozen=True)
class PoolGenerateStats:
    """The rollout pool's figures for one ``RolloutPool.generate`` call over all its engines.

    Attributes:
        tokens: response tokens sampled by every engine together.
        engine_seconds: busy seconds of each engine that got a call, in completion order.
        engine_idle_fraction: 1 − Σ busy engine-seconds / (num_engines × wall seconds of the call), in [0, 1];
            engines that got no group count as idle throughout.
        per_engine: one :class:`EngineLoad` per engine of the pool, by engine index.
        capacity_seconds: num_engines × wall seconds: the idle fraction's denominator (None: not measured).
    """

    tokens: int
    engine_seconds: list[float]
    engine_idle_fraction: float
    per_engine: list[EngineLoad]
    capacity_seconds: float | None = None


# ---- training: driver → train ranks → driver ---------------------------------------------------------------------


@dataclass(frozen=True)
class TrainRankInfo:
    """What a train rank reports once its process group, policy and optimizer are built.

    Attributes:
        rank: its rank in the train group. backend: ``gloo`` or ``nccl``. num_parameters: of the policy (all ranks).
        pid: process id. device: e.g. ``cpu``, ``cuda:0``. node_id: Ray node id (None outside Ray).
        gpu_ids: the GPU ids Ray gave the process. cpu_cores: the CPU core ids the process may run on
        (``os.sched_getaffinity``; ``train.cpu_affinity`` when set), sorted. num_threads: its torch intra-op threads.
    """

    rank: int
    backend: str
    num_parameters: int
    pid: int
    device: str
    node_id: str | None = None
    gpu_ids: list[str] = field(default_factory=list)
    cpu_cores: list[int] = field(default_factory=list)
    num_threads: int | None = None


@dataclass(frozen=True)
class TrainResult:
    """One train step's outcome, identical on every rank.

    Attributes:
        policy_version: the trainer's policy version after the step (one more than before when any optimizer step
            was applied; unchanged when every iteration was skipped).
        skipped: at least one iteration's update was skipped for a NaN/Inf loss or gradient norm.
        skip_reason: ``""``, or the first non-finite metric: ``"actor/loss"`` or ``"actor/grad_norm"``.
        metrics: ``actor/*``, ``rollout/logprob_diff``, ``perf/train_tokens``, ``timing/*``, ``memory/*`` — numbers
            only (float), averaged over ranks and iterations as each metric documents. Reported, never read back to
            steer the job.
        kl: the step's mean KL(policy ‖ reference) estimate per loss token (nats, the ``algorithm.kl_estimator``;
            the value ``actor/kl`` reports), which the adaptive KL controller reads; None when the step computed no
            KL (no reference policy).
        grad_norm: the global gradient norm before clipping, averaged over the iterations (the value
            ``actor/grad_norm`` reports), which the loop reads to tell an update that must move the trainable
            parameters (> 0 and applied: the adapter-payload check of ``train.lora.sync: adapter``); None when not
            reported.
        token_logprobs: the trainer's logprobs (natural log, float) of every response token of the traced sequences
            (``PackedMicroBatch.traced``), before the step's first update — the values ``rollout/logprob_diff``
            compares with the engine's — keyed by the sequence's index in the step's rollout batch
            (``PackedMicroBatch.seq_indices``), R_i floats each; every rank's traced sequences (the Ray trainer
            merges the ranks'); {} when none was traced.
    """

    policy_version: int
    skipped: bool
    skip_reason: str
    metrics: dict[str, float]
    kl: float | None = None
    grad_norm: float | None = None
    token_logprobs: dict[int, list[float]] = field(default_factory=dict)
