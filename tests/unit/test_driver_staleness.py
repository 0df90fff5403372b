"""The driver's version checks on sampled groups (``EngineFleet.generate``) with stand-in pools: no Ray, no engine.

Each group carries the policy version that sampled it; groups older than ``rollout.max_staleness`` are refused, the
engines are synced again, and the same requests are sampled again (same seeds, so the same groups)."""

from types import SimpleNamespace

import pytest
import torch

from cluster.loop.requests import request_seed
from cluster.ray_shell.fleet import EngineFleet
from contract.errors import StaleSamplesError
from cluster.loop.requests import PromptQueue
from contract.versions import PolicyVersionError, PolicyVersionLedger
from cluster.spec import load_spec_text
from contract.messages import EngineInfo, GroupRequest, GroupResult, PoolGenerateStats

SPEC = """\
output_dir: runs/test
total_steps: 1
data:
  train_path: train.jsonl
"""


class FakeRollout:
    """Returns groups stamped with the versions in ``versions`` (one list per call); records each call's
    (group id, seed) pairs in ``seen``."""

    def __init__(self, versions: list[int]):
        self.versions, self.calls, self.engines, self.restarts = list(versions), 0, ["e0"], 0
        self.infos = [EngineInfo(policy_version=0, pid=1)]
        self.seen: list[list[tuple[int, int]]] = []

    def generate(self, requests, on_groups=None):
        version = self.versions[min(self.calls, len(self.versions) - 1)]
        self.calls += 1
        self.seen.append([(q.group_id, q.seed) for q in requests])
        groups = [GroupResult(q.group_id, q.prompt_ids, [[1]], [torch.zeros(1)], ["stop"], ["x"], version)
                  for q in requests]
        return groups, PoolGenerateStats(tokens=len(groups), engine_seconds=[], engine_idle_fraction=0.0,
                                         per_engine=[])


class FakeSync:
    def __init__(self):
        self.rebuilds = self.syncs = 0

    def rebuild(self, engines):
        self.rebuilds += 1

    def sync(self):
        self.syncs += 1
        return SimpleNamespace(verified=True)


def job(versions: list[int], *overrides: str, trainer: int = 3) -> EngineFleet:
    """A fleet over the fakes, with the trainer at policy version ``trainer``."""
    fleet = EngineFleet(load_spec_text(SPEC, overrides=overrides))
    fleet.attach(FakeRollout(versions), FakeSync(), PolicyVersionLedger(trainer), lambda message: None)
    return fleet


REQUESTS = [GroupRequest(0, [5, 6], 2, seed=1), GroupRequest(1, [7], 2, seed=2)]


def test_current_samples_are_accepted_without_resync():
    j = job([3])
    groups = j.generate(REQUESTS)
    assert [g.policy_version for g in groups] == [3, 3] and j.sync.syncs == 0 and j.figures.stale_refused == 0


def test_stale_samples_are_refused_resynced_and_sampled_again():
    j = job([2, 3])  # the first call comes from an engine one version behind
    groups = j.generate(REQUESTS)
    assert [g.policy_version for g in groups] == [3, 3]
    assert j.rollout.calls == 2 and j.figures.stale_refused == 2 and j.sync.rebuilds == 1 and j.sync.syncs == 1
    assert j.rollout.seen == [[(0, 1), (1, 2)]] * 2  # sampled again with the same seeds, so the same groups


def test_max_staleness_allows_older_samples():
    j = job([2], "rollout.max_staleness=1")
    groups = j.generate(REQUESTS)
    assert [g.policy_version for g in groups] == [2, 2] and j.sync.syncs == 0


def test_engines_that_stay_stale_stop_the_job():
    j = job([0], "rollout.max_engine_restarts=0")
    with pytest.raises(StaleSamplesError, match="stale"):
        j.generate(REQUESTS)


def test_samples_ahead_of_the_trainer_are_a_version_error():
    j = job([4])
    with pytest.raises(PolicyVersionError, match="a sampled group reports policy version 4, ahead of the trainer's 3"):
        j.generate(REQUESTS)


def test_request_seeds_are_crc32_of_seed_step_group():
    """The documented mix, computed with binascii (not zlib): stable across processes and Python versions (a
    ``hash()``-based seed would change with PYTHONHASHSEED and break resumed runs' reproducibility)."""
    import binascii

    for seed, step, group in [(0, 1, 2), (1, 1, 2), (0, 2, 2), (0, 1, 3), (12345, 99, 0)]:
        expected = binascii.crc32(f"{seed}:{step}:{group}".encode()) & 0x7FFFFFFF
        assert request_seed(seed, step, group) == expected
    assert len({request_seed(0, 1, 2), request_seed(1, 1, 2), request_seed(0, 2, 2), request_seed(0, 1, 3)}) == 4
    assert all(0 <= request_seed(s, 5, 7) < 2**31 for s in range(100))


def test_next_requests_seed_each_group_from_spec_seed_step_and_group_id():
    """Requests carry request_seed(spec.seed, step, group id); a second round of the same step continues the group
    ids, so no two groups of a step share a seed."""
    from collections import deque

    from cluster.data import Example

    j = PromptQueue(sampler=None, prompt_ids={0: [10], 1: [11], 2: [12]}, seed=7)
    j.begin_step(4)
    j.pending = deque(Example(index=i, question=f"q{i}", answer="#### 1", reference="1") for i in range(3))
    _, first = j.draw(2, 4)
    _, second = j.draw(1, 4)
    assert [(q.group_id, q.prompt_ids, q.group_size) for q in first + second] == [(0, [10], 4), (1, [11], 4),
                                                                                   (2, [12], 4)]
    assert [q.seed for q in first + second] == [request_seed(7, 4, g) for g in range(3)]
    assert len({q.seed for q in first + second}) == 3
