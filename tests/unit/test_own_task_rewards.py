"""Issue #27, rewards that see the whole row: the calling conventions (``grpo.rewards.calling``), async rewards, what a
reward may return, rewards named in the spec by location (``grpo.rewards.loading``), their row checks, and the
example task (examples/own_task) validated and scored with its extra columns."""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
from pathlib import Path

import pytest
import torch

from cluster.data import Example
from cluster.loop.scoring import Scoring
from cluster.spec import SpecError, load_spec, load_spec_text
from contract.messages import GroupResult
from grpo.rewards import REWARD_FUNCTIONS, RewardError, RewardOutputError, combine_rewards, register_reward_function
from grpo.rewards.calling import REFERENCES, WHOLE_ROW, signature_of, where_defined

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def temp_reward():
    added = []

    def add(name, fn, **kwargs):
        register_reward_function(name, **kwargs)(fn)
        added.append(name)
        return fn

    yield add
    for name in added:
        REWARD_FUNCTIONS.pop(name)


def _legacy(c, r):
    return [1.0] * len(c)


def _completions_references(completions, references):
    return [1.0] * len(completions)


def _answer_only(completions, answer):
    return [float(a) for a in answer]


def _everything(prompts, completions, **columns):
    return [0.0] * len(completions)


def _needs_a_column(completions, difficulty, bonus=0.0):
    return [float(d) + bonus for d in difficulty]


@pytest.mark.parametrize(("fn", "style", "accepts", "required"), [
    (_legacy, REFERENCES, None, frozenset()),
    (_completions_references, REFERENCES, None, frozenset()),
    (lambda completions, references, strict=True: [], REFERENCES, None, frozenset()),
    (_answer_only, WHOLE_ROW, frozenset({"completions", "answer"}), frozenset({"answer"})),
    (_everything, WHOLE_ROW, None, frozenset()),
    (_needs_a_column, WHOLE_ROW, frozenset({"completions", "difficulty", "bonus"}), frozenset({"difficulty"})),
    (lambda prompts, completions: [], WHOLE_ROW, frozenset({"prompts", "completions"}), frozenset()),
])
def test_own_task_calling_convention_is_told_by_the_parameters(fn, style, accepts, required):
    sig = signature_of(fn, "x")
    assert (sig.style, sig.accepts, sig.required) == (style, accepts, required)


@pytest.mark.parametrize("fn", [lambda c: [], lambda *args: [], lambda x, /, *, completions: []])
def test_own_task_unusable_signature_is_refused_naming_the_function(fn):
    with pytest.raises(RewardError, match=r"reward function 'bad' \(.*test_own_task_rewards.py:\d+\) has an "
                                          r"unusable signature"):
        signature_of(fn, "bad")


ROWS = [Example(0, "What is 2+3?", "5", "5", "What is 2+3?", {"answer": "5", "difficulty": 1}),
        Example(1, "What is 7*6?", "42", "42", [{"role": "user", "content": "What is 7*6?"}],
                {"answer": "42", "difficulty": 3})]
GROUPS = [GroupResult(0, [1, 2], [[5, 2], [6, 2]], [torch.zeros(2)] * 2, ["stop"] * 2, ["5", "4"], 0),
          GroupResult(1, [1, 3], [[5, 2], [6, 2]], [torch.zeros(2)] * 2, ["stop"] * 2, ["42", "41"], 0)]


def scoring(rewards: str, *overrides: str) -> Scoring:
    spec = load_spec_text(f"output_dir: out\ntotal_steps: 1\ndata: {{train_path: t.jsonl}}\n"
                          f"algorithm: {{rewards: {rewards}}}\n", overrides=overrides)
    return Scoring(spec.algorithm, 4, frozenset({2}))


def test_own_task_whole_row_reward_gets_prompts_completions_and_its_columns(temp_reward):
    seen = {}

    def spy(prompts, completions, difficulty):
        seen.update(prompts=prompts, completions=completions, difficulty=difficulty)
        return [float(c == "5" or c == "42") * d for c, d in zip(completions, difficulty)]

    temp_reward("own_task_spy", spy)
    batch = scoring("{own_task_spy: 1.0}").score(GROUPS, ROWS)
    assert seen["completions"] == ["5", "4", "42", "41"]
    assert seen["difficulty"] == [1, 1, 3, 3]  # one value per completion: the G completions repeat their row's
    assert seen["prompts"] == ["What is 2+3?", "What is 2+3?", ROWS[1].prompt, ROWS[1].prompt]  # as the data gave it
    assert batch.rewards.tolist() == [1.0, 0.0, 3.0, 0.0] and batch.references == ["5", "5", "42", "42"]


def test_own_task_kwargs_reward_gets_every_column_and_legacy_gets_references(temp_reward):
    seen = {}
    temp_reward("own_task_kw", lambda completions, **kw: seen.update(kw) or [0.0] * len(completions))
    temp_reward("own_task_old", lambda c, r: seen.update(old=r) or [0.0] * len(c))
    scoring("{own_task_kw: 1.0, own_task_old: 1.0}").score(GROUPS, ROWS)
    assert set(seen) == {"prompts", "answer", "difficulty", "old"} and seen["old"] == ["5", "5", "42", "42"]


def test_own_task_async_reward_runs_from_a_thread_and_inside_a_running_loop(temp_reward):
    async def slow_exact(completions, answer):
        await asyncio.sleep(0.01)
        return [float(c == a) for c, a in zip(completions, answer)]

    temp_reward("own_task_async", slow_exact)
    expected = [1.0, 0.0, 1.0, 0.0]
    out = {}
    thread = threading.Thread(target=lambda: out.update(t=scoring("{own_task_async: 1.0}").score(GROUPS, ROWS)))
    thread.start()
    thread.join()
    assert out["t"].rewards.tolist() == expected

    async def inside_a_loop():
        return scoring("{own_task_async: 1.0}").score(GROUPS, ROWS)

    assert asyncio.run(inside_a_loop()).rewards.tolist() == expected


@pytest.mark.parametrize(("returns", "match"), [
    (lambda n: [1.0] * (n - 1), r"returned 3 values, expected 4 \(one per completion; defined at .*"
                                r"test_own_task_rewards.py:\d+\)"),
    (lambda n: ["1"] * n, r"returned str at row 0, expected float or None \(defined at .*test_own_task_rewards.py"),
    (lambda n: 1.0, r"must return a sequence of 4 values, got float"),
])
def test_own_task_wrong_count_or_non_numbers_are_refused_naming_the_file(temp_reward, returns, match):
    temp_reward("own_task_bad", lambda completions: returns(len(completions)))
    with pytest.raises(RewardOutputError, match=match):
        scoring("{own_task_bad: 1.0}").score(GROUPS, ROWS)


def test_own_task_numpy_and_tensor_results_and_bools_are_numbers(temp_reward):
    temp_reward("own_task_tensor", lambda completions: torch.tensor([1.0, 0.0, 0.5, 0.0]))
    temp_reward("own_task_bools", lambda completions: [True, False, True, False])
    batch = scoring("{own_task_tensor: 1.0, own_task_bools: 1.0}").score(GROUPS, ROWS)
    assert batch.rewards.tolist() == [2.0, 0.0, 1.5, 0.0]


def test_own_task_a_raising_reward_names_its_file(temp_reward):
    def broken(completions):
        raise KeyError("grader")

    temp_reward("own_task_raises", broken)
    with pytest.raises(RewardError, match=rf"'own_task_raises' raised KeyError: 'grader' \(defined at "
                                          rf"{__file__}:\d+; algorithm.reward_on_error: none"):
        scoring("{own_task_raises: 1.0}").score(GROUPS, ROWS)


# ---- rewards named in the spec by location --------------------------------------------------------------------------
def spec_with(tmp_path: Path, rewards: str, extra: str = "") -> Path:
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "Q?", "answer": "1", "level": 2}) + "\n")
    path = tmp_path / "job.yaml"
    path.write_text(f"output_dir: {tmp_path / 'out'}\ntotal_steps: 1\ndata:\n  train_path: train.jsonl\n"
                    f"  prompt_field: prompt\nalgorithm:\n  rewards:\n{rewards}{extra}")
    return path


def test_own_task_reward_file_next_to_the_spec_is_loaded_and_called(tmp_path, monkeypatch):
    (tmp_path / "helpers.py").write_text("def double(x):\n    return 2 * x\n")
    (tmp_path / "my_reward.py").write_text(
        "from helpers import double\n\ndef by_level(completions, level):\n"
        "    return [double(l) for l in level]\n")
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.chdir(other)  # the spec's folder, not the working folder, anchors the path
    spec = load_spec(spec_with(tmp_path, '    "my_reward.py:by_level": 1.0\n'))
    assert list(spec.algorithm.rewards) == ["my_reward.py:by_level"]  # the key as written: it is the metric name
    fn = REWARD_FUNCTIONS["my_reward.py:by_level"]
    assert where_defined(fn) == f"{tmp_path / 'my_reward.py'}:3"
    result = combine_rewards(["a"], ["1"], {"my_reward.py:by_level": 1.0}, columns={"level": [2]})
    assert result.total.tolist() == [4.0]


def test_own_task_module_reward_in_the_spec_folder_is_importable(tmp_path):
    (tmp_path / "own_task_mod_rewards.py").write_text(
        "def exact(completions, answer):\n    return [float(c == a) for c, a in zip(completions, answer)]\n")
    spec = load_spec(spec_with(tmp_path, '    "own_task_mod_rewards:exact": 1.0\n'))
    assert combine_rewards(["1", "2"], ["", ""], dict(spec.algorithm.rewards),
                           columns={"answer": ["1", "1"]}).total.tolist() == [1.0, 0.0]


@pytest.mark.parametrize(("files", "key", "match"), [
    ({}, "nope.py:score", r"file .*nope.py not found \(a relative path is taken from the spec file's folder\)"),
    ({"r.py": "def score(c, r):\n    return [\n"}, "r.py:score", r"r.py:2: cannot import .*r.py: SyntaxError"),
    ({"r.py": "x = 1\nimport not_a_module_anywhere\n"}, "r.py:score",
     r"r.py:2: cannot import .*ModuleNotFoundError: No module named 'not_a_module_anywhere'"),
    ({"r.py": "def other(completions):\n    return []\n"}, "r.py:score",
     r"r.py has no function 'score' \(it defines: other\)"),
    ({"r.py": "def score(x):\n    return []\n"}, "r.py:score",
     r"'r.py:score' \(.*r.py:1\) has an unusable signature: expected fn\(prompts, completions, \*\*columns\)"),
    ({"r.py": "score = 3\n"}, "r.py:score", r"'score' is a int, not a function"),
    ({"r.txt": "def score(completions):\n    return []\n"}, "./r.txt:score",
     r"file .*r.txt is not a Python file \(no .py name\); expected a .py file defining score\(\)"),
    ({}, "no_such_reward_module_27:score", r"no module 'no_such_reward_module_27' among the installed packages, the "
                                            r"spec file's folder"),
])
def test_own_task_unusable_reward_is_refused_at_spec_load_naming_field_file_and_line(tmp_path, files, key, match):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    path = spec_with(tmp_path, f'    "{key}": 1.0\n')
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert f"{path}:7: algorithm.rewards: reward " in message and repr(key) in message  # algorithm.rewards's line
    assert re.search(match, message), message
    assert "Traceback" not in message


def test_own_task_unknown_name_says_how_to_register_one(tmp_path):
    with pytest.raises(SpecError, match=r"unknown reward 'bleu'; allowed: accuracy, .*; register one with "
                                        r"@grpo.rewards.register_reward_function\('name'\) in a module given to "
                                        r"--import, or name a function in the spec as 'module:function' or "
                                        r"'path/to/file.py:function'"):
        load_spec(spec_with(tmp_path, "    bleu: 1.0\n"))


def test_own_task_eval_reward_may_be_named_by_file(tmp_path):
    (tmp_path / "r.py").write_text("def hit(completions, answer):\n    return [1.0 for _ in completions]\n")
    evaluation = "eval:\n  data_path: train.jsonl\n  accuracy_reward: r.py:hit\n  format_reward: null\n"
    spec = load_spec(spec_with(tmp_path, "    accuracy: 1.0\n", evaluation))
    assert spec.eval.accuracy_reward == "r.py:hit" and "r.py:hit" in REWARD_FUNCTIONS


# ---- the example task --------------------------------------------------------------------------------------------
def test_own_task_example_validates(tiny_model_dir, capsys, tmp_path):
    from cluster.cli import main

    spec = REPO / "examples" / "own_task" / "spec.yaml"  # its output_dir is relative to the working folder: a tmp one
    code = main(["validate", str(spec), "--set", f"model.path={tiny_model_dir}", "--set", f"output_dir={tmp_path}"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "data:       32 prompts from" in out.out and "eval:       8 held-out prompts" in out.out
    assert f"rewards:    reward.py:correct x1 ({spec.parent / 'reward.py'}:" in out.out
    assert "valid: nothing was started or written" in out.out


def test_own_task_example_rows_reach_its_rewards_with_their_extra_columns():
    from cluster.data.sources import load_examples
    from cluster.loop.setup import reward_checks

    spec = load_spec(REPO / "examples" / "own_task" / "spec.yaml")
    examples, bad = load_examples(spec.data, "train", reward_checks(list(spec.algorithm.rewards), "algorithm.rewards"))
    assert bad == 0 and len(examples) == 32 and set(examples[0].columns) == {"answer", "difficulty"}
    ex = examples[0]  # {"prompt": "What is 8 + 5?", "answer": "13", "difficulty": 1}
    right, long_right = "8 + 5 = 13\n13", "Let me add the ones and carry " * 3 + "\n13"
    group = GroupResult(0, [1], [[1], [1], [1]], [torch.zeros(1)] * 3, ["stop"] * 3, [right, long_right, "12"], 0)
    batch = Scoring(spec.algorithm, 64, frozenset({2})).score([group], [ex])
    assert batch.per_function["reward.py:correct"].tolist() == [1.0, 1.0, 0.0]
    assert batch.per_function["reward.py:within_budget"].tolist() == [1.0, 0.0, 1.0]  # 60 chars per difficulty 1
    assert torch.allclose(batch.rewards, torch.tensor([1.2, 1.0, 0.2]))
    assert not any(math.isnan(v) for v in batch.rewards.tolist())
