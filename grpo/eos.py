"""End of sequence: which completions terminated, and which of their tokens count in the loss.

Shapes:
    N   completions, R_i response tokens of completion i

A completion is *terminated* if its own response tokens (never the prompt's) contain one of the model's EOS ids, or if
it ended at one of the rollout's stop strings (``rollout.stop``: the engine's finish reason ``"stop"`` without an EOS;
the policy chose to stop there); every other completion was cut at the length cap and is *truncated*. The model's EOS
ids are all of them: the generation config's ``eos_token_id`` (an int or a list, e.g. ``[128001, 128008, 128009]`` for
Llama 3) plus the tokenizer's ``eos_token_id``. Tokens after the first EOS are not the policy's output for this prompt
(vLLM stops at EOS, but a custom stop rule or a server may not), so they are masked out of the loss; the EOS token
itself is kept (its logprob is the policy's decision to stop).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["eos_token_ids", "response_valid_lengths"]


def eos_token_ids(*sources: int | Iterable[int] | None) -> frozenset[int]:
    """The union of EOS ids from any number of sources, each an int, a list of ints or None.

    Example: ``eos_token_ids(generation_config["eos_token_id"], tokenizer.eos_token_id)``.

    Raises:
        ValueError: a non-integer or negative id, or no id at all.
    """
    out: set[int] = set()
    for src in sources:
        if src is None:
            continue
        items = [src] if isinstance(src, int) else list(src)
        for tok in items:
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise ValueError(f"EOS token ids must be non-negative ints, got {tok!r} in {src!r}")
            out.add(tok)
    if not out:
        raise ValueError(f"no EOS token id found in {sources!r}; expected at least one int")
    return frozenset(out)


def response_valid_lengths(
    response_ids: Sequence[Sequence[int]], eos_ids: Iterable[int],
    sampled_masks: Sequence[Sequence[bool]] | None = None, stopped: Sequence[bool] | None = None,
) -> tuple[list[int], list[bool]]:
    """Per completion: how many leading response tokens count in the loss, and whether it terminated.

    A multi-turn episode (``sampled_masks`` given) ends every policy turn but the last with an EOS (the end of its
    turn), followed by observation tokens; only its last turn — the sampled tokens after its last observation token —
    is searched for the EOS that ends the episode.

    Args:
        response_ids: N lists of R_i response token ids (prompt excluded).
        eos_ids: the model's EOS ids (see `eos_token_ids`).
        sampled_masks: None, or N lists of R_i bools, False for observation tokens (not sampled by the policy).
        stopped: None, or N bools: the engine ended the completion (its last turn) on its own, finish reason
            ``"stop"`` (EOS or a stop string); such a completion without an EOS ended at a stop string.

    Returns:
        (valid_lengths, terminated): N ints in [0, R_i] — index of the first EOS (of the last turn) + 1 for a
        completion with an EOS (tokens after it masked), R_i otherwise — and N bools, True iff the response (its last
        turn) contains an EOS id or ``stopped`` says it ended at a stop string.

    Raises:
        ValueError: a mask of another length than its response.
    """
    eos = frozenset(eos_ids)
    lengths, terminated = [], []
    for row, ids in enumerate(response_ids):
        start = 0
        if sampled_masks is not None:
            mask = list(sampled_masks[row])
            if len(mask) != len(ids):
                raise ValueError(f"row {row}: {len(mask)} sampled-mask entries for {len(ids)} response tokens")
            start = max((i + 1 for i, sampled in enumerate(mask) if not sampled), default=0)
        first = next((i for i in range(start, len(ids)) if ids[i] in eos), None)
        terminated.append(first is not None or (stopped is not None and bool(stopped[row])))
        lengths.append(len(ids) if first is None else first + 1)
    return lengths, terminated
