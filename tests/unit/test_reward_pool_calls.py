"""Issue #27 item 3, the reward pool's pure parts: packing calls into batches of ``reward_pool.batch_size`` rows and
taking the scores apart again (exactly the scores of the calls one by one), the inline pool, a worker pool over
threads, the ``reward_pool`` spec section and the pool's share of the job's Ray resources."""

from __future__ import annotations

import pytest
import torch

from cluster.ray_shell.pools import resources_needed
from cluster.rewards.calls import evaluate_call, join_scores, lost_scores, merge_calls, pack_chunks
from cluster.rewards.inline import InlineRewardPool
from cluster.rewards.pool import WorkerPool
from cluster.in_process.reward_pool import ThreadRewardWorker, plan_pickles
from cluster.rewards.worker import RewardPlan
from cluster.spec import SpecError, load_spec_text, spec_to_yaml
from contract.protocols import RewardPool
from contract.rewards import RewardCall
from grpo.rewards import REWARD_FUNCTIONS, register_reward_function
from grpo.rewards.calling import RewardOutputError

MINIMAL = "output_dir: runs/test\ntotal_steps: 3\ndata:\n  train_path: train.jsonl\n"


def by_length(prompts, completions, level=None):
    """Whole-row test reward: the completion's length, None where the row's level is 'none'."""
    return [None if lv == "none" else float(len(c)) for c, lv in zip(completions, level or [None] * len(completions))]


def exact(completions, references):
    """References-style test reward: 1.0 for the reference itself."""
    return [float(c == r) for c, r in zip(completions, references)]


@pytest.fixture(autouse=True)
def rewards():
    register_reward_function("pool_by_length")(by_length)
    register_reward_function("pool_exact")(exact)
    yield
    REWARD_FUNCTIONS.pop("pool_by_length")
    REWARD_FUNCTIONS.pop("pool_exact")


WEIGHTS = {"pool_by_length": 0.5, "pool_exact": 1.0}


def call(n: int, seed: int, columns: bool = True) -> RewardCall:
    texts = [f"c{seed}-{i}" * (1 + (i + seed) % 3) for i in range(n)]
    refs = [t if (i + seed) % 2 else "no" for i, t in enumerate(texts)]
    level = {"level": ["none" if (i * 7 + seed) % 5 == 0 else "a" for i in range(n)]} if columns else {}
    return RewardCall(texts, refs, [f"p{seed}"] * n, level, WEIGHTS, "raise")


def same(a, b) -> bool:
    """Equal scores, NaN where NaN."""
    return (torch.equal(a.total.isnan(), b.total.isnan()) and torch.equal(a.total.nan_to_num(), b.total.nan_to_num())
            and a.per_function.keys() == b.per_function.keys() and a.num_failed == b.num_failed
            and all(torch.equal(a.per_function[k].nan_to_num(), b.per_function[k].nan_to_num())
                    for k in a.per_function))


def test_reward_pool_pack_cuts_long_calls_and_keeps_whole_ones_together():
    calls = [call(n, s) for s, n in enumerate([3, 5, 2, 7, 1])]
    chunks = pack_chunks(calls, 6)
    assert [[(g.call_index, g.start, g.stop) for g in c.segments] for c in chunks] == [
        [(0, 0, 3)], [(1, 0, 5)], [(2, 0, 2)], [(3, 0, 6)], [(3, 6, 7), (4, 0, 1)]]
    assert [len(c.call) for c in chunks] == [3, 5, 2, 6, 2]
    assert [[(g.call_index, g.start, g.stop) for g in c.segments] for c in pack_chunks(calls[:3], 100)] == [
        [(0, 0, 3), (1, 0, 5), (2, 0, 2)]]
    assert pack_chunks([call(0, 0)], 4) == []
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        pack_chunks(calls, 0)


def test_reward_pool_merged_calls_take_the_union_of_columns():
    a, b = call(2, 0), call(3, 1, columns=False)
    merged = merge_calls([a, b])
    assert merged.completions == a.completions + b.completions and merged.references == a.references + b.references
    assert merged.columns == {"level": a.columns["level"] + [None, None, None]}
    assert same(evaluate_call(merged), join_scores([evaluate_call(a), evaluate_call(b)]))


@pytest.mark.parametrize("batch_size", [1, 4, 100])
def test_reward_pool_thread_workers_score_exactly_as_one_call_at_a_time(batch_size):
    calls = [call(n, s) for s, n in enumerate([4, 1, 9, 3, 6])]
    pool = WorkerPool(lambda i: ThreadRewardWorker(), workers=2, batch_size=batch_size, timeout_s=30, kind="threads")
    assert isinstance(pool, RewardPool) and isinstance(InlineRewardPool(), RewardPool)
    pool.start()
    try:
        scores = pool.collect(pool.submit(calls), 30)
        assert pool.metrics()["reward_pool/lost_rows"] == 0
        pool.shutdown()
        pool.start()  # again, as a guard rollback does
        assert all(same(a, b) for a, b in zip(pool.collect(pool.submit(calls), 30), scores))
    finally:
        pool.shutdown()
    inline = InlineRewardPool()
    expected = inline.collect(inline.submit(calls), 0)
    assert len(scores) == len(expected) == 5
    assert all(same(s, e) for s, e in zip(scores, expected))
    # the 'none' rows came through as not applicable to pool_by_length: pool_exact scores them (TRL's convention)
    assert any(s.per_function["pool_by_length"].isnan().any() for s in scores)
    assert not any(s.total.isnan().any() for s in scores)


def test_reward_pool_a_broken_contract_fails_the_collect_naming_the_function():
    register_reward_function("pool_wrong_count")(lambda completions, references: [1.0])
    try:
        pool = WorkerPool(lambda i: ThreadRewardWorker(), workers=1, batch_size=8, timeout_s=30, kind="threads")
        pool.start()
        bad = RewardCall(["a", "b"], ["a", "b"], [None, None], {}, {"pool_wrong_count": 1.0}, "raise")
        ticket = pool.submit([bad])
        with pytest.raises(RewardOutputError, match=r"'pool_wrong_count' returned 1 values, expected 2"):
            pool.collect(ticket, 30)
        pool.shutdown()
    finally:
        REWARD_FUNCTIONS.pop("pool_wrong_count")


def test_reward_pool_lost_scores_are_no_scores_counted_per_function():
    lost = lost_scores(3, WEIGHTS)
    assert lost.total.isnan().all() and all(v.isnan().all() for v in lost.per_function.values())
    assert lost.num_failed == {"pool_by_length": 3, "pool_exact": 3}


def test_reward_pool_plans_that_cannot_leave_the_process_are_named():
    assert plan_pickles(RewardPlan({"pool_exact": exact})) is None
    local = lambda completions, references: []  # noqa: E731 - a function pickle cannot find by name
    local.__module__ = __name__
    assert plan_pickles(RewardPlan({"x": local})).startswith("AttributeError: Can't pickle local object")
    main_fn = type(exact)(exact.__code__, {}, "main_fn")
    main_fn.__module__ = "__main__"
    assert plan_pickles(RewardPlan({"x": main_fn})) == "reward function(s) ['x'] are defined in __main__"


def test_reward_pool_section_defaults_load_and_round_trip():
    spec = load_spec_text(MINIMAL)
    assert spec.reward_pool.workers == 0 and spec.reward_endpoints == {}
    spec = load_spec_text(MINIMAL + "reward_pool: {workers: 3, num_cpus_per_worker: 0.5, batch_size: 16, "
                                    "timeout_s: 30, resources: {cpu_node: 1}}\n")
    assert (spec.reward_pool.workers, spec.reward_pool.batch_size, spec.reward_pool.timeout_s) == (3, 16, 30.0)
    assert load_spec_text(spec_to_yaml(spec)) == spec


@pytest.mark.parametrize("extra, message", [
    ("reward_pool: {workers: -1}", "job.yaml:5: reward_pool.workers: Input should be greater than or equal to 0"),
    ("reward_pool: {batch_size: 0}", "reward_pool.batch_size: Input should be greater than or equal to 1"),
    ("reward_pool: {timeout_s: 0}", "reward_pool.timeout_s: Input should be greater than 0"),
    ("reward_pool: {resources: {CPU: 1}}", "reward_pool.resources: resource 'CPU' is one of Ray's builtin resources: "
                                           "set reward_pool.num_cpus_per_worker instead"),
    ("reward_pool: {threads: 2}", "reward_pool.threads: unknown key 'threads'"),
])
def test_reward_pool_bad_values_name_the_field(extra, message):
    with pytest.raises(SpecError) as info:
        load_spec_text(MINIMAL + extra + "\n", source="job.yaml")
    assert message in str(info.value), str(info.value)


def test_reward_pool_cpus_count_in_the_local_cluster_and_in_the_ray_resources():
    spec = load_spec_text(MINIMAL + "ray: {num_cpus: 3}\nreward_pool: {workers: 2, num_cpus_per_worker: 0.5, "
                                    "resources: {cpu_node: 1}}\n")
    need = resources_needed(spec)
    assert need["CPU"] == (3.0, "rollout 1 x 1 + train 1 x 1 + reward 2 x 0.5")
    assert need["cpu_node"] == (2.0, "reward 2 x 1")
    with pytest.raises(SpecError, match=r"ray.num_cpus: the job reserves 4 CPUs \(rollout 1 x 1 \+ train 1 x 1 \+ "
                                        r"reward 2 x 1\) but the local cluster has 3"):
        load_spec_text(MINIMAL + "ray: {num_cpus: 3}\nreward_pool: {workers: 2}\n")
    assert resources_needed(load_spec_text(MINIMAL))["CPU"] == (2.0, "rollout 1 x 1 + train 1 x 1")
    assert need["GPU"] == (0.0, "rollout 1 x 0 + train 1 x 0")  # the reward pool reserves no GPU
