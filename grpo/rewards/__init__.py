"""Reward-function registry, weighted combination of rewards, and the step's ``reward/*`` metrics.

A reward function scores a batch of N completions and returns one float or None per completion; it is called
``fn(prompts=..., completions=..., **columns)`` (every column of the rows, the TRL convention) or, the original
convention, ``fn(completions, references)``, told apart by its parameters (``grpo.rewards.calling``); it may be
``async``. None (or NaN) means "this reward does not score this row" (TRL's convention): `combine_rewards` runs the
functions named in a weight dict and returns, per row, the weighted sum over the weighted functions that scored it
(TRL's ``nansum``); each function's ``reward/<name>`` is its mean over the rows it scored. A row that no weighted
function scored, or one a weighted function could not score because it raised (``on_error="none"``), has total NaN:
an infrastructure failure (the verifier could not run), not a wrong answer, which `grpo.advantages` leaves out of
the group statistics (advantage 0) and the loop leaves out of the loss and of the step's metrics (counted as
``reward/infra_failed``). TRL warns about a row no reward scores and trains it with reward 0; this project does not
pay what nothing scored. A verifier that could not score a row it applies to returns `UNSCORED` there: that row has
no total whatever the others give it; so does a None from a function registered with ``none_is_failure`` (one that
scores every row: the builtins ``math`` and ``code``, whose None is a dead worker or a failed sandbox). ±inf is
refused, naming the function and its file:line.

Builtins: ``accuracy`` and ``format`` (GSM8K, ``grpo.rewards.gsm8k``), ``math`` (LaTeX answers with math-verify,
``sandbox.math_reward``), ``reasoning_gym`` (``grpo.rewards.reasoning_gym``), and ``code`` and ``code_asserts``
(programs run against the row's ``tests`` in the sandbox, ``sandbox.code_reward``: the ``sandbox`` package beside
this one, named here by import path and imported on first use, so this package never imports process code). A
spec may also name a function by location (``module:function``, ``path/to/file.py:function``:
``grpo.rewards.loading``). A reward declares what it needs of each data row with a ``check_row``
(``grpo.rewards.checks``), checked when the data is loaded.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from math import isfinite
from typing import Any, Literal, NamedTuple, Protocol

import torch

from grpo.registry import Registry
from grpo.rewards.calling import (UNSCORED, RewardError, RewardOutputError, call_reward, signature_of,
                                  unscored_rows, values_to_tensor, where_defined)
from grpo.rewards.gsm8k import _final_answer, accuracy_reward, extract_answer, format_reward, parse_reference
from grpo.rewards.overlong import overlong_penalty
from grpo.rewards.reasoning_gym import check_reference as check_reasoning_gym_reference
from grpo.rewards.reasoning_gym import reasoning_gym_reward

RewardFunctionName = Literal["accuracy", "format", "math", "reasoning_gym", "code", "code_asserts"]
OnError = Literal["raise", "none"]

__all__ = [
    "OVERLONG_PENALTY_KEY",
    "RESERVED_REWARD_NAMES",
    "REWARD_FUNCTIONS",
    "NONE_IS_FAILURE",
    "SCORED_PREFIX",
    "UNSCORED",
    "REWARD_SUMMARY_METRICS",
    "CombinedRewards",
    "OnError",
    "RewardError",
    "RewardFunctionName",
    "RewardOutputError",
    "accuracy_reward",
    "combine_rewards",
    "count_not_applicable",
    "lookup_reward",
    "extract_answer",
    "format_reward",
    "overlong_penalty",
    "parse_reference",
    "prometheus_safe_name",
    "register_reward_function",
    "reward_metrics",
]

logger = logging.getLogger(__name__)


class RewardFunction(Protocol):
    """``fn(prompts=..., completions=..., **columns)`` or ``fn(completions, references)`` (module docstring)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Sequence[float | None]: ...


#: Step summaries the driver reports as ``reward/<name>`` (see `reward_metrics`), besides one ``reward/<function>``
#: per reward function. ``reward/mean`` is what the alerts in deploy/prometheus read.
REWARD_SUMMARY_METRICS: dict[str, str] = {
    "mean": "mean total reward over the step's completions with a valid reward",
    "std": "standard deviation of that total reward",
    "failed": "reward evaluations (completions x functions) that raised or were lost (a reward pool's worker died "
              "or timed out)",
    "none_fraction": "fraction of the step's completions without a valid reward (reward/infra_failed / completions)",
    "infra_failed": "completions without a valid reward (infrastructure failures), left out of the loss and metrics",
    "not_applicable": "completions with a valid reward that a weighted reward function skipped with None (it does not "
                      "apply to them; another one scored them)",
}
#: Prefix of the per-function counts ``reward/scored/<name>``: the completions ``reward/<name>`` averages over.
SCORED_PREFIX = "scored"

#: Component the driver adds for the DAPO overlong penalty (``reward/overlong_penalty``).
OVERLONG_PENALTY_KEY = "overlong_penalty"
#: Names no reward function may take: its ``reward/<name>`` metric would overwrite the driver's.
RESERVED_REWARD_NAMES: frozenset[str] = frozenset({*REWARD_SUMMARY_METRICS, OVERLONG_PENALTY_KEY})



def prometheus_safe_name(name: str) -> str:
    """A reward name as it appears in its Prometheus series ``grpo_reward_<name>``
    (``cluster.sinks.metric_names.prometheus_name``: characters outside [a-zA-Z0-9_:] become ``_``), so
    ``none-fraction`` is the ``none_fraction`` series."""
    return re.sub(r"[^a-zA-Z0-9_:]", "_", name)


REWARD_FUNCTIONS: Registry[RewardFunction] = Registry("reward function", reserved={
    **{name: f"the driver reports reward/{name} ({what})" for name, what in REWARD_SUMMARY_METRICS.items()},
    OVERLONG_PENALTY_KEY: f"the driver reports reward/{OVERLONG_PENALTY_KEY} (the DAPO overlong penalty)",
}, reserved_prefixes={
    f"{SCORED_PREFIX}_": f"the driver reports reward/{SCORED_PREFIX}/<name> (the completions reward/<name> averages "
                         f"over), the same Prometheus series as reward/{SCORED_PREFIX}_<name>",
}, same_name=prometheus_safe_name)


#: Rewards registered lazily (by where they live) that score every row they are given, so their None is their
#: verifier's failure (read as `UNSCORED`), never "does not apply"; a function registered here says so itself
#: (``none_is_failure``).
NONE_IS_FAILURE: set[str] = set()


def register_reward_function(name: str, *, check_row: Callable[..., Any] | None = None,
                             none_is_failure: bool = False):
    """Decorator adding a batch reward function to `REWARD_FUNCTIONS`; ``check_row`` (optional) becomes the
    function's ``check_row`` attribute, what it needs of every data row (``grpo.rewards.checks``).
    ``none_is_failure``: the function scores every row it is given, so its None is its verifier's failure, never
    "does not apply" (its ``none_is_failure`` attribute; `combine_rewards` reads it as `UNSCORED`).

    Raises:
        ValueError: a duplicate name, or a reserved one (`RESERVED_REWARD_NAMES`: mean, std, failed, none_fraction,
            infra_failed, overlong_penalty), whose ``reward/<name>`` metric would overwrite the driver's; also a name
            that is one of those once written as a Prometheus metric name (`prometheus_safe_name`: ``none-fraction``,
            ``overlong.penalty``), or that is the same as a registered function's there (``a-b`` after ``a_b``).
    """
    def decorator(fn):
        REWARD_FUNCTIONS[name] = fn
        if check_row is not None:
            fn.check_row = check_row
        if none_is_failure:
            fn.none_is_failure = True
        return fn

    return decorator


def reward_metrics(total: torch.Tensor, per_function: Mapping[str, torch.Tensor], num_failed: int,
                   not_applicable: int = 0) -> dict:
    """The step's ``reward/`` metrics: ``reward/<summary>`` for each of `REWARD_SUMMARY_METRICS`, and for each
    component ``reward/<function>`` (its mean over the rows with a valid reward that it scored: NaN when it scored
    none) and ``reward/scored/<function>`` (how many rows that mean is over).

    Rows whose total is NaN (an infrastructure failure: no weighted function scored it, or one raised) are counted in
    ``reward/infra_failed`` and ``reward/none_fraction`` and left out of every other figure, which therefore equals
    the figure of the same rows without them (``reward/failed`` counts the evaluations that raised).

    Args:
        total: [N] float32 total rewards, NaN = no valid reward.
        per_function: component name → [N] float32 unweighted rewards (NaN = none); no reserved name.
        num_failed: reward evaluations that raised (completions × functions).
        not_applicable: rows with a valid reward that a weighted function skipped with None
            (`count_not_applicable`).

    Raises:
        ValueError: a component named like a summary (it would overwrite it).
    """
    clash = sorted(set(per_function) & set(REWARD_SUMMARY_METRICS))
    if clash:
        raise ValueError(f"reward components {clash} would overwrite the summary metrics reward/{clash[0]}; "
                         f"reserved: {', '.join(sorted(RESERVED_REWARD_NAMES))}")
    kept = ~total.isnan()
    valid = total[kept]
    summary = {
        "mean": float(valid.mean()) if valid.numel() else float("nan"),
        "std": float(valid.std()) if valid.numel() > 1 else 0.0,
        "failed": num_failed,
        "none_fraction": float((~kept).float().mean()) if total.numel() else 0.0,
        "infra_failed": int((~kept).sum()),
        "not_applicable": int(not_applicable),
    }
    assert summary.keys() == REWARD_SUMMARY_METRICS.keys()  # one list of names: REWARD_SUMMARY_METRICS
    scored = {name: kept & ~v.isnan() for name, v in per_function.items()}
    return {**{f"reward/{name}": float(v[scored[name]].mean()) if scored[name].any() else float("nan")
               for name, v in per_function.items()},
            **{f"reward/{SCORED_PREFIX}/{name}": int(rows.sum()) for name, rows in scored.items()},
            **{f"reward/{name}": value for name, value in summary.items()}}


def count_not_applicable(total: torch.Tensor, per_function: Mapping[str, torch.Tensor],
                         weights: Mapping[str, float]) -> int:
    """Rows with a valid reward (finite ``total``) that at least one weighted function (weight ≠ 0) skipped with
    None (``reward/not_applicable``). On such a row a weighted function's NaN can only be a None: a raise or a lost
    call leaves the row without a total.

    Args:
        total: [N] float32, NaN = no valid reward. per_function: name → [N] float32 (NaN = none).
        weights: name → weight; names missing from ``per_function`` are ignored.
    """
    skipped = torch.zeros_like(total, dtype=torch.bool)
    for name, weight in weights.items():
        if weight != 0.0 and name in per_function:
            skipped |= per_function[name].isnan()
    return int((skipped & ~total.isnan()).sum())


def _check_number_reference(reference: str) -> None:
    """The ``accuracy`` reward's row check: the reference is one number (``$`` before it, a ``.`` after it allowed;
    no units), as every GSM8K reference is (the text after its ``####``).

    Raises:
        ValueError: naming what was found.
    """
    if not reference.strip():
        raise ValueError("the reference is empty (nothing after the answer's last '####'); the accuracy reward "
                         "compares numbers")
    if _final_answer(reference) is None:
        shown = reference if len(reference) <= 60 else reference[:57] + "..."
        raise ValueError(f"expected a number after the last '####' of the answer (or an answer that is one number: "
                         f"the accuracy reward compares numbers), got {shown!r}")


@register_reward_function("accuracy", check_row=_check_number_reference)
def _accuracy(completions: list[str], references: list[str]) -> list[float | None]:
    """GSM8K numeric accuracy, 1.0/0.0 per completion (`grpo.rewards.gsm8k.accuracy_reward`): 1.0 only for one
    committed final answer equal to the reference, never for a hedge (`grpo.rewards.final_answer`).

    Its row check (`_check_number_reference`) refuses, when the data is loaded, rows whose reference is not one
    number; a reference without a number that still reaches it raises `ValueError` for the whole batch.
    """
    return [accuracy_reward(c, r) for c, r in zip(completions, references, strict=True)]


@register_reward_function("format")
def _format(completions: list[str], references: list[str]) -> list[float | None]:
    """1.0 for a worked solution ending in one "#### <number>" line that is its one final answer, never for the answer
    line alone (rules F1-F6 of `grpo.rewards.gsm8k`, `format_reward`); ignores references."""
    return [format_reward(c) for c in completions]


@register_reward_function("reasoning_gym", check_row=check_reasoning_gym_reference)
def _reasoning_gym(completions: list[str], references: list[str]) -> list[float | None]:
    """reasoning-gym's own scorer of the task each reference names (`grpo.rewards.reasoning_gym`): for prompts from
    ``data.source: reasoning_gym``. A reference of another kind raises `ValueError` for the whole batch."""
    return list(reasoning_gym_reward(completions, references))


#: The sandbox's rewards, keyword arguments in TRL's convention: ``code(completions=[...], tests=[...], **columns)``.
#: ``code`` runs call and stdin/stdout tests, judged outside the program's process; ``code_asserts`` also runs test
#: code inside it (docs/sandbox.md says what that does not catch). Imported on first lookup (grpo.registry). Both score
#: every row they are given: their None is a sandbox's infrastructure failure, never "does not apply".
#: ``math``: LaTeX answers verified by math-verify in a worker process with a per-completion deadline
#: (``sandbox.math_reward``): 1.0 only for one committed final answer equivalent to the reference
#: (`grpo.rewards.final_answer`), 0.0 on a verifier timeout, None (the row has no reward) when the worker died.
REWARD_FUNCTIONS.register_lazy("math", "sandbox.math_reward:math_reward")
REWARD_FUNCTIONS.register_lazy("code", "sandbox.code_reward:code_reward")
REWARD_FUNCTIONS.register_lazy("code_asserts", "sandbox.code_reward:code_asserts_reward")
NONE_IS_FAILURE.update({"math", "code", "code_asserts"})


class CombinedRewards(NamedTuple):
    """Result of `combine_rewards`; unpacks as `total, per_function, num_failed = combine_rewards(...)`.

    Attributes:
        total: [N] float32, Σ weight·reward over the functions with a nonzero weight that scored the row (None/NaN:
            the function does not apply to it; TRL's nansum); NaN in a row none of them scored or one of them gave
            `UNSCORED`, and in every row when one of them failed (raised with on_error="none").
        per_function: name → [N] float32 unweighted rewards (NaN for None), for every function in `weights`.
        num_failed: name → number of rows set to NaN because that function raised (0 or N per call; with
            on_error="raise" it is always 0). Failures are also logged as warnings.
    """

    total: torch.Tensor
    per_function: dict[str, torch.Tensor]
    num_failed: dict[str, int]


def lookup_reward(name: str) -> RewardFunction:
    """The registered function ``name``.

    Raises:
        ValueError: an unknown name; the message lists the registered ones and says how to add one.
    """
    if name not in REWARD_FUNCTIONS:
        from grpo.rewards.loading import HOW_TO_NAME_A_REWARD

        raise ValueError(f"unknown reward function {name!r}; registered: {', '.join(sorted(REWARD_FUNCTIONS))}; "
                         f"{HOW_TO_NAME_A_REWARD}")
    return REWARD_FUNCTIONS[name]


def combine_rewards(
    completions: Sequence[str],
    references: Sequence[str],
    weights: Mapping[str, float],
    *,
    on_error: OnError = "raise",
    prompts: Sequence[Any] | None = None,
    columns: Mapping[str, Sequence[Any]] | None = None,
) -> CombinedRewards:
    """Run the weighted reward functions on a batch and sum them.

    Args:
        completions: N model completions (EOS stripped).
        references: N reference answers (the answer column, the text after its last '####' when it has one),
            row-aligned with completions: what ``(completions, references)`` functions get.
        weights: function name (in `REWARD_FUNCTIONS`) → finite weight; a weight of 0 still runs the function (for
            logging) but keeps it out of `total`.
        on_error: what to do when a function raises: "raise" → `RewardError` (a RuntimeError) naming the function
            and where it is defined (the original exception chained); "none" → that function's rewards are None
            (NaN) for the whole batch, counted in `num_failed` and logged; a weighted one leaves every row of the
            batch without a total (an infrastructure failure: a raise is not "does not apply").
        prompts: N prompts as the data gave them (strings or chat-message lists), for whole-row functions; None
            gives them None each.
        columns: column name → N values (every column of each completion's row but the prompt), for whole-row
            functions; None: no columns.

    Returns:
        `CombinedRewards(total, per_function, num_failed)` (see its doc).

    Raises:
        ValueError: length mismatch of the inputs, empty or unknown weights, non-finite weight, bad on_error.
        RewardOutputError (a ValueError and a RewardError): a function returning the wrong number of values,
            values that are neither numbers nor None, or ±inf (always raised: a bug, not a transient failure; the
            message names the function, the row and the function's file:line).
        RewardError: a function with an unusable signature, or one that raised with on_error="raise".
    """
    if on_error not in ("raise", "none"):
        raise ValueError(f"on_error must be 'raise' or 'none', got {on_error!r}")
    n = len(completions)
    prompts = [None] * n if prompts is None else prompts
    columns = columns or {}
    lengths = {"references": len(references), "prompts": len(prompts),
               **{f"column {k!r}": len(v) for k, v in columns.items()}}
    for what, length in lengths.items():
        if length != n:
            raise ValueError(f"got {n} completions but {length} {what}; expected equal")
    if not weights:
        raise ValueError(f"weights must name at least one reward function of {sorted(REWARD_FUNCTIONS)}")
    total = torch.zeros(n, dtype=torch.float32)
    scored = torch.zeros(n, dtype=torch.bool)  # rows some weighted function scored
    unscored = torch.zeros(n, dtype=torch.bool)  # rows a weighted function could not score (UNSCORED)
    failed = False  # a weighted function raised: no row of the batch has a total
    per_function: dict[str, torch.Tensor] = {}
    num_failed: dict[str, int] = {}
    for name, weight in weights.items():
        fn = lookup_reward(name)
        if not isfinite(weight):
            raise ValueError(f"weight of reward function {name!r} must be finite, got {weight!r}")
        signature = signature_of(fn, name)
        num_failed[name] = 0
        try:
            values = call_reward(fn, signature, completions, references, prompts, columns)
        except Exception as exc:
            if on_error == "raise":
                raise RewardError(f"reward function {name!r} raised {type(exc).__name__}: {exc} (defined at "
                                  f"{where_defined(fn)}; algorithm.reward_on_error: none scores such a batch None "
                                  f"instead)") from exc
            logger.warning("reward function %r raised %s: %s; its %d rewards are None", name,
                           type(exc).__name__, exc, n)
            values = [None] * n
            num_failed[name] = n
        rewards = values_to_tensor(name, fn, values, n)
        per_function[name] = rewards
        if weight != 0.0:
            applies = ~rewards.isnan()
            total = total + torch.where(applies, float(weight) * rewards, 0.0)
            scored |= applies
            none_fails = name in NONE_IS_FAILURE or getattr(fn, "none_is_failure", False)
            unscored |= (rewards.isnan() if none_fails
                         else torch.tensor(unscored_rows(values) or [False] * n, dtype=torch.bool))
            failed = failed or num_failed[name] > 0
    if not any(w != 0.0 for w in weights.values()):
        return CombinedRewards(total=total, per_function=per_function, num_failed=num_failed)  # nothing weighted: 0
    if failed:  # a raise is not "does not apply": no row of this batch has a total
        scored.zero_()
    total = torch.where(scored & ~unscored, total, torch.full_like(total, float("nan")))
    return CombinedRewards(total=total, per_function=per_function, num_failed=num_failed)
