"""The program in a completion, for the ``code`` rewards (``sandbox.code_reward``).

The program is the completion's last fenced block tagged ``python``/``py``/``python3`` (an unclosed last fence runs
to the end of the completion: a truncated answer), else its last closed untagged fenced block, else the whole
completion. For a row with an ``entry_point``, the last such block that defines it comes first: a usage example
written after the function is not the program.

Function-completion rows (HumanEval, APPS/LiveCodeBench call-based problems) may also carry ``starter_code`` (the
code the prompt shows: imports, helpers, the function's signature and docstring) and ``entry_point`` (the function's
name). Then the program run is the starter code followed by the extracted program (:func:`assemble_program`): when
the extracted program defines ``entry_point`` at top level (``def``/``async def``/an assignment), it is appended
after the starter code (its definition replaces the stub, and the starter code's imports and helpers stay
available); otherwise it is taken as the function's body and appended directly, continuing the signature. Rows
without ``starter_code`` run the extracted program alone.
"""

from __future__ import annotations

import re

__all__ = ["assemble_program", "defines_name", "extract_program"]

_FENCE = re.compile(r"^[ \t]*```[ \t]*([A-Za-z0-9_+-]*)[ \t]*$", re.MULTILINE)
_PYTHON_TAGS = {"python", "py", "python3"}


def extract_program(completion: str, entry_point: str | None = None) -> str:
    """The Python program in a completion (rules in the module doc). Fences pair up in order (an opening line
    "```tag", then a closing line "```"), as in Markdown. With ``entry_point``, the last block (tagged first, then
    untagged) that defines it is preferred, so a usage example written after the function is not taken for it.
    Never raises for a str."""
    fences = list(_FENCE.finditer(completion))
    tagged: list[str] = []
    untagged: list[str] = []
    for i in range(0, len(fences), 2):
        opening = fences[i]
        closing = fences[i + 1] if i + 1 < len(fences) else None
        body = completion[opening.end():closing.start() if closing else len(completion)].removeprefix("\n")
        tag = opening.group(1).lower()
        if tag in _PYTHON_TAGS:
            tagged.append(body)
        elif not tag and closing is not None:
            untagged.append(body)
    if entry_point:
        defining = [b for b in tagged if defines_name(b, entry_point)] or [
            b for b in untagged if defines_name(b, entry_point)]
        if defining:
            return defining[-1]
    if tagged:
        return tagged[-1]
    return untagged[-1] if untagged else completion


def defines_name(program: str, name: str) -> bool:
    """Whether ``program`` binds ``name`` at top level: a line starting ``def name(``, ``async def name(`` or
    ``name =`` in column 0 (a textual check: it does not parse the program, which may be truncated)."""
    pattern = rf"^(?:(?:async[ \t]+)?def[ \t]+{re.escape(name)}[ \t]*\(|{re.escape(name)}[ \t]*=[^=])"
    return re.search(pattern, program, re.MULTILINE) is not None


def assemble_program(program: str, entry_point: str | None = None, starter_code: str | None = None) -> str:
    """The program a function-completion row runs (module doc): ``starter_code`` then ``program``, separated by blank
    lines when ``program`` defines ``entry_point``, joined directly (a body continuing the signature) when it does
    not; ``program`` unchanged when ``starter_code`` is None or empty."""
    if not starter_code:
        return program
    if entry_point and defines_name(program, entry_point):
        return starter_code.rstrip("\n") + "\n\n\n" + program
    return starter_code if not program.strip() else (
        starter_code + ("" if starter_code.endswith("\n") else "\n") + program)
