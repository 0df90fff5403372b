"""``samples.jsonl`` and the report page from real jobs on the in-process runtime (the tiny random Llama, no Ray or
vLLM, ≈ 10 s a job): a one-step-off job (its batches are sampled one version behind the trainer, so the
trainer-vs-engine logprob gaps are real) and a multi-turn job (the ``scripted`` environment), each 2 steps with a
held-out evaluation after every step; then ``grpo-cluster report`` on the first, opened in headless Chromium (skipped
without it).

The job samples every group (``metrics.samples_per_step`` = ``rollout.prompts_per_step``), so the samples' per-token
gaps average to the step's ``rollout/logprob_diff`` exactly as the trainer computed it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.in_process import local_job
from cluster.sinks.report.curves import MEAN_COLOR
from tests.headless_chromium import chromium, dom, screenshot
from tests.job_runs import run_to_end
from tests.local_runtime import local_spec
from tests.registered import parity_reward, temporarily_registered

STEPS, GROUPS, G, EVAL_PROBLEMS = 2, 2, 4, 3


@pytest.fixture(scope="module")
def parity():
    yield from temporarily_registered("parity", parity_reward)


def _problems(path: Path, count: int, offset: int = 0) -> str:
    rows = [{"question": f"What is {i} + {i + 1}?", "answer": f"#### {2 * i + 1}"}
            for i in range(offset, offset + count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _job(out: Path, model: str, **rollout):
    spec = local_spec(
        model, str(out), total_steps=STEPS,
        data={"train_path": _problems(out / "train.jsonl", 8), "max_prompt_tokens": 256},
        rollout={"prompts_per_step": GROUPS, "group_size": G, **rollout},
        algorithm={"kl_coef": 0.04, "rewards": {"parity": 1.0, "accuracy": 0.0, "format": 0.0}},
        eval={"data_path": _problems(out / "held_out.jsonl", EVAL_PROBLEMS, offset=50), "every_steps": 1,
              "max_tokens": min(6, rollout.get("max_response_tokens", 8)), "accuracy_reward": "parity"},
        metrics={"port": None, "samples_per_step": GROUPS}, checkpoint={"every_steps": 0, "save_final": False})
    history = run_to_end(local_job(spec, progress=False))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return {"out": out, "history": history, "rows": rows, "samples": samples}


@pytest.fixture(scope="module")
def one_step_off(tiny_model_dir, parity, tmp_path_factory):
    return _job(tmp_path_factory.mktemp("report_one_step_off"), tiny_model_dir, mode="one_step_off",
                max_staleness=1)


@pytest.fixture(scope="module")
def multi_turn(tiny_model_dir, parity, tmp_path_factory):
    episodes = {"environment": "scripted", "options": {"observations": ["Go on."], "done_after": 9,
                                                       "rewards": [0.0, 0.25]}, "max_turns": 3,
                "max_episode_tokens": 64}
    return _job(tmp_path_factory.mktemp("report_multi_turn"), tiny_model_dir, max_response_tokens=4,
                multi_turn=episodes)


def _train(samples: list[dict], step: int) -> list[dict]:
    return [r for r in samples if r["kind"] == "train" and r["step"] == step]


def test_samples_hold_every_step_groups_tokens_and_trainer_engine_gaps(one_step_off):
    rows = {r["step"]: r for r in one_step_off["rows"]}
    for step in range(1, STEPS + 1):
        groups = _train(one_step_off["samples"], step)
        assert len(groups) == GROUPS and all(len(g["completions"]) == G for g in groups)
        completions = [c for g in groups for c in g["completions"]]
        for c in completions:
            assert len(c["tokens"]) == len(c["trained"]) == len(c["gap"]) == len(c["logprob"]) == c["length"]
            assert c["trained"].count("1") == c["loss_tokens"] and not c["cut"]
            assert c["staleness"] == rows[step]["rollout/staleness_max"]
        gaps = [abs(gap) for c in completions for gap, t in zip(c["gap"], c["trained"]) if t == "1"]
        assert None not in gaps
        if step == STEPS:  # one step off: the batch of step 2 was sampled by version 0 and trains version 1
            assert max(gaps) > 1e-4 and rows[step]["rollout/staleness_max"] == 1
        assert sum(gaps) / len(gaps) == pytest.approx(rows[step]["rollout/logprob_diff"], rel=2e-3)
        rewards = [c["reward"] for c in completions]
        assert sum(rewards) / len(rewards) == pytest.approx(rows[step]["reward/mean"], abs=1e-3)
        assert all(g["policy_version"] == rows[step]["policy_version"] for g in groups)


def test_samples_hold_every_held_out_problem_of_each_evaluation(one_step_off):
    for row in (r for r in one_step_off["rows"] if "eval/accuracy" in r):
        problems = [r for r in one_step_off["samples"] if r["kind"] == "eval" and r["step"] == row["step"]]
        assert [p["problem"] for p in problems] == list(range(EVAL_PROBLEMS))
        correct = [c["correct"] for p in problems for c in p["completions"]]
        assert sum(correct) / len(correct) == pytest.approx(row["eval/accuracy"])


def test_samples_of_a_multi_turn_episode_show_its_turns_and_observations(multi_turn):
    for group in _train(multi_turn["samples"], STEPS):
        for c in group["completions"]:
            assert c["episode"]["turns"] == 3 and c["episode"]["observation_tokens"] > 0
            roles = [t["role"] for t in c["turns"]]
            assert roles == ["assistant", "observation", "assistant", "observation", "assistant"]
            for turn in c["turns"]:
                trained = c["trained"][turn["start"]:turn["end"]]
                assert turn["text"] == "".join(c["tokens"][turn["start"]:turn["end"]])
                if turn["role"] == "observation":
                    assert "Go on." in turn["text"] and set(trained) == {"0"}
                else:
                    assert turn["tool_calls"] == []


def _open(page: Path, fragment: str) -> str:
    html, console = dom(page, fragment)
    assert console == [], console
    return html


def test_report_page_shows_the_curves_and_opens_a_sample_in_headless_chromium(one_step_off, tmp_path, capsys):
    chromium()
    assert main(["report", str(one_step_off["out"])]) == 0
    page = one_step_off["out"] / "report.html"
    assert capsys.readouterr().out.strip() == f"wrote {page}"
    console = screenshot(page, tmp_path / "shot.png")
    assert console == [], console
    from matplotlib.image import imread

    pixels = (imread(str(tmp_path / "shot.png"))[..., :3] * 255).round()
    want = [int(MEAN_COLOR[i:i + 2], 16) for i in (1, 3, 5)]
    assert int((abs(pixels - want).max(axis=-1) <= 8).sum()) > 300, "no curve drawn in the mean colour"
    group = next(g for g in _train(one_step_off["samples"], STEPS) if g["mixed"])
    c = next(c for c in group["completions"] if c["advantage"] and c["loss_tokens"])
    html = _open(page, f"train/{STEPS}/{group['group_id']}/{c['index']}")
    assert f'data-open="train/{STEPS}/{group["group_id"]}/{c["index"]}"' in html
    assert html.count('class="tok"') == c["loss_tokens"]
    assert html.count('class="tok"') + html.count('class="tok untrained"') == c["length"]
    colour = "rgba(44, 160, 44" if c["advantage"] > 0 else "rgba(214, 39, 40"
    assert html.count(f"background-color: {colour}") == c["loss_tokens"]  # advantage shading on trained tokens
    assert "scatterlayer" in html  # plotly drew its traces
    where = f"train/{STEPS}/{group['group_id']}/{c['index']}"
    html = _open(page, f"{where}/gap")
    known = sum(gap is not None for gap in c["gap"])
    assert html.count("background-color: rgba(255, 127, 14") + html.count("background-color: rgba(148, 103, 189") \
        == known > 0
    html = _open(page, f"{where}/trained")
    assert html.count("background-color: rgba(31, 119, 180") == c["loss_tokens"]
    assert html.count("background-color: rgba(128, 128, 128") == c["length"] - c["loss_tokens"]


def test_report_page_opens_a_multi_turn_episode_and_a_held_out_problem(multi_turn):
    chromium()
    assert main(["report", str(multi_turn["out"])]) == 0
    page = multi_turn["out"] / "report.html"
    group = _train(multi_turn["samples"], 1)[0]
    html = _open(page, f"train/1/{group['group_id']}/0")
    assert html.count('class="turn observation"') == 2 and html.count('class="turn assistant"') == 3
    html = _open(page, "eval/1/2/0")
    assert 'data-open="eval/1/2/0"' in html and "Held-out problem 2" in html
