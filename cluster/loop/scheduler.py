"""Train-side scheduler: balance a rollout batch's sequences over data-parallel ranks, then pack micro-batches.

Notation: N sequences in the rollout batch (N = B·G), W data-parallel ranks (``world_size``), M micro-batches per
rank, L = ``max_tokens_per_microbatch`` (the token budget of one packed micro-batch).

Inputs and outputs::

    lengths:  [N] int, tokens (prompt + response) of sequence i, each >= 1
    plan.ranks[r][m]: tuple of sequence indices (into the rollout batch, ascending) of micro-batch m on rank r;
              len(plan.ranks) == W, len(plan.ranks[r]) == M for every r
    plan.tokens_per_rank: [W] int, token sum of each rank's sequences

The algorithm (:func:`plan_microbatches`):

1. Validate; a sequence longer than L either raises (``oversize="error"``) or gets a micro-batch of its own.
2. Balance token sums over the W ranks with the Karmarkar–Karp largest differencing method for k-way partitioning
   (N. Karmarkar, R. M. Karp, "The differencing method of set partitioning", UC Berkeley tech. report
   UCB/CSD-83-113, 1982; the k-way form as in verl's ``seqlen_balancing.karmarkar_karp``).
3. Pack each rank's sequences with first-fit-decreasing under L, then equalise M over ranks (FSDP collectives must
   stay in step): a rank with fewer micro-batches splits its largest splittable one into balanced halves until it
   has M, and pads with empty micro-batches only when it has fewer sequences than M.

Micro-batches are packed rows (sequences concatenated, varlen attention), so they carry no padding; use
:func:`padded_tokens` to price the same micro-batches as padded ``[num_seqs, max_len]`` batches.

Rollout side, :func:`assign_groups` dispatches groups to vLLM engines by load (tokens, not request count): every
group's G samples go to one engine (one request with ``n=G`` shares the prompt's prefix cache), each to the engine with
the fewest tokens assigned so far, heaviest group first (longest-processing-time-first list scheduling, R. L. Graham,
"Bounds on multiprocessing timing anomalies", SIAM J. Appl. Math. 17(2), 1969).

Everything is deterministic: ties are broken by sequence index. Pure Python, no Ray, no torch.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["MicroBatchPlan", "plan_microbatches", "karmarkar_karp", "padded_tokens", "assign_groups"]

Oversize = Literal["error", "own"]


@dataclass(frozen=True)
class MicroBatchPlan:
    """Assignment of sequences to data-parallel ranks and micro-batches.

    ranks: ``ranks[r][m]`` = sequence indices (into the rollout batch, ascending) of micro-batch m on rank r. Every
        rank has the same number of micro-batches M >= 1 (FSDP collectives must stay in step). A micro-batch is
        empty only when its rank has fewer sequences than M (e.g. more ranks than sequences: a rank without
        sequences still gets M empty micro-batches and must run them as zero-token steps). On each rank the
        micro-batches are ordered by token count descending (ties: lower first index first), empty ones last, so
        heavy micro-batches of different ranks tend to run in the same step.
    tokens_per_rank: ``[W]`` token sum of each rank's sequences.

    Raises ValueError on construction if there are no ranks, the ranks' micro-batch counts differ or
    ``tokens_per_rank`` does not have one entry per rank.
    """

    ranks: tuple[tuple[tuple[int, ...], ...], ...]
    tokens_per_rank: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("MicroBatchPlan: expected at least 1 rank, got 0")
        counts = sorted({len(rank) for rank in self.ranks})
        if len(counts) != 1 or counts[0] < 1:
            raise ValueError(f"MicroBatchPlan: expected the same number (>= 1) of micro-batches on every rank, "
                             f"got counts {counts}")
        if len(self.tokens_per_rank) != len(self.ranks):
            raise ValueError(f"MicroBatchPlan: expected {len(self.ranks)} tokens_per_rank entries (one per rank), "
                             f"got {len(self.tokens_per_rank)}")

    @property
    def num_microbatches(self) -> int:
        """M, the number of micro-batches on every rank."""
        return len(self.ranks[0])

    @property
    def world_size(self) -> int:
        """W, the number of data-parallel ranks."""
        return len(self.ranks)

    def stats(self, lengths: Sequence[int]) -> dict[str, float]:
        """Packing metrics for logging; ``lengths`` is the ``[N]`` token list the plan was made from.

        Keys:
          - ``packing/num_microbatches``: M.
          - ``packing/tokens_per_microbatch_mean``: total tokens / (W·M), i.e. over every micro-batch slot that
            runs, empty ones included.
          - ``packing/tokens_per_microbatch_max``: tokens of the largest micro-batch.
          - ``packing/rank_imbalance``: max / min token sum over ranks; 1.0 when all equal (including all zero).
            A rank with 0 tokens counts as 1 token (no division by zero, no ``inf`` in the metrics), so with an
            empty rank the value is the largest rank's token count — large, which is the point.
          - ``packing/padding_fraction``: 0.0 — packed rows carry no padding (see :func:`padded_tokens`).

        Raises ValueError if the plan names an index outside ``lengths``.
        """
        lengths = _as_int_list(lengths)
        mb_tokens = [_tokens(lengths, mb) for rank in self.ranks for mb in rank]
        rank_tokens = [sum(_tokens(lengths, mb) for mb in rank) for rank in self.ranks]
        hi, lo = max(rank_tokens), min(rank_tokens)
        return {
            "packing/num_microbatches": float(self.num_microbatches),
            "packing/tokens_per_microbatch_mean": sum(mb_tokens) / len(mb_tokens),
            "packing/tokens_per_microbatch_max": float(max(mb_tokens)),
            "packing/rank_imbalance": 1.0 if hi == lo else hi / max(lo, 1),
            "packing/padding_fraction": 0.0,
        }


def plan_microbatches(lengths: Sequence[int], world_size: int, max_tokens_per_microbatch: int, *,
                      oversize: Oversize = "own") -> MicroBatchPlan:
    """Balance sequences over ``world_size`` ranks (Karmarkar–Karp) and pack each rank's micro-batches (FFD).

    lengths: ``[N]`` int, tokens (prompt + response) per sequence, each >= 1; N may be 0.
    world_size: W >= 1 data-parallel ranks.
    max_tokens_per_microbatch: L >= 1, token budget of one packed micro-batch.
    oversize: what to do with a sequence longer than L: ``"error"`` raises, ``"own"`` gives it a micro-batch of
        its own (the only micro-batches allowed over budget).

    Returns a :class:`MicroBatchPlan`. Guarantees: every index in ``range(N)`` appears exactly once; every rank has
    the same M >= 1 micro-batches; every micro-batch with >= 2 sequences fits in L; when N >= W every rank gets
    >= 1 sequence; rank r gets the r-th heaviest set of the partition.

    Raises ValueError for world_size < 1, L < 1, a length < 1, or (``oversize="error"``) the lowest-index sequence
    longer than L, naming its index, length and L; TypeError for non-integer values.

    Cost: O(N log N + N·W log W) for the partition plus O(N·M) for first-fit packing.
    """
    lengths = _check_lengths(lengths)
    world_size = _check_positive("world_size", world_size)
    budget = _check_positive("max_tokens_per_microbatch", max_tokens_per_microbatch)
    if oversize not in ("error", "own"):
        raise ValueError(f"oversize: expected 'error' or 'own', got {oversize!r}")
    if oversize == "error":
        for i, n in enumerate(lengths):
            if n > budget:
                raise ValueError(f"sequence {i} has {n} tokens, more than max_tokens_per_microbatch={budget}; "
                                 f"expected every length <= {budget} (or pass oversize='own')")

    rank_sets = karmarkar_karp(lengths, world_size)
    packed = [_first_fit_decreasing(lengths, members, budget) for members in rank_sets]
    target = max(1, max(len(bins) for bins in packed))
    ranks = tuple(_order(lengths, _equalise(lengths, bins, target), target) for bins in packed)
    return MicroBatchPlan(ranks=ranks, tokens_per_rank=tuple(sum(lengths[i] for i in s) for s in rank_sets))


def karmarkar_karp(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Partition indices ``range(N)`` into k sets with nearly equal sums of ``lengths`` (largest differencing).

    Each sequence starts as a partial partition (its own set plus k-1 empty ones). A heap keyed by spread (largest
    minus smallest set sum) repeatedly pops the two partial partitions with the largest spread and merges them:
    sets sorted by sum descending, set i of one is joined with set k-1-i of the other, so large meets small.
    Source: Karmarkar & Karp 1982 (see the module docstring).

    Returns k lists of indices (ascending), ordered by set sum descending, ties by lowest index. With all lengths
    >= 1, a partial partition of m sequences has min(k, m) non-empty sets (a merge of partitions with p and q
    non-empty sets pairs them into min(k, p + q)), so when N >= k no set is empty. Pairing one partition's sets
    in descending and the other's in ascending order never makes the spread wider than the wider input's, so the
    final spread (largest minus smallest set sum) is at most max(lengths).

    Raises ValueError for k < 1 or a length < 1, TypeError for non-integers.

    Cost: O(N log N) heap operations, O(k log k) per merge, O(N log N) for joining member lists (small into large).
    """
    lengths = _check_lengths(lengths)
    k = _check_positive("k", k)
    n = len(lengths)
    # A set is (-sum, lowest index or n when empty, members); tuples sort by sum descending, then lowest index.
    empty: tuple[int, int, list[int]] = (0, n, [])
    # A heap entry is (-spread, tie-break, payload); an int payload is a sequence's initial partition.
    heap: list[tuple[int, int, object]] = [(-length, i, i) for i, length in enumerate(lengths)]
    heapq.heapify(heap)
    merges = 0
    while len(heap) > 1:
        first = _materialise(heapq.heappop(heap)[2], lengths, k, empty)
        second = _materialise(heapq.heappop(heap)[2], lengths, k, empty)
        merged = sorted((a[0] + b[0], min(a[1], b[1]), _join(a[2], b[2]))
                        for a, b in zip(first, reversed(second)))
        heapq.heappush(heap, (merged[0][0] - merged[-1][0], n + merges, merged))  # -spread: widest pops first
        merges += 1
    final = _materialise(heap[0][2], lengths, k, empty) if heap else [empty] * k
    return [sorted(members) for _, _, members in final]


def padded_tokens(lengths: Sequence[int], microbatches: Iterable[Sequence[int]]) -> int:
    """Tokens a padded batch would compute: sum over micro-batches of num_seqs × max length (0 for an empty one).

    ``microbatches``: sequences of indices into ``lengths``, e.g. ``(mb for rank in plan.ranks for mb in rank)``.
    Compare with ``sum(lengths)``, the packed cost; padding fraction = 1 - sum(lengths) / padded_tokens.
    """
    return sum(len(mb) * max(lengths[i] for i in mb) for mb in microbatches if len(mb))


def assign_groups(prompt_lengths: Sequence[int], group_sizes: Sequence[int], num_engines: int,
                  max_response_tokens: int) -> list[list[int]]:
    """Dispatch groups to engines by load: ``out[e]`` = indices of the groups engine e samples, in dispatch order.

    prompt_lengths: ``[B]`` int, prompt tokens of each group's prompt (>= 1).
    group_sizes: ``[B]`` int, G of each group (>= 1; groups may differ, e.g. with an adaptive group size).
    num_engines: E >= 1 rollout engines.
    max_response_tokens: T >= 1, the response cap.

    Load of group i: ``prompt_lengths[i] + group_sizes[i] · T`` tokens, the most the engine can have in flight for it
    (the prompt is computed once: its G samples share the prefix cache). Groups are taken heaviest first (ties: lower
    index) and each goes whole to the engine with the least load so far (ties: lower engine index), so engines
    finish together; with equal loads that is round-robin. An engine may get no group (B < E).

    Raises ValueError for mismatched lengths, E < 1, T < 1, or a prompt length / group size < 1.

    Cost: O(B log B + B·E).
    """
    num_engines = _check_positive("num_engines", num_engines)
    max_response_tokens = _check_positive("max_response_tokens", max_response_tokens)
    prompts, sizes = _as_int_list(prompt_lengths), _as_int_list(group_sizes)
    if len(prompts) != len(sizes):
        raise ValueError(f"assign_groups: got {len(prompts)} prompt lengths and {len(sizes)} group sizes; "
                         f"expected one of each per group")
    for name, values in (("prompt_lengths", prompts), ("group_sizes", sizes)):
        for i, v in enumerate(values):
            if v < 1:
                raise ValueError(f"{name}[{i}]: expected >= 1, got {v}")
    loads = [p + g * max_response_tokens for p, g in zip(prompts, sizes)]
    engine_load = [0] * num_engines
    out: list[list[int]] = [[] for _ in range(num_engines)]
    for i in sorted(range(len(loads)), key=lambda j: (-loads[j], j)):
        e = min(range(num_engines), key=lambda k: (engine_load[k], k))
        out[e].append(i)
        engine_load[e] += loads[i]
    return out


def _materialise(payload: object, lengths: list[int], k: int,
                 empty: tuple[int, int, list[int]]) -> list[tuple[int, int, list[int]]]:
    """A heap payload → k sets; an int payload i is sequence i's initial partition (built lazily to save memory)."""
    if isinstance(payload, int):
        return [(-lengths[payload], payload, [payload])] + [empty] * (k - 1)
    return payload  # type: ignore[return-value]


def _join(x: list[int], y: list[int]) -> list[int]:
    """Concatenate two member lists, extending the longer in place (each list is owned by one popped set)."""
    if not y:
        return x
    if not x:
        return y
    if len(x) < len(y):
        x, y = y, x
    x.extend(y)
    return x


def _first_fit_decreasing(lengths: list[int], members: list[int], budget: int) -> list[list[int]]:
    """Pack ``members`` into bins of <= ``budget`` tokens, longest first (ties: lower index), first bin that fits.

    A sequence longer than the budget opens a bin that nothing else fits into.
    """
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(members, key=lambda j: (-lengths[j], j)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def _equalise(lengths: list[int], bins: list[list[int]], target: int) -> list[list[int]]:
    """Split the largest bin with >= 2 sequences (ties: lower first index) in two until there are ``target`` bins.

    Stops early when no bin has 2 sequences (fewer sequences than ``target``); the caller pads with empty bins.
    """
    bins = [list(b) for b in bins]
    while len(bins) < target:
        splittable = [b for b in range(len(bins)) if len(bins[b]) >= 2]
        if not splittable:
            break
        b = max(splittable, key=lambda j: (_tokens(lengths, bins[j]), -min(bins[j])))
        bins[b:b + 1] = _halve(lengths, bins[b])
    return bins


def _halve(lengths: list[int], members: list[int]) -> list[list[int]]:
    """Two non-empty halves with near-equal token sums: longest first (ties: lower index) into the lighter half."""
    halves: list[list[int]] = [[], []]
    loads = [0, 0]
    for i in sorted(members, key=lambda j: (-lengths[j], j)):
        h = 0 if loads[0] <= loads[1] else 1
        halves[h].append(i)
        loads[h] += lengths[i]
    return halves


def _order(lengths: list[int], bins: list[list[int]], target: int) -> tuple[tuple[int, ...], ...]:
    """Bins → tuples of ascending indices, heaviest first (ties: lower first index), padded with empty ones."""
    ordered = sorted((sorted(b) for b in bins), key=lambda b: (-_tokens(lengths, b), b[0]))
    return tuple(tuple(b) for b in ordered) + ((),) * (target - len(ordered))


def _tokens(lengths: list[int], indices: Sequence[int]) -> int:
    """Token sum of ``indices``; raises ValueError for an index outside ``lengths``."""
    total = 0
    for i in indices:
        if not 0 <= i < len(lengths):
            raise ValueError(f"sequence index {i}: expected 0 <= index < {len(lengths)} (len(lengths))")
        total += lengths[i]
    return total


def _as_int_list(lengths: Sequence[int]) -> list[int]:
    """Plain ``list[int]`` copy (accepts numpy/torch integer scalars); raises TypeError for non-integers."""
    try:
        return [operator.index(n) for n in lengths]
    except TypeError:
        bad = next(n for n in lengths if not hasattr(n, "__index__"))
        raise TypeError(f"lengths: expected integers, got {type(bad).__name__} ({bad!r})") from None


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    """``lengths`` as a ``list[int]`` of values >= 1; raises ValueError naming the first bad index."""
    lengths = _as_int_list(lengths)
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"lengths[{i}]: expected >= 1 token, got {n}")
    return lengths


def _check_positive(name: str, value: int) -> int:
    """``value`` as an int >= 1; raises TypeError/ValueError naming ``name``."""
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__}") from None
    if value < 1:
        raise ValueError(f"{name}: expected >= 1, got {value}")
    return value
