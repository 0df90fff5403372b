"""Issue #27 item 4, fault injection through the in-process runtime's reward pool (worker processes): the verifier
raises, the sandbox cannot start (the ``code`` reward with a bwrap that cannot start), a reward worker is killed in
the middle of a call, a reward endpoint times out. In each case the completions hit are left out (advantage 0, no
loss tokens), counted in ``reward/infra_failed``, and the step's reward, length and group figures equal those of the
same round without them, as ``tests/unit/test_own_task_infra.py`` shows for None scores (≈ 40 s)."""

from __future__ import annotations

import pytest
import torch

from cluster.data import Example
from cluster.in_process.reward_pool import local_reward_pool
from cluster.loop.sampling import sample_groups
from cluster.loop.scoring import RoundScorer, Scoring
from cluster.loop.step_metrics import _sampling_metrics
from cluster.spec import load_spec_text
from contract.messages import GroupRequest, GroupResult
from grpo.rewards import REWARD_FUNCTIONS, register_reward_function
from sandbox import SandboxConfig, check_sandbox
from tests.reward_faults import RewardServer, code_or_broken_sandbox, exact_or_fault

EOS = 2
PASS, FAIL = "def f():\n    return 1\n", "def f():\n    return 2\n"  # the code rows' programs
CLEAN = {  # group id -> (text, response length, ends with EOS); "7" is right for groups 0-2
    0: [("7", 3, True), ("8", 5, True), ("7", 2, True)],
    1: [("7", 4, True), ("9", 6, False)],
    2: [("4", 2, True), ("7", 7, True), ("4", 3, True), ("6", 1, True)],
}
CODE = {0: [PASS, FAIL, PASS], 1: [PASS, FAIL], 2: [FAIL, PASS, FAIL, FAIL]}  # the same rows, for the code reward
INJECTED_AT = {0: 1, 1: 0, 3: 0}  # group -> where its injected rows go; group 3 has only injected rows
INJECTED_ROWS = {0: 1, 1: 2, 3: 2}
COUNTS = ("reward/infra_failed", "reward/none_fraction", "reward/failed")


@pytest.fixture(scope="module")
def server():
    s = RewardServer()
    s.delay_s = 4.0
    yield s
    s.close()


@pytest.fixture(scope="module", autouse=True)
def rewards():
    register_reward_function("faults_exact")(exact_or_fault)
    register_reward_function("faults_code")(code_or_broken_sandbox)
    yield
    REWARD_FUNCTIONS.pop("faults_exact")
    REWARD_FUNCTIONS.pop("faults_code")


def spec_for(fault: str, server: RewardServer):
    reward = {"raise": "faults_exact", "kill": "faults_exact", "sandbox": "faults_code", "endpoint": "judge"}[fault]
    endpoint = (f"reward_endpoints: {{judge: {{url: '{server.url}', timeout_s: 1, max_retries: 1, backoff_s: 0.1, "
                f"batch_size: 1}}}}\n") if fault == "endpoint" else ""
    return load_spec_text(
        f"output_dir: out\ntotal_steps: 1\ndata: {{train_path: t.jsonl}}\nrollout: {{max_response_tokens: 8}}\n"
        f"{endpoint}algorithm: {{rewards: {{{reward}: 1.0, format: 0.0}}, reward_on_error: none, "
        f"max_infra_failed_fraction: 0.5}}\nreward_pool: {{workers: 2, batch_size: 1, timeout_s: 60}}\n")


def group(gid: int, rows: list[tuple[str, int, bool]]) -> GroupResult:
    ids = [[5] * (n - 1) + [EOS] if eos else [5] * n for _, n, eos in rows]
    return GroupResult(gid, [1, gid], ids, [torch.full((len(i),), -0.5) for i in ids],
                       ["stop" if eos else "length" for *_, eos in rows], [t for t, *_ in rows], 0)


def round_of(fault: str, injected: bool) -> tuple[list[GroupResult], list[Example]]:
    """The groups of one sampling round and their rows; ``injected``: with the marked completions."""
    marker = {"raise": "RAISE", "kill": "KILL", "sandbox": "SANDBOX", "endpoint": "SLOW"}[fault]
    rows = {g: [(CODE[g][i] if fault == "sandbox" else t, n, eos) for i, (t, n, eos) in enumerate(rs)]
            for g, rs in CLEAN.items()}
    if injected:
        for g, at in INJECTED_AT.items():
            rows.setdefault(g, [])[at:at] = [(f"{marker}{k}", 8, False) for k in range(INJECTED_ROWS[g])]
    gids = sorted(rows)
    examples = [Example(g, f"q{g}", "7", "7", columns={"answer": "7", "tests": [{"args": [], "expected": 1}],
                                                       "entry_point": "f"}) for g in gids]
    return [group(g, rows[g]) for g in gids], examples


def score_round(pool, scoring: Scoring, groups, examples):
    """The round through the pool, as the loop does it: two engines' groups submitted as they finish, then batch."""
    requests = [GroupRequest(g.group_id, g.prompt_ids, len(g.texts)) for g in groups]
    scorer = RoundScorer(scoring, requests, examples, pool, collect_timeout_s=120)
    scorer.on_groups(groups[:2])
    scorer.on_groups(groups[2:])
    return scorer.batch(groups)


def figures(batch) -> dict:
    return _sampling_metrics(sample_groups(lambda k: batch, 4, dynamic=False, max_rounds=1), group_size=4,
                             version_at_train=0)


@pytest.mark.parametrize("fault", ["raise", "sandbox", "kill", "endpoint"])
def test_reward_pool_faults_leave_the_step_as_if_the_rows_never_existed(fault, server):
    if fault == "sandbox" and (why := check_sandbox(SandboxConfig())) is not None:
        pytest.skip(f"the sandbox cannot run here: {why}")
    spec = spec_for(fault, server)
    try:
        scoring = Scoring(spec.algorithm, spec.rollout.max_response_tokens, frozenset({EOS}))
        pool = local_reward_pool(spec)
        pool.start()
        try:
            clean = score_round(pool, scoring, *round_of(fault, injected=False))
            hit = score_round(pool, scoring, *round_of(fault, injected=True))
            metrics = pool.metrics()
        finally:
            pool.shutdown()
    finally:
        REWARD_FUNCTIONS.pop("judge", None)
    failed = hit.rewards.isnan()
    assert int(failed.sum()) == 5 and not clean.rewards.isnan().any()
    assert clean.rewards.unique().tolist() == [0.0, 1.0]  # the clean rows were really scored, right and wrong
    assert [v for v, f in zip(hit.valid_lengths, failed.tolist()) if f] == [0] * 5  # out of the loss
    assert (hit.advantages[failed] == 0).all()
    kept = (~failed).nonzero().flatten().tolist()
    assert [hit.valid_lengths[i] for i in kept] == clean.valid_lengths
    assert torch.equal(hit.advantages[kept], clean.advantages)
    got, want = figures(hit), figures(clean)
    for key in want:
        if key.startswith(("reward/", "response_length/", "groups/")) and key not in COUNTS:
            assert got[key] == pytest.approx(want[key], abs=0, rel=0), key
    assert (got["reward/infra_failed"], want["reward/infra_failed"]) == (5, 0)
    if fault == "kill":
        assert metrics["reward_pool/lost_calls"] == 5 and metrics["reward_pool/worker_restarts"] == 5
    # failed evaluations (completions x functions): the verifier raised on 5; a lost call fails both functions
    assert got["reward/failed"] == {"raise": 5, "kill": 10, "sandbox": 0, "endpoint": 0}[fault]


def test_reward_pool_faults_counting_the_rows_would_change_the_figures(server):
    """The comparison can fail: with the injected rows scored 0 instead of left out, the figures differ."""
    spec = spec_for("raise", server)
    scoring = Scoring(spec.algorithm, spec.rollout.max_response_tokens, frozenset({EOS}))
    groups, examples = round_of("raise", injected=True)
    zeroed = [GroupResult(g.group_id, g.prompt_ids, g.response_ids, g.behaviour_logprobs, g.finish_reasons,
                          ["0" if t.startswith("RAISE") else t for t in g.texts], 0) for g in groups]
    clean = scoring.score(*round_of("raise", injected=False))
    counted = scoring.score(zeroed, examples)
    assert figures(counted)["reward/mean"] != figures(clean)["reward/mean"]
    assert figures(counted)["response_length/mean"] != figures(clean)["response_length/mean"]
