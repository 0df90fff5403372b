"""Reward-function registry and weighted combination of rewards.

A reward function scores a batch: `fn(completions: list[str], references: list[str]) -> list[float | None]`, one
value per completion, None (or NaN) meaning "no valid reward" for that row. `combine_rewards` runs the functions named
in a weight dict and returns the weighted sum as a float32 tensor with NaN where any weighted function gave None, which
`grpo.advantages.compute_advantages` treats as "excluded, advantage 0".
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Literal, NamedTuple, Protocol

import torch

from grpo.registry import Registry
from grpo.rewards.code import code_reward
from grpo.rewards.gsm8k import accuracy_reward, extract_answer, format_reward, parse_reference
from grpo.rewards.overlong import overlong_penalty
from grpo.rewards.reasoning_gym import reasoning_gym_reward

RewardFunctionName = Literal["accuracy", "format", "reasoning_gym", "code"]
OnError = Literal["raise", "none"]

__all__ = [
    "OVERLONG_PENALTY_KEY",
    "RESERVED_REWARD_NAMES",
    "REWARD_FUNCTIONS",
    "REWARD_SUMMARY_METRICS",
    "CombinedRewards",
    "OnError",
    "RewardFunctionName",
    "accuracy_reward",
    "code_reward",
    "combine_rewards",
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
    def __call__(self, completions: list[str], references: list[str]) -> Sequence[float | None]: ...


#: Step summaries the driver reports as ``reward/<name>`` (see `reward_metrics`), besides one ``reward/<function>``
#: per reward function. ``reward/mean`` is what the alerts in deploy/prometheus read.
REWARD_SUMMARY_METRICS: dict[str, str] = {
    "mean": "mean total reward over the step's completions with a valid reward",
    "std": "standard deviation of that total reward",
    "failed": "reward evaluations that raised",
    "none_fraction": "fraction of completions without a valid reward",
}
#: Component the driver adds for the DAPO overlong penalty (``reward/overlong_penalty``).
OVERLONG_PENALTY_KEY = "overlong_penalty"
#: Names no reward function may take: its ``reward/<name>`` metric would overwrite the driver's.
RESERVED_REWARD_NAMES: frozenset[str] = frozenset({*REWARD_SUMMARY_METRICS, OVERLONG_PENALTY_KEY})



def prometheus_safe_name(name: str) -> str:
    """A reward name as it appears in its Prometheus series ``grpo_reward_<name>`` (cluster.ops.metrics.prometheus_name:
    characters outside [a-zA-Z0-9_:] become ``_``), so ``none-fraction`` is the ``none_fraction`` series."""
    return re.sub(r"[^a-zA-Z0-9_:]", "_", name)


REWARD_FUNCTIONS: Registry[RewardFunction] = Registry("reward function", reserved={
    **{name: f"the driver reports reward/{name} ({what})" for name, what in REWARD_SUMMARY_METRICS.items()},
    OVERLONG_PENALTY_KEY: f"the driver reports reward/{OVERLONG_PENALTY_KEY} (the DAPO overlong penalty)",
}, same_name=prometheus_safe_name)


def register_reward_function(name: str):
    """Decorator adding a batch reward function to `REWARD_FUNCTIONS`.

    Raises:
        ValueError: a duplicate name, or a reserved one (`RESERVED_REWARD_NAMES`: mean, std, failed, none_fraction,
            overlong_penalty), whose ``reward/<name>`` metric would overwrite the driver's; also a name that is one
            of those once written as a Prometheus metric name (`prometheus_safe_name`: ``none-fraction``,
            ``overlong.penalty``), or that is the same as a registered function's there (``a-b`` after ``a_b``).
    """
    return REWARD_FUNCTIONS.register(name)


def reward_metrics(total: torch.Tensor, per_function: Mapping[str, torch.Tensor], num_failed: int) -> dict:
    """The step's ``reward/`` metrics: ``reward/<summary>`` for each of `REWARD_SUMMARY_METRICS` and
    ``reward/<function>`` (mean over rows with a value) for each component.

    Args:
        total: [N] float32 total rewards, NaN = no valid reward.
        per_function: component name → [N] float32 unweighted rewards (NaN = none); no reserved name.
        num_failed: reward evaluations that raised (completions × functions).

    Raises:
        ValueError: a component named like a summary (it would overwrite it).
    """
    clash = sorted(set(per_function) & set(REWARD_SUMMARY_METRICS))
    if clash:
        raise ValueError(f"reward components {clash} would overwrite the summary metrics reward/{clash[0]}; "
                         f"reserved: {', '.join(sorted(RESERVED_REWARD_NAMES))}")
    valid = total[~total.isnan()]
    summary = {
        "mean": float(valid.mean()) if valid.numel() else float("nan"),
        "std": float(valid.std()) if valid.numel() > 1 else 0.0,
        "failed": num_failed,
        "none_fraction": float(total.isnan().float().mean()),
    }
    assert summary.keys() == REWARD_SUMMARY_METRICS.keys()  # one list of names: REWARD_SUMMARY_METRICS
    return {**{f"reward/{name}": float(v.nanmean()) for name, v in per_function.items()},
            **{f"reward/{name}": value for name, value in summary.items()}}


@register_reward_function("accuracy")
def _accuracy(completions: list[str], references: list[str]) -> list[float | None]:
    """GSM8K numeric accuracy, 1.0/0.0 per completion (`grpo.rewards.gsm8k.accuracy_reward`).

    A reference without a number raises `ValueError` for the whole batch (a data error, not a model error).
    """
    return [accuracy_reward(c, r) for c, r in zip(completions, references, strict=True)]


@register_reward_function("format")
def _format(completions: list[str], references: list[str]) -> list[float | None]:
    """1.0 for a worked solution ending in one "#### <number>" line, never for the answer line alone (rules F1-F5 of
    `grpo.rewards.gsm8k`, `format_reward`); ignores references."""
    return [format_reward(c) for c in completions]


@register_reward_function("reasoning_gym")
def _reasoning_gym(completions: list[str], references: list[str]) -> list[float | None]:
    """reasoning-gym's own scorer of the task each reference names (`grpo.rewards.reasoning_gym`): for prompts from
    ``data.source: reasoning_gym``. A reference of another kind raises `ValueError` for the whole batch."""
    return list(reasoning_gym_reward(completions, references))


#: Keyword arguments in TRL's convention: ``code(completions=[...], tests=[...], **other_columns)`` (grpo.rewards.code).
register_reward_function("code")(code_reward)


class CombinedRewards(NamedTuple):
    """Result of `combine_rewards`; unpacks as `total, per_function, num_failed = combine_rewards(...)`.

    Attributes:
        total: [N] float32, Σ weight·reward over functions with a nonzero weight; NaN in a row where any of them gave
            None/NaN (or failed with on_error="none").
        per_function: name → [N] float32 unweighted rewards (NaN for None), for every function in `weights`.
        num_failed: name → number of rows set to NaN because that function raised (0 or N per call; with
            on_error="raise" it is always 0). Failures are also logged as warnings.
    """

    total: torch.Tensor
    per_function: dict[str, torch.Tensor]
    num_failed: dict[str, int]


def _to_tensor(name: str, values: object, n: int) -> torch.Tensor:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"reward function {name!r} must return a sequence of {n} values, got {type(values).__name__}")
    if len(values) != n:
        raise ValueError(f"reward function {name!r} returned {len(values)} values, expected {n} (one per completion)")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
        elif isinstance(v, Real):
            out.append(float(v))
        else:
            raise ValueError(f"reward function {name!r} returned {type(v).__name__} at row {i}, expected float or None")
    return torch.tensor(out, dtype=torch.float32)


def combine_rewards(
    completions: Sequence[str],
    references: Sequence[str],
    weights: Mapping[RewardFunctionName, float],
    *,
    on_error: OnError = "raise",
) -> CombinedRewards:
    """Run the weighted reward functions on a batch and sum them.

    Args:
        completions: N model completions (EOS stripped).
        references: N reference answers (e.g. GSM8K answer fields), row-aligned with completions.
        weights: function name (in `REWARD_FUNCTIONS`) → finite weight; a weight of 0 still runs the function (for
            logging) but keeps it out of `total`.
        on_error: what to do when a function raises: "raise" → `RuntimeError` naming the function (the original
            exception chained); "none" → that function's rewards are None (NaN) for the whole batch, counted in
            `num_failed` and logged.

    Returns:
        `CombinedRewards(total, per_function, num_failed)` (see its doc). ±Inf rewards pass through unchanged.

    Raises:
        ValueError: length mismatch of the inputs, empty or unknown weights, non-finite weight, bad on_error, or a
            function returning the wrong number of values / non-numeric values (always raised: a bug, not a
            transient failure).
        RuntimeError: a function raised and on_error="raise".
    """
    if on_error not in ("raise", "none"):
        raise ValueError(f"on_error must be 'raise' or 'none', got {on_error!r}")
    if len(completions) != len(references):
        raise ValueError(f"got {len(completions)} completions but {len(references)} references; expected equal")
    if not weights:
        raise ValueError(f"weights must name at least one reward function of {sorted(REWARD_FUNCTIONS)}")
    n = len(completions)
    total = torch.zeros(n, dtype=torch.float32)
    per_function: dict[str, torch.Tensor] = {}
    num_failed: dict[str, int] = {}
    for name, weight in weights.items():
        fn = REWARD_FUNCTIONS.lookup(name)
        if not math.isfinite(weight):
            raise ValueError(f"weight of reward function {name!r} must be finite, got {weight!r}")
        num_failed[name] = 0
        try:
            values = fn(list(completions), list(references))
        except Exception as exc:
            if on_error == "raise":
                raise RuntimeError(f"reward function {name!r} raised {type(exc).__name__}: {exc}") from exc
            logger.warning("reward function %r raised %s: %s; its %d rewards are None", name,
                           type(exc).__name__, exc, n)
            values = [None] * n
            num_failed[name] = n
        rewards = _to_tensor(name, values, n)
        per_function[name] = rewards
        if weight != 0.0:
            total = total + float(weight) * rewards
    return CombinedRewards(total=total, per_function=per_function, num_failed=num_failed)
