"""The step's samples (``metrics.samples_per_step``): a few groups of every step, and every problem of each held-out
evaluation, as records a person reads (``samples.jsonl``, each tracker's table, ``grpo-cluster report``).

Which groups: :func:`chosen_groups`, deterministic — the first group of the step's trained batch whose rewards differ
(a "mixed" group, the ones that carry a learning signal), when there is one, and the first groups in batch order up
to ``samples_per_step``. The train phase asks the trainer for the per-token logprobs of exactly those rows
(``PackedMicroBatch.traced``), so a sample shows per token the trainer-vs-engine logprob gap that
``rollout/logprob_diff`` averages.

A train record is one group (``kind: "train"``); an eval record one held-out problem (``kind: "eval"``). Both are
plain JSON data (:class:`SampleRecorder` docstrings give every key); text and per-token data are cut to
``metrics.sample_max_tokens`` tokens per completion (``cut`` marks a completion that was longer; a prompt keeps its
last tokens), so the file grows by a bounded amount per step. A multi-turn episode's completion (``rollout.
multi_turn``, an agent's episode) has ``turns``: its runs of sampled tokens (``assistant``, with the tool calls each
holds) and of inserted tokens (``observation``: tool output, the environment's or the agent's messages), and
``episode``: its summary (``contract.messages.EpisodeSummary``'s fields).

Notation: N rows (completions) in the step's batch, R_i tokens in row i.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from contract.batches import RolloutBatch
from contract.messages import GroupResult, TrainResult
from grpo.environments.tool_calls import CallError, parse_tool_calls

__all__ = ["SampleRecorder", "TokenTexts", "chosen_groups", "sample_rows", "traced_mask"]

#: Tokens of context decoded before each token to find its text (a SentencePiece word start, a multi-byte character).
CONTEXT_TOKENS = 4
#: Tokens one character may span (UTF-8 has at most 4 bytes; byte-fallback tokenizers spend a token on each).
MAX_CHARACTER_TOKENS = 4
#: Significant digits kept of rewards, advantages, logprobs and gaps (a gap of 1e-6 nats stays visible).
DIGITS = 4


def _group_rows(batch: RolloutBatch) -> dict[int, list[int]]:
    """Group id → its rows, groups in first-seen order."""
    rows: dict[int, list[int]] = {}
    for i, gid in enumerate(batch.group_ids.tolist()):
        rows.setdefault(int(gid), []).append(i)
    return rows


def _mixed(rewards: list[float]) -> bool:
    """Whether the rewards that exist (not NaN) differ: the group carries a learning signal."""
    scored = {r for r in rewards if not math.isnan(r)}
    return len(scored) > 1


def chosen_groups(batch: RolloutBatch, count: int) -> list[int]:
    """The ids of the ``count`` groups of ``batch`` that make the step's sample, in batch order: the first group whose
    rewards differ (when one does) and the first groups in order; all groups when there are at most ``count``."""
    if count <= 0:
        return []
    groups = _group_rows(batch)
    rewards = batch.rewards.tolist()
    mixed = next((gid for gid, rows in groups.items() if _mixed([rewards[i] for i in rows])), None)
    chosen = [] if mixed is None else [mixed]
    chosen += [gid for gid in groups if gid != mixed][:count - len(chosen)]
    return [gid for gid in groups if gid in chosen]


def sample_rows(batch: RolloutBatch, count: int) -> list[int]:
    """The rows of :func:`chosen_groups` (ascending): the sequences whose per-token trainer logprobs are asked for."""
    groups = _group_rows(batch)
    return sorted(i for gid in chosen_groups(batch, count) for i in groups[gid])


def _number(value: float | None) -> float | None:
    """A finite float to :data:`DIGITS` significant digits; None for None, NaN or ±inf (JSON has neither)."""
    if value is None:
        return None
    value = float(value)
    return float(f"{value:.{DIGITS}g}") if math.isfinite(value) else None


def _finite_or_none(value: Any) -> Any:
    """``value`` with every NaN or ±inf float inside it (dicts, lists, tuples) as None: JSON has neither (an
    episode's ``turn_reward`` is NaN when it has no reward)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value


def _scored_mean(outcomes: list[float | None]) -> float | None:
    """The mean of the scored outcomes (None: none was scored), as ``eval/accuracy`` counts them."""
    scored = [v for v in outcomes if v is not None]
    return _number(sum(scored) / len(scored)) if scored else None


class TokenTexts:
    """Each token's text, so that a completion's tokens joined give its decoded text (special tokens shown).

    Token i's text is decode(ids[i−c : i+1]) minus decode(ids[i−c : i]) with c = :data:`CONTEXT_TOKENS`: the context
    keeps a word start's space (SentencePiece drops it when a token is decoded alone). A token that ends inside a
    multi-byte character (decoded as U+FFFD) has the text "" and the token that completes the character carries the
    text of both.

    Args:
        tokenizer: the model's tokenizer (``batch_decode``).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def __call__(self, ids: Sequence[int]) -> list[str]:
        ids = [int(t) for t in ids]
        if not ids:
            return []
        starts = [max(0, i - CONTEXT_TOKENS) for i in range(len(ids))]
        options = dict(skip_special_tokens=False, clean_up_tokenization_spaces=False)
        before = self.tokenizer.batch_decode([ids[s:i] for i, s in enumerate(starts)], **options)
        upto = self.tokenizer.batch_decode([ids[s:i + 1] for i, s in enumerate(starts)], **options)
        out: list[str] = []
        first = None  # the first token of an unfinished character, whose text the token finishing it carries
        for i in range(len(ids)):
            if first is None:
                prev, full, first_i = before[i], upto[i], i
            else:
                context = max(0, first - CONTEXT_TOKENS)
                prev, full, first_i = self.decode(ids[context:first]), self.decode(ids[context:i + 1]), first
            if full.endswith("\ufffd") and i + 1 < len(ids) and i - first_i < MAX_CHARACTER_TOKENS:
                out.append("")
                first = first_i
                continue
            prev = prev.rstrip("\ufffd")
            out.append(full[len(prev):] if full.startswith(prev) else self.decode(ids[first_i:i + 1]))
            first = None
        return out


def _turns(texts: list[str], sampled: list[bool]) -> list[dict]:
    """A multi-turn completion's runs of sampled tokens (``assistant``, with its ``tool_calls``) and of inserted
    tokens (``observation``): ``{"role", "start", "end", "text"}``, token indexes [start, end)."""
    turns, start = [], 0
    for i in range(1, len(sampled) + 1):
        if i == len(sampled) or sampled[i] != sampled[start]:
            text = "".join(texts[start:i])
            turn = {"role": "assistant" if sampled[start] else "observation", "start": start, "end": i, "text": text}
            if sampled[start]:
                turn["tool_calls"] = [{"error": c.message, "text": c.text} if isinstance(c, CallError)
                                      else {"name": c.name, "arguments": c.arguments} for c in parse_tool_calls(text)]
            turns.append(turn)
            start = i
    return turns


class SampleRecorder:
    """Makes the sample records of a step (:meth:`train_records`) and of a held-out evaluation
    (:meth:`eval_records`) and keeps them until the step is logged (:meth:`take`).

    Args:
        tokenizer: the model's tokenizer. samples_per_step: ``metrics.samples_per_step`` (0: no records at all).
        max_tokens: ``metrics.sample_max_tokens``.

    Attributes:
        seconds: wall seconds spent making records so far (their cost, docs/results.md).
    """

    def __init__(self, tokenizer, samples_per_step: int, max_tokens: int):
        self.tokens = TokenTexts(tokenizer)
        self.samples_per_step = samples_per_step
        self.max_tokens = max_tokens
        self.pending: list[dict] = []
        self.seconds = 0.0

    def take(self) -> list[dict]:
        """The records made since the last call, in order (then forgotten)."""
        out, self.pending = self.pending, []
        return out

    def _prompt(self, ids: Sequence[int]) -> dict:
        """``{"prompt", "prompt_tokens", "prompt_cut"}``: the text of the last ``max_tokens`` prompt tokens."""
        return {"prompt": self.tokens.decode(list(ids)[-self.max_tokens:]), "prompt_tokens": len(ids),
                "prompt_cut": len(ids) > self.max_tokens}

    def _text(self, ids: Sequence[int], text: str) -> tuple[str, bool]:
        """The completion's text, and whether it was cut to ``max_tokens`` tokens."""
        if len(ids) <= self.max_tokens:
            return text, False
        return self.tokens.decode(list(ids)[:self.max_tokens]), True

    def _episode(self, episode, texts: list[str] | None, ids: Sequence[int], sampled: list[bool]) -> dict:
        """A multi-turn completion's ``episode`` summary and ``turns`` ({} for a single completion)."""
        if episode is None:
            return {}
        texts = texts if texts is not None else self.tokens(list(ids)[:self.max_tokens])
        return {"episode": _finite_or_none(dataclasses.asdict(episode)), "turns": _turns(texts, sampled[:len(texts)])}

    # ---- training -------------------------------------------------------------------------------------------------
    def train_records(self, step: int, batch: RolloutBatch, result: TrainResult, version_at_train: int,
                      policy_version: int) -> None:
        """Make the step's train records (one per :func:`chosen_groups` group) and keep them for :meth:`take`.

        A record: ``kind`` "train", ``step``, ``policy_version`` (after the step), ``group_id``, ``mixed`` (its
        rewards differ), ``reference``, ``prompt``/``prompt_tokens``/``prompt_cut``, ``completions``: each with
        ``index`` (in the group), ``row`` (in the step's batch), ``text``, ``cut``, ``reward`` (total; None: no
        reward, an infrastructure failure), ``rewards`` (component → unweighted value), ``advantage``,
        ``finish_reason``, ``terminated`` (an EOS ended it), ``length`` (response tokens), ``sampled_tokens``,
        ``loss_tokens`` (counted in the loss), ``version`` (that sampled it), ``staleness`` (versions behind the
        trainer it trained on), ``excluded`` (why it adds no policy gradient, else None) and per token (the first
        ``max_tokens``): ``tokens`` (texts), ``trained`` ("1"/"0" per token: in the loss), ``logprob`` (the
        engine's), ``gap`` (trainer − engine logprob, nats; None where unknown, all None when the trainer sent
        none); multi-turn: ``episode``, ``turns``; an agent's episode that is several sequences (a rewritten
        history): ``episode_id`` (shared by its rows) and, for a row with a prompt of its own, ``prompt``.
        """
        if self.samples_per_step <= 0:
            return
        t0 = time.perf_counter()
        groups = _group_rows(batch)
        for gid in chosen_groups(batch, self.samples_per_step):
            rows = groups[gid]
            first = rows[0]
            record = {"kind": "train", "step": step, "policy_version": policy_version, "group_id": gid,
                      "mixed": _mixed([float(batch.rewards[i]) for i in rows]),
                      "reference": batch.references[first], **self._prompt(batch.prompt_ids[first])}
            record["completions"] = [self._train_row(batch, i, j, result, version_at_train)
                                     for j, i in enumerate(rows)]
            for row, completion in zip(rows, record["completions"]):
                if list(batch.prompt_ids[row]) != list(batch.prompt_ids[first]):
                    completion["prompt"] = self._prompt(batch.prompt_ids[row])["prompt"]
            self.pending.append(record)
        self.seconds += time.perf_counter() - t0

    def _train_row(self, batch: RolloutBatch, i: int, index: int, result: TrainResult, version_at_train: int) -> dict:
        ids = list(batch.response_ids[i])
        kept = ids[:self.max_tokens]
        text, cut = self._text(ids, batch.texts[i])
        texts = self.tokens(kept)
        mask = batch.loss_mask(i)
        trained, loss_tokens = mask.tolist()[:len(kept)], int(mask.sum())
        engine = batch.behaviour_logprobs[i].tolist()[:len(kept)]
        trainer = result.token_logprobs.get(i)
        gap = [None] * len(kept) if trainer is None else [
            _number(t - e) if math.isfinite(t) and math.isfinite(e) else None for t, e in zip(trainer, engine)]
        sampled = batch.loss_masks[i] if batch.loss_masks is not None else [True] * len(ids)
        reward = float(batch.rewards[i])
        return {
            "index": index, "row": i, "text": text, "cut": cut, "reward": _number(reward),
            "rewards": {name: _number(float(values[i])) for name, values in batch.per_function.items()},
            "advantage": _number(float(batch.advantages[i])), "finish_reason": batch.finish_reasons[i],
            "terminated": bool(batch.terminated[i]), "length": len(ids), "sampled_tokens": int(sum(sampled)),
            "loss_tokens": loss_tokens, "version": int(batch.versions[i]),
            "staleness": version_at_train - int(batch.versions[i]),
            "excluded": self._excluded(batch, i, reward, loss_tokens),
            **({} if batch.episode_ids is None else {"episode_id": int(batch.episode_ids[i])}),
            "tokens": texts, "trained": "".join("1" if t else "0" for t in trained),
            "logprob": [_number(e) for e in engine], "gap": gap,
            **self._episode((batch.episodes or [None] * len(batch))[i], texts, ids, list(sampled)),
        }

    @staticmethod
    def _excluded(batch: RolloutBatch, i: int, reward: float, loss_tokens: int) -> str | None:
        """Why row ``i`` adds no policy gradient: no reward (an infrastructure failure), no token in the loss
        (``algorithm.mask_truncated``), or an advantage of 0 (all its group's rewards equal); None otherwise."""
        if math.isnan(reward):
            return "no reward (infrastructure failure): left out of the loss"
        if loss_tokens == 0:
            return "no token in the loss (truncated, algorithm.mask_truncated)"
        if float(batch.advantages[i]) == 0.0:
            return "advantage 0 (its group's rewards are equal): no policy-gradient signal, only the KL term"
        return None

    # ---- held-out evaluation ----------------------------------------------------------------------------------------
    def eval_records(self, step: int, groups: list[GroupResult], references: list[str],
                     correct: list[list[float | None]], formatted: list[float | None] | None) -> None:
        """Make one record per held-out problem of the evaluation after step ``step`` and keep them for
        :meth:`take`: ``kind`` "eval", ``step``, ``problem`` (its index), ``reference``, ``prompt``...,
        ``accuracy`` (mean of its completions' outcomes), ``completions``: each with ``index``, ``text``, ``cut``,
        ``correct`` (1.0 or 0.0; None: its verifier could not score it, left out of ``accuracy``), ``format`` (the
        format reward's score; None without one), ``finish_reason``, ``length``, ``version``; multi-turn:
        ``episode``, ``turns``. Nothing with ``samples_per_step`` 0.

        Args:
            groups: P results, one per problem. references: P reference answers. correct: P lists of k outcomes,
                one per episode (an agent's episode may be several completions: each shows its episode's).
            formatted: P·k format scores in group order, or None.
        """
        if self.samples_per_step <= 0:
            return
        t0 = time.perf_counter()
        flat = 0
        for problem, (group, reference, outcomes) in enumerate(zip(groups, references, correct)):
            completions = []
            episodes = sorted({group.episode_index(j) for j in range(len(group.response_ids))})
            for j, ids in enumerate(group.response_ids):
                text, cut = self._text(ids, group.texts[j])
                episode = group.episodes[j] if group.episodes is not None else None
                completions.append({
                    "index": j, "text": text, "cut": cut,
                    "correct": _number(outcomes[episodes.index(group.episode_index(j))]),
                    "format": None if formatted is None else _number(formatted[flat]),
                    "finish_reason": group.finish_reasons[j], "length": len(ids),
                    "version": min(group.versions_of(j), default=group.policy_version),
                    **self._episode(episode, None, ids, group.sampled_of(j))})
                flat += 1
            self.pending.append({"kind": "eval", "step": step, "problem": problem, "reference": reference,
                                 **self._prompt(group.prompt_ids), "accuracy": _scored_mean(outcomes),
                                 "completions": completions})
        self.seconds += time.perf_counter() - t0


def traced_mask(seq_indices: torch.Tensor, rows: set[int]) -> torch.Tensor | None:
    """[n] bool: which of a micro-batch's sequences (``seq_indices``) are among ``rows``; None when none is."""
    mask = torch.tensor([int(i) in rows for i in seq_indices.tolist()], dtype=torch.bool)
    return mask if bool(mask.any()) else None
