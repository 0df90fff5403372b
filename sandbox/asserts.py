"""Assert-style test code turned into call cases (``sandbox.cases``), so that the ``code`` reward can judge it outside
the program's process. Used for HumanEval (``cluster.data.humaneval``), whose tests are a ``check(candidate)``
function of asserts.

How (:func:`calls_from_check`): the test code is parsed (``ast``) and each assert of ``check`` that has one of the
shapes below is replaced by a call that records a call case; then the test code runs, in this process, after the
problem's starter code (helpers such as HumanEval's ``encode_cyclic``), with ``random`` seeded, so that its loops,
local variables and random inputs become fixed cases. ``C`` is a call of the candidate (``check``'s parameter, or
the entry point by name) whose arguments do not mention it; ``E`` and ``T`` do not mention it either::

    C == E   or  E == C                          check eq
    F(C) == E  or  E == F(C), F in tuple, list, sorted, set    check eq, apply F
    C is True / False / None                     check is
    abs(C - E) < T  or  abs(E - C) < T           check close, tolerance T   (math.fabs too)
    C   /   not C                                check truthy / falsy

The test code is the dataset's, never a completion: it runs here as the dataset's own harness would run it, with
the starter code's stub in the candidate's place never called. Not convertible (:func:`calls_from_check` returns
the reason): the candidate mentioned anywhere else (its result kept in a variable, passed to a helper as in
HumanEval/32's ``poly(coeffs, candidate(...))``), an expected value that mentions it (HumanEval/33 compares the
candidate with itself), values that are not plain data, a ``check`` that records nothing, or test code that raises
when run this way.
"""

from __future__ import annotations

import ast
import copy
import random
from typing import Any

from sandbox.cases import parse_tests

__all__ = ["calls_from_check"]

_RECORD = "__grpo_record_call__"
_APPLY = {"tuple", "list", "sorted", "set"}


def _call_of(node: ast.AST, names: set[str]) -> ast.Call | None:
    """``node`` when it is ``candidate(args)`` with arguments that do not mention the candidate, else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names):
        return None
    parts = [*node.args, *(k.value for k in node.keywords)]
    if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        return None
    return None if any(_mentions(p, names) for p in parts) else node


def _mentions(node: ast.AST, names: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))


def _applied(node: ast.AST, names: set[str]) -> tuple[ast.Call, str | None] | None:
    """(the candidate call, the function applied to its result or None) for ``C`` or ``F(C)``."""
    call = _call_of(node, names)
    if call is not None:
        return call, None
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _APPLY
            and len(node.args) == 1 and not node.keywords):
        call = _call_of(node.args[0], names)
        if call is not None:
            return call, node.func.id
    return None


def _close(test: ast.Compare, names: set[str]) -> tuple[ast.Call, ast.AST, ast.AST] | None:
    """(call, expected, tolerance) for ``abs(C - E) < T`` / ``abs(E - C) < T`` (``math.fabs`` too)."""
    left = test.left
    is_abs = isinstance(left, ast.Call) and len(left.args) == 1 and not left.keywords and (
        (isinstance(left.func, ast.Name) and left.func.id == "abs")
        or (isinstance(left.func, ast.Attribute) and left.func.attr == "fabs"
            and isinstance(left.func.value, ast.Name) and left.func.value.id == "math"))
    if not (is_abs and isinstance(test.ops[0], ast.Lt) and isinstance(left.args[0], ast.BinOp)
            and isinstance(left.args[0].op, ast.Sub)):
        return None
    a, b = left.args[0].left, left.args[0].right
    for call_side, other in ((a, b), (b, a)):
        call = _call_of(call_side, names)
        if call is not None and not _mentions(other, names) and not _mentions(test.comparators[0], names):
            return call, other, test.comparators[0]
    return None


def _shape(test: ast.AST, names: set[str]) -> tuple[str, str | None, ast.Call, ast.AST | None, ast.AST | None] | None:
    """(check, apply, call, expected, tolerance) of an assert's test, or None when it has no shape of the doc."""
    if (call := _call_of(test, names)) is not None:
        return "truthy", None, call, None, None
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and (call := _call_of(test.operand, names)):
        return "falsy", None, call, None, None
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return None
    left, op, right = test.left, test.ops[0], test.comparators[0]
    singleton = isinstance(right, ast.Constant) and any(right.value is v for v in (True, False, None))
    if isinstance(op, ast.Is) and singleton:
        call = _call_of(left, names)
        return ("is", None, call, right, None) if call is not None else None
    if isinstance(op, ast.Eq):
        for side, other in ((left, right), (right, left)):
            found = _applied(side, names)
            if found is not None and not _mentions(other, names):
                return "eq", found[1], found[0], other, None
        return None
    close = _close(test, names)
    return ("close", None, *close) if close is not None else None


class _Recorder(ast.NodeTransformer):
    """Replace each assert of a known shape with a call of the recorder (module doc)."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        shape = self._shape(node.test)
        if shape is None:
            return node
        check, apply, call, expected, tolerance = shape
        kwargs = ast.Dict(keys=[ast.Constant(k.arg) for k in call.keywords], values=[k.value for k in call.keywords])
        record = ast.Call(ast.Name(_RECORD, ast.Load()), [
            ast.Constant(check), ast.Constant(apply), ast.Tuple(list(call.args), ast.Load()), kwargs,
            expected if expected is not None else ast.Constant(None),
            tolerance if tolerance is not None else ast.Constant(None)], [])
        return ast.copy_location(ast.Expr(record), node)

    def _shape(self, test: ast.AST):
        return _shape(test, self.names)


def calls_from_check(test_code: str, entry_point: str, starter_code: str = "", seed: int = 0
                     ) -> list[dict] | str:
    """The call cases of a ``check(candidate)`` test (module doc), or why it is not convertible.

    Args:
        test_code: code that defines ``check(candidate)`` (HumanEval's ``test`` field), without the call of it.
        entry_point: the function under test; the test code may also name it directly.
        starter_code: what the problem gives the program (its helpers), run first.
        seed: ``random.seed`` for the run (the state of ``random`` is restored afterwards).

    Returns:
        Call cases as ``sandbox.cases`` reads them (``{"args": [...], "expected": ..., "check": ...}``), in the
        order the test makes them; or a str: why the test cannot be expressed so.
    """
    tree = ast.parse(test_code)
    check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is None or len(check.args.args) != 1:
        return "no function check(candidate) in the test code"
    names = {check.args.args[0].arg, entry_point}
    check.body = [_Recorder(names).visit(statement) for statement in check.body]
    for statement in check.body:
        if _mentions(statement, names):
            return f"line {statement.lineno} uses the candidate in no recordable assert: {ast.unparse(statement)[:120]}"
    cases: list[dict] = []

    def record(kind: str, apply: str | None, args: tuple, kwargs: dict, expected: Any, tolerance: Any) -> None:
        case = {"args": copy.deepcopy(list(args)), "check": kind}
        case.update({"kwargs": copy.deepcopy(kwargs)} if kwargs else {})
        case.update({"expected": copy.deepcopy(expected)} if kind not in ("truthy", "falsy") else {})
        case.update({"tolerance": tolerance} if kind == "close" else {})
        case.update({"apply": apply} if apply else {})
        cases.append(case)

    namespace: dict[str, Any] = {"__name__": "__test__"}
    state = random.getstate()
    try:
        random.seed(seed)
        exec(compile(starter_code, "<starter code>", "exec"), namespace)
        namespace[_RECORD] = record
        exec(compile(ast.fix_missing_locations(tree), "<test code>", "exec"), namespace)
        namespace["check"](namespace.get(entry_point))
    except Exception as exc:  # noqa: BLE001 - the dataset's test code failing this way: not convertible
        return f"the test code raised {type(exc).__name__}: {exc}"
    finally:
        random.setstate(state)
    if not cases:
        return "check() records no call"
    try:
        parse_tests(cases, entry_point=entry_point)
    except ValueError as exc:
        return str(exc)
    return cases
