"""Reward calls: running one (:func:`evaluate_call`), packing many into batches for a worker (:func:`pack_chunks`)
and taking a batch's scores apart again (:func:`split_chunk_scores`, :func:`join_scores`).

Rewards are per completion, so a batch of several calls scores each row as the calls would one by one, with one
difference a spec chooses: with ``algorithm.reward_on_error: none`` a function that raises gives no score to every
row of the batch it was called on (the whole chunk, up to ``reward_pool.batch_size`` completions), not only to the
rows of one group.

Notation: N rows in a call, C rows in a chunk (C <= batch_size unless one call is cut into pieces of batch_size).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from contract.rewards import RewardCall, RewardScores
from grpo.rewards import combine_rewards

__all__ = ["Chunk", "Segment", "evaluate_call", "join_scores", "lost_scores", "merge_calls", "pack_chunks",
           "split_chunk_scores"]


def evaluate_call(call: RewardCall) -> RewardScores:
    """Run ``call``'s weighted reward functions here (``grpo.rewards.combine_rewards``).

    Raises:
        RewardError: a function broke its contract, or raised with ``on_error="raise"`` (combine_rewards' errors).
    """
    return RewardScores(*combine_rewards(call.completions, call.references, call.weights, on_error=call.on_error,
                                         prompts=call.prompts, columns=call.columns))


def lost_scores(n: int, weights: Sequence[str] | dict) -> RewardScores:
    """The scores of N rows a pool could not score (worker died or timed out): NaN everywhere, every function
    counted as failed on every row."""
    nan = torch.full((n,), math.nan, dtype=torch.float32)
    return RewardScores(nan.clone(), {name: nan.clone() for name in weights}, {name: n for name in weights})


def join_scores(parts: Sequence[RewardScores]) -> RewardScores:
    """Scores of consecutive row ranges → the scores of all of them (concatenated; failure counts summed)."""
    names = list(parts[0].per_function)
    return RewardScores(torch.cat([p.total for p in parts]),
                        {k: torch.cat([p.per_function[k] for p in parts]) for k in names},
                        {k: sum(p.num_failed.get(k, 0) for p in parts) for k in names})


def _rows(call: RewardCall, start: int, stop: int) -> RewardCall:
    return RewardCall(call.completions[start:stop], call.references[start:stop], call.prompts[start:stop],
                      {k: v[start:stop] for k, v in call.columns.items()}, call.weights, call.on_error)


def merge_calls(calls: Sequence[RewardCall]) -> RewardCall:
    """One call over the rows of ``calls`` (in order); a column some calls lack is None in their rows. The weights
    and ``on_error`` are the first call's (the calls of one submission share them)."""
    if len(calls) == 1:
        return calls[0]
    names = sorted({k for c in calls for k in c.columns})
    columns = {k: [v for c in calls for v in c.columns.get(k, [None] * len(c))] for k in names}
    return RewardCall([t for c in calls for t in c.completions], [r for c in calls for r in c.references],
                      [p for c in calls for p in c.prompts], columns, calls[0].weights, calls[0].on_error)


@dataclass(frozen=True)
class Segment:
    """Rows ``start:stop`` of submitted call ``call_index``."""

    call_index: int
    start: int
    stop: int


@dataclass(frozen=True)
class Chunk:
    """What one worker call scores: ``call``, the rows of ``segments`` in order."""

    call: RewardCall
    segments: tuple[Segment, ...]


def pack_chunks(calls: Sequence[RewardCall], batch_size: int) -> list[Chunk]:
    """Pack ``calls`` in order into chunks of at most ``batch_size`` rows: whole calls while they fit; a call longer
    than ``batch_size`` is cut into pieces of ``batch_size`` rows (and a last, shorter one). Empty calls are skipped.

    Raises:
        ValueError: ``batch_size`` < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    pieces = [Segment(i, start, min(start + batch_size, len(c)))
              for i, c in enumerate(calls) for start in range(0, len(c), batch_size)]
    groups: list[list[Segment]] = []
    size = batch_size
    for piece in pieces:
        n = piece.stop - piece.start
        if size + n > batch_size:
            groups.append([])
            size = 0
        groups[-1].append(piece)
        size += n
    return [Chunk(merge_calls([_rows(calls[s.call_index], s.start, s.stop) for s in segs]), tuple(segs))
            for segs in groups]


def split_chunk_scores(chunk: Chunk, scores: RewardScores) -> list[tuple[Segment, RewardScores]]:
    """A chunk's scores → each of its segments' scores. A function counted as failed in the chunk (it raised, or the
    chunk was lost: every row) is counted as failed on every row of each segment.

    Raises:
        ValueError: the scores do not cover the chunk's rows.
    """
    n = sum(s.stop - s.start for s in chunk.segments)
    if scores.total.numel() != n:
        raise ValueError(f"reward pool: a chunk of {n} rows came back with {scores.total.numel()} scores")
    out, at = [], 0
    for seg in chunk.segments:
        k = seg.stop - seg.start
        per_function = {f: v[at:at + k] for f, v in scores.per_function.items()}
        failed = {f: k if count else 0 for f, count in scores.num_failed.items()}
        out.append((seg, RewardScores(scores.total[at:at + k], per_function, failed)))
        at += k
    return out
