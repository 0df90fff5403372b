"""Held-out evaluation between steps (the spec's ``eval`` section): pass@1, or mean@k, with a 95 % Wilson interval.

The held-out prompts run on the rollout engines, which hold the trainer's current weights after each step's sync, as
:class:`contract.messages.GroupRequest` s with a :class:`contract.messages.SamplingOverride` (greedy by default, the
eval's own length cap) and a fixed seed per prompt (:func:`eval_seed`: the same at every evaluation, so two
evaluations differ only by the weights). Completions are scored (:mod:`cluster.loop.eval_scoring`) with reward
functions called as in training (``grpo.rewards.combine_rewards``: whole-row functions get the prompts and every
column of the rows): ``eval.accuracy_reward``, default the GSM8K verifier ``accuracy``, and ``eval.format_reward``,
default ``format``; the held-out rows must pass those rewards' row checks when they are loaded.

Metrics (``eval/*``, on the metrics row of the step the evaluation ran after; the starting weights' evaluation is a
row of its own with step 0):

- ``eval/accuracy``: mean@k over the scored prompts (pass@1 when k = ``eval.samples`` = 1), a proportion in [0, 1]:
  each prompt's fraction correct among its scored completions, averaged over the prompts with at least one;
  ``eval/accuracy_ci_low`` / ``eval/accuracy_ci_high``: its 95 % Wilson interval over those prompts
  (:func:`grpo.stats.accuracy_estimate`: exact for k = 1, conservative for k > 1). NaN when nothing was scored.
- ``eval/n``: completions scored (at most P · k); ``eval/problems``: prompts with at least one scored completion
  (at most P, the interval's n).
- ``eval/unscored``: completions ``eval.accuracy_reward`` gave no score (None/NaN: its verifier failed). They are not
  wrong answers: they are left out of ``eval/accuracy``, its interval, ``eval/n`` and ``eval/problems``, and an
  evaluation with any says so in a warning (the job's status line) and on the console line.
- ``eval/dropped``: held-out rows read but not evaluated: over ``data.max_prompt_tokens``, unreadable rows skipped
  (``data.on_bad_row: skip``) and, for a reasoning-gym held-out split, problems also in the training split
  (``eval.limit``'s cut is not counted). Two runs' ``eval/accuracy`` are over the same problems only if their
  ``eval/problems`` and ``eval/dropped`` agree (and their files and limits do).
- ``eval/turns_mean``, ``eval/tool_calls_mean``, ``eval/tool_success_rate``, ``eval/observation_tokens_mean``,
  ``eval/max_turns_fraction``, ``eval/token_budget_fraction`` (``rollout.multi_turn`` only: the held-out prompts run
  as episodes, as in training; ``cluster.loop.episode_metrics``).
- ``eval/response_length_mean``: mean completion length (sampled tokens), tokens; ``eval/truncated_fraction``:
  fraction of completions cut at ``eval.max_tokens`` (both over every completion generated, scored or not);
  ``eval/format_rate``: mean ``eval.format_reward`` score over the completions it scored, ``eval/format_unscored``:
  those it did not (both absent when it is null).
- ``eval/seconds``: wall seconds of the evaluation (generate + score); not counted in ``timing/*``.
- ``eval/best_accuracy``, ``eval/best_step``: the highest ``eval/accuracy`` so far and the step it was measured at
  (ties keep the earlier step; step 0 is the starting weights).

A completion the accuracy function gives no score (None/NaN) is unscored, not wrong (``eval/unscored``); the format
function's likewise (``eval/format_unscored``). Two evaluations are over the same completions only if their
``eval/unscored`` agree as well.

Agents (``rollout.agent``): the held-out prompts run as agent episodes (``eval.temperature``, the same seeds), and
each episode is scored by the agent's own reward (:func:`agent_scores`): correct when its ``accuracy`` component,
or its reward when it returns none, is at least 1; no reward (None, a failure) counts as wrong. ``eval/n`` counts
episodes (an episode trained as several sequences counts once). ``eval/reward/<name>``: the mean of each component
the agent returned, over the held-out episodes that returned it (``cluster.loop.episode_metrics.component_metrics``).

``checkpoint.keep_best`` (see :meth:`HeldOutEval.checkpoint_wanted` and :meth:`HeldOutEval.protected_step`): an
evaluation at step s >= 1 that sets a new best asks for step s's checkpoint (written then if none was due), and
``keep_last`` pruning spares it while it is the best. The best is part of the checkpoint's driver state
(``trainer_state.json`` key ``eval``), so a resumed job keeps it.
"""

from __future__ import annotations

import json
import logging
import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cluster.data import DataError, Example, load_jsonl_examples
from cluster.data.sources import load_examples, load_hf_examples
from cluster.loop.checkpoints import TRAINER_STATE
from cluster.loop.eval_scoring import (EvalScores, agent_scores, eval_metrics, score_eval, score_problems,
                                      unscored_warning)
from cluster.loop.setup import SetupError, prompt_ids, reward_checks
from contract.messages import GroupRequest, GroupResult, SamplingOverride

__all__ = ["EvalScores", "EvalSet", "HeldOutEval", "agent_scores", "eval_metrics", "eval_seed", "load_eval_set",
           "load_evaluation", "restore_best", "score_eval", "score_problems", "unscored_warning"]

logger = logging.getLogger(__name__)

#: Generates one group per request, results in request order (``EngineFleet.generate`` without step figures).
Generate = Callable[[list[GroupRequest]], list[GroupResult]]


def eval_seed(seed: int, index: int) -> int:
    """The sampling seed of held-out prompt ``index``: a CRC-32 mix of (spec seed, "eval", index), in [0, 2**31); the
    same at every evaluation of the job."""
    return zlib.crc32(f"{seed}:eval:{index}".encode()) & 0x7FFFFFFF


@dataclass(frozen=True)
class EvalSet:
    """The held-out prompts of a job.

    Attributes:
        path: the jsonl file read. field: the spec field that named it (``eval.data_path`` or ``data.test_path``).
        examples: the P rows evaluated, in file order. prompt_ids: P chat-templated prompts (token ids).
        bad_rows: unreadable rows skipped (``data.on_bad_row: skip``); for a reasoning-gym held-out split, problems
            dropped because their question is also a training one. filtered: rows dropped for being longer than
            ``data.max_prompt_tokens`` tokens (the engines' context is sized for those).
    """

    path: str
    field: str
    examples: list[Example]
    prompt_ids: list[list[int]]
    bad_rows: int
    filtered: int

    @property
    def dropped(self) -> int:
        """Held-out rows read but not evaluated (``eval/dropped``): unreadable or also in training, or too long."""
        return self.filtered + self.bad_rows


def _held_out_split(data, checks) -> tuple[str, str, list[Example], int]:
    """(field, what, examples, bad rows) of the source's own held-out split: ``data.test_path``, ``data.hub.
    test_split``, a ``reasoning_gym`` source's held-out seeds, ``humaneval``'s or ``code_functions``' held-out
    problems (its DataError names the data field already)."""
    field, path = {"reasoning_gym": ("data.reasoning_gym", "reasoning-gym held-out split"),
                   "hf_hub": ("data.hub.test_split", f"{data.hub.name}[{data.hub.test_split}]"),
                   "humaneval": ("data.humaneval", "HumanEval held-out split"),
                   "code_functions": ("data.code_functions", "code functions held-out split")}.get(
        data.source, ("data.test_path", data.test_path))
    examples, bad_rows = load_examples(data, "held_out", checks)
    return field, path, examples, bad_rows


def load_eval_set(ev, data, tokenizer, by_agent: bool = False) -> EvalSet:
    """Read the held-out prompts with ``data``'s fields and prompt (system prompt, suffix, chat template), drop
    prompts over ``data.max_prompt_tokens`` and keep the first ``eval.limit``. ``eval.data_path`` is read in the
    format of ``data.source`` (jsonl, or the ``hf_datasets`` file format; a jsonl file for ``hf_hub``); without it,
    the source's own held-out split (``data.test_path``, ``data.hub.test_split``, or a ``reasoning_gym`` source's
    held-out seeds). Rows must pass the row checks of ``eval.accuracy_reward`` and ``eval.format_reward`` (none
    with ``by_agent``: the agent scores its own episodes).

    Args:
        ev: the spec's ``eval`` section. data: its ``data`` section. tokenizer: the model's tokenizer.
        by_agent: the job has an agent (``rollout.agent``).

    Raises:
        DataError: the file is missing, unreadable or has no usable rows, a row the eval's rewards refuse, or every
            prompt is too long; prefixed with the field that named the file.
    """
    checks = () if by_agent else (*reward_checks([ev.accuracy_reward], "eval.accuracy_reward"),
                                  *reward_checks([ev.format_reward] if ev.format_reward else [], "eval.format_reward"))
    if ev.data_path is None:
        field, path, examples, bad_rows = _held_out_split(data, checks)
    else:
        field, path = "eval.data_path", ev.data_path
        fields = dict(question_field=data.question_field, answer_field=data.answer_field, on_bad_row=data.on_bad_row,
                      prompt_field=data.prompt_field, checks=checks)
        try:
            examples, bad_rows = (load_hf_examples(path, file_format=data.file_format, split=data.split, **fields)
                                  if data.source == "hf_datasets" else load_jsonl_examples(path, **fields))
        except DataError as exc:
            raise DataError(f"{field}: {exc}") from None
    ids = prompt_ids(data, tokenizer, examples, str(path))
    kept = [(ex, list(tok)) for ex, tok in zip(examples, ids) if len(tok) <= data.max_prompt_tokens]
    if not kept:
        raise DataError(f"{field}: {path}: all {len(examples)} prompts are longer than data.max_prompt_tokens="
                        f"{data.max_prompt_tokens} tokens (the shortest has {min(map(len, ids))})")
    chosen = kept if ev.limit is None else kept[:ev.limit]
    return EvalSet(path=str(path), field=field, examples=[ex for ex, _ in chosen], prompt_ids=[t for _, t in chosen],
                   bad_rows=bad_rows, filtered=len(examples) - len(kept))


class HeldOutEval:
    """When to evaluate, running one evaluation, and the best step so far.

    Args:
        ev: the spec's ``eval`` section. evalset: the held-out prompts. seed: the spec's seed. total_steps: the
            job's last step (``eval.at_end``). max_tokens: the completion cap (``eval.max_tokens`` or
            ``rollout.max_response_tokens``). keep_best: ``checkpoint.keep_best``. by_agent: score the episodes by
            the agent's own reward (:func:`agent_scores`; ``rollout.agent``).
        warn: where an evaluation's warning goes (:func:`unscored_warning`; the job passes its status line);
            default the module's logger.
    """

    def __init__(self, ev, evalset: EvalSet, seed: int, total_steps: int, max_tokens: int, keep_best: bool = False,
                 by_agent: bool = False, warn: Callable[[str], None] | None = None):
        self.ev, self.evalset, self.total_steps, self.keep_best = ev, evalset, total_steps, keep_best
        self.by_agent = by_agent
        self.warn = warn if warn is not None else logger.warning
        sampling = SamplingOverride(temperature=ev.temperature, max_tokens=max_tokens)
        self.requests = [GroupRequest(group_id=i, prompt_ids=ids, group_size=ev.samples, seed=eval_seed(seed, i),
                                      sampling=sampling) for i, ids in enumerate(evalset.prompt_ids)]
        self.rows = list(evalset.examples)
        self.best_step: int | None = None
        self.best_accuracy: float | None = None
        self._new_best_at: int | None = None  # step of the last evaluation, when it set a new best
        self._last: tuple[list[GroupResult], EvalScores] | None = None  # the last evaluation's groups and scores

    def due(self, step: int) -> bool:
        """Whether an evaluation runs after step ``step`` (0: before step 1, on the starting weights)."""
        if step == 0:
            return self.ev.at_start
        return (self.ev.at_end and step == self.total_steps) or bool(
            self.ev.every_steps and step % self.ev.every_steps == 0)

    def run(self, step: int, generate: Generate) -> dict[str, float]:
        """Evaluate the engines' current weights after step ``step``; returns the ``eval/*`` metrics.

        Raises:
            ValueError: a reward function gave a score outside [0, 1]. The engines' errors (``generate``'s).
        """
        t0 = time.perf_counter()
        groups = generate(self.requests)
        if not groups:
            raise ValueError("eval: no groups to score; expected one per held-out prompt")
        scores = (agent_scores(groups) if self.by_agent
                  else score_problems(groups, self.rows, self.ev.accuracy_reward, self.ev.format_reward))
        metrics = eval_metrics(groups, scores)
        self._last = (groups, scores)
        reward = "the agent's reward" if self.by_agent else f"eval.accuracy_reward {self.ev.accuracy_reward!r}"
        if (warning := unscored_warning(metrics, reward)) is not None:
            self.warn(f"warning: step {step}: {warning}")
        self._new_best_at = None
        accuracy = metrics["eval/accuracy"]  # NaN when nothing was scored: never a best
        if not math.isnan(accuracy) and (self.best_accuracy is None or accuracy > self.best_accuracy):
            self.best_step = step
            self.best_accuracy = accuracy
            self._new_best_at = step
        best = {} if self.best_step is None else {"eval/best_accuracy": self.best_accuracy,
                                                  "eval/best_step": float(self.best_step)}
        return {**metrics, "eval/dropped": float(self.evalset.dropped), "eval/seconds": time.perf_counter() - t0,
                **best}

    def results(self) -> tuple[list[GroupResult], list[str], list[list[float]], list[float] | None]:
        """The last evaluation's per-problem results (``cluster.loop.samples.SampleRecorder.eval_records``'s
        arguments): its P groups, the P reference answers, each problem's k outcomes and the P·k format scores (None
        without a format reward).

        Raises:
            RuntimeError: no evaluation ran yet.
        """
        if self._last is None:
            raise RuntimeError("HeldOutEval.results: no evaluation has run yet")
        groups, scores = self._last
        return groups, [ex.reference for ex in self.rows], scores.correct, scores.formatted

    def checkpoint_wanted(self, step: int) -> bool:
        """With ``keep_best``: the evaluation after step ``step`` (>= 1) set a new best, so its checkpoint is due."""
        return self.keep_best and step >= 1 and self._new_best_at == step

    def protected_step(self) -> int | None:
        """With ``keep_best``: the best step, whose checkpoint ``keep_last`` must not delete (None: nothing to
        protect, e.g. the best is the starting model at step 0)."""
        return self.best_step if self.keep_best and self.best_step else None

    def state_dict(self) -> dict:
        """``{"best_step", "best_accuracy"}`` (None before the first evaluation), for ``trainer_state.json``."""
        return {"best_step": self.best_step, "best_accuracy": self.best_accuracy}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore :meth:`state_dict`; None (a checkpoint of a job without eval) leaves no best."""
        state = state or {}
        self.best_step, self.best_accuracy = state.get("best_step"), state.get("best_accuracy")


def load_evaluation(spec, tokenizer, status: Callable[[str], None]) -> HeldOutEval | None:
    """The job's :class:`HeldOutEval` (None without an ``eval`` section), its prompts loaded and tokenized now so a
    bad file stops the job before Ray starts.

    Raises:
        DataError: as :func:`load_eval_set`.
    """
    ev = spec.eval
    if ev is None:
        return None
    evalset = load_eval_set(ev, spec.data, tokenizer, by_agent=spec.rollout.agent is not None)
    # a generated held-out split has no unreadable rows: what it drops are problems also in the training split
    dropped = "also in the training split" if spec.data.source == "reasoning_gym" and ev.data_path is None else \
        "bad rows"
    status(f"eval: {len(evalset.examples)} held-out prompts x {ev.samples} from {evalset.path} ({evalset.bad_rows} "
           f"{dropped} skipped, {evalset.filtered} over data.max_prompt_tokens dropped)")
    return HeldOutEval(ev, evalset, spec.seed, spec.total_steps, ev.max_tokens or spec.rollout.max_response_tokens,
                       keep_best=spec.checkpoint.keep_best, by_agent=spec.rollout.agent is not None, warn=status)


def restore_best(evaluation: HeldOutEval | None, checkpoint: Path) -> None:
    """Restore the best step from checkpoint ``checkpoint``'s driver state (key ``eval``) into ``evaluation``.

    Raises:
        SetupError: the driver state cannot be read (naming the file).
    """
    if evaluation is None:
        return
    state_file = checkpoint / TRAINER_STATE
    try:
        evaluation.load_state_dict(json.loads(state_file.read_text()).get("eval"))
    except (OSError, ValueError, AttributeError) as exc:
        raise SetupError(f"resume: {state_file}: cannot restore the eval best step: {type(exc).__name__}: {exc}") \
            from None
