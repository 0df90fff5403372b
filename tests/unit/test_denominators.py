"""Issue 35 item 2, no silent denominators: every count metric counts what its name says, and what could not be scored
is reported, not folded into another count. The training side here (``rollout/sequences_trained``, the console line,
the reward-hacking monitor's sample counts, the guard's choice of the offending reward); held-out evaluation's in
tests/unit/test_loop_evaluation.py. Selectable with ``-k denominator``."""

from __future__ import annotations

import math

import pytest
import torch

from cluster.loop.guard import Guard
from cluster.loop.sampling import sample_groups
from cluster.loop.scoring import Scoring
from cluster.loop.step_metrics import _sampling_metrics
from cluster.sinks.metrics import format_console_line
from cluster.spec import load_spec_text
from cluster.spec.monitor import MonitorSpec
from contract.messages import GroupResult
from grpo.monitor import Monitor, MonitorConfig

EOS = 2


def test_denominator_sequences_trained_counts_the_rows_that_train_a_token():
    """A completion masked whole (``mask_truncated``: cut at the cap) keeps its place in its group but trains no
    token: it is not a trained sequence."""
    spec = load_spec_text("output_dir: out\ntotal_steps: 1\ndata: {train_path: t.jsonl}\nrollout: "
                          "{max_response_tokens: 4}\nalgorithm: {rewards: {accuracy: 1.0}, mask_truncated: true}\n")
    ids = [[5, EOS], [5, 6, 7, 8], [5, 6, EOS], [5, 5, 5, 5]]
    group = GroupResult(0, [1], ids, [torch.full((len(i),), -0.5) for i in ids], ["stop", "length", "stop", "length"],
                        ["#### 3", "#### 3", "#### 4", "#### 4"], 0)
    batch = Scoring(spec.algorithm, 4, frozenset({EOS})).score([group], ["3"])
    assert batch.valid_lengths == [2, 0, 3, 0]
    figures = _sampling_metrics(sample_groups(lambda k: batch, 1), group_size=4, version_at_train=0)
    assert figures["rollout/sequences_trained"] == 2 and figures["rollout/groups_sampled"] == 1


def test_denominator_console_line_shows_what_was_not_scored_only_when_there_is_some():
    row = {"reward/mean": 0.5, "reward/infra_failed": 0, "eval/accuracy": 0.25, "eval/n": 4.0, "eval/unscored": 0.0}
    assert "unscored" not in format_console_line(3, row)
    line = format_console_line(3, {**row, "reward/infra_failed": 2, "eval/unscored": 5.0})
    assert "reward 0.500 unscored 2 |" in line and "eval 0.250 n=4 unscored 5" in line


def _rows(scored: int | None) -> list[dict]:
    """11 steps of 16 groups x G = 4: response length 100 → 150 from step 6 (a drift of +50 %) while the verifiable
    reward rises 0.1 → 0.35; ``scored``: the rows it scored per step (``reward/scored/accuracy``; None: not
    logged)."""
    rows = []
    for step in range(1, 12):
        row = {"response_length/mean": 100.0 if step <= 5 else 150.0, "reward/accuracy": 0.1 if step <= 5 else 0.35,
               "rollout/groups_sampled": 16, "rollout/group_size": 4, "reward/infra_failed": 0}
        if scored is not None:
            row["reward/scored/accuracy"] = scored
        rows.append(row)
    return rows


def test_denominator_monitor_weighs_a_reward_by_the_rows_it_scored():
    """"Accuracy rose" is a test of a proportion over the completions it is a mean of. When the verifiable reward
    applies to 4 rows of 64 (a multi-task mix), its rise 0.1 → 0.35 is within the noise of 4 samples a step, so it
    does not excuse the length drift; counted over all 64 it would."""
    def fired(rows: list[dict]) -> bool:
        monitor = Monitor(MonitorConfig(detectors=("length_drift",)))
        return any(monitor.update(step, row)["monitor/length_drift"] for step, row in enumerate(rows, start=1))

    assert fired(_rows(scored=4))
    assert not fired(_rows(scored=64)) and not fired(_rows(scored=None))  # all 64 scored: the rise is real


def test_denominator_monitor_leaves_infrastructure_failures_out_of_the_sample_count():
    """Without per-reward counts, the completions behind a reward's mean are those sampled less those without a
    reward (``reward/infra_failed``): 60 of 64 failed leave 4."""
    rows = [{**row, "reward/infra_failed": 60} for row in _rows(scored=None)]
    monitor = Monitor(MonitorConfig(detectors=("length_drift",)))
    assert any(monitor.update(step, row)["monitor/length_drift"] for step, row in enumerate(rows, start=1))


def test_denominator_guard_ignores_steps_where_a_reward_scored_nothing(tmp_path):
    """A reward that scored no row of a step has mean NaN there (no denominator); the guard's choice of the reward
    to reduce compares the rises of the steps each reward was measured on."""
    guard = Guard(MonitorSpec(action="rollback", shaping_rewards=("format", "style")), tmp_path,
                  {"accuracy": 1.0, "format": 0.2, "style": 0.2}, status=lambda message: None)
    for step in range(1, 9):
        late = step > 5
        guard.rows[step] = {"reward/format": math.nan if step == 7 else 0.1, "reward/style": 0.3 if late else 0.0}
    assert guard.offending_reward() == "style"


@pytest.mark.parametrize("key", ["eval/problems", "eval/n"])
def test_denominator_monitor_eval_interval_uses_the_scored_count(key):
    """An eval row without its interval keys gets a Wilson interval over the scored count it carries."""
    monitor = Monitor(MonitorConfig(detectors=("eval_drop",)))
    monitor.update(1, {"eval/accuracy": 0.5, key: 10})
    monitor.update(2, {"eval/accuracy": 0.0, key: 10})
    assert monitor.update(3, {"eval/accuracy": 0.0, key: 10})["monitor/eval_drop"] == 1.0
    with pytest.raises(ValueError, match="eval/problems / eval/n >= 1"):
        monitor.update(4, {"eval/accuracy": 0.5, key: 0})


def test_denominator_reward_pool_lost_rows_counts_the_rows_a_step_stopped_waiting_for():
    """``reward_pool/lost_rows`` counts every row the pool gave no score, the rows of a chunk the step stopped
    waiting for (``collect``'s deadline) as well as those of a worker that died."""
    import threading

    from cluster.in_process.reward_pool import ThreadRewardWorker
    from cluster.rewards.pool import WorkerPool
    from contract.rewards import RewardCall
    from grpo.rewards import REWARD_FUNCTIONS, register_reward_function

    release = threading.Event()

    def slow(completions, references):
        if "SLOW" in completions:
            release.wait(10)
        return [1.0] * len(completions)

    register_reward_function("denominator_slow")(slow)
    pool = WorkerPool(lambda i: ThreadRewardWorker(), workers=2, batch_size=2, timeout_s=30, kind="threads")
    pool.start()
    try:
        calls = [RewardCall(texts, ["a"] * len(texts), ["q"] * len(texts), {}, {"denominator_slow": 1.0}, "raise")
                 for texts in (["SLOW", "b"], ["c", "d"])]
        scores = pool.collect(pool.submit(calls), 0.5)
        assert scores[0].total.isnan().all() and scores[1].total.tolist() == [1.0, 1.0]
        assert pool.metrics()["reward_pool/lost_rows"] == 2
    finally:
        release.set()
        pool.shutdown()
        REWARD_FUNCTIONS.pop("denominator_slow")


class _Trainer:
    """A stand-in trainer: one rank, every step's result given by the test."""

    world_size = 1

    def __init__(self, result):
        self.result = result

    def set_kl_coef(self, kl_coef: float) -> None:
        pass

    def set_lr(self, lr: float) -> None:
        pass

    def train_step(self, per_rank, num_tokens, num_sequences):
        return self.result


def _train_once(result, *overrides: str):
    """One TrainPhase.train on a batch of 4 rows, 2 of which trained no token (no reward): (controller, skips)."""
    from cluster.loop.step_metrics import StepBatch
    from cluster.loop.training import SkippedUpdates, TrainPhase
    from contract.figures import FleetFigures
    from contract.versions import PolicyVersionLedger
    from grpo.kl import make_kl_controller

    spec = load_spec_text("output_dir: out\ntotal_steps: 1\ndata: {train_path: t.jsonl}\nrollout: "
                          "{max_response_tokens: 4}\nalgorithm: {rewards: {accuracy: 1.0}, kl_coef: 0.1, "
                          "kl_controller: adaptive, "
                          "kl_horizon_sequences: 100}\n", overrides=overrides)
    ids = [[5, EOS]] * 4
    group = GroupResult(0, [1], ids, [torch.full((2,), -0.5)] * 4, ["stop"] * 4, ["#### 3", "#### 4", "x", "y"], 0)
    rows = Scoring(spec.algorithm, 4, frozenset({EOS})).score([group], ["3"])
    rows.rewards[2:] = math.nan  # as a lost reward call leaves them: no reward, no token in the loss
    rows.valid_lengths[2:] = [0, 0]
    controller, skips = make_kl_controller("adaptive", 0.1, 0.01, 100), SkippedUpdates(3)
    phase = TrainPhase(spec, controller, skips, PolicyVersionLedger(), status=lambda message: None,
                       trainer=_Trainer(result), fleet=None)
    phase.train(StepBatch(1, sample_groups(lambda k: rows, 1), 4, [0], FleetFigures(), {}, {}))
    return controller, skips


def test_denominator_adaptive_kl_controller_counts_the_sequences_that_trained():
    """β moves by clip(KL/target − 1, ±0.2) · n / horizon with n the sequences the KL was measured on (those with a
    token in the loss), not every row of the batch."""
    from contract.messages import TrainResult

    controller, _ = _train_once(TrainResult(policy_version=1, skipped=False, skip_reason="", metrics={}, kl=1.0))
    assert controller.value == pytest.approx(0.1 * (1 + 0.2 * 2 / 100))


def test_denominator_updates_skipped_total_counts_optimizer_updates():
    """With num_iterations 4, a step that skipped 2 of its 4 updates adds 2 to actor/updates_skipped_total (and
    actor/update_skipped is 0.5), while the in-a-row count that stops a job counts steps."""
    from contract.messages import TrainResult

    result = TrainResult(policy_version=1, skipped=True, skip_reason="actor/loss",
                         metrics={"actor/update_skipped": 0.5}, kl=None)
    _, skips = _train_once(result, "algorithm.num_iterations=4")
    assert (skips.total, skips.in_a_row) == (2, 1)


def test_denominator_engine_idle_fraction_is_over_the_engine_time_of_all_calls():
    """rollout/engine_idle_fraction: the idle share of the step's engine time, so a 100 s call idle 10 % and a 1 s
    call idle 90 % are idle (10 + 0.9) / 101 of the time, not the calls' mean 50 %."""
    from contract.figures import FleetFigures
    from contract.messages import EngineLoad, PoolGenerateStats

    figures = FleetFigures()
    figures.add(PoolGenerateStats(tokens=10, engine_seconds=[90.0], engine_idle_fraction=0.1,
                                  per_engine=[EngineLoad(groups=1)], capacity_seconds=100.0))
    figures.add(PoolGenerateStats(tokens=1, engine_seconds=[0.1], engine_idle_fraction=0.9,
                                  per_engine=[EngineLoad(groups=1)], capacity_seconds=1.0))
    assert figures.idle_fraction == pytest.approx(1 - 90.1 / 101)
