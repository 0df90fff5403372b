"""The calculator tool: safe evaluation of an arithmetic expression, without ``eval``.

    calculate("(1234 * 5678) - 91")   # "7006561"
    calculate("7 / 2")                 # "3.5"
    calculate("2 ** 10")               # "1024"

The expression is parsed by :func:`ast.parse` in ``eval`` mode and walked by hand: only numbers (ints and floats,
not booleans), parentheses, unary ``+``/``-`` and the binary operators ``+ - * / // % **`` are accepted; names,
calls, attributes, subscripts, comparisons and everything else are refused by name. ``×``/``÷`` are read as ``*``/``/``.
Limits keep one call cheap: at most :data:`MAX_EXPRESSION_CHARS` characters, exponents up to :data:`MAX_EXPONENT` in
magnitude, integer results up to :data:`MAX_RESULT_DIGITS` digits, finite floats only.

Every refusal is a :class:`CalculatorError` whose message the tool environment shows the policy (an observation: the
call was the policy's mistake, not an infrastructure failure).
"""

from __future__ import annotations

import ast
import math
import operator

__all__ = ["MAX_EXPONENT", "MAX_EXPRESSION_CHARS", "MAX_RESULT_DIGITS", "CalculatorError", "calculate",
           "format_number"]

#: Longest expression accepted, characters.
MAX_EXPRESSION_CHARS = 500
#: Largest |exponent| of ``**``.
MAX_EXPONENT = 256
#: Largest integer result, decimal digits.
MAX_RESULT_DIGITS = 200

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_HINTS = {ast.BitXor: "'^' is not a power here: write ** (2 ** 3)", ast.Name: "names are not allowed",
          ast.Call: "function calls are not allowed", ast.Compare: "comparisons are not allowed"}


class CalculatorError(ValueError):
    """The expression cannot be evaluated (not arithmetic, too long, too large, division by zero)."""


def format_number(value: int | float) -> str:
    """An int as its digits; a float with an integral value below 1e15 as an int (``6.0`` → ``"6"``); other floats
    with 12 significant digits (``%.12g``)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.12g}"
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    """The value of one node of an arithmetic expression (module docstring); CalculatorError for anything else."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, got {node.value!r}")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {format_number(right)} is too large (at most {MAX_EXPONENT})")
        if isinstance(node.op, ast.Pow) and left == 0 and right < 0:
            raise CalculatorError("division by zero (0 to a negative power)")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
        return _checked(value)
    op = getattr(node, "op", None)
    hint = _HINTS.get(type(op) if op is not None else type(node))
    what = type(op).__name__ if op is not None else type(node).__name__
    raise CalculatorError(f"unsupported {what}" + (f": {hint}" if hint else "") + "; use numbers, ( ), + - * / // "
                          "% **")


def _checked(value) -> int | float:
    """``value`` if it is a finite float or an int of at most :data:`MAX_RESULT_DIGITS` digits."""
    if isinstance(value, complex):
        raise CalculatorError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not finite")
    if isinstance(value, int) and value.bit_length() > MAX_RESULT_DIGITS * 3.33:
        raise CalculatorError(f"the result has more than {MAX_RESULT_DIGITS} digits")
    return value


def calculate(expression: str) -> str:
    """Evaluate an arithmetic ``expression``; returns the result as text (:func:`format_number`).

    Raises:
        CalculatorError: not a string, empty, too long, not arithmetic (also: not encodable text), or a result out
            of the limits.
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"expected the expression as a string, got {type(expression).__name__}")
    text = expression.replace("×", "*").replace("÷", "/").strip()
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression of {len(text)} characters; at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(text, mode="eval")
        return format_number(_evaluate(tree))
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {exc.msg}") from None
    except ValueError as exc:  # e.g. a lone surrogate, which cannot be encoded for the parser
        raise CalculatorError(f"not an arithmetic expression: {type(exc).__name__}: {exc}") from None
    except (RecursionError, MemoryError):
        raise CalculatorError("the expression is nested too deeply") from None
