"""Command-line argument types and the parser class of ``grpo-cluster``: flags are named as the user typed them.

- :class:`Parser`: argparse's parser whose errors read ``grpo-cluster eval: --limit: expected a whole number >= 1,
  got 0`` (the usage line first, exit code 2), not ``argument --limit: invalid int value``.
- :func:`whole_number` and :func:`seconds`: argparse ``type=`` callables that refuse what the command cannot use
  (``--limit 0``, ``--max-tokens -5``, ``--timeout-s nan``) before anything is loaded.

Imports only the standard library.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

__all__ = ["Parser", "seconds", "whole_number"]


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with one-line errors that name the flag as typed (``--limit: ...``)."""

    def error(self, message: str):
        """Print the usage and ``<prog>: <message>`` on stderr and exit 2 (argparse's own exit code for bad input)."""
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: {message.removeprefix('argument ')}\n")


def whole_number(minimum: int) -> Callable[[str], int]:
    """A ``type=`` for a flag that takes a whole number >= ``minimum`` (``--limit``, ``--rollout-replicas``).

    The returned callable raises ``argparse.ArgumentTypeError`` (shown as ``--flag: expected a whole number >= 1,
    got 0``) for anything else: ``0``, ``-3``, ``2.5``, ``abc``.
    """
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text}")
        return value

    parse.__name__ = "whole number"
    return parse


def seconds(minimum: float = 0.0) -> Callable[[str], float]:
    """A ``type=`` for a duration in seconds, a finite number >= ``minimum`` (``--timeout-s``, ``--wait-s``).

    The returned callable raises ``argparse.ArgumentTypeError`` for anything else (``-1``, ``nan``, ``inf``, ``abc``).
    """
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < minimum:
            raise argparse.ArgumentTypeError(f"expected a number of seconds >= {minimum:g}, got {text}")
        return value

    parse.__name__ = "seconds"
    return parse
