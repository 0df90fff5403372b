"""The ``math`` reward's work inside its verifier process (``sandbox.math_reward``): math-verify parsing and comparison
with math-verify's own ``signal.alarm`` timeouts off (the calling process bounds the time).

Loaded by path in a fresh interpreter (``sandbox.verifier_process``), so it imports only the standard library and
math-verify: no package of this project, no torch.
"""

from __future__ import annotations

import logging

__all__ = ["gold_text", "verify_item"]


def gold_text(reference: str) -> str:
    """The text math-verify parses for a reference: as is when it holds ``$`` or ``\\boxed``, else ``$reference$``
    (so a bare ``[1, 3)`` or ``\\{1, 2\\}`` parses as an interval or a set, not as its last number)."""
    return reference if "$" in reference or "\\boxed" in reference else f"${reference}$"


def _several(parsed: list) -> bool:
    """Whether math-verify's parse is several values: a set of more than one element, a tuple, an interval, a union
    of intervals, or a matrix of more than one entry ("3, 4", "\\pm 3", "x = 3 \\text{ or } x = 4", "[1, 3)")."""
    from sympy import FiniteSet, Interval, Tuple, Union
    from sympy.matrices import MatrixBase

    return any(isinstance(v, (Interval, Union, Tuple)) or (isinstance(v, FiniteSet) and len(v) > 1)
               or (isinstance(v, MatrixBase) and len(v) > 1) for v in parsed)


def verify_item(item: tuple) -> object:
    """``("verify", reference, statements)`` → 1.0 when the completion's final-answer statements, each
    ``(text, offers_alternatives)`` (``sandbox.math_reward`` finds them), all verify against the reference, else 0.0;
    ``("parse", reference)`` → the string forms of the reference's parsed answers (empty when it has none). The
    reference is parsed as :func:`gold_text`, else as written.

    A statement math-verify finds nothing in names nothing and is skipped; at least one must name something. Unless
    the reference is itself several values (:func:`_several`), a statement that offers alternatives, or that parses
    as several values, is a hedge: 0.0. Each other statement must satisfy ``math_verify.verify(gold, answer)``."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    from math_verify import parse, verify

    gold = parse(gold_text(item[1]), parsing_timeout=None) or parse(item[1], parsing_timeout=None)
    if item[0] == "parse":
        return [str(g) for g in gold]
    if not gold:
        return 0.0
    several = _several(gold)
    named = False
    for text, alternatives in item[2]:
        answer = parse(text, parsing_timeout=None)
        if not answer:
            continue
        if not several and (alternatives or _several(answer)):
            return 0.0
        if not verify(gold, answer, timeout_seconds=None):
            return 0.0
        named = True
    return 1.0 if named else 0.0
