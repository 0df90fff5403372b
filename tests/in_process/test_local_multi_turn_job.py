"""The real loop (``GRPOJob`` on the in-process runtime) with multi-turn episodes: ``rollout.multi_turn`` with the
``scripted`` environment in ``sync``, ``one_step_off`` and ``async`` with partial rollouts, 2 steps each on the tiny
random Llama, held-out evaluation running episodes too.

In ``async`` the fleet holds the producer's second-turn call after two token steps until the schedule interrupts it
(after the train step), so an episode is cut mid-turn by a weight update and finished on the new weights: its
trajectory spans two policy versions (``rollout/partial_older_token_fraction`` > 0).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from cluster.driver import GRPOJob
from cluster.in_process import LocalFleet, LocalTrainer
from tests.job_runs import stopped_after
from tests.local_runtime import local_spec
from tests.registered import parity_reward, temporarily_registered

TURN = 4
MAX_TURNS = 3
MODES = {"sync": {"mode": "sync"}, "one_step_off": {"mode": "one_step_off", "max_staleness": 1},
         "async": {"mode": "async", "max_staleness": 1, "partial_rollout": True}}


@pytest.fixture(scope="module")
def parity():
    yield from temporarily_registered("parity", parity_reward)


class HoldsATurn(LocalFleet):
    """Holds the producer's second generate call (turn 2 of the batch it prefetches) after two token steps until
    the schedule interrupts it (``interrupt``, after the train step)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.producer_calls, self.steps, self.held = 0, 0, 0
        self.released = threading.Event()

    def interrupt(self, epoch: int) -> None:
        super().interrupt(epoch)
        self.released.set()

    def generate(self, requests, *args, interrupt_epoch=None, **kwargs):
        if interrupt_epoch is not None:
            self.producer_calls += 1
            self.steps = 0
        return super().generate(requests, *args, interrupt_epoch=interrupt_epoch, **kwargs)

    def interrupted(self, interrupt_epoch):
        if interrupt_epoch is not None and self.producer_calls == 2:
            self.steps += 1
            if self.steps == 3:
                self.held += 1
                assert self.released.wait(120), "the schedule never interrupted the producer"
        return super().interrupted(interrupt_epoch)


def _problems(path: Path, count: int, offset: int = 0) -> str:
    rows = [{"question": f"What is {i} + {i + 1}?", "answer": f"#### {2 * i + 1}"}
            for i in range(offset, offset + count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module", params=sorted(MODES))
def job_run(request, tiny_model_dir, parity, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"multi_turn_{request.param}")
    multi_turn = {"environment": "scripted", "options": {"observations": ["Go on."], "done_after": 9,
                                                         "rewards": [0.0, 0.25]},
                  "max_turns": MAX_TURNS, "max_episode_tokens": 64}
    spec = local_spec(
        tiny_model_dir, str(out),
        data={"train_path": _problems(out / "train.jsonl", 8), "max_prompt_tokens": 256},
        rollout={"max_response_tokens": TURN, "multi_turn": multi_turn, **MODES[request.param]},
        algorithm={"kl_coef": 0.04, "rewards": {"parity": 1.0, "accuracy": 0.0, "format": 0.0}},
        eval={"data_path": _problems(out / "held_out.jsonl", 2, offset=50), "every_steps": 2, "max_tokens": TURN,
              "accuracy_reward": "parity"},
        metrics={"port": None}, checkpoint={"every_steps": 0, "save_final": False})
    fleet = HoldsATurn(spec) if request.param == "async" else LocalFleet(spec)
    job = GRPOJob(spec, fleet=fleet, trainer=LocalTrainer(spec), progress=False)
    with stopped_after(job):
        history = job.run()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"mode": request.param, "history": history, "rows": rows, "fleet": fleet}


def test_multi_turn_job_trains_on_episodes_in_every_mode(job_run):
    history = job_run["history"]
    assert [m["policy_version"] for m in history] == [1, 2]
    for m in history:
        assert m["sync/verified"] is True and m["actor/update_skipped"] == 0.0
        assert m["episode/turns_mean"] == MAX_TURNS and m["episode/max_turns_fraction"] == 1.0
        assert m["episode/observation_tokens_mean"] > 0 and m["episode/infra_failed"] == 0
        assert 0 < m["response_length/mean"] <= MAX_TURNS * TURN  # sampled tokens only
        assert m["reward/environment"] == pytest.approx(0.25)  # the scripted turn rewards
    if job_run["mode"] == "sync":  # on-policy: the trainer's logprobs of every sampled token are the fleet's
        assert all(m["rollout/logprob_diff"] < 2e-5 for m in history), [m["rollout/logprob_diff"] for m in history]


def test_goodput_environment_pool_adds_up_in_every_mode(job_run):
    """The environment slots (``rollout.multi_turn.parallel``) are a pool of the goodput ledger; every pool's parts
    add up to workers × ``timing/step_s`` whatever the mode (partial rollouts and held-out episodes included)."""
    from tests.unit.test_goodput import check_adds_up

    for m in job_run["history"]:
        assert not check_adds_up(m, m["timing/step_s"]), check_adds_up(m, m["timing/step_s"])
        assert m["time/environment_workers"] >= 1 and m["time/environment_busy_s"] >= 0


def test_multi_turn_job_evaluates_held_out_episodes(job_run):
    rows = job_run["rows"]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    for r in evals:
        assert r["eval/turns_mean"] == MAX_TURNS and r["eval/n"] == 2 and r["eval/max_turns_fraction"] == 1.0
        assert 0 < r["eval/response_length_mean"] <= MAX_TURNS * TURN


def test_multi_turn_async_episode_spans_a_weight_update(job_run):
    if job_run["mode"] != "async":
        pytest.skip("the weight update lands mid-episode in async mode with partial rollouts")
    step1, step2 = job_run["history"]
    assert job_run["fleet"].held == 1
    assert step1["rollout/partial_interrupted"] == 8 and step1["rollout/partial_carried_groups"] == 2  # mid-turn 2
    assert step2["rollout/partial_resumed"] == 8 and step2["rollout/partial_restarted"] == 0
    assert step2["rollout/partial_older_token_fraction"] > 0  # trajectories sampled by version 0 and version 1
    assert step2["rollout/sample_policy_version_min"] == 0 and step2["rollout/staleness_max"] == 1
