"""The ``math`` reward: LaTeX final answers (``\\boxed{}``, fractions, intervals, sets, radicals) compared with the
reference by math-verify (huggingface/Math-Verify, Apache-2.0; ``pip install 'grpo-cluster[math]'``, math-verify
0.9.0 with latex2sympy2-extended).

Reference: the row's answer column (``data.answer_field``), as a ``(completions, references)`` reward receives it: a
bare answer (``\\frac{1}{2}``, ``[1, 3)``, ``\\{1, 2\\}``, ``72``), an answer in ``$...$``, or a whole worked solution
whose last ``\\boxed{}`` holds the answer (the MATH dataset's ``solution``). A reference without ``$`` or ``\\boxed``
is read as ``$reference$``, so bare LaTeX intervals and sets parse as such.

Completion: its final-answer statements, by the rule of :mod:`grpo.rewards.final_answer` (every answer verifier's):
each ``\\boxed{}``, ``####`` line, ``<answer>`` tag and "the answer is" phrase after the last ``</think>``; without
one, the last sentence holding a digit or a ``$``. Score 1.0 when the completion commits to one final answer
equivalent to the reference: every statement math-verify finds an answer in satisfies ``math_verify.verify(gold,
answer)`` (equal as numbers within 6 decimals, as sympy expressions, or as sets/intervals), at least one does, and no
hedge follows the last one; else 0.0. Unless the reference is itself several values (a set, a tuple, an interval, a
± answer), a statement that offers alternatives ("3 or 4", "3, 4", "\\pm 3", "x = 3, x = 4", "between 3 and 5") or
that math-verify parses as several values is a hedge and scores 0.0; against ``\\{3, 4\\}``, ``\\boxed{3, 4}`` and
``\\boxed{3 \\text{ or } 4}`` are the answer. Several boxes with different values, "\\boxed{3} or \\boxed{4}",
"\\boxed{3}. Or maybe 5." and "the answer is 3 (or maybe 5)" score 0.0 whichever value is right.

Registered in ``grpo.rewards`` by name (imported on first lookup, like the ``code`` rewards): it supervises a process,
so it lives in the ``sandbox`` package, not in the pure ``grpo`` one.

Where it runs: in a worker process (:class:`sandbox.verifier_process.VerifierProcess`) with math-verify's
``signal.alarm`` timeouts off (``sandbox.math_worker``), so it works from any thread; each completion has
``MATH_TIMEOUT_S`` seconds.

What a timeout means: a completion whose parsing or comparison runs past its deadline scores **0.0**, a policy
failure, not an infrastructure one. The reference was parsed when the data was loaded (:func:`check_math_reference`:
every row's reference must parse, in the same worker), so what hangs is the completion's own expression (sympy on
``9^{9^{9^9}}``-like output); scoring it None would leave it out of the loss and never teach the policy to stop
writing it. A worker that dies by itself (killed for memory) gives None (no score) to the completion it was on.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

from sandbox import math_worker
from grpo.rewards.final_answer import (answer_start, hedged_after, last_value_hedged, offers_alternatives,
                                       sentence_around, statements, values)
from grpo.rewards.numbers import numbers_equal
from sandbox.verifier_process import VerifierProcess

__all__ = ["MATH_TIMEOUT_S", "check_math_reference", "final_statements", "math_reward"]

logger = logging.getLogger(__name__)

#: Seconds one completion may take to parse and compare (``GRPO_MATH_TIMEOUT_S`` overrides it).
MATH_TIMEOUT_S = float(os.environ.get("GRPO_MATH_TIMEOUT_S", "10"))
INSTALL_HINT = "pip install 'grpo-cluster[math]' (math-verify==0.9.0)"

_worker: VerifierProcess | None = None
_worker_lock = threading.Lock()


def _verifier() -> VerifierProcess:
    global _worker
    with _worker_lock:
        if _worker is None:
            import importlib.util

            if importlib.util.find_spec("math_verify") is None:
                raise ImportError(f"the math reward needs math-verify, not installed in this interpreter; "
                                  f"{INSTALL_HINT}")
            _worker = VerifierProcess(f"{math_worker.__file__}:verify_item", MATH_TIMEOUT_S)
        return _worker


#: Characters an unmarked final answer (S5 of grpo.rewards.final_answer) may be told by: a digit, or the end of LaTeX.
_VALUE_MARKS = ("0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "$", "\\)", "\\]")


def final_statements(completion: str) -> list[tuple[str, bool]] | None:
    """What the worker verifies for one completion: ``(text, offers_alternatives)`` per distinct final-answer
    statement (:func:`_as_written`), or for an unmarked answer its last sentence holding a digit or a ``$``; [] when
    it puts nothing forward; None when a hedge follows its last statement (C4: scored 0.0 here, no worker call).
    Linear in the completion's length."""
    found = [s for s in statements(completion) if s.text.strip()]
    if not found:
        base = answer_start(completion)
        pos = max(completion.rfind(mark, base) for mark in _VALUE_MARKS)
        if pos < 0:
            return []
        begin, end = sentence_around(completion, pos)
        end = max(end, pos + 1)
        return [(completion[begin:end], last_value_hedged(completion[base:end], arithmetic=True))]
    named = values(found[-1].text)[0]
    if hedged_after(completion, found[-1], lambda v: not any(v == w or numbers_equal(v, w) for w in named)):
        return None
    distinct = dict.fromkeys((s.kind, s.text) for s in found)  # a restated answer is verified once
    return [(_as_written(kind, text), offers_alternatives(text, arithmetic=True)) for kind, text in distinct]


def _as_written(kind: str, text: str) -> str:
    """A statement as math-verify is given it: a box's content boxed again, a phrase's rest behind "The answer is "
    (math-verify then reads the answer right after it, not a number further on: "3, not 4" is 3)."""
    if kind == "boxed":
        return f"\\boxed{{{text}}}"
    return f"The answer is {text}" if kind == "phrase" else text


def math_reward(completions: Sequence[str], references: Sequence[str]) -> list[float | None]:
    """1.0 / 0.0 per completion (module docstring); 0.0 on a timeout; None when the worker died on it.

    Raises:
        ImportError: math-verify is not installed. RuntimeError: the worker process cannot start, or math-verify
            raised (a verifier fault: with ``algorithm.reward_on_error: none`` the batch gets no score).
    """
    if len(completions) != len(references):
        raise ValueError(f"got {len(completions)} completions but {len(references)} references; expected equal")
    plans = [final_statements(c) for c in completions]
    worker = _verifier()  # also when no completion needs it: a missing math-verify is reported the same way
    items = [("verify", r, plan) for plan, r in zip(plans, references) if plan]
    outcomes = iter(worker.map(items) if items else [])
    out: list[float | None] = []
    for i, plan in enumerate(plans):
        if not plan:
            out.append(0.0)  # nothing put forward, or a hedge after the final answer
            continue
        outcome = next(outcomes)
        if outcome.status == "error":
            raise RuntimeError(f"math-verify raised on completion {i}: {outcome.value}")
        if outcome.status == "timeout":
            logger.warning("math reward: completion %d took over %g s to verify; scored 0.0", i, MATH_TIMEOUT_S)
        out.append(float(outcome.value) if outcome.status == "ok" else 0.0 if outcome.status == "timeout" else None)
    return out


def check_math_reference(reference: str) -> None:
    """A row check (``check_row``): math-verify finds an answer in the reference within the deadline.

    Raises:
        ValueError: no answer found, or parsing it timed out or failed.
    """
    (outcome,) = _verifier().map([("parse", reference)])
    if outcome.status == "ok" and outcome.value:
        return
    why = {"ok": "finds no answer in it", "timeout": f"took over {MATH_TIMEOUT_S:g} s to parse it",
           "error": f"raised {outcome.value}", "died": "crashed on it"}[outcome.status]
    shown = reference if len(reference) <= 60 else reference[:57] + "..."
    raise ValueError(f"math-verify {why} (reference {shown!r}); expected a LaTeX or plain answer such as "
                     f"'\\frac{{1}}{{2}}', '[1, 3)' or a solution ending in '\\boxed{{...}}'")


math_reward.check_row = check_math_reference  # what it needs of every data row (grpo.rewards.checks)
math_reward.none_is_failure = True  # it scores every row: its None is the worker's death, never "does not apply"
