"""One step's records: the phase clock, the metrics row (``metrics.jsonl``, Prometheus, console) and the
``trained_prompts.jsonl`` line.

Every key, value and type of the row is a contract (dashboards, alerts, ``tests/ray/test_fixed_seed_metrics.py``):
``policy_version``, ``reward/*``, ``groups/*``, ``response_length/*``, ``rollout/*``, ``workers/restarts``,
``actor/*`` (the trainer's), ``sync/*``, ``packing/*``, ``data/*``, ``timing/*``, ``perf/*``, ``memory/*``; and with
``rollout.multi_turn``, ``episode/*`` (``cluster.loop.episode_metrics``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from contract.figures import FleetFigures
from cluster.loop.episode_metrics import component_metrics, episode_metrics
from cluster.loop.sampling import SamplingResult
from contract.messages import TrainResult
from grpo.off_policy import staleness_histogram
from grpo.rewards import reward_metrics

#: The phases a step times (``timing/<phase>_s``).
PHASES = ("generate", "score", "train", "sync")


class StepClock:
    """Wall seconds of one step and of its phases; shows the current phase on the progress bar.

    Args:
        bar: a tqdm bar (its postfix names the phase), or None.
    """

    def __init__(self, bar=None):
        self.bar = bar
        self.started = time.perf_counter()
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def show(self, phase: str) -> None:
        """Name ``phase`` on the progress bar."""
        if self.bar is not None:
            self.bar.set_postfix_str(phase)

    @contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        """Add the wall seconds of the ``with`` body to ``phase``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t0

    @contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """:meth:`show` ``phase``, then :meth:`measure` the ``with`` body."""
        self.show(phase)
        with self.measure(phase):
            yield

    def add(self, phase: str, seconds: float) -> None:
        """Add ``seconds`` measured elsewhere (e.g. rewards computed while engines sample) to ``phase``."""
        self.seconds[phase] += seconds

    def step_s(self) -> float:
        """Wall seconds since the step started."""
        return time.perf_counter() - self.started


@dataclass
class StepBatch:
    """The batch one step trains on, with what its generation measured (``GRPOJob._generate``'s result; in
    ``rollout.mode: one_step_off`` generated during the previous step).

    Attributes:
        step: the step that trains on it. sampling: its sampling rounds (``sampling.batch``: the rows trained on).
        group_size: G. prompts: example indices of the trained groups, one per group, in first-seen order.
        fleet: the fleet's figures of its generate calls. seconds: wall seconds of its ``generate`` and ``score``
            phases. position: the data position and group-size controller state before it was drawn
            (``{"prompts": PromptQueue.state_dict(), "group_size": GroupSizeController.state_dict()}``): what a
            checkpoint records while this batch is generated but not trained.
    """

    step: int
    sampling: SamplingResult
    group_size: int
    prompts: list[int]
    fleet: FleetFigures
    seconds: dict[str, float]
    position: dict

    @property
    def group_versions(self) -> list[int]:
        """The policy version that sampled each trained group (one per entry of :attr:`prompts`, same order)."""
        batch, seen, out = self.sampling.batch, set(), []
        for gid, version in zip(batch.group_ids.tolist(), batch.versions):
            if gid not in seen:
                seen.add(gid)
                out.append(int(version))
        return out


def _sampling_metrics(sampling: SamplingResult, group_size: int, version_at_train: int) -> dict:
    """Rewards, group, length and sampling figures of every group sampled (``sampling.sampled``) and of the groups
    trained on (``sampling.batch``); staleness is the trainer's version at train time minus each row's. Completions
    without a reward (infrastructure failures, NaN total: ``cluster.loop.scoring``) are counted in
    ``reward/infra_failed`` and left out of the ``reward/*``, ``response_length/*`` and ``groups/*`` figures, which
    equal those of the same step without them. Rewards and ``episode/*`` are per episode: an agent's episode trained
    as several sequences (rows) counts once. ``rollout/sequences_trained`` counts the trained rows with at least one
    token in the loss (a row masked whole trains nothing)."""
    sampled, batch = sampling.sampled, sampling.batch
    episode_rows = sampled.episode_rows()
    index = torch.tensor(episode_rows, dtype=torch.long)
    episodes = [sampled.episodes[i] for i in episode_rows] if sampled.episodes is not None else []
    scored = [i for i, failed in enumerate(sampled.rewards.isnan().tolist()) if not failed]  # infra failures left out
    sampled_lengths = sampled.sampled_lengths()  # a multi-turn episode's observation tokens are not its response's
    lengths = torch.tensor([sampled_lengths[i] for i in scored], dtype=torch.float32)
    staleness = torch.tensor([version_at_train - v for v in batch.versions], dtype=torch.float32)
    return {
        **reward_metrics(sampled.rewards[index], {k: v[index] for k, v in sampled.per_function.items()},
                         sampled.num_failed, sampled.num_not_applicable),
        **component_metrics(episodes),
        **episode_metrics(episodes),
        "groups/all_equal_fraction": sampling.all_equal_fraction,
        "response_length/mean": float(lengths.mean()) if scored else float("nan"),
        "response_length/max": float(lengths.max()) if scored else float("nan"),
        "response_length/clip_ratio": (1.0 - sum(sampled.terminated[i] for i in scored) / len(scored)) if scored
        else float("nan"),
        "rollout/group_size": group_size,
        "rollout/sampling_rounds": sampling.rounds,
        "rollout/groups_sampled": sampling.num_groups_sampled,
        "rollout/sequences_trained": batch.num_trained_sequences(),
        "rollout/sample_policy_version_min": min(sampled.versions),
        "rollout/staleness_max": float(staleness.max()),
        "rollout/staleness_mean": float(staleness.mean()),
    }


def step_metrics(*, policy_version: int, sampling: SamplingResult, group_size: int, version_at_train: int,
                 fleet: FleetFigures, engines: int, restarts: int, train: TrainResult, skipped_total: int,
                 sync: dict, packing: dict, epoch: int, prompts_filtered: int, bad_rows: int,
                 clock: StepClock) -> dict:
    """The step's metrics row.

    Args:
        policy_version: the trainer's version after the step; version_at_train: before it.
        sampling: the step's sampling rounds; group_size: G this step.
        fleet: the fleet's figures of the step (generate calls and served requests); engines: engines serving now;
            restarts: engines replaced so far.
        train: the train step's result; skipped_total: updates skipped for NaN/Inf so far.
        sync: the sync's ``sync/*`` metrics (``{"sync/skipped": 1.0}`` alone when nothing was sent).
        packing: the micro-batch plan's ``packing/*`` metrics.
        epoch, prompts_filtered, bad_rows: the data's position and what set-up dropped.
        clock: the step's clock (read last, for ``timing/step_s``).
    """
    generate_s, train_s = clock.seconds["generate"], clock.seconds["train"]
    return {
        "policy_version": policy_version,
        **_sampling_metrics(sampling, group_size, version_at_train),
        "rollout/stale_groups_refused": fleet.stale_refused,
        "rollout/nonfinite_logprobs": sampling.batch.num_nonfinite_logprobs(),
        "rollout/engines": engines,
        "rollout/engine_idle_fraction": fleet.idle_fraction,
        "workers/restarts": restarts,
        "actor/update_skipped": float(train.skipped),
        "actor/updates_skipped_total": skipped_total,
        **train.metrics,
        "actor/update_skipped_reason": train.skip_reason,
        **sync,
        **packing,
        "data/epoch": epoch,
        "data/prompts_filtered": prompts_filtered,
        "data/bad_rows_skipped": bad_rows,
        "timing/generate_s": generate_s,
        "timing/score_s": clock.seconds["score"],
        "timing/train_s": train_s,
        "timing/sync_s": clock.seconds["sync"],
        "timing/step_s": clock.step_s(),
        "perf/rollout_tokens_per_s": fleet.tokens / max(generate_s, 1e-9),
        "perf/train_tokens_per_s": train.metrics["perf/train_tokens"] / max(train_s, 1e-9),
        **_request_metrics(fleet),
    }


def _request_metrics(fleet: FleetFigures) -> dict:
    """``rollout/request_queue_s``: mean seconds a request served this step (request-level generation,
    ``contract.requests``) waited before its engine started it; absent when the step served none."""
    queued = fleet.request_queue_mean_s
    return {} if queued is None else {"rollout/request_queue_s": queued}


def async_metrics(batch: StepBatch, version_at_train: int, dropped: list[StepBatch], queued: int,
                  stale_dropped_total: int, max_staleness: int) -> dict:
    """``rollout.mode: async`` figures of a step: the staleness histogram of the trained batch's samples
    (``grpo.off_policy.staleness_histogram``; ``rollout/staleness_hist/s`` = samples s versions behind, for every s
    in 0..``max_staleness``, zeros included, so the series stay continuous), the groups dropped for staleness before
    this step (``rollout/stale_dropped``) and in the whole run, across resumes (``rollout/stale_dropped_total``),
    and the batches still queued for later steps (``rollout/queued_batches``)."""
    counts = staleness_histogram([version_at_train - int(v) for v in batch.sampling.batch.versions])
    return {
        **{f"rollout/staleness_hist/{s}": counts.get(s, 0) for s in range(max([max_staleness, *counts]) + 1)},
        "rollout/stale_dropped": sum(b.sampling.num_groups_sampled for b in dropped),
        "rollout/stale_dropped_total": stale_dropped_total,
        "rollout/queued_batches": queued,
    }


def record_trained_prompts(output_dir: Path, step: int, policy_version: int, prompts: list[int],
                           engines: int, sample_versions: list[int] | None = None) -> None:
    """Append the step's trained prompts (example indices, one per group) to ``trained_prompts.jsonl``:
    ``{"step", "policy_version", "prompts", "engines"}``, plus ``"sample_versions"`` (the policy version that sampled
    each group, same order as ``prompts``) when given (``rollout.mode`` one_step_off or async: an audit of
    staleness)."""
    row = {"step": step, "policy_version": policy_version, "prompts": prompts, "engines": engines}
    if sample_versions is not None:
        row["sample_versions"] = sample_versions
    with open(output_dir / "trained_prompts.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
