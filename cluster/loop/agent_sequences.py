"""An agent episode's training sequences, built token for token from what the endpoint recorded (never from text).

The agent endpoint (``cluster.endpoint``) records every chat-completions call of an episode
(:class:`contract.agents.CallRecord`): the prompt ids the engine continued, the ids it sampled, their behaviour
logprobs and policy versions, and whether the call's prompt *extends* the previous call's (its messages were the
previous call's + the assistant message the endpoint returned + new messages, so its prompt ids are the previous
prompt + completion + the new messages' tokens).

    sequences = agent_sequences(record)      # one AgentSequence per run of extending calls

- A run of extending calls is **one sequence**: the run's first prompt, then each call's sampled tokens (loss mask
  True, their behaviour logprobs and versions) and, between calls, the inserted tokens of the new messages (tool
  outputs, user turns, the template's delimiters: loss mask False, logprob 0, the version of the sampled token
  before them). The last call's completion ends the sequence.
- Where the agent **rewrote its history** (a summary, a dropped or edited turn: the call does not extend), a new
  sequence starts from that call's prompt (rendered afresh by the endpoint). The episode's sequences **share its
  advantage**: its reward is one number, so every sequence of the episode is trained with the episode's advantage,
  as verl's agent loop and SkyRL do for non-prefix turns (the loop's scoring gives it to each; the group's
  statistics count the episode once). ``episode/rewritten_fraction`` counts such calls.

Notation: P prompt tokens of a sequence, R tokens after it (sampled and inserted).
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.agents import CallRecord, EpisodeRecord

__all__ = ["AgentRecordError", "AgentSequence", "agent_sequences"]


class AgentRecordError(ValueError):
    """An episode record whose calls do not chain as their ``extends`` flags say (an endpoint bug, not the agent's)."""


@dataclass(frozen=True)
class AgentSequence:
    """One training sequence of an agent episode.

    Attributes:
        prompt_ids: P token ids, the first call's prompt of the run (never trained on).
        response_ids: R token ids after the prompt: sampled and inserted tokens in the order the engine saw them.
        loss_mask: R bools, True where the policy sampled the token.
        logprobs: R floats, natural log, the behaviour logprob of each sampled token; 0.0 for inserted tokens.
        token_versions: R ints, the policy version that sampled each token (inserted ones: the sampled token's
            before them).
        calls: how many calls the sequence spans (>= 1; 0 for a row made by hand, e.g. the loop's placeholder of an
            episode with nothing to train). first_call: the index of its first call in the record.
        finish_reason: its last call's (``"stop"``, ``"length"``, ``"tool_calls"``, ``"abort"``).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]
    token_versions: list[int]
    calls: int = 0
    first_call: int = 0
    finish_reason: str = "stop"

    @property
    def sampled_tokens(self) -> int:
        """How many of its tokens the policy sampled."""
        return sum(self.loss_mask)


class _Run:
    """A sequence being assembled."""

    def __init__(self, index: int, call: CallRecord):
        self.first, self.prompt = index, list(call.prompt_ids)
        self.ids: list[int] = []
        self.mask: list[bool] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.calls = 0
        self.finish = call.finish_reason
        self.add_sampled(call)

    def add_sampled(self, call: CallRecord) -> None:
        self.ids += call.completion_ids
        self.mask += [True] * len(call.completion_ids)
        self.logprobs += [float(x) for x in call.logprobs]
        self.versions += [int(v) for v in call.token_versions]
        self.calls, self.finish = self.calls + 1, call.finish_reason

    def add_inserted(self, ids: list[int], next_call: CallRecord) -> None:
        before = self.versions[-1] if self.versions else (next_call.token_versions or [0])[0]
        self.ids += ids
        self.mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [before] * len(ids)

    def sequence(self) -> AgentSequence:
        return AgentSequence(self.prompt, self.ids, self.mask, self.logprobs, self.versions, self.calls, self.first,
                             self.finish)


def _check_call(index: int, call: CallRecord, key: str) -> None:
    r = len(call.completion_ids)
    if len(call.logprobs) != r or len(call.token_versions) != r:
        raise AgentRecordError(f"episode {key!r} call {index}: expected {r} logprobs and versions (one per sampled "
                               f"token), got {len(call.logprobs)} and {len(call.token_versions)}")


def agent_sequences(record: EpisodeRecord) -> list[AgentSequence]:
    """The training sequences of one agent episode (module docstring); [] when it made no call.

    Raises:
        AgentRecordError: a call marked ``extends`` whose prompt does not start with the previous call's prompt +
            completion, the first call marked ``extends``, or a call whose logprobs/versions do not match its tokens.
    """
    runs: list[_Run] = []
    previous: CallRecord | None = None
    for index, call in enumerate(record.calls):
        _check_call(index, call, record.episode_key)
        if not call.extends:
            runs.append(_Run(index, call))
        elif previous is None:
            raise AgentRecordError(f"episode {record.episode_key!r}: its first call is marked as extending a "
                                   f"previous one")
        else:
            prefix = len(previous.prompt_ids) + len(previous.completion_ids)
            if list(call.prompt_ids[:prefix]) != [*previous.prompt_ids, *previous.completion_ids]:
                raise AgentRecordError(f"episode {record.episode_key!r} call {index}: marked as extending call "
                                       f"{index - 1} but its prompt does not start with that call's prompt and "
                                       f"completion ({prefix} tokens)")
            runs[-1].add_inserted(list(call.prompt_ids[prefix:]), call)
            runs[-1].add_sampled(call)
        previous = call
    return [run.sequence() for run in runs]
