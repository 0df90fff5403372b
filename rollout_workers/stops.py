"""Stop strings (``rollout.stop``) with the vLLM engine's semantics, for engines that check them themselves (the
transformers engine, ``rollout_workers.hf``).

What vLLM does (``vllm.v1.engine.detokenizer``, with ``include_stop_str_in_output=True``), and so what every engine
does: after each sampled token the completion's text (decoded, special tokens skipped) is searched for the stop
strings in the characters that token added (a stop string may begin in earlier text); when one is found the
completion ends with finish reason ``"stop"``. The token that completed the stop string is the last one kept, all of
it, even when the stop string ends inside its text: the sampled tokens are never cut (the trainer trains exactly
them), only the text is cut at the stop string's end. When several stop strings complete in the same token, the one
that ends first in the text wins, ties by their order in the list. A stop string completing in the token that also
reaches the length cap makes the finish reason ``"stop"``; an EOS token (no text) ends the completion by itself.

A completion continued after an interruption (partial rollouts, a request paused by a weight sync) is a new engine
request whose prompt ends with the tokens it already has: its scanner is given those tokens (``prefix``), so that a
stop string begun before the interruption and completed after it is matched too (vLLM's own check sees only the
continued request's text; the engines run this scanner over continued requests as well).

Notation: R tokens of a completion.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["StopScanner", "find_stop"]


def find_stop(text: str, new_chars: int, stops: Sequence[str]) -> tuple[str, int] | None:
    """The stop string completed within the last ``new_chars`` characters of ``text`` and the index just after it,
    or None. The earliest end wins, ties by list order (vLLM's ``check_stop_strings``)."""
    if new_chars <= 0 or not stops:
        return None
    best: tuple[str, int] | None = None
    for stop in stops:
        index = text.find(stop, max(0, len(text) + 1 - new_chars - len(stop)))
        if index != -1 and (best is None or index + len(stop) < best[1]):
            best = (stop, index + len(stop))
    return best


#: Tokens of a continued completion's earlier tokens that its scanner decodes with the new ones (a stop string is at
#: most :data:`cluster.spec.rollout.MAX_STOP_CHARS` characters; a token holds at least one, a byte piece aside).
PREFIX_WINDOW_SLACK = 8


class StopScanner:
    """One completion's text and stop-string check, token by token.

    Args:
        stops: the stop strings (none: :meth:`add` never stops).
        decode: token ids → text, special tokens skipped (the engine's tokenizer).
        prefix: the completion's tokens from before an interruption (searched together with the new ones; only the
            last few are decoded: a stop string's length in tokens, and some slack).

    Attributes:
        ids: the new tokens seen. text: their text, cut at the stop string's end once one matched. stop_reason: the
            stop string matched, else None.
    """

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str], prefix: Sequence[int] = ()):
        self.stops, self.decode = tuple(stops), decode
        window = max((len(s) for s in self.stops), default=0) + PREFIX_WINDOW_SLACK
        self.prefix = list(prefix)[-window:] if self.stops else []
        self._prefix_text = decode(self.prefix) if self.prefix else ""
        self.ids: list[int] = []
        self.text = ""
        self._searched = len(self._prefix_text)
        self.stop_reason: str | None = None

    def add(self, token_id: int) -> bool:
        """Take one sampled token; True when it completed a stop string (the completion ends with it).

        A text ending in U+FFFD (a multi-byte character not complete yet) is not searched until the character is
        complete, as vLLM's incremental detokenizer holds such bytes back."""
        self.ids.append(int(token_id))
        if not self.stops or self.stop_reason is not None:
            return False
        full = self.decode(self.prefix + self.ids)
        if full.endswith("\ufffd"):
            return False
        found = find_stop(full, len(full) - self._searched, self.stops)
        self._searched = len(full)
        start = len(self._prefix_text) if full.startswith(self._prefix_text) else 0
        if found is None:
            self.text = full[start:]
            return False
        self.stop_reason, end = found
        self.text = full[start:max(start, end)]
        return True
