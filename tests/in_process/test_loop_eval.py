"""Held-out evaluation inside the loop, on the in-process runtime (``cluster.in_process.local_job``: tiny_cpu
example, tiny random Llama, transformers sampling, one train rank; 2 steps, seconds): the starting weights' row
(step 0), eval/* keys on the steps' rows, sane values, Prometheus gauges, and ``checkpoint.keep_best`` keeping the
best step's checkpoint past ``keep_last``. None of it needs Ray or vLLM.

A random model never solves GSM8K, so which step is best is set by a test reward used as ``eval.accuracy_reward``:
``eval_script`` pays no problem, every problem and the first problem only at the job's first, second and third
evaluation (steps 0, 1, 2: pass@1 0, 1 and 1/3; pass@1 counts full scores, so a script of 0/1 scores), so step 1 is
the best and its checkpoint must survive ``keep_last: 1``. The GSM8K verifier itself is tested in tests/unit.
"""

from __future__ import annotations

import json

import pytest

from grpo.stats import wilson_interval
from tests.job_runs import stopped_after
from tests.prometheus_scrape import scrape
from tests.reference_job import EXAMPLE

PROBLEMS = 3
SCRIPT = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), (1.0, 0.0, 0.0))  # eval_script's score per problem, per evaluation
ACCURACY = [sum(scores) / PROBLEMS for scores in SCRIPT]


@pytest.fixture(scope="module")
def eval_script():
    """Register ``eval_script``: in the i-th evaluation (one call over the PROBLEMS completions, as
    ``cluster.loop.evaluation.score_problems`` calls it) problem j scores SCRIPT[i][j]."""
    from grpo.rewards import REWARD_FUNCTIONS, register_reward_function

    calls = []

    def script(completions: list[str], references: list[str]) -> list[float]:
        calls.append(len(completions))  # one call per evaluation, over its PROBLEMS completions (eval.samples 1)
        assert len(completions) == PROBLEMS, completions
        return list(SCRIPT[len(calls) - 1])

    register_reward_function("eval_script")(script)
    yield calls
    REWARD_FUNCTIONS.pop("eval_script")


@pytest.fixture(scope="module")
def eval_run(tiny_model_dir, gsm8k_train_path, parity_registered, eval_script, tmp_path_factory):
    from cluster.in_process import local_job
    from cluster.spec import load_spec

    tmp = tmp_path_factory.mktemp("eval_run")
    held = tmp / "held.jsonl"
    held.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                            for i in range(PROBLEMS + 2)))
    spec = load_spec(EXAMPLE, [
        f"model.path={tiny_model_dir}", f"output_dir={tmp / 'out'}", "metrics.port=0", "total_steps=2",
        'algorithm.rewards={"parity": 1.0, "accuracy": 0.0, "format": 0.0}',
        f"eval={{data_path: {held}, limit: {PROBLEMS}, every_steps: 1, max_tokens: 8, accuracy_reward: eval_script}}",
        "checkpoint.every_steps=0", "checkpoint.keep_last=1", "checkpoint.keep_best=true",
    ])
    with stopped_after(local_job(spec, progress=False)) as job:
        history = job.run()
        samples = scrape(job.metrics.url)
    rows = [json.loads(line) for line in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
    return {"spec": spec, "history": history, "rows": rows, "samples": samples, "out": tmp / "out"}


EVAL_KEYS = {"eval/accuracy", "eval/accuracy_ci_low", "eval/accuracy_ci_high", "eval/n", "eval/problems",
             "eval/unscored", "eval/response_length_mean", "eval/truncated_fraction", "eval/format_rate",
             "eval/format_unscored", "eval/seconds", "eval/best_accuracy", "eval/best_step", "eval/dropped"}


def test_step_0_row_then_eval_keys_on_every_step_row(eval_run):
    rows = eval_run["rows"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert set(rows[0]) == {"step"} | EVAL_KEYS  # the starting weights: eval keys only
    for row, history in zip(rows[1:], eval_run["history"]):
        assert EVAL_KEYS <= set(row) and "policy_version" in row and row == {"step": row["step"], **history}


def test_eval_values_are_sane(eval_run):
    rows = eval_run["rows"]
    assert [r["eval/accuracy"] for r in rows] == pytest.approx(ACCURACY)
    for r in rows:
        assert r["eval/n"] == r["eval/problems"] == PROBLEMS
        low, high = wilson_interval(round(r["eval/accuracy"] * PROBLEMS), PROBLEMS)
        assert (r["eval/accuracy_ci_low"], r["eval/accuracy_ci_high"]) == pytest.approx((low, high))
        assert r["eval/accuracy_ci_low"] <= r["eval/accuracy"] <= r["eval/accuracy_ci_high"]
        assert 0 < r["eval/response_length_mean"] <= 8  # eval.max_tokens, not rollout.max_response_tokens (16)
        assert 0.0 <= r["eval/truncated_fraction"] <= 1.0 and r["eval/format_rate"] == 0.0  # random model
        assert r["eval/seconds"] > 0
    assert [(r["eval/best_step"], r["eval/best_accuracy"]) for r in rows] == [(0, 0.0), (1, 1.0), (1, 1.0)]


def test_eval_calls_are_not_counted_in_the_steps_engine_figures(eval_run):
    workers = [json.loads(line) for line in (eval_run["out"] / "workers.jsonl").read_text().splitlines()]
    assert [(w["step"], w["rollout/queue_depth"]) for w in workers] == [(1, 2.0), (2, 2.0)]  # B = 2 groups, not 2 + 3


def test_keep_best_keeps_the_best_steps_checkpoint_past_keep_last(eval_run):
    ckpts = eval_run["out"] / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["step_000001", "step_000002"]
    state = json.loads((ckpts / "step_000002" / "trainer_state.json").read_text())
    assert state["eval"] == {"best_step": 1, "best_accuracy": 1.0}


def test_prometheus_has_eval_gauges(eval_run):
    driver = f'job="{eval_run["spec"].name}",pool="driver",worker="driver"'
    samples = eval_run["samples"]
    assert samples[f"grpo_eval_accuracy{{{driver}}}"] == pytest.approx(1 / 3)
    assert samples[f"grpo_eval_best_step{{{driver}}}"] == 1.0
    assert samples[f"grpo_eval_n{{{driver}}}"] == PROBLEMS
