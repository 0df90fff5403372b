"""Chat messages as token ids, with the chat template's own delimiters and every message's text tokenised as plain
text: the tokens an observation (or an agent's new messages) adds after a policy turn, and a conversation rendered
afresh.

A multi-turn episode's sequence is the prompt, then the policy's sampled tokens and the observations' tokens in turn.
Earlier turns are never tokenised again: re-rendering the conversation and tokenising it would give other tokens than
the policy sampled wherever the template rewrites earlier turns (templates of thinking models drop earlier
``<think>`` blocks), so the trainer would score tokens the policy never produced, with wrong behaviour logprobs.

What to append after a turn is read from one rendering of a fixed conversation, ``[user, assistant]`` + the new
messages + the generation prompt, with plain stand-ins (marks) in place of every text an agent or an environment
supplies (content, ``tool_call_id``, ``name``): the text after the assistant's stand-in is the template's own
delimiters that close the assistant's turn, open each new message, close it and open the next assistant turn, with
the marks where the texts go. Delimiters are tokenised as the template's text (special tokens recognised); each mark
is replaced by its text tokenised as plain text (``split_special_tokens``), spellings of special tokens included, so
a tool's output that prints ``<|im_end|>`` cannot forge a turn boundary. The fixed assistant turn is plain (no
``<think>`` block), so a template that strips earlier ``<think>`` blocks, or renders the last assistant turn after
the last user message differently (Qwen3), delimits the same way: only the text after the assistant's content is
read. The assistant's closing delimiter is the text after its stand-in when it is the last message; when the policy's
turn ended with that delimiter's first token (the end-of-turn token it sampled, e.g. ``<|im_end|>``) that token is
not added again, otherwise (a turn cut at its token cap, ended by a stop string or another EOS) the whole delimiter
closes it.

    observation = ObservationTokens(tokenizer)
    observation.ids("tool", "calculator: 7006652", turn_ids)   # [<|im_end|>?] "\\n" <|im_start|> "tool\\n..." ...
    observation.after_turn(turn_ids, [{"role": "tool", "content": "...", "tool_call_id": "call_1"}, ...])
    observation.render_ids(messages, tools)                   # a conversation afresh (the agent endpoint)

The same substitution renders a whole conversation afresh (:meth:`render_ids`, a first call of an agent, or one
whose history was rewritten): the template sees marks, so it cannot transform a text it is given (a template that
trims a message keeps our untrimmed text; one that strips ``<think>`` from an earlier assistant message keeps it).
The tokens are then exactly what the engine is given and what the trainer scores, which is the invariant that
matters; they may differ from ``apply_chat_template(tokenize=True)`` where the template transforms texts.

Raises :class:`ObservationTokenError` when the template cannot be used this way (it does not render an assistant
message's content as given, adding a message changes the tokens of the earlier ones, or it fails on the messages).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ObservationTokenError", "ObservationTokens"]

#: Stand-ins for the fixed conversation's contents (plain words: one token run that no template rewrites).
USER_MARK, ASSISTANT_MARK, OBSERVATION_MARK = "Q7x", "A7x", "O7x"
#: The message fields whose text is supplied from outside and so tokenised as plain text (``tool_calls`` are the
#: template's to render from their structure).
TEXT_FIELDS = ("content", "tool_call_id", "name")


class ObservationTokenError(ValueError):
    """The chat template cannot delimit an observation by rendering difference (names ``data.chat_template``)."""


def _mark(index: int, text_field: str) -> str:
    """The stand-in of message ``index``'s ``text_field``: letters and digits only, closed by ``q`` so that no mark
    is a prefix of another (``M7x1cq`` / ``M7x10cq``)."""
    return f"{OBSERVATION_MARK}{index}{text_field[0]}q"


def _stand_ins(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict], dict[str, str]]:
    """``messages`` with each non-empty text field replaced by its mark; and mark -> the text it stands for.

    An empty or missing text stays as it is (a template may render an empty content differently from a present
    one, e.g. no newline before an assistant message's tool calls)."""
    out, texts = [], {}
    for i, message in enumerate(messages):
        copy = dict(message)
        for name in TEXT_FIELDS:
            value = copy.get(name)
            if isinstance(value, str) and value:
                texts[_mark(i, name)] = value
                copy[name] = _mark(i, name)
        out.append(copy)
    return out, texts


def _structure_key(messages: Sequence[Mapping[str, Any]]) -> tuple | None:
    """What the delimiters of ``messages`` depend on once their texts are marks (role, which texts are present);
    None when a message carries tool calls (rendered from their values: not cached)."""
    if any(m.get("tool_calls") for m in messages):
        return None
    return tuple((m.get("role"), *(bool(m.get(name)) for name in TEXT_FIELDS)) for m in messages)


class ObservationTokens:
    """Token ids of chat messages as the chat template delimits them (module docstring).

    Args:
        tokenizer: the model's HF tokenizer.
        chat_template: a Jinja template used instead of the tokenizer's (``data.chat_template``), None: its own.

    Raises:
        ObservationTokenError: the template does not render an assistant message's content verbatim.
    """

    def __init__(self, tokenizer, chat_template: str | None = None):
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self._base = [{"role": "user", "content": USER_MARK}, {"role": "assistant", "content": ASSISTANT_MARK}]
        base_text = self._render(self._base, generation_prompt=False)
        end = base_text.rfind(ASSISTANT_MARK)
        if end < 0:
            raise ObservationTokenError(f"data.chat_template: the chat template does not render an assistant "
                                        f"message's content as given (rendered {base_text!r})")
        self._head_text = base_text[:base_text.find(USER_MARK)]
        self._close_text = base_text[end + len(ASSISTANT_MARK):]
        #: the template's tokens that close an assistant turn (e.g. <|im_end|> "\n")
        self.close_ids = self._encode(self._close_text)
        #: structure key -> the delimiters of new messages: token ids and marks in order (:meth:`messages_ids`)
        self._pieces: dict[tuple, list[list[int] | str]] = {}

    def _render(self, messages: list[dict], generation_prompt: bool, tools: Sequence[Mapping] | None = None) -> str:
        extra: dict[str, Any] = {} if self.chat_template is None else {"chat_template": self.chat_template}
        if tools:
            extra["tools"] = list(tools)
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=generation_prompt, **extra)
        except Exception as exc:  # jinja2's TemplateError, or what a template's raise_exception() raises
            detail = " ".join(str(exc).split())[:200]
            raise ObservationTokenError(f"data.chat_template: the chat template failed on the messages "
                                        f"({type(exc).__name__}: {detail})") from None

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _encode_plain(self, text: str) -> list[int]:
        """``text`` as plain text: a special token's spelling in it (``<|im_end|>``) is not that token."""
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def _pieces_of(self, text: str, marks: Sequence[str]) -> list[list[int] | str]:
        """``text`` split at ``marks``: the template's text between them as token ids, each mark as itself."""
        if not marks:
            return [self._encode(text)]
        pattern = "(" + "|".join(re.escape(m) for m in sorted(marks, key=len, reverse=True)) + ")"
        marks = set(marks)
        return [part if part in marks else self._encode(part) for part in re.split(pattern, text) if part]

    def _join(self, pieces: list[list[int] | str], texts: Mapping[str, str]) -> list[int]:
        """Token ids of ``pieces`` with each mark replaced by its text (message index and field from the mark, so
        cached pieces serve other messages of the same structure)."""
        out: list[int] = []
        for piece in pieces:
            out += self._encode_plain(texts[piece]) if isinstance(piece, str) else piece
        return out

    def messages_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The tokens new ``messages`` (OpenAI-style dicts: ``role``, ``content`` text, optional ``tool_call_id``,
        ``name``, ``tool_calls``) add after a closed assistant turn, with the next assistant turn's opening (the
        generation prompt); each text tokenised as plain text.

        Raises:
            ObservationTokenError: adding the messages changes the earlier messages' tokens, or the template fails.
        """
        stand_ins, texts = _stand_ins(messages)
        key = _structure_key(messages)
        pieces = self._pieces.get(key) if key is not None else None
        if pieces is None:
            rendered = self._render([*self._base, *stand_ins], generation_prompt=True)
            roles = ", ".join(repr(m.get("role")) for m in messages)
            if rendered[:rendered.find(USER_MARK)] != self._head_text:
                raise ObservationTokenError(f"data.chat_template: adding a {roles} message changes the tokens of "
                                            f"the messages before it, so an observation cannot be appended to the "
                                            f"tokens sampled so far")
            tail = rendered[rendered.find(ASSISTANT_MARK) + len(ASSISTANT_MARK):]
            if not tail.startswith(self._close_text):
                raise ObservationTokenError(f"data.chat_template: an assistant turn followed by a {roles} message is "
                                            f"closed otherwise ({tail[:40]!r}) than a last one "
                                            f"({self._close_text!r}), so the turn's end is ambiguous")
            pieces = self._pieces_of(tail[len(self._close_text):], [_mark(i, f) for i, m in enumerate(messages)
                                                                     for f in TEXT_FIELDS if m.get(f)])
            if key is not None:
                self._pieces[key] = pieces
        return self._join(pieces, texts)

    def message_ids(self, role: str, text: str) -> list[int]:
        """The tokens a new message ``{role, content: text}`` adds after a closed assistant turn, with the next
        assistant turn's opening (:meth:`messages_ids` of one message).

        Raises:
            ObservationTokenError: adding the message changes the earlier messages' tokens.
        """
        return self.messages_ids([{"role": role, "content": text}])

    def after_turn(self, turn_ids: Sequence[int], messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The tokens appended after a policy turn ``turn_ids`` (its sampled tokens) for new ``messages``: what
        closes the turn (less the end-of-turn token the policy sampled itself), then :meth:`messages_ids`."""
        close = self.close_ids
        sampled_close = bool(close) and bool(turn_ids) and turn_ids[-1] == close[0]
        return (close[1:] if sampled_close else close) + self.messages_ids(messages)

    def ids(self, role: str, text: str, turn_ids: Sequence[int]) -> list[int]:
        """The tokens appended after a policy turn ``turn_ids`` for one observation ``{role, content: text}``."""
        return self.after_turn(turn_ids, [{"role": role, "content": text}])

    def render_ids(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping] | None = None,
                   generation_prompt: bool = True) -> list[int]:
        """A whole conversation's token ids, rendered afresh with ``tools`` (the template's own rendering of them):
        the template's delimiters with every message's texts tokenised as plain text (module docstring).

        Raises:
            ObservationTokenError: the template fails on the messages.
        """
        stand_ins, texts = _stand_ins(messages)
        rendered = self._render(stand_ins, generation_prompt, tools)
        return self._join(self._pieces_of(rendered, list(texts)), texts)
