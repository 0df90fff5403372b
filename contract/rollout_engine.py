"""What a fleet calls on one rollout engine: the :class:`RolloutEngine` protocol every engine implements.

An engine (``rollout_workers.vllm.engine.VLLMEngine``: vLLM; ``rollout_workers.hf.engine.HFEngine``: transformers'
own decoding) is a plain class. The Ray shell's rollout pool (``cluster.ray_shell.rollout_pool``) picks it from
``rollout_workers.registry`` by the spec's ``rollout.engine``, wraps it in ``ray.remote`` and starts
``rollout.replicas`` of them; the weight-sync coordinator (``cluster.ray_shell.sync``) joins each to the trainer's sync
group and streams every policy version into it. The in-process runtime (``cluster.in_process.LocalFleet``) builds one
``hf`` engine in the calling process and syncs it over the same transports.

Construction (as the rollout pool calls it)::

    Engine(model_path, rollout, dtype, seed, max_model_len, policy_version=0, lora=None, source=None)

``model_path``: local HF folder (or hub id) of the weights it starts from; ``rollout``: the spec's ``RolloutSpec``
(sampling settings, ``stop``, resources, engine options); ``dtype``: ``model.dtype``; ``seed``: the engine's seed
(requests without their own seed draw from it); ``max_model_len``: the context it reserves per sequence, tokens;
``policy_version``: the version of ``model_path``'s weights; ``lora``: the spec's ``train.lora`` or None (with
``sync: adapter`` the engine serves the streamed adapter); ``source``: :class:`contract.model_source.ModelSource`.

Concurrency: :meth:`RolloutEngine.interrupt` and :meth:`RolloutEngine.ready` may be called from another thread while
``generate`` runs (the Ray shell gives the actor two concurrency slots for partial rollouts); ``generate`` and the
weight sync never run at once (the engine serialises them). Served requests (:meth:`RolloutEngine.submit`, request-
level generation) run beside both: a sync or a ``generate`` call pauses them and they continue afterwards, every
token stamped with the version that sampled it (``rollout_workers.serving``).

Notation: B groups per call, G completions per group, R_i tokens of completion i.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from concurrent.futures import Future

from contract.messages import EngineInfo, GenerateStats, GroupRequest, GroupResult
from contract.requests import TokenRequest, TokenResult
from contract.sync_reports import ReceiveReport


@runtime_checkable
class RolloutEngine(Protocol):
    """One rollout engine: samples groups with behaviour logprobs and receives the trainer's streamed policy.

    Attributes:
        policy_version: the version its weights hold; None after a failed sync (it refuses to generate until a sync
            succeeds).
    """

    policy_version: int | None

    @staticmethod
    def lora_adapter_problem(architectures: list[str]) -> str | None:
        """Pre-start check (starts nothing) for ``train.lora.sync: adapter``: None when the engine serves LoRA
        adapters for a model of these ``config.json`` architectures, else one line saying why not (the caller names
        the spec field)."""
        ...

    def ready(self) -> EngineInfo:
        """Cheap liveness probe: its policy version, process id and where it runs (also the start-up report)."""
        ...

    def generate(self, requests: list[GroupRequest], group_size: int, interrupt_epoch: int | None = None
                 ) -> tuple[list[GroupResult], GenerateStats]:
        """Sample ``group_size`` completions for each request (``request.group_size`` when set) with the spec's
        ``rollout`` sampling settings (``stop`` included) or the request's ``sampling`` override; a request with
        ``resume_from`` continues its interrupted completions (``rollout_workers.partial``).

        Args:
            interrupt_epoch: (partial rollouts) stop early once :meth:`interrupt` is called with an epoch >= this
                one; unfinished completions come back ``"interrupted"`` with their tokens so far. None: run to the end.

        Returns:
            (one :class:`GroupResult` per request, in order, each token stamped with the policy version that sampled
            it; :class:`GenerateStats`: busy seconds, tokens sampled, estimated peak KV-cache use).

        Raises:
            RuntimeError: the weights are inconsistent after a failed sync.
            ValueError: a request's ``resume_from`` does not fit it.
        """
        ...

    def interrupt(self, epoch: int) -> None:
        """Stop every ``generate`` call of ``interrupt_epoch`` <= ``epoch``, running or still to come, at its next
        step (records the epoch only: safe from any thread)."""
        ...

    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, buckets, timeout_s: float,
                         backend: str = "gloo", channel: dict | None = None, adapter_config: dict | None = None
                         ) -> list[int]:
        """Join the weight-sync group (every worker of the engine, as ranks ``rank_offset + i``) with the trainer's
        bucket plan (``weight_sync.buckets.Bucket`` s); ``channel``: the sender's transport descriptor
        (``weight_sync.transport``; None: broadcast over ``backend``); ``adapter_config``: the trainer's PEFT
        adapter config when the buckets hold LoRA adapters. Returns the ranks taken.

        Raises:
            ValueError: the plan's tensors are not the engine model's (names them).
            RuntimeError: the group did not form within ``timeout_s``.
        """
        ...

    def close_weight_sync(self) -> None:
        """Leave the sync group (before a group with new membership is formed, or after a failed sync)."""
        ...

    def receive_weights(self, policy_version: int, verify: bool | list[str]) -> ReceiveReport:
        """Receive one streamed sync and serve ``policy_version`` from then on.

        Args:
            verify: CRC-32 checksums of the received bytes of every tensor (True), none (False) or the named ones.

        Returns:
            per engine worker, the checksums (and with adapter sync, the modules the adapter is bound to).

        Raises:
            RuntimeError: the transport failed; the engine's version is None until a sync succeeds.
        """
        ...

    def submit(self, request: TokenRequest) -> Future[TokenResult]:
        """Serve one request as soon as the engine can (``contract.requests.RequestServer.submit``; thread-safe).
        The future fails with ValueError for a request the engine cannot serve; a sync never fails it."""
        ...

    def serve(self, request: TokenRequest) -> TokenResult:
        """:meth:`submit` and wait: what the Ray shell calls, many at once (the actor's ``requests`` concurrency
        group)."""
        ...

    def busy_seconds(self) -> float:
        """Cumulative seconds spent serving requests (``TokenResult.busy_s``)."""
        ...

    def shutdown(self) -> None:
        """Stop serving (unfinished requests end ``"abort"``) and release what the engine holds in this process
        (idempotent); a Ray actor is killed instead."""
        ...
