"""Issue 35 through the real loop (``cluster.in_process.local_job``, tiny random Llama, 2 steps, ≈ 10 s): a TRL user's
multi-task mix, where each reward returns None for the rows of the other task, trains (it stopped the job with
"infrastructure failures" before); and a held-out evaluation whose accuracy reward leaves a completion unscored
reports it in ``eval/unscored`` and keeps it out of ``eval/accuracy`` and ``eval/n``. Selectable with
``-k "trl_convention or denominator"``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.in_process import local_job
from grpo.stats import wilson_interval
from tests.job_runs import stopped_after
from tests.local_runtime import local_spec

EVAL_PROBLEMS = 3


def even_length(completions, task, **kwargs):
    """Scores the 'even' task's rows (1.0 for an even character count), None for the other task's."""
    return [float(len(c) % 2 == 0) if t == "even" else None for c, t in zip(completions, task)]


def short(completions, task, **kwargs):
    """Scores the 'short' task's rows (1.0 under 12 characters), None for the other task's."""
    return [float(len(c) < 12) if t == "short" else None for c, t in zip(completions, task)]


def held_out(completions, prompts, **kwargs):
    """The held-out scorer: parity, and no score (its verifier 'could not run') for a prompt that says 'skip'."""
    return [None if "skip" in p else float(len(c) % 2 == 0) for c, p in zip(completions, prompts)]


@pytest.fixture(scope="module")
def mix_rewards():
    from grpo.rewards import REWARD_FUNCTIONS, register_reward_function

    names = {"mix_even": even_length, "mix_short": short, "mix_held_out": held_out}
    for name, fn in names.items():
        register_reward_function(name)(fn)
    yield
    for name in names:
        REWARD_FUNCTIONS.pop(name)


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def mix_run(tiny_model_dir, mix_rewards, tmp_path_factory):
    out = tmp_path_factory.mktemp("trl_mix")
    train = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}", "task": ("even", "short")[i % 2]}
             for i in range(8)]
    held = [{"question": f"What is {i} + 2?{' skip' if i == 1 else ''}", "answer": f"#### {i + 2}"}
            for i in range(EVAL_PROBLEMS)]
    spec = local_spec(
        tiny_model_dir, str(out), data={"train_path": _write(out / "train.jsonl", train), "max_prompt_tokens": 256},
        algorithm={"kl_coef": 0.04, "rewards": {"mix_even": 1.0, "mix_short": 1.0}},
        eval={"data_path": _write(out / "held.jsonl", held), "every_steps": 1, "max_tokens": 6,
              "accuracy_reward": "mix_held_out", "format_reward": None},
        metrics={"port": None}, checkpoint={"every_steps": 0, "save_final": False})
    with stopped_after(local_job(spec, progress=False)) as job:
        history = job.run()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"spec": spec, "history": history, "rows": rows}


def test_trl_convention_multi_task_mix_trains_through_the_loop(mix_run):
    history, spec = mix_run["history"], mix_run["spec"]
    n = spec.rollout.prompts_per_step * spec.rollout.group_size
    assert [m["policy_version"] for m in history] == [1, 2]
    for m in history:
        assert m["reward/infra_failed"] == 0 and m["reward/not_applicable"] == n  # each row skipped by one reward
        assert m["reward/scored/mix_even"] + m["reward/scored/mix_short"] == n
        assert m["rollout/sequences_trained"] == n


def test_denominator_loop_eval_leaves_the_unscored_completion_out(mix_run):
    rows = mix_run["rows"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert (r["eval/unscored"], r["eval/n"], r["eval/problems"]) == (1.0, EVAL_PROBLEMS - 1, EVAL_PROBLEMS - 1)
        right = round(r["eval/accuracy"] * 2)
        assert r["eval/accuracy"] == right / 2  # over the two scored problems, not three
        assert (r["eval/accuracy_ci_low"], r["eval/accuracy_ci_high"]) == pytest.approx(wilson_interval(right, 2))
