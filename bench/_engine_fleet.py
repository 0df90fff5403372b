"""One vLLM engine in this process as the loop's rollout side, for benchmarks of multi-turn episodes.

:class:`EngineAsFleet` gives :class:`cluster.loop.episodes.EpisodeRunner` what it calls of a
``contract.protocols.Fleet`` (``generate`` and ``restarts``) over a :class:`rollout_workers.engine.RolloutEngine`
built here, without Ray: the requests go to the engine as they would from
``cluster.ray_shell.fleet.EngineFleet`` (one ``generate`` call, results in request order).
:class:`FixedLengthEngine` makes every completion exactly its cap long (vLLM's ``min_tokens``: no EOS before it), so
two runs sample the same number of tokens.
"""

from __future__ import annotations

import gc
import time

from contract.messages import GroupRequest, GroupResult
from rollout_workers.engine import RolloutEngine

__all__ = ["EngineAsFleet", "FixedLengthEngine", "shutdown_engine"]


class FixedLengthEngine(RolloutEngine):
    """A RolloutEngine whose completions never stop before their length cap (``min_tokens`` = ``max_tokens``)."""

    def _sampling(self, request: GroupRequest) -> dict:
        out = super()._sampling(request)
        out["min_tokens"] = out["max_tokens"]
        return out


class EngineAsFleet:
    """``generate`` over one in-process engine.

    Attributes:
        restarts: always 0 (nothing is replaced here). calls, seconds, tokens: generate calls made, their wall
            seconds and the tokens they sampled, since construction.
    """

    restarts = 0

    def __init__(self, engine: RolloutEngine, group_size: int):
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


def shutdown_engine(engine: RolloutEngine) -> None:
    """Stop vLLM's engine-core process now (instead of at interpreter exit)."""
    try:
        engine.llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001 - best effort: the process exits anyway
        print(f"(engine shutdown: {exc!r})")
    del engine
    gc.collect()
