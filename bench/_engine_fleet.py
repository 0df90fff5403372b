"""One vLLM engine in this process as the loop's rollout side, for benchmarks of multi-turn episodes.

:class:`EngineAsFleet` gives :class:`cluster.loop.episodes.EpisodeRunner` what it calls of a
``contract.protocols.Fleet`` (``generate`` and ``restarts``) over a :class:`rollout_workers.vllm.engine.VLLMEngine`
built here, without Ray: the requests go to the engine as they would from
``cluster.ray_shell.fleet.EngineFleet`` (one ``generate`` call, results in request order).
:class:`FixedLengthEngine` makes every completion (and every served request) exactly its cap long (vLLM's
``min_tokens``: no EOS before it), so two runs sample the same number of tokens.
"""

from __future__ import annotations

import gc
import time

from contract.messages import GroupRequest, GroupResult
from rollout_workers.vllm.engine import VLLMEngine

__all__ = ["EngineAsFleet", "FixedLengthEngine", "shutdown_engine"]


class FixedLengthEngine(VLLMEngine):
    """A VLLMEngine whose completions never stop before their length cap (``min_tokens`` = ``max_tokens``), in
    ``generate`` calls and in served requests alike."""

    def _sampling(self, request: GroupRequest) -> dict:
        out = super()._sampling(request)
        out["min_tokens"] = out["max_tokens"]
        return out

    def request_params(self, request, max_tokens: int, seed: int | None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(n=1, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                              min_p=request.min_p, max_tokens=max_tokens, min_tokens=max_tokens, seed=seed,
                              logprobs=0, skip_special_tokens=True, output_kind=RequestOutputKind.DELTA)


class EngineAsFleet:
    """``generate`` over one in-process engine.

    Attributes:
        restarts: always 0 (nothing is replaced here). calls, seconds, tokens: generate calls made, their wall
            seconds and the tokens they sampled, since construction.
    """

    restarts = 0

    def __init__(self, engine: VLLMEngine, group_size: int):
        self.engine, self.group_size = engine, group_size
        self.calls, self.seconds, self.tokens = 0, 0.0, 0

    def generate(self, requests: list[GroupRequest], on_groups=None, record: bool = True, recover: bool = True,
                 interrupt_epoch: int | None = None) -> list[GroupResult]:
        """The engine's groups for ``requests`` (``on_groups`` called once with all of them)."""
        t0 = time.perf_counter()
        groups, stats = self.engine.generate(requests, self.group_size, interrupt_epoch)
        self.calls += 1
        self.seconds += time.perf_counter() - t0
        self.tokens += stats.tokens
        if on_groups is not None:
            on_groups(groups)
        return groups


def shutdown_engine(engine: VLLMEngine) -> None:
    """Stop vLLM's engine-core process now (instead of at interpreter exit)."""
    try:
        engine.llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001 - best effort: the process exits anyway
        print(f"(engine shutdown: {exc!r})")
    del engine
    gc.collect()
