"""The task families of the ``code_functions`` source (:mod:`cluster.data.code_functions`): short Python functions
over ints, strings and lists that a small model can sometimes write, each family a template with a parameter.

A family turns one parameter value into one problem (:class:`FunctionTask`): the function's name and arguments, a
one-sentence description of what it returns, and a one-line reference body. Families with a constant in the
description (``add_k``: "returns x plus 7") take the constant as the parameter; families that do one fixed thing
(``string_op``: reverse a string) take (operation, function name) pairs, so that each has several problems. The test
arguments are drawn by :attr:`Family.args` (one call's positional arguments from a ``random.Random``); the expected
values are the reference's results on them (:mod:`cluster.data.code_functions`).

Adding a family costs one :class:`Family` in :data:`FAMILIES`: its parameter values, its task and its arguments.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["FAMILIES", "FAMILY_NAMES", "Family", "FunctionTask"]


@dataclass(frozen=True)
class FunctionTask:
    """One function to write.

    Attributes:
        name: the function's name (the row's ``entry_point``). args: its argument names, in order.
        does: what it returns, the end of the sentence "Write a Python function `name(args)` that ..." (e.g.
            "returns x plus 7").
        body: the reference implementation's body: one ``return`` line, unindented.
    """

    name: str
    args: tuple[str, ...]
    does: str
    body: str

    @property
    def signature(self) -> str:
        """``name(arg, ...)``."""
        return f"{self.name}({', '.join(self.args)})"

    @property
    def solution(self) -> str:
        """The reference solution: ``def`` line and body."""
        return f"def {self.signature}:\n    {self.body}\n"


@dataclass(frozen=True)
class Family:
    """A template of problems (module doc).

    Attributes:
        name: the family's key (``data.code_functions.families`` names it). params: its parameter values, in a fixed
            order (each one problem). task: a parameter value → its :class:`FunctionTask`. args: (parameter value,
            rng) → one call's positional arguments, plain data.
    """

    name: str
    params: tuple
    task: Callable[[Any], FunctionTask]
    args: Callable[[Any, random.Random], list]


def _word(rng: random.Random, lo: int = 2, hi: int = 7, letters: str = "abcdeilmnorst") -> str:
    return "".join(rng.choice(letters) for _ in range(rng.randint(lo, hi)))


def _ints(rng: random.Random, lo: int = 0, hi: int = 9, min_len: int = 1, max_len: int = 6) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(min_len, max_len))]


def _int(rng: random.Random) -> int:
    return rng.randint(-20, 50)


#: (operation, function names, description, body) of the two-number family.
_TWO_NUMBERS = (
    ("sum", ("add", "total", "plus"), "returns the sum of a and b", "return a + b"),
    ("product", ("multiply", "product", "times"), "returns a multiplied by b", "return a * b"),
    ("difference", ("subtract", "minus", "difference"), "returns a minus b", "return a - b"),
    ("larger", ("larger", "bigger", "max_of_two"), "returns the larger of a and b", "return max(a, b)"),
    ("smaller", ("smaller", "lesser", "min_of_two"), "returns the smaller of a and b", "return min(a, b)"),
    ("distance", ("distance", "abs_difference", "gap"), "returns the absolute difference of a and b",
     "return abs(a - b)"),
)
_STRING_OPS = (
    ("reverse", ("reverse", "reverse_string", "backwards"), "returns the string s reversed", "return s[::-1]"),
    ("upper", ("to_upper", "shout", "upper_case"), "returns the string s in upper case", "return s.upper()"),
    ("first", ("first_letter", "first_char", "initial"), "returns the first character of the string s",
     "return s[0]"),
    ("last", ("last_letter", "last_char", "final_char"), "returns the last character of the string s",
     "return s[-1]"),
    ("length", ("length", "string_length", "count_chars"), "returns the number of characters in the string s",
     "return len(s)"),
    ("double", ("double_string", "twice", "echo"), "returns the string s written twice", "return s + s"),
)
_LIST_OPS = (
    ("sum", ("list_sum", "sum_all", "total_of"), "returns the sum of the numbers in the list xs", "return sum(xs)"),
    ("max", ("largest", "list_max", "biggest"), "returns the largest number in the list xs", "return max(xs)"),
    ("min", ("smallest", "list_min", "lowest"), "returns the smallest number in the list xs", "return min(xs)"),
    ("length", ("count_items", "list_length", "size"), "returns the number of items in the list xs",
     "return len(xs)"),
    ("first", ("first_item", "head", "first_element"), "returns the first element of the list xs", "return xs[0]"),
    ("last", ("last_item", "tail_item", "last_element"), "returns the last element of the list xs",
     "return xs[-1]"),
    ("sorted", ("sort_list", "in_order", "ascending"), "returns the list xs sorted in increasing order",
     "return sorted(xs)"),
    ("reversed", ("reverse_list", "flip_list", "backwards_list"), "returns the list xs in reverse order",
     "return xs[::-1]"),
)
_SUFFIXES = ("ing", "ed", "er", "s", "ly", "!", "?", "_x", "123", "abc", "ok", "end")
_LETTERS = tuple("abcdeilmnorst")


def _named(table: tuple) -> tuple:
    """(operation, name) pairs of an operations table: every name of every operation."""
    return tuple((op, name) for op, names, _, _ in table for name in names)


def _from_table(table: tuple, args: tuple[str, ...]) -> Callable[[Any], FunctionTask]:
    rows = {op: (does, body) for op, _, does, body in table}

    def task(param) -> FunctionTask:
        op, name = param
        does, body = rows[op]
        return FunctionTask(name, args, does, body)

    return task


def _word_with(letter: str, rng: random.Random) -> str:
    """A word that holds ``letter`` about half the time."""
    word = _word(rng)
    if rng.random() < 0.5:
        at = rng.randrange(len(word) + 1)
        word = word[:at] + letter + word[at:]
    return word


FAMILIES: tuple[Family, ...] = (
    Family("add_k", tuple(range(2, 41)), lambda k: FunctionTask("add_number", ("x",), f"returns x plus {k}",
                                                                  f"return x + {k}"),
           lambda k, rng: [_int(rng)]),
    Family("subtract_k", tuple(range(2, 41)), lambda k: FunctionTask("subtract_number", ("x",),
                                                                       f"returns x minus {k}", f"return x - {k}"),
           lambda k, rng: [_int(rng)]),
    Family("multiply_k", tuple(range(2, 16)), lambda k: FunctionTask("multiply_by", ("x",),
                                                                       f"returns x multiplied by {k}",
                                                                       f"return x * {k}"),
           lambda k, rng: [_int(rng)]),
    Family("power_k", (2, 3, 4, 5), lambda k: FunctionTask("power", ("x",), f"returns x to the power of {k}",
                                                           f"return x ** {k}"),
           lambda k, rng: [rng.randint(-6, 9)]),
    Family("is_multiple_k", tuple(range(2, 13)), lambda k: FunctionTask(
        "is_multiple", ("x",), f"returns True if x is divisible by {k}, otherwise False", f"return x % {k} == 0"),
        lambda k, rng: [rng.randint(0, 12) * k if rng.random() < 0.5 else rng.randint(0, 100)]),
    Family("greater_k", tuple(range(-5, 31)), lambda k: FunctionTask(
        "is_greater", ("x",), f"returns True if x is greater than {k}, otherwise False", f"return x > {k}"),
        lambda k, rng: [k + rng.randint(-2, 2) if rng.random() < 0.5 else k + rng.randint(-10, 10)]),
    Family("two_numbers", _named(_TWO_NUMBERS), _from_table(_TWO_NUMBERS, ("a", "b")),
           lambda p, rng: [_int(rng), _int(rng)]),
    Family("string_op", _named(_STRING_OPS), _from_table(_STRING_OPS, ("s",)), lambda p, rng: [_word(rng)]),
    Family("count_letter", _LETTERS, lambda c: FunctionTask(
        "count_letter", ("s",), f"returns how many times the letter '{c}' appears in the string s",
        f"return s.count('{c}')"),
        lambda c, rng: [_word_with(c, rng)]),
    Family("add_suffix", _SUFFIXES, lambda suffix: FunctionTask(
        "add_suffix", ("s",), f"returns the string s followed by '{suffix}'", f"return s + '{suffix}'"),
        lambda suffix, rng: [_word(rng)]),
    Family("repeat_k", tuple(range(2, 7)), lambda k: FunctionTask(
        "repeat", ("s",), f"returns the string s repeated {k} times", f"return s * {k}"),
        lambda k, rng: [_word(rng, 1, 4)]),
    Family("list_op", _named(_LIST_OPS), _from_table(_LIST_OPS, ("xs",)), lambda p, rng: [_ints(rng, 0, 20)]),
    Family("count_value", tuple(range(0, 10)), lambda k: FunctionTask(
        "count_value", ("xs",), f"returns how many times the number {k} appears in the list xs",
        f"return xs.count({k})"),
        lambda k, rng: [_ints(rng, 0, 9, 2, 8)]),
    Family("add_to_each", tuple(range(1, 21)), lambda k: FunctionTask(
        "add_to_each", ("xs",), f"returns a new list with {k} added to every number of the list xs",
        f"return [x + {k} for x in xs]"),
        lambda k, rng: [_ints(rng, 0, 20, 1, 5)]),
    Family("contains_k", tuple(range(0, 10)), lambda k: FunctionTask(
        "contains", ("xs",), f"returns True if the number {k} is in the list xs, otherwise False",
        f"return {k} in xs"),
        lambda k, rng: [_ints(rng, 0, 9, 1, 5)]),
)

#: The families' names, in :data:`FAMILIES` order (``data.code_functions.families`` is checked against them).
FAMILY_NAMES: tuple[str, ...] = tuple(f.name for f in FAMILIES)
