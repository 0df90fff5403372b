"""One multi-turn episode's state, and the group results made from episodes (``cluster.loop.episodes``).

An episode's response is the concatenation of its turns' sampled tokens (with their behaviour logprobs and the policy
version of each) and its observations' tokens (logprob 0, the version of the token before them, not sampled: False
in its loss mask). Its next turn is a :class:`contract.messages.GroupRequest` of one completion whose prompt is the
episode's whole sequence so far, as token ids (the engine continues it; its prefix cache makes the earlier turns
cheap), capped at what is left of the turn's and the episode's budgets; an interrupted turn (partial rollouts) is the
request's ``resume_from`` and is continued from its tokens (``rollout_workers.partial``).

Seeds (:func:`turn_seed`): turn 1 of episode i of a group seeded s is sampled with s + i, the seed vLLM gives
completion i of an ``n=G`` request, so a one-turn episode is exactly the single completion of that seed; later turns
get a CRC-32 mix of (s, i, turn). An episode sampled again from its start gets the same seeds.

Shapes: G episodes per group, R tokens of an episode's response (sampled + observation).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from contract.messages import INTERRUPTED, EpisodeSummary, GroupRequest, GroupResult
from grpo.environments import Turn

__all__ = ["Episode", "episode_group", "turn_seed"]


def turn_seed(seed: int | None, sample: int, turn: int) -> int | None:
    """The sampling seed of turn ``turn`` (1-based) of episode ``sample`` of a group seeded ``seed`` (module
    docstring); None when the group is unseeded."""
    if seed is None:
        return None
    if turn == 1:
        return seed + sample
    return zlib.crc32(f"{seed}:{sample}:turn{turn}".encode()) & 0x7FFFFFFF


@dataclass
class Episode:
    """One episode of a sampling round.

    Attributes:
        index: its place in the round (group position × G + sample): the group id of its turn requests, unique
            within every generate call of the round. group: its group's position in the round. sample: its index
            in the group. prompt_ids: the group's prompt. seed: the group's seed.
        env: its environment's handle (None before its first step, or after it was closed).
        ids, logprobs, versions, sampled: per response token: the id, the behaviour logprob (0 for observation
            tokens), the policy version, whether the policy sampled it.
        turns: policy turns completed. partial: the turn an interrupted call left (one completion), None.
        pending: a completed turn its environment has not answered yet. last_finish: the last turn's finish
        reason. ended: None while it runs, else :attr:`EpisodeSummary.ended`'s value.
        last_version: the newest policy version of any call that sampled for it (its version before any token).
    """

    index: int
    group: int
    sample: int
    prompt_ids: list[int]
    seed: int | None
    env: object | None = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    turns: int = 0
    partial: GroupResult | None = None
    pending: Turn | None = None
    last_finish: str = "stop"
    ended: str | None = None
    last_version: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    observation_tokens: int = 0
    turn_reward: float = 0.0
    restarts: int = 0
    environment_s: float = 0.0
    detail: str = ""

    def restart(self) -> None:
        """Back to its start (an engine failed mid-episode): everything sampled and observed is dropped; the
        environment must have been closed by the caller."""
        restarts = self.restarts + 1
        fresh = Episode(self.index, self.group, self.sample, self.prompt_ids, self.seed)
        self.__dict__.update(fresh.__dict__)
        self.restarts = restarts

    def request(self, template: GroupRequest, turn_tokens: int, max_episode_tokens: int) -> GroupRequest:
        """The request of its next (or interrupted) turn: its sequence so far as the prompt, one completion, the
        turn's seed, ``template``'s sampling settings, capped at ``turn_tokens`` and what is left of
        ``max_episode_tokens``."""
        cap = min(turn_tokens, max_episode_tokens - len(self.ids))
        return GroupRequest(group_id=self.index, prompt_ids=self.prompt_ids + self.ids, group_size=1,
                            seed=turn_seed(self.seed, self.sample, self.turns + 1), sampling=template.sampling,
                            resume_from=self.partial, max_tokens=cap)

    def take_turn(self, result: GroupResult, decode: Callable[[list[int]], str]) -> None:
        """Record what a generate call returned for its turn request: an interrupted turn is kept as
        :attr:`partial`; a finished one is appended and waits for its environment (:attr:`pending`)."""
        self.last_version = max(self.last_version, result.newest_version)
        if result.finish_reasons[0] == INTERRUPTED:
            self.partial = result
            return
        ids = list(result.response_ids[0])
        self.ids += ids
        self.logprobs += [float(x) for x in result.behaviour_logprobs[0]]
        self.versions += result.versions_of(0)
        self.sampled += [True] * len(ids)
        self.turns += 1
        self.partial = None
        self.last_finish = result.finish_reasons[0]
        self.pending = Turn(text=decode(ids), token_ids=tuple(ids), index=self.turns, finish_reason=self.last_finish)

    def observe(self, ids: list[int]) -> None:
        """Append an observation's tokens (not sampled: logprob 0, the version of the token before them)."""
        version = self.versions[-1] if self.versions else self.last_version
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.sampled += [False] * len(ids)
        self.observation_tokens += len(ids)

    def end(self, how: str, detail: str = "") -> None:
        """End it: ``how`` is an :attr:`EpisodeSummary.ended` value."""
        self.ended, self.detail, self.pending = how, detail, None

    def summary(self) -> EpisodeSummary:
        """Its :class:`EpisodeSummary` (an episode not ended yet reads as running: ``ended`` ``""``)."""
        return EpisodeSummary(turns=self.turns, tool_calls=self.tool_calls, tool_errors=self.tool_errors,
                              observation_tokens=self.observation_tokens, ended=self.ended or "",
                              turn_reward=self.turn_reward, restarts=self.restarts,
                              environment_s=self.environment_s, detail=self.detail)

    def snapshot(self) -> tuple[list[int], list[float], list[int], list[bool]]:
        """(ids, logprobs, versions, sampled) with an interrupted turn's tokens so far appended."""
        ids, lps, versions, sampled = list(self.ids), list(self.logprobs), list(self.versions), list(self.sampled)
        if self.partial is not None:
            part = list(self.partial.response_ids[0])
            ids += part
            lps += [float(x) for x in self.partial.behaviour_logprobs[0]]
            versions += self.partial.versions_of(0)
            sampled += [True] * len(part)
        return ids, lps, versions, sampled


def episode_group(request: GroupRequest, episodes: list[Episode], decode: Callable[[list[int]], str]
                  ) -> GroupResult:
    """The :class:`GroupResult` of one group's G episodes: each a completion whose response is its whole sequence
    after the prompt, with ``loss_masks`` (sampled tokens) and ``episodes`` (summaries). An episode still running
    (partial rollouts: its round is carried over) has finish reason ``"interrupted"`` and its tokens so far.
    ``policy_version`` is the oldest version of any sampled token (of any call, when none was sampled yet)."""
    ids, lps, reasons, texts, versions, masks = [], [], [], [], [], []
    for e in episodes:
        e_ids, e_lps, e_versions, e_sampled = e.snapshot()
        ids.append(e_ids)
        lps.append(torch.tensor(e_lps, dtype=torch.float32))
        reasons.append(e.last_finish if e.ended is not None else INTERRUPTED)
        texts.append(decode(e_ids))
        versions.append(e_versions)
        masks.append(e_sampled)
    sampled_versions = [v for vs, ms in zip(versions, masks) for v, m in zip(vs, ms) if m]
    oldest = min(sampled_versions, default=min(e.last_version for e in episodes))
    return GroupResult(request.group_id, list(request.prompt_ids), ids, lps, reasons, texts, oldest, versions,
                       loss_masks=masks, episodes=[e.summary() for e in episodes])
