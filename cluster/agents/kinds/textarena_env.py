"""The ``textarena`` agent kind: ``rollout.agent: "textarena:<environment id>"`` runs a TextArena environment
(``textarena`` 0.7, the optional extra ``textarena``) unchanged, one episode per game, each move a chat call to the
endpoint (docs/agents.md, "Ecosystem environments").

One episode, as TextArena's own play loop runs a game:

1. ``env = ta.make(environment id, **env_kwargs)`` (with the wrappers the id is registered with: the default ids give
   the model the game log as text, ``LLMObservationWrapper``, and put a bare move in brackets,
   ``ActionFormattingWrapper``), then ``env.reset(num_players=1, seed=...)`` (:func:`~cluster.agents.kinds.ecosystem.
   episode_seed`: the G episodes of a group play the same game);
2. ``player, observation = env.get_observation()``; the observation is the next user message
   (:class:`~cluster.agents.kinds.ecosystem.Conversation`: what it adds to the previous one); the reply's text is the
   move, ``done, info = env.step(reply)``, until ``done``;
3. ``rewards, game_info = env.close()``: the reward is ``rewards[0]``, the game's own (GuessTheNumber: 1 for the
   number, else how close the last guess was); ``reward/invalid_move`` is 1 when the game ended on an invalid move.

An episode that ends without the game ending — a call refused for the episode's token budget (``token_budget``),
``max_turns`` moves (``max_turns``) — gets reward 0: the game gave none. The environment raising, or a call into it
past ``step_timeout_s``, is an infrastructure failure of the episode.

**Single-player environments only** (reset with ``num_players=1``, their state a ``ta.SinglePlayerState``): in a game
of two or more players every seat but one needs an opponent, and a policy playing every seat trains on moves whose
reward is another seat's. A spec naming any other environment is refused when it is validated.

TextArena seeds and draws from the process-wide ``random`` module (``ta.State.__init__`` calls ``random.seed``), so
calls into textarena are serialised in a worker (one lock; they are short): a game drawn after its seed is the same
game however many episodes run at once.
"""

from __future__ import annotations

import difflib
import threading
import time
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from cluster.agents.kinds.ecosystem import (
    Conversation, EcosystemKind, EpisodeOptions, episode_seed, missing_library, read_options,
)
from cluster.agents.kinds.environment import call_in_thread
from cluster.agents.loading import AgentLoadError, SignatureProblem
from cluster.agents.outcomes import one_line
from cluster.agents.plan import AgentPlan
from contract.agents import AgentOutcome, EpisodeRun

__all__ = ["KIND", "TextArenaOptions", "build", "check"]

NAME = "textarena"
#: One call into textarena at a time in this process (module docstring).
_LOCK = threading.Lock()
_TIMEOUT = "rollout.agent_options.step_timeout_s"


class TextArenaOptions(EpisodeOptions):
    """``rollout.agent_options`` of a textarena environment."""

    system_prompt: str | None = Field(None, description=(
        "The system message; null: TextArena's own (textarena.agents.basic_agents.STANDARD_GAME_PROMPT); '' none."))


def _textarena():
    import textarena

    return textarena


def _locked(fn, *args, **kwargs):
    with _LOCK:
        return fn(*args, **kwargs)


def _observation_text(observation: Any) -> str:
    """An observation as text: a wrapped environment's string as it is; a raw one's messages (``-raw`` ids: a list of
    ``(sender id, message, type)``) one per line as ``LLMObservationWrapper`` writes them."""
    if isinstance(observation, str):
        return observation
    lines = []
    for item in observation or ():
        sender, message = (item[0], item[1]) if isinstance(item, (tuple, list)) and len(item) >= 2 else (None, item)
        lines.append(f"[{'GAME' if sender == -1 else f'Player {sender}'}] {message}")
    return "\n".join(lines)


def check(environment_id: str, options: Mapping[str, Any], base_dir: str | None) -> SignatureProblem | None:
    """The spec's check (``EcosystemKind.check``): the options, textarena importable, the id registered, the
    environment made and reset for one player."""
    key = f"{NAME}:{environment_id}"
    opts, problem = read_options(TextArenaOptions, options, NAME)
    if problem is not None:
        return problem
    try:
        ta = _textarena()
    except ImportError as exc:
        return missing_library(NAME, "textarena", "textarena", key, exc)
    from textarena.envs.registration import ENV_REGISTRY

    if environment_id not in ENV_REGISTRY:
        close = difflib.get_close_matches(environment_id, list(ENV_REGISTRY), n=5)
        return SignatureProblem("rollout.agent", (
            f"agent {key!r}: no textarena environment {environment_id!r} (textarena {ta.__version__} registers "
            f"{len(ENV_REGISTRY)}{'; close: ' + ', '.join(close) if close else ''})"))
    try:
        env = _locked(ta.make, environment_id, **opts.env_kwargs)
        _locked(env.reset, num_players=1, seed=0)
        state = env.state
    except Exception as exc:  # noqa: BLE001 - any failure of the library's code, in one line
        return SignatureProblem("rollout.agent", one_line(
            f"agent {key!r}: the environment cannot be made and reset for one player ({type(exc).__name__}: {exc}); "
            f"the textarena kind runs single-player environments (num_players=1) made with "
            f"rollout.agent_options.env_kwargs = {dict(opts.env_kwargs)}"))
    if not isinstance(state, ta.SinglePlayerState):
        return SignatureProblem("rollout.agent", (
            f"agent {key!r}: a game of {type(state).__name__} (a game of several players); the textarena kind runs "
            f"single-player environments (their state a SinglePlayerState): every other seat would need an "
            f"opponent"))
    return None


def build(plan: AgentPlan) -> EpisodeRun:
    """The episode run of ``plan.key`` (module docstring).

    Raises:
        AgentLoadError: :func:`check` finds a problem here (the library missing in this worker, an unknown id).
    """
    environment_id = plan.key.partition(":")[2]
    problem = check(environment_id, plan.options, plan.base_dir())
    if problem is not None:
        raise AgentLoadError(f"{problem.field}: {problem.message}")
    ta = _textarena()
    opts = TextArenaOptions.model_validate(dict(plan.options))
    if opts.system_prompt is None:
        from textarena.agents.basic_agents import STANDARD_GAME_PROMPT
        system_prompt = STANDARD_GAME_PROMPT
    else:
        system_prompt = opts.system_prompt

    async def in_thread(fn, what: str, *args, **kwargs):
        return await call_in_thread(lambda: _locked(fn, *args, **kwargs), opts.step_timeout_s, what, _TIMEOUT)

    async def episode(client: Any, row: Mapping[str, Any]) -> AgentOutcome:
        seconds = 0.0
        t0 = time.perf_counter()
        env = await in_thread(ta.make, "make", environment_id, **opts.env_kwargs)
        await in_thread(env.reset, "reset", num_players=1, seed=episode_seed(row, opts.seed_field))
        seconds += time.perf_counter() - t0
        conversation = Conversation(system_prompt, plan.model, opts.max_tokens)
        ended = "max_turns"
        for _ in range(opts.max_turns):
            t0 = time.perf_counter()
            _, observation = await in_thread(env.get_observation, "get_observation")
            seconds += time.perf_counter() - t0
            conversation.observe(_observation_text(observation))
            move = await conversation.reply(client)
            if move is None:
                ended = "token_budget"
                break
            t0 = time.perf_counter()
            done, _ = await in_thread(env.step, "step", move)
            seconds += time.perf_counter() - t0
            if done:
                ended = "done"
                break
        closed = await in_thread(env.close, "close")
        rewards, info = closed if isinstance(closed, tuple) and len(closed) == 2 else (closed, {})
        reward = float(rewards[0]) if ended == "done" and rewards and 0 in rewards else 0.0
        invalid = float(bool((info or {}).get(0, {}).get("invalid_move", False)))
        return AgentOutcome(reward, {"invalid_move": invalid}, ended=ended, figures={"environment_s": seconds})

    return episode


KIND = EcosystemKind(NAME, "textarena", "textarena", build, check)
