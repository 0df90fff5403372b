"""A model's held-out accuracy on a job spec's evaluation set: ``grpo-cluster eval --spec SPEC [--model MODEL]``.

    grpo-cluster eval --spec examples/humaneval_cpu.yaml --model builtin:SmolLM2-135M-Instruct
    grpo-cluster eval --spec examples/learn_cpu.yaml --model runs/learn_cpu/checkpoints/step_000040 --per-problem f

What the training loop's held-out evaluation (``cluster.loop.evaluation``) does between steps, done once for any
model folder (a checkpoint, an HF folder, ``builtin:...``, a hub id; default the spec's ``model.path``):

- the held-out rows and prompts of :func:`cluster.loop.evaluation.load_eval_set` (the spec's ``eval.data_path`` or
  its source's held-out split; its system prompt, prompt suffix, chat template, prompt column, ``eval.limit``,
  ``data.max_prompt_tokens``), tokenized with the evaluated model's tokenizer;
- the requests of :class:`cluster.loop.evaluation.HeldOutEval` (``eval.samples`` per prompt, ``eval.temperature``,
  greedy by default, the cap ``eval.max_tokens`` or ``rollout.max_response_tokens``, a fixed seed per prompt);
- generation on a rollout engine of ``rollout_workers.registry`` built in this process with the spec's ``rollout``
  and ``model.dtype``: the vLLM engine (``vllm``) or the transformers engine the in-process runtime uses
  (``transformers``, i.e. ``rollout.engine: hf``; no vLLM needed);
- scoring by :func:`cluster.loop.evaluation.score_problems` and :func:`~cluster.loop.evaluation.eval_metrics` with
  ``eval.accuracy_reward`` and ``eval.format_reward`` (loaded as the spec names them).

So the ``eval/*`` figures equal the loop's for the same weights on the same engine: pass@1 (mean@k with k samples)
with its 95 % Wilson interval over the completions the accuracy reward scored, those it did not (``eval/unscored``),
mean length, truncated fraction, format rate.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from cluster.loop.evaluation import EvalSet, HeldOutEval, eval_metrics, load_eval_set, score_problems
from contract.messages import GroupRequest, GroupResult

__all__ = ["ENGINES", "Engine", "SpecEval", "SpecEvalError", "engine_context_tokens", "evaluate_prepared",
           "prepare_spec_eval", "spec_engine"]

Engine = Literal["vllm", "transformers"]
#: The engines ``--engine`` takes → their ``rollout.engine`` names: the vLLM engine, or the transformers engine.
ENGINES: dict[str, str] = {"vllm": "vllm", "transformers": "hf"}
#: Generates one group per request, results in request order.
Generate = Callable[[list[GroupRequest]], list[GroupResult]]


class SpecEvalError(ValueError):
    """The spec cannot be evaluated as given (no ``eval`` section); the message says what to set."""


@dataclass(frozen=True)
class SpecEval:
    """One evaluation, prepared: everything but the engine.

    Attributes:
        spec: the job spec (with ``--set`` overrides). model: the model as given. model_path: it resolved to a local
            folder (or a hub id). evalset: the held-out prompts. held_out: the loop's evaluation of them (its
            ``requests``).
    """

    spec: object
    model: str
    model_path: str
    evalset: EvalSet
    held_out: HeldOutEval

    @property
    def questions(self) -> list[str]:
        """The problems' texts in order (what ``--against`` files are matched by)."""
        return [ex.question for ex in self.evalset.examples]

    @property
    def max_tokens(self) -> int:
        """The completion cap in tokens: ``eval.max_tokens`` or ``rollout.max_response_tokens``."""
        return self.spec.eval.max_tokens or self.spec.rollout.max_response_tokens


def prepare_spec_eval(spec, model: str | None = None) -> SpecEval:
    """Resolve the model, load its tokenizer and the spec's held-out prompts; starts no engine.

    Args:
        spec: a validated job spec with an ``eval`` section. model: what to evaluate; None: ``model.path``.

    Raises:
        SpecEvalError: the spec has no ``eval`` section. ModelError: the model cannot be resolved or has no
            tokenizer. DataError: as :func:`cluster.loop.evaluation.load_eval_set`.
    """
    from cluster.data.models import resolve_model_path
    from cluster.loop.setup import load_tokenizer

    if spec.eval is None:
        raise SpecEvalError("eval: the spec has no eval section, so it names no held-out data or scorer; add one "
                            "(e.g. eval: {accuracy_reward: code, format_reward: null}) or --set eval.accuracy_reward="
                            "NAME")
    model = model or spec.model.path
    path = resolve_model_path(model)
    evalset = load_eval_set(spec.eval, spec.data, load_tokenizer(path))
    held_out = HeldOutEval(spec.eval, evalset, spec.seed, spec.total_steps,
                           spec.eval.max_tokens or spec.rollout.max_response_tokens)
    return SpecEval(spec=spec, model=model, model_path=path, evalset=evalset, held_out=held_out)


def evaluate_prepared(prepared: SpecEval, generate: Generate) -> dict:
    """Generate the held-out completions with ``generate`` and score them.

    Returns:
        ``{"model", "metrics", "seconds", "tokens_per_s", "problems"}``: ``metrics`` the ``eval/*`` figures of the
        loop (:func:`cluster.loop.evaluation.eval_metrics`); ``seconds`` wall time of generation and scoring;
        ``tokens_per_s`` completion tokens per second of generation; ``problems`` one dict per held-out prompt in
        order: ``index`` (0, 1, ...), ``row`` (the row's index in its source), ``question``, ``correct`` (the
        fraction of its scored completions with full credit: 0 or 1 when k = 1; None when the accuracy reward scored
        none), ``format`` (mean format score over the completions it scored, None without a format reward or
        score), ``tokens`` (mean completion length), ``truncated`` (any completion cut at the cap), ``completion``
        (the first completion's text), when k > 1 ``completions`` (all k) and, when the accuracy reward left some of
        them unscored, ``unscored`` (how many).

    Raises:
        ValueError: a reward score outside [0, 1], or ``generate`` returned another number of groups.
        RewardError: a reward function failed.
    """
    t0 = time.perf_counter()
    groups = generate(prepared.held_out.requests)
    generated = time.perf_counter() - t0
    ev = prepared.spec.eval
    scores = score_problems(groups, prepared.held_out.rows, ev.accuracy_reward, ev.format_reward)
    metrics = {**eval_metrics(groups, scores), "eval/dropped": float(prepared.evalset.dropped)}
    seconds = time.perf_counter() - t0
    tokens = sum(len(ids) for g in groups for ids in g.response_ids)
    problems, start = [], 0
    for i, (g, ex, correct) in enumerate(zip(groups, prepared.held_out.rows, scores.correct)):
        k = len(g.texts)
        fmt = [v for v in scores.formatted[start:start + k] if v is not None] if scores.formatted is not None else []
        start += k
        scored = [v for v in correct if v is not None]
        row = {"index": i, "row": ex.index, "question": ex.question,
               "correct": sum(scored) / len(scored) if scored else None,
               "format": sum(fmt) / len(fmt) if fmt else None,
               "tokens": sum(len(ids) for ids in g.response_ids) / k,
               "truncated": any(r == "length" for r in g.finish_reasons), "completion": g.texts[0]}
        if k > 1:
            row["completions"] = list(g.texts)
        if len(scored) < k:
            row["unscored"] = k - len(scored)
        problems.append(row)
    return {"model": prepared.model, "metrics": metrics, "seconds": seconds,
            "tokens_per_s": tokens / max(generated, 1e-9), "problems": problems}


def engine_context_tokens(spec, max_tokens: int) -> int:
    """The engine's context length in tokens: ``rollout.max_model_len``, else ``data.max_prompt_tokens`` plus the
    larger of ``rollout.max_response_tokens`` and ``max_tokens`` (the loop's engines, sized for evaluation too)."""
    r = spec.rollout
    return r.max_model_len or spec.data.max_prompt_tokens + max(r.max_response_tokens, max_tokens)


@contextmanager
def spec_engine(prepared: SpecEval, engine: Engine = "vllm") -> Iterator[Generate]:
    """A ``generate`` over the evaluated model on ``engine``, built from the spec's ``rollout`` and ``model.dtype``.

    ``vllm``: :class:`rollout_workers.vllm.engine.VLLMEngine` in this process (its engine processes are spawned: the
    calling script needs an ``if __name__ == "__main__":`` guard). ``transformers``: the ``hf`` engine
    (:class:`rollout_workers.hf.engine.HFEngine`), the in-process fleet's. Seed ``seed``, as the loop's first
    engine.

    Raises:
        ValueError: an unknown ``engine``.
    """
    if engine not in ENGINES:
        raise ValueError(f"--engine: expected one of {list(ENGINES)}, got {engine!r}")
    from contract.model_source import ModelSource
    from rollout_workers.registry import rollout_engine

    spec, path = prepared.spec, prepared.model_path
    built = rollout_engine(ENGINES[engine])(path, spec.rollout, spec.model.dtype, spec.seed,
                                            engine_context_tokens(spec, prepared.max_tokens),
                                            source=ModelSource.of(spec.model))
    try:
        yield lambda requests: built.generate(requests, spec.rollout.group_size)[0]
    finally:
        built.shutdown()
