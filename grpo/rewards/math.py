"""The ``math`` reward: LaTeX final answers (``\\boxed{}``, fractions, intervals, sets, radicals) compared with the
reference by math-verify (huggingface/Math-Verify, Apache-2.0; ``pip install 'grpo-cluster[math]'``, math-verify
0.9.0 with latex2sympy2-extended).

Reference: the row's answer column (``data.answer_field``), as a ``(completions, references)`` reward receives it: a
bare answer (``\\frac{1}{2}``, ``[1, 3)``, ``\\{1, 2\\}``, ``72``), an answer in ``$...$``, or a whole worked solution
whose last ``\\boxed{}`` holds the answer (the MATH dataset's ``solution``). A reference without ``$`` or ``\\boxed``
is read as ``$reference$``, so bare LaTeX intervals and sets parse as such. Completion: math-verify's extraction (the
last ``\\boxed{}``, else LaTeX, else a plain expression). Score 1.0 when ``math_verify.verify(gold, answer)`` holds
(equal as numbers within 6 decimals, as sympy expressions, or as sets/intervals), else 0.0.

Where it runs: in a worker process (:class:`grpo.rewards.verifier_process.VerifierProcess`) with math-verify's
``signal.alarm`` timeouts off (``grpo.rewards.math_worker``), so it works from any thread; each completion has
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

from grpo.rewards import math_worker
from grpo.rewards.verifier_process import VerifierProcess

__all__ = ["MATH_TIMEOUT_S", "check_math_reference", "math_reward"]

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


def math_reward(completions: Sequence[str], references: Sequence[str]) -> list[float | None]:
    """1.0 / 0.0 per completion (module docstring); 0.0 on a timeout; None when the worker died on it.

    Raises:
        ImportError: math-verify is not installed. RuntimeError: the worker process cannot start, or math-verify
            raised (a verifier fault: with ``algorithm.reward_on_error: none`` the batch gets no score).
    """
    if len(completions) != len(references):
        raise ValueError(f"got {len(completions)} completions but {len(references)} references; expected equal")
    outcomes = _verifier().map([("verify", r, c) for c, r in zip(completions, references)])
    out: list[float | None] = []
    for i, outcome in enumerate(outcomes):
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
