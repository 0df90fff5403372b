"""Procedurally generated verifiable tasks from reasoning-gym (github.com/open-thought/reasoning-gym, Apache-2.0),
scored by the task's own ``score_answer``.

A task is a reasoning-gym dataset name (``chain_sum``, ``basic_arithmetic``, … 106 in 0.1.25) with a config (the
dataset's config dataclass fields, e.g. ``{min_terms: 2, max_terms: 2}``), a seed and a size. reasoning-gym generates
item ``i`` from ``random.Random(seed + i)`` (``ProceduralDataset.__getitem__`` of its datasets), so a
(task, config, seed, index) tuple names one problem exactly, and two splits are disjoint in their generator seeds when
their ranges ``[seed, seed + size)`` do not overlap (:func:`seed_ranges_overlap`).

Each problem's reference, as the reward functions receive it, is a JSON object (:func:`encode_reference`) naming that
tuple; the reward regenerates the entry (question, answer, metadata) and calls the task's ``score_answer`` on the
answer the completion commits to (:func:`committed_final_answer`). Its final answer (:func:`extract_final_answer`) is
the text after the last ``####`` (the project's answer-line convention, see ``grpo.rewards.gsm8k``), else
reasoning-gym's own ``<answer>…</answer>`` tag, else none (score 0). It counts only when the completion commits to it,
by the rule of :mod:`grpo.rewards.final_answer` (every answer verifier's): every final-answer statement (``####``
lines, ``<answer>`` tags, ``\\boxed{}``, "the answer is" phrases) names the same answer — for a numeric answer, the
same number with no alternative in any statement and no hedge after the last one; for a text answer, the same text
(a phrase: containing it, with no hedge word it lacks). "#### 30\\n#### 31", "<answer>30</answer><answer>31</answer>"
and "The answer is 30.\\n#### 31" score 0 whichever value is right.

With ``answer_extraction: last_number`` (``data.reasoning_gym.answer_extraction``, carried in the reference) a
completion with neither falls back to the number it commits to: the one its boxes and answer phrases name, else its
last number (lm-evaluation-harness's "flexible-extract" rule for GSM8K), when that is not one of a list, a range or a
disjunction ("either 30 or 31" scores 0). Small instruct models rarely write the marker (``../shared/GUIDE.md``:
SmolLM2-135M-Instruct on chain_sum), so under the strict rule nearly every group is all-zero and carries no GRPO
signal. The fallback still pays only a correct number: it cannot be won without the answer.

Partial credit. Some reasoning-gym scorers pay part of a point for a wrong answer: chain_sum's decimal scorer pays
``len(oracle) / len(answer)`` when the answer contains the oracle as a substring, so ``-191``, ``1911`` and ``191.5``
earn 0.75, 0.75 and 0.6 against 191 (a sign error would get a positive GRPO advantage). By default the reward is
therefore 1.0 for a full score and 0.0 otherwise; ``data.reasoning_gym.partial_credit: true`` (carried in the
reference) passes the task's score through unchanged. Held-out pass@1 counts full scores only either way. Scores are
in [0, 1]. Only the extracted answer (never the whole completion) is scored, because of that substring rule.

Imports reasoning_gym lazily (only where a task is used), so the project runs without it for other data sources.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from grpo.rewards.answer_text import normalize_signs
from grpo.rewards.final_answer import HEDGE_WORDS, commits_to_number, committed_number, statements
from grpo.rewards.numbers import normalize_number

__all__ = ["ANSWER_EXTRACTIONS", "REFERENCE_KIND", "check_reference", "check_task", "committed_final_answer",
           "encode_reference", "extract_final_answer",
           "generate_entries", "reasoning_gym_reward", "score_completion", "seed_ranges_overlap"]

REFERENCE_KIND = "reasoning_gym"
ANSWER_MARKER = "####"
#: How the answer is read from a completion (see the module docstring); "marker" is the default.
ANSWER_EXTRACTIONS = ("marker", "last_number")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
INSTALL_HINT = "pip install 'grpo-cluster[tasks]' (reasoning-gym==0.1.25)"


def _registry() -> dict[str, Any]:
    """reasoning-gym's dataset registry: name → (dataset class, config class); ImportError with the install hint."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as exc:
        raise ImportError(f"reasoning-gym is not installed ({exc}); {INSTALL_HINT}") from None
    return DATASETS


def check_task(task: str, config: Mapping[str, Any]) -> None:
    """Refuse an unknown task or a config its dataset rejects.

    Raises:
        ValueError: unknown task name (the message lists close names and the count of known ones), or a config
            key/value the task's config class or its ``validate()`` refuses.
        ImportError: reasoning-gym is not installed.
    """
    datasets = _registry()
    if task not in datasets:
        import difflib

        close = difflib.get_close_matches(task, list(datasets), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown reasoning-gym task {task!r}{hint} ({len(datasets)} tasks known, e.g. chain_sum, "
                         f"basic_arithmetic; see reasoning_gym.factory.DATASETS)")
    _, config_cls = datasets[task]
    reserved = sorted({"seed", "size"} & set(config))
    if reserved:
        raise ValueError(f"config key {reserved[0]!r} is set by the split (seed, size fields), not by the task config")
    try:
        cfg = config_cls(**dict(config), seed=0, size=1)
        if hasattr(cfg, "validate"):
            cfg.validate()
    except (TypeError, ValueError, AssertionError) as exc:
        raise ValueError(f"task {task!r} refuses config {dict(config)!r}: {exc or type(exc).__name__}") from None


@lru_cache(maxsize=64)
def _dataset(task: str, config_json: str, seed: int, size: int):
    datasets = _registry()
    dataset_cls, config_cls = datasets[task]
    cfg = config_cls(**json.loads(config_json), seed=seed, size=size)
    if hasattr(cfg, "validate"):
        cfg.validate()
    return dataset_cls(config=cfg)


def _config_json(config: Mapping[str, Any]) -> str:
    return json.dumps(dict(config), sort_keys=True)


def generate_entries(task: str, config: Mapping[str, Any], seed: int, size: int) -> list[dict[str, Any]]:
    """Items 0 .. size-1 of ``task`` with ``config`` and ``seed``: dicts with ``question``, ``answer`` (str) and
    ``metadata``; the same arguments give the same items on every machine (reasoning-gym seeds each item)."""
    dataset = _dataset(task, _config_json(config), seed, size)
    return [dataset[i] for i in range(size)]


def encode_reference(task: str, config: Mapping[str, Any], seed: int, size: int, index: int,
                     answer_extraction: str = "marker", partial_credit: bool = False) -> str:
    """The reference string of item ``index``: compact JSON ``{"kind": "reasoning_gym", "task", "config", "seed",
    "size", "index"}`` with sorted keys, plus ``"answer_extraction"`` when it is not the default ``"marker"`` and
    ``"partial_credit": true`` when set.

    Raises:
        ValueError: ``answer_extraction`` not in :data:`ANSWER_EXTRACTIONS`.
    """
    if answer_extraction not in ANSWER_EXTRACTIONS:
        raise ValueError(f"answer_extraction must be one of {ANSWER_EXTRACTIONS}, got {answer_extraction!r}")
    ref = {"kind": REFERENCE_KIND, "task": task, "config": dict(config), "seed": seed, "size": size, "index": index}
    if answer_extraction != "marker":
        ref["answer_extraction"] = answer_extraction
    if partial_credit:
        ref["partial_credit"] = True
    return json.dumps(ref, sort_keys=True, separators=(",", ":"))


def _decode_reference(reference: str) -> tuple[Any, dict[str, Any], str, bool]:
    """(dataset, entry, answer_extraction, partial_credit) named by an `encode_reference` string; ValueError for
    anything else."""
    try:
        ref = json.loads(reference)
    except (TypeError, json.JSONDecodeError):
        ref = None
    if not isinstance(ref, dict) or ref.get("kind") != REFERENCE_KIND:
        raise ValueError(f"expected a reasoning-gym reference (JSON with kind {REFERENCE_KIND!r}, written by "
                         f"data.source: reasoning_gym), got {str(reference)[:80]!r}")
    extraction = ref.get("answer_extraction", "marker")
    if extraction not in ANSWER_EXTRACTIONS:
        raise ValueError(f"reasoning-gym reference has answer_extraction {extraction!r}, expected one of "
                         f"{ANSWER_EXTRACTIONS}")
    dataset = _dataset(ref["task"], _config_json(ref["config"]), int(ref["seed"]), int(ref["size"]))
    return dataset, dataset[int(ref["index"])], extraction, ref.get("partial_credit") is True


def check_reference(reference: str) -> None:
    """The ``reasoning_gym`` reward's row check (``check_row``): ``reference`` is an :func:`encode_reference` string
    (JSON with kind ``reasoning_gym``, a task, config, seed, size and index). Cheap: generates nothing.

    Raises:
        ValueError: anything else (e.g. a GSM8K answer), naming what was expected.
    """
    try:
        ref = json.loads(reference)
    except (TypeError, json.JSONDecodeError):
        ref = None
    keys = {"task", "config", "seed", "size", "index"}
    if not isinstance(ref, dict) or ref.get("kind") != REFERENCE_KIND or not keys <= set(ref):
        raise ValueError(f"expected a reasoning-gym reference (JSON with kind {REFERENCE_KIND!r} and "
                         f"{', '.join(sorted(keys))}, written by data.source: reasoning_gym), got "
                         f"{str(reference)[:80]!r}")
    if ref.get("answer_extraction", "marker") not in ANSWER_EXTRACTIONS:
        raise ValueError(f"reasoning-gym reference has answer_extraction {ref['answer_extraction']!r}, expected one of "
                         f"{ANSWER_EXTRACTIONS}")


def extract_final_answer(completion: str, answer_extraction: str = "marker") -> str | None:
    """The answer a completion gives: the first line after its last ``####``, stripped; else the last
    ``<answer>…</answer>`` tag's content (reasoning_gym.utils.extract_answer's rule); else, with
    ``answer_extraction="last_number"``, its last number (commas removed); else None. A sign written with another
    sign character (``grpo.rewards.answer_text.MINUS_SIGNS``, ``PLUS_SIGNS``: Unicode minus, en dash, ...) reads as
    "-"/"+" in a numeric answer and in the last-number fallback ("−7" is "-7").

    >>> extract_final_answer("2 + 3 = 5\\n#### 5")
    '5'
    >>> extract_final_answer("<answer> 5 </answer>")
    '5'
    >>> extract_final_answer("So 12 - 19 = -7.", "last_number")
    '-7'
    """
    head, marker, tail = completion.rpartition(ANSWER_MARKER)
    if marker:
        line = tail.strip().split("\n", 1)[0].strip()
        return _ascii_signed_number(line) or None
    tags = re.findall(r"<answer>\s?(.*?)\s?</answer>", completion, flags=re.DOTALL)
    if tags:
        return _ascii_signed_number(tags[-1].strip())
    if answer_extraction == "last_number":
        numbers = _NUMBER.findall(normalize_signs(completion))
        return numbers[-1].replace(",", "") if numbers else None
    return None


def _ascii_signed_number(answer: str) -> str:
    """``answer`` with its sign written "-"/"+" when it is a number signed with another sign character (Unicode
    minus, en dash, ...: ``grpo.rewards.answer_text.MINUS_SIGNS``), so a task's string comparison sees "-7" for
    "−7"; any other answer unchanged."""
    normalized = normalize_signs(answer)
    return normalized if normalized != answer and _NUMBER.fullmatch(normalized.lstrip("+")) else answer


def _as_number(answer: str) -> str | None:
    """The canonical number an answer text is (signs normalised, commas and one trailing "." allowed: "1,000.",
    "−7"), else None."""
    text = normalize_signs(answer).strip().removesuffix(".").replace(",", "")
    return normalize_number(text) if _NUMBER.fullmatch(text.lstrip("+")) else None


def _same_text(answer: str, statement) -> bool:
    """A statement names the text answer ``answer``: its text is the answer (stripped, a trailing "." and the sign
    characters aside); an answer phrase may hold more words, but must contain it and no hedge word it lacks."""
    said = _ascii_signed_number(statement.text.strip().removesuffix(".").strip())
    if statement.kind != "phrase":
        return said == answer or said == answer.removesuffix(".")
    hedges = {w for w in HEDGE_WORDS if re.search(rf"(?i)\b{w}\b", said) and not re.search(rf"(?i)\b{w}\b", answer)}
    return answer in said and not hedges


def committed_final_answer(completion: str, answer_extraction: str = "marker") -> str | None:
    """The answer the completion commits to (module doc; C1-C4 of :mod:`grpo.rewards.final_answer`), else None (a
    hedge, or no answer): its ``####`` line or ``<answer>`` tag (:func:`extract_final_answer`) when every statement
    names the same answer; with ``answer_extraction="last_number"`` and neither, the number it commits to (the one
    its boxes and answer phrases name, else its last number)."""
    answer = extract_final_answer(completion, "marker")
    if answer is None:
        return committed_number(completion) if answer_extraction == "last_number" else None
    number = _as_number(answer)
    if number is not None:
        return answer if commits_to_number(completion, number) else None
    named = [s for s in statements(completion) if s.text.strip()]
    return answer if all(_same_text(answer, s) for s in named) else None


def score_completion(completion: str, reference: str) -> float:
    """The completion's score for the referenced item: 1.0 when reasoning-gym's ``score_answer`` gives the answer it
    commits to (:func:`committed_final_answer`) full credit, else 0.0 (also for a hedge); with ``partial_credit`` in
    the reference, ``score_answer`` itself (float in [0, 1]; a hedge still scores 0).

    Raises:
        ValueError: ``reference`` is not a reasoning-gym reference (a data error: GSM8K data with this reward).
    """
    dataset, entry, extraction, partial = _decode_reference(reference)
    score = float(dataset.score_answer(committed_final_answer(completion, extraction), entry))
    return score if partial else (1.0 if score >= 1.0 else 0.0)


def reasoning_gym_reward(completions: list[str], references: list[str]) -> list[float]:
    """Batch form of `score_completion` (the ``reasoning_gym`` reward function)."""
    return [score_completion(c, r) for c, r in zip(completions, references, strict=True)]


def seed_ranges_overlap(seed_a: int, size_a: int, seed_b: int, size_b: int) -> bool:
    """Whether two splits share a generator seed: ``[seed_a, seed_a + size_a)`` and ``[seed_b, seed_b + size_b)``
    intersect."""
    return seed_a < seed_b + size_b and seed_b < seed_a + size_a
