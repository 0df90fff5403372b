"""Issue 35 item 3, TRL's reward conventions: a reward's None means "this reward does not apply to this row" when
another weighted reward scores the row (the weighted sum over the rewards that apply, TRL's ``nansum``); a row no
weighted reward scores, or one a weighted reward raised on, is an infrastructure failure as before; ±inf names the
function and its file:line. The same through the scoring stage, the step's metrics and a reward pool's workers.
Selectable with ``-k trl_convention``."""

from __future__ import annotations

import math

import pytest
import torch

from cluster.in_process.reward_pool import ThreadRewardWorker
from cluster.loop.sampling import sample_groups
from cluster.loop.scoring import InfraFailureError, Scoring
from cluster.loop.step_metrics import _sampling_metrics
from cluster.rewards.inline import InlineRewardPool
from cluster.rewards.pool import WorkerPool
from cluster.spec import load_spec_text
from contract.messages import GroupResult
from contract.rewards import RewardCall
from grpo.rewards import REWARD_FUNCTIONS, RewardOutputError, combine_rewards, register_reward_function

EOS = 2


def math_task(completions, task, **kwargs):
    """TRL-style multi-task reward: scores the math rows (1.0 for an answer '4'), None for every other row."""
    return [float(c.strip() == "4") if t == "math" else None for c, t in zip(completions, task)]


def code_task(completions, task, **kwargs):
    """Its sibling: scores the code rows (0.5 for any completion that mentions 'def'), None for the rest."""
    return [(0.5 if "def" in c else 0.0) if t == "code" else None for c, t in zip(completions, task)]


@pytest.fixture(autouse=True)
def rewards():
    register_reward_function("trl_math_task")(math_task)
    register_reward_function("trl_code_task")(code_task)
    yield
    for name in ("trl_math_task", "trl_code_task", "trl_inf", "trl_down"):
        REWARD_FUNCTIONS.pop(name, None)


def scoring(*overrides: str) -> Scoring:
    spec = load_spec_text("output_dir: out\ntotal_steps: 1\ndata: {train_path: t.jsonl}\nrollout: "
                          "{max_response_tokens: 8}\nalgorithm: {rewards: {trl_math_task: 1.0, trl_code_task: 2.0}}\n",
                          overrides=overrides)
    return Scoring(spec.algorithm, spec.rollout.max_response_tokens, frozenset({EOS}))


def group(gid: int, texts: list[str]) -> GroupResult:
    ids = [[5, 6, EOS] for _ in texts]
    return GroupResult(gid, [1, gid], ids, [torch.full((3,), -0.5) for _ in ids], ["stop"] * len(ids), texts, 0)


def examples(tasks: list[str]):
    from cluster.data import Example

    return [Example(i, f"q{i}", "a", "a", columns={"task": t}) for i, t in enumerate(tasks)]


# two math groups and one code group, as a TRL user's multi-task mix would sample them
GROUPS = [group(0, ["4", "5", "4", "x"]), group(1, ["def f()", "pass", "def g()", "no"]), group(2, ["4"] * 4)]
TASKS = ["math", "code", "math"]


def test_trl_convention_multi_task_mix_scores_each_row_by_the_reward_that_applies():
    """A row's total is the weighted sum of the rewards that scored it; nothing stops the round, and every row
    trains."""
    batch = scoring().score(GROUPS, examples(TASKS))
    assert batch.rewards.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert not batch.rewards.isnan().any() and all(v > 0 for v in batch.valid_lengths)
    assert batch.num_not_applicable == 12  # every row is skipped by the reward of the other task
    assert batch.advantages[:8].abs().sum() > 0 and (batch.advantages[8:] == 0).all()  # group 2: all-equal
    figures = _sampling_metrics(sample_groups(lambda k: batch, 3), group_size=4, version_at_train=0)
    assert (figures["reward/not_applicable"], figures["reward/infra_failed"]) == (12, 0)
    # each reward's mean is over the rows it scored (TRL's nanmean), with that count beside it
    assert figures["reward/trl_math_task"] == pytest.approx(6 / 8) and figures["reward/scored/trl_math_task"] == 8
    assert figures["reward/trl_code_task"] == pytest.approx(0.25) and figures["reward/scored/trl_code_task"] == 4
    assert figures["rollout/sequences_trained"] == 12


def test_trl_convention_normalise_then_sum_normalises_each_reward_over_the_rows_it_scored():
    s = scoring("algorithm.reward_combine=normalise-then-sum")
    batch = s.score(GROUPS, examples(TASKS))
    # group 1 is the code reward's alone: 2 x its own group advantage of [0.5, 0, 0.5, 0] (mean 0.25, std 0.2887)
    torch.testing.assert_close(batch.advantages[4:8], 2 * torch.tensor([0.86603, -0.86603, 0.86603, -0.86603]),
                               atol=1e-4, rtol=0)


def test_trl_convention_a_row_no_reward_scores_or_a_reward_raised_on_is_an_infrastructure_failure():
    """TRL warns and trains a row no reward scores with reward 0 (nansum of nothing); here it is an infrastructure
    failure: nothing scored it, so nothing pays it. A raise (reward_on_error none) is not "does not apply": the rows
    of its call have no total even where another reward scored them."""
    batch = scoring().score(GROUPS, examples(["math", "code", "poetry"]))
    assert batch.rewards[8:].isnan().all() and batch.valid_lengths[8:] == [0] * 4 and batch.num_not_applicable == 8
    with pytest.raises(InfraFailureError, match=r"every completion .*no score from trl_math_task 4, trl_code_task 4: "
                                                r"None from every weighted reward function"):
        scoring().score(GROUPS[:1], examples(["poetry"]))

    def down(completions, **kwargs):
        raise ConnectionError("grader down")

    register_reward_function("trl_down")(down)
    total, per_function, failed = combine_rewards(["4", "x"], ["a", "a"], {"trl_math_task": 1.0, "trl_down": 1.0},
                                                  on_error="none", columns={"task": ["math", "math"]})
    assert total.isnan().all() and per_function["trl_math_task"].tolist() == [1.0, 0.0]
    assert failed == {"trl_math_task": 0, "trl_down": 2}
    total, _, _ = combine_rewards(["4", "x"], ["a", "a"], {"trl_math_task": 1.0, "trl_down": 0.0},
                                  on_error="none", columns={"task": ["math", "math"]})
    assert total.tolist() == [1.0, 0.0]  # a weight-0 reward is only logged: its raise costs no row


@pytest.mark.parametrize("bad", [math.inf, -math.inf, 1e39, 10**400], ids=["inf", "-inf", "beyond_float32", "int"])
def test_trl_convention_an_infinite_reward_names_the_function_and_its_file_line(bad):
    def inf_reward(completions, references):
        return [1.0, bad][:len(completions)]

    register_reward_function("trl_inf")(inf_reward)
    line = inf_reward.__code__.co_firstlineno
    where = rf"test_trl_reward_conventions\.py:{line}"
    with pytest.raises(RewardOutputError, match=rf"reward function 'trl_inf' returned .* at row 1, expected a finite "
                                                rf"number .*defined at .*{where}\)"):
        combine_rewards(["a", "b"], ["a", "a"], {"trl_math_task": 0.0, "trl_inf": 1.0},
                        columns={"task": ["x", "x"]})
    with pytest.raises(RewardOutputError, match=where):  # whatever its weight, and with reward_on_error none
        combine_rewards(["a", "b"], ["a", "a"], {"trl_inf": 0.0}, on_error="none")


@pytest.mark.parametrize("batch_size", [3, 100])
def test_trl_convention_a_reward_pool_scores_as_the_driver_does(batch_size):
    """The reward pool's workers carry the same semantics: not-applicable rows keep a total, a row no reward scores
    has none, and ±inf comes back as the same error naming the function."""
    weights = {"trl_math_task": 1.0, "trl_code_task": 2.0}
    texts = [["4", "def f", "x"], ["def g", "4"], ["no", "4", "def"]]
    tasks = [["math", "code", "poetry"], ["code", "math"], ["poetry", "poetry", "code"]]
    calls = [RewardCall(t, ["a"] * len(t), ["q"] * len(t), {"task": k}, weights, "raise") for t, k in zip(texts, tasks)]
    pool = WorkerPool(lambda i: ThreadRewardWorker(), workers=2, batch_size=batch_size, timeout_s=30, kind="threads")
    pool.start()
    try:
        got = pool.collect(pool.submit(calls), 30)
    finally:
        pool.shutdown()
    inline = InlineRewardPool()
    want = inline.collect(inline.submit(calls), 0)
    for g, w in zip(got, want):
        assert torch.equal(g.total.isnan(), w.total.isnan()) and torch.equal(g.total.nan_to_num(), w.total.nan_to_num())
    assert [s.total.nan_to_num(-1).tolist() for s in got] == [[1.0, 1.0, -1], [1.0, 1.0], [-1, -1, 1.0]]


def test_trl_convention_a_verifier_failure_is_not_does_not_apply():
    """A row a verifier applies to but could not score (its service or sandbox failed) has no reward whatever the
    other rewards give it: the reward returns UNSCORED there, or is registered with ``none_is_failure`` (the builtins
    ``math`` and ``code``, which score every row: their None is a dead worker or a failed sandbox). None from a TRL
    reward keeps meaning "does not apply"."""
    from grpo.rewards import NONE_IS_FAILURE, UNSCORED

    register_reward_function("trl_down")(lambda completions, **kw: [1.0, UNSCORED, None, 0.0][:len(completions)])
    weights = {"trl_down": 1.0, "trl_math_task": 0.5}
    total, per_function, _ = combine_rewards(["4", "4", "4", "x"], ["a"] * 4, weights, columns={"task": ["math"] * 4})
    assert math.isnan(total[1].item()) and total[[0, 2, 3]].tolist() == [1.5, 0.5, 0.0]
    assert math.isnan(per_function["trl_down"][1].item())
    assert {"code", "code_asserts"} <= NONE_IS_FAILURE and REWARD_FUNCTIONS["math"].none_is_failure

    def failing_verifier(completions, **kwargs):
        return [None, 1.0, 0.0][:len(completions)]

    REWARD_FUNCTIONS.pop("trl_down")
    register_reward_function("trl_down", none_is_failure=True)(failing_verifier)
    total, _, _ = combine_rewards(["4", "4", "x"], ["a"] * 3, weights, columns={"task": ["math"] * 3})
    assert math.isnan(total[0].item()) and total[1:].tolist() == [1.5, 0.0]
