"""The ``environment`` agent kind: one of our own environments (``grpo.environments``, ``rollout.multi_turn``)
driven through the endpoint like any agent (``rollout.multi_turn.runner: agent_pool``), so that its episodes run on
the agent pool, off the driver, and each turn is served the moment its observation is ready.

One episode, as the lock-step runner (``cluster.loop.episodes``) runs it:

1. a fresh environment (``make_environment(name, options)``) is reset with the row;
2. turn k is a chat call with the messages so far (the row's chat prompt: ``data.system_prompt``, the prompt and
   ``data.prompt_suffix``, as ``cluster.data.build_chat_prompt`` renders a single completion's; then each turn's
   reply and observation), ``max_tokens`` one turn's cap (the endpoint lowers it to what is left of the episode's
   budget), asking for the sampled token ids (``return_token_ids``, vLLM's field) that the environment's
   :class:`~grpo.environments.Turn` carries;
3. the environment answers with an :class:`~grpo.environments.Observation`, appended as a message of its role: the
   endpoint continues the episode from its token ids with the observation's tokens (the chat template's delimiters
   around it), so the trainer's layout is the lock-step runner's;
4. the episode ends when the environment says ``done``, after ``max_turns`` turns, or when the endpoint refuses the
   next call for the budget (``token_budget``: scored as it is, as in lock-step).

Its reward is the sum of the turn rewards (``reward/environment``; ``algorithm.rewards`` score the episode's text in
the loop, as in lock-step). The environment raising, a reset, step or close past ``step_timeout_s``, or a malformed
observation raise :class:`~grpo.environments.EnvironmentInfraError` out of the episode: an infrastructure failure.
Environment calls are synchronous: they run in daemon threads, never on the worker's event loop, so a slow tool holds
only its own episode.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from cluster.agents.outcomes import budget_refusal
from cluster.agents.plan import AgentPlan
from cluster.data import Example, build_chat_prompt
from contract.agents import AgentOutcome, EpisodeRun
from grpo.environments import EnvironmentInfraError, Observation, Turn, check_observation, make_environment

__all__ = ["build", "call_in_thread", "completion_token_ids"]


async def call_in_thread(fn: Callable[[], Any], timeout_s: float, what: str,
                         setting: str = "rollout.multi_turn.step_timeout_s") -> Any:
    """``fn()`` in a daemon thread, awaited for at most ``timeout_s`` seconds (a thread past it is abandoned: it
    blocks neither the loop nor the process's exit); ``setting`` names the spec field ``timeout_s`` comes from.

    Raises:
        EnvironmentInfraError: past the timeout, or what ``fn`` raised (its type and message).
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as exc:  # noqa: BLE001 - handed to the episode
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the worker's loop is closed: nobody waits for it any more
            pass

    threading.Thread(target=run, name=f"environment-{what}", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(done), timeout_s)
    except asyncio.TimeoutError:
        raise EnvironmentInfraError(f"the environment's {what} did not return within {timeout_s:g} s "
                                    f"({setting})") from None
    except EnvironmentInfraError:
        raise
    except Exception as exc:  # noqa: BLE001 - any error of the environment is an infrastructure failure
        raise EnvironmentInfraError(f"the environment's {what} raised {type(exc).__name__}: {exc}") from None


def completion_token_ids(choice: Any) -> tuple[int, ...]:
    """The sampled token ids of a chat completion's choice: the ``token_ids`` field an endpoint adds when asked with
    ``return_token_ids`` (vLLM's name); () when the endpoint gave none."""
    ids = getattr(choice, "token_ids", None)
    if ids is None and isinstance(getattr(choice, "model_extra", None), dict):
        ids = choice.model_extra.get("token_ids")
    return tuple(int(i) for i in ids) if ids else ()


def _row_messages(row: Mapping[str, Any], system_prompt: str | None, suffix: str) -> list[dict]:
    """The chat messages of the row's prompt, as a single completion's prompt is rendered from them."""
    prompt = row.get("prompt", "")
    question = prompt if isinstance(prompt, str) else ""
    return build_chat_prompt(Example(-1, question, prompt=prompt), system_prompt, suffix)


def build(plan: AgentPlan) -> EpisodeRun:
    """The episode coroutine of ``plan.environment`` (module docstring).

    Raises:
        ValueError: the environment is not registered in this worker (an ``--import`` module registers it).
    """
    env_plan = plan.environment
    make_environment(env_plan.name, env_plan.options).close()  # registered and buildable here, or the worker fails

    async def episode(client: Any, row: Mapping[str, Any]) -> AgentOutcome:
        timeout = env_plan.step_timeout_s
        env = await call_in_thread(lambda: make_environment(env_plan.name, env_plan.options), timeout, "build")
        figures = {"tool_calls": 0.0, "tool_errors": 0.0, "environment_s": 0.0}
        try:
            await call_in_thread(lambda: env.reset(dict(row)), timeout, "reset")
            reward, ended = await _turns(client, env, row, plan, figures)
        finally:
            try:
                await call_in_thread(env.close, timeout, "close")
            except EnvironmentInfraError:
                pass  # the episode is over; a failed close is not its failure
        return AgentOutcome(reward, ended=ended, figures=figures)

    return episode


async def _turns(client: Any, env: Any, row: Mapping[str, Any], plan: AgentPlan,
                 figures: dict[str, float]) -> tuple[float, str]:
    """Run the episode's turns; (the sum of its turn rewards, how it ended)."""
    env_plan = plan.environment
    messages = _row_messages(row, env_plan.system_prompt, env_plan.prompt_suffix)
    reward = 0.0
    for index in range(1, env_plan.max_turns + 1):
        try:
            response = await client.chat.completions.create(
                model=plan.model, messages=messages, max_tokens=env_plan.turn_tokens,
                extra_body={"return_token_ids": True})
        except Exception as exc:  # noqa: BLE001 - the budget ends the episode; anything else is raised on
            if budget_refusal(exc):
                return reward, "token_budget"
            raise
        choice = response.choices[0]
        text = choice.message.content or ""
        turn = Turn(text=text, token_ids=completion_token_ids(choice), index=index,
                    finish_reason="length" if choice.finish_reason == "length" else "stop")
        t0 = time.perf_counter()
        observation = await call_in_thread(lambda: env.step(turn), env_plan.step_timeout_s, "step")
        figures["environment_s"] += time.perf_counter() - t0
        problem = check_observation(observation)
        if problem is not None:
            raise EnvironmentInfraError(f"the environment's step returned {problem}")
        figures["tool_calls"] += observation.tool_calls
        figures["tool_errors"] += observation.tool_errors
        reward += float(observation.reward) if observation.reward is not None else 0.0
        if observation.done:
            return reward, "done"
        if index == env_plan.max_turns:
            return reward, "max_turns"
        messages = [*messages, {"role": "assistant", "content": text}, _message(observation)]
    return reward, "max_turns"


def _message(observation: Observation) -> dict:
    return {"role": observation.role, "content": observation.text}
