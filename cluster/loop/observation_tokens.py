"""An environment's observation as token ids, tokenised once, with the chat template's turn delimiters.

A multi-turn episode's sequence is the prompt, then the policy's sampled tokens and the observations' tokens in turn.
Earlier turns are never tokenised again: re-rendering the conversation and tokenising it would give other tokens than
the policy sampled wherever the template rewrites earlier turns (templates of thinking models drop earlier
``<think>`` blocks), so the trainer would score tokens the policy never produced, with wrong behaviour logprobs.

What to append after a turn is the token difference of two renderings of a fixed conversation, with and without the
new message (``[user, assistant]`` against ``[user, assistant, observation]`` + the generation prompt; the new
message's content a stand-in, the observation's text tokenised as plain text in its place, spellings of special
tokens included, so a tool's output cannot forge a turn boundary): the template's own delimiters that close the
assistant's turn, open the observation's, close it and open the next assistant turn. The assistant's closing
delimiter is taken from the same rendering: the tokens after the assistant content; when the policy's turn ended
with its first token (the end-of-turn token it sampled, e.g. ``<|im_end|>``) that token is not added again,
otherwise (a turn cut at its token cap, or ended by another EOS) the whole delimiter closes it.

    observation = ObservationTokens(tokenizer)
    observation.ids("tool", "calculator: 7006652", turn_ids)   # [<|im_end|>?] "\\n" <|im_start|> "tool\\n..." ...

Raises :class:`ObservationTokenError` when the template cannot be used this way (it does not render an assistant
message's content as given, or adding a message changes the tokens of the earlier ones).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ObservationTokenError", "ObservationTokens"]

#: Stand-ins for the fixed conversation's contents (plain words: one token run that no template rewrites).
USER_MARK, ASSISTANT_MARK, OBSERVATION_MARK = "Q7x", "A7x", "O7x"


class ObservationTokenError(ValueError):
    """The chat template cannot delimit an observation by rendering difference (names ``data.chat_template``)."""


class ObservationTokens:
    """Token ids of observations as the chat template delimits them (module docstring).

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
        self._base_ids = self._encode(base_text)
        head = self._encode(base_text[:end + len(ASSISTANT_MARK)])
        if self._base_ids[:len(head)] != head:
            raise ObservationTokenError("data.chat_template: the tokens of an assistant message's content run into "
                                        "the template's end-of-turn delimiter")
        #: the template's tokens that close an assistant turn (e.g. <|im_end|> "\n")
        self.close_ids = self._base_ids[len(head):]
        #: per role: the template's tokens before and after an observation's content (:meth:`message_ids`)
        self._delimiters: dict[str, tuple[list[int], list[int]]] = {}

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        extra = {} if self.chat_template is None else {"chat_template": self.chat_template}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **extra)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _encode_plain(self, text: str) -> list[int]:
        """``text`` as plain text: a special token's spelling in it (``<|im_end|>``) is not that token."""
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def message_ids(self, role: str, text: str) -> list[int]:
        """The tokens a new message ``{role, content: text}`` adds after a closed assistant turn, with the next
        assistant turn's opening (the generation prompt): the template's delimiters around the content (rendered
        once per role, with a stand-in content), and ``text`` tokenised as plain text between them, so an
        observation that spells a special token (a program printing ``<|im_end|>``) cannot forge a turn boundary.

        Raises:
            ObservationTokenError: adding the message changes the earlier messages' tokens.
        """
        if role not in self._delimiters:
            rendered = self._render([*self._base, {"role": role, "content": OBSERVATION_MARK}], generation_prompt=True)
            at = rendered.rfind(OBSERVATION_MARK)
            if at < 0:
                raise ObservationTokenError(f"data.chat_template: the chat template does not render a {role!r} "
                                            f"message's content as given (rendered {rendered!r})")
            head = self._encode(rendered[:at])
            if head[:len(self._base_ids)] != self._base_ids:
                raise ObservationTokenError(f"data.chat_template: adding a {role!r} message changes the tokens of "
                                            f"the messages before it, so an observation cannot be appended to the "
                                            f"tokens sampled so far")
            self._delimiters[role] = (head[len(self._base_ids):], self._encode(rendered[at + len(OBSERVATION_MARK):]))
        opening, closing = self._delimiters[role]
        return opening + self._encode_plain(text) + closing

    def ids(self, role: str, text: str, turn_ids: Sequence[int]) -> list[int]:
        """The tokens appended after a policy turn ``turn_ids`` (its sampled tokens) for an observation: what closes
        the turn (less the end-of-turn token the policy sampled itself), then :meth:`message_ids`."""
        close = self.close_ids
        sampled_close = bool(close) and bool(turn_ids) and turn_ids[-1] == close[0]
        return close[1:] + self.message_ids(role, text) if sampled_close else close + self.message_ids(role, text)
