"""The ``math`` reward's work inside its verifier process (``grpo.rewards.math``): math-verify parsing and comparison
with math-verify's own ``signal.alarm`` timeouts off (the calling process bounds the time).

Loaded by path in a fresh interpreter (``grpo.rewards.verifier_process``), so it imports only the standard library and
math-verify: no package of this project, no torch.
"""

from __future__ import annotations

import logging

__all__ = ["gold_text", "verify_item"]


def gold_text(reference: str) -> str:
    """The text math-verify parses for a reference: as is when it holds ``$`` or ``\\boxed``, else ``$reference$``
    (so a bare ``[1, 3)`` or ``\\{1, 2\\}`` parses as an interval or a set, not as its last number)."""
    return reference if "$" in reference or "\\boxed" in reference else f"${reference}$"


def verify_item(item: tuple) -> object:
    """``("verify", reference, completion)`` → 1.0 when ``math_verify.verify(gold, answer)`` holds, else 0.0 (also
    when either has no answer); ``("parse", reference)`` → the string forms of the reference's parsed answers (empty
    when it has none). The reference is parsed as :func:`gold_text`, else as written."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    from math_verify import parse, verify

    gold = parse(gold_text(item[1]), parsing_timeout=None) or parse(item[1], parsing_timeout=None)
    if item[0] == "parse":
        return [str(g) for g in gold]
    answer = parse(item[2], parsing_timeout=None)
    return 1.0 if gold and answer and verify(gold, answer, timeout_seconds=None) else 0.0
