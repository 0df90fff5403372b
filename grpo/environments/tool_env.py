"""The ``tools`` environment: the policy calls tools with ``<tool_call>{json}</tool_call>`` and reads their output.

    rollout:
      multi_turn:
        environment: tools
        options: {tools: [calculator, python], max_output_chars: 800}
        max_turns: 3
        max_episode_tokens: 512
        step_timeout_s: 90      # > longest_step_s: 4 calls x (20 s sandbox wall time + 1 s)

Each policy turn is searched for tool calls (:mod:`grpo.environments.tool_calls`, the documented default format
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``). A turn without one ends the episode (it is the
answer, scored by the reward functions). Otherwise every call of the turn runs, in order (at most
``max_calls_per_turn``; the rest are refused in one line of the observation), and the observation lists one result
per call::

    calculator: 7006561
    error: unknown tool 'calc'; available: calculator, python

Tools: ``calculator`` (``{"expression": "..."}``, :mod:`grpo.environments.calculator`: arithmetic without ``eval``)
and ``python`` (``{"code": "..."}``, :mod:`sandbox.python_tool`: the sandbox with the ``code`` reward's
limits, or ``options.sandbox``'s). What the policy did wrong — a call that is not JSON, an unknown tool, bad
arguments, a program that raises, an output over ``max_output_chars`` (cut, with a note saying how much was left
out) — is in the observation and counted in ``tool_errors``; the sandbox failing to start raises (an infrastructure
failure: the episode gets no reward). :attr:`ToolEnvironment.longest_step_s` bounds a step by those limits
(``max_calls_per_turn`` programs, each killed after the sandbox's ``wall_time_s``): the spec refuses a
``rollout.multi_turn.step_timeout_s`` that would cut a step the tools still bound, which would turn the policy's slow
program into an infrastructure failure.

The prompt must tell the policy about the tools and the format (the data's system prompt: ``TOOL_PROMPT`` is one). A
small model may also need to see the format used: SmolLM2-135M-Instruct called the calculator in 0-5 % of its first
turns with ``TOOL_PROMPT`` alone and in 70-88 % with two worked exchanges before the question
(``examples/tool_calc_chat_template.jinja``, docs/multi_turn.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grpo.environments.base import Observation, Turn
from grpo.environments.calculator import CalculatorError, calculate
from grpo.environments.tool_calls import CallError, parse_tool_calls
from grpo.registry import load_target

__all__ = ["PYTHON_TOOL", "TOOL_NAMES", "TOOL_PROMPT", "ToolEnvironment", "truncate_output"]

#: The tools this environment knows.
TOOL_NAMES = ("calculator", "python")
#: Where the ``python`` tool is made (the ``sandbox`` package, imported when the tool is first offered: this package
#: never imports process code, docs/architecture.md): called with the ``sandbox`` options.
PYTHON_TOOL = "sandbox.python_tool:python_tool"

#: A system prompt that teaches the format (the calculator alone), for specs and benchmarks.
TOOL_PROMPT = ("You can use a calculator. To use it, write exactly\n"
               '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>\n'
               "and stop; its result comes back in the next message.\n"
               "When you know the answer, write it as the last line in the form '#### <number>'.")


def truncate_output(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, with a note of how many were left out (nothing cut: ``text``)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n[output truncated: {len(text) - limit} more characters]"


class _Calculator:
    """``{"expression": "..."}`` → (ok, result or error)."""

    name = "calculator"

    def __call__(self, arguments: Mapping[str, Any]) -> tuple[bool, str]:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return False, 'calculator: expected {"expression": "<arithmetic>"}'
        try:
            return True, calculate(expression)
        except CalculatorError as exc:
            return False, f"calculator: {exc}"


class ToolEnvironment:
    """Tool calls in, tool outputs out (module docstring).

    Args:
        tools: the tools offered, a subset of :data:`TOOL_NAMES` (at least one).
        max_output_chars: longest output of one call shown, characters; longer ones are cut with a note.
        max_calls_per_turn: calls run per turn; more are refused in the observation.
        role: the chat role of the observations (``"tool"``; ``"user"`` for templates without a tool role).
        sandbox: ``SandboxConfig`` fields replacing the ``code`` reward's defaults for the ``python`` tool.

    Attributes:
        longest_step_s: the longest a step can take by the tools' own limits, seconds: ``max_calls_per_turn`` x
            (the sandbox's ``wall_time_s`` with ``python``, else 0, + 1 s for the start and the calculator).

    Raises:
        ValueError: ``tools`` not a non-empty list of known names, a limit that is not an int >= 1, an empty
            ``role``, or a bad ``sandbox`` (not a mapping, an unknown field, a value ``SandboxConfig`` refuses).
    """

    def __init__(self, tools: Sequence[str] = ("calculator",), max_output_chars: int = 1000,
                 max_calls_per_turn: int = 4, role: str = "tool", sandbox: Mapping[str, Any] | None = None):
        if isinstance(tools, str) or not isinstance(tools, Sequence) or not tools or set(tools) - set(TOOL_NAMES):
            raise ValueError(f"tools: expected a non-empty subset of {list(TOOL_NAMES)} (a list of names), got "
                             f"{tools!r}")
        for name, value in (("max_output_chars", max_output_chars), ("max_calls_per_turn", max_calls_per_turn)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if not isinstance(role, str) or not role:
            raise ValueError(f"role: expected a chat role such as 'tool' or 'user', got {role!r}")
        if sandbox is not None and not isinstance(sandbox, Mapping):
            raise ValueError(f"sandbox: expected a mapping of SandboxConfig fields, got {type(sandbox).__name__}")
        self.max_output_chars, self.max_calls_per_turn, self.role = max_output_chars, max_calls_per_turn, role
        makers: dict[str, Callable[[], Callable]] = {"calculator": _Calculator,
                                                     "python": lambda: load_target(PYTHON_TOOL)(sandbox)}
        self.tools = {name: makers[name]() for name in tools}
        python = self.tools.get("python")
        self.longest_step_s = float(max_calls_per_turn) * (1.0 + (python.config.wall_time_s if python else 0.0))

    def reset(self, row: Mapping[str, Any]) -> None:
        """Nothing to prepare: the tools keep no state between calls."""

    def step(self, turn: Turn) -> Observation:
        """Run the turn's tool calls (none: the episode is done).

        Raises:
            EnvironmentInfraError: the python tool's sandbox could not run.
        """
        calls = parse_tool_calls(turn.text)
        if not calls:
            return Observation(done=True, role=self.role)
        lines, errors = [], 0
        for call in calls[:self.max_calls_per_turn]:
            ok, text = self._run(call)
            errors += not ok
            lines.append(text)
        refused = len(calls) - self.max_calls_per_turn
        if refused > 0:  # one line, however many: the observation stays bounded
            lines.append(f"error: at most {self.max_calls_per_turn} tool calls per turn; the other {refused} "
                         f"were not run")
            errors += refused
        return Observation(text="\n".join(lines), done=False, role=self.role, tool_calls=len(calls),
                           tool_errors=errors)

    def _run(self, call) -> tuple[bool, str]:
        """One call → (ran without error, its line of the observation: the tool's output, cut to
        ``max_output_chars``, or why it did not run)."""
        if isinstance(call, CallError):
            return False, f"error: {call.message}: {call.text}"
        tool = self.tools.get(call.name)
        if tool is None:
            return False, f"error: unknown tool {call.name!r}; available: {', '.join(self.tools)}"
        ok, text = tool(call.arguments)
        text = truncate_output(text, self.max_output_chars)
        return ok, text if not ok else f"{call.name}: {text}"

    def close(self) -> None:
        """Nothing to release (every program runs in a sandbox of its own)."""
