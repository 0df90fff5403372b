"""Issue #27, infrastructure failures are not policy failures (scoring side): a completion without a reward (None, or a
reward that raised with reward_on_error none) is left out of its group's statistics, of the loss and of the step's
metrics, which equal those of a run where it never existed; it is counted in reward/infra_failed, and too many stop
the job naming algorithm.max_infra_failed_fraction."""

from __future__ import annotations

import math

import pytest
import torch

from cluster.loop.sampling import sample_groups
from cluster.loop.scoring import InfraFailureError, RoundScorer, Scoring
from cluster.loop.step_metrics import _sampling_metrics
from cluster.spec import load_spec_text
from contract.messages import GroupRequest, GroupResult
from grpo.advantages import compute_advantages
from grpo.rewards import REWARD_FUNCTIONS, register_reward_function

EOS = 2
INFRA = "INFRA"  # completions whose text starts so get None from the flaky verifier


def flaky(completions, references):
    """1.0 for the right answer, 0.0 for a wrong one, None (no score: the verifier could not run) for INFRA rows."""
    return [None if c.startswith(INFRA) else float(c == r) for c, r in zip(completions, references)]


def half_right(completions):
    """A second weighted reward, 0.5 per completion, served by the same verifier: None for INFRA rows too (a None
    while another weighted reward scores the row would mean "does not apply", TRL's convention, not a failure)."""
    return [None if c.startswith(INFRA) else 0.5 for c in completions]


@pytest.fixture(autouse=True)
def rewards():
    register_reward_function("own_task_flaky")(flaky)
    register_reward_function("own_task_half")(half_right)
    yield
    REWARD_FUNCTIONS.pop("own_task_flaky")
    REWARD_FUNCTIONS.pop("own_task_half")


def scoring(*overrides: str) -> Scoring:
    spec = load_spec_text("output_dir: out\ntotal_steps: 1\ndata: {train_path: t.jsonl}\nrollout: "
                          "{max_response_tokens: 8}\nalgorithm: {rewards: {own_task_flaky: 1.0, own_task_half: 0.3}}\n",
                          overrides=overrides)
    return Scoring(spec.algorithm, spec.rollout.max_response_tokens, frozenset({EOS}))


def group(gid: int, rows: list[tuple[str, int, bool]]) -> GroupResult:
    """rows: (text, response length, ends with EOS)."""
    ids = [[5] * (n - 1) + [EOS] if eos else [5] * n for _, n, eos in rows]
    return GroupResult(gid, [1, gid], ids, [torch.full((len(i),), -0.5) for i in ids],
                       ["stop" if eos else "length" for *_, eos in rows], [t for t, *_ in rows], 0)


CLEAN = {  # group id -> its completions that got a reward
    0: [("7", 3, True), ("8", 5, True), ("7", 2, True)],
    1: [("9", 4, True), ("9", 6, False)],
    2: [("4", 2, True), ("5", 7, True), ("4", 3, True), ("6", 1, True)],
}
INJECTED = {  # completions the verifier could not score: long and cut at the cap, so counting them would show
    0: [(INFRA + "a", 8, False)],
    1: [(INFRA + "b", 8, False), (INFRA + "c", 8, False)],
    3: [(INFRA + "d", 8, False), (INFRA + "e", 8, False)],  # a whole group without any reward
}
REFS = {0: "7", 1: "9", 2: "4", 3: "1"}


def batch_of(groups: dict[int, list]) -> tuple[list[GroupResult], list[str]]:
    gids = sorted(groups)
    return [group(g, groups[g]) for g in gids], [REFS[g] for g in gids]


def with_injected() -> dict[int, list]:
    out = {g: list(rows) for g, rows in CLEAN.items()}
    for g, rows in INJECTED.items():
        out.setdefault(g, [])
        out[g][1:1] = rows  # in the middle of the group
    return out


def step_figures(batch, dynamic: bool) -> dict:
    sampling = sample_groups(lambda k: batch, 4, dynamic=dynamic, max_rounds=1)
    return _sampling_metrics(sampling, group_size=4, version_at_train=0)


COUNTS = ("reward/infra_failed", "reward/none_fraction", "reward/failed")


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("combine", ["sum-then-normalise", "normalise-then-sum"])
def test_own_task_infra_failed_rows_leave_metrics_as_if_they_never_existed(dynamic, combine):
    s = scoring(f"algorithm.reward_combine={combine}", "algorithm.max_infra_failed_fraction=0.5")
    clean, injected = s.score(*batch_of(CLEAN)), s.score(*batch_of(with_injected()))
    failed = injected.rewards.isnan()
    assert int(failed.sum()) == 5 and not clean.rewards.isnan().any()
    # out of the loss: no token and no sequence of theirs counts; advantage exactly 0
    assert [v for v, f in zip(injected.valid_lengths, failed.tolist()) if f] == [0] * 5
    assert (injected.advantages[failed] == 0).all()
    kept = (~failed).nonzero().flatten().tolist()
    assert [injected.valid_lengths[i] for i in kept] == clean.valid_lengths
    assert torch.equal(injected.advantages[kept], clean.advantages)  # group statistics without them, bit for bit
    figures, reference = step_figures(injected, dynamic), step_figures(clean, dynamic)
    for key in reference:
        if key.startswith(("reward/", "response_length/", "groups/")) and key not in COUNTS:
            assert figures[key] == pytest.approx(reference[key], abs=0, rel=0), key
    assert (figures["reward/infra_failed"], reference["reward/infra_failed"]) == (5, 0)
    assert figures["reward/none_fraction"] == pytest.approx(5 / 14) and figures["reward/failed"] == 0


def test_own_task_counting_them_would_change_the_figures():
    """The comparison above can fail: the injected rows are long, cut at the cap, in groups with other rewards."""
    s = scoring()
    injected = s.score(*batch_of(with_injected()))
    lengths = torch.tensor([len(r) for r in injected.response_ids], dtype=torch.float32)
    assert float(lengths.mean()) != step_figures(injected, False)["response_length/mean"]


def test_own_task_advantages_of_a_group_with_a_missing_reward_exact_values():
    """Group rewards [1, 0, None, 1] (weight 1): mean 2/3 and unbiased std sqrt(1/3) over the three scored ones."""
    rewards = torch.tensor([1.0, 0.0, math.nan, 1.0])
    adv = compute_advantages(rewards, torch.zeros(4, dtype=torch.long), "grpo", eps=1e-6)
    std = math.sqrt(1 / 3)
    assert adv.tolist() == pytest.approx([(1 / 3) / (std + 1e-6), (-2 / 3) / (std + 1e-6), 0.0, (1 / 3) / (std + 1e-6)],
                                         abs=1e-6)
    assert adv[2].item() == 0.0
    assert torch.equal(adv[[0, 1, 3]], compute_advantages(rewards[[0, 1, 3]], torch.zeros(3, dtype=torch.long)))


def test_own_task_a_raising_verifier_with_reward_on_error_none_is_an_infra_failure():
    def down_for_group_1(completions, references):
        if references[0] == "9":
            raise ConnectionError("verifier down")
        return flaky(completions, references)

    REWARD_FUNCTIONS.pop("own_task_flaky")
    register_reward_function("own_task_flaky")(down_for_group_1)
    s = scoring("algorithm.reward_on_error=none")
    groups, refs = batch_of(CLEAN)
    from cluster.data import Example

    examples = [Example(g.group_id, "q", r, r) for g, r in zip(groups, refs)]
    scorer = RoundScorer(s, [GroupRequest(g.group_id, g.prompt_ids, len(g.texts)) for g in groups], examples)
    scorer.on_groups(groups)
    batch = scorer.batch(groups)
    assert batch.num_failed == 2 and batch.valid_lengths[3:5] == [0, 0]
    figures = step_figures(batch, False)
    assert figures["reward/infra_failed"] == 2 and figures["reward/failed"] == 2


@pytest.mark.parametrize(("limit", "failed", "stops"), [
    (0.5, 3, False), (0.5, 4, False), (0.5, 5, True), (0.0, 1, True), (0.0, 0, False), (1.0, 7, False),
    (1.0, 8, True),  # every completion failed: nothing to train on, whatever the threshold
])
def test_own_task_threshold_stops_the_job_naming_the_field(limit, failed, stops):
    rows = [(INFRA if i < failed else "1", 3, True) for i in range(8)]
    s = scoring(f"algorithm.max_infra_failed_fraction={limit}")
    if not stops:
        assert int(s.score([group(0, rows)], ["1"]).rewards.isnan().sum()) == failed
        return
    what = "every completion" if failed == 8 else f"{failed} of 8 completions"
    with pytest.raises(InfraFailureError, match=rf"^algorithm.max_infra_failed_fraction: {what}.* of this sampling "
                                                rf"round got no reward \(no score from own_task_flaky {failed}, "
                                                rf"own_task_half {failed}: "):
        s.score([group(0, rows)], ["1"])


def test_own_task_threshold_field_is_checked():
    from cluster.spec import SpecError

    assert scoring().algorithm.max_infra_failed_fraction == 0.5
    with pytest.raises(SpecError, match=r"algorithm.max_infra_failed_fraction: Input should be less than or equal"):
        scoring("algorithm.max_infra_failed_fraction=1.5")
