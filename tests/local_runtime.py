"""Helpers for tests of the in-process runtime (``cluster.in_process``): a job spec for the tiny model, a started
trainer + fleet pair, group requests from text prompts, a micro-batch of sampled groups, and a metrics sink that
records what it is given."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from cluster.in_process import LocalFleet, LocalTrainer
from contract.messages import GroupRequest, GroupResult
from contract.versions import PolicyVersionLedger
from train_workers.packing import pack_microbatch

PROMPTS = ["What is 2 + 3?", "Name a colour.", "Count to five, slowly and carefully please.", "Hi"]


def local_spec(model_dir: str, output_dir: str, **sections):
    """A validated ``JobSpec`` for the tiny model: B = 2, G = 4, 8-token completions, one train thread, 1 MiB sync
    buckets; ``sections`` are merged into the spec's sections (e.g. ``rollout={"top_p": 0.8}``). The data path is
    never read by the fleet or the trainer."""
    from cluster.spec import JobSpec

    base = {"output_dir": output_dir, "total_steps": 2, "model": {"path": model_dir},
            "data": {"train_path": f"{output_dir}/unused.jsonl"},
            "rollout": {"prompts_per_step": 2, "group_size": 4, "max_response_tokens": 8},
            "train": {"num_threads": 1, "lr": 1e-3}, "algorithm": {"kl_coef": 0.04},
            "sync": {"bucket_bytes": 2**20}}
    for key, value in sections.items():
        base[key] = {**base[key], **value} if isinstance(base.get(key), dict) else value
    return JobSpec.model_validate(base)


@contextmanager
def running(spec, model_dir: str, fleet_cls=LocalFleet, status=None
            ) -> Iterator[tuple[LocalTrainer, LocalFleet, PolicyVersionLedger]]:
    """A started LocalTrainer and ``fleet_cls`` fleet on ``model_dir`` (policy version 0) and their ledger; both are
    shut down on leaving the block. ``status``: the fleet's status callback (default: drop the messages)."""
    trainer, fleet, versions = LocalTrainer(spec), fleet_cls(spec), PolicyVersionLedger()
    try:
        trainer.start(model_dir)
        fleet.start(model_dir, 0, trainer, versions, status=status or (lambda message: None))
        yield trainer, fleet, versions
    finally:
        fleet.shutdown()
        trainer.shutdown()


def requests_for(tokenizer, prompts: list[str] = PROMPTS[:2], seed: int = 1000, **kwargs) -> list[GroupRequest]:
    """One request per prompt (group ids 0.., seeds ``seed + 10·i``), the prompt's ids from ``tokenizer``."""
    return [GroupRequest(i, tokenizer(p)["input_ids"], seed=seed + 10 * i, **kwargs) for i, p in enumerate(prompts)]


def rows_of(groups: list[GroupResult]) -> tuple[list, list, list]:
    """(prompt ids, response ids, behaviour logprobs) of every completion, group by group."""
    prompts = [g.prompt_ids for g in groups for _ in g.response_ids]
    responses = [r for g in groups for r in g.response_ids]
    logprobs = [lp for g in groups for lp in g.behaviour_logprobs]
    return prompts, responses, logprobs


def microbatch(groups: list[GroupResult], advantages: list[float] | None = None):
    """The groups' completions packed into one micro-batch (advantages alternate +1/−1 unless given); returns
    (micro-batch, loss tokens, sequences)."""
    prompts, responses, logprobs = rows_of(groups)
    adv = advantages or [1.0 if i % 2 == 0 else -1.0 for i in range(len(responses))]
    mb = pack_microbatch(prompts, responses, adv, logprobs, list(range(len(responses))))
    return mb, sum(len(r) for r in responses), len(responses)


def train_on(trainer: LocalTrainer, versions: PolicyVersionLedger, groups: list[GroupResult]):
    """One train step on ``groups`` (reported to ``versions``); returns the :class:`TrainResult`."""
    mb, tokens, sequences = microbatch(groups)
    result = trainer.train_step([[mb]], tokens, sequences)
    assert versions.trained(result.policy_version), "the update was skipped"
    return result


def max_gap(expected: list[torch.Tensor], got: torch.Tensor) -> float:
    """Largest |expected[i][t] − got[i, t]| over every response token (``got``: [n, T] padded)."""
    return max(float((got[i, :len(e)] - e).abs().max()) for i, e in enumerate(expected))


class RecordingSink:
    """A :class:`contract.protocols.MetricSink` that keeps what it is given (``rows``, ``workers``, ``removed``)."""

    url = None

    def __init__(self):
        self.rows: list[tuple[int, dict]] = []
        self.workers: list[tuple[int, str, str, dict]] = []
        self.removed: list[tuple[str, str]] = []

    def log(self, step, metrics) -> None:
        self.rows.append((step, dict(metrics)))

    def log_worker(self, step, pool, worker, metrics) -> None:
        self.workers.append((step, pool, worker, dict(metrics)))

    def remove_worker(self, pool, worker) -> int:
        self.removed.append((pool, worker))
        return 1

    def reopen(self) -> None:
        pass

    def close(self) -> None:
        pass
